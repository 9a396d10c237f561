"""``thinker export --verify`` can fail (issue 15): a bug planted in the graph (the k-norm or the RoPE dropped, a
quantized head negated) ends in exit 1, the one-line error, and nothing installed; the same export without the
planted bug passes, so it is the bug that fails it. Plain, fused and quantized verification each."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner

from thinker_common.cli import main


def export(folder: Path, output: Path, *options: str):
    return CliRunner().invoke(main, ["export", str(folder), str(output), "--verify", *options])


def assert_rejected(result, output: Path, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    line = result.stderr.strip().splitlines()[-1]
    prefixes = ("error: onnxruntime disagrees with PyTorch", "error: the quantized export fails its check")
    assert line.startswith(prefixes), line
    assert "the export was not written" in line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not output.exists()
    assert not [p for p in output.parent.iterdir() if p.name.startswith(f".{output.name}.")]


def assert_passes(folder: Path, output: Path, *options: str) -> None:
    result = export(folder, output, *options)
    assert result.exit_code == 0, result.output
    assert "verify: max |Δlogit|" in result.stdout


def without_k_norm(monkeypatch) -> None:
    """The plain graph's RMSNorm skipped inside the k_norm scope: keys reach attention unnormalised."""
    from export.decoder_graph import DecoderGraph

    original = DecoderGraph.emit_rms_norm

    def emit_rms_norm(self, x: str, weight_name: str) -> str:
        if ".k_norm." not in weight_name:
            return original(self, x, weight_name)
        self.weight(weight_name)  # read, so that the exporter's unused-weight check does not catch it first
        return x

    monkeypatch.setattr(DecoderGraph, "emit_rms_norm", emit_rms_norm)


def without_rope(monkeypatch) -> None:
    """The plain graph's rotation left out: positions never reach q and k."""
    monkeypatch.setattr("export.decoder_graph.DecoderGraph.emit_rotary", lambda self, x, cos, sin: x)


@pytest.mark.parametrize("plant", [without_k_norm, without_rope], ids=["k-norm dropped", "RoPE dropped"])
def test_plain_verify_rejects_a_broken_graph(plant, thinker_folder, tmp_path, monkeypatch):
    folder = thinker_folder("qwen3")  # qk-norm, RoPE
    assert_passes(folder, tmp_path / "good", "--graph", "plain")
    plant(monkeypatch)
    bad = export(folder, tmp_path / "bad", "--graph", "plain")
    assert_rejected(bad, tmp_path / "bad", "float32, plain graph", "> tolerance")


def identity_rope_caches(monkeypatch) -> None:
    """The fused graph's cos/sin caches replaced by cos 1, sin 0: GroupQueryAttention rotates by nothing."""
    from export.fused_graph import FusedDecoderGraph

    def emit_rope_caches(self):
        half = self.head_dim // 2
        ones = torch.ones(self.config.max_position_embeddings, half, dtype=self.dtype)
        return self.b.weight("rotary_emb.cos_cache", ones), self.b.weight("rotary_emb.sin_cache", 0 * ones)

    monkeypatch.setattr(FusedDecoderGraph, "emit_rope_caches", emit_rope_caches)


def fused_without_k_norm(monkeypatch) -> None:
    from export.fused_graph import FusedDecoderGraph

    original = FusedDecoderGraph.emit_head_norm

    def emit_head_norm(self, x: str, heads: int, weight_name: str) -> str:
        if ".k_norm." not in weight_name:
            return original(self, x, heads, weight_name)
        self.weight(weight_name)  # read, so that the exporter's unused-weight check does not catch it first
        return x

    monkeypatch.setattr(FusedDecoderGraph, "emit_head_norm", emit_head_norm)


