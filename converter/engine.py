"""The conversion engine: plan and check a conversion from tensor headers alone, then stream the tensors.

``plan_conversion`` never reads a tensor's bytes. It translates the source config, builds the Thinker model on the
meta device to learn every parameter it must produce (names and shapes, tied ones left out), expands the family's
table for this model's layers and experts into exact names, picks the rules that apply, and checks:

- the layer and expert counts the config declares fit the checkpoint (before anything is built from them);
- the config's ``tie_word_embeddings`` agrees with whether the source has an output projection;
- every source tensor a needed rule reads is present;
- every source tensor is read by some rule or dropped on purpose;
- every Thinker parameter is produced, and by exactly one rule;
- every produced shape (the rule's operation run on meta tensors) equals the parameter's shape.

Each failure is a ``ThinkerError`` naming the tensors. ``stream_tensors`` then reads one rule's sources at a time
(a rule is the unit of memory: one tensor, or one layer's experts when they are stacked), applies the operation,
checks the values (no NaN/Inf; nothing a float16 cast would overflow) and casts to the output dtype;
``write_weights`` hands each tensor to a background thread that writes it into its planned shard.

The way back (``converter/back.py``) plans over the family's inverted table and then uses the same shape check,
streaming, value checks and writer: a ``Plan`` does not care which way it converts.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub.errors import StrictDataclassError

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker_common.config_values import check_model_config
from thinker_common.dtypes import dtype_name
from thinker_common.errors import ThinkerError
from thinker_common.progress import progress_bar
from thinker_common.sources import TensorSource
from thinker_common.values import ValueScan, value_problem

from .families import detect_family
from .ops import Identity, JoinParts, Op
from .output_dtype import kept_wider, resolve_dtype
from .shards import ShardLayout, ShardWriter
from .spec import LAYER_INDEX, LIST_INDICES, Family, TensorRule


@dataclass(frozen=True)
class Step:
    """One rule made concrete: exact source names in, exact Thinker names out; the unit of reading and memory."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    op: Op


@dataclass
class Plan:
    """Everything needed to write a checkpoint, known before any tensor is read: a Thinker checkpoint from a source
    (``plan_conversion``), or a family's checkpoint from a Thinker folder (the way back, ``converter/back.py``)."""

    family: Family
    config: ThinkerConfig  # the Thinker config (the operations read head counts and sizes from it)
    steps: list[Step]  # in the order the source files hold their tensors
    shapes: dict[str, tuple[int, ...]]  # output tensor -> shape, in the order the steps produce them
    dtype: torch.dtype  # the folder's: of every output tensor but those in ``kept``
    dropped: list[str] = field(default_factory=list)  # source tensors skipped on purpose
    kept: dict[str, torch.dtype] = field(default_factory=dict)  # output tensor -> the wider dtype its source stores
    derived: dict[str, torch.dtype] = field(default_factory=dict)  # output tensor -> its own (integer) dtype, for
    # tensors derived from the config (``ops.FromConfig``), which no cast may touch

    def dtype_of(self, target: str) -> torch.dtype:
        return self.derived.get(target) or self.kept.get(target, self.dtype)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(shape) * self.dtype_of(name).itemsize for name, shape in self.shapes.items())


