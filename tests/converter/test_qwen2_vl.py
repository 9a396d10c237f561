"""Qwen2-VL and Qwen2.5-VL: their text decoder converts with parity from either layout, and keeps the multimodal RoPE
in contiguous sections, so an image prompt (the model's own tower and positions) gives the model's logits through
the Thinker. Tiny checkpoints built with transformers' own classes (``tests/references/qwen2_vl.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import thinker
from references import qwen2_vl
from safetensors.torch import load_file
from torch.testing import assert_close

from converter.cli import convert_command, verify_command
from thinker import ThinkerForCausalLM
from thinker.modeling_thinker import mrope_streams

KINDS = ("qwen2_vl", "qwen2_5_vl")
TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in float32


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(kind, memory_layout=False)`` -> (source folder, Thinker folder), converted with the parity gate."""
    root = tmp_path_factory.mktemp("qwen2_vl")
    cache = {}

    def get(kind: str, memory_layout: bool = False):
        key = (kind, memory_layout)
        if key not in cache:
            source = qwen2_vl.save(root / f"{kind}-{memory_layout}", kind, memory_layout=memory_layout)
            result = thinker(source, root / f"{kind}-{memory_layout}-thinker", "--verify", command=convert_command)
            assert result.exit_code == 0 and "(qwen2_vl)" in result.output, result.output
            cache[key] = source, root / f"{kind}-{memory_layout}-thinker"
        return cache[key]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_converts_from_either_layout_with_parity(kind, converted):
    tensors = {}
    for memory_layout in (False, True):
        source, folder = converted(kind, memory_layout)
        parity = json.loads((folder / "parity.json").read_text())
        assert parity["passed"] and parity["reference"] == f"{qwen2_vl.CLASSES[kind]}ForConditionalGeneration"
        config = json.loads((folder / "config.json").read_text())
        assert config["rope_parameters"]["mrope_section"] == [4, 2, 2]
        assert config["rope_parameters"]["mrope_interleaved"] is False
        assert config["attention_bias"] and not config["attention_output_bias"]
        by_layer = thinker(source, folder, "--verify-by-layer", command=verify_command)
        assert by_layer.exit_code == 0, by_layer.output
        tensors[memory_layout] = load_file(folder / "model.safetensors")
    assert tensors[False].keys() == tensors[True].keys()
    assert all(torch.equal(tensors[False][name], tensors[True][name]) for name in tensors[False])
    assert not [name for name in tensors[False] if "visual" in name]


@pytest.mark.parametrize("kind", KINDS)
def test_an_image_prompt_gives_the_models_logits(kind, converted):
    """What the model's text decoder receives for an image prompt (its tower's embeddings, (3, B, T) positions whose
    height and width streams differ) gives its logits through the Thinker; the same positions read in the
    interleaved layout would not."""
    source, folder = converted(kind)
    model = getattr(__import__("transformers"), f"{qwen2_vl.CLASSES[kind]}ForConditionalGeneration")
    reference = model.from_pretrained(source, dtype=torch.float32).eval()
    ids, mask = qwen2_vl.image_batch()
    captured, expected = qwen2_vl.image_prompt(reference, ids, mask)
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]
    assert not torch.equal(positions[1], positions[2])
    ours = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kept = mask.bool()
    with torch.no_grad():
        logits = ours(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
        assert_close(logits[kept], expected[kept], **TOL)
        rotary = ours.model.rotary_emb
        rotary.mrope_interleaved = True  # the Qwen3 layout over the same sections
        interleaved = ours(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
    assert (interleaved[kept] - expected[kept]).abs().max() > 100 * TOL["atol"]


def test_the_stream_layouts():
    assert mrope_streams([4, 2, 2], interleaved=False).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert mrope_streams([4, 2, 2], interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def test_the_hubs_flat_config_converts(tmp_path):
    """The Hub's Qwen2-VL / Qwen2.5-VL config.json as transformers 4.x saved it: the text decoder's fields at the top
    level (no text_config), RoPE as ``rope_scaling: {"type": "mrope", ...}`` beside ``rope_theta``. transformers 5
    reads it into its text_config, and so the conversion does, with parity."""
    source = qwen2_vl.save(tmp_path / "source", "qwen2_vl")
    config = json.loads((source / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "model_type", "dtype"):
        text.pop(key, None)
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]})
    (source / "config.json").write_text(json.dumps(config))
    result = thinker(source, tmp_path / "thinker", "--verify", command=convert_command)
    assert result.exit_code == 0 and "(qwen2_vl)" in result.output, result.output
    rope = json.loads((tmp_path / "thinker" / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2], "mrope_interleaved": False}


def test_mrope_interleaved_must_be_true_or_false():
    from huggingface_hub.errors import StrictDataclassError

    from thinker import ThinkerConfig

    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": "false"}
    with pytest.raises(StrictDataclassError, match="mrope_interleaved'\\]='false'; expected true or false"):
        ThinkerConfig(hidden_size=32, num_attention_heads=4, rope_parameters=rope)


def test_the_mode_counts_the_vision_tower_the_reference_builds(tmp_path, run_convert):
    """transformers' class for the check is the whole vision-language model, its vision tower in float32 beside the
    two decoders: a budget that holds the decoders and their activations but not the tower takes the layer check."""
    from converter.convert import tensor_parameters
    from converter.engine import plan_conversion
    from converter.parity import whole_model_bytes
    from converter.parity_report import BY_LAYER
    from thinker_common.sources import open_source

    source = qwen2_vl.save(tmp_path / "source", "qwen2_vl")
    tensors = open_source(source)
    plan = plan_conversion(tensors, tensors.config(), torch.float32)
    beside = tensor_parameters(tensors) - plan.num_parameters
    tensors.close()
    assert beside > 0  # the vision tower's
    budget = whole_model_bytes(plan.num_parameters, plan.config) + 2 * beside
    assert run_convert(source, memory_budget=budget).parity.mode == BY_LAYER
