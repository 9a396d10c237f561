"""What ``--graph plain`` promises (its --help, README): standard ONNX operators only, a graph any runtime can run
and onnx's own checker passes whole; under ``--quantize`` its projections (and a tied embedding) are onnxruntime's
MatMulNBits (GatherBlockQuantized), which only onnxruntime runs, and nothing else is."""

from __future__ import annotations

import onnx
import pytest
from export_helpers import graph_nodes

from export.quantize import QuantizeSpec

ONNXRUNTIME_QUANTIZED_OPS = {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized")}


def nonstandard_ops(model_path) -> set[tuple[str, str]]:
    return {(n.domain, n.op_type) for n in graph_nodes(model_path) if n.domain not in ("", "ai.onnx")}


@pytest.mark.parametrize(
    "family, dtype",
    [("qwen2", "float32"), ("qwen3_moe", "float32"), ("gpt2", "float32"), ("qwen3", "float16")],
)
def test_a_plain_graph_is_standard_onnx(family, dtype, onnx_folder):
    model = onnx_folder(family, dtype) / "model.onnx"
    assert nonstandard_ops(model) == set()
    onnx.checker.check_model(str(model), full_check=True)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_a_plain_hybrid_graph_is_standard_onnx(family, onnx_variant):
    model = onnx_variant(family, graph="plain", head_dim=None) / "model.onnx"
    assert nonstandard_ops(model) == set()
    onnx.checker.check_model(str(model), full_check=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_plain_graph_adds_onnxruntimes_quantized_ops_only(bits, onnx_variant):
    model = onnx_variant("qwen3_moe", graph="plain", quantize=QuantizeSpec(bits=bits, block_size=16)) / "model.onnx"
    found = nonstandard_ops(model)
    assert ("com.microsoft", "MatMulNBits") in found and found <= ONNXRUNTIME_QUANTIZED_OPS, found
