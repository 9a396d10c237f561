"""A half-precision MoE graph's routing, followed by the reference where the graph's own routers explain it
(export/routing.py).

The tests' tiny Qwen3-Next (top 2 of 4 experts, seed 0) routes a token of the long prompts on a near tie that its
float16 graphs take the other way: before the reference followed the graph's routing, ``--verify`` refused both sound
exports (1.84 against a tolerance of 0.42). Following it must not hide a router bug: the routers' values are held
to the dtype's tolerance, so experts numbered backwards in one layer's router fail the check. A float32 graph's check
is left as it was (no probes, nothing followed).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from click.testing import CliRunner
from export_helpers import reversed_router

from export.quantize import QuantizeSpec
from export.routing import checked_probes, graph_top_k, router_probes
from export.runtime import OnnxDecoder
from thinker_common.cli import main
from thinker_common.parity_inputs import long_batch

GRAPHS = ("plain", "fused")


@pytest.mark.parametrize("graph", GRAPHS)
def test_a_float16_moe_export_routed_on_a_near_tie_verifies(graph, thinker_variant, tmp_path):
    output = tmp_path / "onnx"
    args = ["export", str(thinker_variant("qwen3_next")), str(output), "--dtype", "float16", "--graph", graph]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "token(s) as the graph did at near ties" in result.stdout, result.stdout
    report = json.loads((output / "export_report.json").read_text())["verify"]
    long = report["long_prompts"]
    assert long["routes_followed"] >= 1 and long["router_max_abs_diff"] <= long["router_tolerance"], long
    assert long["max_abs_diff_beyond_spread"] <= long["tolerance"], long


@pytest.mark.parametrize("graph", GRAPHS)
def test_a_router_bug_fails_although_the_reference_follows_the_routing(graph, thinker_variant, tmp_path):
    output = tmp_path / "onnx"
    args = ["export", str(thinker_variant("qwen3_next")), str(output), "--dtype", "float16", "--graph", graph]
    with reversed_router(layer=0):
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "the graph's MoE routers' probabilities lie" in result.stderr, result.stderr
    assert "first at layer 0's router" in result.stderr and "first at layer 1" not in result.stderr
    assert "the export was not written" in result.stderr
    assert not output.exists()


def test_a_float16_tie_the_moe_op_breaks_in_float32_is_followed_as_it_broke_it(thinker_variant, tmp_path):
    """Two experts whose router rows differ by a hair tie in float16 at nearly every token, and onnxruntime's CPU
    MoE, which has no float16 kernel, picks between them by the float32 logits it is handed (the cast between the
    router and the op dropped). Read as float16, the probe showed ties, the follower took the later expert, and a
    sound export failed its --verify (a QA run: 0.343 against the routers' tolerance of 0.2): the probe is a float32
    view of the logits, which holds what the op picks by."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3_next"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight"):  # experts 2 and 3 a hair apart, either way per token
                gate.weight[3] = gate.weight[2] + 2e-4 * torch.randn(gate.weight.shape[1], generator=generator)
    folder = tmp_path / "tied"
    model.save_pretrained(folder)
    shutil.copy(thinker_variant("qwen3_next") / "tokenizer.json", folder)
    shutil.copy(thinker_variant("qwen3_next") / "tokenizer_config.json", folder)
    output = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(folder), str(output), "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    probes = router_probes(onnx.load(output / "model.onnx", load_external_data=False))
    assert all(name.endswith("/float32") and kind == onnx.TensorProto.FLOAT for name, kind, _ in probes.values())
    decoder = OnnxDecoder(output, probes=checked_probes(output / "model.onnx", torch.float16))
    decoder.prefill(*long_batch(96, 128))
    logits = next(iter(decoder.probed.values())).astype(np.float32)
    assert (logits != logits.astype(np.float16).astype(np.float32)).any()  # float32 values, not float16 ones


def test_probes_read_what_the_graph_routes_by_and_change_no_logit(onnx_variant):
    """The plain graph's probe is the Softmax its TopK picks from (not the router MatMul's float16 output: the CPU
    provider drops that rounding inside the graph), the fused graph's the logits its MoE op takes; a float32 check
    reads none. The logits with probes are the logits without, bit for bit."""
    plain, fused = (onnx_variant("qwen3_next", dtype="float16", graph=graph, head_dim=None) for graph in GRAPHS)
    kinds = {}
    for graph, folder in (("plain", plain), ("fused", fused)):
        probes = router_probes(onnx.load(folder / "model.onnx", load_external_data=False))
        kinds[graph] = {layer: probabilities for layer, (_, _, probabilities) in probes.items()}
    assert kinds == {"plain": dict.fromkeys((0, 1, 3), True), "fused": dict.fromkeys((0, 1, 3), False)}
    assert checked_probes(plain / "model.onnx", torch.float32) == {}
    ids, mask = long_batch(96, 128)
    for folder in (plain, fused):
        probes = checked_probes(folder / "model.onnx", torch.float16)
        bare, probed = OnnxDecoder(folder), OnnxDecoder(folder, probes=probes)
        logits, state = probed.prefill(ids, mask)
        np.testing.assert_array_equal(logits, bare.prefill(ids, mask)[0])
        assert set(probed.probed) == set(probes) and all(v.shape[-1] == 4 for v in probed.probed.values())
        step = probed.decode_one_token(logits[:, -1].argmax(-1), state)
        assert step.shape == (2, 96) and all(v.reshape(-1, 4).shape[0] == 2 for v in probed.probed.values())


@pytest.mark.parametrize("graph", GRAPHS)
def test_a_bfloat16_probe_comes_back_as_float32(graph, onnx_variant, tmp_path):
    """A bfloat16 graph's router probes (a CUDA check's: the CPU provider runs no bfloat16 MoE) come back as float32,
    exactly: numpy has no bfloat16, and reading one failed the bfloat16 export's verify on an H200 (bench/results/
    gpu-tests-h200-session7.xml). Here a float16 graph's probe rounded to bfloat16 in the graph stands for one (the
    fused graph's probes run through IO binding, the plain graph's through session.run)."""
    folder = shutil.copytree(onnx_variant("qwen3_next", dtype="float16", graph=graph, head_dim=None), tmp_path / "g")
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    name, kind = sorted(checked_probes(folder / "model.onnx", torch.float16).items())[0]
    model.graph.node.append(onnx.helper.make_node("Cast", [name], ["probe.bf16"], to=onnx.TensorProto.BFLOAT16))
    onnx.save(model, folder / "model.onnx")
    decoder = OnnxDecoder(folder, probes={name: kind, "probe.bf16": onnx.TensorProto.BFLOAT16})
    decoder.prefill(*long_batch(96, 128))
    half, rounded = decoder.probed[name], decoder.probed["probe.bf16"]
    assert rounded.dtype == np.float32
    expected = torch.from_numpy(half).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(rounded, expected)


def isolated_moe(folder, layer: int = 0):
    """Layer ``layer``'s MoE / QMoE node of ``folder``'s model.onnx alone in a session, with its weights: (session,
    its activation input's name, its router-logits input's name)."""
    from onnx import helper

    model = onnx.load(folder / "model.onnx")
    node = next(n for n in model.graph.node if n.op_type in ("MoE", "QMoE") and f"/layers.{layer}/" in n.name)
    weights = [i for i in model.graph.initializer if i.name in node.input]
    x, logits = node.input[:2]
    half = onnx.TensorProto.FLOAT16
    graph = helper.make_graph(
        [node],
        "one_moe",
        [helper.make_tensor_value_info(x, half, ["T", "C"]), helper.make_tensor_value_info(logits, half, ["T", "E"])],
        [helper.make_tensor_value_info(node.output[0], half, ["T", "C"])],
        weights,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    session = onnxruntime.InferenceSession(
        helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    return session, x, logits


@pytest.mark.parametrize("quantize", [None, QuantizeSpec(bits=4, block_size=16)], ids=["MoE", "QMoE"])
def test_the_moe_ops_break_ties_as_the_follower_reads_them(quantize, onnx_variant):
    """onnxruntime's CPU MoE and QMoE pick the later of two experts whose router logits are equal (a float16 row
    rounds near ties to equal values), where ONNX's TopK picks the earlier: the follower reads each op as it picks.
    Read as TopK, a QA run's float16 Qwen3-MoE export with int4 experts failed its own --verify (1.43 against 0.19 on
    onnxruntime-genai's graph): its reference followed the other expert."""
    folder = onnx_variant("qwen3_moe", dtype="float16", quantize=quantize, head_dim=16)
    session, x_name, logits_name = isolated_moe(folder)
    probed = OnnxDecoder(folder, probes=dict.fromkeys((x_name, logits_name), onnx.TensorProto.FLOAT16))
    probed.prefill(*long_batch(96, 8))
    x = probed.probed[x_name].reshape(-1, probed.probed[x_name].shape[-1])[:1]  # a real token's input
    count = probed.probed[logits_name].shape[-1]  # experts

    def run(logits: list[float]) -> np.ndarray:
        return session.run(None, {x_name: x, logits_name: np.array([logits], np.float16)})[0].astype(np.float32)

    tied = [0.5, 1.0, 0.2, 0.5] + [0.0] * (count - 4)  # experts 0 and 3 tie for the second place
    earlier, later = list(tied), list(tied)
    earlier[0] += 0.01
    later[3] += 0.01
    assert np.abs(run(tied) - run(later)).max() < 1e-2 < np.abs(run(tied) - run(earlier)).max()
    picked = graph_top_k(np.array([tied], np.float32), 2, probabilities=False)
    assert sorted(picked[0].tolist()) == [1, 3]
    assert sorted(graph_top_k(np.array([tied], np.float32), 2, probabilities=True)[0].tolist()) == [0, 1]


def test_a_float16_export_with_int4_experts_verifies_on_genai_rows(thinker_variant, tmp_path):
    """The QA run's export: float16, int4 experts in blocks of 16 (QMoE). A prompt of the parity batch, alone on
    onnxruntime-genai's right-padded rows, routes a token on an exact float16 tie; the check now follows it."""
    output = tmp_path / "onnx"
    args = ["export", str(thinker_variant("qwen3_moe", head_dim=16)), str(output), "--dtype", "float16"]
    result = CliRunner().invoke(main, [*args, "--quantize", "int4", "--block-size", "16"])
    assert result.exit_code == 0, result.output
    graph = json.loads((output / "export_report.json").read_text())["verify"]["graph"]
    assert graph["genai_graph"]["max_abs_diff"] <= graph["tolerance"], graph["genai_graph"]
    # QMoE runs in float16 on the CPU and reads the rounded logits: its probe is the float16 one, not a float32 view
    probes = router_probes(onnx.load(output / "model.onnx", load_external_data=False)).values()
    assert probes and all(kind == onnx.TensorProto.FLOAT16 and "/float32" not in name for name, kind, _ in probes)


def test_a_bug_that_moves_the_routing_does_not_widen_its_own_allowance(thinker_variant, onnx_variant, tmp_path):
    """The shadow runs that measure each position's half-precision spread (export/half_spread.py) take the graph's
    experts as the reference does. Routed on their own, a bug that moved the graph's routing moved the reference
    away from them and so widened its own allowance: o_proj x 1.1 in the tiny Qwen3-MoE's float16 graph put the long
    prompts' spread at 2.1 and excused 6 of their 110 positions; the sound graph's was 1.0, itself a near tie a
    shadow run took the other way (a review). Now both are 0.012, and nothing is excused."""
    from conftest import FUSED_HEAD_DIM
    from export_helpers import scale_graph_weight

    from export.verify import verify_export

    folder = thinker_variant("qwen3_moe", head_dim=FUSED_HEAD_DIM)
    export = shutil.copytree(onnx_variant("qwen3_moe", dtype="float16", graph="plain"), tmp_path / "onnx")
    sound = verify_export(folder, export / "model.onnx", torch.float16)["long_prompts"]
    scale_graph_weight(export / "model.onnx", "model.layers.0.self_attn.o_proj.weight", 1.1)
    planted = verify_export(folder, export / "model.onnx", torch.float16)
    long = planted["long_prompts"]
    assert planted["passed"] is False
    assert long["positions_excused"] == 0 and long["half_precision_spread"] < 4 * sound["half_precision_spread"], long
    assert sound["routes_followed"] == 0, sound  # the shadows' runs take routes, but the figures are the reference's
