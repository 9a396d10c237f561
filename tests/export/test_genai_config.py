"""genai_config.json: the special ids come from the model's own configs; the IO names are ours."""

from __future__ import annotations

from export_helpers import make_config

from export.genai_config import SEARCH_DEFAULTS, make_genai_config


def test_special_ids_prefer_generation_config():
    config = make_config("qwen3", eos_token_id=2, pad_token_id=None, bos_token_id=None)
    genai = make_genai_config(config, {"eos_token_id": [7, 2], "bos_token_id": 5})["model"]
    assert (genai["eos_token_id"], genai["bos_token_id"], genai["pad_token_id"]) == ([7, 2], 5, 7)
    assert genai["type"] == "qwen3"
    assert genai["context_length"] == config.max_position_embeddings


def test_decoder_section_declares_the_contract():
    config = make_config("qwen2")
    genai = make_genai_config(config, None, threads=3)
    decoder = genai["model"]["decoder"]
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert (decoder["head_size"], decoder["num_key_value_heads"]) == (config.head_dim, 2)
    assert decoder["session_options"]["intra_op_num_threads"] == 3
    assert genai["search"]["do_sample"] is False and genai["search"]["past_present_share_buffer"] is False
    assert genai["model"]["type"] == "qwen2"


def test_a_model_without_eos_stops_at_its_pad_id():
    """onnxruntime-genai 0.18 refuses eos -1 (and any id outside the vocabulary); a missing key means the pad id
    in every version since 0.8. So the pad id is written, explicitly, and the report says why."""
    from export.genai_config import no_eos_note

    config = make_config("qwen3", eos_token_id=None, pad_token_id=0, bos_token_id=1)
    genai = make_genai_config(config, {"eos_token_id": None})["model"]
    assert (genai["eos_token_id"], genai["pad_token_id"], genai["bos_token_id"]) == (0, 0, 1)
    assert "no eos_token_id" in no_eos_note(config, None) and "token 0" in no_eos_note(config, None)


def test_an_eos_outside_the_vocabulary_is_no_eos_and_the_report_says_so():
    """An eos past the vocabulary is none to onnxruntime-genai, so genai_config.json stops at the pad id as for a
    missing one; the report's note must say so here too, not only for an eos left unset (a mutation run)."""
    from export.genai_config import no_eos_note

    config = make_config("qwen3", eos_token_id=5000, pad_token_id=0, bos_token_id=1)  # vocab_size 96
    assert make_genai_config(config, None)["model"]["eos_token_id"] == 0
    note = no_eos_note(config, None)
    assert note and "within its vocabulary (5000)" in note and "token 0" in note, note


def test_special_ids_outside_the_vocabulary_are_not_written():
    config = make_config("qwen3", eos_token_id=[5000, 2], pad_token_id=-1, bos_token_id=None)
    genai = make_genai_config(config, None)["model"]
    assert (genai["eos_token_id"], genai["pad_token_id"], genai["bos_token_id"]) == (2, 2, 2)
    config = make_config("qwen3", eos_token_id=None, pad_token_id=None, bos_token_id=None)
    genai = make_genai_config(config, None)["model"]
    assert all(0 <= genai[key] < config.vocab_size for key in ("eos_token_id", "pad_token_id", "bos_token_id"))


def test_a_missing_bos_is_the_eos_and_a_boolean_is_no_id():
    """No bos named: genai_config.json writes the eos, Qwen's convention and ``special_token_ids``' own rule, not the
    pad id. A boolean in generation_config.json (``true`` is an int to Python) is no token id: it falls back as a
    missing one would, and is never written as ``true`` (a mutation run found neither held)."""
    import json

    config = make_config("qwen3", eos_token_id=2, pad_token_id=0, bos_token_id=None)
    genai = make_genai_config(config, None)["model"]
    assert (genai["bos_token_id"], genai["eos_token_id"], genai["pad_token_id"]) == (2, 2, 0)
    genai = make_genai_config(config, {"bos_token_id": True})["model"]
    assert json.dumps(genai["bos_token_id"]) == "2", genai["bos_token_id"]


