"""onnxruntime's own tools, run on an export as users run them on any ONNX model: shape inference, the ORT format,
the transformers optimizer, float16 conversion and the quantizers. Each tool's output must load in onnxruntime and
give the export's logits: exactly where the tool only annotates or re-encodes the graph, within the tool's own
rounding where it changes the arithmetic. README, "In onnxruntime's own tools", lists these and the two that fail
on onnxruntime's side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from export_helpers import graph_nodes

from export.names import MODEL_FILE


@pytest.fixture(autouse=True)
def in_a_scratch_folder(tmp_path, monkeypatch) -> None:
    """onnxruntime's tools write scratch files into the working directory (SymbolicShapeInference's
    sym_shape_infer_temp.onnx, external data under a random name): run each test in its own folder, so that none is
    left in the repository (one was committed once)."""
    monkeypatch.chdir(tmp_path)


def prefill_feeds(session: ort.InferenceSession, batch: int = 2, length: int = 6) -> dict[str, np.ndarray]:
    """A left-padded prompt through an empty cache, for whatever inputs the graph takes."""
    mask = np.ones((batch, length), np.int64)
    mask[1, :2] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    feeds = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = np.random.default_rng(0).integers(4, 90, (batch, length))
        elif value.name == "attention_mask":
            feeds[value.name] = mask
        elif value.name == "position_ids":
            feeds[value.name] = positions
        else:  # an empty cache: (batch, kv heads, 0, head size)
            dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[value.type]
            feeds[value.name] = np.zeros((batch, value.shape[1], 0, value.shape[3]), dtype)
    return feeds


def run(path: Path) -> np.ndarray:
    """The logits at the prompt's real tokens, (real tokens, vocab): a pad's are whatever a graph makes of them."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = prefill_feeds(session)
    return session.run(["logits"], feeds)[0][feeds["attention_mask"] == 1].astype(np.float32)


