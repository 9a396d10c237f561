"""Qwen3.8's QSA indexer as ONNX: which key slots each query of an ``indexed_attention`` layer keeps
(``ThinkerQSAIndexer`` and ``qsa_selection`` in thinker/modeling_thinker.py).

Per query, in the PyTorch module's order:

  projection   index_qk_proj: the query heads' rows, then one key head's; the new raw keys extend the carried ones
  query        per head: q_layernorm, then RoPE at the query's position (the first ``rotary_dim`` channels)
  blocks       the query's visible slots, in order, cut into blocks of ``compress_ratio``; a block's key is the
               float32 mean of its raw keys cast back to the model dtype, k_layernorm, RoPE at the block's first slot
  scores       sum over heads of relu(q_h . k_block) / sqrt(head_dim), in float32
  choice       the best ``budget // compress_ratio`` complete blocks (all of them when fewer), plus every slot of
               the unfinished last block

The visible slots of each query (causal and padding masks) are a prefix, in slot order, of the slots its row keeps
at all, so every query's blocks are its row's first ones: the row's blocks are pooled once, every query scores them
in one MatMul, and a block a query does not see whole is masked out of its TopK. (A mask of another form, where a
query sees slots a later one does not, is outside this graph; the PyTorch Thinker runs such queries one by one.)
Rows with different left padding have their blocks start at their own first kept slot.

Ties: the graph keeps the lower block index among blocks scoring 0 (``_emit_untied``: each gets a key of its own, as
ONNX does not say which of equal values TopK keeps, and providers differ). The PyTorch Thinker takes
``torch.topk``'s choice (``reference_selection``), which on the CPU is std::nth_element's, or std::partial_sort's
once k * 64 <= blocks (measured, torch 2.13): an insertion sort, so the lower index too, where a query sees at most
three complete blocks; beyond, a choice that moves with the values of every block (four blocks scoring 0 keep blocks
2 and 3, five keep 2 and 4), which no fixed rule reproduces. Scores tie exactly where relu zeroes every head's
product for several blocks; such a tie decides the choice only where fewer than ``keep`` of a query's blocks score
above zero, and only there may the graph and PyTorch keep different blocks, of equal scores
(tests/export/test_indexer_graph.py shows one). The model does not say which is right; the export's checks compare
against the Thinker under ``lowest_block_wins_ties``, whose rule is this graph's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from onnx import TensorProto, helper

from thinker.configuration_thinker import ThinkerConfig

from .graph_builder import GraphBuilder
from .hybrid_attention_graph import emit_partial_rotary, emit_rms_norm, rotary_dim
from .linear_attention_graph import INT64_MAX, MatMulEmitter


@dataclass(frozen=True)
class RowBlocks:
    """The blocks of each row's kept slots (``_emit_row_blocks``); NB, the most complete blocks of any row."""

    rank: str  # (B, T) int64: each slot's place among its row's kept slots (-1 before the first)
    count: str  # (1,) int64: NB
    slots: str  # (B, NB, r) int64: the slots of blocks 0 .. NB - 1, in order (past a row's own blocks: unused)


