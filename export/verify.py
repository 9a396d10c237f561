"""``thinker export --verify``: onnxruntime against the PyTorch Thinker, step by step.

The left-padded batch of ``thinker_common/parity_inputs.py`` goes through prefill and then several single-token decode
steps in both runtimes, each fed the same (PyTorch-greedy) tokens. Logits are compared at every kept position; pads
carry no meaning in either runtime and are left out. The tolerance is relative to the logit scale, as in DESIGN.md:
``RELATIVE_TOLERANCE``, the converter's gate's in float32 (in half precision the gate, two PyTorch models in one
dtype, holds its own tighter ``GATE_TOLERANCE``), or, for the batch and the long prompts, ``SENSITIVITY_MARGIN`` times
those prompts' own rounding sensitivity where that is larger, up to ``SENSITIVITY_CAP`` times the scale's
(``rounding_sensitivity``: how far 8 float32 ulps on their input embeddings move the PyTorch logits; on an
ill-conditioned model any two sound float32 implementations part further than the logit scale says).

That batch reaches position 12 and a cache of 13 slots, so two long prompts follow (``long_prompts``:
``thinker_common/parity_inputs.py`` LONG_PROMPT_LENGTHS, cut to the context): an attention window, the plain hybrid
graph's chunked delta rule and far positions are exercised there, each pass held at its own logit scale's tolerance.
The RoPE tables the graph ships are compared with the model's rotary embedding at every row (export/beyond_prompts.py).
The batch's rows also go through ``model.onnx`` padded on both sides with their positions given (``PADDED_AROUND``):
a graph or runtime right for left padding alone passes every left-padded pass. And a prompt of the vocabulary's
edge ids (``VOCABULARY_EDGES``), which random prompts almost never hold.

The reference is the PyTorch Thinker in float32 whatever the export's dtype: the exact model, against which a
half-precision graph is held to its dtype's tolerance. A reference in the export's own half precision rounds
differently from onnxruntime's kernels (its MoE routing and accumulation orders are PyTorch's CPU ones), so the two
can sit further apart than either from float32: measured on an H200, a bfloat16 Qwen3-MoE graph was 0.066 from
float32 (tolerance 0.158) but 0.55 from PyTorch's bfloat16 (bench/results/gpu-half-reference.txt). Where no CUDA runs,
a bfloat16 export is checked widened to float32 against the reference holding its rounded weights (``verify_widened``).

Where the export also wrote onnxruntime-genai's graph (``model.genai.onnx``, export/genai_graph.py), that graph is
checked the same way after ``model.onnx``, one session at a time, on the batch's rows padded on the right (the only
layout it takes), against the same reference: each row's own result. Either graph beyond tolerance fails the export.

The onnxruntime session holds the whole graph; the PyTorch model is held whole beside it where both fit in the
memory available (or ``THINKER_VERIFY_MEMORY``), else streamed: built on the meta device and read from the Thinker
folder one layer at a time as it runs (``converter.streamed``, as the converter's parity check runs at any size),
which checks the same shipped graph on the same inputs in the memory of the graph and one layer. ``verify_plan``
decides before the export starts, and refuses a model for which neither fits, rather than let the kernel kill the
process once the export is written.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from converter.parity import MEMORY_BUDGET_ENV, memory_budget
from thinker.configuration_thinker import ThinkerConfig
from thinker.modeling_thinker import CACHE_ARG, lowest_block_wins_ties
from thinker_common.dtypes import dtype_name
from thinker_common.eager import EAGER
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import (
    CONTINUATION_DECODE_STEPS,
    DEEP_DECODE_STEPS,
    LONG_DECODE_STEPS,
    PROMPT_LENGTHS,
    RELATIVE_TOLERANCE,
    foreign_block_prompt,
    foreign_deepstack,
    image_block_positions,
    indexer_batch,
    long_batch,
    parity_batch,
    vocabulary_edges,
)
from thinker_common.progress import progress_bar
from thinker_common.side_files import read_json
from thinker_common.sizes import human_size
from thinker_common.sources import SafetensorsSource
from thinker_common.staging import free_bytes, outside_staging

from .beyond_prompts import attention_window_check, rope_table_check
from .continuation import compare_continuation
from .decoder_graph import rope_tables
from .deep_cache import compare_deep, not_run_reason, slots_within
from .exact_reference import EXACT_DTYPE, FLOAT32_REFUSAL, FLOAT64_REFUSAL, REFUSED_BY_BOTH, running_exactly
from .genai_config_check import genai_config_failures
from .genai_graph import takes_stream_positions
from .half_spread import HALF_PRECISIONS, MAX_EXCUSED_SHARE, HalfShadow, excused, graph_distances, scaled_at_random
from .names import EMBED_FILE, EMBEDS_MODEL_FILE, GENAI_MODEL_FILE, MODEL_FILE, ROPE_SIN_TABLE, ROPE_TABLE
from .onnx_folder import graph_context
from .providers import cuda_usable
from .reference_replay import ReferenceReplay, replay_of, run_key
from .routing import ROUTER_TOLERANCE, RouteFollower, checked_probes
from .runtime import OnnxDecoder, position_ids_from_mask
from .widened import WIDENED, widened_folder

DECODE_STEPS = 6
REFERENCE_DTYPE = torch.float32  # the PyTorch model's dtype, whatever the graph's (module docstring)
# Positions whose logits Agreement.add compares at once (float64 differences: 16 x a 248k vocabulary = 32 MB).
ADD_CHUNK = 16

# The float graphs' tolerance floor on ill-conditioned inputs (the export's check, and a quantized export's check
# of its graph with float activations): SmolLM2's residual stream carries "massive
# activations" (values near 23,000 after layer 11) from which the logits come out by cancellation, so at some
# positions any two float32 implementations part far beyond 1e-4 x the logit scale. Measured on its default int4
# export with the tied embedding quantized (the parity batch's second row, second token): PyTorch float32 5.8e-4
# off float64, onnxruntime's float MatMul graph 4.7e-3, its MatMulNBits (float activations) 1.8e-2, against a
# tolerance of 3.6e-3; the same position moves 1.0e-2 when the input embeddings move by 2^-20 (8 float32 ulps),
# ~50x more than the other positions. So the reference's own sensitivity is measured that way (6.4e-3 over the
# batch there, onnxruntime 3.2x that) and the tolerance is at least SENSITIVITY_MARGIN times it (2.5x room above
# that 3.2x): on well-conditioned inputs (the tiny test models, where planted graph bugs land 10x beyond the
# tolerance) it stays the float graphs' 1e-4 x the logit scale.
SENSITIVITY_PERTURBATION = 2.0**-20
SENSITIVITY_MARGIN = 8.0
# A float export's check widens the logit scale's tolerance by at most this factor (``float_export_tolerance``). The
# sound tiny random Qwen3.5-VL needs 1.27x on its long prompts (1.05e-3 against 8.3e-4 fused, 1.12e-3 plain), where
# 8 x its sensitivity is 36x: there a float16 round trip of the plain graph's chunked delta-rule state (2.2e-3, 2.65x)
# passed, and the intra-chunk decay's (1.3e-2) passed the long prompts (a mutation run). SmolLM2 and the tiny test
# models' sensitivities stay under the scale's tolerance, which they keep. (A quantized export's graph check keeps
# the whole 8x: on SmolLM2's int4 export its MatMulNBits part from PyTorch 5x beyond the scale's tolerance, 1.8e-2
# against 3.6e-3.)
SENSITIVITY_CAP = 2.0

# A bfloat16 export checked widened to float32 (``verify_widened``) is held to one bfloat16 ulp of the logit scale,
# 13x tighter than its own check on CUDA (RELATIVE_TOLERANCE). Widened, it runs the reference's arithmetic with the
# reference's weights, and parts from it only by scalars the graph writes in its own dtype, each rounded by up to
# 2^-9 (GELU's coefficients, the attention scale and Qwen3.8's gate were such, and are now applied in float32); the
# margin is for such a scalar in a graph yet to come. Every tiny family and SmolLM2, fused and plain: the tiny
# hybrids the furthest, 3.0e-5 x the scale, the rest at float32's 1e-6 (`python bench/bench_widened.py`,
# bench/results/widened.json).
WIDENED_BFLOAT16 = "bfloat16, widened to float32"
TOLERANCES: dict[torch.dtype | str, float] = {**RELATIVE_TOLERANCE, WIDENED_BFLOAT16: 2.0**-8}

# compare_decoders' candidate_padding: the rows onnxruntime gets, from the (left-padded) batch given (CANDIDATE_ROWS)
AS_GIVEN, RIGHT, AROUND = "as given", "right", "around"

# How --verify holds the PyTorch model (verify_plan).
WHOLE, STREAMED = "whole", "streamed"


@dataclass
class Agreement:
    """Running figures over every compared position."""

    max_abs_diff: float = 0.0
    abs_diff_sum: float = 0.0
    logit_scale: float = 0.0
    positions: int = 0
    top1_equal: int = 0
    per_step: list[float] = field(default_factory=list)
    half_spread: float | None = None  # the largest half-precision spread, where one is measured
    beyond_spread: float = 0.0  # the largest difference not excused by its position's spread
    excused_differences: list[float] = field(default_factory=list)  # those of the excused positions
    nonfinite: int = 0  # positions whose candidate logits hold inf or NaN

    def add(self, reference: np.ndarray, candidate: np.ndarray, spread: np.ndarray | None = None) -> None:
        """Adds (N, V) logits of the same N positions; ``spread``: (N,) the reference's own half-precision spread
        at each (export/half_spread.py), which excuses a difference within HALF_SPREAD_MARGIN times it. A position
        whose candidate holds inf or NaN is counted apart (a NaN compares as no difference at all). Taken
        ADD_CHUNK positions at a time: a long prompt's float64 differences over a 150k vocabulary would otherwise
        hold gigabytes."""
        step_max = 0.0
        for start in range(0, reference.shape[0], ADD_CHUNK):
            part = slice(start, start + ADD_CHUNK)
            step_max = max(
                step_max, self._add(reference[part], candidate[part], None if spread is None else spread[part])
            )
        self.per_step.append(step_max)

    def _add(self, reference: np.ndarray, candidate: np.ndarray, spread: np.ndarray | None) -> float:
        diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
        finite = np.isfinite(diff).all(axis=-1)
        self.nonfinite += int((~finite).sum())
        diff[~finite] = 0.0
        self.max_abs_diff = max(self.max_abs_diff, float(diff.max()))
        held = diff.max(axis=-1)
        if spread is not None:
            self.half_spread = max(self.half_spread or 0.0, float(np.nan_to_num(spread).max()))
            kept = ~excused(held, spread)
            self.excused_differences += held[~kept].tolist()
            held = held[kept]
        self.beyond_spread = max(self.beyond_spread, float(held.max(initial=0.0)))
        self.abs_diff_sum += float(diff.mean(axis=-1).sum())
        self.logit_scale = max(self.logit_scale, float(np.abs(reference).max()))
        self.positions += reference.shape[0]
        self.top1_equal += int((reference.argmax(-1) == candidate.argmax(-1)).sum())
        return float(diff.max())

    def figures(self) -> dict:
        figures = {
            "max_abs_diff": self.max_abs_diff,
            "mean_abs_diff": self.abs_diff_sum / max(self.positions, 1),
            "logit_scale": self.logit_scale,
            "top1_agreement": self.top1_equal / max(self.positions, 1),
            "positions": self.positions,
            "max_abs_diff_per_step": self.per_step,  # prefill first, then each decode step
        }
        if self.half_spread is not None:
            figures["half_precision_spread"] = self.half_spread
            figures["max_abs_diff_beyond_spread"] = self.beyond_spread
            figures["excused_differences"] = self.excused_differences  # ``judge`` turns them into a count
        if self.nonfinite:
            figures["nonfinite_positions"] = self.nonfinite
        return figures


def half_shadow(model: torch.nn.Module, dtype: torch.dtype) -> HalfShadow | None:
    """The shadow a ``dtype`` graph's comparisons share, or None for a float32 one."""
    return HalfShadow(model, dtype) if dtype in HALF_PRECISIONS else None