def relative(logits: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


@pytest.fixture(params=["plain", "fused"])
def float_export(request, onnx_folder, onnx_variant) -> Path:
    """A float32 Qwen3 export, ``--graph plain`` or the fused default."""
    return (onnx_folder("qwen3") if request.param == "plain" else onnx_variant("qwen3")) / MODEL_FILE


def test_symbolic_shape_inference(float_export, tmp_path):
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # auto_merge: the cache's length is named past_sequence_length + sequence_length where the graph concatenates
    # it and total_sequence_length at the mask, which this tool merges only when asked (its own CLI's --auto_merge)
    inferred = SymbolicShapeInference.infer_shapes(onnx.load(str(float_export)), auto_merge=True)
    assert relative(run(save(inferred, tmp_path / "inferred.onnx")), run(float_export)) == 0


def test_ort_format(float_export, tmp_path):
    converted = tmp_path / "ort"
    command = [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(float_export)]
    done = subprocess.run([*command, "--output_dir", str(converted)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert relative(run(converted / "model.ort"), run(float_export)) == 0


def test_transformers_optimizer_on_the_fused_graph(onnx_variant, tmp_path):
    """The fused graph already holds what the optimizer fuses; on the plain graph the optimizer stops inside
    onnxruntime (its fusion_simplified_layernorm indexes a NodeProto in the branch for x * x; README)."""
    from onnxruntime.transformers.optimizer import optimize_model

    exported = onnx_variant("qwen3") / MODEL_FILE
    optimized = optimize_model(str(exported), model_type="gpt2", num_heads=0, hidden_size=0, opt_level=0)
    path = tmp_path / "optimized.onnx"
    optimized.save_model_to_file(str(path), use_external_data_format=True)
    assert relative(run(path), run(exported)) < 1e-6


def test_float16_conversion(float_export, tmp_path):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(onnx.load(str(float_export)), keep_io_types=True)
    logits, expected = run(save(half, tmp_path / "half.onnx")), run(float_export)
    assert relative(logits, expected) < 1e-2  # measured 1.6e-3 (plain) and 2.2e-3 (fused)
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_dynamic_int8_quantization_of_the_plain_graph(onnx_folder, tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    exported = onnx_folder("qwen3") / MODEL_FILE
    quantized = tmp_path / "int8.onnx"
    quantize_dynamic(str(exported), str(quantized), weight_type=QuantType.QInt8, use_external_data_format=True)
    assert any(node.op_type == "DynamicQuantizeLinear" for node in graph_nodes(quantized))
    assert relative(run(quantized), run(exported)) < 0.2  # measured 4.9e-2: int8 weights and activations


def test_dynamic_int8_quantization_of_the_fused_graph_after_its_pre_processing(onnx_variant, tmp_path):
    """The default (fused) graph's contrib ops leave onnxruntime's own shape inference without the types
    ``quantize_dynamic`` asks for ("Unable to find data type for weight_name=...", a QA run): its
    ``quant_pre_process`` with ``auto_merge`` (symbolic shapes) first, as README says."""
    from onnxruntime.quantization import QuantType, quant_pre_process, quantize_dynamic

    exported = onnx_variant("qwen3") / MODEL_FILE
    with pytest.raises(RuntimeError, match="Unable to find data type"):  # onnxruntime's side: pinned, as above
        quantize_dynamic(str(exported), str(tmp_path / "bare.onnx"), weight_type=QuantType.QInt8)
    prepared, quantized = tmp_path / "prepared.onnx", tmp_path / "int8.onnx"
    quant_pre_process(str(exported), str(prepared), auto_merge=True, save_as_external_data=True)
    quantize_dynamic(str(prepared), str(quantized), weight_type=QuantType.QInt8, use_external_data_format=True)
    assert any(node.op_type == "DynamicQuantizeLinear" for node in graph_nodes(quantized))
    assert relative(run(quantized), run(exported)) < 0.2  # as the plain graph's


def test_matmul_nbits_quantizer(float_export, tmp_path):
    """What ``--quantize int4`` runs for the projections, run by hand on a float export (without the head and
    embedding layouts, the accuracy guard and the check that ``--quantize`` adds)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(float_export)), block_size=32, is_symmetric=True)
    quantizer.process()
    path = tmp_path / "int4.onnx"
    quantizer.model.save_model_to_file(str(path), use_external_data_format=True)
    assert any(node.op_type == "MatMulNBits" for node in graph_nodes(path))
    logits = run(path)
    assert np.isfinite(logits).all()
    assert relative(logits, run(float_export)) < 0.5  # random weights at 4 bits: 0.32 (plain), 0.28 (fused)


# Two tools that fail on onnxruntime's side (README, "In onnxruntime's own tools"): pinned, so that the README is
# mended the day an onnxruntime release fixes either.


def test_the_transformers_optimizer_stops_inside_onnxruntime_on_the_plain_graph(onnx_folder):
    from onnxruntime.transformers.optimizer import optimize_model

    with pytest.raises(TypeError, match="'NodeProto' object is not subscriptable") as raised:
        optimize_model(str(onnx_folder("qwen3") / MODEL_FILE), model_type="gpt2", num_heads=0, hidden_size=0)
    assert raised.traceback[-1].path.name == "fusion_simplified_layernorm.py"


def test_float16_conversion_of_a_fused_hybrid_graph_does_not_load(onnx_variant, tmp_path):
    from onnxruntime.transformers.float16 import convert_float_to_float16

    exported = onnx_variant("qwen3_5", head_dim=None) / MODEL_FILE
    half = save(convert_float_to_float16(onnx.load(str(exported)), keep_io_types=True), tmp_path / "half.onnx")
    with pytest.raises(Exception, match=r"dt_bias\) of operator \(LinearAttentionGate\)"):
        ort.InferenceSession(str(half), providers=["CPUExecutionProvider"])


def test_symbolic_shape_inference_stops_inside_onnxruntime_after_a_reduce_max(onnx_variant):
    """The hybrid graphs reduce the mask with ReduceMax, whose axes are an input from opset 18 on; onnxruntime
    1.31's SymbolicShapeInference cannot follow such a node (a two-node graph of ReduceMax and Unsqueeze stops it the
    same way), so it stops on every Qwen3.5 export, plain or fused (an audit)."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("ReduceMax", ["x", "axes"], ["m"]), helper.make_node("Unsqueeze", ["m", "axes"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.INT64, ["b", "t"])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, None)
    graph = helper.make_graph(nodes, "g", [x], [y], [axes])
    alone = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    for model in (alone, onnx.load(str(onnx_variant("qwen3_5", graph="plain", head_dim=None) / MODEL_FILE))):
        with pytest.raises(TypeError, match="'NoneType' has no len") as raised:
            SymbolicShapeInference.infer_shapes(model, auto_merge=True)
        assert raised.traceback[-1].path.name == "symbolic_shape_infer.py"


def test_symbolic_shape_inference_has_no_rule_for_a_tied_heads_fused_matmul(onnx_variant):
    """A tied head reads the embedding table itself through onnxruntime's FusedMatMul (transB), for which
    SymbolicShapeInference has no rule: it leaves the logits without a shape and stops (an audit, on SmolLM2)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    exported = onnx_variant("qwen3", tie_word_embeddings=True) / MODEL_FILE
    assert "FusedMatMul" in {node.op_type for node in onnx.load(str(exported), load_external_data=False).graph.node}
    with pytest.raises(Exception, match="Incomplete symbolic shape inference"):
        SymbolicShapeInference.infer_shapes(onnx.load(str(exported)), auto_merge=True)


def test_a_saved_optimized_float16_hybrid_graph_does_not_load(onnx_variant, tmp_path):
    """onnxruntime saves the optimized graph of a float16 fused Qwen3.5 export (``optimized_model_filepath``), but
    refuses to load it: its CPU kernels' float16 fallback gives the casts it inserts in both branches of the
    linear-attention If one name (an audit). The export itself loads and runs."""
    exported = onnx_variant("qwen3_5", dtype="float16", head_dim=None) / MODEL_FILE
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
    ort.InferenceSession(str(exported), options, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="single static assignment"):
        ort.InferenceSession(str(tmp_path / "optimized.onnx"), providers=["CPUExecutionProvider"])
