"""Gated DeltaNet graph details that the other tests do not reach (mutation runs of export/linear_attention_graph.py).

The fused graph's padded branch reads the conv's past through the gathered window (``FusedGatedDeltaNetGraph.
emit_conv``), so that where onnxruntime-genai binds one buffer as a linear layer's past and present (genai_config's
past_present_share_buffer) the gather writing ``present`` cannot overwrite ``past`` before the conv has read it. In
the export as it is, onnxruntime (CPU, measured) hands an If branch's outputs to the bound buffer only when the
branch is done, so a conv reading ``past`` directly gives the same numbers there; with the branch inlined (a
constant condition, which onnxruntime folds) the gather writes the shared buffer first, and only the data path keeps
the conv's past. And GatedDeltaNetDims' own refusals, which the CLI's earlier config check hides."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_onnx_hybrid import LINEAR_STATES, hybrid_export, left_padded

from export.linear_attention_graph import GatedDeltaNetDims
from export.runtime import OnnxDecoder, position_ids_from_mask


def run_sharing_linear_states(decoder, ids, mask, positions, cache, buffers):
    """One step with each linear-attention state bound as both past and present (``buffers``, updated in place);
    the KV in ``cache`` as the graph's past, its presents written back there. Returns the logits."""
    binding = decoder.session.io_binding()
    for name, value in (
        ("input_ids", ids),
        ("attention_mask", mask),
        ("position_ids", decoder.graph_positions(positions)),
    ):
        binding.bind_cpu_input(name, np.ascontiguousarray(value, dtype=np.int64))
    binding.bind_output("logits")
    for past, present in zip(decoder.past_names, decoder.present_names, strict=True):
        if past in buffers:
            binding.bind_ortvalue_input(past, buffers[past])
            binding.bind_ortvalue_output(present, buffers[past])
        else:
            binding.bind_cpu_input(past, np.ascontiguousarray(cache[past]))
            binding.bind_output(present)
    decoder.session.run_with_iobinding(binding)
    logits, *presents = binding.get_outputs()
    for past, value in zip(decoder.past_names, presents, strict=True):
        if past not in buffers:
            cache[past] = value.numpy()
    return logits.numpy()


def padded_branch_only(folder, tmp_path):
    """The export with each linear layer's If fed a constant false: onnxruntime inlines the padded branch into the
    main graph, where the node writing a state's present writes the buffer bound as its output directly (inside an
    If, the branch's outputs reach the bound buffer only when the branch is done)."""
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    branches = [node for node in model.graph.node if node.op_type == "If"]
    assert branches
    for node in branches:
        node.input[0] = "never_unpadded"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([False]), "never_unpadded"))
    (tmp_path / "model.onnx.data").write_bytes((folder / "model.onnx.data").read_bytes())
    onnx.save(model, str(tmp_path / "model.onnx"))
    return tmp_path / "model.onnx"


