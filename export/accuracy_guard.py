"""A per-layer guard for ``--accuracy-level 4``: layers whose int8 activations flip tokens fall back to float.

accuracy_level 4 has MatMulNBits round its activations to int8 per block of the input axis (onnxruntime's fastest
CPU kernels), which is reported to flip greedy tokens on some models (onnxruntime issue 29849): an outlier channel
in a block crushes the other channels of that block to a few levels. After the graph is written, the guard runs
export/fidelity.py's paragraph (teacher forced, one prefill) through the graph as written and through the same graph
with every MatMulNBits (and QMoE) at accuracy_level 1 (float32 activations, the same quantized weights), and takes the
share of positions where both pick the same next token. Below ``min_agreement`` it ranks the decoder layers (and the
head) by what int8 activations cost each: one more prefill at level 1 hands back every MatMulNBits' input activations,
which are rounded here as level 4 rounds them (per block of the input axis, a scale of max |a| / 127, MLAS's CompInt8
quantization of A) and multiplied by the node's dequantized weight (export/dequantize.py): each node's relative output
error ||(A_int8 - A) W|| / ||A W||, a unit ranked by its worst node. That costs one prefill in all, where measuring each
unit alone at level 4 would cost one onnxruntime session per layer (~10 s each for SmolLM2 on this machine); it is a
proxy for the kernel's rounding, so the choice is made with the real kernels:
the costliest units' MatMulNBits move to level 1, the shortest prefix of the ranking whose graph meets
``min_agreement``, found by bisection (agreement grows, if not strictly, as units move; whatever prefix is chosen
was measured to meet the threshold).
It rewrites the model proto with those levels; a moved 8-bit MatMulNBits of a float32 graph becomes a float32 MatMul
over its dequantized weight instead, the same function without onnxruntime's per-call dequantization
(export/float_fallback.py, which rewrites the weights file), and the graph as written is measured once more.

Cost: two sessions and prefills of ~230 tokens when the graph passes (SmolLM2-135M: 2-3 s, and 151 MB of peak RSS
at int4, 151 at int8, bench/results/README-export-peak.md); when it falls back, one more for the ranking and one
per bisection step (log2 of the units). The float-activation sessions run wide 8-bit MatMulNBits as row slices
(export/row_slices.py), or onnxruntime would dequantize a whole 8-bit head at once.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

from common.progress import progress_bar

from .fidelity import fidelity_token_ids, mean_kl
from .float_fallback import float_fallback_nodes, replace_with_float_matmuls
from .names import DEFAULT_MIN_AGREEMENT
from .row_slices import split_wide_matmuls
from .runtime import OnnxDecoder, position_ids_from_mask

FALLBACK_LEVEL = 1
# The quantized ops with MatMulNBits' accuracy levels: a unit falls back as a whole, its quantized experts (QMoE)
# with its projections, though only the projections' activations rank it (``activation_rounding_errors``).
LEVELLED_OPS = ("MatMulNBits", "QMoE")
_UNIT = re.compile(r"^/model/layers\.(\d+)/|^/lm_head/")
GUARD_TOKENS = 256  # the paragraph is ~230 tokens with SmolLM2's tokenizer; random ids when there is no tokenizer


def guard_token_ids(model_dir: Path, vocab_size: int, max_positions: int) -> tuple[np.ndarray, str]:
    """export/fidelity.py's paragraph through the model's tokenizer, or, without a usable one (or with ids beyond
    the vocabulary), GUARD_TOKENS ids from a fixed seed; cut to the model's context."""
    length = min(GUARD_TOKENS, max_positions)
    ids, text = fidelity_token_ids(model_dir, vocab_size, length)
    if ids is not None and len(ids) > 1:
        return ids, text
    return np.random.default_rng(0).integers(0, vocab_size, size=length, dtype=np.int64), "random ids (seed 0)"


