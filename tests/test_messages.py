"""Messages that say what is actually wrong (issue 15): a mistyped local path is not sent to the Hub, and
``thinker generate`` names a Hugging Face folder, a missing tokenizer, an empty folder, a config.json that does not fit
its weights or does not validate for what they are."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from cli_helpers import assert_error, edit_config, thinker


def test_a_mistyped_local_path_is_no_such_folder(fake_hub, qwen3_source, tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "qwen3").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for command in (["convert"], ["export"]):
        result = thinker(*command, "ckpt/qwen33", tmp_path / "out")
        assert_error(result, "ckpt/qwen33: no such folder", "ckpt exists here")
    assert not fake_hub.requests  # the Hub was never asked
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)  # with no local tiny-org/, a repo id still works
    assert thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "out", "--no-verify").exit_code == 0


def test_export_takes_a_revision_of_a_hub_source(fake_hub, qwen3_source, tmp_path):
    """`thinker export REPO OUT --revision REV` converts that revision on the way, as convert and verify do."""
    main_sha = fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)
    edited = {p.name: p.read_bytes() for p in qwen3_source.iterdir() if p.is_file()}
    edited["README.md"] = b"# v2"
    v2_sha = fake_hub.add_repo("tiny-org/tiny-qwen3", edited, revision="v2")
    result = thinker("export", "tiny-org/tiny-qwen3", tmp_path / "onnx", "--revision", "v2", "--no-verify")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "onnx" / "export_report.json").read_text())
    assert report["revision"] == "v2" and report["commit"] == v2_sha
    # the card names the commit exported, as thinker-convert's does (it read as if main were: a QA run)
    assert (
        f"The decoder of `tiny-org/tiny-qwen3` at commit `{v2_sha}`, converted"
        in (tmp_path / "onnx" / "README.md").read_text()
    )
    fetched = {request.path.split("/")[4] for request in fake_hub.file_requests()}
    assert fetched == {v2_sha} and main_sha not in fetched
    local = thinker("export", qwen3_source, tmp_path / "local", "--revision", "v2", "--no-verify")
    assert_error(local, "a revision ('v2') only applies to Hub repo ids")


def test_generate_on_a_hugging_face_folder(qwen3_source):
    message = assert_error(thinker("generate", qwen3_source, "-p", "the cat"), "a qwen3 checkpoint", "thinker convert")
    assert "neither" not in message


def test_generate_on_a_folder_without_tokenizer(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    for path in folder.glob("tokenizer*"):
        path.unlink()
    message = assert_error(thinker("generate", folder, "-p", "the cat"), str(folder), "no tokenizer files")
    assert "sentencepiece" not in message


def test_generate_on_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    message = assert_error(thinker("generate", tmp_path / "empty", "-p", "the cat"), "neither an ONNX folder")
    assert "no model.onnx" in message and "no config.json" in message and "tokenizer" not in message


def test_generate_refuses_a_thinker_folder_whose_config_does_not_fit_its_weights(qwen3_thinker, tmp_path):
    """transformers would initialise what it cannot load afresh and run it (its report silenced): random weights."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    layers = json.loads((folder / "config.json").read_text())["layer_types"]
    edit_config(folder, num_hidden_layers=len(layers) - 1, layer_types=layers[:-1])
    assert_error(thinker("generate", folder, "-p", "the cat"), str(folder), "do not fit config.json", "holds")


def test_generate_names_a_broken_config_not_the_tokenizer(qwen3_thinker, tmp_path):
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    edit_config(folder, num_key_value_heads=3)
    message = assert_error(thinker("generate", folder, "-p", "the cat"), f"{folder}/config.json")
    assert "tokenizer" not in message


def test_generate_checks_what_transformers_loaded(qwen3_thinker, tmp_path, monkeypatch):
    """Behind the header check, transformers' own loading report: with the check planted away, a folder missing a
    layer's weights is still refused, by its missing keys."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    layers = json.loads((folder / "config.json").read_text())["layer_types"]
    edit_config(folder, num_hidden_layers=len(layers) + 1, layer_types=[*layers, layers[-1]])
    monkeypatch.setattr("export.cli._check_thinker", lambda folder: None)
    result = thinker("generate", folder, "-p", "the cat")
    assert_error(result, "do not load as the model", "missing keys: model.layers.")


def test_generate_names_a_broken_config_of_an_onnx_folder(qwen3_onnx, tmp_path):
    """An ONNX folder is not checked as a Thinker folder, but its tokenizer reads config.json: the message still
    names the config, not the tokenizer."""
    folder = shutil.copytree(qwen3_onnx, tmp_path / "onnx")
    edit_config(folder, num_key_value_heads=3)
    message = assert_error(thinker("generate", folder, "-p", "the cat"), f"{folder}/config.json")
    assert "tokenizer" not in message


def test_errors_md_quotes_the_families_the_converter_takes():
    """docs/errors.md quotes the unknown-architecture messages with their lists of families, as the converter says
    them today (a family added without the doc's list was once missed there)."""
    from pathlib import Path

    import pytest

    from converter.families import detect_family
    from thinker_common.errors import ThinkerError

    doc = (Path(__file__).parents[1] / "docs" / "errors.md").read_text()
    for config in ({"model_type": "bert", "architectures": ["BertModel"]}, {"general.architecture": "bert"}):
        with pytest.raises(ThinkerError) as refused:
            detect_family(config, ["x.weight"])
        supported = str(refused.value).split("; supported: ", 1)[1].split("; or,", 1)[0]
        assert f"supported: {supported}" in doc, supported


@pytest.mark.parametrize("command", [["export", "SOURCE", "OUT"], ["generate", "FOLDER", "-p", "hi"]])
def test_a_missing_onnxruntime_is_one_line(command, qwen3_onnx, tmp_path):
    """From a QA run: with onnxruntime-gpu uninstalled (onnxruntime-genai's CPU onnxruntime swaps it out), export,
    generate and demo ended in a 30-line traceback. The import's failure is one line that says what to install."""
    args = [
        {"SOURCE": str(tmp_path / "absent"), "OUT": str(tmp_path / "out"), "FOLDER": str(qwen3_onnx)}.get(a, a)
        for a in command
    ]
    script = "import sys; sys.modules['onnxruntime'] = None\nfrom thinker_common.cli import main\nmain(sys.argv[1:])"
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        "error: onnxruntime is not installed; pip install onnxruntime-gpu (its CPU execution provider runs anywhere; "
        "onnxruntime works too, without CUDA)"
    )
    assert not (tmp_path / "out").exists()


def test_both_commands_say_their_version():
    from importlib.metadata import version

    for entry in ("thinker", "thinker-convert"):
        result = subprocess.run([entry, "--version"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout == f"{entry} {version('thinker')}\n", result