@pytest.mark.parametrize("graph", ["branching", "padded_only"])
def test_fused_linear_states_in_one_buffer_through_masked_steps(graph, onnx_variant, tmp_path):
    """After a left-padded prompt, decode steps of which two mask row 1's token (the padded branch, with a non-zero
    conv state): the linear states bound as one buffer for past and present give the logits and states of the
    caller that keeps them apart (the exported graph as onnxruntime-genai runs it), within 1e-5 of the logit
    scale; in the export as it is and with the padded branch inlined. There a conv reading ``past`` itself, after
    the gather has written the shifted window into the same buffer, convolves the new tokens with the wrong past."""
    folder = hybrid_export(onnx_variant, "qwen3_5", "fused")
    decoder = OnnxDecoder(folder, provider="cpu", share_kv=False)
    shared = decoder if graph == "branching" else OnnxDecoder(padded_branch_only(folder, tmp_path), provider="cpu")
    ids, mask = left_padded((9, 6), seed=2)
    prompt, state = decoder.prefill(ids, mask)
    linear = [name for name in decoder.past_names if name.endswith(LINEAR_STATES)]
    assert linear and all(np.abs(state.cache[name]).max() > 0 for name in linear)
    cache = {name: np.array(value, copy=True) for name, value in state.cache.items()}
    buffers = {name: ort.OrtValue.ortvalue_from_numpy(cache.pop(name)) for name in linear}
    scale = max(1.0, float(np.abs(prompt[mask.astype(bool)]).max()))
    rng = np.random.default_rng(7)
    for step, keep in enumerate(([1, 1], [1, 0], [1, 1], [0, 1], [1, 1])):
        token = rng.integers(3, 96, size=(2, 1))
        mask = np.concatenate([mask, np.array(keep)[:, None]], axis=1)
        positions = position_ids_from_mask(mask)[:, -1:]
        state.attention_mask = mask
        expected = decoder.forward(token, positions, state)
        got = run_sharing_linear_states(shared, token, mask, positions, cache, buffers)
        np.testing.assert_allclose(got, expected, atol=1e-5 * scale, rtol=0, err_msg=f"step {step}")
        for name in linear:
            np.testing.assert_allclose(
                buffers[name].numpy(), state.cache[name], atol=1e-6, rtol=0, err_msg=f"step {step}: {name}"
            )


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(conv_kernel=1), "linear_conv_kernel_dim=1: the carried conv state needs a kernel >= 2"),
        (dict(num_value_heads=3), "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ],
    ids=["kernel of 1", "value heads"],
)
def test_layer_sizes_the_graph_cannot_carry_are_refused_by_key(sizes, message):
    """GatedDeltaNetDims, which a caller building a layer graph directly (as test_linear_attention_graph does)
    meets before the exporter's own config check (export/decoder_graph.py): a conv kernel of 1 leaves no conv
    state, and value heads must share the key heads evenly; each refused naming the config key."""
    dims = dict(hidden_size=32, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GatedDeltaNetDims(**{**dims, **sizes}, rms_norm_eps=1e-6)


def test_a_cut_graph_that_the_checker_refuses_is_an_exporter_bug_in_one_line(tmp_path):
    """export/graph_walk.save_checked, which writes each graph cut from model.onnx (genai, embeds): a graph reading
    a name nothing defines is refused naming the file and calling it the exporter's bug; a valid one is written."""
    from onnx import TensorProto, helper

    from export.graph_walk import save_checked

    def model(source: str) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
        graph = helper.make_graph([helper.make_node("Relu", [source], ["y"])], "cut", [x], [y])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])

    save_checked(model("x"), tmp_path / "good.onnx")
    assert onnx.load(tmp_path / "good.onnx").graph.node[0].input == ["x"]
    with pytest.raises(RuntimeError, match=r"^bad\.onnx is invalid \(a bug in the exporter\): .*undefined"):
        save_checked(model("undefined"), tmp_path / "bad.onnx")


def test_the_registered_rmsnorm_schema_takes_onnxruntimes_optional_output(tmp_path):
    """export/contrib_schemas declares SimplifiedLayerNormalization with the outputs onnxruntime's schema lists: a
    node writing Y and the optional float32 inv_std_var (which onnxruntime runs) passes onnx.checker, and so does a
    float16 one; a third output is refused by the checker."""
    from onnx import TensorProto, helper

    from export.contrib_schemas import register_onnxruntime_schemas

    register_onnxruntime_schemas()

    def model(outputs: list[str], dtype=TensorProto.FLOAT) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", dtype, [2, 4])
        scale = helper.make_tensor("scale", dtype, [4], [1.0, 2.0, 3.0, 4.0])
        results = [
            helper.make_tensor_value_info(name, dtype, [2, 4])
            if name == "y"
            else helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 1])
            for name in outputs
        ]
        node = helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], outputs, axis=-1, epsilon=1e-6)
        graph = helper.make_graph([node], "rmsnorm", [x], results, initializer=[scale])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)

    both = model(["y", "inv_std_var"])
    onnx.checker.check_model(both, full_check=True)
    onnx.checker.check_model(model(["y"], TensorProto.FLOAT16), full_check=True)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model(["y", "inv_std_var", "extra"]), full_check=True)

    x = np.array([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
    y, inv_std_var = ort.InferenceSession(both.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    expected_inv = 1 / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(inv_std_var.reshape(2, 1), expected_inv, rtol=1e-5)
    np.testing.assert_allclose(y, x * expected_inv * [1.0, 2.0, 3.0, 4.0], rtol=1e-5)
