"""How far PyTorch's own half-precision run of a model lands from its float32 run, position by position: what
excuses a half-precision graph's difference from float32 at the few positions whose logits half precision cannot
hold.

A float16 or bfloat16 graph is checked against the exact model, PyTorch in float32 (export/verify.py), within
``RELATIVE_TOLERANCE`` of its dtype, 5e-2 x the logit scale. That holds where half-precision rounding stays small,
but not at every position of every model: SmolLM2-135M builds a "massive activation" near 23,000 in one channel of
one position (layer 11's MLP, where a float16 ulp is 16) and cancels it again in its last layers, so a half-precision
run carries a few logits of rounding out of that cancellation. Measured on its float16 int4 export
(``--dtype float16 --quantize int4``) on the parity batch: the graph 3.25 from float32 at that position, PyTorch's
float16 run of the same weights 4.42, the dtype's tolerance 1.72; every other position and every decode step within
0.17. A sound graph failed its own check there.

So the check runs the reference a second time in the graph's half dtype (``HalfShadow``, its own cache, the same
tokens) and measures, at each compared position, that run's largest |Δlogit| from float32: its spread. A position
whose graph difference lies within ``HALF_SPREAD_MARGIN`` times its own spread is excused (two sound half-precision
implementations, each rounding its own way, part by up to about twice either's distance from the exact result);
every other position is held to the dtype's tolerance as before (``max_abs_diff_beyond_spread``). A graph bug moves
the well-conditioned positions, and the decode steps, far beyond their small spreads: on that float16 int4 export,
GroupQueryAttention's scale 20 % off puts the decode steps 1.6-3.4 from float32 where their spreads are a tenth of
that. A single tolerance floor over the batch (twice the largest spread, 8.8 there) would have let that bug pass
but for one position.

One half-precision run is one sample of the roundings a sound graph may make, and at a badly conditioned position
it can land near float32 by chance where another sound rounding lands far off. Measured on a tiny random Qwen3.5-VL
exported in float16: at two of the continuation pass's 72 positions, where one head of layer 0's delta rule comes
out of a near-total cancellation (RMS 1.6e-5 against 1e-3 to 1e-2 elsewhere) into a gated RMSNorm that multiplies
it by about 1/sqrt(eps), onnxruntime landed 0.55 and 0.56 from float32 (tolerance 0.38) and PyTorch's float16 run
0.08 and 0.06, while that run with its float16 embeddings moved by one ulp landed up to 1.16 off, and so was refused
by the check in 9 of 11 such tries (a QA run). So a position's spread is also its response to one half-precision
rounding of its inputs: the float32 model run again on input embeddings scaled by 1 ± the dtype's unit roundoff
(signs from a fixed seed), its own cache beside the half run's, |Δlogit| from the reference. That response is 1.01
and 1.06 at those two positions and a median 0.056 elsewhere, so the well-conditioned positions, where a graph bug
shows, keep small spreads. The float32 run costs about as much as the reference's.

One such rounding is itself one sample. On a tiny random Qwen3.5 (hidden 64) in float16, one continuation position's
response ranged 0.04-0.34 over seven roundings, the first sample's 0.05 and the half run's 0.09, while the sound graph
landed 0.45 off (tolerance 0.36); on a tiny Qwen3-Next, a long-prompt position's ranged 0.25-2.83 over twelve, the
graph 1.81 off (a QA run). So a step of several positions (a prompt, a continuation in one step) runs
PERTURBED_SAMPLES roundings, each its own seed and its own copy of the cache before the step, and takes the furthest
at each position; where the graph, run first, lands beyond the dtype's tolerance and beyond twice a position's
spread so far, more, up to MOST_PERTURBED_SAMPLES, until the spread covers it. The Qwen3.5's position is excused by
the first four, the Qwen3-Next's within sixteen (bench/bench_half_hybrid.py). A decode step keeps one: its rounding
reaches one new token's embedding, and another sample would copy the whole cache (a deep-cache pass's is most of the
check's memory). Drawing more only where the graph lands beyond costs a sound, well-conditioned model nothing, and
can excuse only positions whose own rounding moves them that far: at a well-conditioned position every sample lands
close. The resolution this costs is the rounding's own: the tiny Qwen3.5-VL's last full-attention output projection
3 % off moved only its two badly conditioned positions beyond the tolerance (0.617 where the sound graph lands
0.559), which one sample's spread happened not to cover; 10 % and 15 % off move only such positions too, and pass;
20 % off fails on well-conditioned ones (tests/export/test_half_spread.py). A float32 export's check, 500x tighter,
tells such a bug.

Why not check against PyTorch's half-precision run directly: its MoE routing and accumulation order are PyTorch's
CPU ones, which can sit further from onnxruntime's than either from float32 (export/verify.py). Here it only
measures how much rounding each position invites.

The half-precision run casts each unit's parameters (a decoder layer, or a module owning parameters directly, as
``converter.streamed`` loads them) just before the unit runs and puts the float32 ones back after it: the memory of
one unit in half precision beside the model as held, whole or streamed layer by layer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache

from converter.layer_parity import THINKER_FINAL_NORMS
from converter.streamed import Unit, decoder_layer_classes, find_units, get_tensor, set_tensor
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.parity_inputs import RELATIVE_TOLERANCE

HALF_PRECISIONS = (torch.float16, torch.bfloat16)
# The largest relative error of one rounding to each half dtype (half its machine epsilon): float16 keeps 10
# fraction bits, bfloat16 7.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
HALF_SPREAD_MARGIN = 2.0
# At most this share of a comparison's positions may be excused beyond the tolerance: on SmolLM2's float16 int4
# export, 1 position of 23. Where half precision moves most positions that far (a model whose every position carries
# a cancelled massive activation), excusing them would excuse a graph bug too: the check fails, saying why.
MAX_EXCUSED_SHARE = 0.1
# The perturbed float32 runs of a step of several positions (a prompt, a continuation in one step), each on its own
# rounding of the inputs, the furthest a position's spread: one rounding is one sample of a badly conditioned
# position's response, and can land close by chance (the module docstring). A decode step runs one.
PERTURBED_SAMPLES = 4
# ... and, where the graph lands beyond the tolerance and beyond twice a position's spread, up to this many: on a tiny
# random Qwen3-Next in float16, one long-prompt position's response to one rounding ranged 0.25-2.83 over twelve seeds
# and the sound graph lay 1.81 off (tolerance 0.395): covered within sixteen samples, not eight (the module docstring).
MOST_PERTURBED_SAMPLES = 16
SAMPLE_SEED_STRIDE = 100_003  # a sample's seed: its step's, this far on per sample (a pass runs far fewer steps)


class HalfShadow:
    """``model`` (float32) run again beside the reference, step by step with its own caches, twice: in ``dtype``, and
    in float32 on input embeddings rounded once more at ``dtype``'s unit roundoff. Each call's spread is, at each
    position, the further of the two from the reference's logits.

    The spreads are kept: a second pass over the same reference steps (``rewind``, then the same calls: the reference
    is PyTorch on the same batch and its own greedy tokens, whichever graph it is compared with) reads them back
    rather than running the model again, the half-precision run being the slow part on a CPU without half-precision
    matmuls."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.past, self.perturbed_past = None, None  # the half run's cache, the perturbed float32 run's
        self.spreads: list[np.ndarray] = []
        # each step's MoE routers' own spread (export/routing.py RouteFollower.spread keeps them): layer -> (tokens,)
        self.router_spreads: list[dict[int, torch.Tensor]] = []
        self.step = 0
        self.replayed = False  # whether the last call read a kept spread back rather than run

    def edit_cache(self, edit: Callable[[Cache], None]) -> None:
        """``edit`` on the shadow's caches, as the caller edited the reference's between two calls; nothing while
        replaying (``rewind``): the caches already hold the edit then."""
        if not self.replayed:
            edit(self.past)
            edit(self.perturbed_past)

    def rewind(self) -> None:
        self.step = 0

    @torch.no_grad()
    def spread(self, reference_logits: torch.Tensor, graph_distance: np.ndarray | None = None, **inputs) -> np.ndarray:
        """(B, T): max over the vocabulary of |logits - ``reference_logits``| (B, T, V), the furthest of the half run
        and the perturbed float32 runs (PERTURBED_SAMPLES of a step of several positions), each fed ``inputs`` (as
        the reference was, less its cache) after this shadow's earlier calls. ``graph_distance``: (B, T) the graph's
        own largest |Δlogit| from ``reference_logits`` at each position it compares (0 elsewhere): where one lies
        beyond the dtype's tolerance and beyond HALF_SPREAD_MARGIN times its spread, more samples are drawn, up to
        MOST_PERTURBED_SAMPLES (``widened``)."""
        self.step += 1
        self.replayed = self.step <= len(self.spreads)
        if self.replayed:
            return self.spreads[self.step - 1]
        reference = reference_logits.float()
        half_inputs = inputs
        if "inputs_embeds" in inputs:  # the embeddings a half graph takes are cast to its dtype first thing
            half_inputs = {**inputs, "inputs_embeds": inputs["inputs_embeds"].to(self.dtype)}
        with running_in(self.model, self.dtype):
            out = self.model(**half_inputs, use_cache=True, **cached(self.past))
        self.past = getattr(out, CACHE_ARG)
        # each run's logits let go once measured: a long prompt's over a large vocabulary are tens of megabytes
        spread = distance(out.logits, reference)
        several = reference.shape[1] > 1  # a prompt, or a continuation in one step: more roundings sampled
        before = copy.deepcopy(self.perturbed_past) if several and self.perturbed_past is not None else None
        moved = self.perturbed_inputs(inputs, self.step)
        out = self.model(**moved, use_cache=True, **cached(self.perturbed_past))
        self.perturbed_past = getattr(out, CACHE_ARG)
        spread = torch.maximum(spread, distance(out.logits, reference))
        out = None
        if several:
            draw = functools.partial(self.sampled, inputs, before, reference)
            for sample in range(1, PERTURBED_SAMPLES):
                spread = torch.maximum(spread, draw(sample))
            if graph_distance is not None:
                spread = self.widened(spread, reference, graph_distance, draw)
        self.spreads.append(spread.numpy())
        return self.spreads[-1]

    def sampled(self, inputs: dict, before: Cache | None, reference: torch.Tensor, sample: int) -> torch.Tensor:
        """(B, T): the distance of one more perturbed float32 run of this step (``sample``: its seed's), on its
        own copy of ``before``, the perturbed cache before the step (None for a first step)."""
        past = copy.deepcopy(before) if before is not None else None
        moved = self.perturbed_inputs(inputs, self.step + sample * SAMPLE_SEED_STRIDE)
        return distance(self.model(**moved, use_cache=past is not None, **cached(past)).logits, reference)

    def widened(
        self,
        spread: torch.Tensor,
        reference: torch.Tensor,
        graph_distance: np.ndarray,
        draw: Callable[[int], torch.Tensor],
    ) -> torch.Tensor:
        """``spread`` with more perturbed samples (``draw(sample)``) while a position the graph compares lies
        beyond both the dtype's tolerance at this step's logit scale (no more than the comparison's own, taken over
        this step and others) and HALF_SPREAD_MARGIN times its spread so far, up to MOST_PERTURBED_SAMPLES."""
        tolerance = RELATIVE_TOLERANCE[self.dtype] * max(1.0, float(reference.abs().max()))
        graph = torch.from_numpy(graph_distance)
        for sample in range(PERTURBED_SAMPLES, MOST_PERTURBED_SAMPLES):
            if not ((graph > tolerance) & (graph > HALF_SPREAD_MARGIN * spread)).any():
                break
            spread = torch.maximum(spread, draw(sample))
        return spread

    def perturbed_inputs(self, inputs: dict, seed: int) -> dict:
        """``inputs`` with their input embeddings (looked up from ``input_ids`` where given those) each scaled by
        1 ± the dtype's unit roundoff, the signs drawn from ``seed`` (each call's own: its step)."""
        inputs = dict(inputs)
        ids = inputs.pop("input_ids", None)
        if ids is not None:
            inputs["inputs_embeds"] = self.model.get_input_embeddings()(ids)
            if self.model.config.ple_layer_ids:  # Qwen3.8's n-grams hash the ids themselves
                inputs["ple_input_ids"] = ids
        inputs["inputs_embeds"] = scaled_at_random(inputs["inputs_embeds"].float(), UNIT_ROUNDOFF[self.dtype], seed)
        return inputs


