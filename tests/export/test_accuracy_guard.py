"""The accuracy-level-4 guard (export/accuracy_guard.py): layers whose int8 activations flip tokens fall back.

A planted sensitivity: in one layer the MLP's input norm scales one channel up by OUTLIER and the MLP's gate and up
projections scale that input channel down by as much, so the float model computes the same function while that
layer's MatMulNBits input carries an outlier that accuracy level 4's per-block int8 activations cannot hold (the
other channels of its block round to zero). The guard must move that layer, and only it, to level 1; on the same
model without the outlier nothing moves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import helper

from common.cli import main
from export.quantize import QuantizeSpec

OUTLIER = 1000.0
PLANTED_LAYER = 1
SPEC = QuantizeSpec(bits=4, block_size=16)  # accuracy level 4


def with_outlier(folder: Path, out: Path, layer: int, channel: int = 3) -> Path:
    """A copy of the Thinker ``folder`` whose layer ``layer`` has an outlier activation into its MLP."""
    from thinker import ThinkerForCausalLM

    shutil.copytree(folder, out)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    block = model.model.layers[layer]
    with torch.no_grad():
        block.post_attention_layernorm.weight[channel] *= OUTLIER
        block.mlp.gate_proj.weight[:, channel] /= OUTLIER
        block.mlp.up_proj.weight[:, channel] /= OUTLIER
    model.save_pretrained(out)
    return out


def levels_by_layer(path: Path) -> dict[str, set[int]]:
    from export.accuracy_guard import matmul_units

    model = onnx.load(path, load_external_data=False)
    by_node = {
        n.name: next(helper.get_attribute_value(a) for a in n.attribute if a.name == "accuracy_level")
        for n in model.graph.node
        if n.op_type == "MatMulNBits"
    }
    return {unit: {by_node[name] for name in names} for unit, names in matmul_units(model).items()}


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_guard_moves_the_layer_whose_activations_int8_ruins(graph, thinker_variant, tmp_path):
    from export.exporter import export_model

    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    report = export_model(folder, tmp_path / "out", graph=graph, quantize=SPEC, verify=False, accuracy_guard=0.9)
    guard = report["accuracy_guard"]
    assert guard["agreement_before"] < 0.9, guard
    assert guard["moved_to_level_1"] == [f"layers.{PLANTED_LAYER}"], guard
    assert guard["passed"] is True and guard["agreement"] >= 0.9, guard
    ranking = list(guard["unit_activation_rounding_error"])
    assert ranking[0] == f"layers.{PLANTED_LAYER}", guard
    levels = levels_by_layer(tmp_path / "out" / "model.onnx")
    assert levels.pop(f"layers.{PLANTED_LAYER}") == {1}
    assert set().union(*levels.values()) == {4}, levels
    assert guard["nodes_moved"] and all(f"/layers.{PLANTED_LAYER}/" in name for name in guard["nodes_moved"])


def test_guard_moves_nothing_without_the_outlier(thinker_variant, tmp_path):
    from export.exporter import export_model

    folder = thinker_variant("qwen3", head_dim=16)
    report = export_model(folder, tmp_path / "out", graph="fused", quantize=SPEC, verify=False, accuracy_guard=0.9)
    guard = report["accuracy_guard"]
    assert guard["passed"] is True and guard["agreement_before"] >= 0.9 and guard["moved_to_level_1"] == [], guard
    assert "unit_activation_rounding_error" not in guard  # ranked only when something must move
    assert set().union(*levels_by_layer(tmp_path / "out" / "model.onnx").values()) == {4}


def test_cli_runs_the_guard_by_default_and_turns_it_off(thinker_variant, tmp_path):
    model_dir = str(thinker_variant("qwen3", head_dim=16))
    args = ["export", model_dir, "--graph", "fused", "--quantize", "int4", "--block-size", "16", "--no-verify"]
    on = CliRunner().invoke(main, [args[0], args[1], str(tmp_path / "on"), *args[2:]])
    assert on.exit_code == 0 and "accuracy guard: int8 activations agree" in on.output, on.output
    guard = json.loads((tmp_path / "on" / "export_report.json").read_text())["accuracy_guard"]
    assert guard["min_agreement"] == 0.9 and "agreement_before" in guard, guard
    off = CliRunner().invoke(main, [args[0], args[1], str(tmp_path / "off"), *args[2:], "--accuracy-guard", "0"])
    assert off.exit_code == 0 and "accuracy guard" not in off.output, off.output
    assert json.loads((tmp_path / "off" / "export_report.json").read_text())["accuracy_guard"] is None


def test_mean_kl_a_few_rows_at_a_time_is_the_whole_mean():
    from export.accuracy_guard import mean_kl
    from export.fidelity import log_softmax

    rng = np.random.default_rng(0)
    reference, candidate = rng.normal(size=(37, 500)), rng.normal(size=(37, 500))
    log_p, log_q = log_softmax(reference), log_softmax(candidate)
    whole = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    assert mean_kl(reference, candidate) == pytest.approx(whole, rel=1e-12)
    assert mean_kl(reference, candidate, rows=5) == pytest.approx(whole, rel=1e-12)
    assert mean_kl(reference, reference) == pytest.approx(0.0, abs=1e-12)
