"""The accuracy guard's fallbacks for 8-bit units of a float32 graph: level 1's function without level 1's cost.

The guard (export/accuracy_guard.py) moves the projections whose int8 activations flip tokens to float activations.
For 4 bits that is MatMulNBits at accuracy level 1, which MLAS has a float-activation kernel for. For 8 bits it has
none: onnxruntime's CPU MatMulNBits at level 1 dequantizes the node's whole weight to float32 on every call and then
multiplies, which made a Qwen3.5-MoE int8 decode step 7.5x slower with six of its thirteen units moved
(bench/profile_hybrid.py: MatMulNBits 204.5 ms of a 218 ms step, against 18.2 ms with every unit at level 4).
A float32 MatMul over the dequantized weight computes the same function, (q - zero_point) * scale rounded once to
float32 and then the same MLAS SGEMM, without the per-call dequantization; it reads 4x the 8-bit weight's bytes
(``python bench/bench_int8_fallback.py``: at one row 6-8x faster than 8-bit level 1 and 3-6x slower than level
4; at 64 rows 2x faster than level 1). So where the guard moves an 8-bit MatMulNBits of a float32 graph, the
written graph holds a MatMul over the dequantized weight instead, named ``<packed weight>`` + ``DEQUANTIZED``, which
``export/dequantize.py`` reads back as the quantized weight it is (the quantized verify holds it to the 8-bit bound
and runs the PyTorch Thinker on it).

8-bit routed experts in blocks (QMoE's block-wise kernel, export/quantize.py ``experts_in_blocks``) round their
activations to int8 whatever the node's accuracy level, so a moved unit's QMoE becomes onnxruntime's float MoE op
over its two stacks dequantized (``float_experts``; named ``<packed>`` + ``DEQUANTIZED`` too): the function the
guard's reference computes (QMoE's own float path, which a process can only choose for every QMoE at once), for 4x
the experts' bytes. Requantizing them with a scale per row instead (the 8-bit layout whose kernel computes in
float: 1x the bytes, 0.35 against 0.68 ms per layer of bench_hybrid.py's Qwen3.5-MoE at one row, the experts in
blocks 0.22; ``python bench/bench_qmoe_int8.py``) changes the weights by up to half a row step: on random weights,
where the next tokens are near ties, that alone parted 18 % of them from the reference in a trial export, so the
guard could not meet its threshold by moving every layer. The guard's own trial graphs do not write the float
stacks: they dequantize the moved experts in the graph (``dequantizing_experts``: DequantizeLinear in blocks, which
onnxruntime leaves unfolded, then the same MoE op), the same function at no disk cost.

The weights file is then rewritten one tensor at a time into a temporary file beside it and renamed over it, without
the tensors no node reads any longer (a tied embedding's GatherBlockQuantized keeps reading a moved head's packed
weight, which then stays): no dead bytes, and one new tensor (one expert stack) in memory at a time. Float16 and
bfloat16 graphs keep level 1: their float MatMul would run in half precision (not level 1's function), and the guard
runs on the CPU, where onnxruntime's half-precision matmuls are not the fast path either.
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

from thinker_common.errors import ThinkerError
from thinker_common.staging import DISK_FULL, outside_staging

from .dequantize import (
    DEQUANTIZED,
    attributes,
    constant_reader,
    dequantize_matmul_nbits,
    dequantize_qmoe,
    record_grid,
)
from .graph_builder import WeightFile
from .graph_walk import all_nodes
from .names import WEIGHTS_SIZE_KEY
from .weights_stamp import stamp_weights

FLOAT_FALLBACK_BITS = 8
# New weights by name, each made when it is written (one in memory at a time).
NewWeights = dict[str, Callable[[], np.ndarray]]


def float_fallback_nodes(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """Those of ``names`` that become float MatMuls: 8-bit MatMulNBits with float32 scales (a float32 graph)."""
    return _float32_nodes(model, names, "MatMulNBits", "bits", scales=2)


def expert_fallback_nodes(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """Those of ``names`` that become float MoE ops: QMoE over 8-bit experts in blocks with float32 scales, whose
    kernel computes with int8 activations at every accuracy level."""
    in_blocks = set(_float32_nodes(model, names, "QMoE", "expert_weight_bits", scales=3))
    return [node.name for node in model.graph.node if node.name in in_blocks and attributes(node).get("block_size")]


def _float32_nodes(model: onnx.ModelProto, names: list[str], op_type: str, bits: str, scales: int) -> list[str]:
    """Those of ``names`` that are ``op_type`` nodes at 8 bits (attribute ``bits``) whose scales (input
    ``scales``) are float32."""
    wanted = set(names)
    scale_types = {tensor.name: tensor.data_type for tensor in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.name in wanted
        and node.op_type == op_type
        and attributes(node).get(bits) == FLOAT_FALLBACK_BITS
        and scale_types.get(node.input[scales]) == TensorProto.FLOAT
    ]


def float_experts(model: onnx.ModelProto, read: Callable[[str], np.ndarray], names: list[str]) -> NewWeights:
    """Rewrites, in ``model``, each QMoE named in ``names`` (``expert_fallback_nodes``) as the float MoE op over its
    two stacks dequantized; returns those stacks, made when written (one at a time)."""
    chosen, added = set(names), {}
    for node in model.graph.node:
        if node.name not in chosen:
            continue
        attrs = attributes(node)
        for packed, scales in ((node.input[2], node.input[3]), (node.input[5], node.input[6])):
            added[packed + DEQUANTIZED] = lambda a=attrs, p=packed, s=scales: dequantize_qmoe(  # noqa: E731
                a, read(p), read(s), interleaved=False
            )
        _as_float_moe(node, node.input[2] + DEQUANTIZED, node.input[5] + DEQUANTIZED)
        record_grid(node, attrs.get("block_size", 0), asymmetric=False)  # QMoE's 8 bits are symmetric
    return added


def dequantizing_experts(model: onnx.ModelProto, names: list[str]) -> None:
    """Rewrites, in ``model``, each QMoE named in ``names`` as the float MoE op over its stacks dequantized in the
    graph (per run: for the guard's trial graphs, which run once): DequantizeLinear in the QMoE's blocks along K,
    its zero point 128 (QMoE's, unwritten), the same (q - 128) * scale in float32 as ``dequantize_qmoe``."""
    chosen, nodes = set(names), []
    for node in model.graph.node:
        if node.name in chosen:
            block, outputs = attributes(node)["block_size"], []
            for packed, scales in ((node.input[2], node.input[3]), (node.input[5], node.input[6])):
                zero, dequantized = f"{packed}/zero_point", f"{packed}{DEQUANTIZED}/in_graph"
                value = helper.make_tensor("value", TensorProto.UINT8, [1], [2 ** (FLOAT_FALLBACK_BITS - 1)])
                nodes += [
                    helper.make_node("Shape", [scales], [f"{packed}/scales_shape"]),
                    helper.make_node("ConstantOfShape", [f"{packed}/scales_shape"], [zero], value=value),
                    helper.make_node(
                        "DequantizeLinear", [packed, scales, zero], [dequantized], axis=-1, block_size=block
                    ),
                ]
                outputs.append(dequantized)
            _as_float_moe(node, *outputs)
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _as_float_moe(node: onnx.NodeProto, fc1: str, fc2: str) -> None:
    """Turns QMoE ``node`` into the MoE op (the same routing and activation attributes) over float stacks."""
    quantization = ("expert_weight_bits", "block_size", "accuracy_level", "weights_prepacked")
    kept = [a for a in node.attribute if a.name not in quantization]
    inputs = [node.input[0], node.input[1], fc1, "", fc2]
    node.op_type = "MoE"
    del node.attribute[:], node.input[:]
    node.attribute.extend(kept)
    node.input.extend(inputs)


def replace_with_fallbacks(model: onnx.ModelProto, onnx_path: Path, matmuls: list[str], experts: list[str]) -> int:
    """Replaces, in ``model`` (the graph of ``onnx_path``, loaded without its weights), each MatMulNBits named in
    ``matmuls`` with a float32 MatMul over its dequantized weight (and an Add for a bias) and each QMoE named in
    ``experts`` with the float MoE op over its dequantized stacks, then rewrites the weights file without the tensors
    left unread. Returns the bytes of the new weights. ``model`` is not saved."""
    onnx_path = Path(onnx_path)
    read = constant_reader(model.graph, base_dir=onnx_path.parent)
    added = {**float_matmuls(model, read, matmuls), **float_experts(model, read, experts)}
    read_names = {name for node in all_nodes(model.graph) for name in node.input}
    kept = [tensor for tensor in model.graph.initializer if tensor.name in read_names]
    return _rewrite_weights(model, onnx_path, kept, added)


def float_matmuls(model: onnx.ModelProto, read: Callable[[str], np.ndarray], names: list[str]) -> NewWeights:
    """Rewrites, in ``model``, each MatMulNBits named in ``names`` as a float32 MatMul over its dequantized weight
    (and an Add for a bias); returns those weights, made when written."""
    chosen = set(names)
    added: NewWeights = {}
    nodes = []
    for node in model.graph.node:
        if node.name not in chosen:
            nodes.append(node)
            continue
        weight = node.input[1] + DEQUANTIZED
        attrs, (packed, scales, zero) = attributes(node), [*node.input[1:4], ""][:3]
        added[weight] = lambda a=attrs, p=packed, s=scales, z=zero: dequantize_matmul_nbits(  # noqa: E731
            a, read(p), read(s), read(z) if z else None
        )
        inputs = list(node.input)
        bias = inputs[5] if len(inputs) > 5 else ""
        product = node.output[0] if not bias else f"{node.output[0]}/unbiased"
        nodes.append(helper.make_node("MatMul", [inputs[0], weight], [product], name=f"{node.name}/float"))
        record_grid(nodes[-1], attrs["block_size"], asymmetric=bool(zero))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=f"{node.name}/bias"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return added


def _rewrite_weights(model, onnx_path: Path, kept, added: NewWeights) -> int:
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
        if err.errno in DISK_FULL:
            raise  # the staging folder's own report: the disk named where the user can see it, the space it has
        raise ThinkerError(
            f"{outside_staging(data_path)}: cannot rewrite the weights file with the accuracy guard's 8-bit fallbacks "
            f"({err.strerror or err}); export with --accuracy-guard 0"
        ) from err
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    if any(prop.key == WEIGHTS_SIZE_KEY for prop in model.metadata_props):
        stamp_weights(model, data_path)
    return written
