"""A bfloat16 export where no CUDA runs: onnxruntime's CPU provider has no bfloat16 kernels, so ``--verify`` runs the
export's graphs widened to float32 (export/widened.py) against the PyTorch Thinker holding the same bfloat16
weights, to one bfloat16 ulp of the logit scale (export/verify.py ``verify_widened``). The copy, its exactness, the
bugs it catches that the bfloat16 check on CUDA would pass, the tables it checks as shipped, and its memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, numpy_helper
from test_verify_rejects import assert_rejected, without_k_norm

from thinker_common.cli import main


@pytest.fixture(autouse=True)
def _no_cuda():
    from export.providers import cuda_usable

    if cuda_usable():
        pytest.skip("CUDA is usable here: a bfloat16 export is verified on it in bfloat16 (test_onnx_gpu.py)")


def export(folder: Path, output: Path, *options: str):
    return CliRunner().invoke(main, ["export", str(folder), str(output), "--dtype", "bfloat16", *options])


def verified(output: Path) -> dict:
    return json.loads((output / "export_report.json").read_text())["verify"]


def relative(figures: dict) -> float:
    return figures["max_abs_diff"] / max(1.0, figures["logit_scale"])


@pytest.mark.parametrize(
    ("family", "overrides", "graph"),
    [("qwen3", {"head_dim": 16}, "fused"), ("qwen3", {}, "plain"), ("gpt2", {}, "plain"), ("qwen4_exp", {}, "fused")],
    ids=["qwen3-fused", "qwen3-plain-head-12", "gpt2-plain", "qwen3.8-fused"],
)
def test_a_bfloat16_export_is_verified_widened_on_the_cpu(family, overrides, graph, thinker_variant, tmp_path):
    """--verify, asked for by name or by default, runs: the report, the command's output and the card say how. The
    graph is matched to float32's rounding, 2e-5 of the logit scale where the check allows 2^-8: widened, it runs
    the reference's arithmetic on the reference's weights, and applies in float32 the scalars bfloat16 does not
    hold (a head of 12's attention scale, GPT-2's GELU coefficients, Qwen3.8's gate: rounded to bfloat16, they
    parted it from the reference by 1.9e-3, 5.2e-4 and 9.9e-5 of the scale)."""
    folder = thinker_variant(family, **overrides)
    result = export(folder, tmp_path / "onnx", "--verify", "--graph", graph)
    assert result.exit_code == 0, result.output
    assert "verify: max |Δlogit|" in result.stdout
    assert "verify note: onnxruntime's CPU provider has no bfloat16 kernels" in result.stdout
    figures = verified(tmp_path / "onnx")
    assert figures["passed"] is True and "widened to float32" in figures["widened"]
    assert figures["reference"] == (
        "PyTorch ThinkerForCausalLM, float32, CPU, its weights rounded to bfloat16 as the export's"
    )
    assert figures["tolerance"] == pytest.approx(2.0**-8 * max(1.0, figures["logit_scale"]))
    passes = [figures] + [v for v in figures.values() if isinstance(v, dict) and "max_abs_diff" in v]
    assert len(passes) >= 6 and max(relative(p) for p in passes) <= 2e-5, [relative(p) for p in passes]
    assert family == "qwen4_exp" or figures["deep_cache"]["cache_slots"] > 0  # a float32 cache takes it, not bfloat16
    tables = figures["rope_tables"]  # Qwen3.8's indexer pass is judged too: it chooses in float32 arithmetic
    assert family != "qwen4_exp" or figures["indexer_prompts"]["tolerance"] > 0
    assert tables == {"rows": 0} if family == "gpt2" else tables["equal"] is True  # GPT-2: learned positions
    assert "widened to float32" in (tmp_path / "onnx" / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]  # the copy removed, nothing else left


def test_the_hybrid_plain_graph_is_verified_widened(thinker_folder, tmp_path):
    """The plain hybrid graph: its recurrence's If branches, casts to bfloat16 and float32 states, widened. Its
    attention scale (1/sqrt(32)) is not a bfloat16 number, so it parts from the reference by that rounding, within
    the tolerance."""
    result = export(thinker_folder("qwen3_5"), tmp_path / "onnx", "--graph", "plain")
    assert result.exit_code == 0, result.output
    figures = verified(tmp_path / "onnx")
    assert figures["passed"] is True and "widened" in figures
    assert figures["max_abs_diff"] <= figures["tolerance"]


def bfloat16_values(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """A bfloat16 initializer's values as float32, read from the graph or its weights file."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor).astype(np.float32)
    entry = {item.key: item.value for item in tensor.external_data}
    with open(folder / entry["location"], "rb") as data:
        data.seek(int(entry.get("offset", 0)))
        raw = data.read(int(entry["length"]))
    return np.frombuffer(raw, ml_dtypes.bfloat16).astype(np.float32).reshape(tuple(tensor.dims))