@pytest.mark.parametrize("plant", [identity_rope_caches, fused_without_k_norm], ids=["RoPE dropped", "k-norm dropped"])
def test_fused_verify_rejects_a_broken_graph(plant, thinker_variant, tmp_path, monkeypatch):
    folder = thinker_variant("qwen3", head_dim=16)  # GroupQueryAttention rotates inside (head_dim % 16 == 0)
    assert_passes(folder, tmp_path / "good", "--graph", "fused")
    plant(monkeypatch)
    result = export(folder, tmp_path / "bad", "--graph", "fused")
    assert_rejected(result, tmp_path / "bad", "float32, fused graph")


def negated_head(monkeypatch) -> None:
    """The quantized head written negated: every argmax an argmin, a quantized weight far off its float original."""
    from export.quantize import HEAD, WeightQuantizer

    original = WeightQuantizer.emit

    def emit(self, b, x, name, weight):
        return original(self, b, x, name, -weight if name == HEAD else weight)

    monkeypatch.setattr(WeightQuantizer, "emit", emit)


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_quantized_verify_rejects_a_broken_graph(graph, thinker_variant, tmp_path, monkeypatch):
    """A negated head (every argmax an argmin) is a quantized weight far off its float original."""
    folder = thinker_variant("qwen3", head_dim=16)
    options = ("--graph", graph, "--quantize", "int8")
    assert_passes(folder, tmp_path / "good", *options)
    negated_head(monkeypatch)
    bad = export(folder, tmp_path / "bad", *options)
    assert_rejected(bad, tmp_path / "bad", "quantized weight lm_head.weight is", "int8 rtn")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
def test_streamed_verify_checks_the_shipped_graph_layer_by_layer(family, thinker_folder, tmp_path, monkeypatch):
    """Where the graph's session and the whole PyTorch model do not fit together but the session and one layer do,
    --verify streams the PyTorch model layer by layer: the same figures as whole (the same graph, inputs and
    weights; eager against sdpa attention at most float32 rounding apart), and a planted bug still fails it. The
    hybrid MoE carries its recurrent state, KV cache and routed experts through the streamed layers."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import model_bytes

    folder = thinker_folder(family)
    model, largest_unit = model_bytes(folder, torch.float32)
    whole = export(folder, tmp_path / "whole", "--graph", "plain")
    assert whole.exit_code == 0, whole.output
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(model + largest_unit))  # one layer beside the graph, not two models
    assert_passes(folder, tmp_path / "good", "--graph", "plain")
    figures = [json.loads((tmp_path / name / "export_report.json").read_text())["verify"] for name in ("whole", "good")]
    assert figures[1]["reference"].endswith("read layer by layer as it runs")
    assert "layer by layer" not in figures[0]["reference"]
    assert figures[1]["top1_agreement"] == figures[0]["top1_agreement"] == 1.0
    assert abs(figures[1]["max_abs_diff"] - figures[0]["max_abs_diff"]) <= 1e-5 * max(1.0, figures[0]["logit_scale"])

    without_k_norm(monkeypatch)
    bad = export(folder, tmp_path / "bad", "--graph", "plain")
    assert_rejected(bad, tmp_path / "bad", "float32, plain graph", "> tolerance")


def test_streamed_quantized_verify_from_the_command_line(thinker_folder, tmp_path, monkeypatch):
    """A quantized export whose float model does not fit beside the graph's two sessions, but one layer in both
    forms does: --verify streams it, passes, and still rejects a planted bug (a negated head, every
    argmax an argmin). The hybrid MoE: linear-attention and full-attention layers, routed experts left float."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import model_bytes

    folder = thinker_folder("qwen3_5_moe")
    # the quality gate open: a tiny random model's near-ties say nothing of what int8 costs (test_onnx_quantized.py);
    # plain RTN, so that the planted head leaves the accuracy guard's choices, and so the graph the budget is made
    # from, as they are (the scales fit this budget, read a layer at a time, and moved the guard's level-1 fallback)
    options = ("--quantize", "int8", "--no-awq", "--min-top1", "0", "--max-perplexity-increase", "100")
    unverified = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "sizes"), *options[:3], "--no-verify"])
    assert unverified.exit_code == 0, unverified.output
    proto = onnx.load(str(tmp_path / "sizes" / "model.onnx"), load_external_data=False)  # the weights' own bytes
    graph = sum(int(entry.value) for t in proto.graph.initializer for entry in t.external_data if entry.key == "length")
    model, largest_unit = model_bytes(folder, torch.float32)
    budget = 2 * graph + 2 * largest_unit
    assert budget < 2 * graph + model + largest_unit
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(budget))
    assert_passes(folder, tmp_path / "good", *options)
    report = json.loads((tmp_path / "good" / "export_report.json").read_text())["verify"]
    assert report["reference"].endswith("read layer by layer as it runs"), report["reference"]
    assert report["weights"]["quantized"] > 0 and report["passed"] is True

    negated_head(monkeypatch)
    bad = export(folder, tmp_path / "bad", *options)
    assert_rejected(bad, tmp_path / "bad", "quantized weight lm_head.weight is", "int8 rtn")


