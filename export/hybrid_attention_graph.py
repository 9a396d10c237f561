"""The full-attention pieces that Qwen3.5 and Qwen3-Next add to a decoder's attention layer, as ONNX.

  output gate         q_proj yields 2 * head_dim per head, the query and then a gate (Qwen3NextAttention,
                      Qwen3_5Attention); the attention output is multiplied by sigmoid(gate) before o_proj
  zero-centred norm   RMSNorm weights stored as offsets from one: (x32 * rsqrt(mean(x32²) + eps) * (1 + w32)),
                      cast to the model dtype after the scale (Qwen3_5RMSNorm), for q_norm / k_norm and the layers
  partial rotary      only the first ``rotary_dim`` of each head rotates (half-split), the rest passes through
  multimodal RoPE     position_ids (3, B, T): temporal, height and width positions, each frequency reading the one
                      ``mrope_streams`` gives it: interleaved (frequency i reads the height position when i % 3 == 1
                      and i < 3 * section[1], the width position when i % 3 == 2 and i < 3 * section[2], the temporal
                      one otherwise: Qwen3_5TextRotaryEmbedding's layout), or in contiguous sections, t then h then w
                      (Qwen2VLRotaryEmbedding's; ``mrope_interleaved: false``)

cos/sin come from tables over every position, (max_pos, rotary_dim / 2), computed at export by torch from the
model's own inverse frequencies: the plain graph gathers rows of them per stream and keeps each frequency's
stream (bit-exact with transformers), the fused graph hands the same tables to onnxruntime's MRotaryEmbedding.
Text-only callers pass the same position three times, (B, T) -> (3, B, T), as transformers does inside its model.
"""

from __future__ import annotations

import torch

from thinker.configuration_thinker import ThinkerConfig
from thinker.modeling_thinker import ThinkerRotaryEmbedding, mrope_streams

from .graph_builder import GraphBuilder

MS_DOMAIN = "com.microsoft"


# --- the output gate ------------------------------------------------------------------------------------------
def emit_query_and_gate(b: GraphBuilder, q_proj: str, num_heads: int, head_dim: int) -> tuple[str, str]:
    """q_proj's (B, T, nh * 2 * hd) output, per head [query | gate] -> query (B, T, nh, hd), gate (B, T, nh * hd)."""
    per_head = b.op("Reshape", q_proj, b.const([0, 0, num_heads, 2 * head_dim]))
    query, gate = b.op("Split", per_head, b.const([head_dim, head_dim]), axis=-1, outputs=2)
    return query, b.op("Reshape", gate, b.const([0, 0, num_heads * head_dim]))


def emit_output_gate(b: GraphBuilder, attention: str, gate: str) -> str:
    """attention (B, T, nh * hd) * sigmoid(gate), in the model dtype as transformers multiplies them."""
    return b.op("Mul", attention, b.op("Sigmoid", gate))


# --- zero-centred RMSNorm -------------------------------------------------------------------------------------
def zero_centered_scale(weight: torch.Tensor) -> torch.Tensor:
    """The float32 scale ``1 + w`` that Qwen3_5RMSNorm applies (its weight is stored as an offset from one)."""
    return 1.0 + weight.detach().float()


def emit_zero_centered_rms_norm(b: GraphBuilder, x: str, scale: str, eps: float, dtype: torch.dtype) -> str:
    """(x32 * rsqrt(mean(x32²) + eps) * scale).to(dtype) over the last axis; ``scale`` is the float32 ``1 + w``
    (``zero_centered_scale``). Unlike Llama-style norms the scale multiplies before the cast back."""
    x32 = b.to_float32(x, dtype)
    variance = b.op("ReduceMean", b.op("Mul", x32, x32), b.const([-1]), keepdims=1)
    inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", variance, b.const(eps, torch.float32))))
    out = b.op("Mul", b.op("Mul", x32, inv_rms), scale)
    return b.to_dtype(out, dtype)


def emit_rms_norm(
    b: GraphBuilder, x: str, name: str, weight: torch.Tensor, eps: float, dtype: torch.dtype, zero_centered: bool
) -> str:
    """``ThinkerRMSNorm`` over x's last axis, in float32: zero-centred, the float32 ``1 + w`` before the cast back
    (``emit_zero_centered_rms_norm``); plain, the cast back and then ``w`` (Qwen3's and Llama's order). ``weight``
    broadcasts against x as given (grouped norms pass it reshaped), stored as ``name``."""
    if zero_centered:
        return emit_zero_centered_rms_norm(b, x, b.weight(name, zero_centered_scale(weight)), eps, dtype)
    x32 = b.to_float32(x, dtype)
    variance = b.op("ReduceMean", b.op("Mul", x32, x32), b.const([-1]), keepdims=1)
    inv_rms = b.op("Reciprocal", b.op("Sqrt", b.op("Add", variance, b.const(eps, torch.float32))))
    normed = b.op("Mul", x32, inv_rms)
    normed = b.to_dtype(normed, dtype)
    return b.op("Mul", b.weight(name, weight), normed)