@pytest.mark.parametrize(("family", "head_dim"), [("qwen3_5", None), ("qwen3", 16)], ids=["hybrid", "qwen3"])
def test_the_widened_copy_holds_the_exports_weights_and_no_bfloat16(family, head_dim, onnx_variant, tmp_path):
    """Every graph of a fused bfloat16 export, a hybrid's If branches included: no bfloat16 left in an initializer,
    a value's type, a cast's target or a constant; every weight the export's own value exactly, from the weights
    file or inline (the padding bias's constants), but the tables named for replacement; the copy opens in
    onnxruntime, its weights' stamp written anew."""
    from export.graph_walk import all_graphs, all_nodes
    from export.runtime import OnnxDecoder
    from export.widened import widened_folder

    shipped = onnx_variant(family, "bfloat16", head_dim=head_dim)
    table = onnx.load(shipped / "model.onnx", load_external_data=False).graph.initializer
    rows = next(list(t.dims) for t in table if t.name == "rotary_emb.cos_cache")
    replaced = {"rotary_emb.cos_cache": np.full(rows, 0.5, np.float32)}
    widened_folder(shipped, tmp_path, replaced)
    graphs = sorted(p.name for p in shipped.glob("*.onnx"))
    assert graphs == ["model.genai.onnx", "model.onnx"] and sorted(p.name for p in tmp_path.glob("*.onnx")) == graphs
    kinds = set()
    for name in graphs:
        original = onnx.load(shipped / name, load_external_data=False)
        widened = onnx.load(tmp_path / name)
        bodies = list(all_graphs(widened.graph))
        assert (len(bodies) > 1) is (family == "qwen3_5")  # the recurrence's If branches
        for body in bodies:
            assert all(t.data_type != TensorProto.BFLOAT16 for t in body.initializer)
            values = [*body.input, *body.output, *body.value_info]
            assert all(v.type.tensor_type.elem_type != TensorProto.BFLOAT16 for v in values)
        for node in all_nodes(widened.graph):
            for attribute in node.attribute:
                assert not (attribute.name == "to" and attribute.i == TensorProto.BFLOAT16), node.name
                tensor = attribute.t if attribute.type == onnx.AttributeProto.TENSOR else None
                assert tensor is None or tensor.data_type != TensorProto.BFLOAT16, node.name
        widened_tensors = {t.name: t for body in bodies for t in body.initializer}
        for body in all_graphs(original.graph):
            for tensor in body.initializer:
                got = numpy_helper.to_array(widened_tensors[tensor.name])
                if tensor.name in replaced:
                    np.testing.assert_array_equal(got, replaced[tensor.name])
                elif tensor.data_type == TensorProto.BFLOAT16:
                    kinds.add(tensor.data_location)
                    np.testing.assert_array_equal(got, bfloat16_values(tensor, shipped), err_msg=tensor.name)
    assert kinds == {TensorProto.DEFAULT, TensorProto.EXTERNAL}  # bfloat16 weights from the file and inline
    decoder = OnnxDecoder(tmp_path / "model.onnx")  # the stamp agrees with the widened weights file
    logits, _ = decoder.prefill(np.array([[5, 9, 17]]), np.ones((1, 3), np.int64))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def scaled_o_proj(monkeypatch, factor: float = 1.05) -> None:
    """One layer's o_proj written 5 % too large: a bug whose logits land within the bfloat16 check's tolerance."""
    from export.weights import ThinkerWeights

    original = ThinkerWeights.get

    def get(self, name):
        tensor = original(self, name)
        return tensor * factor if name == "model.layers.1.self_attn.o_proj.weight" else tensor

    monkeypatch.setattr(ThinkerWeights, "get", get)


