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
