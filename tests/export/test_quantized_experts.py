"""Routed experts under ``--quantize`` in the fused graph: onnxruntime's QMoE over 4-bit or 8-bit expert stacks in
blocks along the input axis (8 bits with a scale per row at a float-activation level, or in a float16 graph), read
back by export/dequantize.py and held by the quantized verify.

The kernel check runs a graph's own QMoE node alone against the MoE computed in PyTorch from ``dequantize_qmoe``'s
weights with Qwen's routing, to float32 rounding (1e-5 of the output's scale), with float activations (accuracy
level 0 at 4 bits; 8-bit experts in blocks through onnxruntime's float path, ``experts_in_float``), and with int8
activations as the block-wise kernels compute by default, against the same MoE over activations rounded per block.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from export_helpers import assert_genai_equals_onnxruntime
from onnx import helper, numpy_helper

from export.accuracy_guard import int8_blockwise
from export.dequantize import DEQUANTIZED, attributes, constant_reader, dequantize_qmoe, quantized_weights
from export.graph_walk import all_nodes
from export.quantize import QuantizeSpec, WeightQuantizer
from export.quantized_verify import QualityGate, experts_in_float, verify_quantized_export
from thinker_common.cli import main

INT4 = QuantizeSpec(bits=4, block_size=16)
INT8 = QuantizeSpec(bits=8, block_size=16)
SPECS = {"int4": INT4, "int8": INT8}
NO_GATE = QualityGate(min_top1=0.0, max_perplexity_increase=float("inf"))
MOE_FAMILIES = ["qwen3_moe", "qwen3_5_moe"]


def graph_of(folder: Path) -> onnx.GraphProto:
    return onnx.load(folder / "model.onnx", load_external_data=False).graph


def export_of(onnx_variant, family: str, spec: QuantizeSpec) -> Path:
    head_dim = None if family == "qwen3_5_moe" else 16  # the hybrid keeps its own head_dim
    return onnx_variant(family, graph="fused", quantize=spec, head_dim=head_dim)


def first_qmoe(folder: Path) -> tuple[onnx.NodeProto, Callable[[str], np.ndarray]]:
    """The export's first QMoE node and a reader of its tensors (tiny: the whole model in memory)."""
    model = onnx.load(folder / "model.onnx")
    return next(n for n in model.graph.node if n.op_type == "QMoE"), constant_reader(model.graph)