def test_half_precision_verify_holds_the_graph_to_the_float32_model(thinker_folder, tmp_path, monkeypatch):
    """A float16 export is checked against the exact model, PyTorch in float32, within float16's tolerance (a
    half-precision reference rounds apart from onnxruntime's kernels: export/verify.py), and its memory plan counts
    that reference in float32: a budget that holds the graph beside a float16 model but not beside the float32 one
    streams the reference layer by layer, with the same figures. A planted bug still fails it."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import model_bytes

    folder = thinker_folder("qwen3_moe")
    half, _ = model_bytes(folder, torch.float16)
    full, full_unit = model_bytes(folder, torch.float32)
    assert_passes(folder, tmp_path / "whole", "--dtype", "float16")
    whole = json.loads((tmp_path / "whole" / "export_report.json").read_text())["verify"]
    assert whole["reference"] == "PyTorch ThinkerForCausalLM, float32, CPU", whole["reference"]
    assert whole["tolerance"] == pytest.approx(5e-2 * max(1.0, whole["logit_scale"]))

    assert half + full_unit <= 2 * half < half + full
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(2 * half))
    assert_passes(folder, tmp_path / "streamed", "--dtype", "float16")
    streamed = json.loads((tmp_path / "streamed" / "export_report.json").read_text())["verify"]
    assert streamed["reference"] == "PyTorch ThinkerForCausalLM, float32, CPU, read layer by layer as it runs"
    assert abs(streamed["max_abs_diff"] - whole["max_abs_diff"]) <= 1e-5 * max(1.0, whole["logit_scale"])

    without_k_norm(monkeypatch)
    bad = export(folder, tmp_path / "bad", "--dtype", "float16", "--graph", "plain")
    assert_rejected(bad, tmp_path / "bad", "float16, plain graph", "> tolerance")


@pytest.mark.parametrize(
    ("message", "advice"),
    [
        ("Non-zero status code returned while running GatherElements node.", "an exporter bug, please report it"),
        ("Failed to allocate memory for requested buffer of size 1073741824", "onnxruntime ran out of memory; free"),
    ],
    ids=["a kernel refuses", "out of memory"],
)
def test_a_graph_onnxruntime_fails_to_run_is_one_line_and_not_written(
    message, advice, thinker_folder, tmp_path, monkeypatch
):
    """From a QA run's mutation (a conv window one slot off, which sent a GatherElements out of range): a graph
    that loads and then fails inside onnxruntime while the check runs it showed onnxruntime's traceback. One line,
    exit 1, nothing written; running out of memory is said so, not blamed on the exporter (a review)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    def failing(*args, **kwargs):
        raise Fail(f"[ONNXRuntimeError] : 1 : FAIL : {message}")

    monkeypatch.setattr("export.runtime.OnnxDecoder.forward", failing)
    output = tmp_path / "out"
    result = export(thinker_folder("qwen3"), output)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: onnxruntime fails running the exported graph in its check (Fail: "), line
    assert f"the export was not written: {advice}" in line and "Traceback" not in result.output
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
