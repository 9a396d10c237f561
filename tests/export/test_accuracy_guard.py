"""The accuracy-level-4 guard (export/accuracy_guard.py): layers whose int8 activations flip tokens fall back.

A planted sensitivity: in one layer the MLP's input norm scales one channel up by OUTLIER and the MLP's gate and up
projections scale that input channel down by as much, so the float model computes the same function while that
layer's MatMulNBits input carries an outlier that accuracy level 4's per-block int8 activations cannot hold (the
other channels of its block round to zero). The guard must move that layer, and only it, to level 1; on the same
model without the outlier nothing moves.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from export_helpers import FullDiskFile
from onnx import helper

from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate
from thinker_common.cli import main

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


@pytest.mark.parametrize(("graph", "logits"), [("plain", "all"), ("fused", "all"), ("fused", "last")])
def test_guard_moves_the_layer_whose_activations_int8_ruins(graph, logits, thinker_variant, tmp_path):
    """``--logits last`` too: the guard measures the head's input at every position, as from ``--logits all``."""
    from export.exporter import export_model

    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    report = export_model(
        folder, tmp_path / "out", graph=graph, logits=logits, quantize=SPEC, verify=False, accuracy_guard=0.9
    )
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


def test_cli_says_what_the_guard_measured_on(thinker_variant, tmp_path):
    """The paragraph through the model's tokenizer; without one, random ids, which the line used to call "the
    paragraph" too (QA)."""
    from thinker_common.side_files import tokenizer_files

    folder = shutil.copytree(thinker_variant("qwen3", head_dim=16), tmp_path / "thinker")
    args = ["--graph", "fused", "--quantize", "int4", "--block-size", "16", "--no-verify"]
    said = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "with"), *args])
    assert said.exit_code == 0 and "of the next tokens of the paragraph (at least 90%)" in said.output, said.output
    for name in tokenizer_files(folder):
        (folder / name).unlink()
    said = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "without"), *args])
    assert said.exit_code == 0, said.output
    assert "of the next tokens of random ids (seed 0; no usable tokenizer in the model" in said.output, said.output
    assert "paragraph" not in said.output


@pytest.fixture(scope="module")
def outlier_int4(thinker_variant, tmp_path_factory) -> tuple[Path, Path]:
    """The model with the planted outlier and its int4 export at level 4, no guard run: the guard's figures are
    recomputed on it, and each guard run works on a copy."""
    from export.exporter import export_model

    root = tmp_path_factory.mktemp("outlier-int4")
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), root / "outlier", PLANTED_LAYER)
    export_model(folder, root / "out", graph="fused", quantize=SPEC, verify=False, accuracy_guard=None)
    return folder, root / "out"


def guard_on_copy(folder: Path, export: Path, copy: Path, min_agreement: float) -> dict:
    from export.accuracy_guard import guard_accuracy_level
    from thinker import ThinkerConfig

    config = ThinkerConfig.from_pretrained(folder)
    shutil.copytree(export, copy)
    return guard_accuracy_level(
        folder, copy / "model.onnx", config.vocab_size, config.max_position_embeddings, min_agreement, 1, False
    )


def guard_inputs(folder: Path, export: Path) -> tuple[onnx.ModelProto, list[str], np.ndarray]:
    """The export's graph, its levelled nodes, and the ids the guard runs."""
    from export.accuracy_guard import guard_token_ids, matmul_units
    from thinker import ThinkerConfig

    config = ThinkerConfig.from_pretrained(folder)
    model = onnx.load(export / "model.onnx", load_external_data=False)
    ids, _ = guard_token_ids(folder, config.vocab_size, config.max_position_embeddings)
    return model, [name for names in matmul_units(model).values() for name in names], ids


def test_the_guard_report_says_what_it_measured(outlier_int4, tmp_path):
    """The report's figures against their recomputation from the two prefills: tokens is every id, agreement_before
    the share of every position (the last one's prediction too) where the shipped graph picks level 1's token,
    mean_kl_before KL(level 1 || shipped), the reference first. At a threshold equal to that agreement, the graph
    meets it ("at least"): nothing moves and the guard passes (mutation runs: each figure computed otherwise, and the
    threshold compared strictly, passed every test)."""
    from export.accuracy_guard import prefill
    from export.fidelity import log_softmax

    folder, export = outlier_int4
    model, nodes, ids = guard_inputs(folder, export)
    reference = prefill(model, export / "model.onnx", dict.fromkeys(nodes, 1), ids, threads=1)
    shipped = prefill(model, export / "model.onnx", {}, ids, threads=1)
    agreement = float(np.mean(reference.argmax(-1) == shipped.argmax(-1)))
    assert 0 < agreement < 0.9 and reference.shape[0] == len(ids)
    log_p, log_q = log_softmax(reference), log_softmax(shipped)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean())
    backwards = float((np.exp(log_q) * (log_q - log_p)).sum(-1).mean())
    assert abs(kl - backwards) > 1e-3 * kl  # the direction shows
    report = guard_on_copy(folder, export, tmp_path / "guarded", min_agreement=agreement)
    assert report["tokens"] == len(ids), report
    assert report["agreement_before"] == agreement, report
    assert report["mean_kl_before"] == pytest.approx(kl, rel=1e-9), (report, kl, backwards)
    assert report["moved_to_level_1"] == [] and report["passed"] is True and report["agreement"] == agreement, report