def judge(figures: dict, tolerance: float, against: str = "", excusable: int = 0) -> str | None:
    """The failure of a comparison's ``figures`` at ``tolerance``, or None; called once per comparison. Logits
    holding inf or NaN fail. A half-precision graph's positions within twice the reference's own half-precision
    spread there are excused (export/half_spread.py), but only a few: where more than MAX_EXCUSED_SHARE of the
    positions need it (or more than ``excusable``, where more: ``judged_beside``), the dtype cannot hold the model's
    logits and the check could not tell a graph bug from rounding, so it fails saying so. Adds
    ``positions_excused``, those beyond the tolerance that were excused."""
    if figures.get("nonfinite_positions"):
        return (
            f"onnxruntime's logits hold inf or NaN at {figures['nonfinite_positions']} of {figures['positions']} "
            f"positions{against}: the graph overflows (export float32, or bfloat16 on CUDA, for a model whose "
            "activations float16 cannot hold)"
        )
    router = figures.get("router_max_abs_diff_beyond_spread", figures.get("router_max_abs_diff"))
    if router is not None:  # a half-precision MoE graph's routing, followed by the reference (export/routing.py)
        figures["router_tolerance"] = limit = ROUTER_TOLERANCE
        if router > limit:
            first = figures.get("router_first_layer_beyond")
            where = f", first at layer {first}'s router" if first is not None else ""
            left_out = " (leaving out tokens within twice the reference's own half-precision rounding)"
            return (
                f"the graph's MoE routers' probabilities lie {router:.3g} from the reference's{against}"
                f"{left_out if figures.get('routers_excused') else ''} > tolerance {limit:.3g}{where} (a router "
                "computing other logits: its weight or its layer, or its input, moved by a bug in that layer or "
                "before it)"
            )
    excused = figures.pop("excused_differences", None)
    if excused is not None:
        figures["positions_excused"] = needed = sum(difference > tolerance for difference in excused)
        if needed > max(MAX_EXCUSED_SHARE * figures["positions"], excusable):
            return (
                f"{needed} of {figures['positions']} positions lie beyond the tolerance {tolerance:.3g}{against}, "
                "where half precision moves the reference as far from float32: half precision cannot hold this "
                "model's logits, so the check cannot tell a graph bug from rounding; export float32 (or bfloat16 on "
                "CUDA), or pass --no-verify"
            )
    held = figures.get("max_abs_diff_beyond_spread", figures["max_abs_diff"])
    if held <= tolerance:
        return None
    left_out = ""
    if figures.get("positions_excused"):
        left_out = " (leaving out positions within twice the reference's own half-precision rounding)"
    return f"max |Δlogit| {held:.3g}{against}{left_out} > tolerance {tolerance:.3g}"