def describe_names(names: list[str] | set[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``: error messages name the tensors without flooding the terminal."""
    ordered = sorted(names) if isinstance(names, set) else list(names)
    shown = ", ".join(ordered[:limit])
    return shown + (f" and {len(ordered) - limit} more" if len(ordered) > limit else "") + f" ({len(ordered)} in all)"


# --- templates ---------------------------------------------------------------------------------------------------


def expand_names(templates: tuple[str, ...], layer: int | None, counts: Mapping[str, int]) -> tuple[str, ...]:
    """Exact names for one layer: ``{layer}`` filled in, each template holding a list index (``{expert}``,
    ``{part}``) repeated for every index, up to its count in ``counts``."""
    names: list[str] = []
    for template in templates:
        name = template if layer is None else template.replace(LAYER_INDEX, str(layer))
        index = next((index for index in LIST_INDICES if index in name), None)
        if index is None:
            names.append(name)
        else:
            names.extend(name.replace(index, str(i)) for i in range(counts[index]))
    return tuple(names)


def expand_rules(rules: tuple[TensorRule, ...], config: ThinkerConfig) -> list[Step]:
    """Every rule for every layer it names, as exact names: a lookup table with no patterns left in it."""
    counts = {index: getattr(config, field) for index, field in LIST_INDICES.items()}
    steps = []
    for entry in rules:
        per_layer = any(LAYER_INDEX in name for name in entry.sources + entry.targets)
        for layer in range(config.num_hidden_layers) if per_layer else (None,):
            steps.append(
                Step(
                    expand_names(entry.sources, layer, counts),
                    expand_names(entry.targets, layer, counts),
                    entry.op,
                )
            )
    return steps


# --- planning ----------------------------------------------------------------------------------------------------


def thinker_parameter_shapes(config: ThinkerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Thinker checkpoint of this config holds, from the model built on the meta device (no memory).

    Tied parameters (``lm_head.weight`` when the embeddings are tied) are not stored, as transformers saves them.
    """
    try:
        with torch.device("meta"):
            model = ThinkerForCausalLM(config)
    except (RuntimeError, *_CONFIG_ERRORS) as err:  # sizes no model has: negative, zero vocabulary ...
        reason = " ".join(str(err).split())
        raise ThinkerError(f"the config does not build a Thinker model: {reason}; check config.json") from None
    tied = set(model.all_tied_weights_keys)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in tied}


# Errors a family's config translation raises on a config.json with missing keys or values of the wrong kind: its
# input is whatever the user's file holds, so these are the user's to fix, not bugs.
_CONFIG_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError, StrictDataclassError)


def translate_config(family: Family, source_config: Mapping[str, Any], dtype: torch.dtype) -> ThinkerConfig:
    try:
        kwargs = family.translate_config(source_config)
    except _CONFIG_ERRORS as err:
        reason = f"no key {err}" if isinstance(err, KeyError) else " ".join(str(err).split())
        raise ThinkerError(f"the source {family.config_label} is not a valid {family.name} config: {reason}") from None
    check_model_config(kwargs, f"the source {family.config_label}")  # before the config computes from them
    try:
        config = ThinkerConfig(**kwargs)
        config.validate_architecture()
    except (TypeError, ValueError, StrictDataclassError) as err:
        reason = " ".join(str(err).split())
        raise ThinkerError(f"{family.name} config does not translate to a valid Thinker config: {reason}") from None
    config.architectures = ["ThinkerForCausalLM"]
    config.dtype = dtype
    return config


def plan_conversion(
    source: TensorSource,
    source_config: Mapping[str, Any],
    dtype: str = "auto",
    family: Family | None = None,
) -> Plan:
    """Decide and check the whole conversion from names and shapes; raises ``ThinkerError`` naming what is off."""
    names = source.names()
    if family is None:
        family = detect_family(source_config, set(names))
    output_dtype = resolve_dtype(dtype, source_config.get("dtype") or source_config.get("torch_dtype"), source)
    bounds = _count_bounds(family, source)
    _check_counts(family, _declared_counts(family, source_config), bounds)  # before anything is built from them
    config = translate_config(family, family.hf_config(source_config, names), output_dtype)
    _check_counts(family, {"num_hidden_layers": config.num_hidden_layers, "num_experts": config.num_experts}, bounds)
    expected = thinker_parameter_shapes(config)

    _check_tie(family, config, set(names))
    steps = _select_steps(family, config, expected, set(names))
    check_float_sources(family, steps, source)
    duplicate_head = _duplicate_tied_head(family, config, steps, source)
    _check_sources_used(family, config, steps, names, duplicate_head)
    _check_shared_expert_empty(family, config, source, set(names))
    if family.check_source is not None:
        family.check_source(config, source)
    _check_targets_produced(family, steps, expected)
    planned_shapes(family, config, steps, source, expected)

    steps = in_source_order(steps, names)
    shapes = {target: expected[target] for step in steps for target in step.targets}
    dropped = set(names) & _dropped_names(family, config) | _dropped_by_prefix(family, names, config)
    dropped = sorted(dropped | duplicate_head)
    return Plan(family, config, steps, shapes, output_dtype, dropped, kept_wider(dtype, output_dtype, steps, source))


