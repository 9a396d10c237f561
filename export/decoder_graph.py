"""The Thinker decoder with its KV cache as an ONNX graph of standard operators, written op by op.

Every part of the model is one ``emit_*`` method that mirrors the PyTorch module's order of operations
(``thinker/modeling_thinker.py``): RMSNorm in float32 then cast back before the scale, softmax in float32, RoPE
tables in the model dtype, Qwen's router (softmax, top-k, optional renormalisation). The fused variant for
onnxruntime's contrib ops (``export/fused_graph.py``: GroupQueryAttention, SimplifiedLayerNormalization, MoE)
subclasses ``DecoderGraph`` and overrides the emitters it replaces; weight-only quantization
(``export/quantize.py``, MatMulNBits) plugs into ``emit_matmul`` and works with either graph.

IO contract (shared/DESIGN.md), P past and T new positions:
  inputs   input_ids [B, T] int64, attention_mask [B, P+T] int64, position_ids [B, T] int64 ([3, B, T] with
           multimodal RoPE: temporal, height, width; [B, T] there too under ``--positions text``, repeated
           on the three streams inside), past_key_values.{i}.key/.value [B, n_kv, P, hs]
           in the model dtype for each full-attention layer i
  outputs  logits [B, T, V] float32, present.{i}.key/.value [B, n_kv, P+T, hs] in the model dtype
(``--inputs-embeds`` cuts a decoder taking inputs_embeds [B, T, hidden] float32 from this one at the token lookup,
the ``embed/tokens`` scope: export/embeds_graph.py.)

Hybrid models (Qwen3.5, Qwen3-Next) add, for each linear-attention (Gated DeltaNet) layer i, its carried state:
past_key_values.{i}.conv_state [B, conv_dim, k - 1] in the model dtype and past_key_values.{i}.recurrent_state
[B, Hv, dk, dv] float32 -> present.{i}.conv_state / .recurrent_state, every axis but the batch static (what
onnxruntime-genai allocates from); zeros start a sequence, and a position the attention mask hides leaves both as they
were (padding on either side; docs/hybrid-export.md decision 6). Their full-attention layers
add the output gate, zero-centred norms and partial (multimodal) RoPE (``export/hybrid_attention_graph.py``), the
linear-attention layers come from ``export/linear_attention_graph.py``.

Linear weights are stored transposed, [in, out], so that every projection is a plain MatMul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
import torch
from onnx import TensorProto, helper

from thinker.configuration_thinker import ThinkerConfig, mrope_interleaved
from thinker.modeling_thinker import ThinkerRotaryEmbedding
from thinker_common.errors import ThinkerError

from .graph_builder import TORCH_TO_ONNX, GraphBuilder, emitting_into, value_info
from .hybrid_attention_graph import (
    emit_output_gate,
    emit_partial_rotary,
    emit_query_and_gate,
    emit_rms_norm,
    emit_rotary_cos_sin,
    mrope_stream_selector,
    rotary_dim,
)
from .linear_attention_graph import GatedDeltaNetDims, GatedDeltaNetGraph, PaddingMasks, emit_padding_masks
from .names import (
    DEEPSTACK_SCOPE,
    LAST_POSITION_SCOPE,
    POSITION_TABLE,
    ROPE_SIN_TABLE,
    ROPE_TABLE,
    TOKENS_SCOPE,
    export_context,
)
from .qwen4_exp_graph import (
    Qwen4ExpValues,
    emit_final_mix,
    emit_indexed_bias,
    emit_ple_addition,
    emit_step_values,
    emit_stream_layer,
    extra_state_values,
)
from .weights import ThinkerWeights

if TYPE_CHECKING:
    from .quantize import QuantizedProjection, SplitProjection, StandardExperts, WeightQuantizer

OPSET = 21
MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib operators
IR_VERSION = 10  # what opset 21 asks for; onnxruntime >= 1.20 reads it

# Symbolic dimension names, as Optimum and onnxruntime-genai's builder spell them.
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"

SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu")
# The Gated DeltaNet's conv activation is hidden_act; both graph forms (and onnxruntime's fused conv) apply SiLU.
LINEAR_ATTENTION_ACTIVATIONS = ("silu", "swish")
# RoPE types whose frequencies transformers recomputes as the context grows (``dynamic_rope_update``): a table
# computed once at export would differ from the model's for some lengths.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# A MoE step whose tokens pick at most this many (token, expert) pairs, and at most a quarter of the experts, gathers
# the picked experts' weights at once; a longer one visits each picked expert in a Loop (``picked_experts_max_tokens``).
PICKED_EXPERTS_MAX_PAIRS = 32


@dataclass
class StepContext:
    """Values computed once per forward and shared by every layer."""

    attn_bias: str  # float32 additive mask, (B, 1, 1, T, S): 0 where a query may attend, the float32 minimum elsewhere
    cos: str | None  # (B, 1, T, rotary_dim) in the model dtype, for RoPE
    sin: str | None
    linear_padding: PaddingMasks | None = None  # what the linear-attention layers read about padding
    qwen4_exp: Qwen4ExpValues | None = None  # what Qwen3.8's PLE layers and indexers read (export/qwen4_exp_graph.py)


def position_form(config: ThinkerConfig, positions: str | None) -> str:
    """The graph's position_ids form (``--positions``): the asked one, or the model's own, "multimodal" (3, B, T)
    where it has multimodal RoPE, else "text" (B, T)."""
    multimodal = bool((config.rope_parameters or {}).get("mrope_section"))
    if positions == "multimodal" and not multimodal:
        raise ThinkerError(
            "--positions multimodal: this model has no multimodal RoPE (no mrope_section in its rope_parameters), "
            "so its position_ids are (batch, seq) text positions; leave --positions out"
        )
    return positions or ("multimodal" if multimodal else "text")


@dataclass(frozen=True)
class RoutedStep:
    """What both ways of running one MoE step's routed experts read (``DecoderGraph.emit_routed_experts``): the
    step's tokens (N, C), each token's k routing weights and expert ids (N, k), the layer's two expert stacks."""

    flat: str
    weights: str
    experts: str
    gate_up: str | StandardExperts
    down: str | StandardExperts


