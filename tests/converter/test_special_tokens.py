"""The parity gate holds the special-token ids to the reference's (``converter/special_tokens.py``): no logit shows
them, so an eos read from the bos key computed every logit exactly, passed the gate and ``thinker verify`` (which
translates the source again with the same code), and stopped generation at the wrong token (a mutation run)."""

from __future__ import annotations

import json

import pytest
from convert_helpers import build_reference, edit_config, write_gguf
from transformers import LlamaConfig, Qwen2Config

from converter.families import gguf
from converter.parity import check_parity
from converter.parity_report import BY_LAYER, WHOLE_MODEL, ParityFailed

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=128)
IDS = {"bos_token_id": 3, "eos_token_id": 5, "pad_token_id": 7}


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_an_eos_not_the_references_fails_the_gate(mode, save_reference, run_convert):
    _, source = save_reference(Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2, **IDS))
    converted = run_convert(source, verify=False).output
    assert check_parity(source, converted, mode=mode).passed  # the sound conversion

    edit_config(converted, eos_token_id=3)  # the bos id, as a translation reading the wrong key writes it
    report = check_parity(source, converted, mode=mode)
    assert all(result.passed for result in report.results)  # every logit as exact as before
    assert report.special_tokens == ["eos_token_id ([5] -> [3])"] and not report.passed
    assert "special tokens: FAIL, not the reference's: eos_token_id ([5] -> [3])" in report.table()
    assert json.loads(report.to_json())["passed"] is False


def test_a_gguf_files_ids_are_read_by_transformers_for_the_gate(tmp_path, run_convert, monkeypatch):
    """The reference's ids are transformers' reading of the file's ``tokenizer.ggml`` keys, not the converter's:
    the converter's table with bos and eos swapped is refused, naming both."""
    model = build_reference(LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2))
    (tmp_path / "gguf").mkdir()
    metadata = {f"tokenizer.ggml.{key.replace('pad_', 'padding_')}": value for key, value in IDS.items()}
    path = write_gguf(model, tmp_path / "gguf" / "tiny.gguf", "llama", metadata=metadata)
    written = json.loads((run_convert(path).output / "config.json").read_text())
    assert {key: written[key] for key in IDS} == IDS

    table = gguf._token_id_keys()
    swapped = {"bos_token_id": "eos_token_id", "eos_token_id": "bos_token_id", "pad_token_id": "pad_token_id"}
    monkeypatch.setattr(gguf, "_token_id_keys", lambda: {key: swapped[field] for key, field in table.items()})
    with pytest.raises(ParityFailed, match=r"special token ids not the reference's: bos_token_id \(3 -> 5\), "):
        run_convert(path, "swapped")
    assert not (tmp_path / "swapped").exists()


@pytest.mark.parametrize("mode", [WHOLE_MODEL, BY_LAYER])
def test_an_id_the_source_names_is_compared_even_at_its_classs_default(mode, save_reference, run_convert):
    """A llama folder naming bos 1 and eos 2, LlamaConfig's own defaults (Llama 2's and the real SmolLM2's ids):
    a conversion that drops them is refused. The rule that spares a reference id held only as the class default
    spared these too (a review)."""
    _, source = save_reference(LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2))
    assert {
        key: json.loads((source / "config.json").read_text()).get(key) for key in ("bos_token_id", "eos_token_id")
    } == {"bos_token_id": 1, "eos_token_id": 2}
    converted = run_convert(source, verify=False).output
    edit_config(converted, bos_token_id=None, eos_token_id=None)
    report = check_parity(source, converted, mode=mode)
    assert report.special_tokens == ["bos_token_id (1 -> None)", "eos_token_id ([2] -> None)"], report.special_tokens


@pytest.mark.parametrize(
    "ids",
    [{"outer": {"eos_token_id": 9}}, {"outer": {"eos_token_id": 9}, "text": {"eos_token_id": 7, "bos_token_id": 6}}],
    ids=["on the outer config alone", "on both, differing"],
)
def test_a_vision_language_models_ids_are_the_ones_its_generate_takes(ids, tmp_path, run_convert):
    """transformers' generate takes a Qwen3-VL model's ids from its outer config where that names them, else from
    its text config (``GenerationConfig.from_model_config``). The converter read the text config's alone: an eos on
    the outer config alone was dropped, and the gate refused the conversion (a review)."""
    from references import qwen3_vl

    source = qwen3_vl.save(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    config |= ids["outer"]
    config["text_config"] |= ids.get("text", {})
    (source / "config.json").write_text(json.dumps(config))
    written = json.loads((run_convert(source).output / "config.json").read_text())
    assert written["eos_token_id"] == 9  # the outer config's, as generate stops
    assert written["bos_token_id"] == ids.get("text", {}).get(
        "bos_token_id"
    )  # the text config's where it alone names it
