"""Parity layer by layer: the source family's reference and the converted Thinker, each run one unit at a time from
its own files on disk (``converter/streamed.py``), so that a model of any size is verified in the memory of its
largest layer.

For each batch (the left-padded batch of ``thinker_common/parity_inputs.py``, as the whole-model check feeds; a
reference written without an attention mask gets each prompt alone, unpadded):

1. the reference runs through its own ``forward``, one unit at a time; the hidden states entering and leaving each
   decoder layer, and its logits, are kept (a few KB per layer);
2. the Thinker runs the same way on its own hidden states: its logits are the end-to-end figures, the same as the
   whole-model check's. While each of its decoder layers is loaded, that layer also runs on the reference's input to
   the same layer, with the masks and position embeddings the Thinker's own forward computed; its final norm and head
   run on the reference's last hidden state. So every stage is compared on the same hidden states, and a difference
   is that stage's own, not one accumulated from the layers before (which is recorded too, as
   ``stream_max_abs_diff``).

Stages: ``embeddings`` (the hidden states entering layer 0), ``layer i`` for every decoder layer, ``final norm and
head``. A stage's tolerance is ``GATE_TOLERANCE[dtype] × max(1, max |reference's output of that stage|)`` over
real tokens: scaled by the reference's own activations alone, so a converted model gone wrong never widens it. The
verdict: every stage within its tolerance, the end-to-end logits within theirs (the whole-model rule), and the top-1
token identical at every real position in float32 (at least 90 % in half precision), and LAYER_DECODE_STEPS decode
steps after the prompts, each row of both models fed the reference's greedy token (so every step compares), their
logits within the whole-model check's decode tolerance. Greedy continuations are not run here: each generated token
reads both models from disk again; the top-1 check at every position of the prompts stands in for them, and the
decode steps check the cache and recurrent states the prompts and a step wrote (a decode path broken with every
stage exact passed before: a QA run). A failure names the first stage beyond its tolerance, else the decode steps.

As in the whole-model check, the float32 run loads both models in the converted folder's dtype and widens them (one
unit at a time), and a half-precision conversion is also run in its own dtype; each run reads both models once for
the prompts and once for each decode step (for a reference fed without a mask, once per prompt each). Memory: the
largest unit of one model at a time, the reference's hidden states leaving every layer for the batch's slots (and
entering it, where they are not the layer before's output: 4 x 141 slots at most, 2.3 MB a layer at a width of 1024
in float32), both models' caches for them, and their logits at the real positions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import GATE_TOLERANCE, gate_prompts, left_padded
from thinker_common.side_files import read_json
from thinker_common.sources import (
    BIN_INDEX,
    LOAD_ORDER,
    SAFETENSORS_INDEX,
    bin_files,
    open_source,
    safetensors_files,
    transformers_weights_format,
    unindexed_shards,
)

from .output_dtype import resolve_dtype
from .parity_report import (
    BY_LAYER,
    GREEDY_ONLY,
    GREEDY_TOKENS,
    HALF_TOP1_MIN,
    LAYER_DECODE_STEPS,
    NO_VERIFY,
    DtypeParity,
    LayerParity,
    NoReference,
    ParityReport,
    reference_fails,
    reference_overflows,
    refuse_short_context,
    refuse_unknown_model_type,
)
from .spec import Family
from .special_tokens import source_named_ids, special_id_differences
from .streamed import (
    StreamedModel,
    Unit,
    empty_model,
    fixed_malloc_thresholds,
    fp8_reference_quantizer,
    lazy_tensors,
)
from .unreached import Probes, deepstack_stage, position_stages

EMBEDDINGS, HEAD = "embeddings", "final norm and head"
# Where the Thinker's final norm and head sit (``ThinkerForCausalLM``), run on the reference's last hidden state.
THINKER_HEAD = "lm_head"
# the module that makes the last layer's output the head's input: the final norm, or the hyper-connections' last mix
THINKER_FINAL_NORMS = ("model.norm", "model.hyper_connection_mixer")


def check_parity_by_layer(
    source: Path, converted: Path, family: Family | None = None, dtype: torch.dtype | None = None
) -> ParityReport:
    """Compare ``converted`` with the reference of ``family`` loaded from ``source``, one layer at a time: float32,
    plus the converted dtype if it is a half-precision one (``dtype`` in its place where given: ``check_parity``)."""
    fixed_malloc_thresholds()
    stored = dtype or converted_dtype(converted)
    loader = family.layered_reference if family is not None and family.layered_reference else load_layered_reference
    config = ThinkerConfig.from_pretrained(converted)
    # the whole-model check's prompts, room left for its greedy tokens: both modes compare the same batch
    refuse_short_context(config.max_position_embeddings)
    prompts = gate_prompts(config.vocab_size, config.max_position_embeddings, GREEDY_TOKENS)
    results, names, special = [], ("", ""), []
    for dtype in (torch.float32, *([stored] if stored != torch.float32 else [])):
        reference = loader(source, stored)
        try:
            thinker = load_layered_converted(converted, stored)
            try:
                for model in (reference, thinker):
                    model.compute_dtype = dtype if dtype != stored else None
                results.append(compare_by_layer(reference, thinker, prompts, dtype))
                names = (reference.name, thinker.name)
                special = special_id_differences(
                    getattr(reference.model, "config", None), config, source_named_ids(source)
                )
            finally:
                thinker.close()
        finally:
            reference.close()
    return ParityReport(
        reference=names[0],
        converted=names[1],
        prompts=prompts,
        results=results,
        mode=BY_LAYER,
        special_tokens=special,
    )


# --- loading -----------------------------------------------------------------------------------------------------


def converted_dtype(folder: Path) -> torch.dtype:
    """The dtype a converted folder holds its weights in, as ``from_pretrained(dtype="auto")`` would load it."""
    source = open_source(folder)
    try:
        return resolve_dtype("auto", ThinkerConfig.from_pretrained(folder).dtype, source)
    finally:
        source.close()


def load_layered_converted(
    folder: Path, dtype: torch.dtype, rounded_to: torch.dtype | None = None, attention: str = "eager"
) -> StreamedModel:
    """The converted Thinker folder, built on the meta device in ``dtype``, its weights read unit by unit (each
    floating-point one rounded to ``rounded_to`` first, where given: as an export in that dtype holds it);
    ``attention``: its attention implementation (``empty_model``)."""
    try:
        model = empty_model(ThinkerForCausalLM._from_config, ThinkerConfig.from_pretrained(folder), dtype, attention)
    except Exception as err:  # whatever the folder's config makes transformers raise
        raise ThinkerError(f"{folder}: the converted model does not build ({err})") from None
    source = open_source(folder)
    return StreamedModel(model, lazy_tensors(source, rounded_to), whole_modules=THINKER_FINAL_NORMS, close=source.close)


def load_layered_reference(source: Path, dtype: torch.dtype, model_class: type | None = None) -> StreamedModel:
    """The family's transformers class (``model_class``, else the one ``AutoModelForCausalLM`` picks for the source's
    config), built on the meta device in ``dtype``; its weights read unit by unit from the source as given (a folder
    or a weights file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(source)
    folder = source.parent if source.is_file() else source
    refuse_unknown_model_type(folder / "config.json")
    if source.is_dir():
        refuse_unloadable(source, str(source))
    refuse_other_weights_file(source)
    try:
        # transformers' own class for the family, never code shipped with the checkpoint (a config's auto_map).
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        if model_class is None:
            model = empty_model(AutoModelForCausalLM.from_config, config, dtype, trust_remote_code=False)
        else:
            model = empty_model(model_class._from_config, config, dtype)
    except Exception as err:  # transformers raises many types for a folder it cannot build; all are the folder's
        raise ThinkerError(f"{folder}: the reference model does not build with transformers ({err})") from None
    # As stored: an FP8 checkpoint's weights reach the reference through transformers' own dequantizing loader.
    tensors = open_source(source, dequantize=False)
    quantization = getattr(config, "quantization_config", None)
    quantizer = None if quantization is None else fp8_reference_quantizer(quantization)
    return StreamedModel(model, lazy_tensors(tensors), close=tensors.close, hf_quantizer=quantizer)


def refuse_unloadable(folder: Path, label: str) -> None:
    """Refuse a folder in which transformers' from_pretrained finds no weights under the names it looks for
    (``transformers_weights_format``): the whole-model check cannot load it, and the layer check, which reads the
    files the converter reads, must not vouch for a checkpoint transformers never runs."""
    if transformers_weights_format(folder) is not None:
        refuse_index_without_metadata(folder)
        return
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        if shards := unindexed_shards(folder, index_name):
            raise NoReference(
                f"{label}: its shards ({shards[0]}, ...) have no {index_name}, which transformers needs to load them, "
                "so there is no reference to verify against; restore the index from the model's repository, or "
                f"{NO_VERIFY}"
            )
    raise NoReference(
        f"{label}: transformers finds none of model.safetensors, pytorch_model.bin or their indexes here, so it "
        "cannot load this checkpoint and there is no reference to verify against; give its weights one of those "
        f"names, or {NO_VERIFY}"
    )


def refuse_index_without_metadata(folder: Path) -> None:
    """Refuse an index transformers would read (no whole file before it, ``LOAD_ORDER``) that has no ``metadata``
    object: its loader reads ``index["metadata"]`` with the shards' names, and the check said only that the reference
    does not load ("'metadata'"), a QA run found. The converter reads the shards by ``weight_map`` alone."""
    for whole, index_name in LOAD_ORDER:
        if os.path.lexists(folder / whole):
            return
        index = read_json(folder / index_name)
        if isinstance(index, dict) and not isinstance(index.get("metadata"), dict):
            raise NoReference(
                f'{folder / index_name}: no "metadata" object, which transformers reads to load the shards, so '
                f'there is no reference to verify against; add "metadata": {{}} to it, or {NO_VERIFY}'
            )
        if index is not None:
            return


def refuse_other_weights_file(source: Path) -> None:
    """Refuse a weights file given as SOURCE that is not what transformers loads from its folder: the reference is
    transformers' load of the folder, so the check would compare the Thinker with other weights (and layer by layer,
    reading the file, vouch for weights transformers never runs there). A folder SOURCE, or the file transformers
    loads, passes."""
    if not source.is_file():
        return
    folder = source.parent
    refuse_unloadable(folder, str(folder))
    loaded = safetensors_files(folder) if transformers_weights_format(folder) == "safetensors" else bin_files(folder)
    if source.resolve() not in {path.resolve() for path in loaded}:
        raise NoReference(
            f"{source}: transformers loads {', '.join(path.name for path in loaded)} from {folder}, not this file, "
            f"so the check has no reference of its weights; give the folder as SOURCE, or {NO_VERIFY}"
        )


# --- comparison --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compare_by_layer(
    reference: StreamedModel, converted: StreamedModel, prompts: list[list[int]], dtype: torch.dtype
) -> DtypeParity:
    """Both models over the prompts, stage by stage on the reference's hidden states; see the module docstring."""
    relative = GATE_TOLERANCE[dtype]
    padded = reference.takes_padding and converted.takes_padding
    batches = [left_padded(prompts)] if padded else [left_padded([prompt]) for prompt in prompts]
    stages: dict[str, _Stage] = {}
    expected_logits, actual_logits, counts = [], [], None
    probes = Probes.of(converted.model.config)
    probes.watch_positions(reference.model, converted.model)
    expected_steps, actual_steps = [], []
    for batch, (ids, mask, positions) in enumerate(batches):
        real = mask.bool()
        trace = _Trace(probes if batch == 0 else None)  # the unreached parts, once: they take no prompt
        # Only the real positions' logits are kept, each pass's whole (batch, slots, vocabulary) dropped as soon as
        # it is read: for a 152k vocabulary the batch's are 0.34 GB in float32, its real positions' under half.
        with said_of(reference.name), reference.streaming(trace.record_reference):
            expected, reference_cache = prompt_pass(reference, ids, mask, positions)
        first = expected[:, -1].argmax(-1, keepdim=True)  # each row's greedy token after its prompt
        expected = expected[real].float()
        replay = _Replay(trace, stages, real, probes if batch == 0 else None)
        with converted.streaming(replay.observe):
            actual, converted_cache = prompt_pass(converted, ids, mask, positions)
        actual = actual[real].float()
        if len(trace.inputs) != replay.layers:
            counts = (len(trace.inputs), replay.layers)
            break
        caches = [reference_cache, converted_cache]
        reference_steps, converted_steps = forced_decode(reference, converted, (ids, mask, positions), first, caches)
        expected_steps.append(reference_steps)
        actual_steps.append(converted_steps)
        _stage(stages, HEAD).add(expected, replay.head, None, actual)
        expected_logits.append(expected)
        actual_logits.append(actual)

    if counts is not None:
        return _layer_counts_differ(dtype, *counts)
    overflowing = next((stage.name for stage in stages.values() if not stage.finite), None)
    if overflowing is not None:
        raise reference_overflows(reference.name, dtype, overflowing)
    ref_logits, logits = joined(expected_logits), joined(actual_logits)
    diff = (ref_logits - logits).abs()
    scale = ref_logits.abs().max().item()
    tolerance = relative * max(1.0, scale)
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    layers = [stage.result(relative) for stage in stages.values()]
    max_diff = diff.max().item()
    top1_needed = 1.0 if dtype == torch.float32 else HALF_TOP1_MIN
    ref_steps, steps = torch.cat(expected_steps), torch.cat(actual_steps)
    if not torch.isfinite(ref_steps).all():
        raise reference_overflows(reference.name, dtype, "a decode step")
    decode_max = (ref_steps - steps).abs().max().item()
    decode_tolerance = relative * max(1.0, scale, ref_steps.abs().max().item())  # as the whole-model check's
    decode_agrees = decode_max <= decode_tolerance  # NaN (a non-finite step of the converted model's) does not
    unreached = [
        *probes.stages(dtype),
        *position_stages(reference.model, converted.model, dtype),
        *deepstack_stage(reference.model, converted.model),
    ]
    prompts_pass = all(layer.passed for layer in layers) and max_diff <= tolerance and top1 >= top1_needed
    passed = prompts_pass and decode_agrees and all(layer.passed for layer in unreached)
    failing = next((layer.name for layer in [*layers, *unreached] if not layer.passed), None)
    if not passed and failing is None:
        failing = (
            GREEDY_ONLY
            if prompts_pass
            else "the logits (every stage agrees on the reference's inputs; the differences add up across layers)"
        )
    return DtypeParity(
        dtype=str(dtype).removeprefix("torch."),
        max_abs_diff=max_diff,
        mean_abs_diff=diff.mean().item(),
        logit_scale=scale,
        tolerance=tolerance,
        top1_agreement=top1,
        greedy_identical=None,
        greedy_prompts=None,
        greedy_token_agreement=None,
        passed=passed,
        first_divergence=failing,
        decode_max_abs_diff=decode_max,
        decode_tolerance=decode_tolerance,
        decode_steps=steps.shape[0] * steps.shape[1],
        layers=layers,
        unreached=unreached,
    )


