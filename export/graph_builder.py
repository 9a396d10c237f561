"""A small ONNX graph builder: nodes by op type, scoped names, weights streamed to one external-data file.

Weights never sit in the ModelProto: ``WeightFile.add`` appends each tensor's bytes to ``model.onnx.data`` the
moment it is emitted and returns a ``TensorProto`` that points into the file, so the proto stays a few hundred
kilobytes whatever the model size (no 2 GB protobuf limit) and the exporter holds one tensor at a time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

# Page-aligned offsets let onnxruntime memory-map the weights instead of copying them.
ALIGNMENT = 4096

TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def as_bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a uint8 array sharing its memory (no copy), through uint8 so that bfloat16,
    which numpy lacks, is written as is."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class WeightFile:
    """Appends tensors to one external-data file, each at a page-aligned offset."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close(), the builder's lifetime
        self.bytes_written = 0
        self.count = 0

    def add(self, name: str, tensor: torch.Tensor) -> TensorProto:
        return self._append(name, TORCH_TO_ONNX[tensor.dtype], list(tensor.shape), as_bytes_view(tensor))

    def add_array(self, name: str, array: np.ndarray) -> TensorProto:
        """A numpy array (what onnxruntime's quantizers hand back), by its own dtype."""
        array = np.ascontiguousarray(array)
        data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        return self._append(name, data_type, list(array.shape), array.reshape(-1).view(np.uint8))

    def add_raw(self, name: str, data_type: int, dims: list[int], data: np.ndarray) -> TensorProto:
        """A tensor's bytes as they are (a uint8 array), e.g. copied from another weights file."""
        return self._append(name, data_type, dims, data)

    def _append(self, name: str, data_type: int, dims: list[int], data: np.ndarray) -> TensorProto:
        pad = -self._file.tell() % ALIGNMENT
        self._write(b"\0" * pad)
        offset = self._file.tell()
        self._write(data)  # straight from the tensor's memory
        proto = TensorProto(name=name, data_type=data_type, dims=dims)
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", offset), ("length", data.nbytes)):
            proto.external_data.add(key=key, value=str(value))
        self.bytes_written += data.nbytes
        self.count += 1
        return proto

    def _write(self, data: bytes | np.ndarray) -> None:
        try:
            self._file.write(data)
        except OSError as err:  # a write's error names no file (a full disk, a file-size limit): the file's name
            raise OSError(err.errno, err.strerror, self.path.name) from err

    def close(self) -> None:
        try:
            self._file.close()  # writes what the buffer still holds
        except OSError as err:
            raise OSError(err.errno, err.strerror, self.path.name) from err


