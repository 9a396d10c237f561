"""The way back: a Thinker folder written out as a source family's own Hugging Face folder
(``thinker-convert THINKER_FOLDER OUTPUT --to qwen3``): the engine run over the family's table read backwards.

Nothing here is family-specific, and nothing repeats the engine. The family gives ``export_config`` (its config
translation inverted) and its tensor table, whose rules each know their inverse (``Family.inverted_tensors``).
What differs from the forward direction is only how the rules are chosen:

- the exported config must translate forward again to the very same Thinker config, else the family cannot
  express this model (a Thinker without qk-norm is not a Qwen3) and the error names the fields that differ;
- the inverted table is expanded for this config's layers and experts; a rule applies when the Thinker checkpoint
  holds its tensors, and where the forward table had alternative layouts (per-expert or fused experts) the first,
  the Hub's layout, is written;
- every Thinker tensor must be consumed exactly once and every output name produced once;
- tensors the family's class saves that the Thinker derives from its config (``Family.derived_back``: Qwen4-Exp's
  hash buffers; a shared expert 0 wide, ``empty_shared_expert``) are written from the config.

The result is an ``engine.Plan`` like a forward one: the engine checks its shapes on meta tensors, streams it with
its background writer and value checks, in the Thinker folder's dtype unless asked otherwise, so that a round trip
source -> Thinker -> source is bit-exact.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from thinker import ThinkerConfig
from thinker_common.dtypes import dtype_name
from thinker_common.errors import ThinkerError
from thinker_common.side_files import copy_files, read_json, readable_tokenizer_files
from thinker_common.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size
from thinker_common.source_files import present
from thinker_common.sources import TensorSource, open_source
from thinker_common.staging import refuse_existing_output, staged_output

from .config_compare import config_differences
from .convert import ConversionResult, refuse_contrary_checks
from .engine import (
    Plan,
    Step,
    check_float_sources,
    describe_names,
    expand_rules,
    in_source_order,
    planned_shapes,
    write_weights,
)
from .families import FAMILIES, family_by_name
from .model_card import write_way_back_card
from .ops import FromConfig
from .output_dtype import kept_wider, resolve_dtype
from .parity import parity_gate, parity_mode, refuse_bad_memory_setting
from .parity_report import BY_LAYER, PARITY_FILE
from .spec import Family
from .thinker_config import load_thinker_config


def exportable_families() -> list[str]:
    return [family.name for family in FAMILIES if family.export_config is not None]


def way_back_family(name: str) -> Family:
    """The family ``--to NAME`` writes, refused by name (with what ``--to`` accepts) unless it has a way back."""
    accepted = exportable_families()
    if name not in accepted:
        known = any(family.name == name for family in FAMILIES)
        what = f"a Thinker folder cannot be written back as {name}" if known else f"--to {name!r} names no family"
        raise ThinkerError(f"{what}; --to accepts {', '.join(accepted)}")
    return family_by_name(name)


def read_thinker_config(folder: Path) -> ThinkerConfig:
    path = folder / "config.json"
    if not present(path, folder):
        raise ThinkerError(f"{folder}: no config.json; --to takes a Thinker folder written by thinker-convert")
    data = read_json(path)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type != ThinkerConfig.model_type:
        raise ThinkerError(f"{path}: model_type is {model_type!r}, not 'thinker'; --to takes a Thinker folder")
    return load_thinker_config(folder, data)


def export_config(family: Family, config: ThinkerConfig) -> dict[str, Any]:
    """The family's config for this Thinker config, refused unless it translates forward to the same model."""
    if family.export_config is None:
        raise ThinkerError(
            f"a Thinker folder cannot be written back as {family.name}; --to accepts {', '.join(exportable_families())}"
        )
    try:
        exported = family.export_config(config)
        translated = ThinkerConfig(**family.translate_config(exported))
    except (ThinkerError, TypeError, ValueError, StrictDataclassError) as err:
        # the family's config class refuses the values, the family refuses to convert them back, or the Thinker
        # config they translate to refuses itself; a strict config class wraps its validator's words in its own
        # ("Class validation error for validator 'validate_architecture': ValueError: ..."): the words are what the
        # user needs
        reason = re.sub(r"^Class validation error for validator '\w+': \w+: ", "", " ".join(str(err).split()))
        raise ThinkerError(f"this Thinker model is not expressible as {family.name}: {reason}") from None
    differ = config_differences(config, translated)
    if differ:
        # a dense model to a family of routed experts: that is the reason, whichever field shows it first
        dense = "it is dense (no routed experts); " if not config.num_experts and _routes_experts(family) else ""
        raise ThinkerError(
            f"this Thinker model is not expressible as {family.name}: {dense}the {family.name} config would change "
            f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}"
        )
    return exported


def _routes_experts(family: Family) -> bool:
    return any(".mlp.experts." in target for rule in family.tensors for target in rule.targets)


def plan_back(source: TensorSource, config: ThinkerConfig, family: Family, dtype: str = "auto") -> Plan:
    """The plan that writes the Thinker checkpoint ``source`` out in ``family``'s layout, from headers alone."""
    names = set(source.names())
    steps = _select_steps(family, config, names)
    check_float_sources(family, steps, source)
    consumed = Counter(name for step in steps for name in step.sources)
    unused = sorted(names - set(consumed))
    if unused:
        raise ThinkerError(
            f"the Thinker checkpoint holds {describe_names(unused)}, which a {family.name} model has no place for"
        )
    produced = Counter(target for step in steps for target in step.targets)
    twice = [name for counts in (consumed, produced) for name, count in counts.items() if count > 1]
    if twice:
        raise ThinkerError(f"the inverted {family.name} table uses or produces {describe_names(twice)} twice")
    derived = empty_shared_expert(family, config) | (family.derived_back(config) if family.derived_back else {})
    steps = in_source_order(steps, source.names()) + [Step((), (name,), FromConfig(t)) for name, t in derived.items()]
    shapes = planned_shapes(family, config, steps, source)
    output_dtype = resolve_dtype(dtype, config.dtype, source)
    kept = kept_wider(dtype, output_dtype, steps, source)
    # integer tensors keep their dtype; float ones (an empty shared expert's) take the folder's
    own_dtypes = {name: tensor.dtype for name, tensor in derived.items() if not tensor.is_floating_point()}
    return Plan(family, config, steps, shapes, output_dtype, kept=kept, derived=own_dtypes)


