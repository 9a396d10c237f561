"""One conversion from start to finish: resolve SOURCE, plan and check, stream the weights, write the folder around
them, verify, and install OUTPUT atomically. The command line (``converter/cli.py``) is a thin layer over
``convert`` and ``verify``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .engine import Plan, plan_conversion, stream_tensors
from .errors import ThinkerError
from .families import detect_family
from .gguf_source import GGUFSource, gguf_to_hf_config
from .hub import resolve_source
from .output import (
    copy_tokenizer_files,
    refuse_existing_output,
    refuse_overwriting_source,
    save_gguf_tokenizer,
    staged_output,
    write_generation_config,
    write_thinker_config,
)
from .parity import PARITY_FILE, ParityFailed, ParityReport, check_parity, verify_fits_memory, write_report
from .shards import ShardLayout, ShardWriter, parse_size
from .sources import TensorSource, open_source
from .spec import Family

DEFAULT_MAX_SHARD_SIZE = "5GB"


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


def read_source_config(source: TensorSource) -> dict[str, Any]:
    """The source's Hugging Face config: ``config.json`` beside the weights, or rebuilt from GGUF metadata."""
    if isinstance(source, GGUFSource):
        return gguf_to_hf_config(source.metadata, source.names())
    path = Path(source.root) / "config.json"
    if not path.is_file():
        raise ThinkerError(f"{source.root}: no config.json beside the weights; it says which model they belong to")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ThinkerError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ThinkerError(f"{path}: expected a JSON object")
    return config


def source_family(root: Path) -> Family:
    """The family of the checkpoint at ``root``, from its config and tensor names (headers only)."""
    tensor_source = open_source(root)
    try:
        return detect_family(read_source_config(tensor_source), set(tensor_source.names()))
    finally:
        tensor_source.close()


def write_weights(plan: Plan, source: TensorSource, folder: Path, max_shard_size: int, progress: bool) -> list[str]:
    """Stream the plan's tensors into safetensors shards in ``folder``; returns the files written.

    One background thread writes while the main thread reads and checks the next tensor (file I/O and torch both
    release the GIL). At most two steps' tensors are alive: the one being written and the one being produced.
    """
    layout = ShardLayout([(name, shape, plan.dtype) for name, shape in plan.shapes.items()], max_shard_size)
    with (
        ShardWriter(folder, layout) as writer,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as background,
        tqdm(
            total=layout.total_size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="converting",
            disable=not progress,
        ) as bar,
    ):
        writing = None
        for name, tensor in stream_tensors(plan, source):
            if writing is not None:
                bar.update(writing.result())  # the previous write must end before this tensor is handed over
            writing = background.submit(writer.write, name, tensor)
            del tensor
        if writing is not None:
            bar.update(writing.result())
        return writer.close()


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
) -> ConversionResult:
    """Convert ``source`` (a folder, a weights file, or a Hub repo id) into a Thinker folder at ``output``.

    ``verify=None`` verifies when the two models fit the memory budget (see ``parity.verify_fits_memory``).
    Raises ``ThinkerError`` (``ParityFailed`` when verification fails; nothing is installed then).
    """
    started = time.perf_counter()
    output = Path(output)
    shard_bytes = parse_size(max_shard_size)
    refuse_existing_output(output, force)  # before any download
    root = resolve_source(str(source), revision, progress=progress)
    tensor_source = open_source(root)
    try:
        plan = plan_conversion(tensor_source, read_source_config(tensor_source), dtype)
        refuse_overwriting_source(output, Path(tensor_source.root))
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
            if isinstance(tensor_source, GGUFSource):
                files += save_gguf_tokenizer(tensor_source.path, staging)
            else:
                files += copy_tokenizer_files(Path(tensor_source.root), staging)
            if verify:
                report = check_parity(root, staging, plan.family)
                write_report(report, staging / PARITY_FILE)
                if not report.passed:
                    raise ParityFailed(f"{output}: does not match its reference; nothing written", report)
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
    report = check_parity(root, converted, source_family(root))
    write_report(report, converted / PARITY_FILE)
    if not report.passed:
        raise ParityFailed(f"{converted} does not match its reference {source}", report)
    return report
