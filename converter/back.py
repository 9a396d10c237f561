"""The way back: a Thinker folder written out as a source family's own Hugging Face folder
(``thinker-convert THINKER_FOLDER OUTPUT --to qwen3``), through the family's table read backwards.

Nothing here is family-specific. The family gives ``export_config`` (its config translation inverted) and its
tensor table, whose rules each know their inverse (``TensorRule.inverted``). Planning mirrors the forward engine
and reads no tensor bytes:

- the exported config must translate forward again to the very same Thinker config, else the family cannot
  express this model (a Thinker without qk-norm is not a Qwen3) and the error names the fields that differ;
- the inverted table is expanded for this config's layers and experts; a rule applies when the Thinker checkpoint
  holds its tensors, and where the forward table had alternative layouts (per-expert or fused experts) the first,
  the Hub's layout, is written;
- every Thinker tensor must be consumed exactly once, every output name produced once, and shapes come from the
  operations run on meta tensors.

The tensors are then streamed exactly as in the forward direction, in the Thinker folder's dtype unless asked
otherwise, so that a round trip source -> Thinker -> source is bit-exact.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from thinker import ThinkerConfig

from .convert import ConversionResult
from .engine import OUTPUT_DTYPES, Step, describe_names, expand_rules, finish_tensor
from .errors import ThinkerError
from .families import family_by_name
from .output import copy_tokenizer_files, refuse_existing_output, refuse_overwriting_source, staged_output
from .parity import PARITY_FILE, ParityFailed, check_parity, write_report
from .shards import ShardLayout, ShardWriter, parse_size
from .sources import TensorSource, open_source
from .spec import Family

# Runtime switches that do not change the model, left out of the round-trip comparison of configs.
RUNTIME_FIELDS = {"use_cache", "output_router_logits"}


@dataclass
class BackPlan:
    family: Family
    config: ThinkerConfig  # the Thinker folder's config
    exported_config: dict[str, Any]  # the family's config.json
    steps: list[Step]  # Thinker names in, family names out
    shapes: dict[str, tuple[int, ...]]  # family tensor -> shape, in production order
    dtype: torch.dtype


def exportable_families() -> list[str]:
    from .families import FAMILIES

    return [family.name for family in FAMILIES if family.export_config is not None]


def read_thinker_config(folder: Path) -> ThinkerConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ThinkerError(f"{folder}: no config.json; --to takes a Thinker folder written by thinker-convert")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != ThinkerConfig.model_type:
        raise ThinkerError(f"{path}: model_type is {model_type!r}, not 'thinker'; --to takes a Thinker folder")
    return ThinkerConfig.from_pretrained(folder)


def export_config(family: Family, config: ThinkerConfig) -> dict[str, Any]:
    """The family's config for this Thinker config, refused unless it translates forward to the same model."""
    if family.export_config is None:
        raise ThinkerError(
            f"a Thinker folder cannot be written back as {family.name}; --to accepts {', '.join(exportable_families())}"
        )
    exported = family.export_config(config)
    again = ThinkerConfig(**family.translate_config(exported)).to_dict()
    original = config.to_dict()
    fields = [name for name in ThinkerConfig.__annotations__ if name not in RUNTIME_FIELDS]
    differ = [
        f"{name} ({original.get(name)!r} -> {again.get(name)!r})"
        for name in fields
        if original.get(name) != again.get(name)
    ]
    if differ:
        raise ThinkerError(
            f"this Thinker model is not expressible as {family.name}: the {family.name} config would change "
            f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}"
        )
    return exported