def in_source_order(steps: list[Step], names: list[str]) -> list[Step]:
    """The steps in the order the source files hold their tensors: each file is read front to back."""
    position = {name: index for index, name in enumerate(names)}
    return sorted(steps, key=lambda step: min(position[name] for name in step.sources))


def _count_bounds(family: Family, source: TensorSource) -> dict[str, tuple[int, str]]:
    """The most layers and experts a checkpoint can hold: every layer has tensors of its own, every expert at least
    one weight. Keyed by the family's spellings of the counts and by Thinker's."""
    names = source.names()
    tensors = (len(names), "tensors")
    weights = (sum(math.prod(source.shape(name)) for name in names), "weights")
    layers = {*family.layer_count_keys, "num_hidden_layers"}
    experts = {*family.expert_count_keys, "num_experts"}
    return {key: tensors for key in layers} | {key: weights for key in experts}


def _declared_counts(family: Family, config: Mapping[str, Any]) -> dict[str, Any]:
    """The layer and expert counts ``config`` declares, at any nesting depth (Qwen3-Omni keeps its decoder's under
    thinker_config.text_config)."""
    counts = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            counts |= _declared_counts(family, value)
        elif key in family.layer_count_keys + family.expert_count_keys:
            counts[key] = value
    return counts


def _check_counts(family: Family, counts: Mapping[str, Any], bounds: Mapping[str, tuple[int, str]]) -> None:
    """Refuse layer or expert counts no checkpoint of this size holds, before anything is built from them: building
    the model and expanding the table take time per layer and per expert (and transformers' config classes build
    per-layer lists), so a config.json claiming a billion layers would otherwise hang instead of failing."""
    for key, count in counts.items():
        bound, unit = bounds[key]
        if isinstance(count, int) and not isinstance(count, bool) and count > bound:
            raise ThinkerError(
                f"the source {family.config_label} says {key}={count}, but the checkpoint holds only {bound} {unit} "
                f"in all; its {family.config_label} does not describe these {family.name} weights"
            )


def _check_tie(family: Family, config: ThinkerConfig, names: set[str]) -> None:
    """An untied config must come with its head (a tied one that also holds a head: ``_duplicate_tied_head``)."""
    head = family.head_in(names)
    if head is None:
        return
    if not config.tie_word_embeddings and head not in names:
        raise ThinkerError(
            f"the config has an untied output head ({family.tie_key}=false), but the checkpoint holds no "
            f"{head}; set {family.tie_key} to true in the source config.json if the head reuses the embeddings"
        )


def _duplicate_tied_head(family: Family, config: ThinkerConfig, steps: list[Step], source: TensorSource) -> set[str]:
    """The head a tied checkpoint also stores (fine-tunes and merges save one), dropped when it holds the embedding's
    values, as transformers' class then ties it to the embedding; one with other values is refused, since a tie
    would silently discard a head that was trained on its own. Compared piece by piece: never a table in memory."""
    head = family.head_in(source.names())
    if head is None or not config.tie_word_embeddings or head not in source.names():
        return set()
    embedding = next((step for step in steps if "model.embed_tokens.weight" in step.targets), None)
    if embedding is None or not _same_values(source, embedding.sources, head):
        raise ThinkerError(
            f"the config ties the output head to the embeddings (tie_word_embeddings=true), but the checkpoint also "
            f"holds a separate {head} with other values; set tie_word_embeddings to false in the source "
            "config.json if the head is trained separately"
        )
    return {head}


