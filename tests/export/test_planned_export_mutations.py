"""Export behaviour that planted mutations of export/ changed with every neighbouring test still passing (a mutation
run, helper mutleft2): each test here fails with its mutation in and passes on the code as written."""

from __future__ import annotations

import json

from click.testing import CliRunner
from test_accuracy_guard import PLANTED_LAYER, with_outlier

from export.exporter import export_model
from thinker_common.cli import main


def test_the_guard_line_gives_the_agreement_after_the_move(thinker_variant, tmp_path):
    """The console's accuracy-guard line gives the agreement before the guard moved anything, then the agreement of
    the graph shipped after the move; the mutation printed the agreement before the move twice, so a move that
    reached the threshold read as one that changed nothing (C14)."""
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    # plain RTN: activation-aware scales would take the planted outlier in (tests/export/test_awq.py)
    args = ["--graph", "fused", "--quantize", "int4", "--block-size", "16", "--no-verify", "--no-awq"]
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "out"), *args])
    assert result.exit_code == 0, result.output
    guard = json.loads((tmp_path / "out" / "export_report.json").read_text())["accuracy_guard"]
    assert guard["moved_to_level_1"] == [f"layers.{PLANTED_LAYER}"], guard
    before, after = f"{guard['agreement_before']:.1%}", f"{guard['agreement']:.1%}"
    assert before != after, guard  # the planted layer's move changes the agreement, so the line can tell them apart
    (line,) = [line for line in result.output.splitlines() if line.startswith("accuracy guard:")]
    assert f"agree with float ones on {before} of the next tokens" in line, line
    assert f"layers.{PLANTED_LAYER} moved to level 1 ({after})" in line, line


def test_an_embeds_card_says_text_positions_only_where_the_export_took_them(tmp_path):
    """A multimodal-RoPE model exported with --inputs-embeds and its default positions takes an image prompt's
    distinct streams, so its card must not say the export refuses them; the mutation said so of every multimodal
    model (M6; the --positions text card is test_inputs_embeds.py's)."""
    from export_helpers import save_thinker

    source = save_thinker(tmp_path / "thinker", "qwen3_5")
    report = export_model(source, tmp_path / "onnx", inputs_embeds=True, verify=False, progress=False)
    assert report["positions"] != "text", report["positions"]
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "--inputs-embeds" in card or "inputs_embeds" in card, card
    assert "text positions" not in card and "--positions text" not in card, card


def test_a_failed_check_names_which_check_failed(thinker_folder, thinker_variant, tmp_path, monkeypatch):
    """A float export onnxruntime computes wrong is "onnxruntime disagrees with PyTorch"; a quantized one that fails
    its quality gate is "the quantized export fails its check" (the advice differs: a graph bug, or limits to set).
    The mutation swapped the two, and the refusal tests accept either prefix (E16)."""
    from test_verify_rejects import without_rope

    quantized = ["--graph", "fused", "--quantize", "int4", "--block-size", "16", "--min-top1", "1.0"]
    folder = thinker_variant("qwen3", head_dim=16)
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "int4"), *quantized])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the quantized export fails its check: "), line
    assert "--min-top1" in line and "the export was not written" in line, line

    without_rope(monkeypatch)
    result = CliRunner().invoke(
        main, ["export", str(thinker_folder("qwen3")), str(tmp_path / "plain"), "--graph", "plain"]
    )
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: onnxruntime disagrees with PyTorch: "), line
    assert "float32, plain graph" in line and "the export was not written" in line, line
    assert not (tmp_path / "int4").exists() and not (tmp_path / "plain").exists()
