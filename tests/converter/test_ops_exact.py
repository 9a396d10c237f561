"""Declared tensor operations (converter/ops.py) that no family's conversion reaches in every form: each one's values,
order, dtype and refusals, and its inverse being exact, checked on small tensors."""

from __future__ import annotations

import pytest
import torch

from converter.ops import (
    AsVector,
    ChunkParts,
    Each,
    Identity,
    JoinParts,
    LogOfNegated,
    NegatedExp,
    Offset,
    Split,
    Squeeze,
    Transpose,
    Unsqueeze,
)
from thinker import ThinkerConfig

CONFIG = ThinkerConfig(hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=8)


def _rows(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)


@pytest.mark.parametrize(
    "op",
    [
        Split(dim=1, parts=2),
        Split(dim=1, sizes=lambda c: [c.head_dim, c.hidden_size - c.head_dim]),
        Each(Transpose(), Unsqueeze(1, 3), Identity()),
    ],
    ids=["parts", "sizes", "each"],
)
def test_an_operation_along_another_dimension_is_undone_by_its_inverse(op):
    tensors = [_rows(3, 24)] if isinstance(op, Split) else [_rows(2, 5), _rows(4, 6), _rows(3)]
    restored = op.inverse()(op(tensors, CONFIG), CONFIG)
    assert [tuple(t.shape) for t in restored] == [tuple(t.shape) for t in tensors]
    for before, after in zip(tensors, restored, strict=True):
        assert torch.equal(after, before)


def test_split_by_sizes_gives_the_pieces_in_order():
    q, k, v = Split(dim=0, sizes=lambda c: [8, 8, 4])([_rows(20, 2)], CONFIG)
    assert torch.equal(q, _rows(20, 2)[:8]) and torch.equal(k, _rows(20, 2)[8:16]) and torch.equal(v, _rows(20, 2)[16:])


def test_split_into_parts_refuses_a_dimension_they_do_not_divide():
    with pytest.raises(ValueError, match="into 3 parts"):
        Split(dim=0, parts=3)([_rows(10, 4)], CONFIG)


def test_table_pieces_join_in_order_and_are_cut_as_torch_chunk_cuts():
    config = ThinkerConfig(split_ngram_parts=4)
    table = _rows(10, 2)
    pieces = ChunkParts()([table], config)
    assert [p.shape[0] for p in pieces] == [3, 3, 3, 1]  # torch.chunk's cut, as transformers' Chunk writes
    (joined,) = JoinParts()(pieces, config)
    assert torch.equal(joined, table)
    with pytest.raises(ValueError, match="split_ngram_parts=4"):
        ChunkParts()([_rows(6, 2)], config)  # torch.chunk makes 3 pieces of 2: not the 4 the config says


@pytest.mark.parametrize(
    ("op", "shape"),
    [(AsVector(), (2, 24)), (Squeeze(1, 3), (4, 2, 3)), (Squeeze(1, 3), (4, 1))],
    ids=["two-rows", "not-size-1", "too-few-dimensions"],
)
def test_a_squeeze_refuses_what_it_would_not_restore(op, shape):
    with pytest.raises(ValueError):
        op([torch.zeros(shape)], CONFIG)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offset_is_computed_in_float32_and_keeps_the_dtype(dtype):
    stored = torch.tensor([1.0, 1.5, 0.25, 2.0078125], dtype=dtype)
    (centred,) = Offset(-1.0)([stored], CONFIG)
    assert centred.dtype == dtype
    assert torch.equal(centred, (stored.float() - 1.0).to(dtype))
    (back,) = Offset(-1.0).inverse()([centred], CONFIG)
    assert torch.equal(back, stored)


def test_a_decay_rate_and_its_a_log_are_each_others_inverse():
    a_log = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    (rate,) = LogOfNegated().inverse()([a_log], CONFIG)  # llama.cpp's ssm_a: -exp(A_log), always negative
    assert torch.equal(rate, -torch.exp(a_log)) and isinstance(LogOfNegated().inverse(), NegatedExp)
    (again,) = LogOfNegated()([rate], CONFIG)
    torch.testing.assert_close(again, a_log)


def test_a_shared_expert_with_a_width_is_written_back_as_it_is(tmp_path):
    """Only a shared expert 0 wide is derived from the config on the way back; one with a width is the Thinker's own
    tensors, bit for bit (no family test took Qwen2-MoE with a real shared expert back)."""
    from convert_helpers import QWEN2, build_reference
    from safetensors.torch import load_file
    from transformers import Qwen2MoeConfig

    from converter.back import convert_back
    from converter.convert import convert

    config = Qwen2MoeConfig(
        **QWEN2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8
    )
    build_reference(config, 0).save_pretrained(tmp_path / "source")
    convert(tmp_path / "source", tmp_path / "thinker", progress=False, verify=False)
    convert_back(tmp_path / "thinker", tmp_path / "back", "qwen2_moe", progress=False, verify=False)
    before = load_file(tmp_path / "source" / "model.safetensors")
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
