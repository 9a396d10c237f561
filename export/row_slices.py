"""Wide MatMulNBits nodes as row slices of the same weights, for sessions whose peak memory matters.

onnxruntime's CPU MatMulNBits at accuracy level 1 (float32 activations) dequantizes an 8-bit node's whole weight to
float32 for a prompt: for SmolLM2's 8-bit head, 49152 x 576 floats, 113 MB in one buffer. The accuracy guard
(export/accuracy_guard.py) runs such sessions over the written graph, and that buffer raised the int8 export's peak
RSS. Split into row slices (output columns) whose weights are byte ranges of the same external-data file (no copy)
and whose outputs are concatenated, the node computes the same products with one slice's buffer at a time (the same
logits to float32 rounding: MLAS tiles a narrower product differently). Only for a graph that is run and thrown
away: the shipped graph keeps one node per projection.
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

# A slice's float32 weight at most this many bytes (SmolLM2's 8-bit head: 29 slices of 1728 rows)
SLICE_BYTES = 4 << 20
_ROWS_BY_INPUT = (1, 2, 3, 5)  # MatMulNBits' inputs laid out by output row: B, scales, zero_points, bias (not g_idx)


def split_wide_matmuls(model: onnx.ModelProto, levels: frozenset[int] = frozenset({1}), slice_bytes=SLICE_BYTES):
    """Splits, in place, every 8-bit MatMulNBits at one of ``levels`` whose float32 weight exceeds ``slice_bytes``
    and whose row-laid inputs are all in external data; returns the names of the nodes split."""
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    split = []
    rewritten = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # 8-bit weights only: for 4-bit ones MLAS has float kernels that prepack the weight once, and slices of
        # those measured 30 MB more, not less (bench/bench_export_peak.py). The attributes' defaults are the op's.
        if node.op_type != "MatMulNBits" or attrs.get("accuracy_level", 0) not in levels or attrs.get("bits", 4) != 8:
            rewritten.append(node)
            continue
        rows_per_slice = max(1, slice_bytes // (4 * attrs["K"]))
        row_laid = [node.input[i] for i in _ROWS_BY_INPUT if i < len(node.input) and node.input[i]]
        if attrs["N"] <= rows_per_slice or not all(_external(initializers.get(name)) for name in row_laid):
            rewritten.append(node)
            continue
        rewritten += _slices(model, node, attrs, rows_per_slice, initializers)
        split.append(node.name)
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    return split


def _external(tensor: onnx.TensorProto | None) -> bool:
    return tensor is not None and tensor.data_location == onnx.TensorProto.EXTERNAL


def _slices(model, node, attrs, rows_per_slice, initializers) -> list[onnx.NodeProto]:
    """The slice nodes of ``node`` and the Concat of their outputs (under ``node``'s output name)."""
    out = []
    outputs = []
    for index, first in enumerate(range(0, attrs["N"], rows_per_slice)):
        rows = min(rows_per_slice, attrs["N"] - first)
        inputs = list(node.input)
        for i in _ROWS_BY_INPUT:
            if i < len(inputs) and inputs[i]:
                tensor = _row_range(initializers[inputs[i]], attrs["N"], first, rows, f"{inputs[i]}.rows{index}")
                model.graph.initializer.append(tensor)
                inputs[i] = tensor.name
        outputs.append(f"{node.output[0]}.rows{index}")
        out.append(
            helper.make_node(
                "MatMulNBits", inputs, [outputs[-1]], name=f"{node.name}.rows{index}", domain=node.domain,
                **{**attrs, "N": rows},
            )
        )  # fmt: skip
    out.append(helper.make_node("Concat", outputs, [node.output[0]], name=f"{node.name}.concat", axis=-1))
    return out


def _row_range(tensor: onnx.TensorProto, n: int, first: int, rows: int, name: str) -> onnx.TensorProto:
    """Rows ``first`` to ``first + rows`` of an external-data tensor laid out by the node's ``n`` output rows (its
    first axis, or a flat axis of ``n`` equal runs, as onnxruntime allows zero points): a byte range of the file."""
    location = {entry.key: entry.value for entry in tensor.external_data}
    per_row = math.prod(tensor.dims) // n
    row_bytes = per_row * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    dims = [rows, *tensor.dims[1:]] if tensor.dims[0] == n else [rows * per_row]
    piece = onnx.TensorProto(name=name, data_type=tensor.data_type, dims=dims)
    piece.data_location = onnx.TensorProto.EXTERNAL
    offset = int(location.get("offset", 0)) + first * row_bytes
    for key, value in (("location", location["location"]), ("offset", offset), ("length", rows * row_bytes)):
        piece.external_data.add(key=key, value=str(value))
    return piece