@contextmanager
def said_of(reference: str) -> Iterator[None]:
    """Whatever transformers' ``reference`` class raises on the parity batch, said in one line: the reference's
    failure, not the conversion's (both modes)."""
    try:
        yield
    except ThinkerError:
        raise
    except Exception as err:  # whatever transformers' forward raises
        raise reference_fails(reference, err) from None


def prompt_pass(model: StreamedModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """(logits, the model's cache after the batch, or None for a model fed without one)."""
    if model.cached_call is None:
        return model(ids, mask, positions), None
    return model.run_cached(ids, mask, positions)


@torch.no_grad()
def forced_decode(
    reference: StreamedModel,
    converted: StreamedModel,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    token: torch.Tensor,
    caches: list,
    steps: int = LAYER_DECODE_STEPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` decode steps of both models after ``batch`` (ids, mask, positions), each row fed the reference's
    greedy token (both models the same one, so every step compares): the reference's and the converted model's
    logits, each (B, steps, vocab) in float32. ``token``: (B, 1), the reference's greedy token after the batch;
    ``caches``: each model's cache after it, None for a model without one (it takes the whole sequence again each
    step)."""
    ids, mask, positions = batch
    taken: list[list[torch.Tensor]] = [[], []]
    for _ in range(steps):
        ids, mask = torch.cat([ids, token], dim=1), torch.cat([mask, torch.ones_like(token)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        for side, model in enumerate((reference, converted)):
            with said_of(reference.name) if side == 0 else nullcontext(), model.streaming():
                if caches[side] is None:
                    logits = model(ids, mask, positions)
                else:
                    logits, caches[side] = model.run_cached(token, mask, positions[:, -1:], caches[side])
            taken[side].append(logits[:, -1].float())
        token = taken[0][-1].argmax(-1, keepdim=True)
    return torch.stack(taken[0], dim=1), torch.stack(taken[1], dim=1)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The batches' rows as one tensor, without a copy where there is one batch."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _layer_counts_differ(dtype: torch.dtype, reference: int, converted: int) -> DtypeParity:
    nan = float("nan")
    return DtypeParity(
        dtype=str(dtype).removeprefix("torch."),
        max_abs_diff=nan,
        mean_abs_diff=nan,
        logit_scale=nan,
        tolerance=nan,
        top1_agreement=0.0,
        greedy_identical=None,
        greedy_prompts=None,
        greedy_token_agreement=None,
        passed=False,
        first_divergence=f"layer count ({reference} reference, {converted} converted): the layer counts differ",
    )


def hidden_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder layer is called with: its first positional argument, or ``hidden_states=``."""
    return args[0] if args else kwargs["hidden_states"]


def hidden_output(output: Any) -> torch.Tensor:
    """A decoder layer's output hidden states (transformers 5 layers return the tensor; older ones a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def without_cache(kwargs: dict) -> dict:
    """A Thinker decoder layer's keyword arguments without its cache: run again on the reference's hidden states, it
    must not write them into the cache its own pass keeps for the decode steps (an empty cache and none are the
    same function for a prompt)."""
    return {**kwargs, **{name: None for name in ("cache", "past_key_values") if name in kwargs}, "use_cache": False}


def with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


@dataclass
class _Trace:
    """The reference's hidden states entering and leaving each decoder layer, in the order the layers ran."""

    probes: Probes | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    def record_reference(self, unit: Unit, args: tuple, kwargs: dict, output: Any) -> None:
        if self.probes is not None:
            self.probes.take("reference", unit.module, unit.is_layer)
        if unit.is_layer:
            entering = hidden_input(args, kwargs).detach()
            # a layer's input is most often the layer before's output, which is kept once (half the trace's memory)
            if self.outputs and torch.equal(entering, self.outputs[-1]):
                self.inputs.append(self.outputs[-1])
            else:
                self.inputs.append(entering.clone())
            self.outputs.append(hidden_output(output).detach().clone())


@dataclass
class _Replay:
    """The Thinker's own hidden states, and each of its layers run again on the reference's input to that layer,
    compared as each layer runs into ``stages`` at the ``real`` tokens (nothing kept per layer: the reference's trace
    is the only copy of the batch's hidden states held for every layer)."""

    trace: _Trace
    stages: dict[str, _Stage]
    real: torch.Tensor
    probes: Probes | None = None
    layers: int = 0  # how many of the Thinker's decoder layers ran
    normed: torch.Tensor | None = None
    head: torch.Tensor | None = None  # final norm and head on the reference's last hidden state, real positions

    def observe(self, unit: Unit, args: tuple, kwargs: dict, output: Any) -> None:
        if self.probes is not None:
            self.probes.take("converted", unit.module, unit.is_layer)
        if unit.is_layer:
            index, own = self.layers, hidden_output(output)
            self.layers += 1
            if index == 0 and self.trace.inputs:
                _stage(self.stages, EMBEDDINGS).add(self.trace.inputs[0], hidden_input(args, kwargs), self.real)
            if index < len(self.trace.inputs):
                # ``forward`` rather than the module call: the hooks that load and drop the unit must not run again.
                hidden = self.trace.inputs[index].to(own.dtype)
                args, kwargs = with_hidden(args, without_cache(kwargs), hidden)
                forced = hidden_output(unit.module.forward(*args, **kwargs))
                _stage(self.stages, f"layer {index}").add(self.trace.outputs[index], forced, self.real, own)
        elif unit.name in THINKER_FINAL_NORMS and self.trace.outputs:
            self.normed = hidden_output(unit.module.forward(self.trace.outputs[-1]))
        elif unit.name == THINKER_HEAD and self.normed is not None:
            self.head = unit.module.forward(self.normed[self.real]).float()  # the real positions' alone


def _stage(stages: dict[str, _Stage], name: str) -> _Stage:
    return stages.setdefault(name, _Stage(name))


def _worst(held: float, new: float) -> float:
    """The larger difference, NaN (a converted layer gone NaN) kept whichever comes first: Python's ``max(0.0, nan)``
    is 0.0, which would pass the stage."""
    return math.nan if math.isnan(held) or math.isnan(new) else max(held, new)


@dataclass
class _Stage:
    """One stage's differences over every batch, at real tokens only."""

    name: str
    max_abs_diff: float = 0.0
    total: float = 0.0
    count: int = 0
    scale: float = 0.0
    stream_max_abs_diff: float | None = None
    finite: bool = True  # the reference's own output held no inf or NaN

    def add(
        self,
        expected: torch.Tensor,
        actual: torch.Tensor | None,
        real: torch.Tensor | None,
        own: torch.Tensor | None = None,
    ) -> None:
        """(batch, slots, width) outputs compared at the ``real`` slots, or, with ``real`` None, (rows, width) ones
        already taken there."""

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            return (tensor if real is None else tensor[real]).float()

        expected = rows(expected)
        self.finite = self.finite and bool(torch.isfinite(expected).all())
        self.scale = max(self.scale, expected.abs().max().item())
        wanted = expected.shape if real is None else (*real.shape, expected.shape[-1])
        if actual is None or actual.shape != wanted:
            self.max_abs_diff = float("inf")  # the converted model produced nothing comparable here
            return
        diff = (expected - rows(actual)).abs()
        self.max_abs_diff = _worst(self.max_abs_diff, diff.max().item())
        self.total += diff.sum().item()
        self.count += diff.numel()
        if own is not None:
            stream = (expected - rows(own)).abs().max().item()
            self.stream_max_abs_diff = _worst(self.stream_max_abs_diff or 0.0, stream)

    def result(self, relative: float) -> LayerParity:
        tolerance = relative * max(1.0, self.scale)
        return LayerParity(
            name=self.name,
            max_abs_diff=self.max_abs_diff,
            mean_abs_diff=self.total / self.count if self.count else float("nan"),
            scale=self.scale,
            tolerance=tolerance,
            passed=self.max_abs_diff <= tolerance,
            stream_max_abs_diff=self.stream_max_abs_diff,
        )
