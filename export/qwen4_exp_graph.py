"""What a Qwen3.8 (``qwen4_exp``) decoder adds to either graph: the streams of its hyper-connections, the PLE layers'
n-gram embeddings and the indexers of its ``indexed_attention`` layers, with the state each carries.

The emitters of the parts live beside their kin (export/hyper_connection_graph.py, export/ple_graph.py,
export/indexer_graph.py); this module wires them into ``DecoderGraph`` (plain) and ``FusedDecoderGraph`` alike,
which call it where a Qwen3.8 config asks (``config.qwen4_exp_features``).

State, beyond the Gated DeltaNet's and the attention's (every axis static but the batch, unless said):
  past_key_values.{i}.ngram_context    (B, ngram_size - 1) int64, each PLE layer i: the last ids hashed (pads as
                                       eos); ignored at a sequence's first forward (the context is then eos)
  past_key_values.{i}.ple_conv_state   (B, hc_count * C, (ple_conv_kernel_size - 1) * ngram_size), the model
                                       dtype: the PLE conv's window; zeros start a sequence
  past_key_values.{i}.index_keys       (B, 1, P, indexer_head_dim), the model dtype, each indexed layer i: the raw
                                       (unnormed, unrotated) index keys of every past slot, grown as KV is
  past_key_values.{i}.index_positions  (B, R, P) int64, the first indexed layer only: the RoPE positions of every
                                       past slot (R = 3 with multimodal RoPE), at which past blocks are rotated
As in transformers, the indexer pools the blocks afresh each step from the raw keys (a block's mean is cast to the
model dtype before its norm, which a cache of pooled keys would have to reproduce), so a step reads O(P) keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import onnx
import torch
from onnx import TensorProto

from thinker.configuration_thinker import ThinkerConfig

from .graph_builder import GraphBuilder, value_info
from .hyper_connection_graph import emit_hyper_connection, emit_inject
from .indexer_graph import emit_indexer_selection
from .linear_attention_graph import INT64_MAX, PaddingMasks
from .ple_graph import emit_ple
from .weights import ThinkerWeights


class DecoderGraph(Protocol):
    """What this module reads of export/decoder_graph.py's ``DecoderGraph`` (plain or fused), which imports it."""

    b: GraphBuilder
    config: ThinkerConfig
    dtype: torch.dtype
    weights: ThinkerWeights

    def emit_matmul(self, x: str, name: str, weight: torch.Tensor) -> str: ...
    def emit_allowed(self, input_ids: str, attention_mask: str) -> str: ...
    def emit_rope_tables(self, position_ids: str) -> tuple[str, str]: ...
    def emit_attention(self, i: int, x: str, ctx: StepContext) -> str: ...
    def emit_linear_attention(self, i: int, x: str, ctx: StepContext) -> str: ...
    def emit_mlp(self, x: str, prefix: str) -> str: ...
    def emit_moe(self, x: str, prefix: str) -> str: ...


class StepContext(Protocol):
    """What this module reads of a graph's per-forward values (export/decoder_graph.py ``StepContext``)."""

    linear_padding: PaddingMasks | None
    qwen4_exp: Qwen4ExpValues | None


@dataclass
class Qwen4ExpValues:
    """Per-forward values the Qwen3.8 parts read, computed once."""

    ple_ids: str | None = None  # (B, T) int64: the new ids, eos where the mask hides a position
    starts: str | None = None  # bool scalar: the past is empty
    slot_cos: str | None = None  # (B, S, rotary_dim): RoPE tables of every slot, past then new (indexers)
    slot_sin: str | None = None
    visible: str | None = None  # (B, T, S) bool: causal and padding, what each new query may see


def position_rows(config: ThinkerConfig) -> int:
    """R of ``index_positions``: the three multimodal streams, or one."""
    return 3 if (config.rope_parameters or {}).get("mrope_section") else 1


def first_indexed_layer(config: ThinkerConfig) -> int | None:
    return config.layer_types.index("indexed_attention") if config.has_indexed_attention else None


