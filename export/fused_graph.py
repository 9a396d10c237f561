"""The decoder graph with onnxruntime's contrib operators (``thinker export --graph fused``).

Same IO contract as ``DecoderGraph`` (names, shapes, dtypes; KV as (B, n_kv, S, hs)); what changes is inside:

  attention    one packed QKV MatMul and GroupQueryAttention (com.microsoft), which applies RoPE (``do_rotary``,
               from cos/sin caches of shape (max_pos, hs/2), at the positions the graph gives it), appends to the
               cache and applies the causal mask and softmax
  norms        SimplifiedLayerNormalization for RMSNorm, SkipSimplifiedLayerNormalization (SkipLayerNormalization
               for LayerNorm) wherever a residual add comes right before a norm
  qk-norm      SimplifiedLayerNormalization on q and k per head, before the rotation, as Qwen3 does (norm, then RoPE)
  MoE          the MoE op (com.microsoft): softmax over the router logits, top-k, optional renormalisation,
               interleaved SwiGLU experts: Qwen's routing exactly (checked against PyTorch in the tests); under
               ``--quantize`` QMoE, the same op over 4-bit (blocks) or 8-bit experts (blocks at level 4, else a
               scale per row)
  tied head    FusedMatMul with transB over the embedding matrix, straight to the (B, T, V) logits

GroupQueryAttention and padding. Its CPU kernel assumes compact rows: a row's keys are the slots [0, seqlens_k + 1).
So the graph feeds ``seqlens_k = S - 1`` for every row (every slot counts) and expresses padding as the additive
``attention_bias`` input, the attention mask's row expanded over the T queries (the kernel applies the causal mask
itself; the former causal-and-padding bias, the plain graph's, gave the same bits in nine nodes more per step): any
mask works, left padding (transformers', ``OnnxDecoder``'s) and onnxruntime-genai's right padding alike, whose
decode steps leave the pad slots inside the shorter rows (mask 1 1 1 0 0 1: the new token at slot 5, position 3).
RoPE inside GroupQueryAttention, and what it rotates by. In a prompt (an empty cache) the kernel rotates the token at
slot t by ``p + t``, p the first element of its ``position_ids`` input, whatever the rows; in a step after a cache it
rotates each token by its own element. Rotating every token by its slot is exact for a left-padded row (its
positions shifted by the constant number of pads; RoPE sees differences only) but not once a row has pad slots
between its prompt and its new tokens, as genai's right-padded rows do (measured: wrong tokens on the short row of a
3- and an 8-token prompt under onnxruntime-genai 0.18; tests/export/test_onnx_fused.py). So the graph gives the
kernel each token's ``position_ids`` shifted by its row's first unmasked slot: a left-padded row's real tokens get
their slots, a right-padded row (first slot 0) its positions, and pad tokens their slots, so that a prompt's first
element is 0 in every layout. Where the kernel cannot rotate (head_dim not a multiple of 16, partial rotary,
multimodal RoPE) the RotaryEmbedding / MRotaryEmbedding op rotates q and k by ``position_ids`` before it. A step
with several new tokens after a non-empty cache (chunked prefill)
needs batch 1 (an onnxruntime limit), documented in ``thinker export --help``.
KV buffers: a caller that concatenates (``OnnxDecoder``) feeds P past slots and gets P + T back, the contract. The
same graph also runs with one buffer of the whole context bound as both past and present, which
GroupQueryAttention updates in place at the slots the attention mask gives (S - T .. S - 1): genai_config.json
turns that on (``past_present_share_buffer``), and onnxruntime-genai then skips copying the cache every step.
Configs that GroupQueryAttention cannot take (head_dim not a multiple of 8) keep the plain attention.
onnxruntime-genai runs a copy of this graph without the padding bias and the shifted positions, which its
right-padded batches do not need and which slow GroupQueryAttention on CUDA: export/genai_graph.py.

Hybrid models (Qwen3.5, Qwen3-Next; docs/hybrid-export.md):
  linear layers      FusedGatedDeltaNetGraph: CausalConvWithState, LinearAttentionGate, LinearAttention,
                     GatedRMSNorm (com.microsoft), the recurrence and its state in float32
  output gate        GroupQueryAttention has none: its output times sigmoid(gate) (Sigmoid, Mul) before o_proj
  partial RoPE       the RotaryEmbedding op with ``rotary_embedding_dim``, by ``position_ids``, as for whole heads
  multimodal RoPE    MRotaryEmbedding (``mrope_layout`` 1 interleaved, 0 in sections) on q and k with the (3, B, T)
                     ``position_ids``, likewise
  zero-centred norm  in float32 graphs the float32 scale ``1 + w`` folded into (Skip)SimplifiedLayerNormalization;
                     in half precision the plain graph's norm, because the reference multiplies by ``1 + w`` in
                     float32 before rounding, which the contrib norms (scale in the model dtype) cannot
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

from thinker.configuration_thinker import ThinkerConfig

from .decoder_graph import MS_DOMAIN, DecoderGraph, StepContext, rope_tables, rotary_dim
from .hybrid_attention_graph import emit_mrotary_embedding, emit_output_gate, emit_query_and_gate, zero_centered_scale
from .linear_attention_graph import FusedGatedDeltaNetGraph
from .names import ROPE_SIN_TABLE, ROPE_TABLE
from .qwen4_exp_graph import emit_indexed_bias


@dataclass
class FusedStepContext(StepContext):
    """What GroupQueryAttention reads, computed once per forward."""

    seqlens_k: str | None = None  # (B,) int32: S - 1 for every row
    total_length: str | None = None  # int32 scalar: S
    padding_bias: str | None = None  # (B, 1, T, S) in the model dtype: 0 at kept slots, the dtype's minimum at pads
    cos_cache: str | None = None  # (max_pos, hs / 2) in the model dtype
    sin_cache: str | None = None
    position_ids: str | None = None  # for the RotaryEmbedding and MRotaryEmbedding ops
    rotation_positions: str | None = None  # (B, T) int64: what GroupQueryAttention's own RoPE rotates by


class FusedDecoderGraph(DecoderGraph):
    contrib_ops = True

    @staticmethod
    def standard_experts(config: ThinkerConfig) -> bool:
        """Where top-k weights are not renormalised (Qwen2-MoE's raw softmax weights): onnxruntime 1.31's CPU QMoE
        renormalises them whatever normalize_routing_weights says (measured: the same output at 0 and 1; the float
        MoE op honours it), so such experts take the plain graph's Loop over the same quantized experts."""
        return not config.norm_topk_prob

    linear_attention_graph = FusedGatedDeltaNetGraph

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        # onnxruntime's GroupQueryAttention checks: head_size % 8 == 0, and % 16 == 0 when it applies RoPE itself.
        self.use_gqa = self.head_dim % 8 == 0
        # GroupQueryAttention writes into a shared past/present buffer; CausalConvWithState and LinearAttention
        # read their whole past state before writing the present one, so they take one buffer too (tested).
        self.kv_in_place = self.use_gqa
        self.rotary = None
        if cfg.position_embedding_type == "rope":
            if self.mrope_section:
                self.rotary = "mrope"
            elif rotary_dim(cfg) < self.head_dim or self.head_dim % 16:
                self.rotary = "op"
            else:  # inside GroupQueryAttention: two RotaryEmbedding nodes less per layer, and q/k/v stay packed
                self.rotary = "gqa"
        self.rms = cfg.norm_type != "layernorm"
        # The contrib norms scale in the model dtype; the zero-centred reference scales by 1 + w in float32.
        self.fused_norms = self.rms and not (cfg.norm_zero_centered and self.dtype != torch.float32)

    # --- per-forward values -----------------------------------------------------------------------------------
    def emit_step_context(self, input_ids: str, attention_mask: str, position_ids: str) -> StepContext:
        if not self.use_gqa:
            return super().emit_step_context(input_ids, attention_mask, position_ids)
        b = self.b
        with b.scope("attn_mask"):
            # Padding alone: GroupQueryAttention applies the causal mask itself. Its bias must be (B, 1, T, S),
            # so the (B, 1, 1, S) row is expanded over the T queries.
            keep = b.op("Unsqueeze", b.op("Cast", attention_mask, to=TensorProto.BOOL), b.const([1, 2]))
            # The dtype's own minimum: finite (a row that sees nothing gets a uniform softmax, never NaN, which
            # would reach real rows as 0 x NaN through a pad's value vector).
            lowest = self.scalar(torch.finfo(self.dtype).min)
            queries = b.op("Concat", b.const([1, 1]), b.op("Shape", input_ids, start=1, end=2), b.const([1]), axis=0)
            padding_bias = b.op("Expand", b.op("Where", keep, self.scalar(0.0), lowest), queries)  # (B, 1, T, S)
            total = b.op("Cast", b.op("Shape", attention_mask, start=1, end=2), to=TensorProto.INT32)  # (1,): S
            batch = b.op("Shape", input_ids, start=0, end=1)
            seqlens_k = b.op("Expand", b.op("Sub", total, b.const([1], torch.int32)), batch)  # (B,)
            total = b.op("Squeeze", total, b.const([0]))
        ctx = FusedStepContext(
            attn_bias="",
            cos=None,
            sin=None,
            seqlens_k=seqlens_k,
            total_length=total,
            padding_bias=padding_bias,
            position_ids=position_ids,
        )
        if self.rotary:
            with b.scope("rotary_emb"):
                ctx.cos_cache, ctx.sin_cache = self.emit_rope_caches()
        if self.rotary == "gqa":
            with b.scope("rotation_positions"):
                ctx.rotation_positions = self.emit_rotation_positions(input_ids, attention_mask, position_ids)
        return ctx

    def emit_rotation_positions(self, input_ids: str, attention_mask: str, position_ids: str) -> str:
        """(B, T) int64: each new token's ``position_ids`` plus its row's first unmasked slot, and a pad token's own
        slot (see the module docstring): the slots of a left-padded row, the positions of a right-padded one."""
        b = self.b
        total = b.op("Shape", attention_mask, start=1, end=2)  # (1,): S
        new = b.op("Shape", input_ids, start=1, end=2)  # (1,): T
        past = b.op("Sub", total, new)
        slots = b.op("Range", b.op("Squeeze", past), b.op("Squeeze", total), b.const(1))  # (T,): S - T .. S - 1
        mask = b.op("Cast", attention_mask, to=TensorProto.INT32)  # ArgMax: the first maximum, on int32
        first = b.op("Cast", b.op("ArgMax", mask, axis=1, keepdims=1), to=TensorProto.INT64)  # (B, 1)
        real = b.op("Cast", b.op("Slice", attention_mask, past, total, b.const([1])), to=TensorProto.BOOL)  # (B, T)
        return b.op("Where", real, b.op("Add", position_ids, first), b.op("Unsqueeze", slots, b.const([0])))

    def emit_rope_caches(self) -> tuple[str, str]:
        """cos/sin over the whole context, (max_pos, rotary_dim / 2): the model's own tables (``rope_tables``), as
        GroupQueryAttention, RotaryEmbedding and MRotaryEmbedding take them."""
        cos, sin = rope_tables(self.config, self.dtype)
        return self.b.weight(ROPE_TABLE, cos), self.b.weight(ROPE_SIN_TABLE, sin)

    # --- norms ------------------------------------------------------------------------------------------------
    def emit_norm(self, x: str, prefix: str) -> str:
        if not self.rms:
            return super().emit_norm(x, prefix)
        return self.emit_rms_norm(x, f"{prefix}.weight")

    def rms_weight(self, name: str) -> str:
        """The contrib norms' scale: the weight, or the zero-centred ``1 + w`` (float32 graphs only)."""
        if self.config.norm_zero_centered:
            return self.b.weight(name, zero_centered_scale(self.weights.get(name)))
        return self.weight(name)

    def emit_rms_norm(self, x: str, weight_name: str) -> str:
        """Over the last axis, computed in float32 (stash_type 1) whatever the model dtype."""
        if not self.fused_norms:
            return super().emit_rms_norm(x, weight_name)
        eps = self.config.rms_norm_eps
        weight = self.rms_weight(weight_name)
        return self.b.op("SimplifiedLayerNormalization", x, weight, axis=-1, epsilon=eps, stash_type=1)

    def emit_add_norm(self, hidden: str, delta: str | None, prefix: str) -> tuple[str, str]:
        if delta is None or (self.rms and not self.fused_norms):
            return super().emit_add_norm(hidden, delta, prefix)
        b = self.b
        normed, total = b.fresh("normed"), b.fresh("residual")
        if self.rms:
            inputs, op = [hidden, delta, self.rms_weight(f"{prefix}.weight")], "SkipSimplifiedLayerNormalization"
        else:
            inputs = [hidden, delta, self.weight(f"{prefix}.weight"), self.weight(f"{prefix}.bias")]
            op = "SkipLayerNormalization"
        # Outputs: the norm, (mean, inv_std_var: unused, left unnamed), and hidden + delta for the next residual.
        b.op_to(op, inputs, [normed, "", "", total], domain=MS_DOMAIN, epsilon=self.config.rms_norm_eps)
        return total, normed

    # --- attention --------------------------------------------------------------------------------------------
    def emit_attention(self, i: int, x: str, ctx: StepContext) -> str:
        if not self.use_gqa:
            return super().emit_attention(i, x, ctx)
        assert isinstance(ctx, FusedStepContext)
        cfg, b = self.config, self.b
        prefix = f"model.layers.{i}.self_attn"
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.emit_packed_qkv(x, prefix)  # (B, T, (nh [x 2 with the gate] + 2 n_kv) hs)
        gate = None
        if cfg.qk_norm or cfg.attention_output_gate or self.rotary in ("op", "mrope"):
            q_width = nh * hs * (2 if cfg.attention_output_gate else 1)
            q, k, v = b.op("Split", qkv, b.const([q_width, nkv * hs, nkv * hs]), axis=-1, outputs=3)
            if cfg.attention_output_gate:  # [query | gate] per head
                q, gate = emit_query_and_gate(b, q, nh, hs)  # (B, T, nh, hs), (B, T, nh * hs)
                q = b.op("Reshape", q, b.const([0, 0, nh * hs]))
            if cfg.qk_norm:  # per head, on (B, T, n, hs), before RoPE
                with b.scope("q_norm"):
                    q = self.emit_head_norm(q, nh, f"{prefix}.q_norm.weight")
                with b.scope("k_norm"):
                    k = self.emit_head_norm(k, nkv, f"{prefix}.k_norm.weight")
            if self.rotary == "op":
                q, k = (self.emit_rotary_op(t, n, ctx) for t, n in ((q, nh), (k, nkv)))
            elif self.rotary == "mrope":
                section, dim = self.mrope_section, rotary_dim(cfg)
                q, k = (
                    emit_mrotary_embedding(
                        b, t, ctx.position_ids, ctx.cos_cache, ctx.sin_cache, n, dim, section, self.mrope_interleaved
                    )
                    for t, n in ((q, nh), (k, nkv))
                )
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv, "", ""]  # packed: GroupQueryAttention splits it
        in_kernel = self.rotary == "gqa"  # else q and k come rotated, or there is no RoPE
        bias = ctx.padding_bias
        if cfg.layer_types[i] == "indexed_attention":  # the slots its indexer keeps, per query
            bias = emit_indexed_bias(self, i, x, ctx, bias, 4, self.scalar(torch.finfo(self.dtype).min))
        out = b.fresh("attention")
        b.op_to(
            "GroupQueryAttention",
            [
                *qkv_inputs,
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                ctx.seqlens_k,
                ctx.total_length,
                *((ctx.cos_cache, ctx.sin_cache, ctx.rotation_positions) if in_kernel else ("", "", "")),
                bias,
            ],
            [out, f"present.{i}.key", f"present.{i}.value"],
            domain=MS_DOMAIN,
            num_heads=nh,
            kv_num_heads=nkv,
            scale=hs**-0.5,
            do_rotary=int(in_kernel),
            rotary_interleaved=0,
        )
        if gate is not None:
            out = emit_output_gate(b, out, gate)
        return self.linear(out, f"{prefix}.o_proj", cfg.attention_output_bias)

    def emit_packed_qkv(self, x: str, prefix: str) -> str:
        """q, k and v in one MatMul over the concatenated (C, (nh + 2 n_kv) hs) weight: one pass over x."""
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        weight = torch.cat([self.weights.get(f"{n}.weight") for n in names]).T
        qkv = self.emit_matmul(x, f"{prefix}.qkv_proj.weight", weight)
        if self.config.attention_bias:
            bias = torch.cat([self.weights.get(f"{n}.bias") for n in names])
            qkv = self.b.op("Add", qkv, self.b.weight(f"{prefix}.qkv_proj.bias", bias))
        return qkv

    def emit_head_norm(self, x: str, heads: int, weight_name: str) -> str:
        """RMSNorm of each head of a (B, T, heads * hs) projection."""
        b, hs = self.b, self.head_dim
        per_head = b.op("Reshape", x, b.const([0, 0, heads, hs]))
        return b.op("Reshape", self.emit_rms_norm(per_head, weight_name), b.const([0, 0, heads * hs]))

    def emit_rotary_op(self, x: str, heads: int, ctx: FusedStepContext) -> str:
        """RoPE by ``position_ids`` with the RotaryEmbedding op, on (B, T, heads * hs)."""
        return self.b.op(
            "RotaryEmbedding",
            x,
            ctx.position_ids,
            ctx.cos_cache,
            ctx.sin_cache,
            domain=MS_DOMAIN,
            num_heads=heads,
            rotary_embedding_dim=rotary_dim(self.config),
            interleaved=0,
        )

    # --- head -------------------------------------------------------------------------------------------------
    def emit_tied_head(self, hidden: str, bias: list[str], output: str) -> None:
        """FusedMatMul with transB straight to (B, T, V): no Reshape after it, whose copy of a graph output's
        logits took 3.4 % of a 64-token Qwen3.5-0.8B prefill (profiled); the same product as Gemm's."""
        b = self.b
        if bias:
            return super().emit_tied_head(hidden, bias, output)
        b.op_to("FusedMatMul", [hidden, "model.embed_tokens.weight"], [output], domain=MS_DOMAIN, transB=1)

    # --- feed-forward -----------------------------------------------------------------------------------------
    # A gated MLP is the plain graph's: gate and up as two MatMuls over x. The fused graph used to pack them into one
    # MatMul over the concatenated (C, 2I) weight and Split its output; under onnxruntime-genai that Split (a copy,
    # and a kernel call per layer) cost more than the second MatMul call saves: two MatMuls decode SmolLM2 1.009x
    # (1.000-1.014) as fast at batch 1 and 1.010x (1.001-1.020) at batch 8, int4 1.019x (1.006-1.026) at batch 8
    # (bench/bench_graph_ab.py --runtime genai: bench/results/graph_ab_smollm2-genai-*unpacked-mlp-b*.json). The
    # balance moves with the shape by about 1 % either way (Qwen3-0.6B's: 1.008x; Qwen3.5-0.8B's: 0.990x, the packed
    # form faster; graph_ab_qwen3*-genai-unpacked-mlp-b1.json); one layout, the builder's, is kept. q/k/v stay packed:
    # GroupQueryAttention reads the packed projection itself, with no Split.

    # --- mixture of experts -----------------------------------------------------------------------------------
    def emit_routed_experts(self, flat: str, prefix: str) -> str:
        """onnxruntime's MoE op where its SwiGLU is the model's (gated SiLU), QMoE under ``--quantize``; else the
        plain graph's Loop."""
        cfg, b = self.config, self.b
        if not (cfg.mlp_gated and cfg.hidden_act in ("silu", "swish")):
            return super().emit_routed_experts(flat, prefix)
        with b.scope("gate"):
            router_logits = b.op("MatMul", flat, self.weight(f"{prefix}.gate.weight", transpose=True))  # (N, E)
        gate_up_name, down_name = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        gate_up = self.weights.get(gate_up_name)  # (E, 2I, C): gate rows, then up rows
        experts, double, hidden = gate_up.shape
        # The CPU kernel takes SwiGLU interleaved (swiglu_fusion=1): row 2j is gate j, row 2j + 1 is up j.
        interleaved = gate_up.view(experts, 2, double // 2, hidden).transpose(1, 2).reshape(experts, double, hidden)
        down = self.weights.get(down_name)  # (E, C, I), as the op wants
        attributes = dict(
            domain=MS_DOMAIN,
            k=cfg.num_experts_per_tok,
            activation_type="swiglu",
            swiglu_fusion=1,
            activation_alpha=1.0,  # SwiGLU here is G * sigmoid(alpha G) * (L + beta): SiLU(G) * L
            activation_beta=0.0,
            normalize_routing_weights=int(cfg.norm_topk_prob),
        )
        quantizer = self.quantizer
        if quantizer and all(quantizer.applies_to_experts(*w.shape[1:]) for w in (gate_up, down)):
            if self.standard_experts(cfg):
                return super().emit_routed_experts(flat, prefix)
            in_blocks = quantizer.experts_in_blocks(hidden, down.shape[2])
            fc1 = quantizer.quantize_experts(b, gate_up_name, interleaved, in_blocks)
            fc2 = quantizer.quantize_experts(b, down_name, down, in_blocks)
            if fc1.block_size:  # else one scale per row
                attributes.update(block_size=fc1.block_size, accuracy_level=fc1.accuracy_level)
            # weights_prepacked 0: the raw (E, N, K * bits / 8) layout, whatever a provider's own would be
            attributes.update(expert_weight_bits=fc1.bits, weights_prepacked=0)
            return b.op("QMoE", flat, router_logits, *fc1.inputs, "", *fc2.inputs, **attributes)
        fc1 = self.b.weight(gate_up_name, interleaved)
        return b.op("MoE", flat, router_logits, fc1, "", self.b.weight(down_name, down), **attributes)