def test_the_model_type_follows_the_position_form():
    """A multimodal-RoPE model gets a qwen3_5 type (its (3, B, T) position code) unless exported with text positions;
    left unsaid, the form is the model's own."""
    config = make_config("qwen3_5")
    assert make_genai_config(config, None)["model"]["type"] == "qwen3_5_text"
    assert make_genai_config(config, None, positions="multimodal")["model"]["type"] == "qwen3_5_text"
    assert make_genai_config(config, None, positions="text")["model"]["type"] == "qwen3"
    moe = make_config("qwen3_5_moe")  # 0.18's own name for the MoE's text model, not the dense one's
    assert make_genai_config(moe, None)["model"]["type"] == "qwen3_5_moe_text"
    assert make_genai_config(moe, None, positions="text")["model"]["type"] == "qwen3"


def test_search_follows_generation_config_as_transformers_does():
    """The sampling a release asks for (Qwen3's card: temperature 0.6, top_p 0.95, top_k 20) is what
    onnxruntime-genai samples with by default, as transformers' generate() does; where the folder says nothing,
    greedy, with top_k 50 rather than 1 (which turned a caller's do_sample=True back into greedy)."""
    config = make_config("qwen3")
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [2]}
    search = make_genai_config(config, qwen3)["search"]
    assert {key: search[key] for key in ("do_sample", "temperature", "top_p", "top_k")} == {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    assert (search["repetition_penalty"], search["no_repeat_ngram_size"]) == (1.0, 0)
    plain = make_genai_config(config, {"repetition_penalty": 1.05, "top_k": None})["search"]
    assert (plain["do_sample"], plain["top_k"], plain["repetition_penalty"]) == (False, 50, 1.05)


def test_search_defaults_are_transformers_own():
    from transformers import GenerationConfig

    defaults = GenerationConfig()._get_default_generation_params()
    assert SEARCH_DEFAULTS == {key: defaults[key] for key in SEARCH_DEFAULTS}


def test_verify_holds_genai_config_to_the_graph(thinker_variant, onnx_variant, tmp_path):
    """From a QA sweep: genai_config.json is read by onnxruntime-genai alone, so an edited or miswritten one (a
    context past the RoPE table, a wrong input name, a shared buffer on a graph that concatenates its cache) passed
    every check. --verify reads it back against the graph it names; each edit is named by its key."""
    import json
    import shutil

    import torch

    from export.verify import verify_export

    folder = thinker_variant("qwen3", head_dim=16)
    plain = tmp_path / "plain"
    shutil.copytree(onnx_variant("qwen3", graph="plain", head_dim=16), plain)
    sound = json.loads((plain / "genai_config.json").read_text())
    result = verify_export(folder, plain / "model.onnx", torch.float32)  # as written (head_dim 16 != 32 / 4)
    assert result["passed"] is True, result.get("failure")
    from export.onnx_folder import graph_context

    past_the_table = graph_context(plain / "model.onnx")[0] + 1  # one position past: the boundary itself
    layers = sound["model"]["decoder"]["num_hidden_layers"]
    vocab, context = sound["model"]["vocab_size"], sound["model"]["context_length"]
    edits = {
        f"model.context_length {past_the_table} is past the graph's": lambda c: c["model"].update(
            context_length=past_the_table
        ),
        "model.decoder.inputs.past_key_names 'past.%d.key' names no input": lambda c: c["model"]["decoder"][
            "inputs"
        ].update(past_key_names="past.%d.key"),
        "search.past_present_share_buffer is true, but model.onnx cannot write": lambda c: c["search"].update(
            past_present_share_buffer=True
        ),
        "model.decoder.num_key_value_heads is 4, the model's num_key_value_heads 2": lambda c: c["model"][
            "decoder"
        ].update(num_key_value_heads=4),
        # the present names swapped still name outputs of the graph; genai would feed values back as keys (a QA run)
        "model.decoder.outputs.present_key_names is 'present.%d.value', where the graph's present of": lambda c: c[
            "model"
        ]["decoder"]["outputs"].update(present_key_names="present.%d.value", present_value_names="present.%d.key"),
        # each of the rest went unchecked in a mutation run: an output genai reads, the sizes it allocates by, the
        # longest search within the context, and a graph file that is not there (a traceback, not this line)
        "model.decoder.outputs.logits 'logit' names no output of model.onnx": lambda c: c["model"]["decoder"][
            "outputs"
        ].update(logits="logit"),
        f"model.decoder.num_hidden_layers is {layers + 2}, the model's num_hidden_layers {layers}": lambda c: c[
            "model"
        ]["decoder"].update(num_hidden_layers=layers + 2),
        f"model.vocab_size is {vocab // 2}, the model's {vocab}": lambda c: c["model"].update(vocab_size=vocab // 2),
        f"search.max_length {context + 1} is past model.context_length {context}": lambda c: c["search"].update(
            max_length=context + 1
        ),
        "model.decoder.filename 'gone.onnx' is not a graph in the folder": lambda c: c["model"]["decoder"].update(
            filename="gone.onnx"
        ),
    }
    for said, edit in edits.items():
        config = json.loads(json.dumps(sound))
        edit(config)
        (plain / "genai_config.json").write_text(json.dumps(config))
        result = verify_export(folder, plain / "model.onnx", torch.float32)
        assert result["passed"] is False and f"genai_config.json: {said}" in result["failure"], result.get("failure")
        assert result["max_abs_diff"] <= result["tolerance"]  # every prompt passes
    # a hybrid's linear-attention state names swapped: both still name outputs of the graph (a mutation run)
    folder = thinker_variant("qwen3_5")
    hybrid = tmp_path / "hybrid"
    shutil.copytree(onnx_variant("qwen3_5", graph="plain", head_dim=None), hybrid)
    config = json.loads((hybrid / "genai_config.json").read_text())
    outputs = config["model"]["decoder"]["outputs"]
    outputs["present_conv_names"], outputs["present_recurrent_names"] = (
        outputs["present_recurrent_names"],
        outputs["present_conv_names"],
    )
    (hybrid / "genai_config.json").write_text(json.dumps(config))
    result = verify_export(folder, hybrid / "model.onnx", torch.float32)
    said = "model.decoder.outputs.present_conv_names is 'present.%d.recurrent_state', where the graph's present of"
    assert result["passed"] is False and f"genai_config.json: {said}" in result["failure"], result.get("failure")


def test_greedy_search_keeps_valid_sampling_values_and_drops_what_it_never_reads():
    """generate() runs a greedy generation_config.json whatever its temperature, top_k and top_p (it builds no
    sampling warper): a value onnxruntime-genai cannot take gets the default in its place, where it refused the
    export (a QA run); a valid one stays, so a caller who turns sampling on samples as generate() would."""
    from export.genai_config import search_options

    kept = search_options({"do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    assert (kept["temperature"], kept["top_p"], kept["top_k"]) == (0.7, 0.8, 20)
    dropped = search_options({"temperature": 0.0, "top_p": 0.0, "top_k": -1})
    assert (dropped["temperature"], dropped["top_p"], dropped["top_k"]) == (1.0, 1.0, 50)
    assert dropped["do_sample"] is False


def test_max_length_follows_generation_config_within_the_context():
    """generate() stops at generation_config.json's max_length (Llama 3's releases: 4096 of 8192 positions), so
    onnxruntime-genai does too by default (it wrote the context, a QA run found); within the context; not where a
    max_new_tokens, which generate() follows instead, names a length past each prompt genai_config.json cannot say."""
    import pytest

    from export.genai_config import search_max_length
    from thinker_common.errors import ThinkerError

    config = make_config("qwen3")
    context = make_genai_config(config, None)["model"]["context_length"]
    assert make_genai_config(config, None)["search"]["max_length"] == context
    assert make_genai_config(config, {"max_length": context - 24})["search"]["max_length"] == context - 24
    assert make_genai_config(config, {"max_length": context + 1})["search"]["max_length"] == context
    assert make_genai_config(config, {"max_length": 40, "max_new_tokens": 8})["search"]["max_length"] == context
    for wrong in (0, -1, 2.5, "40", True):
        with pytest.raises(ThinkerError, match=r"generation_config.json: max_length=.* whole number above 0"):
            search_max_length({"max_length": wrong}, context)


def test_no_search_keys_are_checked_where_no_genai_config_is_written(tmp_path):
    """Qwen3.8's export writes no genai_config.json, so its generation_config.json's search keys are not refused."""
    import json

    import pytest

    from export.genai_config import check_search
    from thinker_common.errors import ThinkerError

    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"max_length": 0}))
    check_search(path, make_config("qwen4_exp"))
    with pytest.raises(ThinkerError, match="max_length=0"):
        check_search(path, make_config("qwen3"))
