"""The value check every tensor passes on its way into a written folder (converted weights, the way back, an ONNX
export): no NaN or Inf, and nothing a float16 cast would turn into Inf."""

from __future__ import annotations

import math

import torch

FLOAT16_MAX = torch.finfo(torch.float16).max  # 65504: larger magnitudes become inf in float16


def value_problem(tensor: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What is wrong with ``tensor``'s values for a cast to ``dtype``: NaN or Inf, or magnitudes float16 turns into
    Inf; None when nothing is. One pass over the tensor, no copy."""
    if not tensor.is_floating_point() or not tensor.numel():
        return None
    low, high = (value.item() for value in torch.aminmax(tensor))  # NaN propagates into both
    if not (math.isfinite(low) and math.isfinite(high)):
        return "holds NaN or Inf values"
    if dtype == torch.float16 and max(-low, high) > FLOAT16_MAX:
        return f"holds values up to {max(-low, high):.6g}, beyond float16's ±{FLOAT16_MAX:.0f}"
    return None