def test_the_guard_moves_no_more_units_than_meet_the_threshold(outlier_int4, tmp_path):
    """--accuracy-guard 1.0 where moving the planted layer alone gives 100 % agreement: the bisection keeps the
    prefix that meets the threshold exactly, that layer alone (a mutation that asked more than the threshold moved
    every unit and passed every test)."""
    folder, export = outlier_int4
    report = guard_on_copy(folder, export, tmp_path / "guarded", min_agreement=1.0)
    assert report["agreement_before"] < 1.0, report
    assert report["moved_to_level_1"] == [f"layers.{PLANTED_LAYER}"], report
    assert report["agreement_by_units_moved"][1] == 1.0 and report["passed"] is True, report
    assert report["agreement"] == 1.0, report


def test_the_ranking_rounds_activations_per_block(outlier_int4):
    """unit_activation_rounding_error, the ranking's figure, against its recomputation: each of the planted layer's
    MatMulNBits inputs probed at level 1, rounded per block of the node's block_size along K (as level 4 rounds
    them; not per row: a mutation rounding per K passed every test), times its dequantized weight; the layer's worst
    node."""
    from export.accuracy_guard import (
        activation_rounding_errors,
        graph_variant,
        int8_blockwise,
        matmul_units,
        relative_difference,
    )
    from export.dequantize import attributes, constant_reader, dequantize_matmul_nbits
    from export.runtime import OnnxDecoder, position_ids_from_mask

    folder, export = outlier_int4
    path = export / "model.onnx"
    model, _, ids = guard_inputs(folder, export)
    unit = f"layers.{PLANTED_LAYER}"
    names = matmul_units(model)[unit]
    got = activation_rounding_errors(model, path, {unit: names}, ids, 1)[unit]
    nodes = [n for n in model.graph.node if n.name in names]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    inputs = sorted({n.input[0] for n in nodes})
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in inputs)
    everything = {n.name: 1 for n in probe.graph.node if n.op_type == "MatMulNBits"}
    with graph_variant(probe, path, everything) as variant:
        decoder = OnnxDecoder(variant, provider="cpu", threads=1, all_positions=True)
        mask = np.ones_like(ids)[None]
        feeds = {
            "input_ids": ids[None],
            "attention_mask": mask,
            "position_ids": decoder.graph_positions(position_ids_from_mask(mask)),
            **decoder.empty_cache(1),
        }
        activations = dict(zip(inputs, decoder.session.run(inputs, feeds), strict=True))
    read = constant_reader(model.graph, base_dir=export)
    errors = []
    for node in nodes:
        attrs = attributes(node)
        assert attrs["K"] > attrs["block_size"]  # more than one block a row: the block matters
        weight = dequantize_matmul_nbits(attrs, read(node.input[1]), read(node.input[2])).astype(np.float32)
        a = activations[node.input[0]].reshape(-1, attrs["K"]).astype(np.float32)
        errors.append(relative_difference(int8_blockwise(a, attrs["block_size"]) @ weight, a @ weight))
    assert got == pytest.approx(max(errors), rel=1e-5)


def routed_moe_by_hand(x, logits, fc1, fc2, k: int, block: int | None = None) -> np.ndarray:
    """A MoE token by token, as QMoE routes where the model renormalises: softmax, top k, the k weights made to sum
    to 1, SiLU(gate) * up through each picked expert; its input and its SwiGLU output rounded as level 4 rounds them
    (per block of ``block``) where ``block`` is given."""
    from export.accuracy_guard import int8_blockwise

    def rounded(a: np.ndarray) -> np.ndarray:
        return a if block is None else int8_blockwise(a[None], block)[0]

    out = np.zeros_like(x)
    for t in range(len(x)):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        for weight, expert in zip(p[top] / p[top].sum(), top, strict=True):
            gate, up = np.split(fc1[expert] @ rounded(x[t]), 2)
            out[t] += weight * (fc2[expert] @ rounded(gate / (1 + np.exp(-gate)) * up))
    return out


def test_the_ranking_of_4_bit_experts_is_their_routed_moes_rounding():
    """``qmoe_rounding_error``, a QMoE's figure in the ranking, against a MoE written out token by token: the top k
    experts (not the bottom), their weights renormalised, the input and the SwiGLU output both rounded per block, the
    error over the exact output's norm (mutations of each of these passed every test: the MoE guard test checks
    only which layer ranks first; helper-243)."""
    from export.accuracy_guard import qmoe_rounding_error, relative_difference

    rng = np.random.default_rng(0)
    experts, hidden, inner, tokens, k, block = 4, 32, 32, 6, 2, 16
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    x[:, 3] *= 50  # an outlier channel: its blocks' other channels lose their levels
    logits = (2 * rng.normal(size=(tokens, experts))).astype(np.float32)
    fc1 = rng.normal(size=(experts, 2 * inner, hidden)).astype(np.float32)
    fc2 = rng.normal(size=(experts, hidden, inner)).astype(np.float32)
    exact = routed_moe_by_hand(x, logits, fc1, fc2, k)
    rounded = routed_moe_by_hand(x, logits, fc1, fc2, k, block)
    expected = np.linalg.norm(rounded - exact) / np.linalg.norm(exact)
    got = qmoe_rounding_error({"block_size": block, "k": k}, x, logits, fc1, fc2)
    assert got == pytest.approx(expected, rel=1e-4)
    assert relative_difference(np.array([3.0, 0.0]), np.array([1.0, 0.0])) == 2.0  # over the exact one's norm


