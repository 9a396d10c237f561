"""Qwen3.8's hyper-connections as ONNX nodes (``ThinkerHyperConnection`` in thinker/modeling_thinker.py).

The residual is ``hc_count`` streams of ``hidden_size``, carried as one (B, T, n·C) tensor. Each sub-layer reads a
learned mix of the RMS-normed streams in place of its pre-norm, and its output is added back to every stream with a
per-stream weight. Every step is a static, elementwise or small-matmul operation in the PyTorch module's order, so
the plain and the fused graph share these emitters; the low-rank mixers stay float MatMuls under ``--quantize``
(a few thousand weights each, and the weights every channel of every stream is scaled by).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from thinker.configuration_thinker import ThinkerConfig

from .graph_builder import GraphBuilder
from .hybrid_attention_graph import emit_rms_norm


def emit_stream_norm(
    b: GraphBuilder,
    config: ThinkerConfig,
    x: str,
    weight_name: str,
    dtype: torch.dtype,
    get: Callable[[str], torch.Tensor],
) -> str:
    """``make_norm(config, n * C, group_size=C)`` on x (B, T, n, C): each stream normed on its own in float32, the
    (n * C) weight viewed (n, C); zero-centred (Qwen3.8's form) it scales by the float32 ``1 + w`` before the cast
    back, plain it casts back and scales by ``w``."""
    weight = get(weight_name).reshape(config.hc_count, config.hidden_size)
    return emit_rms_norm(b, x, weight_name, weight, config.rms_norm_eps, dtype, config.norm_zero_centered)


def emit_hyper_connection(
    b: GraphBuilder,
    config: ThinkerConfig,
    prefix: str,
    get: Callable[[str], torch.Tensor],
    streams: str,
    dtype: torch.dtype,
    inject: bool = True,
) -> tuple[str, str | None]:
    """(B, T, n·C) streams -> the sub-layer's input (B, T, C) and, with ``inject``, the weights (B, T, n) its output
    is added to each stream with (``ThinkerHyperConnection.forward``)."""
    n, hidden = config.hc_count, config.hidden_size

    def linear(x: str, name: str) -> str:
        return b.op("MatMul", x, b.weight(f"{prefix}.{name}.weight", get(f"{prefix}.{name}.weight").T))

    def over_streams(x: str) -> str:  # x / n, in the model dtype as the module divides
        return b.op("Div", x, b.const(float(n), dtype))

    by_stream = b.const([0, 0, n, hidden])
    norm_name = f"{prefix}.hc_norm.weight"
    normed_streams = emit_stream_norm(b, config, b.op("Reshape", streams, by_stream), norm_name, dtype, get)
    normed = b.op("Reshape", normed_streams, b.const([0, 0, -1]))  # (B, T, n·C)
    down = over_streams(linear(normed, "input_mix_weight_down"))
    mix = b.op("Sigmoid", linear(b.op("Mul", down, b.op("Sigmoid", down)), "input_mix_weight_up"))  # (B, T, n·C)
    weighted = b.op("Mul", b.op("Reshape", mix, by_stream), normed_streams)  # (B, T, n, C)
    mixed = b.op("ReduceMean", weighted, b.const([-2]), keepdims=0)  # (B, T, C)
    if not inject:
        return mixed, None
    weights = b.op("Mul", b.const(2.0, dtype), b.op("Sigmoid", over_streams(linear(normed, "block_inject_weight"))))
    return mixed, weights


def emit_inject(b: GraphBuilder, streams: str, output: str, weights: str) -> str:
    """Each stream plus the sub-layer's output (B, T, C) times its weight (B, T, n): ``ThinkerHyperConnection``'s
    ``inject``."""
    added = b.op("Mul", b.op("Unsqueeze", output, b.const([-2])), b.op("Unsqueeze", weights, b.const([-1])))
    return b.op("Add", streams, b.op("Reshape", added, b.const([0, 0, -1])))  # (B, T, n·C)
