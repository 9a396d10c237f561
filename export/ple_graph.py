"""Qwen3.8's per-layer embedding (PLE, ``ThinkerPLELayer``) as ONNX, with its carried state.

One layer, in the order of ``ThinkerPLELayer.forward`` and ``ThinkerNGramEmbedding.forward``:

  context     the last n - 1 ids before the step: the carried ``past_ngram``, or eos where the sequence starts
  n-grams     each new position's token and the n - 1 before it, an eos cutting the run short (missing ones read as
              eos); ``torch.cummax`` has no ONNX op, so the cut is a window: lag s is eos where any of lags 1..s is
  hash        per order k = 2..n: XOR of lag_j * multiplier_j (j < k), mod each of its tables' prime sizes, plus the
              table's first row; int64 throughout (the multipliers keep every product below 2^63)
  embedding   one Gather of the shared table, (B, T, heads, P / heads) -> (B, T, P)
  gate        key = norm_key(key_proj e), query = norm_query(streams), both per stream (B, T, n, C);
              g = sum(key * query) / sqrt(C), signed sqrt of |g| (at least 1e-6); gated = sigmoid(g) * value_proj e
  conv        normed = norm_conv(gated); gated and normed times ``keep`` (zero at pads); out = gated +
              silu(dilated depthwise conv of normed), kernel ``ple_conv_kernel_size``, dilation ``ngram_size``

The carried state (every axis but the batch static; names of the caller's choosing):
  ngram  (B, n - 1) int64: the last n - 1 ids of context ++ ids, as the PyTorch cache's conv state slot 2. A
         sequence's first forward (``starts``) reads eos as its context, whatever ``past_ngram`` holds.
  conv   (B, n * C, (kernel - 1) * n) model dtype: the last columns of past ++ normed, as slot 1; zeros start.

Padding follows the PyTorch Thinker, whose reference this is: the caller hands ids with masked positions already eos
(``ThinkerModel.forward``) and ``keep`` zeroes gated and normed where a pad stands (transformers'
``apply_mask_to_padding_states``; where PyTorch skips the mask, every position is kept and x * 1 is x). Both states
are the plain last columns, pads included: for left pads from a fresh sequence that is the row alone's state, eos
context and zero window being what a start reads anyway. Unlike the Gated DeltaNet's state (docs/hybrid-export.md
decision 6), nothing is gathered at a row's last kept position: PyTorch does not do it here.

Norms are the Thinker's RMSNorm in float32, grouped per stream: zero-centred (Qwen3.8) scales by the float32 1 + w
before the cast back, plain casts back and scales by w.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from thinker.configuration_thinker import ThinkerConfig
from thinker.modeling_thinker import ngram_hash_buffers

from .graph_builder import GraphBuilder
from .hyper_connection_graph import emit_stream_norm
from .linear_attention_graph import INT64_MAX, MatMulEmitter

GATE_FLOOR = 1e-6  # ThinkerPLELayer's clamp under the gate's square root


def emit_ple(
    b: GraphBuilder,
    config: ThinkerConfig,
    layer: int,
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
    emit_matmul: MatMulEmitter,
    streams: str,
    ple_ids: str,
    keep: str,
    starts: str,
    past_ngram: str,
    past_conv: str,
    present_ngram: str,
    present_conv: str,
) -> str:
    """What PLE layer ``layer`` (0-indexed) adds to ``streams`` (B, T, n * C), as (B, T, n * C) in ``dtype``.

    ``ple_ids`` (B, T) int64 with masked positions already eos; ``keep`` (B, T, 1) in ``dtype``, 0 at pads;
    ``starts`` a bool scalar, true on a sequence's first forward. Reads ``past_ngram`` (B, n - 1) int64 and
    ``past_conv`` (B, n * C, (kernel - 1) * n) in ``dtype``; writes ``present_ngram`` and ``present_conv``."""
    prefix = f"model.layers.{layer}.ple"
    with b.scope("ngram"):
        history = _emit_history(b, config, ple_ids, starts, past_ngram, present_ngram)
        ids = _emit_hashed_ids(b, config, config.ple_layer_ids.index(layer + 1), history)  # (B, T, heads)
        table_name = f"{prefix}.ple_embedding.ngram_embedding.weight"
        rows = b.op("Gather", b.weight(table_name, get(table_name)), ids)  # (B, T, heads, P / heads)
        embeddings = b.op("Reshape", rows, b.const([0, 0, config.ple_embed_dim]))  # (B, T, P)
    with b.scope("gate"):
        gated = _emit_gated_values(b, config, prefix, dtype, get, emit_matmul, streams, embeddings)  # (B, T, n, C)
    with b.scope("conv"):
        normed = emit_stream_norm(b, config, gated, f"{prefix}.norm_conv.weight", dtype, get)
        flat = b.const([0, 0, config.hc_count * config.hidden_size])
        gated = b.op("Mul", b.op("Reshape", gated, flat), keep)  # (B, T, n * C), zero at pads
        normed = b.op("Mul", b.op("Reshape", normed, flat), keep)
        conv = _emit_dilated_conv(b, config, f"{prefix}.conv1d.weight", dtype, get, normed, past_conv, present_conv)
    return b.op("Add", gated, conv)


# --- n-grams ------------------------------------------------------------------------------------------------------
def _emit_history(
    b: GraphBuilder, config: ThinkerConfig, ple_ids: str, starts: str, past_ngram: str, present_ngram: str
) -> str:
    """context ++ ids, (B, n - 1 + T) int64, writing its last n - 1 columns to ``present_ngram``. A sequence's first
    forward reads eos as the context (the PyTorch module without a cache), not the zeros it is handed."""
    eos = b.const(config.ngram_eos_token_id)
    context = b.op("Where", starts, eos, past_ngram)  # (B, n - 1)
    history = b.op("Concat", context, ple_ids, axis=1)
    last = b.const([-(config.ngram_size - 1)])
    b.op_to("Slice", [history, last, b.const([INT64_MAX]), b.const([1])], [present_ngram])
    return history


def _emit_lagged_ids(b: GraphBuilder, config: ThinkerConfig, history: str) -> list[str]:
    """For each lag s = 0 .. n - 1, the id s positions before each new one within its eos-delimited run, eos where
    the run is shorter (``ThinkerNGramEmbedding.shifted``), (B, T) int64 each. The run back to lag s is cut where
    any of lags 1 .. s is eos: the window form of the PyTorch module's cummax over the last eos, which reaches no
    further back than n - 1 ids and so never past the context."""
    context = config.ngram_size - 1
    eos = b.const(config.ngram_eos_token_id)
    lagged = [b.op("Slice", history, b.const([context]), b.const([INT64_MAX]), b.const([1]))]  # the new ids
    cut = None
    for lag in range(1, config.ngram_size):
        # history holds n - 1 + T columns: lag s of the new positions is columns n - 1 - s .. n - 1 + T - s
        ids = b.op("Slice", history, b.const([context - lag]), b.const([-lag]), b.const([1]))
        is_eos = b.op("Equal", ids, eos)
        cut = is_eos if cut is None else b.op("Or", cut, is_eos)
        lagged.append(b.op("Where", cut, eos, ids))
    return lagged


def _emit_hashed_ids(b: GraphBuilder, config: ThinkerConfig, ple_index: int, history: str) -> str:
    """Each new position's rows of the shared table, (B, T, heads) int64, heads ordered by n-gram order then table:
    order k hashes lag_0 * m_0 XOR .. XOR lag_{k-1} * m_{k-1}, reduced mod each of its tables' sizes, plus offsets.
    The hash constants are derived from the config, as the PyTorch module derives its buffers (never weights)."""
    buffers = ngram_hash_buffers(config, ple_index)
    orders, per_order = config.ngram_size - 1, config.heads_per_ngram
    lagged = _emit_lagged_ids(b, config, history)
    multipliers = buffers["multipliers"].tolist()
    mixed = b.op("Mul", lagged[0], b.const(multipliers[0]))
    by_order = []
    for lag in range(1, config.ngram_size):  # order lag + 1 is order lag's mix XOR one more lag
        mixed = b.op("BitwiseXor", mixed, b.op("Mul", lagged[lag], b.const(multipliers[lag])))
        by_order.append(b.op("Unsqueeze", mixed, b.const([-1, -2])))  # (B, T, 1, 1)
    mixed = b.op("Concat", *by_order, axis=2)  # (B, T, orders, 1)
    sizes = b.const(buffers["table_sizes"].reshape(orders, per_order).tolist())  # (orders, per_order)
    offsets = b.const(buffers["table_offsets"].reshape(orders, per_order).tolist())
    ids = b.op("Add", b.op("Mod", mixed, sizes, fmod=0), offsets)  # (B, T, orders, per_order)
    return b.op("Reshape", ids, b.const([0, 0, orders * per_order]))


# --- gate ---------------------------------------------------------------------------------------------------------
def _emit_gated_values(
    b: GraphBuilder,
    config: ThinkerConfig,
    prefix: str,
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
    emit_matmul: MatMulEmitter,
    streams: str,
    embeddings: str,
) -> str:
    """sigmoid(signed sqrt(key . query / sqrt(C))) * value, (B, T, n, C) in ``dtype``: one value for every stream,
    weighed by how well each stream's normed state matches the n-gram's key for it."""
    per_stream = b.const([0, 0, config.hc_count, config.hidden_size])

    def linear(x: str, name: str) -> str:
        weight_name = f"{prefix}.{name}.weight"
        return emit_matmul(x, weight_name, get(weight_name).T)

    keys = b.op("Reshape", linear(embeddings, "key_proj"), per_stream)
    keys = emit_stream_norm(b, config, keys, f"{prefix}.norm_key.weight", dtype, get)
    queries = b.op("Reshape", streams, per_stream)
    queries = emit_stream_norm(b, config, queries, f"{prefix}.norm_query.weight", dtype, get)
    score = b.op("ReduceSum", b.op("Mul", keys, queries), b.const([-1]), keepdims=1)  # (B, T, n, 1)
    # The gate in float32 whatever the model dtype, rounded once: sqrt(C) and the floor are no half-precision
    # numbers (sqrt(32) is 5.65625 in bfloat16), and PyTorch applies them at float32 precision there too.
    score = b.to_float32(score, dtype)
    score = b.op("Div", score, b.const(math.sqrt(config.hidden_size), torch.float32))
    magnitude = b.op("Sqrt", b.op("Max", b.op("Abs", score), b.const(GATE_FLOOR, torch.float32)))
    gate = b.op("Sigmoid", b.op("Mul", magnitude, b.op("Sign", score)))
    gate = b.to_dtype(gate, dtype)
    value = b.op("Unsqueeze", linear(embeddings, "value_proj"), b.const([-2]))  # (B, T, 1, C)
    return b.op("Mul", gate, value)


# --- conv ---------------------------------------------------------------------------------------------------------
def _emit_dilated_conv(
    b: GraphBuilder,
    config: ThinkerConfig,
    weight_name: str,
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
    normed: str,
    past: str,
    present: str,
) -> str:
    """silu(depthwise conv) over time, (B, T, n * C) -> (B, T, n * C), kernel k and dilation n: output t reads
    window columns t, t + n, .., t + (k - 1) n of past ++ normed, whose last (k - 1) n columns go to ``present``.

    Taps on the time-major window, as the Gated DeltaNet's conv (export/linear_attention_graph.py): a shifted slice
    times one weight column each, in float32, the output rounded to ``dtype`` as torch's conv1d rounds it before
    its SiLU (one rounding again after it, as torch computes silu of a half value in float32)."""
    kernel, dilation = config.ple_conv_kernel_size, config.ngram_size
    span = (kernel - 1) * dilation  # the carried columns
    time_major = b.op("Concat", b.op("Transpose", past, perm=[0, 2, 1]), normed, axis=1)  # (B, span + T, n * C)
    carried = b.op("Slice", time_major, b.const([-span]), b.const([INT64_MAX]), b.const([1]))
    b.op_to("Transpose", [carried], [present], perm=[0, 2, 1])
    window = b.to_float32(time_major, dtype)
    taps = get(weight_name).detach().to(torch.float32)[:, 0, :]  # (n * C, k): nn.Conv1d's (n * C, 1, k)
    conv = None
    for j in range(kernel):  # the window has span + T columns: tap j reads j n .. j n + T - 1
        start = j * dilation
        end = start - span if start < span else INT64_MAX  # counted from the window's end (T is not static)
        shifted = b.op("Slice", window, b.const([start]), b.const([end]), b.const([1]))  # (B, T, n * C)
        column = b.weight(f"{weight_name}.tap{j}", taps[:, j].contiguous())
        term = b.op("Mul", shifted, column)
        conv = term if conv is None else b.op("Add", conv, term)
    conv = b.to_float32(b.to_dtype(conv, dtype), dtype)
    return b.to_dtype(b.op("Mul", conv, b.op("Sigmoid", conv)), dtype)
