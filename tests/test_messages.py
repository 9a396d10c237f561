"""Messages that say what is actually wrong (issue 15): a mistyped local path is not sent to the Hub, and
``thinker generate`` names a Hugging Face folder, a missing tokenizer or an empty folder for what they are."""

from __future__ import annotations

import shutil

from cli_helpers import assert_error, thinker


def test_a_mistyped_local_path_is_no_such_folder(fake_hub, qwen3_source, tmp_path, monkeypatch):
    (tmp_path / "ckpt" / "qwen3").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for command in (["convert"], ["export"]):
        result = thinker(*command, "ckpt/qwen33", tmp_path / "out")
        assert_error(result, "ckpt/qwen33: no such folder", "ckpt exists here")
    assert not fake_hub.requests  # the Hub was never asked
    fake_hub.add_repo("tiny-org/tiny-qwen3", qwen3_source)  # with no local tiny-org/, a repo id still works
    assert thinker("convert", "tiny-org/tiny-qwen3", tmp_path / "out", "--no-verify").exit_code == 0


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