def test_an_all_zero_block_of_activations_rounds_to_zero():
    """A block of zeros (an all-zero embedding row, normalised) has no scale: it stays zeros, not NaN, which would
    make the ranking NaN (a mutation dropping the guard on a zero scale passed every test)."""
    from export.accuracy_guard import int8_blockwise

    a = np.zeros((2, 40), dtype=np.float32)
    a[1, 20:] = np.linspace(-1, 1, 20)
    got = int8_blockwise(a, 16)
    assert np.isfinite(got).all() and (got[0] == 0).all() and (got[1, :16] == 0).all()


def test_units_are_named_by_their_whole_layer_number():
    """Layers 10 and up are units of their own (the tests' models have fewer layers: a pattern reading one digit
    put them in "other" and passed every test)."""
    from export.accuracy_guard import matmul_units

    nodes = [
        helper.make_node("MatMulNBits", ["x"], ["y"], name=f"/model/layers.{i}/mlp/down_proj/MatMulNBits")
        for i in (1, 10, 12)
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    assert list(matmul_units(model)) == ["layers.1", "layers.10", "layers.12"]


def test_a_single_token_paragraph_falls_back_to_random_ids(thinker_variant):
    """A context of one position leaves the paragraph a single token, nothing to predict: random ids, and the
    report says why."""
    from export.accuracy_guard import guard_token_ids

    ids, text = guard_token_ids(thinker_variant("qwen3"), 10**6, 1)
    assert text == "random ids (seed 0; the paragraph is a single token)" and len(ids) == 1


def test_set_levels_moves_4_bit_experts_too(onnx_variant):
    """A moved unit's 4-bit QMoE goes to level 1 with its projections, the reference's included (a mutation
    leaving QMoE out passed every test)."""
    from export.accuracy_guard import set_levels

    folder = onnx_variant("qwen3_moe", quantize=QuantizeSpec(bits=4, block_size=16), head_dim=16)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    experts = [node for node in model.graph.node if node.op_type == "QMoE"]
    assert experts
    set_levels(model, {node.name: 1 for node in experts})
    levels = [helper.get_attribute_value(a) for node in experts for a in node.attribute if a.name == "accuracy_level"]
    assert len(levels) == len(experts) and set(levels) == {1}, levels


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


def test_set_aside_logits_read_back_as_written_and_leave_no_file(tmp_path):
    """The reference's logits wait in an unnamed file while the shipped graph runs: each slice of positions reads
    back bit for bit (the last one short, one past the end empty), the KL over them is the in-memory one, and the
    folder (the export's staging) holds nothing, during or after."""
    from export.accuracy_guard import SetAside, mean_kl

    rng = np.random.default_rng(0)
    logits, candidate = rng.normal(size=(37, 500)).astype(np.float32), rng.normal(size=(37, 500)).astype(np.float32)
    aside = SetAside(logits, tmp_path)
    try:
        assert len(aside) == 37 and np.array_equal(aside.top1, logits.argmax(-1))
        for rows in (slice(0, 16), slice(16, 32), slice(32, 48), slice(5, 6), slice(3, None), slice(40, 50)):
            assert np.array_equal(aside[rows], logits[rows]), rows
        assert mean_kl(aside, candidate, rows=5) == pytest.approx(mean_kl(logits, candidate), rel=1e-12)
        assert not list(tmp_path.iterdir())
    finally:
        aside.close()
    assert not list(tmp_path.iterdir())


def test_set_aside_logits_on_a_full_disk_say_so_with_its_errno(tmp_path, monkeypatch):
    """The reference's logits on a full disk: the error keeps ENOSPC, so that the export says the disk is full
    rather than numpy's "... requested and ... written" without an errno (helper-242's run on a full tmpfs)."""
    import export.accuracy_guard as guard

    monkeypatch.setattr(guard.tempfile, "TemporaryFile", lambda **options: FullDiskFile(tmp_path / "aside", "w+b"))
    with pytest.raises(OSError) as raised:
        guard.SetAside(np.ones((4, 100), np.float32), tmp_path)  # past the room
    assert raised.value.errno == errno.ENOSPC


def test_the_guards_runs_hold_one_prefills_logits_at_a_time(outlier_int4, tmp_path, monkeypatch):
    """The guard's prefills are a quantized export's peak (bench/results/README-export-peak.md): the reference's
    logits wait in a file in the export's own folder (not the system's temporary one, which may be memory) and are
    read back 16 positions at a time; the shipped graph's are let go before the runs after them."""
    import tempfile
    import weakref

    import export.accuracy_guard as guard

    folders, slices, results = [], [], []
    real_prefill, real_read, real_file = guard.prefill, guard.SetAside.__getitem__, tempfile.TemporaryFile

    def prefill(*args, **kwargs):
        if len(results) > 2:
            assert results[1]() is None, "the shipped graph's logits held through the runs after it"
        logits = real_prefill(*args, **kwargs)
        results.append(weakref.ref(logits))
        return logits

    def read(aside, rows):
        values = real_read(aside, rows)
        slices.append(len(values))
        return values

    def temporary_file(*args, **kwargs):
        folders.append(kwargs.get("dir"))
        return real_file(*args, **kwargs)

    monkeypatch.setattr(guard, "prefill", prefill)
    monkeypatch.setattr(guard.SetAside, "__getitem__", read)
    monkeypatch.setattr(guard.tempfile, "TemporaryFile", temporary_file)
    folder, export = outlier_int4
    report = guard_on_copy(folder, export, tmp_path / "guarded", min_agreement=1.0)
    assert report["moved_to_level_1"] and len(results) > 3, report
    assert folders == [tmp_path / "guarded"] and slices and max(slices) <= 16, (folders, slices)


# --- the 8-bit fallback: a float32 MatMul over the dequantized weight (export/float_fallback.py) ---------------------

INT8 = QuantizeSpec(bits=8, block_size=16)  # accuracy level 4
INT8_ASYM = QuantizeSpec(bits=8, block_size=16, algo="rtn-asym")  # with zero points
NO_GATE = QualityGate(min_top1=0.0, max_perplexity_increase=float("inf"))  # random weights: the graph checks alone


def written_ops(folder: Path) -> dict[str, int]:
    from export.exporter import count_ops

    return dict(sorted(count_ops(onnx.load(folder / "model.onnx", load_external_data=False).graph).items()))


def external_ranges(path: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """Each external tensor's (offset, length) in the weights file, and the file's size."""
    model = onnx.load(path, load_external_data=False)
    ranges = {}
    for tensor in model.graph.initializer:
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if entries:
            ranges[tensor.name] = (int(entries["offset"]), int(entries["length"]))
    return ranges, (path.parent / "model.onnx.data").stat().st_size


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_int8_units_fall_back_to_float_matmuls_that_the_verify_reads(graph, thinker_variant, tmp_path):
    """At 8 bits the moved layer's projections become float32 MatMuls over their dequantized weights (onnxruntime's
    8-bit level 1 dequantizes on every call), the weights file holds no tensor nothing reads, and the quantized
    verify reads those MatMuls as the 8-bit weights they are (its graph check at the float graphs' tolerance)."""
    from export.dequantize import DEQUANTIZED
    from export.exporter import export_model
    from export.graph_builder import ALIGNMENT

    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    report = export_model(
        folder, tmp_path / "out", graph=graph, quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
    )
    guard = report["accuracy_guard"]
    assert guard["moved_to_level_1"] == [f"layers.{PLANTED_LAYER}"], guard
    assert guard["passed"] is True and guard["agreement"] >= 0.9, guard
    assert guard["nodes_to_float_matmul"] and set(guard["nodes_to_float_matmul"]) <= set(guard["nodes_moved"])
    assert report["verify"]["passed"] is True, report["verify"]
    path = tmp_path / "out" / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    in_layer = [n for n in model.graph.node if f"/layers.{PLANTED_LAYER}/" in n.name]
    assert not [n.name for n in in_layer if n.op_type == "MatMulNBits"]
    floats = [n for n in in_layer if n.op_type == "MatMul" and n.input[1].endswith(DEQUANTIZED)]
    assert len(floats) == len(guard["nodes_to_float_matmul"])
    assert report["nodes_by_op"] == written_ops(tmp_path / "out"), report["nodes_by_op"]  # after the rewrite
    weights = {t.name: t for t in model.graph.initializer}
    assert all(weights[n.input[1]].data_type == onnx.TensorProto.FLOAT for n in floats)
    assert not [name for name in weights if name + DEQUANTIZED in weights]  # the packed 8-bit tensors are gone
    ranges, size = external_ranges(path)
    assert size <= sum(length for _, length in ranges.values()) + ALIGNMENT * len(ranges)
    assert set(levels_by_layer(path).pop("layers.0")) == {4}


@pytest.mark.parametrize("spec", [INT8, INT8_ASYM], ids=["rtn", "rtn-asym"])
def test_the_float_fallback_computes_what_level_1_computes(spec, thinker_variant, tmp_path):
    """Asymmetric RTN too: each fallback dequantizes with its zero points, and records an asymmetric grid for the
    verify's per-row check (a mutation run dropped the zero points, and another recorded every grid symmetric: no
    test exported ``--algo rtn-asym`` with a fallback, and both passed); the rewritten graph passes the verify."""
    from export.accuracy_guard import matmul_units, prefill
    from export.dequantize import DEQUANTIZED, recorded_grid
    from export.exporter import export_model
    from export.float_fallback import float_fallback_nodes, replace_with_fallbacks
    from export.quantized_verify import verify_quantized_export

    folder = thinker_variant("qwen3", head_dim=16)
    export_model(folder, tmp_path / "out", graph="fused", quantize=spec, verify=False, accuracy_guard=None)
    shutil.copytree(tmp_path / "out", tmp_path / "float")
    level_4 = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    names = [name for names in matmul_units(level_4).values() for name in names]
    ids = np.random.default_rng(0).integers(0, 90, size=24)
    at_level_1 = prefill(level_4, tmp_path / "out" / "model.onnx", dict.fromkeys(names, 1), ids, threads=1)
    model = onnx.load(tmp_path / "float" / "model.onnx", load_external_data=False)
    chosen = float_fallback_nodes(model, names)
    assert sorted(chosen) == sorted(names)  # every projection and the head: all 8-bit, float32 scales
    written = replace_with_fallbacks(model, tmp_path / "float" / "model.onnx", chosen, [])
    onnx.save_model(model, tmp_path / "float" / "model.onnx")
    # the bytes reported (the CLI's "MiB" and the report's float_fallback_bytes) are every new weight's, not the last's
    ranges, _ = external_ranges(tmp_path / "float" / "model.onnx")
    assert written == sum(length for name, (_, length) in ranges.items() if name.endswith(DEQUANTIZED)) > 0
    as_float = prefill(model, tmp_path / "float" / "model.onnx", {}, ids, threads=1)
    scale = np.abs(at_level_1).max()
    assert np.abs(as_float - at_level_1).max() <= 1e-6 * scale
    assert sorted(p.name for p in (tmp_path / "float").iterdir()) == sorted(
        p.name for p in (tmp_path / "out").iterdir()
    )
    floats = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1].endswith(DEQUANTIZED)]
    assert len(floats) == len(names)
    assert {recorded_grid(n) for n in floats} == {(spec.block_size, spec.algo == "rtn-asym")}
    alone = tmp_path / "alone"  # the graph and its weights: the folder's genai graph still reads the old weights file
    alone.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(tmp_path / "float" / name, alone / name)
    verified = verify_quantized_export(folder, alone / "model.onnx", torch.float32, 8, NO_GATE, asked=spec)
    assert verified["passed"] is True, verified.get("failure")
    assert verified["weights"]["worst_row"]["error_over_rounding"] == pytest.approx(1.0, abs=1e-4), verified["weights"]


