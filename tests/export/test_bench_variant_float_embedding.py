"""bench/variant_float_embedding.py, the measurement-only copy of a quantized export whose tied embedding is the float
table again: it must hold exactly the source Thinker's float table, and nothing else may change, or bench_int8.py's
"float embedding" row would explain the int8 exports' fidelity by something else. The quantized verify holds it to
that: the copy's graph against the PyTorch Thinker with the same dequantized projections and its own float
embedding, at the float tolerance (the same check fails a graph whose embedding is off by its rounding:
test_quantized_embedding.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import torch

from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate, verify_quantized_export

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "variant_float_embedding.py"
INT8 = QuantizeSpec(bits=8, block_size=16)
NO_GATE = QualityGate(min_top1=0.0, max_perplexity_increase=float("inf"))


def test_the_copy_gathers_the_float_table_and_keeps_every_quantized_projection(thinker_variant, onnx_variant, tmp_path):
    model_dir = thinker_variant("qwen3", head_dim=16, tie_word_embeddings=True)
    source = onnx_variant("qwen3", quantize=INT8, tie_word_embeddings=True)
    copy = tmp_path / "float-embedding"
    subprocess.run([sys.executable, str(SCRIPT), str(source), str(copy)], check=True, capture_output=True)

    for graph_file in ("model.onnx", "model.genai.onnx"):
        before = onnx.load(source / graph_file, load_external_data=False).graph
        after = onnx.load(copy / graph_file, load_external_data=False).graph
        assert [n for n in before.node if n.op_type == "GatherBlockQuantized"], graph_file
        assert not [n for n in after.node if n.op_type == "GatherBlockQuantized"], graph_file
        matmuls = [[n.input[1] for n in g.node if n.op_type == "MatMulNBits"] for g in (before, after)]
        assert matmuls[0] and matmuls[0] == matmuls[1], graph_file  # the head's tensors still feed the head

    checked = verify_quantized_export(model_dir, copy / "model.onnx", torch.float32, INT8.bits, NO_GATE)
    assert checked["passed"] is True, checked
    assert checked["weights"]["embedding"] == "Gather (float)", checked["weights"]
