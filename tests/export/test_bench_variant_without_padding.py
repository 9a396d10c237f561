"""bench/variant_without_padding.py, the measurement-only copy of a fused export without the attention bias: it must
compute the same logits as the export on a batch without padding (or bench_graph_ab.py would compare two functions),
and really have lost the bias (a left-padded row then goes wrong), or the measurement would measure nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

from export.runtime import OnnxDecoder

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "variant_without_padding.py"


def variant(source: Path, output: Path, *options: str) -> Path:
    subprocess.run([sys.executable, str(SCRIPT), str(source), str(output), *options], check=True, capture_output=True)
    return output


def test_the_variant_matches_the_export_without_padding_and_loses_the_bias(onnx_variant, tmp_path):
    source = onnx_variant("qwen2")
    stripped = variant(source, tmp_path / "nobias")
    ids = np.random.default_rng(0).integers(3, 90, size=(2, 7))
    full = np.ones_like(ids)
    exact, _ = OnnxDecoder(source, provider="cpu").prefill(ids, full)
    cut, _ = OnnxDecoder(stripped, provider="cpu").prefill(ids, full)
    np.testing.assert_allclose(cut, exact, rtol=0, atol=1e-5)

    padded = full.copy()
    padded[1, :3] = 0  # row 1 left-padded: only the bias keeps its real tokens off the pads
    exact, _ = OnnxDecoder(source, provider="cpu").prefill(ids, padded)
    cut, _ = OnnxDecoder(stripped, provider="cpu").prefill(ids, padded)
    np.testing.assert_allclose(cut[0], exact[0], rtol=0, atol=1e-5)
    assert np.abs(cut[1, -1] - exact[1, -1]).max() > 1e-3


def test_no_positions_drops_the_input_and_the_nodes_that_fed_it(onnx_variant, tmp_path):
    source = onnx_variant("qwen2")
    without_positions = variant(source, tmp_path / "nopos", "--no-positions")
    before = onnx.load(source / "model.onnx", load_external_data=False).graph
    after = onnx.load(without_positions / "model.onnx", load_external_data=False).graph
    assert "position_ids" in {i.name for i in before.input}
    assert "position_ids" not in {i.name for i in after.input}
    attention = [node for node in after.node if node.op_type == "GroupQueryAttention"]
    assert attention and all(len(node.input) <= 9 for node in attention)  # neither position_ids nor the bias
    assert len(after.node) < len(before.node) - 10  # the mask and position nodes went with them


def test_no_positions_refuses_a_graph_whose_rope_runs_outside_the_kernel(onnx_variant, tmp_path):
    source = onnx_variant("qwen2", head_dim=24)  # not a multiple of 16: a RotaryEmbedding op rotates by position_ids
    output = tmp_path / "nopos"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(source), str(output), "--no-positions"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "RotaryEmbedding" in run.stderr and "--no-positions needs" in run.stderr
    assert not output.exists()  # refused before anything was written
