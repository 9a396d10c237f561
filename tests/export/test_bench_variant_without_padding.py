"""bench/variant_without_padding.py, the measurement-only copy of a fused export without the attention bias: it must
compute the same logits as the export on a batch without padding (or bench_graph_ab.py would compare two functions),
and really have lost the bias (a left-padded row then goes wrong), or the measurement would measure nothing."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import side_by_side

from export.runtime import OnnxDecoder

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "variant_without_padding.py"


def run_script(source: Path, output: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(source), str(output), *options], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def runs(onnx_variant, tmp_path_factory) -> dict[str, tuple[Future, Path]]:
    """The module's three runs of the script, started at once (``cli_helpers.side_by_side``): each imports the
    exporter (transformers, torch) in a fresh interpreter, and none reads what another writes. Name -> (the run, its
    output folder)."""
    root = tmp_path_factory.mktemp("variants")
    outputs = {"nobias": root / "nobias", "nopos": root / "nopos", "refused": root / "refused"}
    jobs = {
        "nobias": partial(run_script, onnx_variant("qwen2"), outputs["nobias"]),
        "nopos": partial(run_script, onnx_variant("qwen2"), outputs["nopos"], "--no-positions"),
        # head_dim not a multiple of 16: a RotaryEmbedding op rotates by position_ids
        "refused": partial(run_script, onnx_variant("qwen2", head_dim=24), outputs["refused"], "--no-positions"),
    }
    with side_by_side(jobs) as started:
        yield {name: (started[name], outputs[name]) for name in jobs}


def variant(run: tuple[Future, Path]) -> Path:
    """The output folder of a run that must succeed."""
    done = run[0].result()
    assert done.returncode == 0, done.stderr[-3000:]
    return run[1]


def test_the_variant_matches_the_export_without_padding_and_loses_the_bias(onnx_variant, runs):
    source = onnx_variant("qwen2")
    stripped = variant(runs["nobias"])
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


def test_no_positions_drops_the_input_and_the_nodes_that_fed_it(onnx_variant, runs):
    source = onnx_variant("qwen2")
    without_positions = variant(runs["nopos"])
    before = onnx.load(source / "model.onnx", load_external_data=False).graph
    after = onnx.load(without_positions / "model.onnx", load_external_data=False).graph
    assert "position_ids" in {i.name for i in before.input}
    assert "position_ids" not in {i.name for i in after.input}
    attention = [node for node in after.node if node.op_type == "GroupQueryAttention"]
    assert attention and all(len(node.input) <= 9 for node in attention)  # neither position_ids nor the bias
    assert len(after.node) < len(before.node) - 10  # the mask and position nodes went with them


def test_no_positions_refuses_a_graph_whose_rope_runs_outside_the_kernel(runs):
    started, output = runs["refused"]  # onnx_variant("qwen2", head_dim=24) with --no-positions
    run = started.result()
    assert run.returncode != 0 and "RotaryEmbedding" in run.stderr and "--no-positions needs" in run.stderr
    assert not output.exists()  # refused before anything was written