def _same_values(source: TensorSource, embedding: tuple[str, ...], head: str) -> bool:
    if len(embedding) != 1 or source.shape(embedding[0]) != source.shape(head):
        return False
    (name,) = embedding
    if source.dtype(name) != source.dtype(head) or not hasattr(source, "read_pieces"):
        return torch.equal(source.load(name), source.load(head).to(source.dtype(name)))
    buffers = torch.empty(COPY_PIECE, dtype=torch.uint8), torch.empty(COPY_PIECE, dtype=torch.uint8)
    pieces = zip(source.read_pieces(name, buffers[0]), source.read_pieces(head, buffers[1]), strict=True)
    return all(torch.equal(a, b) for a, b in pieces)


def _select_steps(
    family: Family, config: ThinkerConfig, expected: Mapping[str, tuple[int, ...]], names: set[str]
) -> list[Step]:
    """The steps this model needs: for each group of targets it has, the first alternative whose sources exist."""
    alternatives: dict[tuple[str, ...], list[Step]] = {}
    for step in expand_rules(family.tensors, config):
        present = [target in expected for target in step.targets]
        if not any(present):
            continue  # a rule for something this model does not have (biases, experts on a dense layer ...)
        if not all(present):
            absent = [t for t, ok in zip(step.targets, present, strict=True) if not ok]
            raise ThinkerError(
                f"the {family.name} table produces {describe_names(absent)}, which the Thinker model of this "
                "config does not have; the family's table and config translation disagree"
            )
        alternatives.setdefault(step.targets, []).append(step)

    def parent(name: str) -> str:  # the module holding the tensor's module: "...layers.2.linear_attn"
        return name.rsplit(".", 2)[0]

    parents = {parent(name) for name in names}

    def closeness(step: Step) -> tuple[int, int]:  # tensors present, then tensors with present siblings
        return sum(name in names for name in step.sources), sum(parent(name) in parents for name in step.sources)

    chosen, missing = [], set()
    for options in alternatives.values():
        usable = next((step for step in options if names.issuperset(step.sources)), None)
        if usable is None:
            # Named as the layout the checkpoint is closest to spells them, not as the table's first layout does.
            missing.update(name for name in max(options, key=closeness).sources if name not in names)
        else:
            chosen.append(usable)
    if missing:
        raise ThinkerError(
            f"the source checkpoint lacks tensors a {family.name} model of this config needs: "
            f"{describe_names(missing)}; the checkpoint is incomplete or its {family.config_label} does not "
            "describe it"
        )
    return chosen


def check_float_sources(family: Family, steps: list[Step], source: TensorSource) -> None:
    """Every tensor a step reads holds floating-point values: a float tensor relabelled ``I32`` in a safetensors
    header would otherwise be cast to float as integers and written as a model (every weight a huge number)."""
    for step in steps:
        for name in step.sources:
            dtype = source.dtype(name)
            if not dtype.is_floating_point:
                raise ThinkerError(
                    f"{source.file_of(name)}: tensor {name!r} is stored as {dtype_name(dtype)}, where a {family.name} "
                    "checkpoint holds floating-point weights; the file is corrupt or mislabelled: re-download it"
                )


# The prefix of the multi-token-prediction block Qwen3.5 and Qwen3-Next checkpoints carry: a speculative-decoding
# head, not a tower whose output the decoder takes.
MTP_PREFIX = "mtp."


class LeftOut(NamedTuple):
    """A part of the source a conversion leaves out: its tensors' prefix, how many, whether it is the
    multi-token-prediction block (else a tower, a projector, a talker: what feeds or follows the decoder)."""

    prefix: str
    count: int
    mtp: bool


def left_out(plan: Plan) -> list[LeftOut]:
    """The source's parts beside its text decoder that this conversion leaves out, in the family's order: each of its
    ``dropped_prefixes`` the checkpoint holds tensors under (a vision or audio tower, a talker, ``mtp.``), and each
    block past the decoder's layers it drops by index (a GGUF's multi-token-prediction block, ``blk.N.``)."""
    prefixes = plan.family.dropped_prefixes
    held = [name for name in plan.dropped if name.startswith(prefixes)]
    counts = Counter(next(prefix for prefix in prefixes if name.startswith(prefix)) for name in held)
    parts = [LeftOut(prefix, counts[prefix], prefix == MTP_PREFIX) for prefix in prefixes if counts[prefix]]
    if layer := _extra_layer(plan.family):
        blocks = Counter(match[0] for name in plan.dropped if (match := layer.match(name)))
        parts += [LeftOut(prefix, count, True) for prefix, count in sorted(blocks.items())]
    return parts


