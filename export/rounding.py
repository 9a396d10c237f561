"""onnxruntime's block-wise round-to-nearest, reproduced in torch: what a quantized weight holds after rounding.

Used where a weight's rounding is needed without a graph: the quantized export's weight check
(export/quantized_verify.py) and the activation-aware scales' search (export/awq.py)."""

from __future__ import annotations

import torch


def in_blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """(R, K) as (R, blocks, block size), the last block padded with zeros; ``block_size`` 0: one block a row."""
    block = block_size or rows.shape[-1]
    if rows.shape[-1] % block:
        rows = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % block))
    return rows.reshape(rows.shape[0], -1, block)


def rtn_dequantized(
    rows: torch.Tensor, bits: int, block_size: int, asymmetric: bool = False, scale_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``rows`` (R, K), float, as (R, blocks, block size) after round-to-nearest and back, at
    ``bits``, in blocks of ``block_size`` along K, as onnxruntime's blockwise quantizer rounds (MLAS: symmetric,
    the block's value of largest magnitude at -2^(bits-1) steps; asymmetric, the block's range widened to hold 0
    over 2^bits - 1 steps, an integer zero point; C's roundf, ties away from 0). ``block_size`` 0: one scale per
    row, the largest magnitude at 2^(bits-1) - 1 steps, rounded as export/quantize.py ``column_wise_int8`` rounds
    (halves to even). The scale is the
    one stored, in ``scale_dtype`` (the graph's), and the values are rounded at it, as MLAS does: a float16 graph's
    scale of a block of small weights is subnormal, its rounding then larger than the values' (a review: modelled
    in float32, a sound graph's blocks measured 1.3-5x)."""

    def stored(scale: torch.Tensor) -> torch.Tensor:
        return scale.to(scale_dtype).float()

    blocks = in_blocks(rows, block_size)
    top, middle = 2**bits - 1, 2 ** (bits - 1)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    lowest = 0
    if not block_size:
        scale, zero, lowest = stored(torch.maximum(-low, high) / (middle - 1)), middle, 1
    elif asymmetric:
        low, high = low.clamp(max=0), high.clamp(min=0)
        scale = stored((high - low) / top)
        zero = _round(-low / torch.where(scale > 0, scale, 1)).clamp(0, top)
    else:
        scale, zero = stored(torch.where(high.abs() > low.abs(), high, low) / -middle), middle
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))
    if not block_size:  # column_wise_int8's own rounding, torch.round's: halves to even (helper-246)
        return (blocks / scale).round_().clamp_(lowest - zero, top - zero).mul_(scale)
    # _round's halves away from 0, in place and in one pass each (6-8x faster, the activation-aware scales' search
    # rounds every weight eleven times): for values >= 0 it is floor(v + 0.5) exactly, and a value below 0 comes
    # out of either at most 0, which the clamp to ``lowest`` >= 0 takes to the same level.
    levels = blocks / scale
    levels.add_(zero).add_(0.5).floor_().clamp_(lowest, top)
    return levels.sub_(zero).mul_(scale)


def _round(values: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round takes them to even)."""
    return values.sign() * (values.abs() + 0.5).floor()