def test_the_fallback_keeps_the_weights_a_subgraph_reads(onnx_variant, tmp_path):
    """The plain hybrid graph's delta rule runs in If branches that read tensors of the main graph: the rewritten
    weights file keeps every tensor any node reads, a branch's nodes included (a mutation run that counted the main
    graph's nodes alone passed every test, whose fallbacks were all on graphs without branches)."""
    from export.accuracy_guard import matmul_units, prefill
    from export.float_fallback import float_fallback_nodes, replace_with_fallbacks
    from export.graph_walk import all_nodes

    export = onnx_variant("qwen3_5", graph="plain", quantize=INT8, head_dim=None)
    shutil.copytree(export, tmp_path / "float")
    path = tmp_path / "float" / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    branches = {name for node in all_nodes(model.graph) for name in node.input} - {
        name for node in model.graph.node for name in node.input
    }
    assert branches & {tensor.name for tensor in model.graph.initializer}  # what this test is about
    names = [name for names in matmul_units(model).values() for name in names]
    assert replace_with_fallbacks(model, path, float_fallback_nodes(model, names), []) > 0
    onnx.save_model(model, path)
    ids = np.random.default_rng(0).integers(0, 90, size=70)  # 64 tokens or more: the chunked branch runs
    assert np.isfinite(prefill(model, path, {}, ids, threads=1)).all()