def _extra_layer(family: Family) -> re.Pattern | None:
    """The family's ``dropped_extra_layers`` as a pattern: its match is a block's prefix (``blk.4.``), group 1 its
    index."""
    if not family.dropped_extra_layers:
        return None
    before, _, after = family.dropped_extra_layers.partition(LAYER_INDEX)
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


def _empty_shared_expert(family: Family, config: ThinkerConfig) -> list[Step]:
    """A shared expert 0 wide adds exactly 0 (its gate scales an empty product), yet Qwen2-MoE's class writes its
    empty projections and its gate: the Thinker, which has none, drops them. The steps that would read them, where
    the config says 0."""
    if not config.num_experts or config.shared_expert_intermediate_size:
        return []
    return expand_rules(
        tuple(rule for rule in family.tensors if any(".shared_expert" in t for t in rule.targets)), config
    )


def _dropped_names(family: Family, config: ThinkerConfig) -> set[str]:
    rules = tuple(TensorRule((name,), ()) for name in family.dropped)
    dropped = expand_rules(rules, config) + _empty_shared_expert(family, config)
    return {name for step in dropped for name in step.sources}


def _check_shared_expert_empty(family: Family, config: ThinkerConfig, source: TensorSource, names: set[str]) -> None:
    """The shared expert the config calls 0 wide is dropped: its projections must then be empty in the checkpoint,
    or real weights would leave the model unsaid (a config.json edited, or another checkpoint's)."""
    projections = (s for s in _empty_shared_expert(family, config) if any(".shared_expert." in t for t in s.targets))
    for step in projections:  # not the gate, (1, hidden) whatever the width
        for name in step.sources:
            if name in names and math.prod(shape := source.shape(name)):
                raise ThinkerError(
                    f"its {family.config_label} gives shared_expert_intermediate_size 0, but the checkpoint's "
                    f"shared expert has width: {name} is {tuple(shape)}; set the width its weights have (or convert "
                    "with the config.json saved beside these weights)"
                )


def _dropped_by_prefix(family: Family, names: list[str], config: ThinkerConfig) -> set[str]:
    dropped = {name for name in names if family.dropped_prefixes and name.startswith(family.dropped_prefixes)}
    if layer := _extra_layer(family):
        dropped |= {
            name for name in names if (match := layer.match(name)) and int(match[1]) >= config.num_hidden_layers
        }
    return dropped


def _check_sources_used(
    family: Family, config: ThinkerConfig, steps: list[Step], names: list[str], dropped: set[str]
) -> None:
    used = {name for step in steps for name in step.sources} | _dropped_names(family, config) | dropped
    used |= _dropped_by_prefix(family, names, config)
    unexpected = [name for name in names if name not in used]
    if unexpected:
        raise ThinkerError(
            f"the source checkpoint holds tensors that no {family.name} rule maps and none drops on purpose: "
            f"{describe_names(unexpected)}; its {family.config_label} may not match the weights (layer, expert or "
            "piece counts: num_hidden_layers, num_experts, split_ngram_parts; biases; tied head)"
        )


def _check_targets_produced(family: Family, steps: list[Step], expected: Mapping[str, tuple[int, ...]]) -> None:
    produced = Counter(target for step in steps for target in step.targets)
    twice = [name for name, count in produced.items() if count > 1]
    if twice:
        raise ThinkerError(f"the {family.name} table produces {describe_names(twice)} more than once")
    never = [name for name in expected if name not in produced]
    if never:
        raise ThinkerError(
            f"no {family.name} rule produces the Thinker parameters {describe_names(never)}; "
            "the family's table is incomplete for this config"
        )


