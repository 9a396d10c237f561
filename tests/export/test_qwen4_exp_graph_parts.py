"""Parts of the Qwen3.8 (``qwen4_exp``) graph that tests/export/test_onnx_qwen4_exp.py's family does not reach: a
model with plain partial RoPE ((B, T) positions, one row of index positions) and a dense MLP layer among the sparse
ones, exported whole (export/qwen4_exp_graph.py ``emit_slot_tables``'s and ``emit_stream_layer``'s other branches),
and the hyper-connection emitters (export/hyper_connection_graph.py) alone against ``ThinkerHyperConnection``.

Tolerances: the whole model as test_onnx_qwen4_exp.py holds it (float32, 1e-4 x max(1, logit scale)); the emitters
alone 1e-5 in float32 and 1e-2 in float16, absolute, on values of order one.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_helpers import component_session, save_thinker
from seeded_weights import randomize_parameters
from test_onnx_qwen4_exp import bound, long_left_padded

from export.exporter import export_model
from export.graph_builder import TORCH_TO_ONNX, GraphBuilder, WeightFile, value_info
from export.hyper_connection_graph import emit_hyper_connection, emit_inject
from export.runtime import OnnxDecoder
from export.verify import compare_decoders
from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import ThinkerHyperConnection

FAMILY = "qwen4_exp"
TEXT_ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}


# --- the whole model: plain RoPE, a dense layer ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_rope_folder(tmp_path_factory):
    """The family with (B, T) positions (no mrope_section) and layer 2 dense (an MLP where the others hold experts)."""
    folder = tmp_path_factory.mktemp("qwen4-exp-text-rope") / "thinker"
    return save_thinker(folder, FAMILY, rope_parameters=TEXT_ROPE, mlp_only_layers=[2], intermediate_size=40)


@pytest.mark.parametrize("graph", ["plain", "fused"])
def test_text_rope_and_a_dense_layer_match_pytorch(text_rope_folder, tmp_path, graph):
    """The left-padded long prompts (every indexer prunes) and 4 decode steps: the index positions carried as one
    row (B, 1, P), the dense layer run as an MLP."""
    out = tmp_path / "onnx"
    export_model(text_rope_folder, out, graph=graph, verify=False, progress=False)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["past_key_values.1.index_positions"] == [0, 1, 0], inputs
    assert inputs["position_ids"] == [0, 0], inputs
    thinker = ThinkerForCausalLM.from_pretrained(text_rope_folder, dtype=torch.float32).eval()
    assert thinker.config.mlp_layer_types[2] == "dense"
    figures = compare_decoders(thinker, OnnxDecoder(out, provider="cpu"), *long_left_padded(), steps=4)
    assert figures["max_abs_diff"] <= bound(figures), figures
    assert figures["top1_agreement"] == 1.0, figures


# --- the hyper-connection emitters alone ----------------------------------------------------------------------------
def hc_config(**overrides) -> ThinkerConfig:
    fields = dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    return ThinkerConfig(**(fields | dict(hc_count=3, hc_lowrank=4, norm_zero_centered=True) | overrides))


def hc_session(config: ThinkerConfig, module: ThinkerHyperConnection, dtype: torch.dtype, folder, inject: bool):
    """streams and the sub-layer's output in; the mixed input and (with ``inject``) the injected streams out."""
    weights = WeightFile(folder / "hc.onnx.data")
    b = GraphBuilder(weights)
    state = {f"hc.{name}": tensor.detach().to(dtype) for name, tensor in module.state_dict().items()}
    mixed, injection = emit_hyper_connection(b, config, "hc", state.__getitem__, "streams", dtype, inject=inject)
    b.op_to("Identity", [mixed], ["mixed"])
    onnx_dtype, width = TORCH_TO_ONNX[dtype], config.hc_count * config.hidden_size
    inputs = [value_info("streams", onnx_dtype, ["batch", "seq", width])]
    outputs = [value_info("mixed", onnx_dtype, ["batch", "seq", config.hidden_size])]
    if inject:
        b.op_to("Identity", [emit_inject(b, "streams", "output", injection)], ["injected"])
        inputs.append(value_info("output", onnx_dtype, ["batch", "seq", config.hidden_size]))
        outputs.append(value_info("injected", onnx_dtype, ["batch", "seq", width]))
    return component_session(b, weights, "hc", inputs, outputs, folder, threads=1)


HC_CASES = {
    "zero-centred": (torch.float32, True, {}, 1e-5),
    "plain-norm": (torch.float32, True, {"norm_zero_centered": False}, 1e-5),
    "final-mix": (torch.float32, False, {}, 1e-5),
    "float16": (torch.float16, True, {}, 1e-2),
}


@pytest.mark.parametrize("case", list(HC_CASES))
@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["unit", "tiny"])
def test_hyper_connection_matches_the_module(tmp_path, case, scale):
    """Streams of order one, and tiny ones (1e-3: their mean square is the norm's epsilon, 1e-6): the mixed input
    and the streams after injection, as ``ThinkerHyperConnection`` computes them."""
    dtype, inject, overrides, tolerance = HC_CASES[case]
    config = hc_config(**overrides)
    module = randomize_parameters(ThinkerHyperConnection(config, inject=inject), seed=4).eval().to(dtype)
    generator = torch.Generator().manual_seed(5)
    width = config.hc_count * config.hidden_size
    streams = (scale * torch.randn(2, 5, width, generator=generator)).to(dtype)
    output = torch.randn(2, 5, config.hidden_size, generator=generator).to(dtype)
    session = hc_session(config, module, dtype, tmp_path, inject)
    feeds = {"streams": streams.numpy()} | ({"output": output.numpy()} if inject else {})
    got = session.run(None, feeds)
    with torch.no_grad():
        mixed, weights = module(streams)
    expected = [mixed] + ([ThinkerHyperConnection.inject(streams, output, weights)] if inject else [])
    for ours, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(ours.astype(np.float32), theirs.float().numpy(), atol=tolerance, rtol=0)


# --- the PLE gate below its floor -----------------------------------------------------------------------------------
def test_ple_gate_below_its_floor(tmp_path):
    """norm_query scaled to ~1e-7 (zero-centred weights of -1 + 1e-7): every key . query / sqrt(C) lies below the
    gate's floor of 1e-6, where ``ThinkerPLELayer`` takes sqrt(1e-6) (sigmoid(±1e-3)) and not sqrt(|g|): the
    addition and the states as the PyTorch layer's over test_ple_graph.py's left-padded scenario."""
    from test_ple_graph import FLOAT32_TOLERANCE, LAYER, SCENARIOS, OnnxPLE, TorchPLE, export_ple, run, tiny_config
    from test_ple_graph import tiny_model as ple_model

    config = tiny_config()
    model = ple_model(config, torch.float32)
    ple = model.model.layers[LAYER].ple
    with torch.no_grad():
        ple.norm_query.weight.fill_(-1.0 + 1e-7)
        streams = torch.randn(2, 6, config.hc_count * config.hidden_size, generator=torch.Generator().manual_seed(0))
        assert ple.norm_query(streams).abs().max() < 1e-6  # the premise: queries this small, so is every g
    scenario = SCENARIOS["left-padded"]
    onnx_side = OnnxPLE(export_ple(config, model, torch.float32, tmp_path), config, len(scenario.lengths), np.float32)
    diffs = run(TorchPLE(model), onnx_side, scenario, config.hc_count * config.hidden_size, torch.float32)
    assert diffs["ngram states equal"], diffs
    assert max(diffs["addition"], diffs["conv state"]) <= FLOAT32_TOLERANCE, diffs
