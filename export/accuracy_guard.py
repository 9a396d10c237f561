"""A per-layer guard for ``--accuracy-level 4``: layers whose int8 activations flip tokens fall back to float.

accuracy_level 4 has MatMulNBits round its activations to int8 per block of the input axis (onnxruntime's fastest
CPU kernels), which is reported to flip greedy tokens on some models (onnxruntime issue 29849): an outlier channel
in a block crushes the other channels of that block to a few levels. QMoE's experts in blocks do the same (4 bits at
level 4; 8 bits at every level). After the graph is written, the guard runs export/fidelity.py's paragraph (teacher
forced, one prefill) through the graph as written and through the same graph with every unit moved to float
activations, the same quantized weights: MatMulNBits and 4-bit QMoE at accuracy_level 1, 8-bit QMoE as the float MoE
op over its dequantized stacks. It takes the share of positions where both pick the same next token. Below
``min_agreement`` it ranks the decoder layers (and the head) by what int8 activations cost each: one more prefill
at level 1 hands back every quantized op's input activations, which are rounded here as level 4 rounds them (per
block of the input axis, a scale of max |a| / 127, MLAS's CompInt8 quantization of A) and multiplied by the op's
dequantized weights (export/dequantize.py): a MatMulNBits' relative output error ||(A_int8 - A) W|| / ||A W||, a
QMoE's over its routed experts with their SwiGLU outputs rounded too (``qmoe_rounding_error``), a unit ranked by its
worst op. That costs one prefill in all, where measuring each unit alone at level 4 would cost one onnxruntime
session per layer (~10 s each for SmolLM2 on this machine); it is a proxy for the kernel's rounding, so the choice is
made with the real kernels: the costliest units move to float activations, the shortest prefix of the ranking whose
graph meets ``min_agreement``, found by bisection (agreement grows, if not strictly, as units move; whatever prefix
is chosen was measured to meet the threshold, as the guard writes it).
A moved unit's MatMulNBits and 4-bit QMoE go to level 1. A moved 8-bit MatMulNBits of a float32 graph becomes a
float32 MatMul over its dequantized weight instead, the same function without onnxruntime's per-call
dequantization, and a moved 8-bit QMoE in blocks the float MoE op over its dequantized stacks (export/float_fallback.py,
which rewrites the weights file; the trial graphs dequantize those in the graph), unless one more run shows the
moved units meeting the threshold with their 8-bit experts kept at int8 activations (the float stacks cost 4x
their bytes); the graph as written is measured once more.

Cost: two sessions and prefills of ~230 tokens when the graph passes (SmolLM2-135M: 2-3 s); when it falls back, one
more for the ranking and one per bisection step (log2 of the units). The guard's prefills are the peak of a quantized
export (bench/results/README-export-peak.md), so the reference's logits wait in a file while the shipped graph runs
(``SetAside``: in one-off runs on SmolLM2's int4 export with ``--no-awq``, the guard's own peak fell from 810 to 713
MiB; turning onnxruntime's CPU arena off as well cost 21 MiB more, not less), and the float-activation sessions run
wide 8-bit MatMulNBits as row slices (export/row_slices.py), or onnxruntime would dequantize a whole 8-bit head at
once.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

from thinker_common.progress import progress_bar
from thinker_common.staging import write_fully

from .dequantize import attributes, constant_reader, dequantize_matmul_nbits, dequantize_qmoe
from .fidelity import fidelity_token_ids, mean_kl
from .float_fallback import dequantizing_experts, expert_fallback_nodes, float_fallback_nodes, replace_with_fallbacks
from .names import DEFAULT_MIN_AGREEMENT
from .row_slices import split_wide_matmuls
from .runtime import OnnxDecoder, position_ids_from_mask

FALLBACK_LEVEL = 1
# The quantized ops with MatMulNBits' accuracy levels: a unit falls back as a whole, its quantized experts (QMoE)
# with its projections.
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
    reason = text if ids is None else "the paragraph is a single token"
    random_ids = np.random.default_rng(0).integers(0, vocab_size, size=length, dtype=np.int64)
    return random_ids, f"random ids (seed 0; {reason})"


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
    model: onnx.ModelProto,
    onnx_path: Path,
    levels: dict[str, int],
    split_wide: bool = False,
    float_experts: Sequence[str] = (),
) -> Iterator[Path]:
    """``model`` with ``levels`` applied, saved beside ``onnx_path`` (its weights file in reach), removed after.
    ``float_experts``: those QMoE nodes (``expert_fallback_nodes``) as the float MoE op over their stacks
    dequantized in the graph (export/float_fallback.py ``dequantizing_experts``), the function the guard writes for a
    moved one. ``split_wide``: its wide level-1 MatMulNBits as row slices of the same weights
    (export/row_slices.py), the same products at a lower peak, for the guard's own sessions."""
    variant = onnx.ModelProto()
    variant.CopyFrom(model)
    set_levels(variant, levels)
    dequantizing_experts(variant, list(float_experts))
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
    """The logits of ``ids`` through ``model`` with ``levels``, its moved 8-bit experts in blocks in float
    (``graph_variant``): every unit moved is the guard's reference."""
    float_experts = expert_fallback_nodes(model, [name for name, level in levels.items() if level == FALLBACK_LEVEL])
    with graph_variant(model, onnx_path, levels, split_wide=True, float_experts=float_experts) as path:
        decoder = OnnxDecoder(path, provider="cpu", threads=threads, all_positions=True)
        return decoder.prefill(ids[None], np.ones_like(ids)[None])[0][0]