def qmoe_alone(node: onnx.NodeProto, read: Callable[[str], np.ndarray], **attributes) -> ort.InferenceSession:
    """``node`` alone in a session, its router logits an input: ``y = QMoE(x, logits)`` over its own expert tensors,
    its attributes but those given (None: left out, the schema's default)."""
    hidden, experts = read(node.input[5]).shape[1], read(node.input[2]).shape[0]
    alone = helper.make_node("QMoE", ["x", "logits", *node.input[2:]], ["y"], domain=node.domain)
    alone.attribute.extend(a for a in node.attribute if a.name not in attributes)
    alone.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items() if v is not None)
    graph = helper.make_graph(
        [alone],
        "qmoe",
        [
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", hidden]),
            helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", experts]),
        ],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", hidden])],
        [numpy_helper.from_array(read(name), name) for name in set(node.input[2:]) if name],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return ort.InferenceSession(helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString())


class Weights:
    """A GraphBuilder's weight sink: what the quantizer writes, by name."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def weight(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = array


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_routed_experts_are_qmoe(family, spec, onnx_variant):
    """Every sparse layer's experts are one QMoE over uint8 stacks in blocks of the spec's size (a float32 graph at
    accuracy level 4); no float MoE and no float expert stack is left in the graph."""
    graph = graph_of(export_of(onnx_variant, family, spec))
    qmoe = [n for n in graph.node if n.op_type == "QMoE"]
    assert qmoe and not [n for n in graph.node if n.op_type == "MoE"]
    tensors = {t.name: t for t in graph.initializer}
    for node in qmoe:
        attrs = attributes(node)
        assert attrs["expert_weight_bits"] == spec.bits and attrs["weights_prepacked"] == 0
        assert attrs.get("block_size") == spec.block_size and attrs["accuracy_level"] == 4, attrs
        for packed, scales in ((node.input[2], node.input[3]), (node.input[5], node.input[6])):
            assert tensors[packed].data_type == onnx.TensorProto.UINT8
            assert len(tensors[scales].dims) == 3
    assert not [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_dequantized_experts_are_what_qmoe_computes_with(family, spec, onnx_variant):
    """The first QMoE of the export, alone (router logits as an input), against the MoE computed in PyTorch from
    ``dequantize_qmoe``'s stacks: softmax over the logits, top-k, renormalised, SiLU(gate) * up, weighted sum."""
    node, read = first_qmoe(export_of(onnx_variant, family, spec))
    with experts_in_float():
        session = qmoe_alone(node, read, accuracy_level=None)  # level 0: float activations
    x, logits = router_inputs(node, read)
    y = session.run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
    reference = moe_of(node, read, x, logits)
    scale = float(reference.abs().max())
    np.testing.assert_allclose(y, reference.numpy(), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_experts_in_blocks_compute_with_int8_activations(spec, onnx_variant):
    """What the guard's ranking and its reference rest on: the block-wise kernels at level 4 (and at 8 bits at every
    level, unless ``experts_in_float``) compute the float MoE over the tokens and their SwiGLU outputs rounded to
    int8 per block (``int8_blockwise``): within 1e-4 of the output's scale (3e-7 measured; float summation order
    can flip a rounding step now and then), where the unrounded MoE is 20x that away (7e-3 measured)."""
    node, read = first_qmoe(export_of(onnx_variant, "qwen3_5_moe", spec))
    x, logits = router_inputs(node, read)
    y = qmoe_alone(node, read).run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
    rounded = moe_of(node, read, x, logits, round_block=spec.block_size)
    exact = moe_of(node, read, x, logits)
    scale = float(exact.abs().max())
    assert np.abs(y - rounded.numpy()).max() <= 1e-4 * scale
    assert np.abs(y - exact.numpy()).max() > 2e-3 * scale


def router_inputs(node: onnx.NodeProto, read: Callable[[str], np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Six random tokens for ``node`` and router logits that spread them over its experts."""
    experts, hidden = read(node.input[5]).shape[:2]
    generator = torch.Generator().manual_seed(0)
    return torch.randn(6, hidden, generator=generator), 2 * torch.randn(6, experts, generator=generator)


def moe_of(node, read, x: torch.Tensor, logits: torch.Tensor, round_block: int | None = None) -> torch.Tensor:
    """The MoE of ``node``'s dequantized stacks (``dequantize_qmoe``) in PyTorch: softmax over the logits, top-k,
    renormalised, SiLU(gate) * up, weighted sum; ``round_block``: its activations rounded to int8 in blocks of it."""
    attrs = attributes(node)
    w1 = torch.from_numpy(dequantize_qmoe(attrs, read(node.input[2]), read(node.input[3]), interleaved=True))
    w2 = torch.from_numpy(dequantize_qmoe(attrs, read(node.input[5]), read(node.input[6]), interleaved=False))

    def rounded(a: torch.Tensor) -> torch.Tensor:
        return a if round_block is None else torch.from_numpy(int8_blockwise(a[None].numpy(), round_block)[0])

    weights, chosen = torch.softmax(logits, -1).topk(attrs["k"], dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], chosen[token], strict=True):
            gate, up = (w1[expert] @ rounded(x[token])).chunk(2)
            out[token] += weight * (w2[expert] @ rounded(F.silu(gate) * up))
    return out


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_each_expert_is_quantized_as_if_alone(spec):
    """In blocks: the stack through onnxruntime's quantizer as one (K, E * N) weight gives each expert the tensors
    it gets quantized alone, bit for bit (RTN quantizes every column on its own)."""
    stack = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
    quantizer = WeightQuantizer(spec, torch.float32)
    sink = Weights()
    experts = quantizer.quantize_experts(sink, "e", stack, in_blocks=True)
    packed, scales = (sink.arrays[name] for name in experts.inputs)
    width = 64 * spec.bits // 8
    assert (packed.shape, scales.shape, experts.block_size) == ((3, 40, width), (3, 40, 4), 16)
    for expert in range(3):
        alone = Weights()
        projection = quantizer.quantize_whole(alone, "alone", stack[expert].T, spec)
        assert np.array_equal(alone.arrays[projection.inputs[0]].reshape(40, width), packed[expert])
        assert np.array_equal(alone.arrays[projection.inputs[1]].reshape(40, 4), scales[expert])


def test_int8_experts_take_blocks_only_where_their_activations_may_be_int8():
    """8-bit experts go in blocks (whose kernel rounds activations to int8) only in a float32 graph at accuracy
    level 4 whose widths are whole blocks; else a scale per row: the largest magnitude over 127, every weight
    within half a step of its float value."""
    assert WeightQuantizer(INT8, torch.float32).experts_in_blocks(64, 32)
    assert not WeightQuantizer(INT8, torch.float32).experts_in_blocks(64, 40)  # 40 is not whole blocks of 16
    assert not WeightQuantizer(dataclasses.replace(INT8, accuracy_level=1), torch.float32).experts_in_blocks(64, 32)
    assert not WeightQuantizer(INT8, torch.float16).experts_in_blocks(64, 32)
    assert WeightQuantizer(INT4, torch.float16).experts_in_blocks(64, 32)

    stack = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(0))
    sink = Weights()
    experts = WeightQuantizer(INT8, torch.float32).quantize_experts(sink, "e", stack, in_blocks=False)
    packed, scales = (sink.arrays[name] for name in experts.inputs)
    assert (packed.shape, packed.dtype, scales.shape, experts.block_size) == ((3, 40, 64), np.uint8, (3, 40), 0)
    np.testing.assert_allclose(scales, stack.abs().amax(-1).numpy() / 127, rtol=1e-6)
    dequantized = (packed.astype(np.float32) - 128) * scales[..., None]
    assert np.abs(dequantized - stack.numpy()).max() <= 0.5 * scales.max() * (1 + 1e-6)


def route_to_one_expert(model: onnx.ModelProto) -> None:
    """Every QMoE mixes its top expert alone (k = 1) where the model mixes its top k."""
    for node in model.graph.node:
        for attribute in node.attribute:
            if node.op_type == "QMoE" and attribute.name == "k":
                attribute.i = 1


def scale_down_experts(model: onnx.ModelProto) -> None:
    """One layer's FC2 expert scales 30 % off (the exporter writing wrong scales)."""
    tensors = {t.name: t for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "QMoE")
    scales = tensors[node.input[6]]
    scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales) * 1.3, scales.name))


def planted(folder: Path, out: Path, bug) -> Path:
    model = onnx.load(folder / "model.onnx")
    bug(model)
    out.mkdir()
    onnx.save_model(model, out / "model.onnx")
    return out / "model.onnx"


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_quantized_verify_holds_the_experts(spec, thinker_variant, onnx_variant, tmp_path):
    """The quantized verify of a MoE export: sound, the graph within 1e-4 of the PyTorch model holding the
    dequantized experts; routing to the top expert alone fails the graph check, an expert stack's wrong scales the
    weight check (naming the stack), while that graph itself stays sound."""
    model_dir = thinker_variant("qwen3_moe", head_dim=16)
    folder = export_of(onnx_variant, "qwen3_moe", spec)

    def verify(path: Path) -> dict:
        return verify_quantized_export(model_dir, path, torch.float32, spec.bits, NO_GATE)

    sound = verify(folder / "model.onnx")
    assert sound["passed"] is True, sound
    assert sound["graph"]["max_abs_diff"] <= 1e-4, sound["graph"]
    assert set(quantized_weights(folder / "model.onnx")) >= {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    one_expert = verify(planted(folder, tmp_path / "routing", route_to_one_expert))
    assert one_expert["passed"] is False, one_expert
    assert "against the model with the same dequantized weights" in one_expert["failure"], one_expert
    assert one_expert["graph"]["max_abs_diff"] > 10 * one_expert["graph"]["tolerance"], one_expert["graph"]
    if spec.bits == 8:  # at 4 bits a 30 % scale error is within the rounding error the check allows (0.2)
        wrong_scale = verify(planted(folder, tmp_path / "scale", scale_down_experts))
        assert wrong_scale["passed"] is False and "experts.down_proj is" in wrong_scale["failure"], wrong_scale
        assert wrong_scale["graph"]["max_abs_diff"] <= wrong_scale["graph"]["tolerance"]


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_cli_export_of_a_hybrid_moe_verifies(spec, thinker_variant, tmp_path):
    """``thinker export --quantize`` of the tiny Qwen3.5-MoE passes its own verify, the experts among the weights
    checked: each layer's QMoE, or where the accuracy guard moved an 8-bit one, the float MoE op over its
    dequantized stacks (on these random weights it moves most)."""
    source = thinker_variant("qwen3_5_moe")
    words = {4: "int4", 8: "int8"}[spec.bits]
    output = tmp_path / words
    args = ["export", str(source), str(output), "--quantize", words, "--block-size", "16"]
    result = CliRunner().invoke(main, [*args, "--min-top1", "0", "--max-perplexity-increase", "9"])
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())
    assert report["quantize"]["routed_experts"] == "QMoE", report["quantize"]
    verify = report["verify"]
    assert verify["passed"] is True, verify
    assert verify["graph"]["max_abs_diff"] <= verify["graph"]["tolerance"], verify["graph"]
    nodes = graph_of(output).node
    assert "MatMulNBits" in {node.op_type for node in nodes}
    moved = set(report["accuracy_guard"].get("experts_to_float_moe", []))
    experts = [node for node in nodes if node.op_type in ("QMoE", "MoE")]
    assert experts and all((node.op_type == "MoE") == (node.name in moved) for node in experts), moved
    assert all(node.input[2].endswith(DEQUANTIZED) for node in experts if node.op_type == "MoE")
    assert spec.bits == 8 or not moved


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_plain_graph_decode_path_equals_its_expert_loop(spec, onnx_variant):
    """The plain graph's two paths over the same int8-held experts: a one-token step gathers its picked experts at
    once and dequantizes them as a batch (DequantizeLinear in blocks along K at int4, int8's scale per output as a
    Cast and a Mul),
    a 24-token step visits them in the Loop, which the quantized verify holds to PyTorch; each token's logits
    agree to float rounding."""
    from export.runtime import OnnxDecoder

    decoder = OnnxDecoder(onnx_variant("qwen3_moe", graph="plain", quantize=spec), provider="cpu")
    tokens = np.arange(24, dtype=np.int64)[:, None]  # 24 one-token rows
    loop = decoder.prefill(tokens, np.ones_like(tokens))[0]
    picked = np.concatenate([decoder.prefill(row[None], np.ones_like(row[None]))[0] for row in tokens])
    np.testing.assert_allclose(picked, loop, rtol=0, atol=1e-5 * np.abs(loop).max())


def test_genai_runs_quantized_experts(genai_python, onnx_variant):
    """onnxruntime-genai's greedy tokens equal onnxruntime's on the QMoE graphs (its own onnxruntime)."""
    folders = [export_of(onnx_variant, "qwen3_moe", INT4), export_of(onnx_variant, "qwen3_5_moe", INT8)]
    assert_genai_equals_onnxruntime(genai_python, folders)


def test_onnxruntime_qmoe_renormalises_whatever_its_attribute(onnx_variant):
    """Why a model with unnormalised top-k weights (Qwen2-MoE) keeps the Loop under --quantize: onnxruntime's CPU
    QMoE gives the same output with normalize_routing_weights 0 and 1. When this fails, the kernel honours the
    attribute and export/fused_graph.py can use QMoE for those models too."""
    node, read = first_qmoe(export_of(onnx_variant, "qwen3_moe", INT4))
    hidden, experts = read(node.input[5]).shape[1], read(node.input[2]).shape[0]
    feeds = {"x": np.ones((2, hidden), np.float32), "logits": np.linspace(-1, 1, 2 * experts, dtype=np.float32)}
    feeds["logits"] = feeds["logits"].reshape(2, experts)
    outputs = [qmoe_alone(node, read, normalize_routing_weights=normalize).run(None, feeds)[0] for normalize in (0, 1)]
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_unnormalised_routing_keeps_the_loop_over_quantized_experts(thinker_variant, tmp_path):
    """Qwen2-MoE (norm_topk_prob false): the fused int4 export has no QMoE; its Loop dequantizes the int8-held
    experts (DequantizeLinear), and the export passes its own verify, the experts among the weights checked."""
    output = tmp_path / "int4"
    args = ["export", str(thinker_variant("qwen2_moe", head_dim=16)), str(output), "--quantize", "int4"]
    args += ["--block-size", "16", "--min-top1", "0", "--max-perplexity-increase", "9"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())
    assert report["quantize"]["routed_experts"] == "DequantizeLinear of the gathered experts", report["quantize"]
    verify = report["verify"]
    assert verify["passed"] is True, verify
    assert [name for name in quantized_weights(output / "model.onnx") if name.endswith(".mlp.experts.down_proj")]
    graph = graph_of(output)
    assert not [n for n in graph.node if n.op_type in ("QMoE", "MoE")]
    for branch in ("then_branch", "else_branch"):  # a decode step's picked experts, and a prompt's expert Loop
        body = helper.get_attribute_value(next(a for a in expert_if(graph).attribute if a.name == branch))
        assert "DequantizeLinear" in {n.op_type for n in all_nodes(body)}, branch


def expert_if(graph: onnx.GraphProto) -> onnx.NodeProto:
    """The first MoE layer's ``If`` between the picked experts (then) and the Loop (else)."""
    return next(
        node
        for node in graph.node
        if node.op_type == "If"
        and any(n.op_type == "Loop" for a in node.attribute if a.name == "else_branch" for n in a.g.node)
    )


def test_int8_experts_at_float_activations_keep_a_scale_per_row(thinker_variant, onnx_variant, tmp_path):
    """``--quantize int8 --accuracy-level 1``: the experts take a scale per row (no ``block_size``), whose kernel
    computes in float without ``experts_in_float``, and the quantized verify holds the graph to 1e-4; routing to
    the top expert alone still fails its graph check."""
    spec = dataclasses.replace(INT8, accuracy_level=1)
    folder = export_of(onnx_variant, "qwen3_moe", spec)
    tensors = {t.name: t for t in graph_of(folder).initializer}
    for node in (n for n in graph_of(folder).node if n.op_type == "QMoE"):
        assert "block_size" not in attributes(node) and len(tensors[node.input[3]].dims) == 2
    node, read = first_qmoe(folder)
    x, logits = router_inputs(node, read)
    y = qmoe_alone(node, read).run(None, {"x": x.numpy(), "logits": logits.numpy()})[0]
    reference = moe_of(node, read, x, logits)
    np.testing.assert_allclose(y, reference.numpy(), rtol=0, atol=1e-5 * float(reference.abs().max()))
    model_dir = thinker_variant("qwen3_moe", head_dim=16)
    sound = verify_quantized_export(model_dir, folder / "model.onnx", torch.float32, 8, NO_GATE)
    assert sound["passed"] is True and sound["graph"]["max_abs_diff"] <= 1e-4, sound
    one_expert = planted(folder, tmp_path / "routing", route_to_one_expert)
    assert verify_quantized_export(model_dir, one_expert, torch.float32, 8, NO_GATE)["passed"] is False


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32])
def test_per_row_int8_experts_round_against_the_scale_they_store(scale_dtype):
    """Each weight is the nearest step of the scale the graph holds, so the kernel reads exactly the rounding the
    verify judges: a float16 scale rounds before the weights are divided by it (a mutation dividing by the unrounded
    float32 scale put 0.8 % of a tiny model's expert weights one step off and passed verify and tests)."""
    from export.quantize import column_wise_int8

    stack = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    packed, scales = column_wise_int8(stack, scale_dtype)
    assert packed.dtype == np.uint8 and scales.dtype == scale_dtype and scales.shape == (3, 16)
    stored = scales.astype(np.float32)[..., None]
    nearest = np.clip(np.round(stack.numpy() / stored), -127, 127)
    np.testing.assert_array_equal(packed.astype(np.int64) - 128, nearest)
    assert (np.abs(packed.astype(np.int64) - 128).max(-1) == 127).all()  # each row's largest weight takes the end