def emit_indexer_selection(
    b: GraphBuilder,
    config: ThinkerConfig,
    layer: int,
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
    emit_matmul: MatMulEmitter,
    hidden: str,
    cos: str,
    sin: str,
    visible: str,
    past_index_keys: str,
    present_index_keys: str,
) -> str:
    """The slots each new query of layer ``layer`` keeps, (B, S, T) bool.

    ``hidden`` (B, S, C) in ``dtype``, the attention layer's input; ``cos`` / ``sin`` (B, T, rotary_dim) in
    ``dtype``, the RoPE tables of every slot, past then new (T = P + S); ``visible`` (B, S, T) bool, causal and
    padding. Reads ``past_index_keys`` (B, 1, P, Id) in ``dtype``, the raw (unnormed, unrotated) index keys of the
    past slots; writes ``present_index_keys`` (B, 1, T, Id). ``get`` returns a weight by its Thinker name in
    ``dtype``; ``emit_matmul`` writes ``x @ weight`` for index_qk_proj (a caller's quantizer, or a plain MatMul)."""
    if config.norm_type != "rmsnorm":
        raise ValueError(f"norm_type={config.norm_type!r}: the indexer's ONNX graph writes its norms as RMSNorm")
    prefix = f"model.layers.{layer}.self_attn.indexer"
    heads, dim, ratio = config.indexer_n_heads, config.indexer_head_dim, config.indexer_compress_ratio
    rotary = rotary_dim(config)
    with b.scope("projection"):
        name = f"{prefix}.index_qk_proj.weight"
        qk = emit_matmul(hidden, name, get(name).T)  # (B, S, (In + 1) Id)
        q, new_keys = b.op("Split", qk, b.const([heads * dim, dim]), axis=-1, outputs=2)
        b.op_to("Concat", [past_index_keys, b.op("Unsqueeze", new_keys, b.const([1]))], [present_index_keys], axis=2)
    with b.scope("query"):
        q = b.op("Reshape", q, b.const([0, 0, heads, dim]))  # (B, S, In, Id)
        q = _emit_norm(b, config, q, f"{prefix}.q_layernorm.weight", get, dtype)
        seq = b.op("Shape", hidden, start=1, end=2)  # (1,): S
        query_tables = [
            b.op("Slice", table, b.op("Neg", seq), b.const([INT64_MAX]), b.const([1])) for table in (cos, sin)
        ]
        query_tables = [b.op("Unsqueeze", table, b.const([2])) for table in query_tables]  # (B, S, 1, rot): over heads
        q = emit_partial_rotary(b, q, *query_tables, rotary, dim)
    with b.scope("blocks"):
        blocks = _emit_row_blocks(b, visible, ratio)
        raw_keys = b.op("Squeeze", present_index_keys, b.const([1]))  # (B, T, Id)
        norm = f"{prefix}.k_layernorm.weight"
        keys = _emit_block_keys(b, config, raw_keys, blocks, cos, sin, rotary, get, dtype, norm)  # (B, NB, Id) fp32
    with b.scope("scores"):
        scores = _emit_scores(b, q, keys, blocks.count, heads, dim, dtype)  # (B, S, NB)
    with b.scope("choice"):
        counts = b.op("ReduceSum", b.op("Cast", visible, to=TensorProto.INT64), b.const([-1]), keepdims=0)  # (B, S)
        seen = b.op("Div", counts, b.const(ratio))  # complete blocks each query sees
        kept_blocks = _emit_best_blocks(b, scores, seen, blocks.count, config.indexer_budget // ratio)
        return _emit_kept_slots(b, visible, kept_blocks, blocks.rank, seen, ratio)


def _emit_norm(
    b: GraphBuilder, config: ThinkerConfig, x: str, name: str, get: Callable[[str], torch.Tensor], dtype: torch.dtype
) -> str:
    return emit_rms_norm(b, x, name, get(name), config.rms_norm_eps, dtype, config.norm_zero_centered)


def _emit_row_blocks(b: GraphBuilder, visible: str, ratio: int) -> RowBlocks:
    """Each row's kept slots (what any of its queries sees: the last query's view under a causal mask), numbered
    in order, and the slots of its complete blocks."""
    row_kept = b.op("ReduceMax", b.op("Cast", visible, to=TensorProto.INT64), b.const([1]), keepdims=0)  # (B, T)
    rank = b.op("Sub", b.op("CumSum", row_kept, b.const(1)), b.const(1))
    count = b.op("Div", b.op("ReduceMax", b.op("ReduceSum", row_kept, b.const([1])), keepdims=0), b.const(ratio))
    count = b.op("Reshape", count, b.const([1]))  # (1,): NB
    # Kept slots first, in order: the smallest of slot + T * (1 - kept), all distinct (no tie for TopK to break).
    # float32 is exact for them while 2 T < 2^24, and is the key type every provider's TopK takes.
    total = b.op("Shape", visible, start=2, end=3)  # (1,): T
    slot = b.op(
        "Cast", b.op("Range", b.const(0), b.op("Squeeze", total, b.const([0])), b.const(1)), to=TensorProto.FLOAT
    )
    dropped = b.op("Cast", b.op("Sub", b.const(1), row_kept), to=TensorProto.FLOAT)
    order = b.op("Add", slot, b.op("Mul", dropped, b.op("Cast", total, to=TensorProto.FLOAT)))  # (B, T)
    width = b.op("Mul", count, b.const([ratio]))  # (1,): NB r
    _, slots = b.op("TopK", order, width, axis=-1, largest=0, sorted=1, outputs=2)  # (B, NB r)
    per_block = b.op("Concat", b.op("Shape", visible, start=0, end=1), count, b.const([ratio]), axis=0)
    return RowBlocks(rank=rank, count=count, slots=b.op("Reshape", slots, per_block, allowzero=1))  # NB may be 0


def _emit_block_keys(
    b: GraphBuilder,
    config: ThinkerConfig,
    raw_keys: str,
    blocks: RowBlocks,
    cos: str,
    sin: str,
    rotary: int,
    get: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    norm_name: str,
) -> str:
    """(B, NB, Id) float32: each block's key as ``qsa_selection`` pools it: the float32 mean of its raw keys (B, T,
    Id), cast back, k_layernorm, rotated at the block's first slot."""
    members = b.op("GatherND", raw_keys, b.op("Unsqueeze", blocks.slots, b.const([-1])), batch_dims=1)  # (B, NB, r, Id)
    members = b.to_float32(members, dtype)
    pooled = b.op("ReduceMean", members, b.const([2]), keepdims=0)  # (B, NB, Id) float32
    pooled = b.to_dtype(pooled, dtype)
    pooled = _emit_norm(b, config, pooled, norm_name, get, dtype)
    starts = _emit_block_starts(b, blocks.slots)  # (B, NB, 1)
    block_tables = [b.op("GatherND", table, starts, batch_dims=1) for table in (cos, sin)]  # (B, NB, rot)
    keys = emit_partial_rotary(b, pooled, *block_tables, rotary, config.indexer_head_dim)
    return b.to_float32(keys, dtype)


def _emit_block_starts(b: GraphBuilder, block_slots: str) -> str:
    """(B, NB, 1) int64 of the (B, NB, r) slots: each block's first, the position its key is rotated at."""
    return b.op("Slice", block_slots, b.const([0]), b.const([1]), b.const([2]))


def _emit_scores(b: GraphBuilder, q: str, keys: str, count: str, heads: int, dim: int, dtype: torch.dtype) -> str:
    """(B, S, NB) float32: sum over heads of relu(q_h . k_block) / sqrt(Id), every query and head in one MatMul."""
    q32 = b.to_float32(q, dtype)
    rows = b.op("Reshape", q32, b.const([0, -1, dim]))  # (B, S In, Id)
    products = b.op("MatMul", rows, b.op("Transpose", keys, perm=[0, 2, 1]))  # (B, S In, NB)
    per_head = b.op("Concat", b.op("Shape", q, start=0, end=3), count, axis=0)  # (B, S, In, NB); NB may be 0
    products = b.op("Reshape", products, per_head, allowzero=1)
    summed = b.op("ReduceSum", b.op("Relu", products), b.const([2]), keepdims=0)  # (B, S, NB)
    return b.op("Div", summed, b.const(math.sqrt(dim), torch.float32))


def _emit_untied(b: GraphBuilder, scores: str, block: str) -> str:
    """(B, S, NB) float32: ``scores`` with each block scoring 0 given -(1 + its index) instead, below every positive
    score and below each earlier block's, so that TopK keeps the lower indices among them on every provider.

    ONNX leaves open which of equal values TopK keeps: onnxruntime's CPU provider keeps the lower index, its CUDA one
    another (an H200 kept other blocks, and Qwen3.8's logits moved by 0.5; bench/results/gpu-tests-h200-session7.xml).
    Relu makes zero scores common (the module docstring); positive ones tie only by coincidence of rounding, and keep
    their values. float32 holds -(1 + index) exactly below 2^24 blocks."""
    behind = b.op("Neg", b.op("Add", b.op("Cast", block, to=TensorProto.FLOAT), b.const(1.0, torch.float32)))
    return b.op("Where", b.op("Greater", scores, b.const(0.0, torch.float32)), scores, behind)


def _emit_best_blocks(b: GraphBuilder, scores: str, seen: str, count: str, keep: int) -> str:
    """(B, S, NB + 1) bool: the ``keep`` best of the blocks each query sees whole (``seen`` (B, S) of them, the
    first ones), or all of them when fewer; the last column, no block's, is false (the unfinished block's slots
    read it, and it makes the gather in ``_emit_kept_slots`` valid when NB is 0)."""
    block = b.op("Range", b.const(0), b.op("Squeeze", count, b.const([0])), b.const(1))  # (NB,)
    seen = b.op("Unsqueeze", seen, b.const([-1]))  # (B, S, 1)
    sees = b.op("Less", block, seen)  # (B, S, NB)
    ranked = b.op("Where", sees, _emit_untied(b, scores, block), b.const(-math.inf, torch.float32))
    k = b.op("Min", count, b.const([keep]))  # TopK's k must not exceed NB
    _, best = b.op("TopK", ranked, k, axis=-1, largest=1, sorted=1, outputs=2)  # (B, S, k)
    picked = b.op("Less", best, seen)  # a query that sees fewer than k blocks has picked unseen ones too
    shape = b.op("Concat", b.op("Shape", scores, start=0, end=2), b.op("Add", count, b.const([1])), axis=0)
    nothing = b.op("ConstantOfShape", shape, value=helper.make_tensor("value", TensorProto.BOOL, [1], [False]))
    # TopK's indices are distinct, so each block is written once
    return b.op("ScatterElements", nothing, best, picked, axis=-1)


def _emit_kept_slots(b: GraphBuilder, visible: str, kept_blocks: str, rank: str, seen: str, ratio: int) -> str:
    """(B, S, T) bool: the visible slots that lie in a kept block or past the query's complete blocks."""
    # (B, T): each kept slot's block, at most NB; a block past a query's complete ones reads false
    block_of_slot = b.op("Div", b.op("Max", rank, b.const(0)), b.const(ratio))
    block_of_slot = b.op("Expand", b.op("Unsqueeze", block_of_slot, b.const([1])), b.op("Shape", visible))
    in_kept_block = b.op("GatherElements", kept_blocks, block_of_slot, axis=-1)  # (B, S, T)
    complete_slots = b.op("Unsqueeze", b.op("Mul", seen, b.const(ratio)), b.const([-1]))  # (B, S, 1)
    unfinished = b.op("GreaterOrEqual", b.op("Unsqueeze", rank, b.const([1])), complete_slots)  # (B, S, T)
    return b.op("And", visible, b.op("Or", in_kept_block, unfinished))
