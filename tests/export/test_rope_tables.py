"""The RoPE tables the graphs store (issue 16): half the rotated width (what both graphs read), in the graph's
dtype, built chunk by chunk (memory: the tables, not several float32 copies of the whole context), and equal to the
model's own rotary embedding run over the whole context at once, for every RoPE type the export takes (the
length-dependent ones are refused by check_exportable), across chunk boundaries, partial rotary included."""

from __future__ import annotations

import pytest
import torch
from export_helpers import make_config

from export.decoder_graph import ROPE_CHUNK, rope_tables
from thinker.modeling_thinker import ThinkerRotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "partial": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("rope", ROPES)
def test_tables_equal_the_models_rotary_embedding(rope):
    positions = 2 * ROPE_CHUNK + 5  # three chunks, the last a short one
    config = make_config("qwen3", max_position_embeddings=positions, rope_parameters=ROPES[rope])
    expected_cos, expected_sin = ThinkerRotaryEmbedding(config)(torch.zeros(()), torch.arange(positions)[None])
    half = expected_cos.shape[-1] // 2  # the rotated width's half: the whole head's unless partial
    assert (half < config.head_dim // 2) if rope == "partial" else (half == config.head_dim // 2)
    cos, sin = rope_tables(config, torch.float32)
    assert cos.shape == sin.shape == (positions, half)
    torch.testing.assert_close(cos, expected_cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0, :, :half], rtol=0, atol=0)
    cos, sin = rope_tables(config, torch.float16)
    assert cos.dtype == torch.float16
    torch.testing.assert_close(cos, expected_cos[0, :, :half].half(), rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0, :, :half].half(), rtol=0, atol=0)
