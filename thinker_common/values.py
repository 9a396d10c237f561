"""The value check every tensor passes on its way into a written folder (converted weights, the way back, an ONNX
export): no NaN or Inf, and nothing a float16 cast would turn into Inf.

``ValueScan`` sees a tensor in pieces, so that a reader can check each piece of bytes right after reading it, while
it is still in the processor's cache, instead of passing over the whole tensor a second time.
"""

from __future__ import annotations

import math

import torch

FLOAT16_MAX = torch.finfo(torch.float16).max  # 65504: larger magnitudes become inf in float16


# Values reduced per call: torch's grain size (at::internal::GRAIN_SIZE), below which a reduction runs on the calling
# thread. Larger calls are split across the intra-op thread pool, and waking it for every piece costs more than the
# reduction itself whenever the cores are busy (the conversion's writer thread, or anything else on the machine).
_PIECE = 32768


class ValueScan:
    """The smallest and largest value of a tensor seen piece by piece (``update``); NaN anywhere is remembered."""

    def __init__(self) -> None:
        self.low, self.high, self.finite = math.inf, -math.inf, True

    def update(self, values: torch.Tensor) -> None:
        if not values.is_floating_point() or not values.numel() or not self.finite:
            return
        for piece in values.reshape(-1).split(_PIECE):
            low, high = (value.item() for value in torch.aminmax(piece))  # NaN propagates into both
            if not (math.isfinite(low) and math.isfinite(high)):
                self.finite = False
                return
            self.low, self.high = min(self.low, low), max(self.high, high)

    def problem(self, dtype: torch.dtype) -> str | None:
        """What is wrong with the values seen for a cast to ``dtype``; None when nothing is."""
        if not self.finite:
            return "holds NaN or Inf values"
        largest = max(-self.low, self.high)
        if dtype == torch.float16 and largest > FLOAT16_MAX:
            return f"holds values up to {largest:.6g}, beyond float16's ±{FLOAT16_MAX:.0f}"
        return None


def value_problem(tensor: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What is wrong with ``tensor``'s values for a cast to ``dtype``: NaN or Inf, or magnitudes float16 turns into
    Inf; None when nothing is. One pass over the tensor, no copy."""
    scan = ValueScan()
    scan.update(tensor)
    return scan.problem(dtype)
