"""``dequantized``: gguf's ``dequantize`` bit for bit, through transformers' torch dequantizers where it has one.

The converter, the parity references and transformers' own loading must read the same numbers from a GGUF file
(the conversion's contract is that its weights are the values transformers loads), so the faster dequantizers are
held to gguf's reference on every block type both know, over pieces as the converter cuts them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers.integrations.gguf.dequant import GGML_BLOCK

import thinker_common.gguf_reader as gguf_reader
from thinker_common.gguf_reader import dequantized

# Random half-precision scales include NaN and infinities, over which numpy warns as it multiplies.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

ROWS, BLOCKS_PER_ROW = 6, 5


def random_blocks(kind: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """ROWS rows of BLOCKS_PER_ROW random blocks, shaped as gguf's reader shapes a quantized tensor's bytes (rows of
    bytes), read-only as a view of the file's map is. Random bytes make some half-precision scales NaN or infinite,
    which the comparison allows for."""
    _, block_bytes = quants.GGML_QUANT_SIZES[kind]
    data = np.random.default_rng(seed).integers(0, 256, (ROWS, BLOCKS_PER_ROW * block_bytes), dtype=np.uint8)
    data.flags.writeable = False
    return data


def assert_same_values(got: torch.Tensor, expected: np.ndarray) -> None:
    """Equal bits wherever the reference is a number; NaN where it is NaN (a NaN's payload may differ)."""
    got = got.numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("kind", sorted(GGMLQuantizationType(kind) for kind in GGML_BLOCK), ids=lambda kind: kind.name)
def test_transformers_dequantizers_give_ggufs_values(kind, monkeypatch):
    """Every block type transformers dequantizes, in pieces that end inside a row and a last piece cut short."""
    per_block, _ = quants.GGML_QUANT_SIZES[kind]
    monkeypatch.setattr(gguf_reader, "DEQUANTIZE_PIECE", 4 * per_block)  # 30 blocks: seven of four, one of two
    for seed in range(3):
        data = random_blocks(kind, seed)
        assert_same_values(dequantized(data, kind), quants.dequantize(data, kind))


def test_the_default_piece_size_holds_too():
    """Pieces of DEQUANTIZE_PIECE values over a tensor larger than one (the embedding of a real model)."""
    kind = GGMLQuantizationType.Q8_0
    per_block, block_bytes = quants.GGML_QUANT_SIZES[kind]
    rows = 2 * gguf_reader.DEQUANTIZE_PIECE // (64 * per_block) + 3
    data = np.random.default_rng(1).integers(0, 256, (rows, 64 * block_bytes), dtype=np.uint8)
    assert_same_values(dequantized(data, kind), quants.dequantize(data, kind))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "F16", "F32"])
def test_other_types_take_ggufs_own_dequantizer(kind):
    """Types transformers has no dequantizer for go through gguf's; a float32 tensor's values are copied out of the
    file's (read-only) map, never handed out as a view of it."""
    kind = GGMLQuantizationType[kind]
    assert kind not in GGML_BLOCK
    data = random_blocks(kind)
    if kind == GGMLQuantizationType.F32:
        data = np.arange(ROWS * 8, dtype=np.float32).reshape(ROWS, 8)
        data.flags.writeable = False
    result = dequantized(data, kind)
    assert_same_values(result, quants.dequantize(data, kind))
    result += 1  # writable: its own memory
