"""``--subfolder``: a checkpoint kept in a folder of a Hub repo or of a local folder, as transformers'
``from_pretrained(..., subfolder=)`` reads it, converted, verified and exported from the command line; the card names
the folder, and carries the repo's card and license from its top, which cover the folder."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_helpers import assert_error, thinker

REPO = "tiny-org/omni-parts"
TOP_CARD = b"---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# The whole model\n"
TOP_LICENSE = b"Apache License 2.0 (the repo's)\n"


def repo_with_a_folder(source, folder: str = "text") -> dict[str, bytes]:
    """A repo holding its card and license at the top, and the checkpoint ``source`` in ``folder``."""
    files = {f"{folder}/{path.name}": path.read_bytes() for path in source.iterdir() if path.is_file()}
    return {"README.md": TOP_CARD, "LICENSE": TOP_LICENSE, "vision/model.safetensors": b"not fetched", **files}


def fetched(fake_hub) -> set[str]:
    """The repo paths of the files downloaded, whatever the commit named in the URL."""
    return {request.path.split("/resolve/", 1)[1].split("/", 1)[1] for request in fake_hub.file_requests()}


def test_convert_and_verify_take_a_hub_subfolder(fake_hub, qwen3_source, tmp_path):
    """Without --subfolder the repo is refused with the option to name; with it, only that folder's files and the
    repo's card and license come down, parity holds, and the card names the folder and carries the top's license;
    `thinker verify` finds the same checkpoint with the same option."""
    sha = fake_hub.add_repo(REPO, repo_with_a_folder(qwen3_source))
    output = tmp_path / "thinker"
    refused = thinker("convert", REPO, output)
    assert_error(refused, f"{REPO}@main has no .safetensors, .bin or .gguf weights at its top level")
    assert refused.output.rstrip().endswith("name the one to convert with --subfolder text")
    assert not fake_hub.file_requests() and not output.exists()

    result = thinker("convert", REPO, output, "--subfolder", "text/")
    assert result.exit_code == 0, result.output
    assert fetched(fake_hub) == {"README.md", "LICENSE", *(f"text/{p.name}" for p in qwen3_source.iterdir())}
    card = (output / "README.md").read_text()
    assert f"The weights of [`{REPO}`](https://huggingface.co/{REPO}) at commit `{sha}`, the folder `text`, " in card
    assert "license: apache-2.0" in card and f"base_model: {REPO}" in card
    assert (output / "LICENSE").read_bytes() == TOP_LICENSE
    assert json.loads((output / "parity.json").read_text())["passed"] is True

    report = tmp_path / "verify.json"
    assert thinker("verify", REPO, output, "--subfolder", "text", "--report", report).exit_code == 0
    assert json.loads(report.read_text())["passed"] is True
    other = thinker("verify", REPO, output, "--subfolder", "txt", "--report", tmp_path / "other.json")
    assert_error(other, f"{REPO}@main: no subfolder 'txt' in the repo; check the subfolder name (its folders: ")


def test_export_converts_a_hub_subfolder_on_the_way(fake_hub, qwen3_source, tmp_path):
    """`thinker export REPO OUT --subfolder text`: the report records the folder, and the card names it."""
    sha = fake_hub.add_repo(REPO, repo_with_a_folder(qwen3_source))
    output = tmp_path / "onnx"
    result = thinker("export", REPO, output, "--subfolder", "text", "--no-verify")
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())
    assert (report["source"], report["subfolder"], report["commit"], report["converted"]) == (REPO, "text", sha, True)
    card = (output / "README.md").read_text()
    assert f"The decoder of `{REPO}` at commit `{sha}`, the folder `text`, converted" in card
    assert "license: apache-2.0" in card and (output / "LICENSE").read_bytes() == TOP_LICENSE


def local_repo(qwen3_source, tmp_path, folder: str = "parts/text"):
    """A local folder holding a card and license at its top, and the checkpoint ``qwen3_source`` in ``folder``."""
    repo = tmp_path / "repo"
    shutil.copytree(qwen3_source, repo / folder)
    (repo / "README.md").write_bytes(TOP_CARD)
    (repo / "LICENSE").write_bytes(TOP_LICENSE)
    return repo


def test_a_local_subfolder_is_named_and_its_own_license_wins(qwen3_source, tmp_path):
    """A local folder with --subfolder: the card names the folder within SOURCE. A license file in the folder itself
    is the one carried (it is the checkpoint's own), and the top card's word on the license, which describes another
    file, is left out; its other metadata (language) still holds."""
    repo = local_repo(qwen3_source, tmp_path)
    (repo / "parts" / "text" / "LICENSE").write_bytes(b"the folder's own terms\n")
    output = tmp_path / "thinker"
    result = thinker("convert", repo, output, "--subfolder", "parts/text", "--no-verify")
    assert result.exit_code == 0, result.output
    card = (output / "README.md").read_text()
    assert "The weights of `repo`, the folder `parts/text` (a local checkpoint), family `qwen3`" in card, card
    assert "language:\n- en" in card and "license" not in card.partition("\n---\n")[0]
    assert (output / "LICENSE").read_bytes() == b"the folder's own terms\n"
    missing = thinker("convert", repo, tmp_path / "other", "--subfolder", "parts/txt")
    assert_error(missing, f"{repo}: no subfolder 'parts/txt' in {repo}; check the subfolder name")


def test_a_folders_own_card_adds_to_the_tops_license(qwen3_source, tmp_path):
    """The folder's own card, silent on the license, with no license file of its own: the top's license file and
    its card's word on it are carried together, beside the folder card's own metadata (its language wins)."""
    repo = local_repo(qwen3_source, tmp_path)
    (repo / "parts" / "text" / "README.md").write_text("---\nlanguage:\n- fr\n---\n# the text part\n")
    output = tmp_path / "thinker"
    assert thinker("convert", repo, output, "--subfolder", "parts/text", "--no-verify").exit_code == 0
    header = (output / "README.md").read_text().partition("\n---\n")[0]
    assert "license: apache-2.0" in header and "- fr" in header and "- en" not in header
    assert (output / "LICENSE").read_bytes() == TOP_LICENSE


@pytest.mark.parametrize(("spelling", "recorded"), [("./parts/text/", "parts/text"), ("/parts//text/.", "parts/text")])
def test_every_spelling_of_a_folder_is_recorded_as_one(qwen3_source, tmp_path, spelling, recorded):
    """`./text`, `/text`, `text/.` name the folder `text` inside SOURCE (a leading slash too, as on the Hub): the
    export's report and card record it so."""
    repo = local_repo(qwen3_source, tmp_path)
    output = tmp_path / "onnx"
    result = thinker("export", repo, output, "--subfolder", spelling, "--no-verify")
    assert result.exit_code == 0, result.output
    assert json.loads((output / "export_report.json").read_text())["subfolder"] == recorded
    assert (output / "LICENSE").read_bytes() == TOP_LICENSE  # through the Thinker folder converted on the way


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_way_out_of_source_or_a_file_is_refused(qwen3_source, tmp_path, command):
    """`--subfolder ../elsewhere` would convert a folder outside SOURCE under SOURCE's name: refused, as --gguf-file
    refuses '..' and the Hub has no such path. On a weights file as SOURCE no folder name can help: said so."""
    repo = local_repo(qwen3_source, tmp_path)
    shutil.copytree(qwen3_source, tmp_path / "elsewhere")
    result = thinker(command, repo, tmp_path / "out", "--subfolder", "../elsewhere")
    assert_error(result, "--subfolder '../elsewhere': a folder inside SOURCE", "give that folder as SOURCE")
    weights = repo / "parts" / "text" / "model.safetensors"
    result = thinker(command, weights, tmp_path / "out", "--subfolder", "text")
    assert_error(result, f"{weights}: --subfolder picks a folder in a folder or a Hub repo; SOURCE is already a file")
    assert not (tmp_path / "out").exists()


def test_a_slash_names_the_top_of_a_hub_repo(fake_hub, qwen3_source, tmp_path):
    """`--subfolder /` on a Hub id is the repo's top (the Hub's paths have no root of their own): not the local
    root taken for SOURCE, inside which no OUTPUT could lie."""
    fake_hub.add_repo(REPO, {path.name: path.read_bytes() for path in qwen3_source.iterdir() if path.is_file()})
    result = thinker("convert", REPO, tmp_path / "thinker", "--subfolder", "/", "--no-verify")
    assert result.exit_code == 0, result.output


def test_export_carries_the_repos_license_for_a_thinker_folder_in_a_subfolder(fake_hub, qwen3_thinker, tmp_path):
    """A Thinker folder kept in a folder of a repo is exported as it is: the card names the repo, commit and folder,
    and carries the repo's license from its top."""
    thinker_files = {f"thinker/{p.name}": p.read_bytes() for p in qwen3_thinker.iterdir() if p.is_file()}
    sha = fake_hub.add_repo(REPO, {"README.md": TOP_CARD, "LICENSE": TOP_LICENSE, **thinker_files})
    output = tmp_path / "onnx"
    result = thinker("export", REPO, output, "--subfolder", "thinker", "--no-verify")
    assert result.exit_code == 0, result.output
    assert json.loads((output / "export_report.json").read_text())["converted"] is False
    card = (output / "README.md").read_text()
    assert f"The decoder of the Thinker folder `{REPO}` at commit `{sha}`, the folder `thinker`, exported" in card
    assert "license: apache-2.0" in card and (output / "LICENSE").read_bytes() == TOP_LICENSE


@pytest.mark.parametrize("top_cached", [False, True], ids=["folder-alone", "with-the-top"])
def test_offline_the_tops_card_and_license_are_taken_where_cached(
    fake_hub, qwen3_source, tmp_path, monkeypatch, top_cached
):
    """A cache filled with the folder alone (`hf download REPO --include 'text/*'`, which caches the repo's listing)
    converts offline: the top's card and license are taken where the cache holds them, never asked for."""
    from huggingface_hub import constants, snapshot_download

    fake_hub.add_repo(REPO, repo_with_a_folder(qwen3_source))
    top = ["README.md", "LICENSE"] if top_cached else []
    snapshot_download(REPO, allow_patterns=["text/*", *top], cache_dir=fake_hub.cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(fake_hub.requests)
    output = tmp_path / "thinker"
    result = thinker("convert", REPO, output, "--subfolder", "text", "--no-verify")
    assert result.exit_code == 0, result.output
    assert len(fake_hub.requests) == asked
    header = (output / "README.md").read_text().partition("\n---\n")[0]
    if top_cached:
        assert (output / "LICENSE").read_bytes() == TOP_LICENSE and "license: apache-2.0" in header
    else:
        assert not (output / "LICENSE").exists() and "license" not in header


@pytest.mark.parametrize(
    ("option", "words"),
    [("--subfolder", "--subfolder picks a folder"), ("--revision", "--revision picks a Hub revision")],
)
def test_the_way_back_takes_no_hub_options(qwen3_thinker, tmp_path, option, words):
    """--to writes a local Thinker folder back: an option that locates a Hub checkpoint is refused, not ignored."""
    result = thinker("convert", qwen3_thinker, tmp_path / "back", "--to", "qwen3", option, "x")
    assert_error(result, f"{words} of SOURCE; --to takes a local Thinker folder, with none of these")
    assert not (tmp_path / "back").exists()
