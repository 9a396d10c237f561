"""genai_config.json's fields as onnxruntime-genai reads them (the special ids, the search keys refused by key, the
qwen3_5 types' vision ids, a stretched RoPE context) and --verify's reading of it (state names, max_length, a folder
without one), held where a mutation run of export/genai_config.py and export/genai_config_check.py found each
changeable without a failing test."""

from __future__ import annotations

import pytest
from export_helpers import make_config

from export.genai_config import make_genai_config, no_eos_note, search_options
from thinker_common.errors import ThinkerError

VISION_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id")


def special_ids(config, generation_config=None) -> tuple:
    model = make_genai_config(config, generation_config)["model"]
    return model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]


def test_an_eos_of_exactly_the_vocabulary_size_is_no_eos():
    """The first id past the vocabulary (vocab_size itself) is no token: onnxruntime-genai 0.18 refuses it as it does
    5000, so genai_config.json stops at the pad id and the report's note says so."""
    config = make_config("qwen3", eos_token_id=96, pad_token_id=0, bos_token_id=1)
    assert config.vocab_size == 96
    assert special_ids(config) == (1, 0, 0)
    note = no_eos_note(config, None)
    assert note and "within its vocabulary (96)" in note and "token 0" in note, note
    assert special_ids(make_config("qwen3", eos_token_id=95, pad_token_id=96, bos_token_id=96)) == (95, 95, 95)


def test_generation_configs_id_zero_is_taken_over_config_jsons():
    """0 is a token (many vocabularies' pad or eos): generation_config.json naming it wins over config.json, as for
    any other id, rather than reading as "not given"."""
    config = make_config("qwen3", eos_token_id=2, pad_token_id=5, bos_token_id=1)
    assert special_ids(config, {"eos_token_id": 0, "pad_token_id": 0, "bos_token_id": 0}) == (0, 0, 0)
    assert special_ids(config, {"pad_token_id": 0}) == (1, 2, 0)


def test_a_model_with_neither_eos_nor_pad_stops_and_pads_at_its_bos():
    """No eos and no pad within the vocabulary: the pad is the bos (then the eos written in its place), not token 0,
    which the model never named."""
    config = make_config("qwen3", eos_token_id=None, pad_token_id=None, bos_token_id=7)
    assert special_ids(config) == (7, 7, 7)
    note = no_eos_note(config, None)
    assert note and "token 7 (its pad id)" in note, note


def test_a_missing_bos_is_the_first_of_several_eos_ids():
    """Qwen3's generation_config.json lists [151645, 151643]; with no bos anywhere, the first is written."""
    config = make_config("qwen3", eos_token_id=None, pad_token_id=3, bos_token_id=None)
    assert special_ids(config, {"eos_token_id": [7, 2]}) == (7, [7, 2], 3)


@pytest.mark.parametrize(
    ("key", "value"),
    [("no_repeat_ngram_size", 1.5), ("no_repeat_ngram_size", -1), ("do_sample", 1), ("do_sample", 0)],
)
def test_search_values_genai_reads_by_type_are_refused_by_key(key, value):
    """no_repeat_ngram_size is a count and do_sample a JSON boolean: 1.5, -1, 0 and 1 are refused by key, never
    written into genai_config.json."""
    with pytest.raises(ThinkerError) as refused:
        search_options({key: value})
    assert str(refused.value).startswith(f"generation_config.json: {key}={value!r} is not a value generate() takes")
    assert str(refused.value).endswith("correct it in the Thinker folder and export again")


def test_the_moe_multimodal_type_gets_every_vision_token_id_as_none():
    """qwen3_5_moe_text's position code scans prompts for the vision ids as qwen3_5_text's does: each is -1, where
    the pad id 0 they default to opens spans in a padded batch; a type with (B, T) positions gets none of them."""
    model = make_genai_config(make_config("qwen3_5_moe"), None, positions="multimodal")["model"]
    assert model["type"] == "qwen3_5_moe_text"
    assert {key: model[key] for key in VISION_KEYS} == dict.fromkeys(VISION_KEYS, -1)
    text = make_genai_config(make_config("qwen3_5_moe"), None, positions="text")["model"]
    assert text["type"] == "qwen3" and not set(VISION_KEYS) & set(text)


def test_a_state_name_is_the_graphs_where_only_the_last_layer_has_it(tmp_path):
    """A hybrid's KV names exist for its attention layers only; where that is the last layer alone, the names are the
    graph's all the same (--verify refused a sound export). Names that exist only past the last layer are none."""
    from test_folder_checks import genai_folder

    from export.genai_config_check import genai_config_failures

    hybrid = make_config("qwen3_5")
    last = hybrid.num_hidden_layers - 1
    (tmp_path / "last").mkdir()
    assert genai_config_failures(genai_folder(tmp_path / "last", hybrid, kv_layers=[last]), hybrid, 128) == []
    (tmp_path / "past").mkdir()
    failures = genai_config_failures(genai_folder(tmp_path / "past", hybrid, kv_layers=[last + 1]), hybrid, 128)
    assert (
        "genai_config.json: model.decoder.inputs.past_key_names 'past_key_values.%d.key' names no input of "
        "model.onnx" in failures
    ), failures


def test_the_longest_search_is_held_to_the_files_own_context_not_the_graphs_rows(tmp_path):
    """A context_length short of the graph's rows bounds search.max_length by itself: one past it is refused though
    the graph has the rows."""
    from test_folder_checks import genai_folder

    from export.genai_config_check import genai_config_failures

    config = make_config("qwen3")

    def edit(genai):
        genai["model"]["context_length"], genai["search"]["max_length"] = 40, 41

    assert genai_config_failures(genai_folder(tmp_path, config, genai_edit=edit), config, 64) == [
        "genai_config.json: search.max_length 41 is past model.context_length 40"
    ]


def test_a_folder_without_genai_config_has_nothing_to_check(tmp_path):
    """Qwen3.8's export writes no genai_config.json: --verify finds nothing wrong with the file it does not have."""
    from export.genai_config_check import genai_config_failures

    (tmp_path / "model.onnx").write_bytes(b"")
    assert genai_config_failures(tmp_path, make_config("qwen3"), 64) == []


def test_a_stretched_rope_context_is_the_files_context_and_longest_search():
    """YaRN's factor 4 over 64 trained positions: the graph's RoPE tables hold 256 rows (export_context), and
    genai_config.json gives onnxruntime-genai all of them, as context_length and as the default max_length."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config = make_config("qwen3", rope_parameters=rope)
    assert config.max_position_embeddings == 64
    genai = make_genai_config(config, None)
    assert (genai["model"]["context_length"], genai["search"]["max_length"]) == (256, 256)
    assert make_genai_config(config, {"max_length": 200})["search"]["max_length"] == 200
