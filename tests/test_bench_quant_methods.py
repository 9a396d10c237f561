"""bench/bench_quant_methods.py's own quantizer (the searched symmetric scales): it must stay on MatMulNBits'
symmetric grid, never round worse than the RTN it starts from, and leave a weight already on that grid alone. Its
mixed head is the exporter's, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_quant_methods import BLOCK, Sink, least_squares_symmetric, mixed_head, onnxruntime_quantizer  # noqa: E402


def blockwise(weight: torch.Tensor) -> torch.Tensor:
    """(in, out) -> (out, in / BLOCK, BLOCK): the blocks MatMulNBits quantizes."""
    return weight.reshape(weight.shape[0] // BLOCK, BLOCK, weight.shape[1]).permute(2, 0, 1)


def test_searched_scales_stay_on_the_symmetric_grid_and_beat_rtn_block_by_block():
    torch.manual_seed(0)
    weight = torch.randn(128, 48) * torch.linspace(0.01, 1.0, 48)  # columns of very different scales
    weight[5, 3] = 9.0  # an outlier: RTN spends its whole range on it
    searched = least_squares_symmetric(weight)
    rtn = onnxruntime_quantizer(4, "rtn")(weight)
    levels = {len(torch.unique(block)) for block in blockwise(searched).reshape(-1, BLOCK)}
    assert max(levels) <= 16  # at most 16 distinct values a block: 4 bits
    error_searched = ((blockwise(weight - searched)) ** 2).sum(-1)
    error_rtn = ((blockwise(weight - rtn)) ** 2).sum(-1)
    assert (error_searched <= error_rtn * (1 + 1e-5) + 1e-12).all()  # RTN's scale is among the candidates
    assert error_searched.sum() < 0.95 * error_rtn.sum()  # and the search finds better ones (8 % here)


def test_a_weight_on_the_grid_comes_back_unchanged():
    torch.manual_seed(1)
    scales = torch.rand(64 // BLOCK, 1, 24) + 0.5
    codes = torch.randint(-8, 8, (64 // BLOCK, BLOCK, 24)).float()
    codes[:, 0, :] = -8  # every block reaches -8: the grid's own extreme
    weight = (codes * scales).reshape(64, 24)
    torch.testing.assert_close(least_squares_symmetric(weight), weight, rtol=1e-6, atol=1e-6)


def test_the_benchs_mixed_head_is_what_the_exporter_writes():
    import numpy as np

    from export.dequantize import dequantize_matmul_nbits
    from export.quantize import HEAD, QuantizeSpec, SplitProjection, WeightQuantizer

    torch.manual_seed(2)
    weight = torch.randn(64, 96)  # (in, out): 96 vocabulary rows
    sink = Sink()
    split = WeightQuantizer(QuantizeSpec(bits=4, block_size=BLOCK, head_int8_rows=40), torch.float32).quantize(
        sink, HEAD, weight
    )
    assert isinstance(split, SplitProjection) and [p.attributes["bits"] for p in split.pieces] == [8, 4]
    pieces = [
        dequantize_matmul_nbits(p.attributes, *[sink.arrays[name] if name else None for name in p.inputs[:3]])
        for p in split.pieces
    ]
    exported = torch.from_numpy(np.concatenate(pieces, axis=1).astype(np.float32))
    assert torch.equal(mixed_head(40)(weight), exported)
