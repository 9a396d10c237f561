"""``thinker export`` as a command: what export_report.json, the card and the console say of the export asked for
(its graph, positions, source, whether it was converted or verified), and OUTPUT replaced only on request, also
when it appears during the run (a mutation run of export/exporter.py, export/cli.py and export/model_card.py: each
of these could be wrong with every other test passing)."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from cli_helpers import earlier_output
from click.testing import CliRunner

from thinker_common.cli import main
from thinker_common.errors import ThinkerError


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def report_of(folder) -> dict:
    return json.loads((folder / "export_report.json").read_text())


def test_a_thinker_folder_is_exported_as_it_is_and_unverified_says_so(runner, thinker_folder, tmp_path):
    """A Thinker folder is not converted on the way: the report says so, and the card names the folder; with
    --no-verify the report has no figures and the card says why (not an empty section); the console's first line
    names OUTPUT, the graph and the report's figures."""
    source = shutil.copytree(thinker_folder("qwen3"), tmp_path / "my-thinker")
    output = tmp_path / "onnx"
    result = runner.invoke(main, ["export", str(source), str(output), "--no-verify"])
    assert result.exit_code == 0, result.output
    report = report_of(output)
    assert (report["source"], report["converted"], report["revision"], report["commit"]) == (
        str(source),
        False,
        None,
        None,
    )
    assert report["verify"] is None and report["graph"] == "fused" and report["positions"] == "text"
    card = (output / "README.md").read_text()
    assert "The decoder of the Thinker folder `my-thinker`, exported by `thinker export`" in card, card
    assert ", converted" not in card
    assert "## Verify\n\nNot verified: exported with --no-verify." in card, card
    first = result.stdout.splitlines()[0]
    assert first.startswith(
        f"wrote {output} (fused graph): {report['nodes']} nodes, {report['parameters']:,} parameters ("
    ), first
    assert "verify" not in result.output


def test_a_converted_source_is_named_as_given(runner, tmp_path):
    """A transformers checkpoint converted on the way: the report and the card name it as the user gave it, not the
    temporary Thinker folder it went through."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    source = tmp_path / "qwen3"
    Qwen3ForCausalLM(config).save_pretrained(source)
    output = tmp_path / "onnx"
    result = runner.invoke(main, ["export", str(source), str(output), "--no-verify"])
    assert result.exit_code == 0, result.output
    report = report_of(output)
    assert (report["source"], report["converted"]) == (str(source), True)
    card = (output / "README.md").read_text()
    assert f"The decoder of `{source}`, converted, exported by `thinker export`" in card, card


def test_the_graph_and_positions_asked_for_are_reported_as_built(runner, thinker_folder, tmp_path):
    """--graph plain --positions text on a multimodal-RoPE model: the graph takes [batch, seq] positions, and the
    report, the card and the console say plain and text (each option dropped, or the report's value fixed, left a
    sound export of another kind or a report of one: a mutation run)."""
    output = tmp_path / "onnx"
    options = ["--graph", "plain", "--positions", "text", "--no-verify"]
    result = runner.invoke(main, ["export", str(thinker_folder("qwen3_5")), str(output), *options])
    assert result.exit_code == 0, result.output
    report = report_of(output)
    assert (report["graph"], report["positions"]) == ("plain", "text")
    assert f"wrote {output} (plain graph): " in result.stdout
    assert ", the plain graph)" in (output / "README.md").read_text()
    graph = onnx.load(output / "model.onnx", load_external_data=False).graph
    (positions,) = [i for i in graph.input if i.name == "position_ids"]
    assert len(positions.type.tensor_type.shape.dim) == 2

    default = tmp_path / "default"
    result = runner.invoke(main, ["export", str(thinker_folder("qwen3_5")), str(default), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert (report_of(default)["graph"], report_of(default)["positions"]) == ("fused", "multimodal")


def test_the_cards_max_length_stays_within_a_shorter_context(runner, thinker_variant, tmp_path):
    """onnxruntime-genai refuses a max_length past context_length: the card's example runs to 64 tokens, or the
    model's context where it is shorter (the tiny models' context is 64, where either bound gives the same)."""
    output = tmp_path / "onnx"
    folder = thinker_variant("qwen3", max_position_embeddings=32)
    result = runner.invoke(main, ["export", str(folder), str(output), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert json.loads((output / "genai_config.json").read_text())["model"]["context_length"] == 32
    assert "params.set_search_options(max_length=32)" in (output / "README.md").read_text()


def test_an_output_that_appears_during_the_export_is_not_replaced_without_force(thinker_folder, tmp_path, monkeypatch):
    """OUTPUT absent when the export looked, and made (here an earlier output, which --force would replace) before
    the new one is renamed into place: refused without --force, the folder left as it was; with --force, replaced."""
    import export.exporter

    output = tmp_path / "onnx"
    real_card = export.exporter.write_onnx_card

    def card_then_someone_writes_output(*args, **kwargs):
        names = real_card(*args, **kwargs)
        earlier_output(output, {"theirs.txt": "mine"})
        return names

    monkeypatch.setattr(export.exporter, "write_onnx_card", card_then_someone_writes_output)
    with pytest.raises(ThinkerError, match="onnx appeared during the run; pass --force to replace it"):
        export.exporter.export_model(thinker_folder("qwen3"), output, verify=False, progress=False)
    assert sorted(p.name for p in output.iterdir()) == ["README.md", "config.json", "theirs.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the staging folder went

    shutil.rmtree(output)
    export.exporter.export_model(thinker_folder("qwen3"), output, verify=False, progress=False, force=True)
    assert (output / "model.onnx").is_file() and not (output / "theirs.txt").exists()