def extra_state_values(
    config: ThinkerConfig, i: int, prefix: str, onnx_dtype: int, batch: str, length: str
) -> list[onnx.ValueInfoProto]:
    """Layer ``i``'s Qwen3.8 state (module docstring), after its KV or linear-attention state; ``length`` names the
    sequence axis (past or total)."""
    values = []
    if i + 1 in (config.ple_layer_ids or ()):
        width = config.hc_count * config.hidden_size
        window = (config.ple_conv_kernel_size - 1) * config.ngram_size
        values.append(value_info(f"{prefix}.{i}.ngram_context", TensorProto.INT64, [batch, config.ngram_size - 1]))
        values.append(value_info(f"{prefix}.{i}.ple_conv_state", onnx_dtype, [batch, width, window]))
    if config.layer_types[i] == "indexed_attention":
        keys = [batch, 1, length, config.indexer_head_dim]
        values.append(value_info(f"{prefix}.{i}.index_keys", onnx_dtype, keys))
        if i == first_indexed_layer(config):
            rows = [batch, position_rows(config), length]
            values.append(value_info(f"{prefix}.{i}.index_positions", TensorProto.INT64, rows))
    return values


# --- per-forward values -------------------------------------------------------------------------------------------
def emit_step_values(graph: DecoderGraph, input_ids: str, attention_mask: str, positions: str) -> Qwen4ExpValues:
    """``positions``: the graph's RoPE positions, (B, T), or (3, B, T) with multimodal RoPE."""
    b, cfg = graph.b, graph.config
    values = Qwen4ExpValues()
    seq = b.op("Shape", input_ids, start=1, end=2)  # (1,): T
    total = b.op("Shape", attention_mask, start=1, end=2)  # (1,): S
    if cfg.ple_layer_ids:
        with b.scope("ple_ids"):  # as ThinkerModel.forward: a hidden position hashes as eos
            new = b.op("Slice", attention_mask, b.op("Neg", seq), b.const([INT64_MAX]), b.const([1]))
            kept = b.op("Cast", new, to=TensorProto.BOOL)
            values.ple_ids = b.op("Where", kept, input_ids, b.const(cfg.ngram_eos_token_id))
            values.starts = b.op("Equal", b.op("Squeeze", b.op("Sub", total, seq), b.const([0])), b.const(0))
    if cfg.has_indexed_attention:
        with b.scope("indexer_slots"):
            values.slot_cos, values.slot_sin = emit_slot_tables(graph, positions)
            allowed = graph.emit_allowed(input_ids, attention_mask)  # (B, 1, 1, T, S)
            values.visible = b.op("Squeeze", allowed, b.const([1, 2]))
    return values


def emit_slot_tables(graph: DecoderGraph, positions: str) -> tuple[str, str]:
    """cos and sin (B, S, rotary_dim) of every slot: the positions carried on the first indexed layer, then this
    step's, which are carried on."""
    b, cfg = graph.b, graph.config
    layer = first_indexed_layer(cfg)
    past, present = f"past_key_values.{layer}.index_positions", f"present.{layer}.index_positions"
    if position_rows(cfg) == 3:  # (B, 3, P) ++ (3, B, T)
        every = b.op("Concat", b.op("Transpose", past, perm=[1, 0, 2]), positions, axis=2)  # (3, B, S)
        b.op_to("Transpose", [every], [present], perm=[1, 0, 2])
    else:  # (B, 1, P) ++ (B, T)
        every = b.op("Concat", b.op("Squeeze", past, b.const([1])), positions, axis=1)  # (B, S)
        b.op_to("Unsqueeze", [every, b.const([1])], [present])
    cos, sin = graph.emit_rope_tables(every)  # (B, 1, S, rot)
    return b.op("Squeeze", cos, b.const([1])), b.op("Squeeze", sin, b.const([1]))


