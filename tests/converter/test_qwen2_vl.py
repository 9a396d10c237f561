"""Qwen2-VL and Qwen2.5-VL: their text decoder converts with parity from either layout, and keeps the multimodal RoPE
in contiguous sections, so an image prompt (the model's own tower and positions) gives the model's logits through
the Thinker. Tiny checkpoints built with transformers' own classes (``tests/references/qwen2_vl.py``)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from cli_helpers import thinker
from convert_helpers import class_mrope_streams
from references import qwen2_vl
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from converter.cli import convert_command, verify_command
from converter.engine import plan_conversion, translate_config
from converter.families.qwen2_vl import QWEN2_VL
from thinker import ThinkerForCausalLM
from thinker.modeling_thinker import mrope_streams
from thinker_common.sources import SafetensorsSource

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


@pytest.mark.parametrize("kind", KINDS)
def test_without_mrope_section_a_head_of_128_takes_the_classs_fallback(kind):
    """A config.json that names no mrope_section, on the releases' head of 128: the class falls back to a section
    of its own (``Qwen2VLRotaryEmbedding``: [16, 24, 24], in contiguous sections), read here from the class itself.
    The translated config gives every frequency the position stream the class gives it."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": 1e6}  # no mrope_section
    text = qwen2_vl.TEXT_CONFIG | {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_parameters": rope,
    }
    hf = getattr(transformers, f"{qwen2_vl.CLASSES[kind]}Config")(
        text_config=text, vision_config=qwen2_vl.VISION_CONFIGS[kind]
    )
    assert "mrope_section" not in hf.text_config.rope_parameters
    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    rotary = getattr(modeling, f"{qwen2_vl.CLASSES[kind]}RotaryEmbedding")(hf.text_config)
    assert rotary.inv_freq.numel() == 64

    ours = translate_config(QWEN2_VL, hf.to_dict(), torch.float32).rope_parameters
    assert ours["mrope_section"] == rotary.mrope_section and ours["mrope_interleaved"] is False
    assert torch.equal(mrope_streams(ours["mrope_section"], ours["mrope_interleaved"]), class_mrope_streams(rotary))


def test_without_mrope_section_a_head_the_fallback_does_not_fit_converts(tmp_path):
    """The class's fallback section [16, 24, 24] has 64 frequencies, a head of 128's; this head of 16 has 8, so the
    fallback cannot be what the class runs on 3-D positions. Such a config.json still converts, without a section
    (exact on text, where every section reads the same position), rather than being refused for a section it
    never named."""
    source = qwen2_vl.save(tmp_path / "source", "qwen2_vl")
    config = json.loads((source / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_section"]
    (source / "config.json").write_text(json.dumps(config))
    plan = plan_conversion(SafetensorsSource(source), config)
    assert plan.family.name == "qwen2_vl"
    assert "mrope_section" not in plan.config.rope_parameters and "mrope_interleaved" not in plan.config.rope_parameters


@pytest.mark.parametrize("memory_layout", [False, True], ids=["hub-layout", "memory-layout"])
def test_rotary_buffers_older_transformers_saved_are_dropped(memory_layout, tmp_path):
    """Checkpoints saved by older transformers hold each attention's ``rotary_emb.inv_freq``, a buffer the model
    computes from its config: they convert, those buffers dropped on purpose and listed as such."""
    source = qwen2_vl.save(tmp_path / "source", "qwen2_vl", memory_layout=memory_layout)
    path = source / "model.safetensors"
    tensors = load_file(path)
    buffers = [
        name.replace("q_proj.weight", "rotary_emb.inv_freq") for name in tensors if name.endswith("q_proj.weight")
    ]
    assert len(buffers) == qwen2_vl.TEXT_CONFIG["num_hidden_layers"]
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, 16, 2).float() / 16)
    save_file(tensors | {name: inv_freq.clone() for name in buffers}, path, metadata={"format": "pt"})
    plan = plan_conversion(SafetensorsSource(source), json.loads((source / "config.json").read_text()))
    assert set(buffers) <= set(plan.dropped) and not set(buffers) & set(plan.shapes)


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