def planned_shapes(
    family: Family,
    config: ThinkerConfig,
    steps: list[Step],
    source: TensorSource,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Every output's shape, from each step's operation run on meta tensors (no bytes read); when ``expected`` is
    given, every shape must equal it. Raises ``ThinkerError`` naming the tensors that do not fit."""
    shapes, mismatches = {}, []
    for step in steps:
        inputs = [torch.empty(source.shape(name), device="meta") for name in step.sources]
        try:
            outputs = step.op(inputs, config)
        except (RuntimeError, ValueError, ThinkerError) as err:
            described = ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(step.sources, inputs, strict=True))
            raise ThinkerError(
                f"cannot convert {described}: {err}; the {family.config_label} does not match the weights"
            ) from None
        for target, output in zip(step.targets, outputs, strict=True):
            shapes[target] = tuple(output.shape)
            if expected is not None and shapes[target] != expected[target]:
                origin = step.sources[0] if len(step.sources) == 1 else f"{step.sources[0]} (+{len(step.sources) - 1})"
                named = target if origin == target else f"{target} from {origin}"  # a name kept is said once
                mismatches.append(f"{named}: {shapes[target]}, expected {expected[target]}")
    if mismatches:
        shown = "; ".join(mismatches[:5]) + (f"; and {len(mismatches) - 5} more" if len(mismatches) > 5 else "")
        raise ThinkerError(
            f"{len(mismatches)} tensor shape(s) disagree with the config: {shown}; "
            f"the {family.config_label} does not describe these weights"
        )
    return shapes


# --- streaming ---------------------------------------------------------------------------------------------------


def stream_tensors(plan: Plan, source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Thinker tensors in plan order, each checked and cast; the generator holds only the current step's tensors."""
    for step in plan.steps:
        yield from convert_step(step, source, plan)


def convert_step(step: Step, source: TensorSource, plan: Plan) -> Iterator[tuple[str, torch.Tensor]]:
    """One step's output tensors, checked and cast.

    When the step's operation only moves values (``Op.rearranges``), each source tensor's values are checked as its
    bytes are read (``ValueScan``), which costs no pass of its own; otherwise the outputs are checked."""
    scan_sources = step.op.rearranges
    narrowest = min((plan.dtype_of(target) for target in step.targets), key=lambda dtype: dtype.itemsize)
    inputs = []
    for name in step.sources:
        scan = ValueScan() if scan_sources else None
        inputs.append(source.load(name, scan=scan))
        if scan is not None:
            refuse_values(scan.problem(narrowest), name, ", ".join(step.targets))
    outputs = step.op(inputs, plan.config)
    del inputs
    for index, target in enumerate(step.targets):
        tensor, outputs[index] = outputs[index], None  # hand over our reference: freed once written
        checked = scan_sources or not step.sources  # a tensor derived from the config holds integers, not read ones
        yield target, finish_tensor(tensor, target, step.sources, plan.dtype_of(target), checked=checked)
        del tensor


def finish_tensor(
    tensor: torch.Tensor, target: str, sources: tuple[str, ...], dtype: torch.dtype, checked: bool = False
) -> torch.Tensor:
    """Refuse NaN/Inf and float16 overflow (naming the tensor) unless ``checked`` already, then cast and make
    contiguous for writing."""
    if not checked:
        origin = sources[0] if len(sources) == 1 else f"{sources[0]} and {len(sources) - 1} more"
        refuse_values(value_problem(tensor, dtype), origin, target)
    return tensor.to(dtype).contiguous()


def refuse_values(problem: str | None, origin: str, target: str) -> None:
    if problem:
        advice = "the checkpoint is corrupt" if "NaN" in problem else "convert with --dtype bfloat16 or float32 instead"
        raise ThinkerError(f"source tensor {origin} (for {target}) {problem}; {advice}")


# Bytes copied unchanged go through a buffer of this size, reused: it stays in the processor's cache while its values
# are checked and written.
COPY_PIECE = 4 << 20


def write_weights(
    plan: Plan, source: TensorSource, folder: Path, max_shard_size: int, progress: bool, desc: str = "converting"
) -> list[str]:
    """Stream the plan's tensors into safetensors shards in ``folder``; returns the files written.

    Reading, converting and writing overlap: the main thread reads and converts the next step while a background
    thread writes the previous one into its shard (file I/O and torch both release the GIL), and the disk writes
    back what is already written while both go on (``shards.ShardWriter``). At most two steps' tensors are alive:
    the one being written and the one being produced. A tensor copied unchanged (a rename, in the output dtype,
    from a source that knows its bytes' place in a file) is never held whole: the writer reads it through one small
    buffer to check its values, then the kernel copies its bytes (``copy_checked``).
    """
    layout = ShardLayout([(name, shape, plan.dtype_of(name)) for name, shape in plan.shapes.items()], max_shard_size)
    buffer = torch.empty(COPY_PIECE, dtype=torch.uint8)
    with (
        ShardWriter(folder, layout) as writer,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as background,
        progress_bar(layout.total_size, desc, enabled=progress) as bar,
    ):
        writing = None
        for step in plan.steps:
            target = step.targets[0]
            if isinstance(step.op, JoinParts) and step.op.dim == 0:
                jobs = piece_by_piece(step, source, plan, writer, buffer)
            elif copies_bytes(step, source, plan.dtype_of(target)):
                jobs = [partial(copy_checked, writer, source, step.sources[0], target, plan.dtype_of(target), buffer)]
            else:
                jobs = (partial(writer.write, name, tensor) for name, tensor in convert_step(step, source, plan))
            for job in jobs:
                if writing is not None:
                    bar.update(writing.result())  # the previous write must end before the next is handed over
                writing = background.submit(job)
                del job
        if writing is not None:
            bar.update(writing.result())
        return writer.close()


def piece_by_piece(
    step: Step, source: TensorSource, plan: Plan, writer: ShardWriter, buffer: torch.Tensor
) -> Iterator[Callable[[], int]]:
    """The writes of a tensor joined from pieces along its first dimension (Qwen4-Exp's n-gram tables: tens of GB,
    in hundreds of pieces), each piece put after the one before it in the target's slot: copied by the kernel where
    it is stored in the output dtype, else read, checked and cast alone. The joined tensor is never in memory."""
    target, dtype = step.targets[0], plan.dtype_of(step.targets[0])
    for name in step.sources:
        if hasattr(source, "byte_range") and source.dtype(name) == dtype:
            yield partial(copy_checked, writer, source, name, target, dtype, buffer, part=True)
        else:
            scan = ValueScan()
            tensor = source.load(name, scan=scan)
            refuse_values(scan.problem(dtype), name, target)
            yield partial(writer.write, target, tensor.to(dtype).contiguous(), part=True)
            del tensor


def copies_bytes(step: Step, source: TensorSource, dtype: torch.dtype) -> bool:
    """Whether a step writes its one source tensor's bytes unchanged."""
    return (
        isinstance(step.op, Identity)
        and len(step.sources) == 1
        and hasattr(source, "byte_range")
        and source.dtype(step.sources[0]) == dtype
    )


def copy_checked(
    writer: ShardWriter,
    source: TensorSource,
    name: str,
    target: str,
    dtype: torch.dtype,
    buffer: torch.Tensor,
    part: bool = False,
) -> int:
    """Copy a source tensor's bytes into its slot unchanged (``part``: into the next part of its slot), refusing
    (``ThinkerError``) values the output dtype cannot hold. The values are checked piece by piece as they are read
    into ``buffer``; the bytes are then copied by the kernel from the file (still in the page cache): through this
    process's memory, as a pwrite of every piece, the copy measured 2-2.6x slower. Returns the bytes written."""
    scan = ValueScan()
    for piece in source.read_pieces(name, buffer):
        scan.update(piece.view(dtype))
    refuse_values(scan.problem(dtype), name, target)
    descriptor, begin, end = source.byte_range(name)
    return writer.copy_range(target, descriptor, begin, end - begin, part=part)