def graph_distances(
    reference: torch.Tensor, candidate: np.ndarray, reference_kept: np.ndarray, candidate_kept: np.ndarray
) -> np.ndarray:
    """(B, T) over ``reference``'s (B, T, V) positions: at each one ``reference_kept`` selects, the graph's largest
    |Δlogit| at its counterpart in ``candidate`` (B, T', V), where ``candidate_kept`` selects the same positions in
    the same order; 0 elsewhere. What a half-precision spread is asked to cover (``HalfShadow.spread``)."""
    distances = np.zeros(reference_kept.shape, np.float32)
    compared = reference.float().numpy()[reference_kept]
    distances[reference_kept] = np.abs(compared - candidate[candidate_kept]).max(axis=-1)
    return distances


def distance(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """(B, T): max over the vocabulary of |``logits`` - ``reference``|, in float32."""
    return (logits.float() - reference).abs().amax(-1)


def scaled_at_random(embeddings: torch.Tensor, relative: float, seed: int) -> torch.Tensor:
    """``embeddings`` each scaled by 1 + ``relative`` or 1 - ``relative``, the signs drawn from ``seed``: a rounding's
    worth of change at every entry, the same for the same seed."""
    signs = torch.randint(0, 2, embeddings.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return embeddings * (1 + relative * signs.to(embeddings.dtype))


def cached(past: Cache | None) -> dict:
    """The cache argument of a call that continues ``past`` (none for a first call)."""
    return {CACHE_ARG: past} if past is not None else {}


def excused(diff: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Which positions' differences lie within HALF_SPREAD_MARGIN times their own half-precision spread."""
    return diff <= HALF_SPREAD_MARGIN * spread


@contextmanager
def running_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, each unit of ``model`` runs with its floating parameters and persistent buffers cast to
    ``dtype``. The hooks go around whatever loads the unit (``converter.streamed``'s, registered earlier): the cast
    after the load, the originals back before the drop."""
    handles, helds = [], []
    for unit in find_units(model, decoder_layer_classes(model), THINKER_FINAL_NORMS):
        held: dict[str, torch.Tensor] = {}  # the unit's own tensors while it runs cast
        helds.append(held)

        def cast(module, args, kwargs, unit: Unit = unit, held: dict = held) -> None:
            for name in unit.tensors:
                tensor = get_tensor(model, name)
                if tensor.is_floating_point() and tensor.dtype != dtype:
                    held[name] = tensor
                    set_tensor(model, name, tensor.detach().to(dtype))
            return None

        def restore(module, args, kwargs, output, held: dict = held) -> None:
            _put_back(model, held)

        handles.append(unit.module.register_forward_pre_hook(cast, with_kwargs=True))
        handles.append(unit.module.register_forward_hook(restore, with_kwargs=True, prepend=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for held in helds:  # a forward that raised leaves its unit cast
            _put_back(model, held)


def _put_back(model: nn.Module, held: dict[str, torch.Tensor]) -> None:
    for name, tensor in held.items():
        set_tensor(model, name, tensor)
    held.clear()
