"""A half-precision MoE graph's routing, followed by the reference it is checked against where rounding explains it.

An MoE layer picks each token's top-k experts: a discrete choice. Where two experts' router logits lie within a few
parts in a thousand, a half-precision graph's rounding of the hidden state can pick the other one, and the logits of
that token and of every later one (through the attention cache and a linear-attention layer's state) then part by
far more than any half-precision tolerance, although the graph is sound. Measured on the tests' tiny Qwen3.5-MoE and
Qwen3-Next (top 2 of 4 experts): float16 exports of both graphs failed ``--verify`` on the long prompts and the
continuation pass (1.8 to 5.3 against tolerances near 0.4), each time after a token whose float32 router put its
second and third experts 1.5e-4 apart in probability. PyTorch's own half-precision run (the spread of
export/half_spread.py) need not flip the same tokens, so it cannot excuse them.

So for a half-precision graph with MoE layers the check reads what the graph routes by (its routers' logits where an MoE
op takes them, in float32 where onnxruntime runs the op in float32; their Softmax where the graph's own TopK picks:
``router_probes``), returned beside the logits (``OnnxDecoder(probes=...)``: the same nodes, with more outputs), and
runs the reference after the graph, step by step: at each layer and kept token where the graph's top-k experts are not
the reference's, the reference takes the graph's experts, weighted by its own probabilities. The comparison is then
between the same discrete paths, and what remains is rounding. The half-precision spread's runs (export/half_spread.py)
take the same experts (``RouteFollower.spread``), so that a spread, too, measures rounding along the graph's path and
not a choice of its own. The graph's router probabilities are held within ``ROUTER_TOLERANCE`` of the reference's
(``router_max_abs_diff``), so a wrong router weight, input or layer fails there (0.62 to 0.985 for experts read
backwards), and a choice is followed only where the two routers, that close, part on it; the graph's routing weights are
not taken, so a bug in them, or a choice made wrong by a bug elsewhere, leaves its logits to fail as before (a QA run's
plants: a temperature of 1.15, a bias of 0.04 on one expert's logit, renormalisation dropped, the MoE op's k off by one,
another layer's router: each fails). The count of followed choices is reported (``routes_followed``; ``thinker export``
says it on its verify line).

Rounding moves a router too: at a badly conditioned token PyTorch's own half-precision run of a router can lie as
far from the float32 reference's as a sound graph's does (a tiny Qwen3-Next's float16 graph 0.307 at one token of
the vocabulary's edges, its own float16 run 0.297: a QA build refused for it, and refused now for that prompt's
logits, which half precision cannot hold). So the shadow's runs (the spread's:
export/half_spread.py) measure, token by token and layer by layer, how far their routers lie from the reference's
(``routed``, unrecorded; read back with the spreads where a second graph's comparison replays them), and at the end
of each step a graph router's distance within HALF_SPREAD_MARGIN times that is excused (``settle``;
``routers_excused``), the rest held to ROUTER_TOLERANCE (``router_max_abs_diff_beyond_spread``). A router read
backwards lies 0.62 to 0.985 off at tokens where rounding moves the shadow's by a few thousandths, and fails there.

What a half-precision check cannot tell from rounding, it passes: a router bug within the dtype's own rounding of the
routers. Expert 0's router row scaled by 1.01 (its logit moved by about 1 %) passes the tiny Qwen3-Next's plain float16
check with the routing followed; with the reference routing on its own it failed, but as the sound export fails too
(bench/bench_half_moe.py). A QA run's bias of 0.025 on one expert's logit passed likewise. The float32 export's check,
exact, fails both (0.13 against a tolerance of 1.44e-3 for the first, bench/results/half_moe.json): the graph's nodes
are the same in every dtype, so one float32 export proves them.

A float32 graph is not followed: its routers lie within 1e-6 of the reference's, and its check is exact.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from torch.nn import functional as F

from thinker.modeling_thinker import ThinkerTopKRouter

from .half_spread import HALF_SPREAD_MARGIN
from .runtime import FLOAT32_VIEW, OnnxDecoder

if TYPE_CHECKING:
    from .half_spread import HalfShadow

_ROUTER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
# How far a graph's router probabilities may lie from the reference's, at any expert of any token. Measured by
# bench/bench_half_moe.py on the tests' MoE families in float16 (three seeds, both graphs): a sound graph's lie within
# 0.059 where the check judges them (the tiny hybrid models, whose hidden states carry a few per cent of rounding;
# the classic MoE ones within 0.003); a router reading its experts backwards lies 0.62 to 0.985 away. Not the logits'
# relative tolerance: a router's probabilities are not the model's output, and the bound is what a followed choice
# rests on (the module docstring).
ROUTER_TOLERANCE = 0.2


def router_probes(model: onnx.ModelProto) -> dict[int, tuple[str, int, bool]]:
    """Layer index -> (name, element type, whether they are probabilities) of the values each MoE layer of
    ``model``'s top-level graph picks its experts by: the router MatMul's output (over
    ``model.layers.{i}.mlp.gate.weight``) where an MoE op takes it (the fused graph; a float32 view of a half
    graph's MoE, which may take them in float32), the Softmax over it where the graph's own TopK picks (the plain
    graph). Not the plain graph's MatMul output: onnxruntime's CPU provider computes a float16 MatMul in float32 and
    drops the cast back to float16 when the Softmax's Cast to float32 follows, a rounding a graph output would put
    back, so it is not what the TopK saw."""
    types = {tensor.name: tensor.data_type for tensor in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    probes = {}
    for node in model.graph.node:
        found = _ROUTER_WEIGHT.fullmatch(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if not found or node.input[1] not in types:
            continue
        value, kind, probabilities = node.output[0], types[node.input[1]], False
        while len(readers.get(value, ())) == 1 and readers[value][0].op_type in ("Cast", "Softmax"):
            reader = readers[value][0]
            value, probabilities = reader.output[0], probabilities or reader.op_type == "Softmax"
            kind = onnx.TensorProto.FLOAT if reader.op_type == "Cast" else kind
        moe_reads = any(reader.op_type == "MoE" for reader in readers.get(value, ()))
        if moe_reads and not probabilities and kind != onnx.TensorProto.FLOAT:
            # onnxruntime's CPU provider has no float16 MoE kernel: it runs the router's MatMul and the MoE in
            # float32 and drops the float16 rounding between them, which a graph output of the logits would keep
            # (a QA run: two experts tied in float16, the op picked by the float32 logits, the reference followed
            # the other). A float32 view (runtime.FLOAT32_VIEW) is read as the op reads them: the float32 values
            # there, the float16 ones exactly where the op runs in float16 (CUDA). QMoE runs in float16 on the CPU
            # too and reads the rounded logits, as the plain probe does.
            value, kind = f"{value}{FLOAT32_VIEW}", onnx.TensorProto.FLOAT
        probes[int(found.group(1))] = (value, kind, probabilities)
    return probes


def checked_probes(onnx_path: Path, dtype: torch.dtype) -> dict[str, int]:
    """The outputs (name -> element type) a check of the ``dtype`` graph at ``onnx_path`` reads beside its logits
    (``OnnxDecoder(probes=...)``): what a half-precision graph's MoE layers route by (``router_probes``), whose
    choices the reference follows (module docstring); none for a float32 graph or one without MoE layers."""
    if dtype == torch.float32:
        return {}
    probes = router_probes(onnx.load(str(onnx_path), load_external_data=False)).values()
    return {name: kind for name, kind, _ in probes}


def graph_top_k(values: np.ndarray, k: int, probabilities: bool) -> np.ndarray:
    """The ``k`` experts (N, k) a graph picks by ``values`` (N, E), ties broken as the op that picks breaks them: the
    graph's own TopK over probabilities (``probabilities``) as ONNX's TopK does, to the lower index; an MoE or QMoE op
    over the logits it takes as onnxruntime's CPU kernels do, to the higher index (measured by
    tests/export/test_verify_routing.py: a float16 row whose second and third experts' logits round to one value
    routes to the later expert). Softmax is monotonic: logits order the experts as the probabilities do."""
    if probabilities:
        return np.argsort(-values, axis=-1, kind="stable")[:, :k]
    last = values.shape[-1] - 1
    return last - np.argsort(-values[:, ::-1], axis=-1, kind="stable")[:, :k]


class RouteFollower:
    """Makes the reference route as the graph did (module docstring) in the reference runs it wraps, and keeps the
    figures: how many choices were followed, and how far the graph's router probabilities lie from the reference's.

    ``probes``: layer -> (the graph output it routes by, whether those are probabilities) (``router_probes``); none
    makes this a no-op, for a float32 graph or a model without MoE layers."""

    @classmethod
    def of(cls, model: torch.nn.Module, decoder: OnnxDecoder) -> RouteFollower:
        """The follower of ``decoder``'s router probes (``checked_probes``), a no-op where it has none."""
        if not decoder.probe_names:
            return cls(model, {})
        graph = onnx.load(str(decoder.model_path), load_external_data=False)
        probed = set(decoder.probe_names)
        probes = router_probes(graph).items()
        return cls(model, {layer: (name, probs) for layer, (name, _, probs) in probes if name in probed})

    def __init__(self, model: torch.nn.Module, probes: dict[int, tuple[str, bool]]) -> None:
        self.probes = probes
        self.layer_of = {}
        for name, module in model.named_modules():
            if isinstance(module, ThinkerTopKRouter):
                self.layer_of[module] = int(re.search(r"layers\.(\d+)\.", name).group(1))
        self.followed = 0
        self.router_max_abs_diff = 0.0  # of the routers' probabilities, the graph's from the reference's
        # ... at the tokens the shadow's own routers do not lie as far from the reference's (``settle``)
        self.router_beyond_spread = 0.0
        self.routers_excused = 0  # (layer, token)s beyond ROUTER_TOLERANCE so excused
        # the layers whose routers part beyond ROUTER_TOLERANCE: a failure names the first, its router or its input,
        # so a bug in that layer or before it (a wrong expert moves the next layer's router)
        self.layers_beyond: set[int] = set()
        self.recording = True  # False while a shadow run takes the routes: the figures are the reference's
        # The step being run: layer -> (the reference's router probabilities, the graph's distance from them) at
        # its kept tokens; and the shadow runs' furthest distance from those probabilities (``spread``).
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.router_spreads: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def reference(
        self,
        probed: dict[str, np.ndarray],
        graph_mask: np.ndarray | None = None,
        reference_mask: np.ndarray | None = None,
    ) -> Iterator:
        """Within it, each MoE layer of the reference routes the kept tokens of ``reference_mask`` (B, T: this run's
        new tokens) as the graph's run just before did (``probed``, the values it routed by, over the kept tokens of
        ``graph_mask``: the same tokens in the same order, however each side pads its rows). Without masks every new
        token is kept, on both sides alike (a decode step, a batch of one)."""
        if not self.probes:
            yield
            return
        routed_by, tokens = {}, 0
        for layer, (name, probabilities) in self.probes.items():
            values = probed[name].reshape(-1, probed[name].shape[-1]).astype(np.float32)
            if graph_mask is not None:
                values = values[graph_mask.reshape(-1).astype(bool)]
            routed_by[layer], tokens = (torch.from_numpy(values), probabilities), len(values)
        kept = torch.ones(tokens, dtype=torch.bool)
        if reference_mask is not None:
            kept = torch.from_numpy(reference_mask.reshape(-1).astype(bool))
        original = ThinkerTopKRouter.forward
        follower = self

        def forward(router: ThinkerTopKRouter, hidden_states: torch.Tensor):
            layer = follower.layer_of.get(router)
            if layer not in routed_by:  # a layer the graph does not probe
                return original(router, hidden_states)
            return follower.routed(router, hidden_states, *routed_by[layer], kept)

        ThinkerTopKRouter.forward = forward
        try:
            yield
        finally:
            ThinkerTopKRouter.forward = original
            self.settle()

    def settle(self) -> None:
        """The step's router figures: the graph's distance at each kept token of each layer, excused where it lies
        within HALF_SPREAD_MARGIN times the shadow's own there (the module docstring), else held to
        ROUTER_TOLERANCE."""
        for layer, (_, distance) in self.pending.items():
            spread = self.router_spreads.get(layer)
            if spread is None or spread.shape != distance.shape:  # no shadow ran, or one of other tokens: none
                spread = torch.zeros_like(distance)
            excused = distance <= HALF_SPREAD_MARGIN * spread
            self.routers_excused += int((excused & (distance > ROUTER_TOLERANCE)).sum())
            held = float(distance[~excused].max()) if (~excused).any() else 0.0
            self.router_beyond_spread = max(self.router_beyond_spread, held)
            if held > ROUTER_TOLERANCE:
                self.layers_beyond.add(layer)
        self.pending, self.router_spreads = {}, {}

    def routed(
        self,
        router: ThinkerTopKRouter,
        hidden_states: torch.Tensor,
        graph_values: torch.Tensor,
        probabilities: bool,
        kept: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ThinkerTopKRouter's forward, its kept tokens' experts those the graph picked by ``graph_values`` (kept
        tokens, E: its router's probabilities, or its logits)."""
        logits = F.linear(hidden_states, router.weight)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top_values, top_index = torch.topk(probs, router.top_k, dim=-1)
        layer = self.layer_of.get(router)
        if kept.any() and self.recording:  # a step whose tokens are all pads routes nothing the graph's probe holds
            graph_probs = graph_values if probabilities else F.softmax(graph_values, dim=-1)
            distance = (graph_probs - probs[kept]).abs().amax(-1)
            self.router_max_abs_diff = max(self.router_max_abs_diff, float(distance.max()))
            self.pending[layer] = (probs[kept], distance)
        elif kept.any() and layer in self.pending:  # a shadow run: how far rounding moves the same router
            moved = (probs[kept] - self.pending[layer][0]).abs().amax(-1)
            furthest = self.router_spreads.get(layer)
            self.router_spreads[layer] = moved if furthest is None else torch.maximum(furthest, moved)
        graph_index = torch.from_numpy(graph_top_k(graph_values.numpy(), router.top_k, probabilities))
        differs = (graph_index.sort(-1).values != top_index[kept].sort(-1).values).any(-1)
        if differs.any():
            self.followed += int(differs.sum()) if self.recording else 0
            rows = kept.nonzero()[:, 0][differs]
            picked = graph_index[differs]
            values = probs[rows].gather(-1, picked)
            order = values.argsort(-1, descending=True)  # in the reference's own order of its probabilities
            top_index[rows], top_values[rows] = picked.gather(-1, order), values.gather(-1, order)
        if router.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        return logits, top_values.to(logits.dtype), top_index

    def spread(
        self,
        shadow: HalfShadow | None,
        reference_logits: torch.Tensor,
        graph_distance: np.ndarray | None = None,
        **inputs,
    ) -> np.ndarray | None:
        """Within ``reference``: ``shadow``'s spread of the step the reference has just run (None without a shadow;
        ``graph_distance``: HalfShadow.spread's), its runs taking the graph's experts as the reference did,
        unrecorded. Routed on their own, a near tie one of them took the other way widened every later position's
        spread, and a bug that moved the graph's routing moved the reference away from them and so widened its own
        allowance (o_proj x 1.1 in the tiny Qwen3-MoE's float16 graph: 6 of 110 long-prompt positions excused, at a
        spread of 2.1 where the sound graph's was 1.0 from a flip of the shadows' own: a review)."""
        if shadow is None:
            return None
        self.recording = False
        try:
            spread = shadow.spread(reference_logits, graph_distance, **inputs)
        finally:
            self.recording = True
        if shadow.replayed:  # its runs made once, by an earlier comparison of the same step: their routers' too
            self.router_spreads = dict(shadow.router_spreads[shadow.step - 1])
        else:
            shadow.router_spreads.append(dict(self.router_spreads))
        return spread

    def figures(self) -> dict:
        """The routing figures a comparison reports (none for a no-op follower)."""
        if not self.probes:
            return {}
        figures = {"routes_followed": self.followed, "router_max_abs_diff": self.router_max_abs_diff}
        figures |= {"router_max_abs_diff_beyond_spread": self.router_beyond_spread}
        figures |= {"routers_excused": self.routers_excused}
        if self.layers_beyond:
            figures["router_first_layer_beyond"] = min(self.layers_beyond)
        return figures
