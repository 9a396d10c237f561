"""What convert() does that the other tests pass through without pinning: the weights line of a folder whose every
tensor keeps the source's wider dtype, a mistyped memory setting that only a check reads, and OUTPUT inside the
folder a GGUF is picked from (``gguf_file``), which is checked once the source is resolved."""

from __future__ import annotations

import json
import shutil

import pytest

from converter import parity
from converter.convert import convert, verify
from thinker_common.errors import ThinkerError


def test_float32_weights_under_a_config_declaring_bfloat16_are_all_kept_and_said_so(qwen3_source, tmp_path):
    """``--dtype auto`` follows config.json's bfloat16 but keeps every float32 tensor as stored: the weights line
    names float32 as the weights' dtype and bfloat16 as the config's (not "bfloat16 weights, N tensors kept")."""
    source = shutil.copytree(qwen3_source, tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    result = convert(source, tmp_path / "out", verify=False, progress=False)
    assert len(result.kept) == result.tensors > 0 and set(result.kept.values()) == {"float32"}
    assert result.weights().endswith(
        " MiB of float32 weights, as the source stores them (config.json's dtype: bfloat16, as the source's)"
    ), result.weights()


def test_a_mistyped_memory_setting_does_not_stop_a_conversion_that_runs_no_check(qwen3_source, tmp_path, monkeypatch):
    """THINKER_VERIFY_MEMORY sizes the check only: with ``verify=False`` it is never read, so a mistyped value does
    not refuse the conversion; with the check (the default) it is refused before anything is written."""
    monkeypatch.setenv(parity.MEMORY_BUDGET_ENV, "lots")
    result = convert(qwen3_source, tmp_path / "out", verify=False, progress=False)
    assert result.parity is None and (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(ThinkerError, match="^THINKER_VERIFY_MEMORY='lots': "):
        convert(qwen3_source, tmp_path / "checked", progress=False)
    assert not (tmp_path / "checked").exists()


def test_output_inside_the_folder_a_gguf_file_is_picked_from_is_refused(qwen3_source, tmp_path):
    """With ``gguf_file`` the source is the GGUF named in SOURCE's folder, known only once resolved: an OUTPUT named
    like a file read with it (tokenizer.json beside it) is refused then, before anything is written."""
    from convert_helpers import write_gguf
    from transformers import Qwen3ForCausalLM

    folder = tmp_path / "ggufs"
    folder.mkdir()
    gguf = write_gguf(Qwen3ForCausalLM.from_pretrained(qwen3_source), folder / "tiny.gguf", "qwen3")
    output = folder / "tokenizer.json"
    with pytest.raises(ThinkerError) as refused:
        convert(folder, output, verify=False, progress=False, gguf_file="tiny.gguf")
    assert str(refused.value) == (
        f"{output}: OUTPUT lies inside the source {folder} (a file the conversion reads, or a folder among them); "
        "choose a folder outside it"
    )
    assert sorted(path.name for path in folder.iterdir()) == [gguf.name]


def test_the_card_of_a_qwen4_exp_conversion_says_why_no_genai_config_is_written(tmp_path):
    """Qwen4-Exp's additions have state onnxruntime-genai has no model type for: the card's export line names them
    and says no genai_config.json is written (not "for onnxruntime and onnxruntime-genai")."""
    from references.hybrid import reference
    from references.qwen4_exp import qwen4_exp_config
    from transformers import Qwen4ExpForCausalLM

    from thinker import ThinkerConfig

    reference(Qwen4ExpForCausalLM, qwen4_exp_config()).save_pretrained(tmp_path / "source")
    convert(tmp_path / "source", tmp_path / "out", verify=False, progress=False)
    features = ThinkerConfig.from_pretrained(tmp_path / "out").qwen4_exp_features
    assert features
    card = (tmp_path / "out" / "README.md").read_text()
    assert (
        "`thinker export out ONNX_FOLDER` writes it as an ONNX decoder for onnxruntime (`thinker generate`, "
        "`export.runtime.OnnxDecoder`); onnxruntime-genai has no model type for the state of its "
        f"{', '.join(features)}, so no genai_config.json is written."
    ) in card
    assert "for onnxruntime and onnxruntime-genai" not in card


def test_the_card_of_a_deepstack_model_says_how_its_features_reach_the_decoder(tmp_path):
    """A Qwen3-VL source's vision tower is left out; its DeepStack features go into the decoder's first layers, so
    the card's left-out section names the arguments that carry them."""
    from references import qwen3_vl

    source = qwen3_vl.save(tmp_path / "source")
    result = convert(source, tmp_path / "out", verify=False, progress=False)
    assert (
        "left out (the source's parts beside its text decoder, README.md says more): model.visual.* (27 tensors)"
        in (result.notes)
    )
    card = (tmp_path / "out" / "README.md").read_text()
    assert (
        ", and an image or video's DeepStack features as the source model hands them to its text decoder, "
        "`visual_pos_masks=` and `deepstack_visual_embeds=`; `thinker export --inputs-embeds` writes"
    ) in card


def test_verify_puts_its_figures_into_the_card_of_a_folder_converted_unchecked(qwen3_source, qwen3_thinker, tmp_path):
    """A folder converted with --no-verify says so in its card; ``thinker verify`` passing replaces that line with
    the check's figures (the card is this tool's, unchanged since it was written)."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    assert "Not checked: converted with --no-verify." in (folder / "README.md").read_text()
    report = verify(qwen3_source, folder)
    assert report.passed
    card = (folder / "README.md").read_text()
    assert "Not checked: converted with --no-verify." not in card
    assert "Checked against " in card and "are in `parity.json`." in card


def test_verify_refuses_a_report_in_a_folder_below_converted(qwen3_source, qwen3_thinker, tmp_path):
    """``--report`` leaves CONVERTED as it is: a report path in a folder inside it, at any depth, is refused before
    the check runs."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    (folder / "reports").mkdir()
    report = folder / "reports" / "parity.json"
    with pytest.raises(ThinkerError) as refused:
        verify(qwen3_source, folder, report_path=report)
    assert str(refused.value) == (
        f"--report {report}: inside CONVERTED {folder}, which --report leaves as it is; name a file outside it (or "
        "leave --report out to write parity.json into it)"
    )
    assert not report.exists() and not (folder / "parity.json").exists()


def test_verify_names_the_first_six_generation_settings_changed_and_says_there_are_more(
    qwen3_source, qwen3_thinker, tmp_path
):
    """A generation_config.json edited in seven settings: the refusal lists six and marks the rest with " ..."."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    path = folder / "generation_config.json"
    edits = {"do_sample": True, "max_length": 7, "min_length": 3, "num_beams": 2, "repetition_penalty": 1.5}
    edits |= {"temperature": 0.5, "top_k": 3, "top_p": 0.5}
    path.write_text(json.dumps({**json.loads(path.read_text()), **edits}, indent=2))
    with pytest.raises(ThinkerError) as refused:
        verify(qwen3_source, folder)
    message = str(refused.value)
    assert message.startswith(f"{path} is not the generation config {qwen3_source} gives: do_sample (")
    listed = message.split(" gives: ")[1].split(" (the source's value first)")[0]
    assert listed.endswith(") ...") and listed.count(" -> ") == 6, message
    assert not (folder / "parity.json").exists()


def test_exporting_a_source_refuses_its_generation_config_by_its_own_path(qwen3_source, tmp_path):
    """``thinker export SOURCE`` checks the source's generation_config.json before converting it: a sampling value
    generate() refuses is named at the source's file, to be corrected in the source (not in a staging folder)."""
    from export.exporter import export_model

    source = shutil.copytree(qwen3_source, tmp_path / "source")
    path = source / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_sample": True, "top_p": 2.0}, indent=2))
    with pytest.raises(ThinkerError) as refused:
        export_model(source, tmp_path / "onnx", verify=False)
    assert str(refused.value) == (
        f"{path}: top_p=2.0 is not a value generate() takes (do_sample true or false; temperature and "
        "repetition_penalty above 0; top_p in (0, 1]; top_k and no_repeat_ngram_size whole numbers, 0 or more); "
        "correct it in the source and export again"
    )
    assert not (tmp_path / "onnx").exists()


# ---- export/graph_builder.py: node names and the casts around a half-precision step -------------------------------


def test_names_carry_the_scope_into_a_body_and_count_repeats_from_one():
    """Names read ``/scope/Op``, ``/scope/Op_1``, ``/scope/Op_2`` (as the class says, for Netron and profiles); a
    control-flow body built inside a scope carries it, and shares the model-wide count."""
    from export.graph_builder import GraphBuilder

    builder = GraphBuilder(None)
    with builder.scope("model"), builder.scope("layers.3"):
        assert [builder.fresh("x") for _ in range(3)] == [
            "/model/layers.3/x",
            "/model/layers.3/x_1",
            "/model/layers.3/x_2",
        ]
        body = builder.subgraph()
        assert body.fresh("x") == "/model/layers.3/x_3"
        assert body.op("Neg", "a") == "/model/layers.3/Neg/output_0"


@pytest.mark.parametrize("dtype, onnx_type", [("float16", "FLOAT16"), ("bfloat16", "BFLOAT16")])
def test_a_step_computed_in_float32_is_cast_back_to_the_graphs_own_dtype(dtype, onnx_type):
    """``to_float32`` widens a half-precision value; ``to_dtype`` rounds it back to that same dtype (a bfloat16
    graph's value to BFLOAT16, not FLOAT16); a float32 graph gets no Cast either way."""
    import torch
    from onnx import TensorProto, helper

    from export.graph_builder import GraphBuilder

    builder = GraphBuilder(None)
    assert builder.to_float32("x", torch.float32) == "x" and builder.to_dtype("x", torch.float32) == "x"
    builder.to_float32("x", getattr(torch, dtype))
    builder.to_dtype("y", getattr(torch, dtype))
    casts = [(node.op_type, helper.get_attribute_value(node.attribute[0])) for node in builder.nodes]
    assert casts == [("Cast", TensorProto.FLOAT), ("Cast", getattr(TensorProto, onnx_type))]