# --- layers ---------------------------------------------------------------------------------------------------------
def emit_stream_layer(graph: DecoderGraph, i: int, streams: str, ctx: StepContext) -> str:
    """One decoder layer on the (B, T, n·C) streams (``ThinkerDecoderLayer.forward`` with hyper-connections): PLE's
    addition first on a PLE layer, then each sub-layer on its mix of the streams, its output injected back."""
    b, cfg = graph.b, graph.config
    prefix = f"model.layers.{i}"
    streams = emit_ple_addition(graph, i, streams, ctx)
    with b.scope("attn_hyper_connection"):
        mixed, weights = emit_hyper_connection(
            b, cfg, f"{prefix}.attn_hyper_connection", graph.weights.get, streams, graph.dtype
        )
    if cfg.layer_types[i] == "linear_attention":
        with b.scope("linear_attn"):
            out = graph.emit_linear_attention(i, mixed, ctx)
    else:
        with b.scope("self_attn"):
            out = graph.emit_attention(i, mixed, ctx)
    streams = emit_inject(b, streams, out, weights)
    with b.scope("mlp_hyper_connection"):
        mixed, weights = emit_hyper_connection(
            b, cfg, f"{prefix}.mlp_hyper_connection", graph.weights.get, streams, graph.dtype
        )
    with b.scope("mlp"):
        sparse = cfg.mlp_layer_types[i] == "sparse"
        out = graph.emit_moe(mixed, f"{prefix}.mlp") if sparse else graph.emit_mlp(mixed, f"{prefix}.mlp")
    return emit_inject(b, streams, out, weights)


PLE_STATE = ("ngram_context", "ple_conv_state")


def emit_ple_addition(graph: DecoderGraph, i: int, residual: str, ctx: StepContext) -> str:
    """The residual (B, T, n·C) plus layer ``i``'s PLE addition where it is a PLE layer (the streams, or with
    hc_count 1 the one residual stream), else the residual as it is."""
    b, cfg = graph.b, graph.config
    if i + 1 not in (cfg.ple_layer_ids or ()):
        return residual
    with b.scope("ple"):
        state = [f"{kind}.{i}.{name}" for kind in ("past_key_values", "present") for name in PLE_STATE]
        extra = emit_ple(
            b, cfg, i, graph.dtype, graph.weights.get, graph.emit_matmul, residual, ctx.qwen4_exp.ple_ids,
            ctx.linear_padding.keep, ctx.qwen4_exp.starts, *state,
        )  # fmt: skip
        return b.op("Add", residual, extra)


def emit_final_mix(graph: DecoderGraph, streams: str) -> str:
    """The head's input: the streams' last mix (``ThinkerModel.final_hidden_state``), in place of the final norm."""
    mixed, _ = emit_hyper_connection(
        graph.b, graph.config, "model.hyper_connection_mixer", graph.weights.get, streams, graph.dtype, inject=False
    )
    return mixed


def emit_indexed_bias(
    graph: DecoderGraph, i: int, x: str, ctx: StepContext, bias: str, bias_rank: int, lowest: str
) -> str:
    """``bias`` (B, 1, [1,] T, S) of rank ``bias_rank``, the attention's additive mask, narrowed to the slots layer
    ``i``'s indexer keeps for each query: ``lowest`` (the dtype's minimum, as ThinkerAttention.indexed_mask masks
    them) elsewhere."""
    b = graph.b
    values = ctx.qwen4_exp
    with b.scope("indexer"):

        def float_matmul(x: str, name: str, weight: torch.Tensor) -> str:
            # the indexer's choice is discrete: kept float under --quantize, where a rounded projection would move
            # whole blocks in or out rather than nudge a logit (and it is a few thousand weights)
            return b.op("MatMul", x, b.weight(name, weight))

        keys = f"past_key_values.{i}.index_keys", f"present.{i}.index_keys"
        slot_tables = values.slot_cos, values.slot_sin
        selected = emit_indexer_selection(
            b, graph.config, i, graph.dtype, graph.weights.get, float_matmul, x, *slot_tables, values.visible, *keys
        )
        selected = b.op("Unsqueeze", selected, b.const(list(range(1, bias_rank - 2))))
        return b.op("Where", selected, bias, lowest)
