"""One conversion from start to finish: resolve SOURCE, plan and check, stream the weights, write the folder around
them, verify, and install OUTPUT atomically. The command line (``converter/cli.py``) is a thin layer over
``convert`` and ``verify``; the way back (``--to``) is ``converter/back.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from thinker import ThinkerConfig
from thinker_common.card_format import CARD_FILE, card_after_verify, card_text, read_record
from thinker_common.dtypes import dtype_name
from thinker_common.errors import ThinkerError
from thinker_common.fp8_source import DequantizedFP8Source
from thinker_common.gguf_reader import GGUFSource, gguf_read_once
from thinker_common.side_files import (
    VOCABULARY_FILES,
    has_vocabulary,
    read_json,
    readable_tokenizer_files,
    tokenizer_files,
)
from thinker_common.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from thinker_common.sources import TensorSource, open_source
from thinker_common.staging import (
    not_an_earlier_output,
    outside_staging,
    refuse_existing_output,
    refuse_output_over_source,
    staged_output,
    write_atomically,
)

from .config_compare import saved_config_differences
from .engine import left_out, plan_conversion, write_weights
from .families import detect_family
from .folder_weights import check_thinker_weights, refuse_weightless
from .hub import local_checkpoint, normal_subfolder, refuse_empty_source, resolve_source
from .model_card import gguf_card_metadata, left_out_parts, tool_version, update_parity, write_thinker_card
from .output import (
    generation_config_for,
    generation_differences,
    tokens_past_vocabulary_note,
    write_thinker_config,
)
from .output_dtype import resolve_dtype
from .parity import parity_gate, parity_mode, refuse_bad_memory_setting
from .parity_report import BY_LAYER, FAILED_PARITY_FILE, PARITY_FILE, NoReference, ParityReport
from .spec import Family
from .weights_check import weights_verdict

# The Thinker's modeling code a converted folder ships beside its weights (converter/output.py).
SHIPPED_CODE = ("modeling_thinker.py", "configuration_thinker.py")


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
    kept: dict[str, str] = field(default_factory=dict)  # tensor -> the wider dtype --dtype auto kept it in
    tensors: int = 0  # how many the folder holds

    def weights(self) -> str:
        """``12.3 MiB of bfloat16 weights (72 tensors kept in float32, as the source stores them)``; where every
        tensor is kept (float32 weights under a config declaring bfloat16), ``0.1 MiB of float32 weights, as the
        source stores them (config.json's dtype: bfloat16, as the source's)``."""
        kept = Counter(self.kept.values())
        size = f"{self.total_bytes / 2**20:.1f} MiB"
        if len(kept) == 1 and len(self.kept) == self.tensors:
            declared = f"config.json's dtype: {self.dtype}, as the source's"
            return f"{size} of {next(iter(kept))} weights, as the source stores them ({declared})"
        note = ", ".join(f"{count} tensor{'s' * (count > 1)} kept in {dtype}" for dtype, count in sorted(kept.items()))
        return f"{size} of {self.dtype} weights" + (f" ({note}, as the source stores them)" if note else "")


def source_family(root: Path) -> Family:
    """The family of the checkpoint at ``root``, from its config and tensor names (headers only)."""
    tensor_source = open_source(root)
    try:
        return detect_family(tensor_source.config(), set(tensor_source.names()))
    finally:
        tensor_source.close()


def refuse_contrary_checks(verify: bool | None, verify_by_layer: bool) -> None:
    """``--no-verify`` with ``--verify-by-layer``: one turns the check off, the other asks for it by layer."""
    if verify is False and verify_by_layer:
        raise ThinkerError("--verify-by-layer asks for the check that --no-verify turns off; pass one of them")


@gguf_read_once()  # a GGUF file's header parsed once, not once for each of transformers' readings of it
def convert(
    source: str | Path,
    output: str | Path,
    *,
    revision: str | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    verify: bool | None = None,
    verify_by_layer: bool = False,
    force: bool = False,
    progress: bool = True,
    memory_budget: int | None = None,
    check_config: Callable[[ThinkerConfig, Path], None] | None = None,
    card_top: Path | None = None,
    **hub_options: Any,
) -> ConversionResult:
    """Convert ``source`` (a folder, a weights file, or a Hub repo id) into a Thinker folder at ``output``.

    Every conversion is verified against its reference before it is installed, unless ``verify=False``: the whole
    models side by side when both fit ``memory_budget`` (bytes; default ``parity.memory_budget()``), else layer by
    layer; ``verify_by_layer`` asks for layer by layer whatever the size. A family without a transformers reference
    is not verified (a note says why), or refused when ``verify=True`` asks for it.
    ``check_config(config, where)``, a caller's check of the translated config (``where``: the source's config
    file), runs before anything is written. ``card_top``: the folder whose card and license cover ``source`` where
    it is a part of one (``thinker export --subfolder`` converting the part it resolved; by default the folder
    ``source`` names). ``hub_options`` (``token``, ``cache_dir`` ...) go to
    ``hub.resolve_source``. Raises ``ThinkerError`` (``ParityFailed`` when verification fails; nothing is installed
    then).
    """
    started = time.perf_counter()
    refuse_empty_source(source)  # before OUTPUT is checked against it
    refuse_contrary_checks(verify, verify_by_layer)
    if verify is not False:
        refuse_bad_memory_setting()
    output = Path(output)
    shard_bytes = parse_size(max_shard_size)
    # before any download; a local SOURCE first (a GGUF picked in a folder is checked once it is resolved)
    local = None if hub_options.get("gguf_file") else local_checkpoint(source, hub_options.get("subfolder"))
    refuse_existing_output(output, force, "once the new conversion is complete", local)
    root = resolve_source(str(source), revision, progress=progress, **hub_options)
    refuse_output_over_source(output, root)
    tensor_source = open_source(root)
    try:
        plan = plan_conversion(tensor_source, tensor_source.config(), dtype)
        if Path(root).is_dir():  # its tokenizer goes into OUTPUT as it is: a file cut short is refused before any work
            readable_tokenizer_files(Path(root))
        if check_config is not None:
            check_config(plan.config, root / "config.json" if Path(root).is_dir() else Path(root))
        notes = []
        if left := left_out(plan):
            beside = "the source's parts beside its text decoder, README.md says more"
            notes.append(f"left out ({beside}): {left_out_parts(left)}")
        generation = generation_config_for(Path(tensor_source.root), plan.config)
        if past_vocabulary := tokens_past_vocabulary_note(generation, plan.config):
            notes.append(past_vocabulary)
        no_reference = plan.family.no_reference
        if isinstance(tensor_source, DequantizedFP8Source):
            notes.append(tensor_source.summary(dtype_name(plan.dtype)))
            no_reference = no_reference or tensor_source.no_reference()
        if no_reference:
            if verify or verify_by_layer:  # asked for explicitly: refuse before writing anything
                flag = "--verify-by-layer" if verify_by_layer else "--verify"
                raise ThinkerError(f"{flag}: cannot verify a {plan.family.name} conversion: {no_reference}")
            if verify is None:
                notes.append(f"verification skipped: {no_reference}")
            verify = False
        verify = verify is not False
        mode, note = BY_LAYER, ""
        if verify and not verify_by_layer:
            beside = max(0, tensor_parameters(tensor_source) - plan.num_parameters)  # towers the reference builds
            mode, note = parity_mode(plan.num_parameters, plan.config, memory_budget, beside)
        report = None
        with staged_output(output, force, needed=plan.total_bytes) as staging:
            files = write_weights(plan, tensor_source, staging, shard_bytes, progress)
            write_thinker_config(staging, plan.config)
            generation.save_pretrained(staging)  # the source's generation config, read above for its note
            tokenizer = tensor_source.save_tokenizer(staging)
            files += tokenizer
            if not has_vocabulary(tokenizer) and not isinstance(tensor_source, GGUFSource):  # GGUF's says why
                notes.append(
                    f"the source has no tokenizer (no {', '.join(VOCABULARY_FILES)}), so neither has {output.name}: "
                    "it takes token ids; copy the model's tokenizer files into it for text"
                )
            if verify:
                # named by SOURCE where OUTPUT is an export's staging folder (converted on the way), gone when read
                named = output if outside_staging(output) == output else source
                failure = f"{named}: does not match its reference; nothing written"
                report = parity_gate(root, staging, plan.family, staging / PARITY_FILE, failure, mode, note)
            skipped = no_reference or "converted with --no-verify"
            files += write_thinker_card(
                staging,
                str(source),
                Path(root),
                plan.family.name,
                dtype_name(plan.dtype),
                report,
                skipped,
                output.name,
                beyond_genai=plan.config.qwen4_exp_features,
                recorded=gguf_card_metadata(tensor_source.metadata) if isinstance(tensor_source, GGUFSource) else {},
                left=left,
                deepstack=bool(plan.config.deepstack_layers),
                tokenizer=has_vocabulary(tokenizer),
                top=card_top,
            )
    finally:
        tensor_source.close()
    return ConversionResult(
        output=output,
        family=plan.family.name,
        dtype=dtype_name(plan.dtype),
        files=files,
        total_bytes=plan.total_bytes,
        seconds=time.perf_counter() - started,
        parity=report,
        notes=notes,
        kept={name: dtype_name(dtype) for name, dtype in plan.kept.items()},
        tensors=len(plan.shapes),
    )


@gguf_read_once()
def verify(
    source: str | Path,
    converted: str | Path,
    *,
    revision: str | None = None,
    subfolder: str | None = None,
    gguf_file: str | None = None,
    by_layer: bool = False,
    memory_budget: int | None = None,
    report_path: str | Path | None = None,
) -> ParityReport:
    """``thinker verify``: compare an existing Thinker folder with its source; writes ``parity.json`` into it, or
    with ``report_path`` the report (passing or failing) there alone, leaving CONVERTED as it was (a read-only copy,
    a shared cache).

    Whole models side by side when both fit ``memory_budget``, else (or with ``by_layer``) layer by layer.
    ``revision``, ``subfolder`` and ``gguf_file`` locate SOURCE as they do for ``convert``."""
    try:
        located = {"revision": revision, "subfolder": subfolder, "gguf_file": gguf_file}
        return _verify(source, converted, located, by_layer, memory_budget, report_path)
    except NoReference as err:
        # the conversion's advice where transformers gives no reference is for a conversion; here the folder exists
        # (made with --no-verify, as that advice said), and there is nothing to check it against
        raise err.instead(f"leave {converted} unverified") from None


def _verify(
    source: str | Path,
    converted: str | Path,
    located: dict[str, str | None],
    by_layer: bool,
    memory_budget: int | None,
    report_path: str | Path | None,
) -> ParityReport:
    converted = Path(converted)
    refuse_bad_memory_setting()
    if not (converted / "config.json").is_file():
        raise ThinkerError(f"{converted}: not a converted model folder (no config.json)")
    revision = located["revision"]
    root = resolve_source(str(source), revision, subfolder=located["subfolder"], gguf_file=located["gguf_file"])
    report_path = None if report_path is None else Path(report_path)
    if report_path is None:
        refuse_output_over_source(converted, root, writes_into=True)  # parity.json goes into CONVERTED
    refuse_unwritable_report(converted, report_path, Path(root))
    if (read_json(Path(root) / "config.json") or {}).get("model_type") == ThinkerConfig.model_type:
        raise ThinkerError(
            f"{source}: SOURCE is a Thinker folder, which has no reference to verify against; the order is "
            "`thinker verify SOURCE CONVERTED` (the checkpoint converted from, then the Thinker folder)"
        )
    model_type = (read_json(converted / "config.json") or {}).get("model_type")
    if model_type != ThinkerConfig.model_type:
        raise ThinkerError(
            f"{converted}: a {model_type or 'model_type-less'} checkpoint, not a Thinker folder; CONVERTED is what "
            "thinker-convert wrote (`thinker verify SOURCE CONVERTED`)"
        )
    if (converted / "model.onnx").is_file() and not any(converted.glob("*.safetensors")):
        raise ThinkerError(
            f"{converted}: an ONNX export, not a Thinker folder; thinker verify checks what thinker-convert wrote, "
            "and an export is checked as it is written (thinker export's --verify, the default): export it again "
            "to check it"
        )
    refuse_weightless(converted)
    tensor_source = open_source(root)
    try:
        hub = not Path(str(source)).expanduser().exists()  # a Hub repo id: the revision is part of what it names
        named = f"{source}@{revision or 'main'}" if hub else str(source)
        if folder := normal_subfolder(located["subfolder"]):  # and the folder, a checkpoint of its own
            named += f" (its folder {folder})"
        if isinstance(tensor_source, DequantizedFP8Source) and (why := tensor_source.no_reference()):
            raise ThinkerError(f"{source}: {why}")
        config = refuse_another_config(tensor_source, converted, named)
        refuse_other_generation_config(Path(tensor_source.root), converted, config, named)
    finally:
        tensor_source.close()
    check_thinker_weights(converted, config)
    refuse_other_code(converted)
    tensor_source = open_source(root)
    try:  # every weight bit for bit: an edit too small for the parity tolerance is named by tensor and row
        refuse_other_tokenizer(tensor_source, converted)
        stored_dtype = refuse_other_dtype(converted, config, tensor_source)
        weights = weights_verdict(tensor_source, converted, stored_dtype, named)
        parameters = folder_parameters(converted)
        beside = max(0, tensor_parameters(tensor_source) - parameters)  # towers the reference builds
    finally:
        tensor_source.close()
    mode, note = (BY_LAYER, "") if by_layer else parity_mode(parameters, config, memory_budget, beside)
    if report_path is not None:
        failure = f"{converted} does not match its reference {source}; the report is in {report_path}"
        return parity_gate(root, converted, source_family(root), report_path, failure, mode, note, weights=weights)
    # A failing report goes beside parity.json, not over it: a mistaken SOURCE (another revision, another model)
    # must not erase the record of the conversion that CONVERTED came from.
    failure = f"{converted} does not match its reference {source}; the report is in {FAILED_PARITY_FILE}"
    if (converted / PARITY_FILE).is_file():
        failure += f", and {PARITY_FILE} is kept as it was"
    # The reports written here are thinker's own: a folder unchanged since it was written stays so for --force
    # (card_format), one a user changed (a fine-tune saved into it), before or while this runs, stays changed.
    real = Path(os.path.realpath(converted))  # CONVERTED given as a link is the folder it leads to
    before = read_record(real) if not_an_earlier_output(real) is None else None
    card_before = card_text(real)
    try:
        report = parity_gate(
            root,
            converted,
            source_family(root),
            converted / PARITY_FILE,
            failure,
            mode,
            note,
            failed_path=converted / FAILED_PARITY_FILE,
            weights=weights,
        )
        update_parity(converted, report)
        with contextlib.suppress(FileNotFoundError):  # a failing report from before, now answered
            (converted / FAILED_PARITY_FILE).unlink()
    finally:
        if before is not None:
            card = card_after_verify(real, before, card_before)
            with contextlib.suppress(ThinkerError):  # unrecorded (a full disk), the reports count as a change: safe
                if card is not None:
                    write_atomically(real / CARD_FILE, card)
    return report


def refuse_unwritable_report(converted: Path, report_path: Path | None, source: Path) -> None:
    """Refuse, before minutes of checking, a report that could not be written at the end: into CONVERTED on a
    read-only mount or in a shared cache, or to a ``--report`` path that exists or lies in no writable folder; and
    a ``--report`` inside SOURCE or CONVERTED, which it leaves as they are (a report named chat_template.jinja in a
    source folder became the template the next conversion copied)."""
    if report_path is None:
        if not os.access(converted, os.W_OK):
            raise ThinkerError(
                f"{converted}: not writable, and thinker verify writes its report ({PARITY_FILE}) there; give "
                "--report PATH to write it elsewhere and leave the folder as it is"
            )
        for name in (PARITY_FILE, FAILED_PARITY_FILE):  # written by a rename at the end, which a folder refuses
            if (converted / name).is_dir() and not (converted / name).is_symlink():
                raise ThinkerError(
                    f"{converted / name}: a folder, where thinker verify writes its report; move it out of the "
                    "way, or give --report PATH to write the report elsewhere"
                )
        return
    if report_path.exists() or report_path.is_symlink():
        raise ThinkerError(f"--report {report_path}: exists, and a report is never written over; name a new file")
    refuse_output_over_source(report_path, source, role="--report")
    inside = Path(os.path.realpath(report_path.parent))
    if inside == Path(os.path.realpath(converted)) or Path(os.path.realpath(converted)) in inside.parents:
        raise ThinkerError(
            f"--report {report_path}: inside CONVERTED {converted}, which --report leaves as it is; name a file "
            "outside it (or leave --report out to write parity.json into it)"
        )
    folder = report_path.parent
    if not folder.is_dir():
        raise ThinkerError(f"--report {report_path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK):
        raise ThinkerError(f"--report {report_path}: {folder} is not writable")


def refuse_other_code(converted: Path) -> None:
    """The modeling code CONVERTED ships (what ``trust_remote_code=True`` runs) must be the installed Thinker's, which
    the check runs: otherwise a pass would prove nothing about the code the folder is loaded with."""
    import thinker

    installed = Path(thinker.__file__).parent
    for name in SHIPPED_CODE:
        shipped = converted / name
        if not shipped.is_file():  # where thinker is not installed the folder does not load (a QA run's pass)
            raise ThinkerError(
                f"{converted}: lacks {name}, which trust_remote_code=True loads where thinker is not installed; "
                "convert the source again (or copy the installed Thinker's file in)"
            )
        if shipped.read_bytes() != (installed / name).read_bytes():
            raise ThinkerError(
                f"{shipped}: not the installed Thinker's {name} (thinker {tool_version()}), which the check runs, so "
                "it would prove nothing about the code trust_remote_code=True loads from the folder; convert the "
                "source again with this Thinker (or copy its file in)"
            )


def refuse_other_tokenizer(tensor_source: TensorSource, converted: Path) -> None:
    """CONVERTED's tokenizer files must be the ones the conversion writes from ``tensor_source``: a folder's copied,
    a GGUF's rebuilt from its metadata by transformers (byte for byte the same on each run). The parity check feeds
    token ids, never text, so a tokenizer edited or taken from another model would pass it and encode other ids;
    a file the source does not give (a chat template added beside its tokenizer) is refused too, unless the source
    gives no tokenizer at all (then the folder's is its owner's, as with any weights-only checkpoint)."""
    with tempfile.TemporaryDirectory(prefix="thinker-tokenizer-") as scratch:
        written = Path(scratch)
        expected = tensor_source.save_tokenizer(written)
        for name in expected:
            ours = converted / name
            if not ours.is_file():
                raise ThinkerError(
                    f"{converted}: lacks {name}, which its source gives; convert it again (or copy it in)"
                )
            if ours.read_bytes() != (written / name).read_bytes():
                raise ThinkerError(
                    f"{ours}: not the source's {name}; the parity check runs token ids, so it cannot vouch for another "
                    "tokenizer: convert the source again (or copy its file in)"
                )
    extra = sorted(set(tokenizer_files(converted)) - set(expected)) if expected else []
    if extra:
        raise ThinkerError(
            f"{converted / extra[0]}: a tokenizer file its source does not give; the parity check runs token ids, so "
            "it cannot vouch for it: remove it, or convert the source again"
        )


def refuse_other_generation_config(root: Path, converted: Path, config: ThinkerConfig, source: str) -> None:
    """CONVERTED's generation_config.json must be what the conversion wrote from ``source``: its stop tokens and
    sampling defaults are what ``generate()`` runs with, which the parity check (logits of fixed prompts) never
    reads, so an edited eos id would pass it and generate past the end."""
    from transformers import GenerationConfig

    path = converted / "generation_config.json"
    if not path.is_file():
        raise ThinkerError(f"{converted}: lacks generation_config.json, which the conversion writes; convert it again")
    try:
        actual = GenerationConfig.from_pretrained(converted)
    except (OSError, ValueError) as err:
        raise ThinkerError(f"{path}: unreadable ({err})") from None
    differ = generation_differences(generation_config_for(root, config), actual)
    if differ:
        raise ThinkerError(
            f"{path} is not the generation config {source} gives: {', '.join(differ[:6])}"
            f"{' ...' if len(differ) > 6 else ''} (the source's value first); convert the source again, or copy "
            "its generation_config.json in"
        )


def refuse_another_config(tensor_source: TensorSource, converted: Path, source: str = "its source") -> ThinkerConfig:
    """CONVERTED's config.json, which must be the Thinker config its ``source`` (named so in the error; a Hub repo
    with its revision, which may be the one that differs) translates to: a field the fixed parity prompts cannot
    reach (max_position_embeddings, RoPE scaling past their length) is still the model's."""
    with tempfile.TemporaryDirectory(prefix="thinker-config-") as scratch:  # as a conversion writes it, auto_map too
        write_thinker_config(Path(scratch), plan_conversion(tensor_source, tensor_source.config()).config)
        expected = ThinkerConfig.from_pretrained(scratch)
    try:
        actual = ThinkerConfig.from_pretrained(converted)
    except Exception as err:  # transformers raises many types for a config it cannot read; all are the file's
        raise ThinkerError(f"{converted / 'config.json'}: not a Thinker config ({err})") from None
    differ = saved_config_differences(expected, actual)
    if differ:
        raise ThinkerError(
            f"{converted / 'config.json'} is not the config {source} translates to: {', '.join(differ[:6])}"
            f"{' ...' if len(differ) > 6 else ''} (the source's value first); convert the source again, or check "
            "that SOURCE (and --revision, --subfolder) name the checkpoint it was converted from"
        )
    return actual


