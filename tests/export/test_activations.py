"""The exported activations against transformers' own (``ACT2FN``), one emitter alone, in float32 over the range a
model's pre-activations reach: a constant typed wrong (gelu_new's 0.044715 as 0.04475, a QA run's mutation) moved a
GPT-2 export's logits by 1e-5 of their scale, a tenth of the export check's tolerance, and passed it; alone, the
activation is 2e-5 off (at outputs up to 12) where onnxruntime's sound ones are within 1e-6 (its Sigmoid's tail)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from export_helpers import component_session
from onnx import TensorProto
from transformers.activations import ACT2FN

from export.decoder_graph import DecoderGraph
from export.graph_builder import GraphBuilder, WeightFile, value_info

ACTIVATIONS = ["silu", "swish", "relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu"]


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_each_activation_is_transformers_own(act, tmp_path):
    weights = WeightFile(tmp_path / f"{act}.onnx.data")
    b = GraphBuilder(weights)
    emitter = SimpleNamespace(b=b, config=SimpleNamespace(hidden_act=act), dtype=torch.float32)
    emitter.scalar = lambda value: DecoderGraph.scalar(emitter, value)
    out = DecoderGraph.emit_activation(emitter, "x")
    b.op_to("Identity", [out], ["y"])
    session = component_session(
        b,
        weights,
        act,
        [value_info("x", TensorProto.FLOAT, ["n"])],
        [value_info("y", TensorProto.FLOAT, ["n"])],
        tmp_path,
    )
    x = torch.linspace(-12, 12, 4801)
    expected = ACT2FN[act](x).numpy()
    (actual,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
