"""One conversion from start to finish: resolve SOURCE, plan and check, stream the weights, write the folder around
them, verify, and install OUTPUT atomically. The command line (``converter/cli.py``) is a thin layer over
``convert`` and ``verify``; the way back (``--to``) is ``converter/back.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ThinkerError
from common.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from common.sources import open_source
from common.staging import refuse_existing_output, refuse_output_over_source, staged_output

from .engine import plan_conversion, write_weights
from .families import detect_family
from .hub import resolve_source
from .output import write_generation_config, write_thinker_config
from .parity import ParityReport, parity_gate, verify_fits_memory
from .spec import Family


@dataclass
class ConversionResult:
    output: Path
    family: str
    dtype: str
    files: list[str]
    total_bytes: int
    seconds: float
    parity: ParityReport | None = None
    notes: list[str] = field(default_factory=list)  # e.g. why verification was skipped


def source_family(root: Path) -> Family:
    """The family of the checkpoint at ``root``, from its config and tensor names (headers only)."""
    tensor_source = open_source(root)
    try:
        return detect_family(tensor_source.config(), set(tensor_source.names()))
    finally:
        tensor_source.close()


def convert(
    source: str | Path,
    output: str | Path,
    *,
    revision: str | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    verify: bool | None = None,
    force: bool = False,
    progress: bool = True,
    **hub_options: Any,
) -> ConversionResult:
    """Convert ``source`` (a folder, a weights file, or a Hub repo id) into a Thinker folder at ``output``.

    ``verify=None`` verifies when the two models fit the memory budget (see ``parity.verify_fits_memory``).
    ``hub_options`` (``token``, ``cache_dir`` ...) go to ``hub.resolve_source``.
    Raises ``ThinkerError`` (``ParityFailed`` when verification fails; nothing is installed then).
    """
    started = time.perf_counter()
    output = Path(output)
    shard_bytes = parse_size(max_shard_size)
    refuse_existing_output(output, force, "once the new conversion is complete")  # before any download
    root = resolve_source(str(source), revision, progress=progress, **hub_options)
    refuse_output_over_source(output, root)
    tensor_source = open_source(root)
    try:
        plan = plan_conversion(tensor_source, tensor_source.config(), dtype)
        notes = []
        if plan.family.no_reference:
            if verify:  # asked for explicitly: refuse before writing anything
                family = plan.family
                raise ThinkerError(f"--verify: cannot verify a {family.name} conversion: {family.no_reference}")
            if verify is None:
                notes.append(f"verification skipped: {plan.family.no_reference}")
            verify = False
        if verify is None:
            verify, note = verify_fits_memory(plan.num_parameters)
            notes += [note] if note else []
        report = None
        with staged_output(output, force, needed=plan.total_bytes) as staging:
            files = write_weights(plan, tensor_source, staging, shard_bytes, progress)
            write_thinker_config(staging, plan.config)
            write_generation_config(staging, Path(tensor_source.root), plan.config)
            files += tensor_source.save_tokenizer(staging)
            if verify:
                failure = f"{output}: does not match its reference; nothing written"
                report = parity_gate(root, staging, plan.family, staging, failure)
    finally:
        tensor_source.close()
    return ConversionResult(
        output=output,
        family=plan.family.name,
        dtype=str(plan.dtype).removeprefix("torch."),
        files=files,
        total_bytes=plan.total_bytes,
        seconds=time.perf_counter() - started,
        parity=report,
        notes=notes,
    )


def verify(source: str | Path, converted: str | Path, *, revision: str | None = None) -> ParityReport:
    """``thinker verify``: compare an existing Thinker folder with its source; writes ``parity.json`` into it."""
    converted = Path(converted)
    if not (converted / "config.json").is_file():
        raise ThinkerError(f"{converted}: not a converted model folder (no config.json)")
    root = resolve_source(str(source), revision)
    refuse_output_over_source(converted, root, writes_into=True)  # parity.json goes into CONVERTED
    failure = f"{converted} does not match its reference {source}"
    return parity_gate(root, converted, source_family(root), converted, failure)
