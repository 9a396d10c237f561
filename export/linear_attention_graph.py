"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5 and Qwen3-Next, as ONNX with its carried state.

One layer, in the order of transformers' ``Qwen3_5GatedDeltaNet.forward`` (which the Thinker mirrors):

  padding      hidden * keep: padded positions become zeros before the projections (apply_mask_to_padding_states)
  projections  in_proj_qkv, in_proj_z (output gate), in_proj_b (write strength), in_proj_a (decay step)
  conv         causal depthwise conv over the q|k|v channels with the last k - 1 inputs carried, then SiLU
  gates        beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), the log decay, in float32
  q, k         per head: l2-normalised in float32 (eps 1e-6 inside the root, as transformers' ``l2norm``); each
               key head serves ``Hv / Hk`` consecutive value heads
  delta rule   per value head, state S (dk x dv): S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q / sqrt(dk)
  norm         RMSNorm per value head, times silu(z) in float32 (Qwen3_5RMSNormGated), then out_proj

Padding (docs/hybrid-export.md, decision 6): a position the attention mask hides leaves both states exactly as they
were, whatever the layout (left pads, onnxruntime-genai's right pads, a row masked for a whole step). Zeroed inputs
alone (transformers' rule) do that only for left pads from an empty state: a trailing pad's conv window still holds
the real tokens before it (k, v and beta are not zero), its decay is not one, and it shifts the carried conv window.
So, besides zeroing the inputs:
  recurrence   log decay g and beta times the float32 keep mask: exp(0) = 1 and beta = 0 leave S as it was
  conv state   the k - 1 columns of ``past ++ inputs`` that end at the row's last unmasked new position,
               lastpos = max_t keep_t (t + 1) (0 for a row masked throughout: the old state), gathered per row
               (GatherElements) with one index that every layer shares (``emit_padding_masks``)
Where nothing is masked this is exactly the unpadded layer (the last k - 1 columns; g and beta times 1), and a
left-padded row from an empty state gets transformers' result as before (float32: the same bits). The fused form
runs the rule only where it matters: an ``If`` on "every new position kept" (each decode step onnxruntime-genai
runs, any unpadded prompt) takes the unpadded layer, the same bits in fewer nodes (``emit_conv_and_gates``).

The carried state, graph inputs and outputs of the caller's choosing (names in docs/hybrid-export.md):
  conv_state       (B, conv_dim, k - 1) in the model dtype: the raw q|k|v inputs the next step's conv window reads
                   (transformers' cache keeps k columns; the oldest is never read again)
  recurrent_state  (B, Hv, dk, dv) float32, key-major as transformers' cache and onnxruntime's LinearAttention
Zeros start a sequence. The graph is the same for a prompt of any length and for one-token decode.

Two forms: ``GatedDeltaNetGraph`` uses standard ONNX operators only (the recurrence is a ``Scan`` over tokens for
a decode step, and over chunks of 64 tokens for a step of CHUNKED_FROM tokens or more, export/chunked_delta_rule.py);
``FusedGatedDeltaNetGraph`` replaces the conv, the gates, the recurrence and the gated norm with onnxruntime's
com.microsoft operators (CausalConvWithState, LinearAttentionGate, LinearAttention, GatedRMSNorm), each of which
runs on onnxruntime's CPU execution provider and matches transformers' torch fallbacks to rounding (measured in
docs/hybrid-export.md). Both keep the recurrence, its inputs and its state in float32 whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from onnx import TensorProto

from .chunked_delta_rule import DeltaRuleInputs, emit_chunked_delta_rule
from .graph_builder import TORCH_TO_ONNX, GraphBuilder, emitting_into, value_info

MS_DOMAIN = "com.microsoft"
L2NORM_EPS = 1e-6  # transformers' l2norm (and the FLA kernels it follows) put this inside the square root
INT64_MAX = 2**63 - 1  # Slice's "to the end"
# Steps of at least this many tokens (a prompt) run the plain graph's delta rule in chunks: for one layer of
# Qwen3.5-0.8B's sizes the two forms break even at about 48 tokens, and from 64 on the chunks take 0.54-0.81x the
# Scan's time (bench/bench_delta_rule.py); below that a chunk's fixed cost (about 4.3 ms, the padded chunk's
# products) outweighs the Scan's per token (about 0.09 ms), and a decode step keeps the Scan
CHUNKED_FROM = 64

# (x, weight name, weight (in, out)) -> x @ weight: lets a caller route projections through its quantizer.
MatMulEmitter = Callable[[str, str, torch.Tensor], str]


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """The sizes of one Gated DeltaNet layer, in Qwen3.5's config names."""

    hidden_size: int
    num_key_heads: int  # linear_num_key_heads: q and k heads
    num_value_heads: int  # linear_num_value_heads: v heads, one state each; a multiple of num_key_heads
    key_head_dim: int  # linear_key_head_dim
    value_head_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    rms_norm_eps: float

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel}: the carried conv state needs a kernel >= 2")

    @classmethod
    def from_config(cls, config) -> GatedDeltaNetDims:
        """From any config with Qwen3.5's field names (Qwen3_5TextConfig, Qwen3NextConfig, the hybrid Thinker)."""
        return cls(
            hidden_size=config.hidden_size,
            num_key_heads=config.linear_num_key_heads,
            num_value_heads=config.linear_num_value_heads,
            key_head_dim=config.linear_key_head_dim,
            value_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            rms_norm_eps=config.rms_norm_eps,
        )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # channels [q | k | v]

    @property
    def value_heads_per_key_head(self) -> int:
        return self.num_value_heads // self.num_key_heads

    def conv_state_shape(self, batch: int | str) -> list[int | str]:
        return [batch, self.conv_dim, self.conv_kernel - 1]

    def recurrent_state_shape(self, batch: int | str) -> list[int | str]:
        return [batch, self.num_value_heads, self.key_head_dim, self.value_head_dim]


@dataclass(frozen=True)
class PaddingMasks:
    """What every linear-attention layer of one forward reads about its step's padding (and length), computed once
    (``emit_padding_masks``)."""

    keep: str  # (B, T, 1) model dtype: 1 for the new positions the mask keeps, 0 for pads; zeroes the layer's input
    keep_float: str  # (B, T, 1) float32, the same: scales the log decay and beta (0 at pads: the state stays)
    conv_state_index: str  # (B, k - 1, conv_dim) int64: rows lastpos .. lastpos + k - 2 of the time-major window
    unpadded: str | None = None  # bool scalar: the mask keeps every new position (asked for with ``branches``)
    chunked: str | None = None  # bool (1,): T >= CHUNKED_FROM, where the plain rule takes chunks (with ``chunks``)


def emit_padding_masks(
    b: GraphBuilder,
    attention_mask: str,
    hidden: str,
    dtype: torch.dtype,
    dims: GatedDeltaNetDims,
    branches: bool = False,
    chunks: bool = False,
) -> PaddingMasks:
    """The padding values of one forward. The new positions are the last T columns of the (B, P + T) attention
    mask, T being ``hidden``'s sequence length (hidden states (B, T, C) or input ids (B, T)). ``branches`` adds
    the ``unpadded`` flag that the fused layers branch on, ``chunks`` the ``chunked`` one of the plain layers."""
    seq = b.op("Shape", hidden, start=1, end=2)  # (1,): T
    new = b.op("Slice", attention_mask, b.op("Neg", seq), b.const([INT64_MAX]), b.const([1]))  # (B, T) int64
    keep = b.op("Unsqueeze", b.op("Cast", new, to=TORCH_TO_ONNX[dtype]), b.const([-1]))
    keep_float = keep
    if dtype != torch.float32:
        keep_float = b.op("Unsqueeze", b.op("Cast", new, to=TensorProto.FLOAT), b.const([-1]))
    # lastpos = max_t keep_t (t + 1): the row's last real input is column lastpos + k - 2 of past ++ inputs, so
    # the next window is columns lastpos .. lastpos + k - 2 (the last k - 1 where the row ends unpadded, the old
    # state where it is masked throughout).
    ordinal = b.op("Range", b.const(1), b.op("Add", b.op("Squeeze", seq, b.const([0])), b.const(1)), b.const(1))
    last = b.op("ReduceMax", b.op("Mul", new, ordinal), b.const([1]), keepdims=1)  # (B, 1)
    window = b.const([[i] for i in range(dims.conv_kernel - 1)])  # (k - 1, 1)
    index = b.op("Add", b.op("Unsqueeze", last, b.const([2])), window)  # (B, k - 1, 1)
    index = b.op("Expand", index, b.const([1, 1, dims.conv_dim]))  # GatherElements wants the output's shape
    unpadded = b.op("Cast", b.op("ReduceMin", new, keepdims=0), to=TensorProto.BOOL) if branches else None
    chunked = b.op("GreaterOrEqual", seq, b.const([CHUNKED_FROM])) if chunks else None
    return PaddingMasks(keep, keep_float, index, unpadded, chunked)


class GatedDeltaNetGraph:
    """Writes Gated DeltaNet layers into ``builder`` with standard ONNX operators.

    ``weight(name)`` returns a parameter by its module name (``{prefix}.in_proj_qkv.weight``...) in the model
    dtype; ``matmul`` writes ``x @ W`` for a projection (default: a MatMul over the weight stored (in, out)).
    """

    contrib_ops = False
    branches_on_padding = False  # whether ``emit`` reads PaddingMasks.unpadded (emit_padding_masks' ``branches``)
    chunks_prompts = True  # whether ``emit`` reads PaddingMasks.chunked (emit_padding_masks' ``chunks``)

    def __init__(
        self,
        builder: GraphBuilder,
        dims: GatedDeltaNetDims,
        dtype: torch.dtype,
        weight: Callable[[str], torch.Tensor],
        matmul: MatMulEmitter | None = None,
    ) -> None:
        self.b = builder
        self.dims = dims
        self.dtype = dtype
        self.onnx_dtype = TORCH_TO_ONNX[dtype]
        self.weight = weight
        self.matmul = matmul or (lambda x, name, w: self.b.op("MatMul", x, self.b.weight(name, w)))

    # --- small helpers ----------------------------------------------------------------------------------------
    def to_float(self, x: str) -> str:
        return self.b.to_float32(x, self.dtype)

    def to_model_dtype(self, x: str) -> str:
        return self.b.to_dtype(x, self.dtype)

    def linear(self, x: str, name: str) -> str:
        return self.matmul(x, f"{name}.weight", self.weight(f"{name}.weight").T)

    def float_weight(self, name: str, tensor: torch.Tensor) -> str:
        return self.b.weight(name, tensor.detach().to(torch.float32).contiguous())

    # --- the layer --------------------------------------------------------------------------------------------
    def emit(
        self,
        x: str,
        prefix: str,
        padding: PaddingMasks,
        past_conv: str,
        past_recurrent: str,
        present_conv: str,
        present_recurrent: str,
    ) -> str:
        """One layer on ``x`` (B, T, C) in the model dtype; ``padding`` from ``emit_padding_masks``. Writes the
        graph values ``present_conv`` and ``present_recurrent``; returns the layer output (B, T, C)."""
        b = self.b
        x = self.emit_input_mask(x, padding)
        with b.scope("in_proj"):
            qkv = self.linear(x, f"{prefix}.in_proj_qkv")  # (B, T, conv_dim)
            z = self.linear(x, f"{prefix}.in_proj_z")  # (B, T, Hv * dv)
            write = self.linear(x, f"{prefix}.in_proj_b")  # (B, T, Hv)
            step = self.linear(x, f"{prefix}.in_proj_a")  # (B, T, Hv)
        qkv, log_decay, beta = self.emit_conv_and_gates(qkv, step, write, prefix, padding, past_conv, present_conv)
        with b.scope("qk_l2norm"):
            query, key, value = self.emit_split_qkv(qkv)  # (B, T, Hk * dk) float32 each, v in the model dtype
        with b.scope("delta_rule"):
            rule = DeltaRuleInputs(query, key, value, log_decay, beta)
            core = self.emit_delta_rule(rule, past_recurrent, present_recurrent, padding)
        with b.scope("norm"):
            core = self.emit_gated_norm(self.to_model_dtype(core), z, f"{prefix}.norm.weight")  # (B, T, Hv * dv)
        with b.scope("out_proj"):
            return self.linear(core, f"{prefix}.out_proj")

    def emit_input_mask(self, x: str, padding: PaddingMasks) -> str:
        """The layer input with padded positions zeroed (so a left pad is nothing in the conv window)."""
        return self.b.op("Mul", x, padding.keep)

    def emit_conv_and_gates(
        self, qkv: str, step: str, write: str, prefix: str, padding: PaddingMasks, past_conv: str, present_conv: str
    ) -> tuple[str, str, str]:
        """The conv output (B, T, conv_dim), writing ``present_conv``, and the gates (log decay, beta), both
        (B, T, Hv) float32, zero at pads."""
        b = self.b
        with b.scope("conv"):
            qkv = self.emit_conv(qkv, f"{prefix}.conv1d.weight", past_conv, present_conv, padding.conv_state_index)
        with b.scope("gates"):
            log_decay, beta = self.emit_gates(step, write, prefix)  # (B, T, Hv) float32 each
            # A pad neither decays the state (exp(0) = 1) nor writes into it (beta = 0).
            log_decay, beta = b.op("Mul", log_decay, padding.keep_float), b.op("Mul", beta, padding.keep_float)
        return qkv, log_decay, beta

    # --- pieces, each replaced by one onnxruntime operator in the fused form --------------------------------
    def emit_conv(self, qkv: str, weight_name: str, past: str, present: str, state_index: str) -> str:
        """Causal depthwise conv + SiLU over time, (B, T, C) -> (B, T, C). The window of token t is the k - 1
        inputs before it (from ``past`` where the step starts) and itself; ``present`` is the k - 1 columns of
        ``past ++ inputs`` that ``state_index`` picks per row (those ending at the row's last real input).

        Written as k taps (a shifted slice of the window times one weight column each, summed) rather than a
        grouped ``Conv``: onnxruntime's CPU Conv with one group per channel took 7.5 % of a Qwen3.5-0.8B decode
        step (profiled), the taps are a few elementwise nodes. Half-precision graphs take the taps in float32 (the
        conv kernels accumulate in float32 too; bfloat16 has no Conv before opset 22 anyway), rounded after."""
        b, k = self.b, self.dims.conv_kernel
        window = self.emit_window(qkv, past, present, state_index)  # (B, k - 1 + T, C)
        taps = self.weight(weight_name).detach().to(torch.float32)[:, 0, :]  # (C, k): nn.Conv1d's (C, 1, k)
        window = self.to_float(window)
        seq = b.op("Shape", qkv, start=1, end=2)  # (1,): T
        conv = None
        for j in range(k):  # tap j meets input t + j of the window for output t
            start = b.const([j])
            shifted = b.op("Slice", window, start, b.op("Add", start, seq), b.const([1]))  # (B, T, C)
            column = self.float_weight(f"{weight_name}.tap{j}", taps[:, j].contiguous())  # (C,)
            term = b.op("Mul", shifted, column)
            conv = term if conv is None else b.op("Add", conv, term)
        conv = b.op("Mul", conv, b.op("Sigmoid", conv))  # SiLU, float32
        return self.to_model_dtype(conv)

    def emit_window(self, qkv: str, past: str, present: str, state_index: str) -> str:
        """``past ++ inputs`` time-major, (B, k - 1 + T, C), and ``present`` (B, C, k - 1) gathered from it: the k - 1
        rows ``state_index`` picks per batch row. Time-major because a Concat along the last axis of the
        channel-major (B, C, k - 1) and (B, C, T) copies one short run per channel: onnxruntime took 16-56 ms per
        layer for it in a 128-token Qwen3.5-0.8B prefill (8 % of the prefill, profiled), where rows are whole
        (B, T, C) blocks here and only the (B, C, k - 1) state is transposed, both ways. The values are the same."""
        b = self.b
        window = b.op("Concat", b.op("Transpose", past, perm=[0, 2, 1]), qkv, axis=1)  # (B, k - 1 + T, C)
        carried = b.op("GatherElements", window, state_index, axis=1)  # (B, k - 1, C)
        b.op_to("Transpose", [carried], [present], perm=[0, 2, 1])
        return window

    def emit_gates(self, step: str, write: str, prefix: str) -> tuple[str, str]:
        """The log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), both (B, T, Hv) float32.
        -exp(A_log) is folded at export with torch in float32, the very value transformers computes per call."""
        b = self.b
        dt_bias = self.float_weight(f"{prefix}.dt_bias", self.weight(f"{prefix}.dt_bias"))
        decay_rate = self.float_weight(f"{prefix}.neg_exp_A_log", -self.weight(f"{prefix}.A_log").float().exp())
        log_decay = b.op("Mul", b.op("Softplus", b.op("Add", self.to_float(step), dt_bias)), decay_rate)
        beta = self.to_float(b.op("Sigmoid", write))  # sigmoid in the model dtype, as transformers does
        return log_decay, beta

    def emit_split_qkv(self, qkv: str) -> tuple[str, str, str]:
        """The conv output (B, T, conv_dim) split into q and k, each l2-normalised per head in float32, and v."""
        b, d = self.b, self.dims
        query, key, value = b.op("Split", qkv, b.const([d.key_dim, d.key_dim, d.value_dim]), axis=-1, outputs=3)
        query = self.emit_l2norm(query, d.num_key_heads, d.key_head_dim)
        return query, self.emit_l2norm(key, d.num_key_heads, d.key_head_dim), value

    def emit_l2norm(self, x: str, heads: int, head_dim: int) -> str:
        """Each head of (B, T, heads * head_dim) scaled to unit length in float32: x / sqrt(sum(x²) + eps)."""
        b = self.b
        x = self.to_float(b.op("Reshape", x, b.const([0, 0, heads, head_dim])))
        sum_sq = b.op("ReduceSum", b.op("Mul", x, x), b.const([-1]), keepdims=1)
        inv_norm = b.op("Reciprocal", b.op("Sqrt", b.op("Add", sum_sq, b.const(L2NORM_EPS, torch.float32))))
        return b.op("Reshape", b.op("Mul", x, inv_norm), b.const([0, 0, heads * head_dim]))

    def emit_delta_rule(self, rule: DeltaRuleInputs, past: str, present: str, padding: PaddingMasks) -> str:
        """The gated delta rule over ``rule``'s q, k (B, T, Hk * dk) float32, v (B, T, Hv * dv) and gates
        (B, T, Hv) float32; returns (B, T, Hv * dv) float32 and writes ``present``. An ``If`` on the step's
        length (``padding.chunked``, one flag for every layer): from CHUNKED_FROM tokens on (a prompt) in chunks
        (export/chunked_delta_rule.py), below that (a decode step) as a Scan over tokens, which pays nothing for the
        chunk's padding."""
        b, d = self.b, self.dims
        rule = rule._replace(query=b.op("Mul", rule.query, b.const(d.key_head_dim**-0.5, torch.float32)))
        branches = {}
        for name in ("chunks", "tokens"):
            body = b.subgraph()
            state = body.fresh("present_recurrent")
            with emitting_into(self, body), body.scope(name):
                form = self.emit_delta_chunks if name == "chunks" else self.emit_delta_scan
                out = form(rule, past, state)
            outputs = [value_info(out, TensorProto.FLOAT, None), value_info(state, TensorProto.FLOAT, None)]
            branches[name] = body.make_graph(f"delta_rule.{name}", [], outputs)
        out = b.fresh("delta_rule")
        b.op_to("If", [padding.chunked], [out, present], then_branch=branches["chunks"], else_branch=branches["tokens"])
        return out

    def emit_delta_chunks(self, rule: DeltaRuleInputs, past: str, present: str) -> str:
        """The rule in chunks of the prompt, over head-major rows (transformers' ``torch_chunk_gated_delta_rule``)."""
        b, d = self.b, self.dims
        query, key, value, log_decay, beta = rule

        def heads_first(x: str, width: int) -> str:  # (B, T, Hv * width) -> (B, Hv, T, width)
            return b.op("Transpose", b.op("Reshape", x, b.const([0, 0, d.num_value_heads, width])), perm=[0, 2, 1, 3])

        query, key = (heads_first(self.per_value_head(x), d.key_head_dim) for x in (query, key))
        value = heads_first(self.to_float(value), d.value_head_dim)
        log_decay, beta = (b.op("Transpose", x, perm=[0, 2, 1]) for x in (log_decay, beta))  # (B, Hv, T)
        heads = (d.num_value_heads, d.key_head_dim, d.value_head_dim)
        out = emit_chunked_delta_rule(b, heads, DeltaRuleInputs(query, key, value, log_decay, beta), past, present)
        return b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3]), b.const([0, 0, d.value_dim]))

    def emit_delta_scan(self, rule: DeltaRuleInputs, past: str, present: str) -> str:
        """The rule as a Scan over tokens (q already scaled). Per token (transformers'
        ``torch_recurrent_gated_delta_rule``): S = exp(g) S; delta = beta (v - S^T k); S += k delta^T; out = S^T q."""
        b, d = self.b, self.dims
        query, key, value, log_decay, beta = rule
        # Time-major: Scan walks axis 0. Each key head serves Hv / Hk consecutive value heads. Every per-token input
        # comes already shaped as the step uses it (rows (.., 1, d), gates (.., 1, 1)): reshaped once here instead
        # of unsqueezed in each of T steps, which halves the nodes the Scan runs per token.
        query = b.op("Transpose", self.per_value_head(query), perm=[1, 0, 2, 3, 4])  # (T, B, Hv, 1, dk)
        key = b.op("Transpose", self.per_value_head(key), perm=[1, 0, 2, 3, 4])
        value = self.to_float(b.op("Reshape", value, b.const([0, 0, d.num_value_heads, 1, d.value_head_dim])))
        value = b.op("Transpose", value, perm=[1, 0, 2, 3, 4])  # (T, B, Hv, 1, dv)
        gate_shape = b.const([0, 0, d.num_value_heads, 1, 1])
        decay = b.op("Transpose", b.op("Reshape", b.op("Exp", log_decay), gate_shape), perm=[1, 0, 2, 3, 4])
        beta = b.op("Transpose", b.op("Reshape", beta, gate_shape), perm=[1, 0, 2, 3, 4])  # (T, B, Hv, 1, 1)

        body = b.subgraph()
        with body.scope("token"):
            names = {n: body.fresh(n) for n in ("state", "q", "k", "v", "decay", "beta")}
            state_out, out = self.emit_delta_step(body, **names)
        hv, dk, dv = d.num_value_heads, d.key_head_dim, d.value_head_dim
        float32 = TensorProto.FLOAT
        graph = body.make_graph(
            "gated_delta_step",
            [
                value_info(names["state"], float32, [None, hv, dk, dv]),
                value_info(names["q"], float32, [None, hv, 1, dk]),
                value_info(names["k"], float32, [None, hv, 1, dk]),
                value_info(names["v"], float32, [None, hv, 1, dv]),
                value_info(names["decay"], float32, [None, hv, 1, 1]),
                value_info(names["beta"], float32, [None, hv, 1, 1]),
            ],
            [value_info(state_out, float32, [None, hv, dk, dv]), value_info(out, float32, [None, hv, 1, dv])],
        )
        outputs = b.fresh("outputs")
        b.op_to("Scan", [past, query, key, value, decay, beta], [present, outputs], body=graph, num_scan_inputs=5)
        out = b.op("Transpose", outputs, perm=[1, 0, 2, 3, 4])  # (B, T, Hv, 1, dv)
        return b.op("Reshape", out, b.const([0, 0, d.value_dim]))

    def per_value_head(self, x: str) -> str:
        """(B, T, Hk * dk) -> (B, T, Hv, 1, dk): key head h serves value heads h * r .. h * r + r - 1
        (torch's repeat_interleave over the head axis)."""
        b, d = self.b, self.dims
        x = b.op("Reshape", x, b.const([0, 0, d.num_key_heads, 1, d.key_head_dim]))
        if d.value_heads_per_key_head > 1:
            x = b.op("Expand", x, b.const([1, 1, 1, d.value_heads_per_key_head, 1]))
        return b.op("Reshape", x, b.const([0, 0, d.num_value_heads, 1, d.key_head_dim]))

    @staticmethod
    def emit_delta_step(
        body: GraphBuilder, state: str, q: str, k: str, v: str, decay: str, beta: str
    ) -> tuple[str, str]:
        """One token: state (B, Hv, dk, dv); q, k (B, Hv, 1, dk) rows; v (B, Hv, 1, dv); decay, beta (B, Hv, 1, 1).
        Returns the new state and the read-out (B, Hv, 1, dv); the new state is the body's output itself (an
        Identity to name it would copy the whole state every token)."""
        state = body.op("Mul", state, decay)  # S = exp(g) S
        remembered = body.op("MatMul", k, state)  # S^T k as a row: (B, Hv, 1, dv)
        delta = body.op("Mul", body.op("Sub", v, remembered), beta)  # beta (v - S^T k)
        k_col = body.op("Reshape", k, body.const([0, 0, -1, 1]))  # (B, Hv, dk, 1)
        state_out = body.fresh("state_out")
        body.op_to("Add", [state, body.op("MatMul", k_col, delta)], [state_out])  # S += k delta^T
        return state_out, body.op("MatMul", q, state_out)  # S^T q: (B, Hv, 1, dv)

    def emit_gated_norm(self, x: str, z: str, weight_name: str) -> str:
        """Qwen3_5RMSNormGated per value head: w * (x32 / sqrt(mean(x32²) + eps)).to(dtype), times silu(z32), cast
        to the model dtype. x and z (B, T, Hv * dv) in the model dtype."""
        b, d = self.b, self.dims
        heads = b.const([0, 0, d.num_value_heads, d.value_head_dim])
        x32 = self.to_float(b.op("Reshape", x, heads))
        variance = b.op("ReduceMean", b.op("Mul", x32, x32), b.const([-1]), keepdims=1)
        eps = b.const(d.rms_norm_eps, torch.float32)
        normed = b.op("Mul", x32, b.op("Reciprocal", b.op("Sqrt", b.op("Add", variance, eps))))
        scaled = b.op("Mul", b.weight(weight_name, self.weight(weight_name)), self.to_model_dtype(normed))
        gate = self.to_float(b.op("Reshape", z, heads))
        out = b.op("Mul", self.to_float(scaled), b.op("Mul", gate, b.op("Sigmoid", gate)))
        return b.op("Reshape", self.to_model_dtype(out), b.const([0, 0, d.value_dim]))