def emit_last_position(
    b: GraphBuilder, hidden: str, input_ids: str, attention_mask: str, dtype: torch.dtype, right_padded: bool = False
) -> str:
    """(B, 1, C): each row's hidden state at its last kept new position, the one a next token is sampled from.
    That is the last slot for a left-padded prompt and every decode step, and the last real token of a right-padded
    one (onnxruntime-genai pads a batch of unequal prompts on the right); a row that keeps no new position (no
    logits worth reading) takes its last slot. The mask, not the last slot, decides: a right-padded row's last slot
    is a pad. (``--logits last``'s graph, and every onnxruntime-genai graph: export/genai_graph.py.)

    Every decode step runs it, so it is written per provider, in the fewest nodes each runs on its device. A
    float32 graph (the CPU's): ArgMax with ``select_last_index``, six nodes (an earlier 13-node form cost 0.8 % of a
    SmolLM2 step under onnxruntime-genai, this one nothing measurable). A half graph (CUDA's, whose ArgMax takes no
    int64: onnxruntime's operator table) numbers the kept positions and takes the largest, in int64 operators CUDA
    runs, so that no node falls back to the CPU (a copy each way per step, and no CUDA graph capture).

    ``right_padded``: the graph takes right padding alone (onnxruntime-genai's batches: a step's new slots kept,
    then padded; a decode step's one slot), so the last kept one is their count less one, -1 (GatherND's last slot)
    for a row that keeps none: a ReduceSum and a Sub, for either dtype, where the half form's Range, Add, Squeeze,
    Mul and ReduceMax took about 0.05 ms of an H200's 5 ms Qwen3-0.6B-shaped step at batch 1
    (`profile-genai-cuda-h200-b1.json`); int64 operators CUDA runs (the genai graph's seqlens_k is a ReduceSum of
    the same mask). Wrong for a left-padded row, which such a graph is not for."""
    seq = b.op("Shape", input_ids, start=1, end=2)  # (1,): T
    new = b.op("Slice", attention_mask, b.op("Neg", seq), b.const([torch.iinfo(torch.int64).max]), b.const([1]))
    if right_padded:
        index = b.op("Sub", b.op("ReduceSum", new, b.const([1]), keepdims=1), b.const(1))  # (B, 1)
    elif dtype == torch.float32:
        index = b.op("ArgMax", new, axis=1, keepdims=1, select_last_index=1)  # (B, 1): the last 1, else the last slot
    else:
        numbers = b.op("Range", b.const(1), b.op("Add", b.op("Squeeze", seq, b.const([0])), b.const(1)), b.const(1))
        last = b.op("ReduceMax", b.op("Mul", new, numbers), b.const([1]), keepdims=1)  # (B, 1): 1 + its index
        index = b.op("Sub", last, b.const(1))  # -1 where none is kept: GatherND's last slot
    return b.op("Unsqueeze", b.op("GatherND", hidden, index, batch_dims=1), b.const([1]))