def plan_back(source: TensorSource, config: ThinkerConfig, family: Family, dtype: str = "auto") -> BackPlan:
    exported = export_config(family, config)
    names = set(source.names())
    groups: dict[tuple[str, ...], list[Step]] = {}
    for step in expand_rules(family.inverted_tensors(), config.num_hidden_layers, config.num_experts):
        present = [name in names for name in step.sources]
        if any(present) and not all(present):
            absent = [n for n, ok in zip(step.sources, present, strict=True) if not ok]
            raise ThinkerError(f"the Thinker checkpoint lacks {describe_names(absent)}, which {family.name} needs")
        if all(present):
            groups.setdefault(step.sources, []).append(step)
    steps = [options[0] for options in groups.values()]  # the first layout the forward table lists

    consumed = Counter(name for step in steps for name in step.sources)
    unused = sorted(names - set(consumed))
    if unused:
        raise ThinkerError(
            f"the Thinker checkpoint holds {describe_names(unused)}, which a {family.name} model has no place for"
        )
    produced = Counter(target for step in steps for target in step.targets)
    twice = [name for name, count in produced.items() if count > 1] + [n for n, c in consumed.items() if c > 1]
    if twice:
        raise ThinkerError(f"the inverted {family.name} table uses or produces {describe_names(twice)} twice")

    shapes: dict[str, tuple[int, ...]] = {}
    for step in steps:
        inputs = [torch.empty(source.shape(name), device="meta") for name in step.sources]
        try:
            outputs = step.op(inputs, config)
        except (RuntimeError, ValueError) as err:
            raise ThinkerError(f"cannot write {', '.join(step.targets)} back: {err}") from None
        shapes |= {target: tuple(output.shape) for target, output in zip(step.targets, outputs, strict=True)}

    output_dtype = _output_dtype(dtype, config, source)
    exported["dtype"] = str(output_dtype).removeprefix("torch.")
    return BackPlan(family, config, exported, steps, shapes, output_dtype)


def _output_dtype(requested: str, config: ThinkerConfig, source: TensorSource) -> torch.dtype:
    """``auto``: the Thinker config's dtype (what the forward conversion wrote), else its tensors' dtype."""
    if requested != "auto":
        if requested not in OUTPUT_DTYPES:
            raise ThinkerError(f"--dtype {requested!r} is not one of auto, {', '.join(OUTPUT_DTYPES)}")
        return OUTPUT_DTYPES[requested]
    declared = config.dtype
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str) and declared in OUTPUT_DTYPES:
        return OUTPUT_DTYPES[declared]
    return Counter(source.dtype(name) for name in source.names()).most_common(1)[0][0]


def convert_back(
    source: str | Path,
    output: str | Path,
    family_name: str,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    verify: bool | None = None,
    force: bool = False,
) -> ConversionResult:
    """Write the Thinker folder ``source`` out as a ``family_name`` folder at ``output``, atomically.

    ``verify`` (default on) checks the written folder, loaded with its own transformers class, against the Thinker.
    """
    started = time.perf_counter()
    source, output = Path(source), Path(output)
    family = family_by_name(family_name)
    refuse_existing_output(output, force)
    config = read_thinker_config(source)
    tensor_source = open_source(source)
    try:
        plan = plan_back(tensor_source, config, family, dtype)
        refuse_overwriting_source(output, source)
        report = None
        needed = sum(_numel(shape) for shape in plan.shapes.values()) * plan.dtype.itemsize
        with staged_output(output, force, needed=needed) as staging:
            layout = ShardLayout([(n, s, plan.dtype) for n, s in plan.shapes.items()], parse_size(max_shard_size))
            with ShardWriter(staging, layout) as writer:
                for step in plan.steps:
                    tensors = step.op([tensor_source.load(name) for name in step.sources], plan.config)
                    for target, tensor in zip(step.targets, tensors, strict=True):
                        writer.write(target, finish_tensor(tensor, target, step.sources, plan.dtype))
                files = writer.close()
            (staging / "config.json").write_text(json.dumps(plan.exported_config, indent=2, sort_keys=True) + "\n")
            files.append("config.json")
            if (source / "generation_config.json").is_file():
                (staging / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
                files.append("generation_config.json")
            files += copy_tokenizer_files(source, staging)
            if verify is None or verify:
                report = check_parity(staging, source)
                write_report(report, staging / PARITY_FILE)
                if not report.passed:
                    raise ParityFailed(f"{output}: does not match the Thinker folder; nothing written", report)
    finally:
        tensor_source.close()
    return ConversionResult(
        output=output,
        family=family.name,
        dtype=str(plan.dtype).removeprefix("torch."),
        files=files,
        total_bytes=sum(_numel(shape) for shape in plan.shapes.values()) * plan.dtype.itemsize,
        seconds=time.perf_counter() - started,
        parity=report,
    )


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