class FusedGatedDeltaNetGraph(GatedDeltaNetGraph):
    """The same layer with onnxruntime's com.microsoft operators where they are exact:

    conv        CausalConvWithState (carry of k - 1 inputs, fused SiLU), on (B, C, T); where the step has pads
                the carried state is gathered per row as in the plain form (the op's own, the last k - 1 columns,
                left unused), elsewhere it is the op's own (an If per layer: ``emit_conv_and_gates``)
    gates       LinearAttentionGate: decay_scale * softplus(a + dt_bias) and sigmoid(b), fed float32 so that
                both come out in float32
    delta rule  LinearAttention, update_rule gated_delta, q and k at the key heads (onnxruntime expands them to
                the value heads itself), state (B, Hv, dk, dv) float32, scale dk^-0.5
    norm        GatedRMSNorm over each value head's dv channels, silu gate, float32 inside

    l2 norm     q and k together in one SimplifiedLayerNormalization with transformers' eps rescaled (LinearAttention
                expects normalised keys; onnxruntime's normalising variant, GatedDeltaNet with qk_l2_norm, has CUDA
                and WebGPU kernels only, and the builder's LpNormalization has no eps)
    """

    contrib_ops = True
    branches_on_padding = True
    chunks_prompts = False  # onnxruntime's LinearAttention takes any length

    def emit_input_mask(self, x: str, padding: PaddingMasks) -> str:
        """Unchanged: the padded branch zeroes the conv's input instead (``emit_conv_and_gates``). A pad's z, a and b
        projections then differ from transformers', which only that pad's own output reads (its decay and beta
        are masked, its q|k|v zeroed); kept positions are the same bits, x * 1 being x."""
        return x

    def emit_conv_and_gates(
        self, qkv: str, step: str, write: str, prefix: str, padding: PaddingMasks, past_conv: str, present_conv: str
    ) -> tuple[str, str, str]:
        """An ``If`` on ``padding.unpadded``. A step whose new positions are all kept (every decode step
        onnxruntime-genai runs, an unpadded prompt) takes the unpadded branch: the conv op's own carry is the
        state and the gates go unmasked, which is what the padded branch computes there, bit for bit, in a
        third of the nodes. Other steps take the padded branch: the conv input zeroed at pads, the state
        gathered, the gates masked. Decode pays per node on small tensors: skipping the rule's nine nodes made a
        Qwen3.5-0.8B-shaped decode step 1.022x (0.977-1.036) as fast (docs/hybrid-export.md 6.6)."""
        b = self.b
        types = [self.onnx_dtype, TensorProto.FLOAT, TensorProto.FLOAT, self.onnx_dtype]
        branches = {}
        for name in ("unpadded", "padded"):
            body = b.subgraph()
            present = body.fresh("present_conv")
            with emitting_into(self, body), body.scope(name):
                if name == "unpadded":
                    with body.scope("conv"):
                        conv = self.emit_unpadded_conv(qkv, f"{prefix}.conv1d.weight", past_conv, present)
                    with body.scope("gates"):
                        log_decay, beta = self.emit_gates(step, write, prefix)
                else:
                    masked = body.op("Mul", qkv, padding.keep)  # pads: zeros in the conv window (transformers' rule)
                    conv, log_decay, beta = super().emit_conv_and_gates(
                        masked, step, write, prefix, padding, past_conv, present
                    )
            outputs = [value_info(v, t, None) for v, t in zip((conv, log_decay, beta, present), types, strict=True)]
            branches[name] = body.make_graph(f"{prefix}.{name}", [], outputs)
        conv, log_decay, beta = b.fresh("conv"), b.fresh("log_decay"), b.fresh("beta")
        b.op_to(
            "If",
            [padding.unpadded],
            [conv, log_decay, beta, present_conv],
            then_branch=branches["unpadded"],
            else_branch=branches["padded"],
        )
        return conv, log_decay, beta

    def emit_unpadded_conv(self, qkv: str, weight_name: str, past: str, present: str) -> str:
        """Every new position kept: the op's carry, the last k - 1 columns of ``past ++ inputs``, is the state.
        The op reads all of ``past`` before it writes ``present`` (one buffer under genai's shared buffers: tested)."""
        return self.emit_causal_conv(qkv, weight_name, past, present)

    def emit_causal_conv(self, qkv: str, weight_name: str, past: str, present: str | None = None) -> str:
        """CausalConvWithState with fused SiLU over (B, T, C) -> (B, T, C), reading its k - 1 past columns from
        ``past`` (B, C, k - 1); its carry goes to ``present``, or nowhere where the caller gathers its own."""
        b = self.b
        inputs = b.op("Transpose", qkv, perm=[0, 2, 1])  # (B, C, T): the op is channel-major
        weight = b.weight(weight_name, self.weight(weight_name))  # (C, 1, k)
        conv = b.fresh("conv")
        carry = present or b.fresh("unused_carry")
        b.op_to("CausalConvWithState", [inputs, weight, "", past], [conv, carry], domain=MS_DOMAIN, activation="silu")
        return b.op("Transpose", conv, perm=[0, 2, 1])

    def emit_conv(self, qkv: str, weight_name: str, past: str, present: str, state_index: str) -> str:
        """The op's carry is the last k - 1 columns whatever the mask, so ``present`` is gathered from
        ``past ++ inputs`` as in the plain form. The op then reads its past from that concatenation, not from
        ``past``: where past and present are one buffer (genai_config's past_present_share_buffer) the window's
        Transpose, ``past``'s only reader, must run before the gather writes ``present``, which only a data path
        guarantees."""
        b, k = self.b, self.dims.conv_kernel
        window = self.emit_window(qkv, past, present, state_index)  # (B, k - 1 + T, C)
        past_rows = b.op("Slice", window, b.const([0]), b.const([k - 1]), b.const([1]))  # past, read through the window
        carried = b.op("Transpose", past_rows, perm=[0, 2, 1])  # (B, C, k - 1)
        return self.emit_causal_conv(qkv, weight_name, carried)

    def emit_gates(self, step: str, write: str, prefix: str) -> tuple[str, str]:
        dt_bias = self.float_weight(f"{prefix}.dt_bias", self.weight(f"{prefix}.dt_bias"))
        decay_rate = self.float_weight(f"{prefix}.neg_exp_A_log", -self.weight(f"{prefix}.A_log").float().exp())
        log_decay, beta = self.b.op(
            "LinearAttentionGate",
            self.to_float(step),
            dt_bias,
            decay_rate,
            self.to_float(write),
            domain=MS_DOMAIN,
            outputs=2,
        )
        return log_decay, beta

    def emit_split_qkv(self, qkv: str) -> tuple[str, str, str]:
        """q and k normalised together by one SimplifiedLayerNormalization over their 2 Hk heads (a dozen small
        nodes fewer per layer, which decode pays for in dispatch): x / sqrt(sum(x²) + eps) is
        x / sqrt(mean(x²) + eps / dk) * dk^-0.5, the norm's epsilon and scale; float32 inside and out."""
        b, d = self.b, self.dims
        qk, value = b.op("Split", qkv, b.const([2 * d.key_dim, d.value_dim]), axis=-1, outputs=2)
        qk = self.to_float(b.op("Reshape", qk, b.const([0, 0, 2 * d.num_key_heads, d.key_head_dim])))
        scale = b.const([d.key_head_dim**-0.5] * d.key_head_dim, torch.float32)  # one inline copy for every layer
        qk = b.op("SimplifiedLayerNormalization", qk, scale, axis=-1, epsilon=L2NORM_EPS / d.key_head_dim, stash_type=1)
        qk = b.op("Reshape", qk, b.const([0, 0, 2 * d.key_dim]))
        query, key = b.op("Split", qk, b.const([d.key_dim, d.key_dim]), axis=-1, outputs=2)
        return query, key, value

    def emit_delta_rule(self, rule: DeltaRuleInputs, past: str, present: str, padding: PaddingMasks) -> str:
        d = self.dims
        out = self.b.fresh("linear_attention")
        self.b.op_to(
            "LinearAttention",
            [rule.query, rule.key, self.to_float(rule.value), past, rule.log_decay, rule.beta],
            [out, present],
            domain=MS_DOMAIN,
            q_num_heads=d.num_key_heads,
            kv_num_heads=d.num_value_heads,
            update_rule="gated_delta",
            scale=d.key_head_dim**-0.5,
        )
        return out  # (B, T, Hv * dv) float32

    def emit_gated_norm(self, x: str, z: str, weight_name: str) -> str:
        weight = self.b.weight(weight_name, self.weight(weight_name))  # (dv,): one norm per value head
        return self.b.op(
            "GatedRMSNorm", x, weight, z, domain=MS_DOMAIN, activation="silu", epsilon=self.dims.rms_norm_eps
        )