# A shared expert's tensors by their Thinker names within a layer, and their shapes at a width of 0.
_EMPTY_SHARED_EXPERT = {
    "mlp.shared_expert.gate_proj.weight": lambda hidden: (0, hidden),
    "mlp.shared_expert.up_proj.weight": lambda hidden: (0, hidden),
    "mlp.shared_expert.down_proj.weight": lambda hidden: (hidden, 0),
    "mlp.shared_expert_gate.weight": lambda hidden: (1, hidden),
}


def empty_shared_expert(family: Family, config: ThinkerConfig) -> dict[str, torch.Tensor]:
    """A shared expert 0 wide (``shared_expert_intermediate_size: 0``) adds exactly 0, so the Thinker has none and
    the forward direction drops its tensors (``engine._dropped_names``); the family's class builds them all the same
    (Qwen2-MoE's, Qwen3-Next's), so the way back writes them, by the family's names: the projections empty, the gate
    zeros (the source's gate values scaled an empty product and are not kept). Nothing for a family without one."""
    if not config.num_experts or config.shared_expert_intermediate_size:
        return {}
    wanted = {
        f"model.layers.{layer}.{name}": torch.zeros(shape(config.hidden_size))
        for layer, kind in enumerate(config.mlp_layer_types)
        if kind == "sparse"
        for name, shape in _EMPTY_SHARED_EXPERT.items()
    }
    written = {}
    for step in expand_rules(family.inverted_tensors(), config):
        if step.sources[0] in wanted:  # by the first layout the table lists, as ``_select_steps`` picks
            written.setdefault(step.sources[0], (step.targets[0], wanted[step.sources[0]]))
    return dict(written.values())


def _select_steps(family: Family, config: ThinkerConfig, names: set[str]) -> list[Step]:
    """For each group of Thinker tensors the inverted table reads, the first alternative whose tensors are all here."""
    groups: dict[tuple[str, ...], list[Step]] = {}
    for step in expand_rules(family.inverted_tensors(), config):
        present = [name in names for name in step.sources]
        if any(present) and not all(present):
            absent = [n for n, ok in zip(step.sources, present, strict=True) if not ok]
            raise ThinkerError(f"the Thinker checkpoint lacks {describe_names(absent)}, which {family.name} needs")
        if all(present):
            groups.setdefault(step.sources, []).append(step)
    return [options[0] for options in groups.values()]  # the first layout the forward table lists


def convert_back(
    source: str | Path,
    output: str | Path,
    family_name: str,
    *,
    dtype: str = "auto",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    verify: bool | None = None,
    verify_by_layer: bool = False,
    force: bool = False,
    progress: bool = True,
    memory_budget: int | None = None,
) -> ConversionResult:
    """Write the Thinker folder ``source`` out as a ``family_name`` folder at ``output``, atomically.

    ``verify`` (default on) checks the written folder, loaded with its own transformers class, against the Thinker:
    the whole models when both fit ``memory_budget``, else (or with ``verify_by_layer``) one layer at a time.
    """
    started = time.perf_counter()
    refuse_contrary_checks(verify, verify_by_layer)
    if verify is not False:
        refuse_bad_memory_setting()
    source, output = Path(source), Path(output)
    family = way_back_family(family_name)
    shard_bytes = parse_size(max_shard_size)
    refuse_existing_output(output, force, "once the new conversion is complete", source)
    config = read_thinker_config(source)
    exported = export_config(family, config)
    tensor_source = open_source(source)
    try:
        plan = plan_back(tensor_source, config, family, dtype)
        readable_tokenizer_files(source)  # copied into OUTPUT as it is: a file cut short is refused before any work
        exported["dtype"] = str(plan.dtype).removeprefix("torch.")
        report = None
        with staged_output(output, force, needed=plan.total_bytes) as staging:
            files = write_weights(plan, tensor_source, staging, shard_bytes, progress, desc="writing back")
            (staging / "config.json").write_text(json.dumps(exported, indent=2, sort_keys=True) + "\n")
            files.append("config.json")
            if present(source / "generation_config.json", source):  # sampling defaults of the source release
                files += copy_files(["generation_config.json"], source, staging)
            files += tensor_source.save_tokenizer(staging)
            if verify is not False:
                mode, note = (
                    (BY_LAYER, "") if verify_by_layer else parity_mode(plan.num_parameters, plan.config, memory_budget)
                )
                failure = f"{output}: does not match the Thinker folder; nothing written"
                # at the written dtype: the float32 Thinker rounded as the way back rounded it
                report = parity_gate(staging, source, None, staging / PARITY_FILE, failure, mode, note, plan.dtype)
            architecture = exported["architectures"][0]
            files += write_way_back_card(staging, source, family.name, architecture, report, output.name)
    finally:
        tensor_source.close()
    return ConversionResult(
        output=output,
        family=family.name,
        dtype=str(plan.dtype).removeprefix("torch."),
        files=files,
        total_bytes=plan.total_bytes,
        seconds=time.perf_counter() - started,
        parity=report,
        kept={name: dtype_name(dtype) for name, dtype in plan.kept.items()},
    )
