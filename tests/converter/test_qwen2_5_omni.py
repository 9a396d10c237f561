"""Qwen2.5-Omni: the thinker's text decoder out of a tiny full checkpoint (thinker with audio and vision towers,
talker, token2wav; ``tests/references/qwen2_5_omni.py``) or the thinker saved alone converts with parity, whole and
layer by layer, to the same tensors, and a prompt holding audio and an image (the thinker's own towers and positions)
gives the thinker's logits through the Thinker."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import thinker
from click.testing import CliRunner
from references import qwen2_5_omni
from references.hybrid import capture_language_model_inputs
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from converter.cli import convert_command, verify_command
from thinker import ThinkerForCausalLM

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in float32


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(source, Thinker folder): the full checkpoint, converted through the command line with its parity gate."""
    root = tmp_path_factory.mktemp("qwen2_5_omni")
    source = qwen2_5_omni.save(root / "source")
    result = thinker(source, root / "thinker", "--verify", command=convert_command)
    assert result.exit_code == 0 and "(qwen2_5_omni)" in result.output, result.output
    return source, root / "thinker"


def test_the_full_checkpoint_converts_with_parity(omni):
    source, folder = omni
    parity = json.loads((folder / "parity.json").read_text())
    assert parity["passed"] and parity["reference"] == "Qwen2_5OmniThinkerForConditionalGeneration"
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["rope_parameters"]["mrope_section"] == [4, 2, 2] and not config["rope_parameters"]["mrope_interleaved"]
    )
    assert config["attention_bias"] and not config["attention_output_bias"]
    names = load_file(folder / "model.safetensors").keys()
    assert not [name for name in names if any(part in name for part in ("audio", "visual", "talker", "token2wav"))]
    by_layer = thinker(source, folder, "--verify-by-layer", command=verify_command)
    assert by_layer.exit_code == 0 and "parity (layer-by-layer)" in by_layer.output, by_layer.output


@pytest.mark.parametrize("loaded_from", ["full checkpoint", "its own build"])
def test_the_thinker_saved_alone_converts_to_the_same_thinker(loaded_from, omni, tmp_path):
    source, folder = omni
    alone = tmp_path / "thinker"
    if loaded_from == "full checkpoint":
        qwen2_5_omni.load_reference_thinker(source).save_pretrained(alone)
    else:
        qwen2_5_omni.build().thinker.save_pretrained(alone)  # build() is seeded: the weights the source holds
    assert json.loads((alone / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    result = thinker(alone, tmp_path / "out", "--verify", command=convert_command)
    assert result.exit_code == 0 and "(qwen2_5_omni_thinker)" in result.output, result.output
    ours, full = load_file(tmp_path / "out" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert ours.keys() == full.keys() and all(torch.equal(ours[name], full[name]) for name in ours)


@torch.no_grad()
def test_an_audio_and_image_prompt_gives_the_thinkers_logits(omni):
    """Audio and image embeddings (no deepstack: nothing but ``inputs_embeds`` enters the decoder) at the thinker's
    own (3, B, T) positions, whose streams differ over the image, give its logits."""
    source, folder = omni
    reference = qwen2_5_omni.load_reference_thinker(source)
    ids, inputs = qwen2_5_omni.audio_and_image_prompt(reference)
    captured = capture_language_model_inputs(reference)
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits
    embeds, positions = captured["inputs_embeds"], captured["position_ids"]
    assert not torch.equal(positions[1], positions[2])
    ours = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_close(ours(inputs_embeds=embeds, position_ids=positions).logits, expected, **TOL)


def test_the_thinker_configs_own_settings_are_read(omni, tmp_path):
    """What a config declares on thinker_config rather than its text_config: the special ids are taken from there,
    and an untied head's absence names thinker_config's tie, the one transformers follows."""
    source, _ = omni
    config = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config["thinker_config"]["text_config"].pop(key, None)
    config["thinker_config"].update(bos_token_id=2, eos_token_id=7, pad_token_id=3)
    ids = tmp_path / "ids"
    shutil.copytree(source, ids)
    (ids / "config.json").write_text(json.dumps(config))
    result = thinker(ids, tmp_path / "ids-thinker", "--no-verify", command=convert_command)
    assert result.exit_code == 0, result.output
    converted = json.loads((tmp_path / "ids-thinker" / "config.json").read_text())
    assert (converted["bos_token_id"], converted["eos_token_id"], converted["pad_token_id"]) == (2, 7, 3)

    # the thinker saved alone, its ids on its own (the thinker) config
    alone = tmp_path / "alone"
    qwen2_5_omni.load_reference_thinker(ids).save_pretrained(alone)
    config = json.loads((alone / "config.json").read_text())
    assert config["eos_token_id"] == 7 and config["text_config"].get("eos_token_id") is None
    result = thinker(alone, tmp_path / "alone-thinker", "--no-verify", command=convert_command)
    assert result.exit_code == 0 and "(qwen2_5_omni_thinker)" in result.output, result.output
    converted = json.loads((tmp_path / "alone-thinker" / "config.json").read_text())
    assert (converted["bos_token_id"], converted["eos_token_id"], converted["pad_token_id"]) == (2, 7, 3)

    headless = tmp_path / "headless"
    shutil.copytree(source, headless)
    tensors = load_file(headless / "model.safetensors")
    del tensors["thinker.lm_head.weight"]
    save_file(tensors, headless / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(convert_command, [str(headless), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "untied output head (thinker_config.tie_word_embeddings=false)" in result.output
    assert "set thinker_config.tie_word_embeddings to true" in result.output