def activation_rounding_errors(
    model: onnx.ModelProto, onnx_path: Path, units: dict[str, list[str]], ids: np.ndarray, threads
) -> dict[str, float]:
    """Each unit's worst relative output error from int8 activations in its quantized ops, on the level-1 graph's
    own activations: a MatMulNBits' product, a QMoE's routed experts (``qmoe_rounding_error``). Weights are read
    from the file one op at a time."""
    read = constant_reader(model.graph, base_dir=onnx_path.parent)
    levelled = {node.name: node for node in model.graph.node if node.op_type in LEVELLED_OPS}
    probed = {}  # every op's activations (a QMoE's router logits too) as extra outputs, typed as its scales
    for node in levelled.values():
        scales = node.input[2] if node.op_type == "MatMulNBits" else node.input[3]
        for name in node.input[: 2 if node.op_type == "QMoE" else 1]:
            probed[name] = onnx.helper.np_dtype_to_tensor_dtype(read(scales).dtype)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(n, t, None) for n, t in sorted(probed.items()))
    float_experts = expert_fallback_nodes(model, list(levelled))
    levels = dict.fromkeys(levelled, FALLBACK_LEVEL)
    with graph_variant(probe, onnx_path, levels, split_wide=True, float_experts=float_experts) as path:
        decoder = OnnxDecoder(path, provider="cpu", threads=threads, all_positions=True)
        mask = np.ones_like(ids)[None]
        feeds = {
            "input_ids": ids[None],
            "attention_mask": mask,
            "position_ids": decoder.graph_positions(position_ids_from_mask(mask)),
            **decoder.empty_cache(1),
        }
        names = sorted(probed)
        values = dict(zip(names, decoder.session.run(names, feeds), strict=True))
    del decoder

    def error(node: onnx.NodeProto) -> float:
        attrs = attributes(node)
        if node.op_type == "QMoE":
            if not attrs.get("block_size"):  # a scale per row: computed in float at every level
                return 0.0
            fc1 = dequantize_qmoe(attrs, read(node.input[2]), read(node.input[3]), attrs.get("swiglu_fusion") == 1)
            fc2 = dequantize_qmoe(attrs, read(node.input[5]), read(node.input[6]), interleaved=False)
            x, logits = (values[name].astype(np.float32).reshape(-1, values[name].shape[-1]) for name in node.input[:2])
            return qmoe_rounding_error(attrs, x, logits, fc1.astype(np.float32), fc2.astype(np.float32))
        packed, scales, zero = (read(i) if i else None for i in [*node.input[1:4], ""][:3])
        weight = dequantize_matmul_nbits(attrs, packed, scales, zero).astype(np.float32)
        a = values[node.input[0]].astype(np.float32).reshape(-1, attrs["K"])
        return relative_difference(int8_blockwise(a, attrs["block_size"]) @ weight, a @ weight)

    return {unit: max((error(levelled[name]) for name in names), default=0.0) for unit, names in units.items()}


def qmoe_rounding_error(attrs: dict, x: np.ndarray, logits: np.ndarray, fc1: np.ndarray, fc2: np.ndarray) -> float:
    """A QMoE's relative output error from int8 activations, its kernel's in blocks: the float MoE of its
    dequantized stacks (FC1 (E, 2I, C) gate rows then up rows, FC2 (E, C, I)) over the tokens ``x`` (N, C) with
    their input, and their SwiGLU outputs, each rounded per block as level 4 rounds (``int8_blockwise``: what the
    kernel computes, measured in tests/export/test_quantized_experts.py), against the same without rounding; routed
    as QMoE routes (softmax, top k, renormalised: the graph writes QMoE only where the model renormalises)."""
    block, k = attrs["block_size"], attrs["k"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, top, -1)
    weights /= weights.sum(-1, keepdims=True)
    exact, rounded = np.zeros_like(x), np.zeros_like(x)
    for expert in np.unique(top):
        rows, slots = np.nonzero(top == expert)
        for a, out, rounds in ((x[rows], exact, False), (int8_blockwise(x[rows], block), rounded, True)):
            gate, up = np.split(a @ fc1[expert].T, 2, axis=-1)
            inner = gate / (1 + np.exp(-gate)) * up
            inner = int8_blockwise(inner, block) if rounds else inner
            np.add.at(out, rows, weights[rows, slots, None] * (inner @ fc2[expert].T))
    return relative_difference(rounded, exact)