def scale_one_expert(model: onnx.ModelProto) -> None:
    """One expert of the first layer's down-projection stack with scales 15 % off, in either graph: QMoE's FC2
    scales (E, N, K / block) or the plain graph's ``..._scales`` (E, K / block, N)."""
    tensors = {t.name: t for t in model.graph.initializer}
    node = next((n for n in model.graph.node if n.op_type == "QMoE"), None)
    name = node.input[6] if node is not None else next(t for t in tensors if t.endswith("experts.down_proj_scales"))
    values = numpy_helper.to_array(tensors[name]).copy()
    values[1] *= 1.15
    tensors[name].CopyFrom(numpy_helper.from_array(values, name))


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_one_experts_scales_fail_the_row_check(graph, thinker_variant, onnx_variant, tmp_path):
    """One expert of a 4-bit stack with scales 15 % off: within int4's whole-tensor limit and sound as a graph (the
    model runs the same weights), so only the per-row check of the experts' own rounding sees it (a mutation reading
    the plain graph's stacks without their grid, which skips that check, passed every test)."""
    model_dir = thinker_variant("qwen3_moe", head_dim=16)
    folder = onnx_variant("qwen3_moe", graph=graph, quantize=INT4)
    sound = verify_quantized_export(model_dir, folder / "model.onnx", torch.float32, 4, NO_GATE)
    assert sound["passed"] is True, sound
    broken_path = planted(folder, tmp_path / "bug", scale_one_expert)
    broken = verify_quantized_export(model_dir, broken_path, torch.float32, 4, NO_GATE)
    weights = broken["weights"]
    assert weights["relative_error"] <= weights["limit"], weights  # the whole-tensor check alone passes it
    assert broken["passed"] is False and "experts.down_proj is" in broken["failure"], broken["failure"]
    assert "as far from the float row as round-to-nearest" in broken["failure"], broken["failure"]