def test_a_half_precision_graph_keeps_its_moved_8_bit_projections_at_level_1(onnx_variant):
    """A float16 graph's moved 8-bit MatMulNBits stay MatMulNBits at level 1: a float MatMul over its dequantized
    weight would run in half precision, not level 1's function (a mutation run that let float16 scales fall back
    passed every test)."""
    from export.accuracy_guard import matmul_units
    from export.float_fallback import float_fallback_nodes

    model = onnx.load(onnx_variant("qwen3", "float16", quantize=INT8) / "model.onnx", load_external_data=False)
    names = [name for names in matmul_units(model).values() for name in names]
    assert names and float_fallback_nodes(model, names) == []
    float32 = onnx.load(onnx_variant("qwen3", quantize=INT8) / "model.onnx", load_external_data=False)
    assert sorted(float_fallback_nodes(float32, names)) == sorted(names)  # the same nodes in a float32 graph


def test_the_guard_measures_the_graph_it_wrote_and_fails_a_wrong_float_fallback(thinker_variant, tmp_path, monkeypatch):
    """A planted bug in the written fallback (its float weights zeroed): the guard measures the rewritten graph once
    more and reports its agreement, and that it fails, beside the chosen levels' own (mutations dropping that
    measurement, reporting the levels' agreement as the graph's, or passing it regardless passed every test, since a
    sound fallback computes level 1's function to 1e-6; helper-243)."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model

    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    export_model(folder, tmp_path / "out", graph="fused", quantize=INT8, verify=False, accuracy_guard=None)
    real = float_fallback.dequantize_matmul_nbits
    monkeypatch.setattr(float_fallback, "dequantize_matmul_nbits", lambda *args: real(*args) * 0)
    report = guard_on_copy(folder, tmp_path / "out", tmp_path / "guarded", min_agreement=0.9)
    assert report["nodes_to_float_matmul"], report
    moved = len(report["moved_to_level_1"])
    assert report["agreement_at_level_1"] == report["agreement_by_units_moved"][moved] >= 0.9, report
    assert report["agreement"] < 0.9 and report["passed"] is False, report


def test_the_verify_fails_a_float_fallback_with_the_wrong_weight(thinker_variant, tmp_path, monkeypatch):
    """A planted bug: the fallback's weights 5 % too large (as a wrong scale would make them). The graph check runs
    PyTorch on the weights read back from the graph, so it is the weight check, 8 bits' bound against the float
    weights, that refuses it, as it refuses a wrong MatMulNBits scale."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    real = float_fallback.dequantize_matmul_nbits
    monkeypatch.setattr(float_fallback, "dequantize_matmul_nbits", lambda *args: real(*args) * 1.05)
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    with pytest.raises(ThinkerError, match=rf"quantized weight model\.layers\.{PLANTED_LAYER}\..* off the float one"):
        export_model(
            folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
        )
    assert not (tmp_path / "out").exists()


