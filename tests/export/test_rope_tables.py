"""The RoPE tables the graphs store (issue 16): sized by what each graph reads (the fused graph half a head wide),
in the graph's dtype, built chunk by chunk (memory: the tables, not several float32 copies of the whole context),
and equal to the model's own rotary embedding run over the whole context at once, for every RoPE type, across
chunk boundaries."""

from __future__ import annotations

import pytest
import torch
from export_helpers import make_config

from export.decoder_graph import ROPE_CHUNK, rope_tables
from thinker.modeling_thinker import ThinkerRotaryEmbedding

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("rope", ROPES)
def test_tables_equal_the_models_rotary_embedding(rope):
    positions = 2 * ROPE_CHUNK + 5  # three chunks, the last a short one
    config = make_config("qwen3", max_position_embeddings=positions, rope_parameters=ROPES[rope])
    expected_cos, expected_sin = ThinkerRotaryEmbedding(config)(torch.zeros(()), torch.arange(positions)[None])
    cos, sin = rope_tables(config, torch.float32)
    assert cos.shape == sin.shape == (positions, config.head_dim)
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=0)
    half_cos, half_sin = rope_tables(config, torch.float16, half=True)
    assert half_cos.shape == (positions, config.head_dim // 2) and half_cos.dtype == torch.float16
    torch.testing.assert_close(half_cos, expected_cos[0, :, : config.head_dim // 2].half(), rtol=0, atol=0)
    torch.testing.assert_close(half_sin, expected_sin[0, :, : config.head_dim // 2].half(), rtol=0, atol=0)
