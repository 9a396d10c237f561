"""The weights a quantized graph really computes with: its MatMulNBits and GatherBlockQuantized initializers read
back and dequantized as onnxruntime's kernels do, keyed by the Thinker parameters they stand for.

``thinker export --verify`` of a ``--quantize`` export loads these into the PyTorch Thinker, so that onnxruntime's
graph and the model run the same weights and can be held to a tight tolerance (export/verify.py); what the rounding
costs is measured separately, against the float model.

Layouts (onnxruntime's contrib op schemas, com.microsoft):
  MatMulNBits           B uint8 (N, blocks, block_size * bits / 8): column n's K weights in blocks along K, low
                        nibble first for 4 bits; scales (N * blocks); zero_points absent (symmetric: 2^(bits-1)),
                        uint8 packed like B along the blocks, or float (HQQ) of the scales' shape.
                        weight[k, n] = (q - zero_point) * scale, over the padded K, cut back to K.
  QMoE                  each expert stack's packed weights (E, N, K * bits / 8) and scales (E, N, K / block_size),
                        or (E, N) without ``block_size`` (a scale per row): per expert, MatMulNBits' B and scales
                        (symmetric); FC1's rows interleave gate and up (``swiglu_fusion`` 1).
  GatherBlockQuantized  data (V, C): int4 (signed, zero point 0, or the zero_points given) or uint4; or uint8
                        holding two 4-bit values per byte (``bits`` 4, default zero point 8) or one 8-bit value
                        (default 128); scales (V, C / block_size), blocks along quantize_axis 1.

The arithmetic is done in float32, where every (q - zero_point) is exact and each product is one rounding, as in the
kernels; float16 scales give float16 weights after one more rounding, which is also what the kernels hold.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from thinker_common.errors import ThinkerError

# What the fused graph packs into one projection along the output axis (export/fused_graph.py writes these names),
# to the Thinker parameters it concatenates, in order. gate|up: graphs exported before the MLP's two MatMuls.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
QUANTIZED_OPS = ("MatMulNBits", "GatherBlockQuantized", "QMoE")
# The accuracy guard's float fallbacks for 8-bit units (export/float_fallback.py): a MatMul over the packed
# weight's dequantized values, named "<packed weight>" + DEQUANTIZED ("..._Q8_dequantized"), and a float MoE op over
# a QMoE's two stacks so named, read back as the quantized weights they are.
DEQUANTIZED = "_dequantized"
# A fallback's weights are float, so its node records the grid they were dequantized from, for the per-row check
# (the quantized verify): node metadata (ONNX IR >= 10), which onnxruntime ignores.
GRID_BLOCK_SIZE, GRID_ASYMMETRIC = "thinker.quantized_block_size", "thinker.quantized_asymmetric"
# The ops whose weight is read as the (K, N) array they multiply by (the transposed view of a Linear's).
MATMUL_OPS = ("MatMulNBits", "MatMul")
# The plain graph dequantizes these stacks (int8 values) as it gathers their experts, by graph name.
PLAIN_EXPERT_STACKS = (".experts.gate_up_proj", ".experts.down_proj")
EMBEDDING = "model.embed_tokens.weight"
_QUANTIZED_SUFFIX = re.compile(r"_Q\d+$")  # onnxruntime's quantizer names the packed weight "<name>_Q4" / "_Q8"
# A weight quantized in row ranges (export/quantize.py ``SplitProjection``, the mixed head): "<name>.rows_<a>_<b>".
_ROW_RANGE = re.compile(r"^(?P<name>.+)\.rows_(?P<start>\d+)_(?P<stop>\d+)$")


@dataclass
class QuantizedWeight:
    op_type: str  # MatMulNBits, GatherBlockQuantized, QMoE, DequantizeLinear (the plain graph's experts), or
    # MatMul (the guard's float fallback, already dequantized)
    bits: int
    weight: np.ndarray | torch.Tensor  # a graph's (K, N) / (V, C) array; a Thinker parameter's (out, in) tensor
    # The quantization grid, for the per-row check: each output row's inputs in blocks of ``block_size`` (0: one
    # block per row; a guard's float fallback: the grid its node records), None where the graph does not say. A
    # weight quantized in row ranges (the mixed head) gives each range's own instead, ``row_parts``: (start, stop,
    # bits, block_size).
    block_size: int | None = None
    row_parts: tuple[tuple[int, int, int, int | None], ...] = ()
    asymmetric: bool = False  # with zero points (uint ones of asymmetric RTN, HQQ's float ones)
    float_zero_points: bool = False  # HQQ's: a MatMulNBits whose zero points are in the scales' float type
    # MatMulNBits' accuracy level (its activations' compute type): the distinct levels of its parts; () elsewhere
    accuracy_levels: tuple[int, ...] = ()


def record_grid(node: onnx.NodeProto, block_size: int, asymmetric: bool) -> None:
    """Writes on ``node`` the grid its float weights were dequantized from (``GRID_BLOCK_SIZE``: 0, one block per
    row)."""
    for key, value in ((GRID_BLOCK_SIZE, block_size), (GRID_ASYMMETRIC, int(asymmetric))):
        node.metadata_props.add(key=key, value=str(value))


def recorded_grid(node: onnx.NodeProto) -> tuple[int | None, bool]:
    """(block size, asymmetric) as ``record_grid`` wrote them on ``node``; (None, False) where it did not (graphs
    exported before it did)."""
    props = {entry.key: entry.value for entry in node.metadata_props}
    block = props.get(GRID_BLOCK_SIZE)
    return (int(block) if block is not None else None), props.get(GRID_ASYMMETRIC) == "1"


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., n) -> (..., 2n): the low 4 bits of each byte first."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def integer_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s own memory, only ever read: arrays read from a weights file are read-only, which
    torch warns about because a tensor could write to them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def as_float32(array: np.ndarray) -> torch.Tensor:
    """Scales or float zero points (float32, float16, or a bfloat16 numpy has no name for) as a float32 tensor."""
    return torch.from_numpy(array.astype(np.float32))


# The arithmetic is torch's rather than numpy's: its elementwise kernels use every core, and ``--verify`` of a
# streamed model dequantizes every weight once per forward pass (numpy took 6x as long on Qwen3-0.6B's weights).


def dequantize_matmul_nbits(attrs: dict, packed: np.ndarray, scales: np.ndarray, zero_points=None) -> np.ndarray:
    """MatMulNBits' B as the (K, N) weight the node multiplies by, in the scales' dtype: the transposed view of an
    (N, K) array, so the (out, in) layout of a Linear needs no copy."""
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    blocks = -(-k // block)
    q = integer_tensor(packed).reshape(n, blocks, -1)
    q = unpack_nibbles(q) if bits == 4 else q
    if bits not in (4, 8) or q.shape[-1] != block:
        raise ThinkerError(f"MatMulNBits with {bits} bits and B of shape {packed.shape}: not a layout this reads")
    scale = as_float32(scales).reshape(n, blocks, 1)
    if zero_points is None:
        zero = float(2 ** (bits - 1))
    elif zero_points.dtype == np.uint8:
        zero = integer_tensor(zero_points).reshape(n, -1)
        zero = (unpack_nibbles(zero) if bits == 4 else zero)[:, :blocks].to(torch.float32).reshape(n, blocks, 1)
    else:  # float zero points (HQQ), one per block
        zero = as_float32(zero_points).reshape(n, blocks, 1)
    weight = q.to(torch.float32).sub_(zero).mul_(scale).reshape(n, blocks * block)[:, :k]
    return weight.numpy().astype(scales.dtype, copy=False).T


def dequantize_qmoe(attrs: dict, packed: np.ndarray, scales: np.ndarray, interleaved: bool) -> np.ndarray:
    """One of QMoE's quantized expert stacks (in blocks, or a scale per row) as the (E, N, K) float stack its
    experts multiply by (each expert's rows its outputs), in the scales' dtype; ``interleaved``: an FC1 whose rows
    alternate gate and up (``swiglu_fusion`` 1), returned as the Thinker's gate rows and then up rows."""
    experts, rows, width = packed.shape
    bits = attrs.get("expert_weight_bits", 4)
    k = width * 8 // bits
    block = attrs.get("block_size", k)  # none: one scale per row, a block of K
    if scales.shape[:2] != (experts, rows) or scales[0, 0].size * block != k or width * 8 != k * bits:
        raise ThinkerError(f"QMoE experts of shape {packed.shape}, scales {scales.shape}: not a layout this reads")
    layout = {"K": k, "N": experts * rows, "bits": bits, "block_size": block}
    stack = dequantize_matmul_nbits(layout, packed.reshape(experts * rows, -1), scales).T.reshape(experts, rows, k)
    return deinterleaved(stack) if interleaved else stack


def deinterleaved(stack: np.ndarray) -> np.ndarray:
    """An (E, 2I, K) SwiGLU stack's rows (g0, u0, g1, u1, ...) as (g0, g1, ..., u0, u1, ...)."""
    return np.concatenate([stack[:, 0::2], stack[:, 1::2]], axis=1)


def bits_of(packed: str) -> int:
    """The bit width a packed weight's name gives ("..._Q8": 8), for the float fallbacks read back."""
    suffix = _QUANTIZED_SUFFIX.search(packed)
    if suffix is None:
        raise RuntimeError(f"float fallback over {packed} names no bit width (a bug in the exporter)")
    return int(suffix.group(0)[2:])


def dequantize_plain_experts(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The plain graph's quantized expert stack (export/quantize.py ``standard_experts``): signed int8 values
    (E, K, N) and scales (E, K / block, N) in blocks along K or (E, N) one per output, as the (E, N, K) float stack
    (each expert's rows its outputs), in the scales' dtype."""
    experts, k, n = values.shape
    scale = as_float32(scales)
    scale = scale[:, None, :] if scales.ndim == 2 else scale.repeat_interleave(k // scales.shape[1], dim=1)
    weight = integer_tensor(values).to(torch.float32).mul_(scale)
    return weight.transpose(1, 2).numpy().astype(scales.dtype, copy=False)


def dequantize_gather_block(attrs: dict, data: np.ndarray, scales: np.ndarray, zero_points=None) -> np.ndarray:
    """GatherBlockQuantized's table as the (V, C) matrix its rows are gathered from, in the scales' dtype."""
    if attrs.get("gather_axis", 0) != 0 or attrs.get("quantize_axis", 1) != 1:
        raise ThinkerError("GatherBlockQuantized other than rows gathered, blocks along the row: not read here")
    block, bits = attrs["block_size"], attrs.get("bits", 4)
    if data.dtype == np.uint8 and bits == 4:
        q, default_zero = unpack_nibbles(integer_tensor(data)), 8
    elif data.dtype == np.uint8:
        q, default_zero = integer_tensor(data), 128
    else:  # onnx's int4 / uint4 arrays come back one value per element; the schema's default zero point is 0
        q, default_zero = torch.from_numpy(data.astype(np.int8)), 0
    rows, columns = scales.shape[0], q.shape[-1]
    q = q.to(torch.float32).reshape(rows, -1, block)
    if zero_points is None:
        zero = float(default_zero)
    else:
        zero = integer_tensor(zero_points if zero_points.dtype == np.uint8 else zero_points.astype(np.int8))
        if zero_points.dtype == np.uint8 and bits == 4:
            zero = unpack_nibbles(zero)
        zero = zero.to(torch.float32).reshape(rows, -1)[:, : q.shape[1], None]
    weight = q.sub_(zero).mul_(as_float32(scales).reshape(rows, -1, 1))
    return weight.reshape(rows, columns).numpy().astype(scales.dtype, copy=False)


def graph_weight_name(quantized_input: str) -> str:
    """``model.layers.0.self_attn.qkv_proj.weight_Q4`` -> ``model.layers.0.self_attn.qkv_proj.weight``."""
    return _QUANTIZED_SUFFIX.sub("", quantized_input)


def quantized_weights(onnx_path: Path) -> dict[str, QuantizedWeight]:
    """Every quantized weight of the graph, dequantized, by graph weight name: a MatMulNBits weight (K, N), as the
    graph multiplies by it, a GatherBlockQuantized table (V, C') (C' the row padded to whole blocks). The one table
    the exporter gathers quantized is the token embedding: its GatherBlockQuantized is ``EMBEDDING``, whatever
    tensors it reads (a tied one reads the head's; a mixed head's two parts, joined). A weight quantized in row
    ranges (the mixed head) comes back whole."""
    return {name: read() for name, read in quantized_weight_readers(onnx_path).items()}


def quantized_weight_readers(onnx_path: Path) -> dict[str, Callable[[], QuantizedWeight]]:
    """``quantized_weights``, each weight read from the graph's weights file and dequantized only when its reader is
    called: a graph of any size, one weight in memory at a time."""
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    read = constant_reader(model.graph, base_dir=onnx_path.parent)

    def array(name: str):
        if not name:
            return None
        value = read(name)
        if value is None:
            raise RuntimeError(f"quantized tensor {name} is not a constant of the graph (a bug in the exporter)")
        return value

    def matmul_nbits(attrs: dict, inputs: list[str]) -> QuantizedWeight:
        packed, scales, zero = (array(name) for name in [*inputs, ""][:3])
        weight = dequantize_matmul_nbits(attrs, packed, scales, zero)
        level = (attrs.get("accuracy_level", 0),)  # the attribute's default in onnxruntime's schema
        return QuantizedWeight(
            "MatMulNBits",
            attrs["bits"],
            weight,
            attrs["block_size"],
            asymmetric=zero is not None,
            float_zero_points=zero is not None and zero.dtype != np.uint8,
            accuracy_levels=level,
        )

    def float_weight(name: str, bits: int, node: onnx.NodeProto) -> QuantizedWeight:
        block, asymmetric = recorded_grid(node)
        return QuantizedWeight("MatMul", bits, array(name), block, asymmetric=asymmetric)

    def float_stack(name: str, interleaved: bool, bits: int, node: onnx.NodeProto) -> QuantizedWeight:
        stack = deinterleaved(array(name)) if interleaved else array(name)
        block, asymmetric = recorded_grid(node)
        return QuantizedWeight("MoE", bits, stack, block, asymmetric=asymmetric)

    def plain_experts(values: str, scales: str) -> QuantizedWeight:
        values, scales = array(values), array(scales)  # (E, K, N) and (E, N) per row or (E, K / block, N)
        block, bits = (0, 8) if scales.ndim == 2 else (values.shape[1] // scales.shape[1], 4)
        return QuantizedWeight("DequantizeLinear", bits, dequantize_plain_experts(values, scales), block)

    def gather_block(attrs: dict, data: str, scales: str, zero: str) -> QuantizedWeight:
        table = dequantize_gather_block(attrs, array(data), array(scales), array(zero))
        block, asymmetric = attrs["block_size"], bool(zero)  # a symmetric table takes the op's default zero point
        return QuantizedWeight("GatherBlockQuantized", attrs.get("bits", 4), table, block, asymmetric=asymmetric)

    reshaped = {node.output[0]: node.input[0] for node in model.graph.node if node.op_type == "Reshape"}
    readers: dict[str, Callable[[], QuantizedWeight]] = {}
    for node in model.graph.node:
        attrs = attributes(node)
        if node.op_type == "MatMulNBits":
            inputs = list(node.input[1:4])
            name = graph_weight_name(node.input[1])
            read_one = lambda a=attrs, i=inputs: matmul_nbits(a, i)  # noqa: E731
        elif node.op_type == "MatMul" and node.input[1].endswith(DEQUANTIZED):
            packed = node.input[1].removesuffix(DEQUANTIZED)
            name = graph_weight_name(packed)
            read_one = partial(float_weight, node.input[1], bits_of(packed), node)
        elif node.op_type == "QMoE":  # two weights: FC1 (gate and up, interleaved under SwiGLU) and FC2
            for packed, scales, interleaved in (
                (node.input[2], node.input[3], attrs.get("swiglu_fusion", 0) == 1),
                (node.input[5], node.input[6], False),
            ):
                name = graph_weight_name(packed)
                if name in readers:
                    raise RuntimeError(f"a second QMoE over {name} in the graph (a bug in the exporter)")
                readers[name] = lambda a=attrs, p=packed, s=scales, i=interleaved: QuantizedWeight(  # noqa: E731
                    "QMoE",
                    a.get("expert_weight_bits", 4),
                    dequantize_qmoe(a, array(p), array(s), i),
                    a.get("block_size", 0),
                )
            continue
        elif node.op_type == "MoE" and node.input[2].endswith(DEQUANTIZED):  # a QMoE the guard moved, in float
            for stack, interleaved in ((node.input[2], attrs.get("swiglu_fusion", 0) == 1), (node.input[4], False)):
                packed = stack.removesuffix(DEQUANTIZED)
                readers[graph_weight_name(packed)] = partial(float_stack, stack, interleaved, bits_of(packed), node)
            continue
        elif node.op_type == "GatherBlockQuantized":
            zero = node.input[3] if len(node.input) > 3 else ""
            read_one = lambda a=attrs, d=node.input[0], s=node.input[2], z=zero: gather_block(a, d, s, z)  # noqa: E731
            # The table is the head's packed weight through a Reshape: its name says which rows (a mixed head).
            part = _ROW_RANGE.match(graph_weight_name(reshaped.get(node.input[0], node.input[0])))
            name = EMBEDDING if part is None else f"{EMBEDDING}.rows_{part['start']}_{part['stop']}"
        else:
            continue
        if name in readers:
            raise RuntimeError(f"a second {node.op_type} over {name} in the graph (a bug in the exporter)")
        readers[name] = read_one
    for tensor in model.graph.initializer:  # the plain graph's quantized experts, read where it gathers them
        name = graph_weight_name(tensor.name)
        if tensor.data_type == onnx.TensorProto.INT8 and name.endswith(PLAIN_EXPERT_STACKS) and name not in readers:
            readers[name] = partial(plain_experts, tensor.name, f"{name}_scales")
    return _join_row_ranges(readers)


def _join_row_ranges(readers: dict[str, Callable[[], QuantizedWeight]]) -> dict[str, Callable[[], QuantizedWeight]]:
    """The parts of a weight quantized in row ranges (``<name>.rows_<a>_<b>``) under one reader for ``name``."""
    joined: dict[str, Callable[[], QuantizedWeight]] = {}
    ranges: dict[str, list[tuple[int, int, Callable[[], QuantizedWeight]]]] = {}
    for name, read in readers.items():
        part = _ROW_RANGE.match(name)
        if part is None:
            joined[name] = read
        else:
            ranges.setdefault(part["name"], []).append((int(part["start"]), int(part["stop"]), read))
    for name, parts in ranges.items():
        joined[name] = partial(_joined, name, sorted(parts, key=lambda part: part[0]))
    return joined


def _joined(name: str, ranges: list[tuple[int, int, Callable[[], QuantizedWeight]]]) -> QuantizedWeight:
    """A weight quantized in row ranges as one: its parts concatenated in row order (which must tile the rows from
    0), at the fewest bits of any part (the looser bound for the per-weight error check). A table's rows are its
    first axis; a MatMulNBits weight, read as the (K, N) it multiplies by, has them as columns."""
    expected = 0
    for start, stop, _ in ranges:
        if start != expected:
            raise RuntimeError(f"the parts of {name} do not tile its rows at {start} (a bug in the exporter)")
        expected = stop
    parts = [read() for _, _, read in ranges]
    axis = 1 if parts[0].op_type in MATMUL_OPS else 0
    weight = np.concatenate([part.weight for part in parts], axis=axis)
    grid = tuple(
        (start, stop, part.bits, part.block_size) for (start, stop, _), part in zip(ranges, parts, strict=True)
    )
    bits = min(part.bits for part in parts)
    levels = tuple(sorted({level for part in parts for level in part.accuracy_levels}))
    return QuantizedWeight(
        parts[0].op_type,
        bits,
        weight,
        row_parts=grid,
        asymmetric=parts[0].asymmetric,
        float_zero_points=parts[0].float_zero_points,
        accuracy_levels=levels,
    )


def constant_reader(graph: onnx.GraphProto, base_dir: Path | str = "") -> Callable[[str], np.ndarray | None]:
    """A function from a value name to its array when the value is a constant: an initializer, or a Reshape of
    constants (how a tied embedding reads the head's packed weight); None otherwise. Arrays are made on demand, so
    the float weights a graph also holds are never converted; ``base_dir``: the folder of the weights file, for a
    graph loaded without its external data (each tensor then read from the file when asked for)."""
    tensors = {t.name: t for t in graph.initializer}
    reshapes = {node.output[0]: node for node in graph.node if node.op_type == "Reshape"}

    def read(name: str) -> np.ndarray | None:
        if name in tensors:
            return numpy_helper.to_array(tensors[name], str(base_dir))
        node = reshapes.get(name)
        if node is None:
            return None
        data, shape = read(node.input[0]), read(node.input[1])
        if data is None or shape is None:
            return None
        if attributes(node).get("allowzero", 0) == 0:  # ONNX: a 0 copies the input's dimension
            shape = [data.shape[i] if size == 0 else size for i, size in enumerate(shape)]
        return data.reshape([int(size) for size in shape])

    return read


def as_thinker_parameters(weights: dict[str, QuantizedWeight], model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    """Graph weights -> by Thinker parameter name, as (out, in) tensors (a Gather table stays (V, C)); a packed
    projection is split back by its parts' shapes. An unknown name is an exporter bug and raises."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, QuantizedWeight] = {}
    for name, quantized in weights.items():
        tensor = torch.from_numpy(quantized.weight)  # a MatMulNBits weight: the (K, N) view of an (N, K) array
        if quantized.op_type in MATMUL_OPS:
            tensor = tensor.T  # (K, N) -> (out, in), the Linear layout
        elif name in parameters and tensor.shape[1] > parameters[name].shape[1]:
            # A Gather table's rows padded to whole blocks: the graph slices the gathered rows back (its graph
            # check would fail on the shapes if it did not).
            tensor = tensor[:, : parameters[name].shape[1]]
        parts = thinker_names(name, parameters)
        if parts == [name]:
            out[name] = dataclasses.replace(quantized, weight=tensor)
            continue
        sizes = [parameters[part].shape[0] for part in parts]
        if sum(sizes) != tensor.shape[0]:
            raise RuntimeError(f"quantized weight {name} has {tensor.shape[0]} outputs, its parts {sum(sizes)}")
        for part, piece in zip(parts, torch.split(tensor, sizes, dim=0), strict=True):
            out[part] = dataclasses.replace(quantized, weight=piece)  # a packed projection: no row ranges
    return out


def thinker_names(name: str, parameters: Mapping[str, torch.Tensor]) -> list[str]:
    """The Thinker parameters graph weight ``name`` stands for: itself, or the parts of a packed projection, in
    order. An unknown name is an exporter bug and raises."""
    if name in parameters:
        return [name]
    prefix, _, packed = name.removesuffix(".weight").rpartition(".")
    parts = [f"{prefix}.{part}.weight" for part in PACKED.get(packed, ())]
    if not parts or any(part not in parameters for part in parts):
        raise RuntimeError(f"quantized weight {name} stands for no Thinker parameter (a bug in the exporter)")
    return parts


def relative_error(name: str, weight: torch.Tensor, reference: torch.Tensor) -> float:
    """||weight - reference|| / ||reference|| for dequantized parameter ``name``; shapes must agree. A weight
    holding NaN (a NaN scale) is infinitely far: NaN would lose every ``>`` comparison that ranks and judges it."""
    reference = reference.detach().float()
    if tuple(reference.shape) != tuple(weight.shape):
        shapes = f"{tuple(weight.shape)}, the model's {tuple(reference.shape)}"
        raise RuntimeError(f"quantized {name} has shape {shapes} (a bug in the exporter)")
    error = float((weight.float() - reference).norm() / reference.norm().clamp_min(1e-30))
    return math.inf if math.isnan(error) else error


@torch.no_grad()
def untie_head(model: torch.nn.Module) -> None:
    """Tied embedding and head become two parameters: a graph that quantizes the head (MatMulNBits) may keep the
    embedding Gather float, or quantize it with another layout."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embeddings.weight:
        head.weight = torch.nn.Parameter(embeddings.weight.detach().clone())
