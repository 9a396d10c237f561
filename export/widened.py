"""A bfloat16 export widened to float32, so that onnxruntime's CPU provider, which has no bfloat16 kernels, can run it
for ``--verify`` (export/verify.py ``verify_widened``).

The copy is the same graphs, node for node, with every bfloat16 in them made float32: the weights (each bfloat16
value is a float32 value, so they are the export's weights exactly), the casts to bfloat16, the constants, the
cache inputs and outputs. It runs the export's structure and weights in float32 arithmetic, against the PyTorch
Thinker holding the same rounded weights, to one bfloat16 ulp of the logit scale: a bug in the structure or the
weights shows 13 times smaller than the bfloat16 graph's own check on CUDA would see it. What it does not run is the
bfloat16 arithmetic itself, the rounding of activations between ops, which only CUDA runs (a cast to bfloat16 where
the graph should keep float32 is invisible here), as the report says.

The weights file is rewritten one tensor at a time, so the copy needs no more memory than its largest tensor.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto

from .graph_walk import all_graphs
from .weights_stamp import stamp_weights

# Where a graph's external tensors start in the rewritten file: aligned for onnxruntime's memory mapping, as
# onnx's own writer aligns them.
ALIGNMENT = 64

WIDENED = (
    "onnxruntime's CPU provider has no bfloat16 kernels, so the graphs ran widened to float32 (export/widened.py): "
    "the export's structure and bfloat16 weights, exactly, held to one bfloat16 ulp of the logit scale; its bfloat16 "
    "arithmetic runs on CUDA only"
)


def widened_folder(folder: Path, into: Path, replaced: dict[str, np.ndarray] | None = None) -> None:
    """Writes into the empty folder ``into`` every graph of the ONNX export ``folder`` widened to float32, the
    weights files they read, and the export's other (small) files as they are. ``replaced``: float32 values written
    for the tensors of those names instead of their own widened (where the shapes agree)."""
    replaced = replaced or {}
    graphs = {path.name: onnx.load(str(path), load_external_data=False) for path in sorted(folder.glob("*.onnx"))}
    spans = sorted({span for model in graphs.values() for span in external_spans(model.graph)})
    moved = write_widened_data(folder, into, spans, replaced)
    for name, model in graphs.items():
        for graph in all_graphs(model.graph):
            widen_graph(graph, moved, replaced)
        for location in {span.location for span in external_spans(model.graph)}:
            stamp_weights(model, into / location)
        onnx.save_model(model, str(into / name))
    for path in sorted(folder.iterdir()):
        if path.is_file() and not (into / path.name).exists():
            shutil.copyfile(path, into / path.name)


class Span(NamedTuple):
    """Where a graph's tensor lies in a weights file."""

    location: str
    offset: int
    length: int
    kind: int  # onnx element type
    name: str


def external_spans(graph: onnx.GraphProto) -> Iterator[Span]:
    """Every tensor ``graph`` and its subgraphs read from a weights file."""
    for body in all_graphs(graph):
        for tensor in body.initializer:
            if tensor.data_location == TensorProto.EXTERNAL:
                entry = {item.key: item.value for item in tensor.external_data}
                offset, length = int(entry.get("offset", 0)), int(entry["length"])
                yield Span(entry["location"], offset, length, tensor.data_type, tensor.name)


def write_widened_data(
    folder: Path, into: Path, spans: list[Span], replaced: dict[str, np.ndarray]
) -> dict[tuple[str, int], tuple[int, int]]:
    """Copies each of ``spans`` into a weights file of the same name in ``into``, a bfloat16 one widened and one
    named in ``replaced`` (of as many values) replaced; returns where each went: (file, old offset) -> (new
    offset, new length)."""
    moved: dict[tuple[str, int], tuple[int, int]] = {}
    for location in sorted({span.location for span in spans}):
        with open(folder / location, "rb") as source, open(into / location, "wb") as target:
            for span in spans:
                if span.location != location or (location, span.offset) in moved:
                    continue
                source.seek(span.offset)
                data = source.read(span.length)
                if span.kind == TensorProto.BFLOAT16:
                    data = widened_bytes(data)
                values = replaced.get(span.name)
                if values is not None and values.size * 4 == len(data):
                    data = values.astype(np.float32).tobytes()
                target.write(b"\0" * (-target.tell() % ALIGNMENT))
                moved[location, span.offset] = target.tell(), len(data)
                target.write(data)
    return moved


def widened_bytes(data: bytes) -> bytes:
    """bfloat16 values (little-endian) as float32 ones: the same sign, exponent and fraction, 16 zero bits below."""
    return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).tobytes()


def widen_graph(
    graph: onnx.GraphProto, moved: dict[tuple[str, int], tuple[int, int]], replaced: dict[str, np.ndarray]
) -> None:
    """Makes every bfloat16 of ``graph`` itself (not its subgraphs: ``all_graphs``) float32, its external tensors
    pointed at their places in the widened file (``moved``), and its tensors named in ``replaced`` replaced."""
    for tensor in graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            entry = {item.key: item for item in tensor.external_data}
            if "offset" not in entry:
                entry["offset"] = tensor.external_data.add(key="offset", value="0")
            offset, length = moved[entry["location"].value, int(entry["offset"].value)]
            entry["offset"].value, entry["length"].value = str(offset), str(length)
            if tensor.data_type == TensorProto.BFLOAT16:
                tensor.data_type = TensorProto.FLOAT
        else:
            widen_tensor(tensor, replaced.get(tensor.name))
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                widen_tensor(attribute.t)
            elif attribute.type == onnx.AttributeProto.INT and attribute.name in ("to", "dtype"):
                if attribute.i == TensorProto.BFLOAT16:  # Cast's target, a generator's output type
                    attribute.i = TensorProto.FLOAT


def widen_tensor(tensor: onnx.TensorProto, values: np.ndarray | None = None) -> None:
    """A bfloat16 tensor held in the graph itself made float32 (raw bytes, or onnx's int32 field of bit patterns),
    or ``values`` written in its place where they have its size."""
    if values is not None and values.size == np.prod(tensor.dims):
        tensor.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32).reshape(tensor.dims), tensor.name))
    elif tensor.data_type == TensorProto.BFLOAT16:
        widened = onnx.numpy_helper.to_array(tensor).astype(np.float32)
        tensor.CopyFrom(onnx.numpy_helper.from_array(widened, tensor.name))