def test_the_verify_fails_one_wrong_row_of_a_float_fallback(thinker_variant, tmp_path, monkeypatch):
    """A planted bug confined to one output row of a fallback (one row's scales 15 % off): the whole weight stays
    within 8 bits' bound, so only the per-row check catches it, on the grid the fallback's node records."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    real = float_fallback.dequantize_matmul_nbits

    def one_row_off(*args):
        weight = real(*args)  # (K, N): output row n is column n
        weight[:, 3] *= 1.15
        return weight

    monkeypatch.setattr(float_fallback, "dequantize_matmul_nbits", one_row_off)
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    with pytest.raises(
        ThinkerError, match=rf"row 3 of quantized weight model\.layers\.{PLANTED_LAYER}\..* as round-to-nearest at int8"
    ):
        export_model(
            folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
        )
    assert not (tmp_path / "out").exists()


def test_cli_says_which_int8_projections_became_float(thinker_variant, tmp_path):
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    args = ["export", str(folder), str(tmp_path / "out"), "--graph", "fused", "--quantize", "int8"]
    # plain RTN: activation-aware scales take the planted outlier in (tests/export/test_awq.py)
    result = CliRunner().invoke(main, [*args, "--block-size", "16", "--no-verify", "--no-awq"])
    assert result.exit_code == 0, result.output
    assert f"layers.{PLANTED_LAYER} moved to level 1" in result.output, result.output
    assert "8-bit projections as float32 MatMuls" in result.output, result.output


@pytest.mark.parametrize(
    "error, says",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk is full at {parent}: writing OUTPUT needs more"),
        (
            OSError(errno.EIO, "Input/output error"),
            "{parent}: cannot rewrite the weights file with the accuracy guard's",
        ),
    ],
    ids=["disk full", "another error"],
)
def test_a_fallback_that_fails_midway_leaves_no_output(error, says, thinker_variant, tmp_path, monkeypatch):
    """The weights file is rewritten into a temporary file beside it; a failure while writing it (here at the second
    weight) ends the export with an error naming a folder the user can see (not the staging folder, gone by then):
    a full disk as every full disk is reported, anything else as the guard's; nothing at OUTPUT and no temporary file
    left."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    real, calls = float_fallback.dequantize_matmul_nbits, []

    def fails_the_second_time(*args):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*args)

    monkeypatch.setattr(float_fallback, "dequantize_matmul_nbits", fails_the_second_time)
    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    with pytest.raises(ThinkerError) as raised:
        export_model(folder, tmp_path / "out", graph="fused", quantize=INT8, verify=False, accuracy_guard=0.9)
    assert str(raised.value).startswith(says.format(parent=tmp_path)), raised.value
    assert ".partial-" not in str(raised.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["outlier"]  # no work folder left beside OUTPUT either


# --- 8-bit experts in blocks: QMoE's kernel rounds their activations at every level; a moved one becomes float --------


def with_expert_outlier(folder: Path, out: Path, layer: int, channel: int = 3) -> Path:
    """A copy of the MoE Thinker ``folder`` whose sparse layer ``layer`` has an outlier channel into its experts (and
    router), the float function unchanged."""
    from thinker import ThinkerForCausalLM

    shutil.copytree(folder, out)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    block = model.model.layers[layer]
    with torch.no_grad():
        block.post_attention_layernorm.weight[channel] *= OUTLIER
        block.mlp.experts.gate_up_proj[:, :, channel] /= OUTLIER
        block.mlp.gate.weight[:, channel] /= OUTLIER
    model.save_pretrained(out)
    return out


def with_attention_outlier(folder: Path, out: Path, layer: int, channel: int = 3) -> Path:
    """A copy of the Thinker ``folder`` whose layer ``layer`` has an outlier channel into its attention alone (q, k
    and v), the float function unchanged."""
    from thinker import ThinkerForCausalLM

    shutil.copytree(folder, out)
    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    block = model.model.layers[layer]
    with torch.no_grad():
        block.input_layernorm.weight[channel] *= OUTLIER
        for projection in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
            projection.weight[:, channel] /= OUTLIER
    model.save_pretrained(out)
    return out


def test_moved_int8_experts_become_float_moe_and_verify(thinker_variant, tmp_path):
    """An outlier into layer 0's experts: the ranking puts that layer first (its QMoE's routed products, rounded as
    the kernel rounds them), the guard moves it alone and writes its QMoE as the float MoE op over the dequantized
    stacks, the other layer's QMoE stays; the quantized verify reads those stacks as the 8-bit experts they are and
    passes, and nothing of the guard's trial graphs is left in the folder."""
    from export.dequantize import DEQUANTIZED, recorded_grid
    from export.exporter import export_model

    folder = with_expert_outlier(thinker_variant("qwen3_moe", head_dim=16), tmp_path / "outlier", layer=0)
    report = export_model(
        folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
    )
    guard = report["accuracy_guard"]
    assert guard["agreement_before"] < 0.9, guard
    assert next(iter(guard["unit_activation_rounding_error"])) == "layers.0", guard
    assert guard["moved_to_level_1"] == ["layers.0"] and guard["passed"] is True, guard
    assert [name.split("/")[2] for name in guard["experts_to_float_moe"]] == ["layers.0"], guard
    assert report["verify"]["passed"] is True, report["verify"]
    assert report["verify"]["graph"]["max_abs_diff"] <= report["verify"]["graph"]["tolerance"]
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    moved = [n for n in model.graph.node if n.op_type == "MoE"]
    kept = [n for n in model.graph.node if n.op_type == "QMoE"]
    assert [n.name.split("/")[2] for n in moved] == ["layers.0"] and [n.name.split("/")[2] for n in kept] == [
        "layers.2"
    ]
    weights = {t.name: t for t in model.graph.initializer}
    assert all(weights[name].data_type == onnx.TensorProto.FLOAT for name in (moved[0].input[2], moved[0].input[4]))
    assert all(name.endswith(DEQUANTIZED) for name in (moved[0].input[2], moved[0].input[4]))
    assert not [name for name in weights if name + DEQUANTIZED in weights]  # the 8-bit stacks are gone
    assert recorded_grid(moved[0]) == (INT8.block_size, False)  # for the per-row check of its stacks
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    # the report describes the graph as written, after the guard's rewrite
    assert report["nodes_by_op"] == written_ops(tmp_path / "out"), report["nodes_by_op"]
    assert report["quantize"]["routed_experts"] == "QMoE in 1 layers, float MoE in 1 (the accuracy guard's fallback)"


def test_the_verify_fails_one_wrong_row_of_a_float_moe_fallback(thinker_variant, tmp_path, monkeypatch):
    """A planted bug confined to one row of one expert of the guard's float MoE (its scales 15 % off): within 8
    bits' bound for the whole stack, refused by the per-row check on the grid the node records."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    real = float_fallback.dequantize_qmoe

    def one_row_off(*args, **kwargs):
        stack = real(*args, **kwargs)  # (E, N, K)
        stack[1, 2] *= 1.15
        return stack

    monkeypatch.setattr(float_fallback, "dequantize_qmoe", one_row_off)
    folder = with_expert_outlier(thinker_variant("qwen3_moe", head_dim=16), tmp_path / "outlier", layer=0)
    with pytest.raises(ThinkerError, match=r"row \d+ of quantized weight model\.layers\.0\.mlp\.experts\..* at int8"):
        export_model(
            folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
        )
    assert not (tmp_path / "out").exists()


def test_the_float_experts_compute_what_the_float_path_computes(thinker_variant, tmp_path):
    """The moved experts' float MoE, written or dequantized in the graph (the guard's trial graphs), against QMoE's
    own float path (``experts_in_float``) over the same 8-bit weights: equal to 1e-6 of the logit scale.

    Every token is routed to all four experts (top-4 of 4): with top-2, the two functions' summation-order
    differences (~5e-7 of the scale) reach the next layer's router, and a near tie there picks another expert on
    some CPUs (an AVX2-only EPYC: one position of 24 off by 2e-3 of the scale), which says nothing of the experts.
    """
    from export.accuracy_guard import graph_variant
    from export.exporter import export_model
    from export.float_fallback import expert_fallback_nodes, replace_with_fallbacks
    from export.quantized_verify import experts_in_float
    from export.runtime import OnnxDecoder

    folder = thinker_variant("qwen3_moe", head_dim=16, num_experts_per_tok=4)
    export_model(folder, tmp_path / "out", graph="fused", quantize=INT8, verify=False, accuracy_guard=None)
    shutil.copytree(tmp_path / "out", tmp_path / "float")
    ids = np.random.default_rng(0).integers(0, 90, size=(1, 24))

    def logits(path: Path) -> np.ndarray:
        decoder = OnnxDecoder(path, provider="cpu", threads=1, all_positions=True)
        return decoder.prefill(ids, np.ones_like(ids))[0]

    with experts_in_float():
        float_path = logits(tmp_path / "out" / "model.onnx")
    as_shipped = logits(tmp_path / "out" / "model.onnx")  # int8 activations
    model = onnx.load(tmp_path / "float" / "model.onnx", load_external_data=False)
    experts = expert_fallback_nodes(model, [n.name for n in model.graph.node])
    assert len(experts) == 2  # the two sparse layers
    with graph_variant(model, tmp_path / "float" / "model.onnx", {}, float_experts=experts) as path:
        in_graph = logits(path)
    assert replace_with_fallbacks(model, tmp_path / "float" / "model.onnx", [], experts) > 0
    onnx.save_model(model, tmp_path / "float" / "model.onnx")
    written = logits(tmp_path / "float" / "model.onnx")
    scale = np.abs(float_path).max()
    assert np.abs(written - float_path).max() <= 1e-6 * scale
    assert np.abs(in_graph - float_path).max() <= 1e-6 * scale
    assert np.abs(as_shipped - float_path).max() > 1e-4 * scale  # what the float path is for


def test_the_verify_fails_float_experts_with_the_wrong_weights(thinker_variant, tmp_path, monkeypatch):
    """A planted bug: the moved experts' dequantized stacks 5 % too large (as a wrong scale would make them). The
    weight check refuses them, naming the stack."""
    import export.float_fallback as float_fallback
    from export.exporter import export_model
    from thinker_common.errors import ThinkerError

    real = float_fallback.dequantize_qmoe
    monkeypatch.setattr(float_fallback, "dequantize_qmoe", lambda *args, **kwargs: real(*args, **kwargs) * 1.05)
    folder = with_expert_outlier(thinker_variant("qwen3_moe", head_dim=16), tmp_path / "outlier", layer=0)
    with pytest.raises(ThinkerError, match=r"quantized weight model\.layers\.0\.mlp\.experts\..* off the float one"):
        export_model(
            folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
        )
    assert not (tmp_path / "out").exists()


def test_a_moved_layer_keeps_its_int8_experts_where_they_do_not_cost(thinker_variant, tmp_path):
    """An outlier into layer 0's attention alone: the guard moves layer 0, then finds that layer meets the threshold
    with its experts still at int8 activations (one more run), so its QMoE stays and no float stacks are written."""
    from export.exporter import export_model

    folder = with_attention_outlier(thinker_variant("qwen3_moe", head_dim=16), tmp_path / "outlier", layer=0)
    report = export_model(
        folder, tmp_path / "out", graph="fused", quantize=INT8, verify=True, accuracy_guard=0.9, quality=NO_GATE
    )
    guard = report["accuracy_guard"]
    assert guard["moved_to_level_1"] == ["layers.0"] and guard["passed"] is True, guard
    assert guard["agreement_with_int8_experts"] >= 0.9 and guard["experts_to_float_moe"] == [], guard
    assert guard["nodes_to_float_matmul"], guard  # its projections did fall back
    assert not [name for name in guard["nodes_moved"] if "QMoE" in name], guard  # its experts did not move
    assert report["nodes_by_op"] == written_ops(tmp_path / "out") and report["quantize"]["routed_experts"] == "QMoE"
    assert [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).graph.node].count(
        "QMoE"
    ) == 2
    assert report["verify"]["passed"] is True, report["verify"]


def test_int8_experts_stay_where_they_meet_the_threshold_exactly(thinker_variant, tmp_path):
    """--accuracy-guard 1.0 where the moved layers reach 100 % agreement with their experts kept at int8 activations:
    that meets the threshold ("at least"), so their QMoE stay (a mutation that asked more than the threshold wrote
    the float MoE at 4x the experts' bytes and passed every test)."""
    from export.exporter import export_model

    folder = with_attention_outlier(thinker_variant("qwen3_moe", head_dim=16), tmp_path / "outlier", layer=0)
    report = export_model(folder, tmp_path / "out", graph="fused", quantize=INT8, verify=False, accuracy_guard=1.0)
    guard = report["accuracy_guard"]
    assert "layers.0" in guard["moved_to_level_1"] and guard["agreement_with_int8_experts"] == 1.0, guard
    assert guard["experts_to_float_moe"] == [] and guard["passed"] is True, guard
    ops = [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).graph.node]
    assert ops.count("QMoE") == 2 and "MoE" not in ops