class GraphBuilder:
    """Collects nodes and initializers for one graph; ``subgraph()`` makes a builder for a Loop/If body.

    ``op("MatMul", a, b)`` adds a node and returns its output name (a tuple when ``outputs > 1``). Names carry the
    current ``scope`` (``/model/layers.3/attn/MatMul_2``), which keeps the graph readable in Netron and in profiles.
    """

    def __init__(self, weights: WeightFile | None, root: GraphBuilder | None = None, consts: str = "/const/") -> None:
        """``weights``: where ``weight`` streams to (None: a builder of constants and nodes only); ``consts``: the
        prefix of its constants' names, which must differ from an existing graph's that its nodes join."""
        self.weights = weights
        self._const_prefix = consts
        self.nodes: list[onnx.NodeProto] = []
        # Initializers always live in the main graph; a body reads them as outer-scope values.
        self._root = root or self
        self.initializers: list[TensorProto] = []
        self._weights: dict[str, tuple] = {}  # name -> (dtype, shape) of the weights written (root only)
        self._names: Counter = self._root._names if root else Counter()
        self._consts: dict = self._root._consts if root else {}
        self._scope: list[str] = []

    # --- naming -----------------------------------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def _unique(self, base: str) -> str:
        prefix = "/" + "/".join(self._scope) if self._scope else ""
        stem = f"{prefix}/{base}"
        self._names[stem] += 1
        count = self._names[stem]
        return stem if count == 1 else f"{stem}_{count - 1}"

    def fresh(self, base: str) -> str:
        """A model-wide unique value name (for graph inputs of a body)."""
        return self._unique(base)

    # --- nodes ------------------------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs) -> str | tuple[str, ...]:
        name = self._unique(op_type)
        names = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=name, **attrs))
        return names[0] if outputs == 1 else tuple(names)

    def op_to(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs) -> None:
        """A node whose outputs have given names (graph outputs such as ``present.0.key``)."""
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=self._unique(op_type), **attrs))

    def to_float32(self, x: str, dtype: torch.dtype) -> str:
        """``x``, held in ``dtype``, as float32, where a half-precision graph computes a step at float32
        precision as PyTorch does (norms, softmax, recurrences): no node in a float32 graph."""
        return x if dtype == torch.float32 else self.op("Cast", x, to=TensorProto.FLOAT)

    def to_dtype(self, x: str, dtype: torch.dtype) -> str:
        """A float32 ``x`` rounded once to ``dtype``, the inverse of ``to_float32``."""
        return x if dtype == torch.float32 else self.op("Cast", x, to=TORCH_TO_ONNX[dtype])

    # --- data -------------------------------------------------------------------------------------------------
    def weight(self, name: str, tensor: torch.Tensor | np.ndarray) -> str:
        """A model weight: streamed to the external-data file once, referenced by name. Naming it again (the two
        branches of an ``If`` read one weight) refers to the first, which must have the same dtype and shape."""
        key = (str(tensor.dtype), tuple(tensor.shape))
        written = self._root._weights.get(name)
        if written is None:
            add = self.weights.add_array if isinstance(tensor, np.ndarray) else self.weights.add
            self._root.initializers.append(add(name, tensor))
            self._root._weights[name] = key
        elif written != key:
            raise ValueError(f"weight {name} written twice, as {written} and then {key}")
        return name

    def const(self, value, dtype: torch.dtype = torch.int64) -> str:
        """A small constant (shapes, axes, scalars), stored inline and shared by every user of the same value.
        ``dtype`` is a torch dtype so that model-dtype scalars work for bfloat16 too."""
        tensor = torch.tensor(value, dtype=dtype)
        raw = as_bytes_view(tensor).tobytes()
        key = (str(dtype), tuple(tensor.shape), raw)
        if key not in self._consts:
            name = f"{self._root._const_prefix}{str(dtype).removeprefix('torch.')}_{len(self._consts)}"
            self._consts[key] = name
            proto = TensorProto(name=name, data_type=TORCH_TO_ONNX[dtype], dims=list(tensor.shape), raw_data=raw)
            self._root.initializers.append(proto)
        return self._consts[key]

    # --- graphs -----------------------------------------------------------------------------------------------
    def subgraph(self) -> GraphBuilder:
        """A builder for a control-flow body (Loop, If): its own nodes, names unique across the model."""
        body = GraphBuilder(self.weights, root=self._root)
        body._scope = list(self._scope)
        return body

    def make_graph(
        self, name: str, inputs: Sequence[onnx.ValueInfoProto], outputs: Sequence[onnx.ValueInfoProto]
    ) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, list(inputs), list(outputs), initializer=self.initializers)


@contextmanager
def emitting_into(owner, builder: GraphBuilder) -> Iterator[None]:
    """Has ``owner`` (a graph writer that emits through ``owner.b``) emit into ``builder``, a control-flow body, for
    the duration of the block."""
    outer, owner.b = owner.b, builder
    try:
        yield
    finally:
        owner.b = outer


def value_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    """A typed value; ``None`` in ``shape`` is an unnamed dynamic dimension, ``shape=None`` an unknown rank."""
    return helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape))
