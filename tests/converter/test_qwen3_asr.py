"""Qwen3-ASR: the text decoder of a tiny ``Qwen3ASRForConditionalGeneration`` (transformers' class: audio tower,
projector, Qwen3 decoder, tied head; ``tests/references/qwen3_asr.py``) converts with parity, whole and layer by
layer; and an audio prompt (the tower's own frames at the audio tokens) gives the reference's logits and greedy
transcript through the Thinker."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import thinker
from references import qwen3_asr
from references.hybrid import capture_language_model_inputs
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from converter.cli import convert_command, verify_command
from thinker import ThinkerForCausalLM

TOL = dict(atol=1e-4, rtol=0)  # max |Δlogit| in float32


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    """(source, Thinker folder): the checkpoint, converted through the command line with its parity gate."""
    root = tmp_path_factory.mktemp("qwen3_asr")
    source = qwen3_asr.save(root / "source")
    result = thinker(source, root / "thinker", "--verify", command=convert_command)
    assert result.exit_code == 0 and "(qwen3_asr)" in result.output, result.output
    # what was left out, said on the way and in the card
    assert "left out (" in result.output and "model.multi_modal_projector.* (4 tensors)" in result.output
    card = (root / "thinker" / "README.md").read_text()
    assert "## Left out" in card and "`model.audio_tower.*`" in card and "as `inputs_embeds`" in card
    return source, root / "thinker"


def test_the_checkpoint_converts_with_parity(asr):
    source, folder = asr
    parity = json.loads((folder / "parity.json").read_text())
    assert parity["passed"] and parity["reference"] == "Qwen3ASRForConditionalGeneration"
    config = json.loads((folder / "config.json").read_text())
    assert config["qk_norm"] and config["tie_word_embeddings"] and "mrope_section" not in config["rope_parameters"]
    # the outer config's special ids, which the text config lacks and generate stops on
    assert config["eos_token_id"] == qwen3_asr.EOS and config["pad_token_id"] == qwen3_asr.PAD
    names = load_file(folder / "model.safetensors").keys()
    assert "lm_head.weight" not in names and not [n for n in names if "audio" in n or "projector" in n]
    by_layer = thinker(source, folder, "--verify-by-layer", command=verify_command)
    assert by_layer.exit_code == 0 and "parity (layer-by-layer)" in by_layer.output, by_layer.output


def test_there_is_no_way_back(asr, tmp_path):
    """A Thinker folder has no audio tower: written as qwen3_asr it would be incomplete, so ``--to`` refuses it."""
    _, folder = asr
    refused = thinker(folder, tmp_path / "back", "--to", "qwen3_asr", command=convert_command)
    assert refused.exit_code == 1 and "cannot be written back as qwen3_asr" in refused.output
    assert not (tmp_path / "back").exists()


def test_another_releases_layout_is_refused_by_name(asr, tmp_path):
    """A config with a ``thinker_config`` where transformers' class reads a ``text_config`` (and ``thinker.*``
    tensors): not a layout transformers loads, said so, where it was told its tensor names matched no layout."""
    source, _ = asr
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["thinker_config"] = {"text_config": config.pop("text_config"), "audio_config": config.pop("audio_config")}
    (other / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "thinker.", 1): value for name, value in load_file(source / "model.safetensors").items()
    }
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    refused = thinker(other, tmp_path / "out", "--no-verify", command=convert_command)
    assert (
        refused.exit_code == 1
        and "holds a thinker_config where transformers' Qwen3ASRConfig reads a text_config" in refused.output
    )
    assert not (tmp_path / "out").exists()


@torch.no_grad()
def test_an_audio_prompt_gives_the_references_logits_and_transcript(asr):
    """The projected audio frames the reference scatters into its embeddings, fed as ``inputs_embeds``, give its
    logits and its greedy continuation (prefill, then decode steps on the Thinker's own cache)."""
    source, folder = asr
    reference = qwen3_asr.load_reference(source)
    ids, audio = qwen3_asr.audio_prompt(reference)
    captured = capture_language_model_inputs(reference)
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids), **audio).logits
    embeds = captured["inputs_embeds"]
    text_rows = reference.get_input_embeddings()(ids)
    audio_rows = ids[0] == qwen3_asr.AUDIO_TOKEN
    assert audio_rows.sum() > 10 and not torch.equal(embeds[0, audio_rows], text_rows[0, audio_rows])
    ours = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_close(ours(inputs_embeds=embeds).logits, expected, **TOL)

    transcript = reference.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **audio)[:, ids.shape[1] :]
    ours_transcript = ours.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours_transcript, transcript)