# --- rotary tables ---
def rotary_dim(config: ThinkerConfig) -> int:
    """Channels of each head that RoPE rotates: the head, or its first part with ``partial_rotary_factor``."""
    return 2 * ThinkerRotaryEmbedding(config).inv_freq.shape[0]


def mrope_stream_selector(mrope_section: list[int], half_rotary_dim: int, interleaved: bool = True) -> torch.Tensor:
    """(3, 1, 1, rotary_dim / 2) float32 one-hot: which of the temporal/height/width position streams each
    frequency reads (the Thinker's ``mrope_streams``: interleaved, or in contiguous sections)."""
    if len(mrope_section) != 3 or sum(mrope_section) != half_rotary_dim:
        raise ValueError(
            f"mrope_section={mrope_section} must give 3 counts (temporal, height, width) summing to "
            f"rotary_dim / 2 = {half_rotary_dim}"
        )
    streams = mrope_streams(mrope_section, interleaved)
    return torch.nn.functional.one_hot(streams, 3).T.float().reshape(3, 1, 1, half_rotary_dim)


def emit_rotary_cos_sin(
    b: GraphBuilder,
    position_ids: str,
    cos_table: str,
    sin_table: str,
    dtype: torch.dtype,
    selector: str | None = None,
) -> tuple[str, str]:
    """cos and sin (B, 1, T, rotary_dim) in the tables' ``dtype`` for ``position_ids`` (B, T), or (3, B, T) with the
    float32 ``selector`` of ``mrope_stream_selector`` (interleaved mRoPE). Gathered, never recomputed, so they
    equal the reference's values bit for bit."""
    halves = []
    for table in (cos_table, sin_table):
        rows = b.op("Gather", table, position_ids)  # ([3,] B, T, rotary_dim / 2)
        if selector is not None:
            # Each frequency keeps one stream's value: x * 1 + 0 + 0 in float32 is exact.
            rows32 = b.to_float32(rows, dtype)
            rows = b.op("ReduceSum", b.op("Mul", rows32, selector), b.const([0]), keepdims=0)  # (B, T, rot/2)
            rows = b.to_dtype(rows, dtype)
        both = b.op("Concat", rows, rows, axis=-1)  # the half-split rotation repeats each frequency
        halves.append(b.op("Unsqueeze", both, b.const([1])))  # (B, 1, T, rotary_dim)
    return halves[0], halves[1]


def emit_partial_rotary(b: GraphBuilder, x: str, cos: str, sin: str, rotary_dim: int, head_dim: int) -> str:
    """x (B, H, T, hd): its first ``rotary_dim`` channels become x * cos + rotate_half(x) * sin, the rest pass."""
    if rotary_dim == head_dim:
        return _rotate(b, x, cos, sin)
    rotating, passing = b.op("Split", x, b.const([rotary_dim, head_dim - rotary_dim]), axis=-1, outputs=2)
    return b.op("Concat", _rotate(b, rotating, cos, sin), passing, axis=-1)


def _rotate(b: GraphBuilder, x: str, cos: str, sin: str) -> str:
    first, second = b.op("Split", x, axis=-1, num_outputs=2, outputs=2)
    rotated = b.op("Concat", b.op("Neg", second), first, axis=-1)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def emit_mrotary_embedding(
    b: GraphBuilder,
    x: str,
    position_ids: str,
    cos_table: str,
    sin_table: str,
    num_heads: int,
    rotary_dim: int,
    mrope_section: list[int],
    interleaved: bool = True,
) -> str:
    """The fused form: onnxruntime's MRotaryEmbedding on x (B, T, H * hd) with (3, B, T) positions and the
    (max_pos, rotary_dim / 2) tables of ``rope_tables``; rotates the first ``rotary_dim`` of each head. Its
    ``mrope_layout`` 1 reads the interleaved sections, 0 the contiguous ones (Qwen2-VL's)."""
    return b.op(
        "MRotaryEmbedding",
        x,
        position_ids,
        cos_table,
        sin_table,
        domain=MS_DOMAIN,
        mrope_section=list(mrope_section),
        mrope_layout=1 if interleaved else 0,
        num_heads=num_heads,
        rotary_embedding_dim=rotary_dim,
        interleaved=0,
    )