@pytest.mark.parametrize("plant", [without_k_norm, scaled_o_proj], ids=["k-norm dropped", "o_proj 5% off"])
def test_a_bug_in_a_bfloat16_export_fails_its_widened_check(plant, thinker_variant, tmp_path, monkeypatch):
    """A graph bug fails the export, the copy removed with the staging folder. The o_proj bug parts from the
    reference by less than 5e-2 of the logit scale, the tolerance the bfloat16 graph itself is held to on CUDA:
    only the widened check's sees it."""
    folder = thinker_variant("qwen3", head_dim=16)
    plant(monkeypatch)
    result = export(folder, tmp_path / "bad", "--graph", "plain")
    assert_rejected(result, tmp_path / "bad", "bfloat16, plain graph", "> tolerance")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the copy went with the staging folder
    if plant is scaled_o_proj:  # the same bug in a float32 export: how far it moves the logits
        from export.verify import verify_export

        float32 = CliRunner().invoke(
            main, ["export", str(folder), str(tmp_path / "f32"), "--graph", "plain", "--no-verify"]
        )
        assert float32.exit_code == 0, float32.output
        figures = verify_export(folder, tmp_path / "f32" / "model.onnx", torch.float32)
        assert figures["passed"] is False
        assert figures["max_abs_diff"] < 5e-2 * max(1.0, figures["logit_scale"]), figures["max_abs_diff"]


def test_the_shipped_rope_tables_are_checked_though_the_copy_runs_float32_ones(thinker_variant, tmp_path, monkeypatch):
    """The copy rotates by float32 tables (the fused graph turns a left-padded row by its slots, exact but for the
    rounding of the tables' rows), so the tables the export ships are compared with the model's on their own: one
    row wrong in them fails the export."""
    from export.decoder_graph import rope_tables
    from export.fused_graph import FusedDecoderGraph
    from export.names import ROPE_SIN_TABLE, ROPE_TABLE

    def wrong_row(self):
        cos, sin = rope_tables(self.config, self.dtype)
        cos[40] = cos[41]
        return self.b.weight(ROPE_TABLE, cos), self.b.weight(ROPE_SIN_TABLE, sin)

    monkeypatch.setattr(FusedDecoderGraph, "emit_rope_caches", wrong_row)
    result = export(thinker_variant("qwen3", head_dim=16), tmp_path / "bad")
    assert_rejected(
        result, tmp_path / "bad", "rotary_emb.cos_cache differs from the model's rotary embedding from position 40"
    )


def test_a_streamed_widened_check_reads_each_layer_rounded(thinker_variant, tmp_path, monkeypatch):
    """Where the reference is read layer by layer, each tensor is rounded to bfloat16 as it is read: the same
    exactness as held whole. The plan counts the widened graph in float32."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import STREAMED, model_bytes, verify_plan

    folder = thinker_variant("qwen3", head_dim=16)
    full, unit = model_bytes(folder, torch.float32)
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(full + unit))  # the float32 graph beside one float32 layer
    assert verify_plan(folder, torch.bfloat16) == STREAMED
    result = export(folder, tmp_path / "onnx")
    assert result.exit_code == 0, result.output
    figures = verified(tmp_path / "onnx")
    assert figures["reference"].endswith("rounded to bfloat16 as the export's, read layer by layer as it runs")
    assert relative(figures) <= 1e-4 and relative(figures["long_prompts"]) <= 1e-4


def test_a_widened_check_without_the_disk_for_its_copy_is_refused(thinker_variant, tmp_path, monkeypatch):
    """The copy takes twice the export's bytes beside it: refused in one line, naming the way out, nothing left."""
    monkeypatch.setattr("export.verify.free_bytes", lambda path: 0)
    result = export(thinker_variant("qwen3", head_dim=16), tmp_path / "onnx")
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "float32 copy" in line and "--no-verify" in line and str(tmp_path) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []
