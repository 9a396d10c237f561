"""The accuracy guard's fallback for 8-bit projections: a float32 MatMul over the dequantized weight.

The guard (export/accuracy_guard.py) moves the projections whose int8 activations flip tokens to float activations.
For 4 bits that is MatMulNBits at accuracy level 1, which MLAS has a float-activation kernel for. For 8 bits it has
none: onnxruntime's CPU MatMulNBits at level 1 dequantizes the node's whole weight to float32 on every call and then
multiplies, which made a Qwen3.5-MoE int8 decode step 7.5x slower with six of its thirteen units moved
(bench/profile_hybrid.py: MatMulNBits 204.5 ms of a 218 ms step, against 18.2 ms with every unit at level 4).
A float32 MatMul over the dequantized weight computes the same function, (q - zero_point) * scale rounded once to
float32 and then the same MLAS SGEMM, without the per-call dequantization; it reads 4x the 8-bit weight's bytes
(``python bench/bench_int8_fallback.py``: at one row 6-7x faster than 8-bit level 1 and 3-4x slower than level
4; at 64 rows 2x faster than level 1). So where the guard moves an 8-bit MatMulNBits of a float32 graph, the
written graph holds a MatMul over the dequantized weight instead, named ``<packed weight>`` + ``DEQUANTIZED``, which
``export/dequantize.py`` reads back as the quantized weight it is (the quantized verify holds it to the 8-bit bound
and runs the PyTorch Thinker on it).

The weights file is then rewritten one tensor at a time into a temporary file beside it and renamed over it, without
the tensors no node reads any longer (a tied embedding's GatherBlockQuantized keeps reading a moved head's packed
weight, which then stays): no dead bytes, and one tensor in memory at a time. Float16 and bfloat16 graphs keep
level 1: their float MatMul would run in half precision (not level 1's function), and the guard runs on the CPU,
where onnxruntime's half-precision matmuls are not the fast path either.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from common.errors import ThinkerError

from .dequantize import DEQUANTIZED, attributes, constant_reader, dequantize_matmul_nbits
from .graph_builder import WeightFile
from .graph_walk import all_nodes

FLOAT_FALLBACK_BITS = 8


def float_fallback_nodes(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """Those of ``names`` that become float MatMuls: 8-bit MatMulNBits with float32 scales (a float32 graph)."""
    wanted = set(names)
    scale_types = {tensor.name: tensor.data_type for tensor in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.name in wanted
        and node.op_type == "MatMulNBits"
        and attributes(node)["bits"] == FLOAT_FALLBACK_BITS
        and scale_types.get(node.input[2]) == TensorProto.FLOAT
    ]


def replace_with_float_matmuls(model: onnx.ModelProto, onnx_path: Path, names: list[str]) -> int:
    """Replaces, in ``model`` (the graph of ``onnx_path``, loaded without its weights), each MatMulNBits named in
    ``names`` with a float32 MatMul over its dequantized weight (and an Add for a bias), then rewrites the weights
    file without the tensors left unread. Returns the bytes of float32 weight written. ``model`` is not saved."""
    onnx_path = Path(onnx_path)
    read = constant_reader(model.graph, base_dir=onnx_path.parent)
    chosen = set(names)
    dequantized: dict[str, Callable[[], np.ndarray]] = {}  # new weight -> its float32 values, made when written
    nodes = []
    for node in model.graph.node:
        if node.name not in chosen:
            nodes.append(node)
            continue
        weight = node.input[1] + DEQUANTIZED
        attrs, (packed, scales, zero) = attributes(node), [*node.input[1:4], ""][:3]
        dequantized[weight] = lambda a=attrs, p=packed, s=scales, z=zero: dequantize_matmul_nbits(
            a, read(p), read(s), read(z) if z else None
        )
        inputs = list(node.input)
        bias = inputs[5] if len(inputs) > 5 else ""
        product = node.output[0] if not bias else f"{node.output[0]}/unbiased"
        nodes.append(helper.make_node("MatMul", [inputs[0], weight], [product], name=f"{node.name}/float"))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=f"{node.name}/bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read_names = {name for node in all_nodes(model.graph) for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name in read_names]
    return _rewrite_weights(model, onnx_path, kept, dequantized)


def _rewrite_weights(model, onnx_path: Path, kept, added: dict[str, Callable[[], np.ndarray]]) -> int:
    """Writes ``kept`` (external tensors copied byte for byte) and ``added`` (each made when written) to a fresh
    weights file that replaces the old one; points ``model``'s initializers at it."""
    external = {tensor.name: ExternalDataInfo(tensor) for tensor in kept if uses_external_data(tensor)}
    locations = {info.location for info in external.values()}
    if len(locations) != 1:
        raise RuntimeError(f"{onnx_path}: weights in {sorted(locations)}, expected one file (a bug in the exporter)")
    data_path = onnx_path.parent / locations.pop()
    written = 0
    try:
        with tempfile.TemporaryDirectory(prefix=".float-fallback-", dir=onnx_path.parent) as staging:
            weights = WeightFile(Path(staging) / data_path.name)
            initializers = []
            with open(data_path, "rb") as source:
                for tensor in kept:
                    info = external.get(tensor.name)
                    if info is None:  # stored in the proto itself
                        initializers.append(tensor)
                        continue
                    source.seek(info.offset or 0)
                    data = np.frombuffer(source.read(-1 if info.length is None else info.length), dtype=np.uint8)
                    initializers.append(weights.add_raw(tensor.name, tensor.data_type, list(tensor.dims), data))
            for name, make in added.items():
                array = make()
                written += array.nbytes
                initializers.append(weights.add_array(name, array))
            weights.close()
            os.replace(weights.path, data_path)
    except OSError as err:
        raise ThinkerError(
            f"{data_path}: cannot rewrite the weights file with the accuracy guard's float32 fallback ({err}); "
            "free disk space, or export with --accuracy-guard 0"
        ) from err
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    return written