def refuse_other_dtype(converted: Path, config: ThinkerConfig, source: TensorSource) -> torch.dtype:
    """CONVERTED's config.json must name the dtype its weights are stored in (the one holding most of their bytes),
    or the one an ``auto`` conversion of ``source`` writes: that keeps every tensor the source stores wider as it is
    (``kept_wider``), which may be all of them (float32 weights under a config declaring bfloat16, as DeepSpeed's
    zero_to_fp32 leaves them). ``from_pretrained(dtype="auto")`` loads the folder in the dtype the config names,
    which the parity check, loading each dtype it compares explicitly, never reads; ``weights_verdict`` then holds
    every tensor to the dtype and bytes the conversion writes."""
    weights = open_source(converted)
    try:
        stored = resolve_dtype("auto", None, weights)
    finally:
        weights.close()
    declared = config.dtype if config.dtype is None or isinstance(config.dtype, str) else dtype_name(config.dtype)
    if declared is None or declared == dtype_name(stored):  # none: "auto" reads the weights themselves
        return stored
    auto = plan_conversion(source, source.config(), "auto").dtype
    if declared != dtype_name(auto):
        raise ThinkerError(
            f"{converted / 'config.json'}: dtype {declared!r}, but the folder's weights are stored in "
            f"{dtype_name(stored)}, which from_pretrained(dtype='auto') would not load them as; set dtype to "
            f"{dtype_name(stored)!r} (or convert the source again)"
        )
    return auto


def folder_parameters(folder: Path) -> int:
    """How many parameters a model folder's weights hold, from the tensor headers."""
    tensor_source = open_source(folder)
    try:
        return tensor_parameters(tensor_source)
    finally:
        tensor_source.close()


def tensor_parameters(tensor_source: TensorSource) -> int:
    """How many values a source's tensors hold, from their headers."""
    return sum(math.prod(tensor_source.shape(name)) for name in tensor_source.names())