def test_moved_int8_experts_with_a_scale_per_row_stay_qmoe(thinker_variant, tmp_path):
    """Expert widths that are not whole blocks (24 against blocks of 16) give 8-bit experts a scale per row, whose
    kernel computes in float at every level: an outlier into layer 0's attention has the guard move that layer, and
    its QMoE stays, with nothing to dequantize in blocks (a mutation run that took them for the float MoE's, which
    the guard's trial graphs dequantize in blocks, passed every test)."""
    from export.exporter import export_model
    from export.float_fallback import expert_fallback_nodes

    source = thinker_variant("qwen3_moe", head_dim=16, moe_intermediate_size=24)
    folder = with_attention_outlier(source, tmp_path / "outlier", layer=0)
    report = export_model(folder, tmp_path / "out", graph="fused", quantize=INT8, verify=False, accuracy_guard=0.9)
    guard = report["accuracy_guard"]
    assert guard["agreement_before"] < 0.9 and guard["moved_to_level_1"] == ["layers.0"], guard
    assert guard["passed"] is True and guard["experts_to_float_moe"] == [], guard
    assert "agreement_with_int8_experts" not in guard, guard  # nothing of theirs to keep at int8 or not
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    qmoe = [n for n in model.graph.node if n.op_type == "QMoE"]
    assert len(qmoe) == 2 and not [n for n in model.graph.node if n.op_type == "MoE"]
    assert not [n.name for n in qmoe if any(a.name == "block_size" for a in n.attribute)]  # a scale per row
    assert expert_fallback_nodes(model, [n.name for n in qmoe]) == []


