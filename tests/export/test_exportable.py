"""What ``thinker export`` takes and what it refuses, before any byte is written (``check_exportable``): partial
rotary is exported by both graphs and matches PyTorch; RoPE types whose tables change with the context length, and
a linear-attention conv activation the graphs do not write, are refused with a one-line reason."""

from __future__ import annotations

import pytest
import torch
from export_helpers import save_thinker

from export.exporter import export_model
from export.runtime import OnnxDecoder
from export.verify import compare_decoders
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch

PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_partial_rotary_matches_pytorch(graph, tmp_path):
    """A dense Qwen3 whose RoPE rotates 8 of each head's 16 channels."""
    from thinker import ThinkerForCausalLM

    folder = save_thinker(tmp_path / "thinker", "qwen3", head_dim=16, rope_parameters=PARTIAL)
    export_model(folder, tmp_path / "onnx", verify=False, graph=graph)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    figures = compare_decoders(model, OnnxDecoder(tmp_path / "onnx", provider="cpu"), *parity_batch(96))
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"]), figures


REFUSED = [
    (
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        r"rope_type='dynamic' recomputes its frequencies as the context grows",
    ),
    (
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 6,
                "long_factor": [2.0] * 6,
                "original_max_position_embeddings": 32,
            }
        ),
        r"rope_type='longrope' recomputes its frequencies",
    ),
    (
        dict(layer_types=["linear_attention", "full_attention", "full_attention"], hidden_act="gelu"),
        r"hidden_act='gelu' with linear_attention layers: .* silu / swish only",
    ),
    (
        dict(head_dim=16, rope_parameters={**PARTIAL, "partial_rotary_factor": 1.25}),
        r"partial_rotary_factor=1.25 rotates 20 channels of a head of head_dim=16; it must be at most 1",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "message"), REFUSED, ids=["dynamic", "longrope", "linear-gelu", "rotary-above-1"]
)
def test_unsupported_configs_are_refused(overrides, message, tmp_path):
    folder = save_thinker(tmp_path / "thinker", "qwen3", tokenizer=False, **overrides)
    with pytest.raises(ThinkerError, match=message):
        export_model(folder, tmp_path / "onnx", verify=False)
    assert not (tmp_path / "onnx").exists() and [p.name for p in tmp_path.iterdir()] == ["thinker"]


def test_a_source_the_graphs_cannot_build_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    """A Hugging Face Qwen3 folder with dynamic RoPE: `thinker export SOURCE` names its config.json and converts
    nothing (a conversion begun would fail on the missing write_weights)."""
    from click.testing import CliRunner
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import converter.convert
    from thinker_common.cli import main

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_parameters=rope)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "source")
    monkeypatch.setattr(converter.convert, "write_weights", None)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "source"), str(tmp_path / "onnx")])
    assert result.exit_code == 1 and not (tmp_path / "onnx").exists(), result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"error: {tmp_path / 'source' / 'config.json'}: rope_parameters rope_type='dynamic'")