class DecoderGraph:
    """Builds the decoder graph for one config, streaming weights from ``weights`` into ``builder``."""

    contrib_ops = False  # True where the graph uses onnxruntime's com.microsoft operators
    kv_in_place = False  # True where every layer's cache can also be one buffer bound as past and present

    @staticmethod
    def standard_experts(config: ThinkerConfig) -> bool:
        """Whether quantized routed experts are held in standard types (export/quantize.py ``standard_experts``)
        rather than as QMoE's: always in this graph."""
        return True

    linear_attention_graph: type[GatedDeltaNetGraph] = GatedDeltaNetGraph  # the Gated DeltaNet emitter

    def __init__(
        self,
        config: ThinkerConfig,
        weights: ThinkerWeights,
        builder: GraphBuilder,
        dtype: torch.dtype,
        quantizer: WeightQuantizer | None = None,
        positions: str | None = None,
        logits: str = "all",
    ):
        """``positions``: the form of position_ids (``position_form``); "text" on a multimodal-RoPE model takes
        (B, T) and repeats them on its three streams (``--positions text``). ``logits``: "all" (B, T, V), or "last"
        (B, 1, V): each row's last kept new position only (``--logits``, export/names.py LOGITS)."""
        self.config = config
        self.last_logits_only = logits == "last"
        self.quantizer = quantizer
        self.weights = weights
        self.b = builder
        self.dtype = dtype
        self.onnx_dtype = TORCH_TO_ONNX[dtype]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        check_exportable(config)
        self.mrope_section = (config.rope_parameters or {}).get("mrope_section")
        self.mrope_interleaved = mrope_interleaved(config.rope_parameters)
        self.multimodal_positions = position_form(config, positions) == "multimodal"
        self.linear_dims = GatedDeltaNetDims.from_config(config) if config.has_linear_attention else None
        # A quantized head that a tied embedding is gathered from (``emit_embeddings``), quantized there, emitted
        # as the head later.
        self.shared_head: QuantizedProjection | SplitProjection | None = None

    # --- the whole graph --------------------------------------------------------------------------------------
    def build(self) -> onnx.GraphProto:
        cfg, b = self.config, self.b
        with b.scope("model"):
            positions = "position_ids"
            if self.mrope_section and not self.multimodal_positions:
                with b.scope("text_positions"):  # (B, T) -> (3, B, T): the same rows on every stream
                    positions = b.op("Expand", b.op("Unsqueeze", positions, b.const([0])), b.const([3, 1, 1]))
            ctx = self.emit_step_context("input_ids", "attention_mask", positions)
            if cfg.qwen4_exp_features:
                with b.scope("qwen4_exp"):
                    ctx.qwen4_exp = emit_step_values(self, "input_ids", "attention_mask", positions)
            if cfg.has_linear_attention:
                with b.scope("linear_attn_mask"):
                    ctx.linear_padding = emit_padding_masks(
                        b,
                        "attention_mask",
                        "input_ids",
                        self.dtype,
                        self.linear_dims,
                        branches=self.linear_attention_graph.branches_on_padding,
                        chunks=self.linear_attention_graph.chunks_prompts,
                    )
            with b.scope("embed"):
                hidden = self.emit_embeddings("input_ids", positions)
                if cfg.hc_count > 1:  # hyper-connections: hc_count streams, each starting as the embedding
                    hidden = b.op("Tile", hidden, b.const([1, 1, cfg.hc_count]))  # (B, T, n·C)
            # The residual stream travels as (sum so far, the last block's output not yet added), so that a fused
            # graph can add and normalise in one node (SkipSimplifiedLayerNormalization).
            delta = None
            for i in range(cfg.num_hidden_layers):
                with b.scope(f"layers.{i}"):
                    if cfg.hc_count > 1:
                        hidden = emit_stream_layer(self, i, hidden, ctx)
                    else:
                        hidden, delta = self.emit_layer(i, hidden, delta, ctx)
                if i < cfg.deepstack_layers and cfg.hc_count == 1:
                    # where --inputs-embeds adds the vision tower's DeepStack features (export/embeds_graph.py): the
                    # running sum, the layer's last output (delta) still to come, so the sum of both takes them
                    with b.scope(f"{DEEPSTACK_SCOPE}.{i}"):
                        hidden = b.op("Identity", hidden)
            if cfg.hc_count > 1:
                with b.scope("hyper_connection_mixer"):
                    hidden = emit_final_mix(self, hidden)
            else:
                with b.scope("norm"):
                    _, hidden = self.emit_add_norm(hidden, delta, "model.norm")
        with b.scope("lm_head"):
            if self.last_logits_only:
                with b.scope(LAST_POSITION_SCOPE):
                    hidden = emit_last_position(b, hidden, "input_ids", "attention_mask", self.dtype)
            self.emit_lm_head(hidden, "logits")
        return b.make_graph("thinker_decoder", self.graph_inputs(), self.graph_outputs())

    def graph_inputs(self) -> list[onnx.ValueInfoProto]:
        positions = [3, BATCH, SEQ] if self.multimodal_positions else [BATCH, SEQ]
        inputs = [
            value_info("input_ids", TensorProto.INT64, [BATCH, SEQ]),
            value_info("attention_mask", TensorProto.INT64, [BATCH, TOTAL]),
            value_info("position_ids", TensorProto.INT64, positions),
        ]
        return inputs + self.state_values("past_key_values", PAST)

    def graph_outputs(self) -> list[onnx.ValueInfoProto]:
        # A static 1 is how onnxruntime-genai (0.12.2 and later) recognises logits it need not slice itself.
        positions = 1 if self.last_logits_only else SEQ
        outputs = [value_info("logits", TensorProto.FLOAT, [BATCH, positions, self.config.vocab_size])]
        return outputs + self.state_values("present", TOTAL)

    def state_values(self, prefix: str, kv_length: str) -> list[onnx.ValueInfoProto]:
        """Each layer's carried state, by its layer type: KV for full attention, conv and recurrent state for
        linear attention (static but for the batch, as onnxruntime-genai requires)."""
        kv_shape = [BATCH, self.num_kv_heads, kv_length, self.head_dim]
        values = []
        for i, layer_type in enumerate(self.config.layer_types):
            if layer_type == "linear_attention":
                dims = self.linear_dims
                values.append(value_info(f"{prefix}.{i}.conv_state", self.onnx_dtype, dims.conv_state_shape(BATCH)))
                values.append(
                    value_info(f"{prefix}.{i}.recurrent_state", TensorProto.FLOAT, dims.recurrent_state_shape(BATCH))
                )
            else:
                values.append(value_info(f"{prefix}.{i}.key", self.onnx_dtype, kv_shape))
                values.append(value_info(f"{prefix}.{i}.value", self.onnx_dtype, kv_shape))
            values += extra_state_values(self.config, i, prefix, self.onnx_dtype, BATCH, kv_length)
        return values

    # --- small helpers ----------------------------------------------------------------------------------------
    def weight(self, name: str, transpose: bool = False) -> str:
        tensor = self.weights.get(name)
        if transpose:  # nn.Linear keeps (out, in); MatMul wants (in, out). For 3-D expert stacks: the last two axes.
            tensor = tensor.transpose(-1, -2)
        return self.b.weight(name, tensor)

    def scalar(self, value: float) -> str:
        """A scalar in the model dtype."""
        return self.b.const(value, self.dtype)

    def to_float(self, x: str) -> str:
        return self.b.to_float32(x, self.dtype)

    def to_model_dtype(self, x: str) -> str:
        return self.b.to_dtype(x, self.dtype)

    def linear(self, x: str, prefix: str, bias: bool) -> str:
        y = self.emit_matmul(x, f"{prefix}.weight", self.weights.get(f"{prefix}.weight").T)
        return self.b.op("Add", y, self.weight(f"{prefix}.bias")) if bias else y

    def emit_matmul(self, x: str, name: str, weight: torch.Tensor) -> str:
        """``x @ weight`` for a 2-D (in, out) weight: the one place a projection is written, so that a
        weight-only quantizer (``export/quantize.py``) can replace it with MatMulNBits."""
        if self.quantizer is not None and self.quantizer.applies(weight, name):
            return self.quantizer.emit(self.b, x, name, weight)
        return self.b.op("MatMul", x, self.b.weight(name, weight))

    # --- per-forward values -----------------------------------------------------------------------------------
    def emit_step_context(self, input_ids: str, attention_mask: str, position_ids: str) -> StepContext:
        with self.b.scope("attn_mask"):
            bias = self.emit_attention_bias(input_ids, attention_mask)
        cos = sin = None
        if self.config.position_embedding_type == "rope":
            with self.b.scope("rotary_emb"):
                cos, sin = self.emit_rope_tables(position_ids)
        return StepContext(attn_bias=bias, cos=cos, sin=sin)

    def emit_attention_bias(self, input_ids: str, attention_mask: str) -> str:
        """Causal and padding masks in one additive float32 bias of shape (B, 1, 1, T, S): 0 where allowed, the
        float32 minimum elsewhere. Rows that see nothing (a left pad's own query) get a uniform softmax, never NaN,
        because the bias is finite; their outputs are garbage that no kept position reads."""
        allowed = self.emit_allowed(input_ids, attention_mask)
        lowest = torch.finfo(torch.float32).min
        return self.b.op("Where", allowed, self.b.const(0.0, torch.float32), self.b.const(lowest, torch.float32))

    def emit_allowed(self, input_ids: str, attention_mask: str) -> str:
        """Which cache slot each query may see, bool (B, 1, 1, T, S): query t sits at slot P + t, where
        P = S - T, and may see slot s when s <= P + t and the mask keeps s."""
        b = self.b
        seq = b.op("Squeeze", b.op("Shape", input_ids, start=1, end=2), b.const([0]))  # T, a scalar
        total = b.op("Squeeze", b.op("Shape", attention_mask, start=1, end=2), b.const([0]))  # S
        past = b.op("Sub", total, seq)
        query_slot = b.op("Unsqueeze", b.op("Range", past, total, b.const(1)), b.const([1]))  # (T, 1)
        key_slot = b.op("Unsqueeze", b.op("Range", b.const(0), total, b.const(1)), b.const([0]))  # (1, S)
        causal = b.op("LessOrEqual", key_slot, query_slot)  # (T, S)
        keep = b.op("Cast", attention_mask, to=TensorProto.BOOL)
        keep = b.op("Unsqueeze", keep, b.const([1, 2, 3]))  # (B, 1, 1, 1, S)
        return b.op("And", causal, keep)  # (B, 1, 1, T, S)

    def emit_rope_tables(self, position_ids: str) -> tuple[str, str]:
        """cos/sin rows for ``position_ids``, (B, 1, T, rotary_dim), gathered from ``rope_tables`` stored as
        weights; with multimodal RoPE each frequency keeps its own position stream of the (3, B, T) positions."""
        cos, sin = rope_tables(self.config, self.dtype)
        cos_table = self.b.weight(ROPE_TABLE, cos)
        sin_table = self.b.weight(ROPE_SIN_TABLE, sin)
        selector = None
        if self.mrope_section:
            selector = self.b.weight(
                "rotary_emb.mrope_selector",
                mrope_stream_selector(self.mrope_section, cos.shape[1], self.mrope_interleaved),
            )
        return emit_rotary_cos_sin(self.b, position_ids, cos_table, sin_table, self.dtype, selector)

    # --- embeddings and head ----------------------------------------------------------------------------------
    def emit_embeddings(self, input_ids: str, position_ids: str) -> str:
        cfg, quantizer = self.config, self.quantizer
        head_shape = (cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings and quantizer is not None and quantizer.shares_embedding(head_shape):
            # Tied and quantized: the head is quantized here, once, and the lookup dequantizes its rows
            # (export/quantize.py, ``emit_gather``), so the table is stored once, quantized.
            self.shared_head = quantizer.quantize(self.b, "lm_head.weight", self.weights.get("lm_head.weight").T)
        # The token lookup alone in its scope: ``--inputs-embeds`` cuts the graph there (export/embeds_graph.py)
        with self.b.scope(TOKENS_SCOPE):
            if self.shared_head is not None:
                hidden = quantizer.emit_gather(self.b, self.shared_head, input_ids)
            else:
                hidden = self.b.op("Gather", self.weight("model.embed_tokens.weight"), input_ids)  # (B, T, C)
        if self.config.position_embedding_type == "learned":
            positions = self.b.op("Gather", self.weight(POSITION_TABLE), position_ids)
            hidden = self.b.op("Add", hidden, positions)
        return hidden

    def emit_lm_head(self, hidden: str, output: str) -> None:
        b, cfg = self.b, self.config
        bias = [self.weight("lm_head.bias")] if cfg.lm_head_bias else []
        # float32 graphs write the logits straight into ``output``: an identity Cast there is a full copy of the
        # (B, T, V) logits that onnxruntime does not remove (7 % of a 64-token Qwen3.5-0.8B prefill, profiled).
        cast = self.dtype != torch.float32
        if cfg.tie_word_embeddings and self.quantizer is None:
            # Tied: the (V, C) embedding matrix serves as the head through Gemm's transB, so it is stored once.
            # (Quantized graphs quantize the head; the embedding gathers from it, or, with HQQ, stays float.)
            # transB reads the (V, C) matrix as fast as MatMul reads a (C, V) copy (measured: onnxruntime 1.31,
            # V = 124160, 1 and 128 rows).
            logits_out = b.fresh("logits") if cast else output
            self.emit_tied_head(hidden, bias, logits_out)
        else:
            if self.shared_head is not None:
                logits_out = self.quantizer.emit_matmul(b, hidden, self.shared_head)
            else:
                logits_out = self.emit_matmul(hidden, "lm_head.weight", self.weights.get("lm_head.weight").T)
            if bias:
                logits_out = b.op("Add", logits_out, bias[0])
            if not cast:
                b.op_to("Identity", [logits_out], [output])  # onnxruntime folds this one into its producer (a Cast not)
        if cast:
            b.op_to("Cast", [logits_out], [output], to=TensorProto.FLOAT)

    def emit_tied_head(self, hidden: str, bias: list[str], output: str) -> None:
        """``output`` (B, T, V) = hidden (B, T, C) @ embed_tokens^T: Gemm's transB over the 2-D rows."""
        b, cfg = self.b, self.config
        flat = b.op("Reshape", hidden, b.const([-1, cfg.hidden_size]))
        logits = b.op("Gemm", flat, "model.embed_tokens.weight", *bias, transB=1)
        out_shape = b.op("Concat", b.op("Shape", hidden, start=0, end=2), b.const([cfg.vocab_size]), axis=0)
        b.op_to("Reshape", [logits, out_shape], [output])

    # --- norms ------------------------------------------------------------------------------------------------
    def emit_add_norm(self, hidden: str, delta: str | None, prefix: str) -> tuple[str, str]:
        """The residual add (when ``delta`` is given) and the norm after it: returns (hidden + delta, norm)."""
        if delta is not None:
            hidden = self.b.op("Add", hidden, delta)
        return hidden, self.emit_norm(hidden, prefix)

    def emit_norm(self, x: str, prefix: str) -> str:
        if self.config.norm_type == "layernorm":
            weight, bias = self.weight(f"{prefix}.weight"), self.weight(f"{prefix}.bias")
            return self.b.op(
                "LayerNormalization", x, weight, bias, axis=-1, epsilon=self.config.rms_norm_eps, stash_type=1
            )
        return self.emit_rms_norm(x, f"{prefix}.weight")

    def emit_rms_norm(self, x: str, weight_name: str) -> str:
        """``weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)`` over the last axis, as ThinkerRMSNorm; zero-centred
        weights (``norm_zero_centered``) scale by the float32 ``1 + w`` before the cast instead."""
        cfg = self.config
        weight = self.weights.get(weight_name)
        return emit_rms_norm(self.b, x, weight_name, weight, cfg.rms_norm_eps, self.dtype, cfg.norm_zero_centered)

    # --- decoder layer ----------------------------------------------------------------------------------------
    def emit_layer(self, i: int, hidden: str, delta: str | None, ctx: StepContext) -> tuple[str, str]:
        """One decoder layer on the residual stream ``hidden + delta``; returns the new (hidden, delta)."""
        prefix = f"model.layers.{i}"
        if i + 1 in self.config.ple_layer_ids:  # a Qwen3.8 PLE layer without hyper-connections adds to the residual
            hidden = self.b.op("Add", hidden, delta) if delta is not None else hidden
            hidden, delta = emit_ple_addition(self, i, hidden, ctx), None
        with self.b.scope("input_layernorm"):
            hidden, normed = self.emit_add_norm(hidden, delta, f"{prefix}.input_layernorm")
        if self.config.layer_types[i] == "linear_attention":
            with self.b.scope("linear_attn"):
                attn = self.emit_linear_attention(i, normed, ctx)
        else:
            with self.b.scope("self_attn"):
                attn = self.emit_attention(i, normed, ctx)
        with self.b.scope("post_attention_layernorm"):
            hidden, normed = self.emit_add_norm(hidden, attn, f"{prefix}.post_attention_layernorm")
        with self.b.scope("mlp"):
            if self.config.mlp_layer_types[i] == "sparse":
                mlp = self.emit_moe(normed, f"{prefix}.mlp")
            else:
                mlp = self.emit_mlp(normed, f"{prefix}.mlp")
        return hidden, mlp

    # --- linear attention -------------------------------------------------------------------------------------
    def emit_linear_attention(self, i: int, x: str, ctx: StepContext) -> str:
        """Gated DeltaNet on (B, T, C) with layer ``i``'s conv and recurrent state in and out."""
        layer = self.linear_attention_graph(self.b, self.linear_dims, self.dtype, self.weights.get, self.emit_matmul)
        states = [f"past_key_values.{i}.conv_state", f"past_key_values.{i}.recurrent_state"]
        states += [f"present.{i}.conv_state", f"present.{i}.recurrent_state"]
        return layer.emit(x, f"model.layers.{i}.linear_attn", ctx.linear_padding, *states)

    # --- attention --------------------------------------------------------------------------------------------
    def emit_attention(self, i: int, x: str, ctx: StepContext) -> str:
        cfg, b = self.config, self.b
        prefix = f"model.layers.{i}.self_attn"
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.linear(x, f"{prefix}.q_proj", cfg.attention_bias)
        gate = None
        if cfg.attention_output_gate:  # q_proj yields [query | gate] per head
            q, gate = emit_query_and_gate(b, q, nh, hs)  # (B, T, nh, hs), (B, T, nh * hs)
        else:
            q = b.op("Reshape", q, b.const([0, 0, nh, hs]))
        k = b.op("Reshape", self.linear(x, f"{prefix}.k_proj", cfg.attention_bias), b.const([0, 0, nkv, hs]))
        v = b.op("Reshape", self.linear(x, f"{prefix}.v_proj", cfg.attention_bias), b.const([0, 0, nkv, hs]))
        if cfg.qk_norm:  # per head, on (B, T, n, hs)
            with b.scope("q_norm"):
                q = self.emit_rms_norm(q, f"{prefix}.q_norm.weight")
            with b.scope("k_norm"):
                k = self.emit_rms_norm(k, f"{prefix}.k_norm.weight")
        q = b.op("Transpose", q, perm=[0, 2, 1, 3])  # (B, nh, T, hs)
        k = b.op("Transpose", k, perm=[0, 2, 1, 3])  # (B, n_kv, T, hs)
        v = b.op("Transpose", v, perm=[0, 2, 1, 3])
        if ctx.cos is not None:
            with b.scope("rotary"):
                q = self.emit_rotary(q, ctx.cos, ctx.sin)
                k = self.emit_rotary(k, ctx.cos, ctx.sin)
        b.op_to("Concat", [f"past_key_values.{i}.key", k], [f"present.{i}.key"], axis=2)  # (B, n_kv, S, hs)
        b.op_to("Concat", [f"past_key_values.{i}.value", v], [f"present.{i}.value"], axis=2)
        bias = ctx.attn_bias
        if cfg.layer_types[i] == "indexed_attention":  # the slots its indexer keeps, per query
            lowest = b.const(torch.finfo(torch.float32).min, torch.float32)
            bias = emit_indexed_bias(self, i, x, ctx, bias, 5, lowest)
        out = self.emit_sdpa(q, f"present.{i}.key", f"present.{i}.value", bias)  # (B, T, nh*hs)
        if gate is not None:
            out = emit_output_gate(b, out, gate)
        return self.linear(out, f"{prefix}.o_proj", cfg.attention_output_bias)

    def emit_rotary(self, x: str, cos: str, sin: str) -> str:
        """``x * cos + rotate_half(x) * sin`` with the half-split rotation, on the first ``rotary_dim`` channels of
        each head (all of them unless ``partial_rotary_factor`` says otherwise)."""
        return emit_partial_rotary(self.b, x, cos, sin, rotary_dim(self.config), self.head_dim)

    def emit_sdpa(self, q: str, k: str, v: str, attn_bias: str) -> str:
        """Grouped-query attention without copying K/V per query head: the g = nh / n_kv query heads that share a
        KV head become one axis, and MatMul broadcasts K/V over it. (B, nh, T, hs) -> (B, T, nh * hs)."""
        b = self.b
        nh, nkv, hs = self.num_heads, self.num_kv_heads, self.head_dim
        groups = nh // nkv
        q = b.op("Reshape", q, b.const([0, nkv, groups, -1, hs]))  # (B, n_kv, g, T, hs)
        # Transpose right before MatMul, so that onnxruntime folds it into the product (FusedMatMul, transB).
        k_t = b.op("Transpose", b.op("Unsqueeze", k, b.const([2])), perm=[0, 1, 2, 4, 3])  # (B, n_kv, 1, hs, S)
        # scaled in float32: 1/sqrt(hs) is no half-precision number for most head sizes (PyTorch scales at float32
        # precision in a half-precision model too)
        scores = b.op("Mul", self.to_float(b.op("MatMul", q, k_t)), b.const(hs**-0.5, torch.float32))
        scores = b.op("Add", scores, attn_bias)  # (B, n_kv, g, T, S)
        probs = self.to_model_dtype(b.op("Softmax", scores, axis=-1))
        out = b.op("MatMul", probs, b.op("Unsqueeze", v, b.const([2])))  # (B, n_kv, g, T, hs)
        out = b.op("Reshape", out, b.const([0, nh, -1, hs]))  # (B, nh, T, hs)
        out = b.op("Transpose", out, perm=[0, 2, 1, 3])  # (B, T, nh, hs)
        return b.op("Reshape", out, b.const([0, 0, nh * hs]))

    # --- feed-forward -----------------------------------------------------------------------------------------
    def emit_activation(self, x: str, b: GraphBuilder | None = None) -> str:
        """``hidden_act`` as transformers' ACT2FN computes it; ``b`` is the builder to write into (a Loop body).
        The GELUs in float32 whatever the model dtype, rounded once: their coefficients are not half-precision
        numbers (sqrt(2/pi) is 0.796875 in bfloat16, 0.13 % off), and PyTorch applies them at float32 precision
        in a half-precision model too."""
        b, act = b or self.b, self.config.hidden_act
        if act in ("silu", "swish"):
            return b.op("Mul", x, b.op("Sigmoid", x))
        if act == "relu":
            return b.op("Relu", x)
        x = b.to_float32(x, self.dtype)

        def scalar(value: float) -> str:
            return b.const(value, torch.float32)

        if act == "quick_gelu":
            out = b.op("Mul", x, b.op("Sigmoid", b.op("Mul", x, scalar(1.702))))
        else:
            half_x = b.op("Mul", x, scalar(0.5))
            if act == "gelu":  # exact: 0.5 x (1 + erf(x / sqrt 2))
                inner = b.op("Erf", b.op("Mul", x, scalar(1 / math.sqrt(2))))
            else:  # the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))
                cube = b.op("Mul", b.op("Mul", x, x), x)
                inner = b.op("Add", x, b.op("Mul", cube, scalar(0.044715)))
                inner = b.op("Tanh", b.op("Mul", inner, scalar(math.sqrt(2 / math.pi))))
            out = b.op("Mul", half_x, b.op("Add", inner, scalar(1.0)))
        return b.to_dtype(out, self.dtype)

    def emit_mlp(self, x: str, prefix: str) -> str:
        bias = self.config.mlp_bias
        if self.config.mlp_gated:
            gate = self.emit_activation(self.linear(x, f"{prefix}.gate_proj", bias))
            hidden = self.b.op("Mul", gate, self.linear(x, f"{prefix}.up_proj", bias))
        else:
            hidden = self.emit_activation(self.linear(x, f"{prefix}.up_proj", bias))
        return self.linear(hidden, f"{prefix}.down_proj", bias)

    def emit_router(self, flat: str, prefix: str) -> tuple[str, str]:
        """Qwen's router: softmax over every expert in float32, top-k, optionally renormalised.
        Returns the routing weights (N, k) in the model dtype and the expert indices (N, k) int64."""
        b, cfg = self.b, self.config
        logits = b.op("MatMul", flat, self.weight(f"{prefix}.gate.weight", transpose=True))  # (N, E)
        probs = b.op("Softmax", self.to_float(logits), axis=-1)
        top_values, top_index = b.op("TopK", probs, b.const([cfg.num_experts_per_tok]), axis=-1, outputs=2)
        if cfg.norm_topk_prob:
            top_values = b.op("Div", top_values, b.op("ReduceSum", top_values, b.const([-1]), keepdims=1))
        return self.to_model_dtype(top_values), top_index

    def emit_moe(self, x: str, prefix: str) -> str:
        """Sparse MoE with real top-k routing. A prompt's step: a Loop over the experts that some token picked
        (``Unique`` of the top-k indices, ascending, as the PyTorch block visits them). Each iteration gathers its
        tokens, runs the expert on those rows only and adds the weighted result back at the same rows, so the work
        is proportional to tokens x k, not tokens x E, and memory holds one expert's rows at a time.

        Cost: standard ONNX has no way to multiply by one slice of a weight stack without copying it (Gather), so
        each visited expert's weights are read about three times (copy in, copy out, product); a dense pass over
        every expert reads all E once. The Loop wins when E > 3k (Qwen3-MoE: E = 128, k = 8). The fused variant
        replaces this with onnxruntime's MoE contrib op, which reads each routed expert once. Under ``--quantize``
        the gathered copy is the expert's int4 / int8 slice, dequantized (``expert_stacks``). A step of a few
        tokens (decode) gathers its picked experts at once instead, which spares the Loop's per-expert dispatch
        (``emit_routed_experts``)."""
        b, cfg = self.b, self.config
        flat = b.op("Reshape", x, b.const([-1, cfg.hidden_size]))  # (N, C)
        moe = self.emit_routed_experts(flat, prefix)
        if cfg.shared_expert_intermediate_size:
            with b.scope("shared_expert"):
                shared = self.emit_mlp(flat, f"{prefix}.shared_expert")
                shared_gate = b.op("Sigmoid", self.linear(flat, f"{prefix}.shared_expert_gate", bias=False))
                moe = b.op("Add", moe, b.op("Mul", shared_gate, shared))
        return b.op("Reshape", moe, b.op("Shape", x))

    def emit_routed_experts(self, flat: str, prefix: str) -> str:
        """The routed experts' weighted sum for tokens ``flat`` (N, C): an ``If`` on the step's size. A step of at
        most ``picked_experts_max_tokens`` tokens (a decode step) multiplies by the N x k picked experts' weights
        gathered at once (``emit_picked_experts``); a longer one (a prompt) takes the Loop described in
        ``emit_moe``, which copies each visited expert once however many tokens picked it."""
        b, cfg = self.b, self.config
        with b.scope("gate"):
            routing_weights, expert_index = self.emit_router(flat, prefix)
        gate_up, down = self.expert_stacks(prefix)
        tokens = b.op("Shape", flat, start=0, end=1)
        few = b.op("LessOrEqual", tokens, b.const([picked_experts_max_tokens(cfg)]))
        step = RoutedStep(flat, routing_weights, expert_index, gate_up, down)
        branches = {}
        for name, emit in (("picked", self.emit_picked_experts), ("visited", self.emit_expert_loop)):
            body = b.subgraph()
            with emitting_into(self, body), body.scope(name):
                out = emit(step)
            outputs = [value_info(out, self.onnx_dtype, [None, cfg.hidden_size])]
            branches[name] = body.make_graph(f"{prefix}.experts.{name}", [], outputs)
        routed = b.fresh("routed_experts")
        b.op_to("If", [few], [routed], then_branch=branches["picked"], else_branch=branches["visited"])
        return routed

    def emit_picked_experts(self, step: RoutedStep) -> str:
        """Every (token, slot) pair's expert at once: the N x k picked experts' weights gathered into one batch
        (a copy each, as the Loop makes of each expert it visits), one batched product per projection, the slots'
        weighted outputs summed. The same work as the Loop for a decode step (k experts, each picked once), in a
        dozen nodes instead of a Loop of seventeen per visited expert, whose dispatch a decode step pays for; the
        slots are summed in slot order where the Loop (and PyTorch) add experts in index order, which moves the
        sum by float rounding."""
        b, cfg = self.b, self.config
        k = cfg.num_experts_per_tok
        picked = b.op("Reshape", step.experts, b.const([-1]))  # (N k,)
        rows = b.op("Expand", b.op("Unsqueeze", step.flat, b.const([1])), b.const([1, k, 1]))  # (N, k, C)
        rows = b.op("Reshape", rows, b.const([-1, 1, cfg.hidden_size]))  # (N k, 1, C)
        gate_up = self.emit_expert_weight(b, step.gate_up, picked, batch=True)  # (N k, C, 2I)
        gate_up_rows = b.op("MatMul", rows, gate_up)  # (N k, 1, 2I)
        gate, up = b.op("Split", gate_up_rows, axis=-1, num_outputs=2, outputs=2)
        hidden = b.op("Mul", self.emit_activation(gate, b), up)
        y = b.op("MatMul", hidden, self.emit_expert_weight(b, step.down, picked, batch=True))  # (N k, 1, C)
        y = b.op("Reshape", y, b.const([-1, k, cfg.hidden_size]))  # (N, k, C)
        y = b.op("Mul", y, b.op("Unsqueeze", step.weights, b.const([-1])))
        return b.op("ReduceSum", y, b.const([1]), keepdims=0)  # (N, C)

    def emit_expert_loop(self, step: RoutedStep) -> str:
        """A Loop over the experts that some token picked: ``emit_moe``."""
        b, cfg = self.b, self.config
        experts = b.op("Unique", b.op("Reshape", step.experts, b.const([-1])), sorted=1, outputs=4)[0]
        zero = helper.make_tensor("zero", self.onnx_dtype, [1], [0])
        zeros = b.op("ConstantOfShape", b.op("Shape", step.flat), value=zero)  # the accumulator, (N, C)

        body = b.subgraph()
        with body.scope("expert"):
            # Body inputs get model-wide unique names: onnx forbids a subgraph name that shadows another.
            iteration, cond_in, acc = body.fresh("iteration"), body.fresh("condition_in"), body.fresh("accumulated")
            cond_out = body.op("Identity", cond_in)  # no early exit: the trip count is the number of experts
            out = self.emit_expert_step(body, iteration, acc, experts, step)
        loop_body = body.make_graph(
            "moe_expert_step",
            [
                value_info(iteration, TensorProto.INT64, []),
                value_info(cond_in, TensorProto.BOOL, []),
                value_info(acc, self.onnx_dtype, [None, cfg.hidden_size]),
            ],
            [value_info(cond_out, TensorProto.BOOL, []), value_info(out, self.onnx_dtype, [None, cfg.hidden_size])],
        )
        # The condition is given although it never stops the loop: onnx's reference evaluator skips a Loop whose
        # optional condition is left out.
        return b.op("Loop", b.op("Size", experts), b.const(True, torch.bool), zeros, body=loop_body)

    def expert_stacks(self, prefix: str) -> tuple[str | StandardExperts, str | StandardExperts]:
        """The layer's two expert stacks as both MoE paths gather from them: float (E, C, 2I) and (E, I, C), or
        under ``--quantize`` the same quantized weights as the fused graph's QMoE in standard types
        (``StandardExperts``, dequantized as they are gathered: ``emit_expert_weight``)."""
        names = (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj")
        stacks = [self.weights.get(name) for name in names]  # (E, 2I, C), (E, C, I): (E, N, K)
        quantizer = self.quantizer
        if quantizer and all(quantizer.applies_to_experts(*stack.shape[1:]) for stack in stacks):
            return tuple(quantizer.standard_experts(self.b, n, s) for n, s in zip(names, stacks, strict=True))
        return tuple(self.weight(name, transpose=True) for name in names)

    @staticmethod
    def emit_expert_weight(body: GraphBuilder, stack: str | StandardExperts, expert: str, batch: bool = False) -> str:
        """Expert ``expert``'s (K, N) weight out of ``stack`` (``expert_stacks``): a copy of its slice (Gather), or
        its quantized slice dequantized; with ``batch``, ``expert`` is 1-D and this the (M, K, N) batch of those
        experts."""
        if isinstance(stack, str):
            return body.op("Gather", stack, expert)
        values, scales = body.op("Gather", stack.values, expert), body.op("Gather", stack.scales, expert)
        if stack.block_size:  # blocks along K, the second axis from the end of (K, N) and of (M, K, N)
            return body.op("DequantizeLinear", values, scales, axis=-2, block_size=stack.block_size)
        if not batch:
            return body.op("DequantizeLinear", values, scales, axis=1)  # a scale per output
        # A batch's scales per output, (M, N): DequantizeLinear's per-axis form takes one axis of scales, so its
        # product (no zero point: q * scale, one rounding) in elementwise operators, broadcast over K.
        weight = body.op("Cast", values, to=stack.scale_type)
        return body.op("Mul", weight, body.op("Unsqueeze", scales, body.const([-2])))

    def emit_expert_step(
        self, body: GraphBuilder, iteration: str, accumulated: str, visited: str, step: RoutedStep
    ) -> str:
        """The Loop body: expert ``visited[iteration]`` runs on its tokens, its weighted output is added in."""
        expert = body.op("Gather", visited, iteration)  # a scalar expert id
        picks = body.op("NonZero", body.op("Equal", step.experts, expert))  # (2, M): (token, slot) pairs
        tokens = body.op("Gather", picks, body.const(0))  # (M,)
        weights = body.op("GatherND", step.weights, body.op("Transpose", picks, perm=[1, 0]))  # (M,)
        rows = body.op("Gather", step.flat, tokens)  # (M, C)
        gate_up_rows = body.op("MatMul", rows, self.emit_expert_weight(body, step.gate_up, expert))
        gate, up = body.op("Split", gate_up_rows, axis=-1, num_outputs=2, outputs=2)
        hidden = body.op("Mul", self.emit_activation(gate, body), up)
        y = body.op("MatMul", hidden, self.emit_expert_weight(body, step.down, expert))  # (M, C)
        y = body.op("Mul", y, body.op("Unsqueeze", weights, body.const([-1])))
        # Each token meets an expert at most once, so a gather-add-scatter is exact (no duplicate indices).
        token_rows = body.op("Unsqueeze", tokens, body.const([-1]))  # (M, 1)
        updated = body.op("Add", body.op("Gather", accumulated, tokens), y)
        return body.op("ScatterND", accumulated, token_rows, updated)


def picked_experts_max_tokens(config: ThinkerConfig) -> int:
    """The most tokens a MoE step may have and still gather its picked experts at once (at least one: a batch-1
    decode step). Gathering copies N x k experts where the Loop copies the distinct ones, about E (1 - e^(-N k / E)):
    at N k = E / 4, 13 % more copies, against the Loop's seventeen nodes per visited expert; measured on a
    Qwen3.5-MoE of E = 64, k = 8 under onnxruntime-genai (bench/results/graph_ab_qwen3_5-moe-plain-picked-experts-*):
    decode 1.15x the Loop's speed at batch 1, 1.11x at batch 2 (N k = E / 4), 0.97x at batch 4 (N k = E / 2), by
    rotation cycle, the last interval spanning 1. PICKED_EXPERTS_MAX_PAIRS bounds the
    gathered copies' memory (32 experts of 2048 x 1024 float32 weights: 268 MB)."""
    pairs = min(config.num_experts // 4, PICKED_EXPERTS_MAX_PAIRS)
    return max(1, pairs // config.num_experts_per_tok)


# Positions computed per call of the rotary embedding: its float32 temporaries stay a few MiB however long the context.
ROPE_CHUNK = 1 << 14


def rope_tables(config: ThinkerConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin over the whole context, (``export_context``, rotary_dim / 2) each in ``dtype``, computed by
    the model's own ``ThinkerRotaryEmbedding`` (so every rope_type transformers knows is right, partial rotary
    included). The one source of the RoPE tables of both graphs: the half-split rotation repeats each frequency, so
    half a row is all either needs.

    Built chunk by chunk into tables of the graph's dtype and width, so that memory holds what the graph stores and
    no more (the whole context in float32 at full width is what a long context cannot afford). The rope types whose
    frequencies depend on the context length are refused by ``check_exportable``, so chunks are independent."""
    rotary = ThinkerRotaryEmbedding(config)
    total, width = export_context(config.max_position_embeddings, config.rope_parameters)[0], rotary.inv_freq.shape[0]
    cos_table, sin_table = torch.empty(total, width, dtype=dtype), torch.empty(total, width, dtype=dtype)
    for start in range(0, total, ROPE_CHUNK):
        positions = torch.arange(start, min(start + ROPE_CHUNK, total))[None]
        cos, sin = rotary(torch.zeros((), dtype=dtype), positions)  # (1, chunk, rotary_dim)
        cos_table[start : start + positions.shape[1]] = cos[0, :, :width]
        sin_table[start : start + positions.shape[1]] = sin[0, :, :width]
    return cos_table, sin_table


def rope_table_bytes(config: ThinkerConfig, dtype: torch.dtype) -> int:
    """What ``rope_tables`` holds: the RoPE tables a graph of this config stores."""
    if config.position_embedding_type != "rope":
        return 0
    positions = export_context(config.max_position_embeddings, config.rope_parameters)[0]
    return 2 * positions * (rotary_dim(config) // 2) * dtype.itemsize


def not_exported(config: ThinkerConfig) -> tuple[str, ...]:
    """Name prefixes of the Thinker parts the graph leaves out on purpose: it is the text decoder, which takes
    token ids, so neither the audio projection (``audio_embed_size``; audio embeddings reach the model through
    ``inputs_embeds``) nor the talker head (``talker_head_size``) is exported."""
    return (("model.audio_proj.",) if config.audio_embed_size else ()) + (
        ("talker_head.",) if config.talker_head_size else ()
    )


def check_exportable(config: ThinkerConfig) -> None:
    """Refuses configs the graph cannot express, naming the field, before any byte is written. Supported beyond
    the dense families: linear-attention layers (Gated DeltaNet) with a SiLU conv, the attention output gate,
    zero-centred RMSNorm, partial rotary and multimodal RoPE (``mrope_section``, interleaved or in sections)."""
    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ThinkerError(
            f"hidden_act={config.hidden_act!r} has no ONNX export yet; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ThinkerError("num_attention_heads must be a multiple of num_key_value_heads")
    if config.has_linear_attention and config.linear_conv_kernel_dim < 2:
        raise ThinkerError(
            f"linear_conv_kernel_dim={config.linear_conv_kernel_dim}: the graph carries the conv's last kernel - 1 "
            "inputs from step to step as its conv state, so it exports kernels of 2 or more"
        )
    if config.ple_layer_ids and config.ple_conv_kernel_size < 2:
        raise ThinkerError(
            f"ple_conv_kernel_size={config.ple_conv_kernel_size}: a PLE conv of kernel 1 keeps no window, which "
            "transformers' cache cannot carry (Qwen4-Exp's update_conv_state fails on it) and the graph carries from "
            "step to step, so it exports kernels of 2 or more"
        )
    if config.has_linear_attention and config.hidden_act not in LINEAR_ATTENTION_ACTIVATIONS:
        raise ThinkerError(
            f"hidden_act={config.hidden_act!r} with linear_attention layers: the Gated DeltaNet conv's activation "
            f"is hidden_act, and the ONNX export writes {' / '.join(LINEAR_ATTENTION_ACTIVATIONS)} only"
        )
    rope = config.rope_parameters or {}
    if config.position_embedding_type == "rope":
        rope_type = rope.get("rope_type", "default")
        if any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE_TYPES):
            raise ThinkerError(
                f"rope_parameters rope_type={rope_type!r} recomputes its frequencies as the context grows, which "
                "the ONNX graph's fixed RoPE tables cannot follow; export a model with another rope_type"
            )
        if rotary_dim(config) > config.head_dim:
            raise ThinkerError(
                f"rope_parameters partial_rotary_factor={rope.get('partial_rotary_factor')} rotates "
                f"{rotary_dim(config)} channels of a head of head_dim={config.head_dim}; it must be at most 1"
            )


def make_model(graph: onnx.GraphProto, metadata: dict[str, str], contrib_ops: bool = False) -> onnx.ModelProto:
    """``contrib_ops``: the graph uses onnxruntime's com.microsoft operators (fused or quantized graphs)."""
    opsets = [helper.make_opsetid("", OPSET)]
    if contrib_ops:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="thinker", ir_version=IR_VERSION)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    return model
