"""What a quantized graph's weights file will hold, before it is written.

``--verify`` of a quantized export holds sessions of the graph (export/verify.py ``verify_plan`` counts two), so its
memory plan needs the graph's size. Measured only once the graph is written, a budget refused then would have
cost the whole quantization first, and the size a first refusal quoted (without the graph) would be refused again
once granted. So the plan starts from this estimate: an upper bound on the bytes of the graph the layout asked for
produces (without the accuracy guard's float fallbacks, which the exporter measures afterwards), read off the
Thinker folder's safetensors headers alone.

Written here rather than asked of onnxruntime's quantizer, which only reports sizes by quantizing: the layout's
arithmetic is MatMulNBits' own (packed ``ceil(K / block) * block * bits / 8`` bytes a row, a scale a block, a zero
point a block where the algorithm writes one).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from thinker.configuration_thinker import ThinkerConfig
from thinker_common.sources import SafetensorsSource

from .decoder_graph import rope_table_bytes
from .hybrid_attention_graph import rotary_dim
from .quantize import HEAD, QuantizeSpec, WeightQuantizer

FLOAT32_BYTES = 4
EMBEDDING = "model.embed_tokens.weight"
PROJECTION = "proj"  # in the module name of every projection the graphs write through MatMulNBits when it fits
CONV = ".conv1d."  # linear attention's and PLE's kernels, whose taps a half graph keeps in float32
FLOAT_MODULES = (".indexer.",)  # projections a graph keeps float under --quantize (export/qwen4_exp_graph.py)
EXPERT_STACKS = (".experts.gate_up_proj", ".experts.down_proj")  # (E, N, K) stacks: QMoE, or int8 in the plain graph


def expected_graph_bytes(
    model_dir: Path, config: ThinkerConfig, dtype: torch.dtype, spec: QuantizeSpec, standard_experts: bool = False
) -> int:
    """An upper bound on the tensor bytes of the ``dtype`` graph of ``model_dir`` under ``spec``, as
    export/exporter.py's ``GraphFiles.data_bytes`` counts them: every projection the quantizer takes in its packed
    layout, everything else in ``dtype`` (vectors and conv kernels in float32 where ``dtype`` is narrower: some
    stay so, and counting all of them so keeps this a bound), and the RoPE tables.
    ``standard_experts``: the plain graph (or Qwen2-MoE's routing in the fused one), whose expert stacks hold a byte
    a weight at either width (export/quantize.py ``standard_experts``)."""
    quantizer = WeightQuantizer(spec, dtype)
    weights = SafetensorsSource(model_dir)
    try:
        shapes = {name: tuple(weights.shape(name)) for name in weights.names()}
    finally:
        weights.close()
    total = rope_table_bytes(config, dtype)
    if (config.rope_parameters or {}).get("mrope_section"):  # the plain graph's stream selector, float32
        total += 3 * rotary_dim(config) // 2 * FLOAT32_BYTES
    if HEAD not in shapes and EMBEDDING in shapes:  # tied: the head is the embedding's table, quantized once
        shapes[HEAD] = shapes[EMBEDDING]
    quantized_experts = experts_quantized(shapes, quantizer)
    for name, shape in shapes.items():
        if name == EMBEDDING:
            shared = config.tie_word_embeddings and quantizer.shares_embedding(shape[::-1])
            total += 0 if shared else math.prod(shape) * dtype.itemsize  # gathered from the head's tensors
        elif name == HEAD and quantizer.applies_to_shape(shape[::-1], HEAD):
            total += sum(
                projection_bytes(stop - start, shape[1], part, dtype) for start, stop, part in spec.head_rows(shape[0])
            )
        elif is_projection(name, shape) and quantizer.applies_to_shape(shape[::-1], name):
            total += projection_bytes(shape[0], shape[1], spec.for_weight(name), dtype)
        elif name.endswith(EXPERT_STACKS) and name.rpartition(".")[0] in quantized_experts:
            experts, rows, in_features = shape
            bits = 8 if standard_experts else spec.bits
            total += experts * projection_bytes(rows, in_features, QuantizeSpec(bits, spec.block_size), dtype)
        else:  # in dtype; vectors (norms, gates' biases) and conv kernels may stay float32 in a half graph
            kept_float32 = len(shape) == 1 or CONV in name
            total += math.prod(shape) * (max(dtype.itemsize, FLOAT32_BYTES) if kept_float32 else dtype.itemsize)
    return total


def experts_quantized(shapes: dict[str, tuple[int, ...]], quantizer: WeightQuantizer) -> set[str]:
    """The expert modules (``model.layers.N.mlp.experts``) whose stacks the graphs quantize: a layer's are
    quantized together or not at all, as both graphs decide (``applies_to_experts`` of every stack)."""
    stacks: dict[str, list[bool]] = {}
    for name, shape in shapes.items():
        if name.endswith(EXPERT_STACKS) and len(shape) == 3:
            stacks.setdefault(name.rpartition(".")[0], []).append(quantizer.applies_to_experts(shape[1], shape[2]))
    return {module for module, quantized in stacks.items() if all(quantized)}


def is_projection(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D (out, in) weight of a module named as a projection (``q_proj``, ``in_proj_qkv``, ``out_proj``): any
    other tensor is counted float, which can only overstate the graph (routers, gates and tables stay float)."""
    module, _, leaf = name.rpartition(".")
    kept_float = any(part in name for part in FLOAT_MODULES)
    return leaf == "weight" and len(shape) == 2 and PROJECTION in module.rpartition(".")[2] and not kept_float


def projection_bytes(rows: int, in_features: int, spec: QuantizeSpec, dtype: torch.dtype) -> int:
    """MatMulNBits' tensors for ``rows`` outputs of ``in_features`` inputs: the packed weights (each row padded to
    whole blocks), a scale per block in ``dtype``, and a zero point per block where ``spec.algo`` writes one (packed
    to ``bits`` for rtn-asym, a float for HQQ)."""
    blocks = -(-in_features // spec.block_size)
    packed = blocks * spec.block_size * spec.bits // 8
    zero_points = {"rtn": 0, "hqq": blocks * dtype.itemsize}.get(spec.algo, -(-blocks * spec.bits // 8))
    return rows * (packed + blocks * dtype.itemsize + zero_points)
