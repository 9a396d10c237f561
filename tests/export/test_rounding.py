"""export/rounding.py against onnxruntime's own quantizer: the weights a MatMulNBits node holds, dequantized, equal
``rtn_dequantized``'s bit for bit (the activation-aware scales' search and the quantized verify both rest on it), at
both bit widths, both symmetries, a width the block does not divide, and values on exact ties of a rounding step
(where C's roundf and torch's round part)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.dequantize import dequantize_matmul_nbits
from export.quantize import QuantizeSpec, WeightQuantizer
from export.rounding import rtn_dequantized


def tied_weight(rows: int, columns: int, bits: int) -> torch.Tensor:
    """Random weights, and rows whose blocks' largest magnitude is 2^(bits-1) exactly, so that the step is 1 and
    the halves of the rest lie on ties."""
    generator = torch.Generator().manual_seed(bits)
    weight = torch.randn(rows, columns, generator=generator)
    middle = 2 ** (bits - 1)
    halves = torch.randint(-2 * middle + 1, 2 * middle, (rows // 2, columns), generator=generator) / 2
    halves[:, ::16] = -middle  # every block of 16 holds the magnitude that makes its step 1
    weight[: rows // 2] = halves
    return weight


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("algo", ["rtn", "rtn-asym"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rtn_dequantized_is_onnxruntime_bit_for_bit(bits, algo, block_size):
    weight = tied_weight(24, 40, bits)  # 40 inputs: the last block of 32 padded
    spec = QuantizeSpec(bits=bits, block_size=block_size, algo=algo)
    quantized = WeightQuantizer(spec, torch.float32).quantize_slice("w", weight.T.contiguous(), spec)
    arrays = [quantized.arrays[name] if name else None for name in quantized.inputs]
    graph = torch.from_numpy(np.ascontiguousarray(dequantize_matmul_nbits(quantized.attributes, *arrays).T))
    ours = rtn_dequantized(weight, bits, block_size, asymmetric=algo == "rtn-asym").reshape(24, -1)[:, :40]
    assert torch.equal(ours, graph), (ours - graph).abs().max()
    assert not torch.equal(ours, weight.half().float())  # the rounding is a real one, not a copy of the values


def onnxruntime_dequantized(weight: torch.Tensor, bits: int, block_size: int, algo: str) -> torch.Tensor:
    """(R, K) ``weight`` through onnxruntime's quantizer and back, as a MatMulNBits node holds it."""
    spec = QuantizeSpec(bits=bits, block_size=block_size, algo=algo)
    quantized = WeightQuantizer(spec, torch.float32).quantize_slice("w", weight.T.contiguous(), spec)
    arrays = [quantized.arrays[name] if name else None for name in quantized.inputs]
    return torch.from_numpy(np.ascontiguousarray(dequantize_matmul_nbits(quantized.attributes, *arrays).T))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("algo", ["rtn", "rtn-asym"])
def test_awkward_blocks_are_onnxruntime_bit_for_bit(bits, algo):
    """Blocks of one sign (asymmetric: the range widened to hold 0), a block of zeros (no NaN from a scale of 0),
    a block whose largest magnitude is held by +m and -m both (onnxruntime takes the negative one), and
    asymmetric zero points on exact ties (roundf's halves away from 0, not torch's to even)."""
    positive, tie = torch.linspace(0.1, 3.0, 16), torch.cat([torch.tensor([8.0, -8.0]), torch.linspace(-7, 7, 14)])
    halves = torch.cat([torch.linspace(-0.25, 7.25, 16), torch.linspace(-0.75, 6.75, 16)])  # -low / scale: x.5
    weight = torch.stack([torch.cat([positive, -positive]), torch.cat([torch.zeros(16), tie]), halves, -halves])
    ours = rtn_dequantized(weight, bits, 16, asymmetric=algo == "rtn-asym").reshape(4, -1)
    assert torch.equal(ours, onnxruntime_dequantized(weight, bits, 16, algo)), ours


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_one_scale_a_row_is_the_row_wise_int8_the_experts_store(scale_dtype):
    """``block_size`` 0: export/quantize.py ``column_wise_int8``'s weights (QMoE's int8 rows, which the quantized
    verify holds to this rounding), the largest magnitude of either sign at 127 steps."""
    from export.quantize import column_wise_int8

    weight = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    weight[1] *= -1
    weight[1, 3] = -4.0  # rows whose largest magnitude is negative, and positive
    weight[2, 7] = 4.0
    weight[3, :4] = torch.tensor([127.0, 2.5, 0.5, -1.5])  # a scale of 1: halves, which torch.round takes to even
    packed, scales = column_wise_int8(weight[None], np.dtype("float16" if scale_dtype == torch.float16 else "float32"))
    stored = (torch.from_numpy(packed[0]).float() - 128) * torch.from_numpy(scales[0]).float()[:, None]
    ours = rtn_dequantized(weight, 8, 0, scale_dtype=scale_dtype).reshape(6, -1)
    assert torch.equal(ours, stored), (ours - stored).abs().max()