def relative_difference(candidate: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(candidate - exact) / max(float(np.linalg.norm(exact)), 1e-30))


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


def top1_agreement(reference_top1: np.ndarray, candidate: np.ndarray) -> float:
    """The share of positions where ``candidate``'s (T, V) logits pick the reference's next token."""
    return float((reference_top1 == candidate.argmax(-1)).mean())


class SetAside:
    """(T, V) logits kept in an unnamed temporary file in ``folder`` and read back a slice of positions at a time,
    with their top-1 ids in memory: the guard's reference waits there while the next graph's session runs, which
    would otherwise hold it too (SmolLM2's paragraph: 45 MB of the export's peak, which is the guard's)."""

    def __init__(self, logits: np.ndarray, folder: Path) -> None:
        self.top1 = logits.argmax(-1)
        self.rows, self.width = logits.shape
        self.dtype = logits.dtype
        self.file = tempfile.TemporaryFile(dir=folder)
        write_fully(self.file, np.ascontiguousarray(logits))  # a full disk's error with its errno (not tofile's)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.rows)
        if step != 1:
            raise ValueError("SetAside reads contiguous slices of positions")
        self.file.seek(start * self.width * self.dtype.itemsize)
        values = np.fromfile(self.file, self.dtype, max(stop - start, 0) * self.width)
        return values.reshape(-1, self.width)

    def close(self) -> None:
        self.file.close()


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
    reference = SetAside(prefill(model, onnx_path, float_levels, ids, threads), onnx_path.parent)
    try:
        bar.update()
        shipped = prefill(model, onnx_path, {}, ids, threads)
        bar.update()
        agreement = top1_agreement(reference.top1, shipped)
        result["agreement_before"] = agreement
        result["mean_kl_before"] = mean_kl(reference, shipped)
    finally:
        reference.close()
    reference = reference.top1  # what the runs below are held to
    del shipped  # nor is the graph's own kept through them
    moved: list[str] = []
    moved_nodes: list[str] = []
    if agreement < min_agreement:
        # the ranking, the bisection's runs, and one with the moved units' 8-bit experts kept
        bar.total += 2 + math.ceil(math.log2(max(len(units), 1)))
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
        result["agreement_by_units_moved"] = dict(sorted(tried.items()))
        levels = levels_moving(low)
        # A moved unit's 8-bit experts in blocks fall back at 4x their bytes: one more run says whether the moved
        # units meet the threshold with their experts kept at int8 activations, and if so they stay.
        experts = expert_fallback_nodes(model, list(levels))
        if experts:
            kept = {name: level for name, level in levels.items() if name not in experts}
            with_int8_experts = top1_agreement(reference, prefill(model, onnx_path, kept, ids, threads))
            bar.update()
            result["agreement_with_int8_experts"] = with_int8_experts
            if with_int8_experts >= min_agreement:
                levels, agreement = kept, with_int8_experts
        bar.total = bar.n  # the bisection may need fewer runs than its bound
        set_levels(model, levels)
        moved_nodes = list(levels)  # a moved unit's experts may have stayed at int8 activations
        to_float = float_fallback_nodes(model, list(levels))
        experts_to_float = expert_fallback_nodes(model, list(levels))
        if to_float or experts_to_float:  # the same function as level 1 (export/float_fallback.py), measured again
            bar.total += 2  # the weights file rewritten, the graph run again
            bar.refresh()
            result["float_fallback_bytes"] = replace_with_fallbacks(model, onnx_path, to_float, experts_to_float)
            bar.update()
            # the chosen levels' agreement before the rewrite (its experts kept at int8 activations where they stay)
            result["agreement_at_level_1"] = agreement
            agreement = top1_agreement(reference, prefill(model, onnx_path, {}, ids, threads))
            bar.update()
        result["nodes_to_float_matmul"] = to_float
        result["experts_to_float_moe"] = experts_to_float
        onnx.save_model(model, str(onnx_path))
    result.update(
        agreement=agreement,
        passed=agreement >= min_agreement,
        moved_to_level_1=moved,
        nodes_moved=moved_nodes,
        seconds=round(time.perf_counter() - started, 3),
    )
    return result