def matmul_units(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The graph's nodes with an accuracy level (``LEVELLED_OPS``) by unit: ``layers.i`` or ``lm_head``, in graph
    order."""
    units: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type not in LEVELLED_OPS:
            continue
        match = _UNIT.match(node.name)
        unit = (f"layers.{match.group(1)}" if match.group(1) else "lm_head") if match else "other"
        units.setdefault(unit, []).append(node.name)
    return units


def set_levels(model: onnx.ModelProto, levels: dict[str, int]) -> None:
    """Sets each MatMulNBits node named in ``levels`` to its accuracy level."""
    for node in model.graph.node:
        if node.name in levels:
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = levels[node.name]


@contextmanager
def graph_variant(
    model: onnx.ModelProto, onnx_path: Path, levels: dict[str, int], split_wide: bool = False
) -> Iterator[Path]:
    """``model`` with ``levels`` applied, saved beside ``onnx_path`` (its weights file in reach), removed after.
    ``split_wide``: its wide level-1 MatMulNBits as row slices of the same weights (export/row_slices.py), the
    same products at a lower peak, for the guard's own sessions."""
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    set_levels(variant, levels)
    if split_wide:
        split_wide_matmuls(variant, levels=frozenset({FALLBACK_LEVEL}))
    handle, name = tempfile.mkstemp(prefix=".guard-", suffix=".onnx", dir=onnx_path.parent)
    os.close(handle)
    path = Path(name)
    try:
        onnx.save_model(variant, str(path))
        yield path
    finally:
        path.unlink(missing_ok=True)


def prefill(model: onnx.ModelProto, onnx_path: Path, levels: dict[str, int], ids: np.ndarray, threads) -> np.ndarray:
    with graph_variant(model, onnx_path, levels, split_wide=True) as path:
        decoder = OnnxDecoder(path, provider="cpu", threads=threads, all_positions=True)
        return decoder.prefill(ids[None], np.ones_like(ids)[None])[0][0]


def activation_rounding_errors(
    model: onnx.ModelProto, onnx_path: Path, units: dict[str, list[str]], ids: np.ndarray, threads
) -> dict[str, float]:
    """Each unit's worst relative output error from int8 activations in its MatMulNBits (a QMoE's routed products
    are not probed), on the level-1 graph's own activations."""
    from .dequantize import attributes, constant_reader, dequantize_matmul_nbits

    read = constant_reader(onnx.load(str(onnx_path), load_external_data=True).graph)
    matmuls = {node.name: node for node in model.graph.node if node.op_type == "MatMulNBits"}
    units = {unit: [name for name in names if name in matmuls] for unit, names in units.items()}
    levelled = [node.name for node in model.graph.node if node.op_type in LEVELLED_OPS]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    activations = sorted({matmuls[name].input[0] for names in units.values() for name in names})
    for name in activations:  # every MatMulNBits input as an extra output; its type is its scales'
        node = next(n for n in matmuls.values() if n.input[0] == name)
        elem_type = onnx.helper.np_dtype_to_tensor_dtype(read(node.input[2]).dtype)
        probe.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    with graph_variant(probe, onnx_path, dict.fromkeys(levelled, FALLBACK_LEVEL), split_wide=True) as path:
        decoder = OnnxDecoder(path, provider="cpu", threads=threads, all_positions=True)
        mask = np.ones_like(ids)[None]
        feeds = {
            "input_ids": ids[None],
            "attention_mask": mask,
            "position_ids": decoder.graph_positions(position_ids_from_mask(mask)),
            **decoder.empty_cache(1),
        }
        values = decoder.session.run(activations, feeds)
    inputs = dict(zip(activations, values, strict=True))
    errors = {}
    for unit, names in units.items():
        worst = 0.0
        for name in names:
            node = matmuls[name]
            attrs = attributes(node)
            packed, scales, zero = (read(i) if i else None for i in [*node.input[1:4], ""][:3])
            weight = dequantize_matmul_nbits(attrs, packed, scales, zero).astype(np.float32)
            a = inputs[node.input[0]].astype(np.float32).reshape(-1, attrs["K"])
            exact = a @ weight
            rounded = int8_blockwise(a, attrs["block_size"]) @ weight
            worst = max(worst, float(np.linalg.norm(rounded - exact) / max(np.linalg.norm(exact), 1e-30)))
        errors[unit] = worst
    return errors


def int8_blockwise(a: np.ndarray, block: int) -> np.ndarray:
    """(M, K) activations as accuracy level 4 sees them: per block of ``block`` along K, a symmetric int8 scale of
    max |a| / 127, rounded to nearest, then dequantized."""
    m, k = a.shape
    padded = np.zeros((m, -(-k // block) * block), dtype=np.float32)
    padded[:, :k] = a
    blocks = padded.reshape(m, -1, block)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    scale[scale == 0] = 1
    return (np.clip(np.rint(blocks / scale), -127, 127) * scale).reshape(m, -1)[:, :k]


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    return float((reference.argmax(-1) == candidate.argmax(-1)).mean())


def guard_accuracy_level(
    model_dir: Path,
    onnx_path: Path,
    vocab_size: int,
    max_positions: int,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    threads: int | None = None,
    progress: bool = True,
) -> dict:
    """Checks the written graph's level-4 MatMulNBits against level 1 and moves the most sensitive units to level 1
    until they agree on at least ``min_agreement`` of the paragraph's next tokens; rewrites ``onnx_path`` when
    anything moved. Returns the report's figures. ``progress``: a bar over its steps (onnxruntime runs, a float
    fallback's rewrite of the weights file) on stderr, where it is a terminal."""
    with progress_bar(2, "accuracy guard", unit="step", enabled=progress) as bar:
        return _guard(model_dir, Path(onnx_path), vocab_size, max_positions, min_agreement, threads, bar)


def _guard(model_dir, onnx_path, vocab_size, max_positions, min_agreement, threads, bar) -> dict:
    started = time.perf_counter()
    model = onnx.load(str(onnx_path), load_external_data=False)
    units = matmul_units(model)
    nodes = [name for names in units.values() for name in names]
    ids, text = guard_token_ids(model_dir, vocab_size, max_positions)
    result: dict = {"min_agreement": min_agreement, "text": text, "tokens": len(ids)}

    float_levels = dict.fromkeys(nodes, FALLBACK_LEVEL)
    reference = prefill(model, onnx_path, float_levels, ids, threads)
    bar.update()
    shipped = prefill(model, onnx_path, {}, ids, threads)
    bar.update()
    agreement = top1_agreement(reference, shipped)
    result["agreement_before"] = agreement
    result["mean_kl_before"] = mean_kl(reference, shipped)
    moved: list[str] = []
    if agreement < min_agreement:
        bar.total += 1 + math.ceil(math.log2(max(len(units), 1)))  # the ranking, then the bisection's runs
        bar.refresh()
        sensitivity = activation_rounding_errors(model, onnx_path, units, ids, threads)
        bar.update()
        result["unit_activation_rounding_error"] = dict(sorted(sensitivity.items(), key=lambda item: -item[1]))
        ranked = sorted(sensitivity, key=sensitivity.get, reverse=True)

        def levels_moving(count: int) -> dict[str, int]:
            return {name: FALLBACK_LEVEL for unit in ranked[:count] for name in units[unit]}

        # The fewest of the costliest units whose fallback meets the threshold, by bisection over the ranking:
        # log2(units) sessions instead of one per unit. Every unit moved is the level-1 reference itself.
        tried = {len(ranked): 1.0}
        low, high = 1, len(ranked)
        while low < high:
            middle = (low + high) // 2
            tried[middle] = top1_agreement(reference, prefill(model, onnx_path, levels_moving(middle), ids, threads))
            bar.update()
            low, high = (low, middle) if tried[middle] >= min_agreement else (middle + 1, high)
        moved, agreement = ranked[:low], tried[low]
        bar.total = bar.n  # the bisection may need fewer runs than its bound
        result["agreement_by_units_moved"] = dict(sorted(tried.items()))
        levels = levels_moving(low)
        set_levels(model, levels)
        to_float = float_fallback_nodes(model, list(levels))
        if to_float:  # the same function as level 1 (export/float_fallback.py), so measured again as written
            bar.total += 2  # the weights file rewritten, the graph run again
            bar.refresh()
            result["float_fallback_bytes"] = replace_with_float_matmuls(model, onnx_path, to_float)
            bar.update()
            agreement = top1_agreement(reference, prefill(model, onnx_path, {}, ids, threads))
            bar.update()
            result["agreement_at_level_1"] = tried[low]
        result["nodes_to_float_matmul"] = to_float
        onnx.save_model(model, str(onnx_path))
    result.update(
        agreement=agreement,
        passed=agreement >= min_agreement,
        moved_to_level_1=moved,
        nodes_moved=[name for unit in moved for name in units[unit]],
        seconds=round(time.perf_counter() - started, 3),
    )
    return result
