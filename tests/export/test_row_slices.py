"""Row slices of wide 8-bit MatMulNBits (export/row_slices.py), which the accuracy guard's float-activation sessions
run to keep onnxruntime from dequantizing a whole head at once: the sliced graph must compute the unsliced one's
logits (each slice a byte range of the same weights file: a wrong offset or length reads other rows), and leave
alone what it must not touch (4-bit nodes, other accuracy levels, weights not in external data)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from export.quantize import QuantizeSpec


@pytest.fixture(scope="module")
def int8_export(thinker_variant, tmp_path_factory):
    from export.exporter import export_model

    out = tmp_path_factory.mktemp("row-slices") / "int8"
    spec = QuantizeSpec(bits=8, block_size=16)
    export_model(thinker_variant("qwen3", head_dim=16), out, graph="fused", quantize=spec, verify=False)
    return out / "model.onnx"


def float_activation_logits(model: onnx.ModelProto, onnx_path, split_bytes: int | None) -> tuple[np.ndarray, list]:
    """Every position's logits of ``model`` with all MatMulNBits at accuracy level 1, its wide ones split into
    slices of ``split_bytes`` (None: unsplit)."""
    from export import accuracy_guard
    from export.row_slices import split_wide_matmuls
    from export.runtime import OnnxDecoder

    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    accuracy_guard.set_levels(variant, {n.name: 1 for n in variant.graph.node if n.op_type == "MatMulNBits"})
    split = [] if split_bytes is None else split_wide_matmuls(variant, slice_bytes=split_bytes)
    with accuracy_guard.graph_variant(variant, onnx_path, {}) as path:
        decoder = OnnxDecoder(path, provider="cpu", all_positions=True)
        ids = np.random.default_rng(0).integers(1, 90, size=(2, 24))
        return decoder.prefill(ids, np.ones_like(ids))[0], split


def test_sliced_matmuls_give_the_unsliced_logits(int8_export):
    model = onnx.load(int8_export, load_external_data=False)
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMulNBits")
    k = next(helper.get_attribute_value(a) for a in head.attribute if a.name == "K")
    expected, _ = float_activation_logits(model, int8_export, None)
    # slices of 7 rows: uneven, so the last slice is shorter and every offset is off any alignment
    logits, split = float_activation_logits(model, int8_export, 7 * 4 * k)
    assert "/lm_head/MatMulNBits" in split and len(split) > 1, split
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_slicing_leaves_4_bit_nodes_other_levels_and_inline_weights_alone(int8_export):
    from export import accuracy_guard
    from export.row_slices import split_wide_matmuls

    model = onnx.load(int8_export, load_external_data=False)
    assert split_wide_matmuls(model, levels=frozenset({1}), slice_bytes=1) == []  # every node is at level 4
    accuracy_guard.set_levels(model, {n.name: 1 for n in model.graph.node if n.op_type == "MatMulNBits"})
    four_bit = onnx.ModelProto()
    four_bit.CopyFrom(model)
    for node in four_bit.graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "bits":
                attribute.i = 4
    assert split_wide_matmuls(four_bit, slice_bytes=1) == []
    inline = onnx.load(int8_export, load_external_data=True)  # every weight in the proto itself
    accuracy_guard.set_levels(inline, {n.name: 1 for n in inline.graph.node if n.op_type == "MatMulNBits"})
    assert split_wide_matmuls(inline, slice_bytes=1) == []
    count = len([n for n in model.graph.node if n.op_type == "MatMulNBits"])
    assert len(split_wide_matmuls(model, slice_bytes=1)) == count  # and at level 1, 8-bit, external: all of them


def test_each_slice_holds_at_most_its_bytes_in_float32(int8_export):
    """The memory bound the guard's sessions rely on: every slice's weight, dequantized to float32 (4 bytes a value),
    fits ``slice_bytes`` (a mutation counting one byte a value made the slices 4x wider, and their buffers with
    them, and passed every test); slices of at most that many rows cover every row once."""
    from export import accuracy_guard
    from export.row_slices import split_wide_matmuls

    model = onnx.load(int8_export, load_external_data=False)
    accuracy_guard.set_levels(model, {n.name: 1 for n in model.graph.node if n.op_type == "MatMulNBits"})
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMulNBits")
    attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
    slice_bytes = 7 * 4 * attrs["K"]
    assert "/lm_head/MatMulNBits" in split_wide_matmuls(model, slice_bytes=slice_bytes)
    slices = [n for n in model.graph.node if n.name.startswith("/lm_head/MatMulNBits.rows")]
    widths = [next(helper.get_attribute_value(a) for a in n.attribute if a.name == "N") for n in slices]
    assert max(widths) * 4 * attrs["K"] <= slice_bytes and max(widths) == 7, widths
    assert sum(widths) == attrs["N"], widths


def test_sliced_matmuls_with_zero_points_give_the_unsliced_logits(thinker_variant, tmp_path):
    """``--algo rtn-asym``: each slice reads its own rows' zero points (a flat uint8 run per row), not the first
    slice's (a mutation run that left the zero points unsliced, or cut them by the packed weight's first axis, passed
    every test: the module's fixture is symmetric, with no zero points)."""
    from export.exporter import export_model

    spec = QuantizeSpec(bits=8, block_size=16, algo="rtn-asym")
    export_model(thinker_variant("qwen3", head_dim=16), tmp_path / "asym", graph="fused", quantize=spec, verify=False)
    path = tmp_path / "asym" / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMulNBits")
    assert len(head.input) > 3 and head.input[3], list(head.input)  # zero points
    k = next(helper.get_attribute_value(a) for a in head.attribute if a.name == "K")
    expected, _ = float_activation_logits(model, path, None)
    logits, split = float_activation_logits(model, path, 7 * 4 * k)
    assert "/lm_head/MatMulNBits" in split, split
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