def compare_decoders(
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    steps: int = DECODE_STEPS,
    on_step: Callable[[], object] | None = None,
    candidate_padding: str = AS_GIVEN,
    torch_ties: bool = False,
    shadow: HalfShadow | None = None,
    foreign_embeddings: bool = False,
    image_positions: bool = False,
    replay: ReferenceReplay | None = None,
) -> dict:
    """Prefill + ``steps`` decode steps in PyTorch and onnxruntime; figures over every kept position (of a
    ``--logits last`` graph's prefill: each row's last kept position, all it gives). ``on_step`` is called after the
    prefill and after each decode step (a progress bar's ``update``). ``candidate_padding``: onnxruntime gets the
    rows as given (AS_GIVEN), padded on the right (RIGHT: onnxruntime-genai's layout, which its graph
    ``model.genai.onnx`` takes), or on both sides with the positions passed (AROUND: ``padded_around``); PyTorch
    always the batch as given: each row's own result is the reference, as transformers defines it with left padding
    (a right-padded PyTorch batch would carry a hybrid model's recurrence over the pads, as no runtime should).
    Qwen3.8's indexers give exact ties to the earlier blocks, as ONNX's TopK does (``lowest_block_wins_ties``);
    ``torch_ties``: torch.topk's choice instead, transformers'. ``shadow``: for a half-precision graph, the reference
    run again in its dtype to measure each position's spread (``half_shadow``; export/half_spread.py).
    ``foreign_embeddings``: the prompt goes in as ``inputs_embeds`` (``decoder`` runs ``model.embeds.onnx``), its
    token rows with a block of foreign vectors written over them, at an image's multimodal positions where the model
    has multimodal RoPE (``foreign_block_prompt``); the decode steps' tokens then go through ``embed.onnx``.
    ``image_positions``: the token ids at the (3, B, T) positions of a prompt holding an image
    (``image_block_positions``), for a graph with multimodal RoPE: its three streams then differ, as text positions
    never make them. ``replay``: the reference's runs recorded by an earlier comparison of the same inputs, read back
    rather than run again (export/reference_replay.py)."""
    ties = contextlib.nullcontext() if torch_ties else lowest_block_wins_ties()
    if shadow is not None:
        shadow.rewind()  # the same reference steps as any earlier comparison: their spreads read back
    with torch.no_grad(), ties:
        return _compare_decoders(
            model,
            decoder,
            input_ids,
            attention_mask,
            steps,
            on_step,
            candidate_padding,
            shadow,
            foreign_embeddings,
            image_positions,
            replay_of(None if torch_ties else replay),  # a run's key holds no tie rule: transformers' runs apart
        )


def _compare_decoders(
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    steps: int,
    on_step: Callable[[], object] | None,
    candidate_padding: str,
    shadow: HalfShadow | None,
    foreign_embeddings: bool,
    image_positions: bool,
    replay: ReferenceReplay,
) -> dict:
    on_step = on_step or (lambda: None)
    agreement = Agreement()
    mask = torch.from_numpy(attention_mask)
    if foreign_embeddings:
        tokens = model.get_input_embeddings()(torch.from_numpy(input_ids)).float().numpy()
        embeds, position_array, foreign = foreign_block_prompt(tokens, attention_mask, decoder.position_rank == 3)
        positions = torch.from_numpy(position_array)
        inputs = {"inputs_embeds": torch.from_numpy(embeds), "attention_mask": mask, "position_ids": positions}
        deepstack = {}
        if decoder.deepstack_layers:  # Qwen3-VL's: features added at the foreign slots after the first layers
            features = foreign_deepstack(foreign, decoder.deepstack_layers, embeds.shape[-1], float(embeds.std()))
            deepstack = {"visual_pos_masks": foreign, "deepstack_visual_embeds": features}
            inputs |= {"visual_pos_masks": torch.from_numpy(foreign)}
            inputs |= {"deepstack_visual_embeds": [torch.from_numpy(f) for f in features]}
    else:
        position_array = image_block_positions(attention_mask)[0] if image_positions else None
        text_positions = position_ids_from_mask(attention_mask)
        positions = torch.from_numpy(text_positions if position_array is None else position_array)
        inputs = {"input_ids": torch.from_numpy(input_ids), "attention_mask": mask, "position_ids": positions}
    # the graph runs first at each step: a half-precision MoE graph's routing is followed by the reference's run
    # (export/routing.py)
    follower = RouteFollower.of(model, decoder)
    given = CANDIDATE_ROWS[candidate_padding](input_ids, attention_mask)
    if candidate_padding == AROUND:  # the caller's positions, which the runtime carries on into the decode steps
        if position_array is not None:
            raise ValueError("candidate_padding=AROUND takes the rows' text positions only")
        position_array = position_ids_from_mask(given[1])
    if foreign_embeddings:  # its token rows from embed.onnx, as a caller builds a prompt: a wrong lookup shows
        rows = np.where(foreign[..., None], embeds, decoder.embed(input_ids))
        candidate, state = decoder.prefill(
            None, attention_mask, inputs_embeds=rows, position_ids=position_array, **deepstack
        )
    else:
        candidate, state = decoder.prefill(*given, position_ids=position_array)
    follows, reference_past = bool(follower.probes), []

    def prefill_reference() -> tuple[np.ndarray, np.ndarray | None]:
        with follower.reference(decoder.probed, given[1], attention_mask):
            out = model(**inputs, use_cache=True)
            distances = None  # where the graph lands, for the spread to cover (HalfShadow.spread)
            if shadow is not None and decoder.last_logits_only:
                alone = np.ones(candidate.shape[:2], bool)
                distances = graph_distances(out.logits, candidate, last_kept_slots(attention_mask), alone)
            elif shadow is not None:
                kept = attention_mask.astype(bool)
                distances = graph_distances(out.logits, candidate, kept, given[1].astype(bool))
            spread = follower.spread(shadow, out.logits, distances, **inputs)  # (B, T)
        reference_past.append(getattr(out, CACHE_ARG))
        return out.logits.float().numpy(), spread

    key = run_key("", inputs, shadow is None)
    reference, spread = replay.run(key, follows, prefill_reference)
    if decoder.last_logits_only:
        last_spread = None if spread is None else at_last_kept(spread, attention_mask)
        agreement.add(at_last_kept(reference, attention_mask), candidate[:, 0], last_spread)
        if candidate_padding == AS_GIVEN and not decoder.left_padding_only:
            # Left padding puts every row's last token in the last slot; onnxruntime-genai pads on the right, where
            # only the mask tells a row's last token from its pads: the same rows padded so, prefill only (not for a
            # graph that refuses them, Qwen3.8's: LEFT_PADDING_ONLY).
            add_right_padded_prefill(
                agreement, model, decoder, input_ids, attention_mask, last_spread, follower, replay
            )
    else:  # the kept positions of each row, in order, whichever side its pads are
        kept = attention_mask.astype(bool)
        agreement.add(reference[kept], candidate[given[1].astype(bool)], None if spread is None else spread[kept])
    on_step()

    # each stream resumes one past the last slot's position, as transformers' generate continues (the batch is
    # left-padded: the last slot is each row's last token); the reference's own reckoning, apart from the runtime's
    next_position = positions[..., -1:] + 1
    token = reference[:, -1].argmax(-1)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = {"input_ids": torch.from_numpy(token[:, None]), "attention_mask": mask, "position_ids": next_position}
        candidate = decoder.decode_one_token(token, state)

        def step_reference(step: dict = step) -> tuple[np.ndarray, np.ndarray | None]:
            if not reference_past:  # read back so far: the cache it would continue was never made
                raise AssertionError("the reference's runs of this comparison were recorded in part")
            with follower.reference(decoder.probed):
                out = model(**step, use_cache=True, **{CACHE_ARG: reference_past[-1]})
                spread = follower.spread(shadow, out.logits[:, -1:], **step)
            reference_past[-1] = getattr(out, CACHE_ARG)
            return out.logits[:, -1].float().numpy(), None if spread is None else spread[:, -1]

        key = run_key(key, step)
        reference, spread = replay.run(key, follows, step_reference)
        agreement.add(reference, candidate, spread)
        next_position, token = next_position + 1, reference.argmax(-1)
        on_step()
    return {"batch": int(input_ids.shape[0]), "decode_steps": steps, **agreement.figures(), **follower.figures()}


def add_right_padded_prefill(
    agreement: Agreement,
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    spread: np.ndarray | None = None,
    follower: RouteFollower | None = None,
    replay: ReferenceReplay | None = None,
) -> None:
    """The left-padded batch's rows padded on the right instead, prefilled by both: each row's last real token's
    logits (what a ``--logits last`` graph gives) into ``agreement``; ``spread``: the half-precision spread of those
    tokens, measured on the left-padded rows; ``follower`` and ``replay``: the comparison's (export/routing.py,
    export/reference_replay.py)."""
    ids, mask = right_padded(input_ids, attention_mask)
    inputs = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "position_ids": torch.from_numpy(position_ids_from_mask(mask)),
    }
    candidate = decoder.prefill(ids, mask)[0][:, 0]
    follower = follower or RouteFollower.of(model, decoder)

    def reference() -> tuple[np.ndarray, None]:
        with follower.reference(decoder.probed, mask, mask):
            return at_last_kept(model(**inputs).logits.float().numpy(), mask), None

    logits, _ = replay_of(replay).run(run_key("", inputs, "last kept"), bool(follower.probes), reference)
    agreement.add(logits, candidate, spread)