def test_experts_the_guard_moved_are_not_said_too_narrow():
    """Every expert layer moved to float by the guard leaves no QMoE: the note that blames the widths (and advises a
    smaller --block-size) was shown, though the widths fit; the guard's own line says why (a QA run)."""
    from export_helpers import make_config

    from export.exporter import float_experts_note
    from export.quantize import QuantizeSpec

    config = make_config("qwen3_moe")
    moved = {"experts_to_float_moe": ["/model/layers.0/moe/QMoE", "/model/layers.1/moe/QMoE"]}
    nodes_by_op = {"MoE": 2, "MatMulNBits": 8}
    assert float_experts_note(config, QuantizeSpec(bits=8), nodes_by_op, moved) is None
    assert "do not fit --block-size" in float_experts_note(config, QuantizeSpec(bits=8), nodes_by_op, None)


@pytest.mark.parametrize(
    "widths, flags, advised",
    [
        ((48, 16), ["--quantize", "int4"], ["--block-size", "16"]),  # 16 alone among the sizes divides both
        ((48, 40), ["--quantize", "int4", "--block-size", "16"], ["--quantize", "int8"]),  # none divides 40 and 48
        ((48, 24), ["--quantize", "int4"], ["--quantize", "int8", "--block-size", "16"]),  # int8: inputs >= a block
    ],
)
def test_the_float_experts_note_advises_what_quantizes_them(tmp_path, widths, flags, advised):
    """The note on experts left float names what quantizes them, and the export so advised quantizes them: the
    note said "a smaller --block-size" where no block size could (a QA run, widths 80 and 40 at blocks of 16)."""
    from export_helpers import graph_nodes, save_thinker

    hidden, expert = widths
    folder = save_thinker(tmp_path / "moe", "qwen3_moe", hidden_size=hidden, moe_intermediate_size=expert)
    first = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "first"), *flags, "--no-verify"])
    assert first.exit_code == 0, first.output
    note = next(line for line in first.output.splitlines() if "the routed experts stay float" in line)
    assert " ".join(advised) in note, note
    options = dict(zip(flags[::2], flags[1::2], strict=True)) | dict(zip(advised[::2], advised[1::2], strict=True))
    again = [item for pair in options.items() for item in pair]
    second = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "second"), *again, "--no-verify"])
    assert second.exit_code == 0 and "the routed experts stay float" not in second.output, second.output
    nodes = {node.op_type for node in graph_nodes(tmp_path / "second" / "model.onnx")}
    assert "QMoE" in nodes and "MoE" not in nodes