def right_padded(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same rows with their kept slots moved to the front, in order: padded on the right instead."""
    order = np.argsort(1 - attention_mask, axis=1, kind="stable")
    return np.take_along_axis(input_ids, order, 1), np.take_along_axis(attention_mask, order, 1)


def padded_around(input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same rows with their kept slots moved to the middle, in order: half of each row's pads (rounded down)
    before them, the rest after, as a batch assembled by a server may come. A graph that reads padding from one side
    only (the last sum(mask) slots kept, a conv window or recurrent state taken from the last slots) fails here."""
    ids, mask = right_padded(input_ids, attention_mask)
    shifts = (attention_mask.shape[1] - attention_mask.sum(axis=1)) // 2
    order = (np.arange(attention_mask.shape[1])[None, :] - shifts[:, None]) % attention_mask.shape[1]
    return np.take_along_axis(ids, order, 1), np.take_along_axis(mask, order, 1)


CANDIDATE_ROWS = {
    AS_GIVEN: lambda input_ids, attention_mask: (input_ids, attention_mask),
    RIGHT: right_padded,
    AROUND: padded_around,
}


def at_last_kept(logits: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """(B, V): each row of (B, T, V) ``logits`` at its last position the mask keeps (the last for a row that keeps
    none), the position a ``--logits last`` graph picks."""
    return logits[last_kept_slots(attention_mask)]


def last_kept_slots(attention_mask: np.ndarray) -> np.ndarray:
    """(B, T) bool: each row's last slot the mask keeps (its last slot, for a row that keeps none)."""
    numbered = attention_mask * np.arange(1, attention_mask.shape[1] + 1)
    last = numbered.max(axis=1) - 1
    slots = np.zeros(attention_mask.shape, bool)
    slots[np.arange(len(slots)), np.where(last < 0, attention_mask.shape[1] - 1, last)] = True
    return slots


HALF_INDEXER_TIES = "a half-precision network may flip an indexer's near-tie; the float32 export is checked"


def indexer_failures(figures: dict, dtype: torch.dtype | str) -> list[str]:
    """The long prompts' verdict. float32 only: an indexer's choice is discrete, and where two of a query's blocks
    score within a few parts in a thousand, the rounding of a half-precision network's hidden states picks the other
    one, a logit difference no tolerance of the dtype covers, in transformers' own half-precision model as in the
    graph. The graph's indexer is the same nodes in every dtype, so the float32 export's check is the one that proves
    it; a half graph's figures are reported, marked so. (``dtype``: as ``scale_tolerance`` takes it.)"""
    if dtype in HALF_PRECISIONS:
        figures["judged"], figures["why"] = False, HALF_INDEXER_TIES
        return []
    figures["tolerance"] = tolerance = scale_tolerance(figures, dtype)
    failure = judge(figures, tolerance)
    return [f"on prompts long enough for the indexers to choose: {failure}"] if failure else []


def genai_graph_of(onnx_path: Path) -> Path | None:
    """onnxruntime-genai's graph beside ``onnx_path``, where the export wrote one (export/genai_graph.py)."""
    path = onnx_path.with_name(GENAI_MODEL_FILE)
    return path if path.is_file() else None


def embeds_graph_of(onnx_path: Path) -> Path | None:
    """The ``--inputs-embeds`` graph beside ``onnx_path``, where the export wrote one (export/embeds_graph.py)."""
    path = onnx_path.with_name(EMBEDS_MODEL_FILE)
    return path if path.is_file() else None


# The graphs an export writes beside model.onnx, by their figures' key in the report, as a failure names them.
SIDE_GRAPHS = {
    "genai_graph": f"{GENAI_MODEL_FILE} (onnxruntime-genai's graph, rows padded on the right)",
    "embeds_graph": f"{EMBEDS_MODEL_FILE} with {EMBED_FILE} (a prompt with foreign embeddings)",
}


def side_graph_failures(result: dict, tolerance: float | dict[str, float]) -> list[str]:
    """The failures of the side graphs whose figures ``result`` holds, judged at model.onnx's ``tolerance`` (or each
    at its own, by its key); onnxruntime-genai's graph, which runs the batch's own prompts, may excuse as many
    positions as model.onnx's comparison did (``judged_beside``: ``result`` judged first)."""
    failures = []
    for key, what in SIDE_GRAPHS.items():
        held = tolerance[key] if isinstance(tolerance, dict) else tolerance
        excusable = result.get("positions_excused", 0) if key == "genai_graph" else 0
        failure = judge(result[key], held, excusable=excusable) if key in result else None
        if failure:
            failures.append(f"{what}: {failure}")
    return failures


# The passes on the long prompts (parity_inputs.long_batch), by their figures' key in the report, as a failure
# names them; each holds its own "tolerance", set by the check that ran it.
LONG_PASSES = {
    "long_prompts": MODEL_FILE,
    "genai_graph_long_prompts": f"{GENAI_MODEL_FILE} (rows padded on the right)",
}


def long_prompts(model: torch.nn.Module, decoder: OnnxDecoder) -> tuple[np.ndarray, np.ndarray]:
    """The long batch for ``model``, cut to the context both it and the graph hold."""
    context = min(model.config.max_position_embeddings, decoder.context_length or model.config.max_position_embeddings)
    return long_batch(model.config.vocab_size, context)


def compare_long(model: torch.nn.Module, decoder: OnnxDecoder, batch: tuple[np.ndarray, np.ndarray], **options) -> dict:
    """``compare_decoders`` on the long ``batch`` and LONG_DECODE_STEPS steps, the prompts' lengths in the figures."""
    figures = compare_decoders(model, decoder, *batch, steps=LONG_DECODE_STEPS, **options)
    return {"prompt_lengths": batch[1].sum(axis=1).tolist(), **figures}


def unprompted_checks(onnx_path: Path, dtype: torch.dtype, config) -> tuple[dict, list[str]]:
    """What no prompt reaches, read off the export (export/beyond_prompts.py): the RoPE tables' figures, and the
    failures of those, of any attention window in ``model.onnx`` or a graph cut from it, and of genai_config.json
    against the graph it names (export/genai_config_check.py)."""
    tables, failure = rope_table_check(onnx_path, config, dtype)
    graphs = [onnx_path, genai_graph_of(onnx_path), embeds_graph_of(onnx_path)]
    windows = [attention_window_check(path) for path in graphs if path]
    genai = genai_config_failures(onnx_path.parent, config, graph_context(onnx_path)[0])
    return tables, [found for found in (failure, *windows, *genai) if found]


# onnxruntime-genai's graph's passes over the prompts of a model.onnx pass, by their figures' keys: the same reference
# runs, step for step (export/reference_replay.py), of which a --logits last graph compares a few positions.
COUNTERPARTS = {
    "genai_graph_long_prompts": "long_prompts",
    "genai_graph_deep_cache": "deep_cache",
    "genai_graph_continuation": "continuation",
}


def judged_beside(result: dict) -> None:
    """Each pass in COUNTERPARTS that ``result`` holds, at its counterpart's tolerance where that is wider: a
    --logits last graph's pass sees each row's last position and the decode steps, and takes its logit scale from
    those alone, where the prompts' logits reach further (on a tiny Qwen3.5-MoE in float16, 0.34 against model.onnx's
    0.438 on the long prompts: a QA run). (``judge`` takes the counterpart's excused positions as the number the pass
    may excuse: ``pass_failures``.)"""
    for key, counterpart in COUNTERPARTS.items():
        side, own = result.get(key), result.get(counterpart)
        if side and own and "not_run" not in side and "not_run" not in own:
            side["tolerance"] = max(side["tolerance"], own["tolerance"])


def pass_failures(
    result: dict, passes: dict[str, str], described: Callable[[dict], str], config=None, dtype=None
) -> list[str]:
    """The failures of ``passes`` (their figures' key -> the graph they ran) whose figures ``result`` holds, each at
    its own tolerance, named "GRAPH DESCRIBED: failure" (``described(figures)``); a pass that did not run is left
    out. A pass in COUNTERPARTS may excuse as many positions as its counterpart did (judged before it, ``passes``
    naming model.onnx's first): those are positions of the same prompts that half precision cannot hold, which a
    pass of a few positions would otherwise fail for one of them alone (MAX_EXCUSED_SHARE of 8 positions: 0.8). With
    ``config`` and ``dtype``: Qwen3.8's indexers choose on these prompts, so in half precision they are reported,
    not judged, as its indexer prompts are."""
    failures = []
    for key, what in passes.items():
        figures = result.get(key)
        if not figures or "not_run" in figures:
            continue
        if config is not None and config.has_indexed_attention and dtype != torch.float32:
            figures["judged"], figures["why"] = False, HALF_INDEXER_TIES
            continue
        excusable = result.get(COUNTERPARTS.get(key), {}).get("positions_excused", 0)
        failure = judge(figures, figures["tolerance"], excusable=excusable)
        if failure:
            failures.append(f"{what} {described(figures)}: {failure}")
    return failures


def long_prompt_failures(result: dict, config, dtype: torch.dtype) -> list[str]:
    """The long passes' failures (``pass_failures``)."""

    def described(figures: dict) -> str:
        lengths = " and ".join(map(str, figures["prompt_lengths"]))
        return f"on prompts of {lengths} tokens, then {figures['decode_steps']} steps"

    return pass_failures(result, LONG_PASSES, described, config, dtype)


# The deep-cache passes (export/deep_cache.py), by their figures' key in the report, as a failure names them.
DEEP_PASSES = {
    "deep_cache": MODEL_FILE,
    "genai_graph_deep_cache": f"{GENAI_MODEL_FILE} (onnxruntime-genai's graph)",
}


def deep_cache_pass(model: torch.nn.Module, decoder: OnnxDecoder, dtype: torch.dtype, **options) -> dict:
    """The deep-cache pass's figures, or why it was not run (``not_run``); ``options``: ``compare_deep``'s."""
    why = not_run_reason(model.config, dtype)
    if not why and options.get("most_slots", 1) <= 0:
        why = NO_MEMORY_LEFT
    if why:
        return {"not_run": why}
    agreement = Agreement()
    with torch.no_grad():
        where = compare_deep(model, decoder, agreement.add, **options)
    return {**where, **agreement.figures()}


# The continuation passes (export/continuation.py), by their figures' key in the report, as a failure names them.
CONTINUATION_PASSES = {
    "continuation": MODEL_FILE,
    "genai_graph_continuation": f"{GENAI_MODEL_FILE} (onnxruntime-genai's graph)",
}
CONTINUATION_STEPS = 2 + CONTINUATION_DECODE_STEPS  # a progress bar's: the prompt, the continuation, the steps


def continuation_pass(model: torch.nn.Module, decoder: OnnxDecoder, **options) -> dict:
    """The continuation pass's figures; ``options``: ``compare_continuation``'s."""
    agreement = Agreement()
    with torch.no_grad():
        where = compare_continuation(model, decoder, agreement.add, **options)
    return {**where, **agreement.figures()}


def continuation_failures(result: dict, config, dtype: torch.dtype) -> list[str]:
    """The continuation passes' failures (``pass_failures``)."""

    def described(figures: dict) -> str:
        lengths = f"{figures['prompt_length']} tokens continued by {figures['continued_by']}"
        return f"on a prompt of {lengths} in one step, then {CONTINUATION_DECODE_STEPS} steps"

    return pass_failures(result, CONTINUATION_PASSES, described, config, dtype)


# The pass over the parity batch at an image's multimodal positions (``compare_decoders``' ``image_positions``), by
# its figures' key in the report.
IMAGE_POSITIONS = "image_positions"


def image_position_failures(result: dict) -> list[str]:
    """The failure of the image-positions pass, where ``result`` holds one beyond its own tolerance."""
    figures = result.get(IMAGE_POSITIONS)
    failure = judge(figures, figures["tolerance"]) if figures else None
    if not failure:
        return []
    lengths = " and ".join(map(str, PROMPT_LENGTHS))
    return [f"{MODEL_FILE} on prompts of {lengths} tokens at an image's multimodal positions: {failure}"]


# The pass over the parity batch's rows padded on both sides, their positions given (``compare_decoders``'
# ``candidate_padding=AROUND``), by its figures' key in the report: the batch itself is padded on the left, and
# model.onnx takes any padding (and is onnxruntime-genai's graph where the export wrote no model.genai.onnx).
PADDED_AROUND = "padded_around"


LEFT_PADDING_ONLY = "Qwen3.8's graph takes left-padded rows only (its PLE states carry each row's last slots on)"


def padded_around_pass(model: torch.nn.Module, decoder: OnnxDecoder, on_step=None, shadow=None, replay=None) -> dict:
    """The padded-around pass's figures, or why it was not run (``not_run``); ``replay``: the parity batch's
    comparison's (the reference runs the batch as given, whatever padding the graph gets)."""
    if decoder.left_padding_only:
        return {"not_run": LEFT_PADDING_ONLY}
    batch = parity_batch(model.config.vocab_size)
    options = {"on_step": on_step, "shadow": shadow, "replay": replay}
    return compare_decoders(model, decoder, *batch, candidate_padding=AROUND, **options)


def padded_around_failures(result: dict) -> list[str]:
    """The padded-around pass's failure (``pass_failures``)."""
    lengths = " and ".join(map(str, PROMPT_LENGTHS))
    described = f"on prompts of {lengths} tokens padded on both sides, their positions given, then {DECODE_STEPS} steps"
    return pass_failures(result, {PADDED_AROUND: MODEL_FILE}, lambda figures: described)


# The pass over a prompt of the vocabulary's edge ids (thinker_common/parity_inputs.py ``vocabulary_edges``), by
# its figures' key in the report: a lookup that sends an id at an edge to the wrong row (the mixed head's tied
# embedding gathering each id from its own table) is exact for every id away from it.
VOCABULARY_EDGES = "vocabulary_edges"
EDGE_DECODE_STEPS = 1


def edges_prompt(model: torch.nn.Module, onnx_path: Path, decoder: OnnxDecoder) -> tuple[np.ndarray, np.ndarray]:
    """The edge ids of ``model``'s vocabulary and of the splits of ``onnx_path``'s graph, cut to the context, as a
    batch of one with its mask."""
    from .quantize import split_rows

    splits = split_rows(onnx.load(str(onnx_path), load_external_data=False).graph)
    context = min(model.config.max_position_embeddings, decoder.context_length or model.config.max_position_embeddings)
    ids = vocabulary_edges(model.config.vocab_size, splits)[:, : max(1, context - 1 - EDGE_DECODE_STEPS)]
    return ids, np.ones_like(ids)


def vocabulary_edge_failures(result: dict) -> list[str]:
    """The vocabulary-edges pass's failure (``pass_failures``)."""

    def described(figures: dict) -> str:
        ids = ", ".join(map(str, figures["ids"]))
        return f"on a prompt of the vocabulary's edge ids ({ids}), then {EDGE_DECODE_STEPS} step"

    return pass_failures(result, {VOCABULARY_EDGES: MODEL_FILE}, described)


def vocabulary_edges_pass(
    model: torch.nn.Module, decoder: OnnxDecoder, onnx_path: Path, on_step=None, shadow=None
) -> dict:
    """The vocabulary-edges pass's figures, the ids it ran among them."""
    ids, mask = edges_prompt(model, onnx_path, decoder)
    figures = compare_decoders(model, decoder, ids, mask, steps=EDGE_DECODE_STEPS, on_step=on_step, shadow=shadow)
    return {"ids": ids[0].tolist(), **figures}


def batch_failure(failure: str) -> str:
    """A failure on the parity batch, named as every other pass's is."""
    lengths = " and ".join(map(str, PROMPT_LENGTHS))
    return f"{MODEL_FILE} on prompts of {lengths} tokens, then {DECODE_STEPS} steps: {failure}"


NO_MEMORY_LEFT = f"the memory the check's models leave ({MEMORY_BUDGET_ENV}, or what is available) holds no slot"


def deep_cache_steps(config, dtype: torch.dtype) -> int:
    """A progress bar's steps for one deep-cache pass: its prompt and decode steps, where it runs."""
    return 0 if not_run_reason(config, dtype) else 1 + DEEP_DECODE_STEPS


def deep_cache_failures(result: dict) -> list[str]:
    """The deep-cache passes' failures (``pass_failures``)."""

    def described(figures: dict) -> str:
        first, last = figures["step_positions"]
        return f"after a cache of {figures['cache_slots']} slots, at positions {first} to {last}"

    return pass_failures(result, DEEP_PASSES, described)


def verify_plan(model_dir: Path, dtype: torch.dtype, quantized: bool = False, graph_bytes: int | None = None) -> str:
    """How ``--verify`` will hold the PyTorch model: WHOLE when it fits whole beside what the check runs, else
    STREAMED (one layer at a time); a bfloat16 graph where no CUDA runs is checked widened to float32
    (``verify_widened``), and counted so. Raises, naming the sizes and what to do, when neither fits. The budget is
    all the memory available, or ``THINKER_VERIFY_MEMORY`` (unlike the converter's check, nothing cheaper waits
    behind this one).

    A float export's check holds the graph's session (about the model's bytes in ``dtype``) and the PyTorch model in
    float32 (``REFERENCE_DTYPE``). A quantized export's holds a session of its graph at a time (as shipped, for the
    quantization's cost, then with float activations), still counted as two (``graph_bytes`` each), as when both were
    held together (the plan errs on the side of memory), and the float32 model, whose weights it replaces by
    the dequantized ones one at a time; or, streamed, one layer in both forms.
    Before a quantized graph is written the exporter passes the size its layout will have (an upper bound,
    export/quantized_size.py, with the projections the activation-aware scales will cover at their coarser block:
    export/exporter.py ``planned_layout``), so that a budget too small is refused before the quantization and the
    size named is the one needed; it asks again with the size written, which the accuracy guard's float fallbacks
    can raise."""
    if dtype == torch.bfloat16 and not cuda_usable():
        dtype = torch.float32  # the graph widened to float32 is what runs (verify_widened)
    whole, streamed, held = held_bytes(model_dir, dtype, quantized, graph_bytes)
    budget = memory_budget(share=1.0)
    if whole <= budget:
        return WHOLE
    if streamed <= budget:
        return STREAMED
    limit = f"{MEMORY_BUDGET_ENV} allows" if os.environ.get(MEMORY_BUDGET_ENV) else "of memory available"
    # a source converted on the way lies in a staging folder, gone by the time the message is read
    named = model_dir if outside_staging(model_dir) == model_dir else "the model converted from SOURCE"
    raise ThinkerError(
        f"{named}: --verify holds at least {held}, {human_size(streamed, round_up=True)} with the graph in "
        f"{dtype_name(dtype)}, more than the {human_size(budget)} {limit}; export with --no-verify (`thinker verify "
        "SOURCE FOLDER` proves the Thinker folder against its source layer by layer, at any size), or where more "
        "memory is free"
    )


def held_bytes(
    model_dir: Path, dtype: torch.dtype, quantized: bool = False, graph_bytes: int | None = None
) -> tuple[int, int, str]:
    """(bytes held whole, bytes held streamed, what the streamed check holds, in words), as ``verify_plan`` counts
    them."""
    model, largest_unit = model_bytes(model_dir, REFERENCE_DTYPE if quantized else dtype)
    if quantized:
        graph = graph_bytes or 0
        held = "two sessions of the quantized graph and one PyTorch layer, float and dequantized"
        return 2 * graph + model + largest_unit, 2 * graph + 2 * largest_unit, held
    reference, reference_unit = model_bytes(model_dir, REFERENCE_DTYPE)
    return model + reference, model + reference_unit, "the graph and one PyTorch layer in float32"


def deep_slots(
    model_dir: Path,
    dtype: torch.dtype,
    plan: str,
    quantized: bool = False,
    graph_bytes: int | None = None,
    reference: torch.dtype = REFERENCE_DTYPE,
) -> int:
    """The deep-cache pass's random slots: as many as the memory ``plan`` leaves holds (export/deep_cache.py
    ``slots_within``; ``reference``: the dtype the reference runs in, its cache's), so that the pass never has a
    check refused that fits without it."""
    whole, streamed, _ = held_bytes(model_dir, dtype, quantized, graph_bytes)
    left = memory_budget(share=1.0) - (streamed if plan == STREAMED else whole)
    return slots_within(left, ThinkerConfig.from_pretrained(model_dir), dtype, reference)


def model_bytes(model_dir: Path, dtype: torch.dtype) -> tuple[int, int]:
    """(the model's weights, its largest streamed unit) in ``dtype``, from the folder's safetensors headers: the
    units are the decoder layers and the other modules (embeddings, norm, head), as ``converter.streamed`` loads
    them."""
    weights = SafetensorsSource(model_dir)
    try:
        units: dict[str, int] = {}
        for name in weights.names():
            parts = name.split(".")
            unit = ".".join(parts[:3]) if parts[1:2] == ["layers"] else name.rpartition(".")[0]
            units[unit] = units.get(unit, 0) + math.prod(weights.shape(name)) * dtype.itemsize
    finally:
        weights.close()
    return sum(units.values()), max(units.values(), default=0)


@contextmanager
def pytorch_thinker(
    model_dir: Path, dtype: torch.dtype, plan: str, rounded_to: torch.dtype | None = None
) -> Iterator[torch.nn.Module]:
    """The PyTorch Thinker of ``model_dir`` for the check: loaded whole (WHOLE), or built on the meta device with
    each layer read from the folder as it runs (STREAMED). ``rounded_to``: the folder's weights rounded to that dtype
    first, as an export in it holds them (export/weights.py), then run in ``dtype`` (``verify_widened``)."""
    from converter.layer_parity import load_layered_converted
    from thinker import ThinkerForCausalLM

    if plan != STREAMED:
        model = ThinkerForCausalLM.from_pretrained(model_dir, dtype=dtype, **EAGER).eval()
        if rounded_to is not None:
            weights = SafetensorsSource(model_dir)
            stored = set(weights.names())  # ThinkerWeights rounds every one the graph reads (export/weights.py)
            weights.close()
            for name, tensor in (*model.named_parameters(), *model.named_buffers()):
                if name in stored and tensor.is_floating_point():
                    tensor.data = tensor.data.to(rounded_to).to(dtype)
        yield model
        return
    streamed = load_layered_converted(model_dir, dtype, rounded_to)
    try:
        with streamed.streaming():
            yield streamed.model
    finally:
        streamed.close()


@torch.no_grad()
def rounding_sensitivity(
    model: torch.nn.Module, input_ids: np.ndarray, attention_mask: np.ndarray, last_only: bool = False
) -> float:
    """max |Δlogit| over the kept positions of the PyTorch prefill of the prompts given when their input embeddings
    are scaled by 1 ± SENSITIVITY_PERTURBATION (signs from a fixed seed): how far a few float32 roundings move the
    logits on this input, which bounds how far two sound float32 implementations may part on it. ``last_only``: at
    each row's last kept position alone, all a ``--logits last`` graph is compared at."""
    from .runtime import position_ids_from_mask

    ids, mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    positions = torch.from_numpy(position_ids_from_mask(attention_mask))
    embeddings = model.get_input_embeddings()(ids)
    ple = {"ple_input_ids": ids} if model.config.ple_layer_ids else {}  # Qwen3.8's n-grams hash the ids themselves
    logits = [
        model(inputs_embeds=e, attention_mask=mask, position_ids=positions, **ple).logits.float()
        for e in (embeddings, scaled_at_random(embeddings, SENSITIVITY_PERTURBATION, seed=0))
    ]
    kept = mask.bool()
    if last_only:
        kept &= mask.cumsum(-1) == mask.sum(-1, keepdim=True)
    return float((logits[1] - logits[0]).abs()[kept].max())


def scale_tolerance(figures: dict, dtype: torch.dtype | str) -> float:
    """The tolerance of ``figures``' logit scale alone: ``TOLERANCES`` × max(1, the scale), for a graph of
    ``dtype`` or one widened to float32 (WIDENED_BFLOAT16)."""
    return TOLERANCES[dtype] * max(1.0, figures["logit_scale"])


def graph_tolerance(figures: dict, dtype: torch.dtype | str) -> float:
    """The float graphs' tolerance on ``figures``' logit scale, or SENSITIVITY_MARGIN times the input's own
    rounding sensitivity where that is larger (where ``figures`` records one)."""
    return max(scale_tolerance(figures, dtype), SENSITIVITY_MARGIN * figures.get("rounding_sensitivity", 0.0))


def float_export_tolerance(figures: dict, dtype: torch.dtype | str) -> float:
    """``graph_tolerance``, at most SENSITIVITY_CAP times the logit scale's: a float export's check."""
    return min(graph_tolerance(figures, dtype), SENSITIVITY_CAP * scale_tolerance(figures, dtype))


def beyond_scale(dtype: torch.dtype | str, *passes: dict | None) -> bool:
    """Whether any of ``passes`` (None: not run) parts beyond the logit scale's tolerance."""
    return any(
        figures and "not_run" not in figures and figures["max_abs_diff"] > scale_tolerance(figures, dtype)
        for figures in passes
    )


def sensitivity_recorded(sensitivity: float | None) -> dict:
    return {} if sensitivity is None else {"rounding_sensitivity": sensitivity}


def verify_export(
    model_dir: Path,
    onnx_path: Path,
    dtype: torch.dtype,
    threads: int | None = None,
    progress: bool = False,
    plan: str = WHOLE,
    shipped: tuple[Path, torch.dtype] | None = None,
) -> dict:
    """The figures for the export report; ``passed`` is False beyond tolerance (``failure`` says how), None when it
    could not run. ``progress``: a bar over loading both models, the prefill and the decode steps; ``plan``: WHOLE
    or STREAMED (``verify_plan``); ``shipped``: (the graph as exported, its dtype) where ``onnx_path`` is a float32
    copy of it (``verify_widened``). A float32 graph refused on its logits is checked again against the reference
    run in float64, and passes where that run passes it (export/exact_reference.py). (A quantized export has its own
    checks: export/quantized_verify.py.)"""
    if dtype == torch.bfloat16 and not cuda_usable():
        return verify_widened(model_dir, onnx_path, threads, progress, plan)
    args = (model_dir, onnx_path, dtype, threads, progress, plan, shipped)
    result, refusals = checked_against(REFERENCE_DTYPE, *args)
    if result["passed"] or not refusals or dtype != torch.float32 or shipped:
        return result
    slots = result.get("deep_cache", {}).get("random_slots")  # the float64 run's deep cache the same, or no run
    no_room = float64_room(model_dir, dtype, plan, slots)
    if no_room:
        return {**result, "failure": f"{result['failure']} ({no_room})"}
    exact, exact_refusals = checked_against(EXACT_DTYPE, *args, most_slots=slots)
    if exact["passed"]:
        return {**exact, FLOAT32_REFUSAL: result["failure"]}
    # Refused by both: the float32 run's figures stand, as the check's (where the graph's own rounding is what parts,
    # at a badly conditioned position, the float64 run's figure can be 5x the float32 one's: a QA run), on the passes
    # both refuse (a pass the float64 run passes lies within the tolerance of the exact model's stand-in), or on all
    # where the two refuse different passes; the float64 run's failure beside them.
    where = {refusal.partition(": ")[0] for refusal in exact_refusals}
    standing = [refusal for refusal in refusals if refusal.partition(": ")[0] in where] or refusals
    shipped_alone = result["failure"].removeprefix("; ".join(refusals)).removeprefix("; ")  # the RoPE tables ...
    failure = "; ".join(standing + ([shipped_alone] if shipped_alone else []))
    return {**result, FLOAT64_REFUSAL: exact["failure"], "failure": f"{failure} ({REFUSED_BY_BOTH})"}


def float64_room(model_dir: Path, dtype: torch.dtype, plan: str, slots: int | None) -> str | None:
    """Why the float64 run (export/exact_reference.py) cannot run in the memory ``plan`` leaves, or None: beside
    what the check holds, each unit of the model is cast to float64 as it runs, the largest (an embedding or head
    over a large vocabulary) twice its float32 bytes; and its deep-cache pass must hold the float32 run's ``slots``
    (None: no such pass) in its float64 cache, so that the two runs' passes are the same."""
    whole, streamed, _ = held_bytes(model_dir, dtype)
    left = memory_budget(share=1.0) - (streamed if plan == STREAMED else whole)
    _, largest = model_bytes(model_dir, EXACT_DTYPE)
    if largest > left:
        return (
            f"not judged again against the model run in float64: its largest layer in float64, "
            f"{human_size(largest, round_up=True)}, does not fit in the {human_size(max(left, 0))} the check leaves"
        )
    if slots and deep_slots(model_dir, dtype, plan, reference=EXACT_DTYPE) < slots:
        return (
            f"not judged again against the model run in float64: its deep-cache pass's {slots} slots in a float64 "
            f"cache do not fit in the {human_size(max(left, 0))} the check leaves"
        )
    return None


def checked_against(
    reference: torch.dtype,
    model_dir: Path,
    onnx_path: Path,
    dtype: torch.dtype,
    threads: int | None,
    progress: bool,
    plan: str,
    shipped: tuple[Path, torch.dtype] | None,
    most_slots: int | None = None,
) -> tuple[dict, list[str]]:
    """``verify_export``'s figures with the PyTorch Thinker run in ``reference`` (REFERENCE_DTYPE, or EXACT_DTYPE:
    export/exact_reference.py), and the failures of its comparisons with the graph (apart from those of what the
    graph ships alone: its RoPE tables, windows and genai_config.json), each "WHERE: WHY". ``most_slots``: the
    deep-cache pass's random slots at most (the float32 run's, for the float64 one's), else what memory allows."""
    held_as = WIDENED_BFLOAT16 if shipped else dtype  # the tolerance's key
    genai_path, embeds_path = genai_graph_of(onnx_path), embeds_graph_of(onnx_path)
    indexed = "indexed_attention" in (read_json(model_dir / "config.json").get("layer_types") or ())
    steps = 2 + DECODE_STEPS + sum(1 + DECODE_STEPS for extra in (genai_path, embeds_path, indexed) if extra)
    config = ThinkerConfig.from_pretrained(model_dir)
    steps += (1 + LONG_DECODE_STEPS + CONTINUATION_STEPS + deep_cache_steps(config, dtype)) * (2 if genai_path else 1)
    streams = takes_stream_positions(onnx.load(str(onnx_path), load_external_data=False))
    steps += (1 + DECODE_STEPS) * (1 + streams)  # the padded-around pass, and the image-positions one
    steps += 1 + EDGE_DECODE_STEPS + 2  # the edges' pass, and the two prompts' rounding sensitivities
    long, further = {}, {}  # the long prompts; the deep-cache and continuation passes
    # before the models are loaded: the memory they will leave
    allowed = deep_slots(model_dir, dtype, plan, reference=reference)
    most_slots = allowed if most_slots is None else min(most_slots, allowed)
    exactly = reference == EXACT_DTYPE
    with (
        progress_bar(steps, "verifying in float64" if exactly else "verifying", unit="step", enabled=progress) as bar,
        pytorch_thinker(model_dir, REFERENCE_DTYPE, plan, shipped and shipped[1]) as model,
        running_exactly(model) if exactly else contextlib.nullcontext(),
        contextlib.closing(ReferenceReplay(onnx_path.parent)) as replay,  # the second graph's passes read back
    ):
        bar.update()
        batch = parity_batch(model.config.vocab_size)
        decoder = OnnxDecoder(onnx_path, threads=threads, probes=checked_probes(onnx_path, dtype))
        device, last_only = decoder.device, decoder.last_logits_only
        shadow, long_shadow, deep_shadow, continued_shadow = (half_shadow(model, dtype) for _ in range(4))
        figures = compare_decoders(model, decoder, *batch, on_step=bar.update, shadow=shadow, replay=replay)
        long_inputs = long_prompts(model, decoder)
        again = replay if genai_path else None  # what model.genai.onnx's passes alone read back: kept for them only
        options = {"on_step": bar.update, "shadow": long_shadow, "replay": again}
        long["long_prompts"] = compare_long(model, decoder, long_inputs, **options)
        deep = {"most_slots": most_slots, "shadow": deep_shadow, "replay": again}
        further["deep_cache"] = deep_cache_pass(model, decoder, dtype, on_step=bar.update, **deep)
        options = {"on_step": bar.update, "shadow": continued_shadow, "replay": again}
        further["continuation"] = continuation_pass(model, decoder, **options)
        options = {"on_step": bar.update, "shadow": shadow, "replay": replay}
        further[PADDED_AROUND] = padded_around_pass(model, decoder, **options)
        further[VOCABULARY_EDGES] = vocabulary_edges_pass(
            model, decoder, onnx_path, on_step=bar.update, shadow=half_shadow(model, dtype)
        )
        if streams:  # multimodal RoPE: the batch at an image's positions, whose three streams differ
            further[IMAGE_POSITIONS] = compare_decoders(
                model, decoder, *batch, on_step=bar.update, shadow=half_shadow(model, dtype), image_positions=True
            )
        if indexed:  # prompts on which the indexers choose (thinker_common/parity_inputs.py INDEXER_EXTRA_BLOCKS)
            indexer_figures = compare_decoders(model, decoder, *indexer_batch(model.config), on_step=bar.update)
        del decoder  # one session at a time, as verify_plan counts them
        if genai_path:
            genai = OnnxDecoder(genai_path, threads=threads, probes=checked_probes(genai_path, dtype))
            options = {"on_step": bar.update, "candidate_padding": RIGHT, "replay": replay}
            genai_figures = compare_decoders(model, genai, *batch, shadow=shadow, **options)
            long["genai_graph_long_prompts"] = compare_long(model, genai, long_inputs, shadow=long_shadow, **options)
            further["genai_graph_deep_cache"] = deep_cache_pass(model, genai, dtype, on_step=bar.update, **deep)
            further["genai_graph_continuation"] = continuation_pass(
                model, genai, on_step=bar.update, shadow=continued_shadow, replay=replay
            )
            del genai
        if embeds_path:  # another prompt: its own half-precision spreads
            embeds = OnnxDecoder(embeds_path, threads=threads, probes=checked_probes(embeds_path, dtype))
            embeds_figures = compare_decoders(
                model, embeds, *batch, on_step=bar.update, shadow=half_shadow(model, dtype), foreign_embeddings=True
            )
        # Measured only where a pass parts beyond the logit scale's tolerance, which is all the allowance can
        # change: each measure costs two prefills, for a streamed model two more reads of every layer.
        batch_passes = [figures, further[PADDED_AROUND], genai_figures if genai_path else None]
        sensitivity = {
            name: rounding_sensitivity(model, *inputs, last_only) if beyond_scale(held_as, *passes) else None
            for name, inputs, passes in (("batch", batch, batch_passes), ("long", long_inputs, long.values()))
        }
        bar.update(2)
    held = ", read layer by layer as it runs" if plan == STREAMED else ""
    if shipped:
        held = f", its weights rounded to {dtype_name(shipped[1])} as the export's{held}"
    result = {
        "provider": device,
        "reference": f"PyTorch ThinkerForCausalLM, {dtype_name(reference)}, CPU{held}",
        **figures,
    }
    # the batch's and the long prompts' passes at their own prompts' rounding sensitivity (SENSITIVITY_MARGIN, up to
    # SENSITIVITY_CAP): a tiny random Qwen3.5-VL, sound, parted 1.05e-3 from PyTorch on the long prompts against
    # 1e-4 x the logit scale, 8.3e-4, where 8 float32 ulps on their input embeddings move the logits by 3.7e-3 (a QA
    # run)
    result |= sensitivity_recorded(sensitivity["batch"])
    result["tolerance"] = float_export_tolerance(result, held_as)
    failures = []
    failure = judge(result, result["tolerance"])
    if failure:
        failures.append(batch_failure(failure))
    if indexed:
        result["indexer_prompts"] = indexer_figures
        failures += indexer_failures(indexer_figures, held_as)
    if genai_path:
        result["genai_graph"] = genai_figures
    if embeds_path:
        result["embeds_graph"] = embeds_figures
    # onnxruntime-genai's graph runs the batch's rows; the embeds graph a prompt of its own, with foreign embeddings
    # no measure here perturbs, at the scale's tolerance (a review)
    held = {"genai_graph": result["tolerance"], "embeds_graph": scale_tolerance(result, held_as)}
    failures += side_graph_failures(result, held)
    for key, figures in long.items():
        figures |= sensitivity_recorded(sensitivity["long"])
        figures["tolerance"] = float_export_tolerance(figures, held_as)
        result[key] = figures
    for key, figures in further.items():
        if "not_run" not in figures:
            # the batch's rows padded around: the batch's sensitivity; the passes at an image's positions, on a
            # deep cache, continued, and on the vocabulary's edges run other inputs, which neither measure reaches,
            # and keep the logit scale's tolerance (a deep-cache bug passed at the long prompts' 48x wider one: a
            # review)
            if key == PADDED_AROUND:
                figures |= sensitivity_recorded(sensitivity["batch"])
            figures["tolerance"] = float_export_tolerance(figures, held_as)
        result[key] = figures
    judged_beside(result)
    failures += long_prompt_failures(result, model.config, dtype)
    failures += deep_cache_failures(result) + continuation_failures(result, model.config, dtype)
    failures += image_position_failures(result) + padded_around_failures(result) + vocabulary_edge_failures(result)
    compared = list(failures)
    result["rope_tables"], unprompted = unprompted_checks(*(shipped or (onnx_path, dtype)), model.config)
    failures += unprompted
    result["passed"] = not failures
    result["failure"] = "; ".join(failures)
    if result["passed"]:
        del result["failure"]
    return result, compared


def verify_widened(model_dir: Path, onnx_path: Path, threads: int | None, progress: bool, plan: str) -> dict:
    """``verify_export`` of a bfloat16 export where no CUDA runs (onnxruntime's CPU provider has no bfloat16
    kernels): its graphs widened to float32 (export/widened.py), the RoPE tables they rotate by float32 ones, are
    checked as a float32 export is, against the PyTorch Thinker in float32 holding the same bfloat16 weights, to one
    bfloat16 ulp of the logit scale (``TOLERANCES``); the shipped tables, the attention windows and genai_config.json
    are read off the export as shipped. The copy is written beside the export's folder (twice its weights' bytes) and
    removed after."""
    folder = onnx_path.parent
    needed = 2 * sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    free = free_bytes(folder.parent)
    if needed > free:
        raise ThinkerError(
            f"{outside_staging(folder.parent)}: --verify of a bfloat16 export without CUDA runs a float32 copy of it, "
            f"{human_size(needed, round_up=True)}, and {human_size(free)} is free; export with --no-verify, or where "
            "more disk is free or CUDA runs"
        )
    # The RoPE tables in float32: the shipped ones are compared bit for bit with the model's (``rope_table_check``),
    # and the fused graph rotates a left-padded row by its slots, not its positions, which is exact but for the
    # rounding of the tables' rows (2.3e-3 x the logit scale on a tiny Qwen3 with bfloat16 rows)
    config = ThinkerConfig.from_pretrained(model_dir)
    rotary = config.position_embedding_type == "rope"
    tables = rope_tables(config, REFERENCE_DTYPE) if rotary else ()
    replaced = {name: table.numpy() for name, table in zip((ROPE_TABLE, ROPE_SIN_TABLE), tables, strict=False)}
    with tempfile.TemporaryDirectory(prefix=".widened-", dir=folder.parent) as scratch:
        widened_folder(folder, Path(scratch), replaced)
        result = verify_export(
            model_dir,
            Path(scratch) / onnx_path.name,
            REFERENCE_DTYPE,
            threads,
            progress,
            plan,
            (onnx_path, torch.bfloat16),
        )
    return {**result, "widened": WIDENED}
