"""``thinker export --verify`` of a ``--quantize`` export: the graph checked for what it is, and what the rounding
costs, reported apart.

Judging a quantized graph only by how often it agrees with the float model cannot tell a graph bug from rounding
(a fused graph without its k-norm agreed 82.6 % as int8). So three checks, each with its own figures:

  weights  every quantized weight, read back from the graph and dequantized as onnxruntime does
           (export/dequantize.py), is within its bit width's rounding error of the float weight it replaces:
           relative RMS error <= WEIGHT_ERROR[its bits], and each output row within ROW_ROUNDING_LIMIT (each block
           within BLOCK_ROUNDING_LIMIT) of the error onnxruntime's round-to-nearest makes on that row (at its own
           bits: a mixed head's int8 rows at int8). A wrong scale or zero point, even in one block, a transposed or
           misplaced weight fails here.
           A tied embedding gathered with GatherBlockQuantized is one more quantized weight, and it must dequantize
           to exactly the head's table (the graph shares the head's tensors): a Gather reading other scales or
           zero points fails here even where its error would pass the bit width's limit.
  graph    onnxruntime's graph against the PyTorch Thinker (float32, whatever the graph's dtype) holding those same
           dequantized weights (the embedding too, when the graph quantizes it; the tie undone, so each holds what
           its op reads): the float graphs' check (left-padded batch, prefill + decode steps) at the float graphs'
           tolerance for the graph's dtype. The graph runs
           with MatMulNBits' activations in float (accuracy_level 0, in a copy of the graph; 8-bit experts in
           blocks through onnxruntime's float path, ``experts_in_float``): level 4 rounds the activations to
           int8, which has no PyTorch counterpart. A graph bug fails here, whatever the bits.
  cost     the graph as shipped (its own accuracy level) against the float model on export/fidelity.py's English
           paragraph: top-1 agreement and perplexity change, gated by ``QualityGate`` (``--min-top1``,
           ``--max-perplexity-increase``). This is what quantization costs, not a test of the graph.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from thinker_common.eager import EAGER
from thinker_common.parity_inputs import (
    DEEP_CACHE_SLOTS,
    LONG_DECODE_STEPS,
    indexer_batch,
    parity_batch,
)
from thinker_common.progress import progress_bar

from .accuracy_guard import LEVELLED_OPS, graph_variant
from .dequantize import (
    EMBEDDING,
    QuantizedWeight,
    as_thinker_parameters,
    quantized_weight_readers,
    relative_error,
    thinker_names,
    untie_head,
)
from .fidelity import fidelity_token_ids, prefill_logits, text_fidelity
from .quantize import HEAD, QuantizeSpec
from .quantized_layout import Layout, layout_failures
from .reference_replay import ReferenceReplay
from .rounding import in_blocks, rtn_dequantized
from .routing import checked_probes
from .runtime import OnnxDecoder
from .verify import (
    CONTINUATION_PASSES,
    CONTINUATION_STEPS,
    DECODE_STEPS,
    DEEP_PASSES,
    EDGE_DECODE_STEPS,
    IMAGE_POSITIONS,
    LONG_PASSES,
    PADDED_AROUND,
    REFERENCE_DTYPE,
    RIGHT,
    STREAMED,
    VOCABULARY_EDGES,
    WHOLE,
    batch_failure,
    beyond_scale,
    compare_decoders,
    compare_long,
    continuation_failures,
    continuation_pass,
    deep_cache_failures,
    deep_cache_pass,
    deep_cache_steps,
    deep_slots,
    embeds_graph_of,
    genai_graph_of,
    graph_tolerance,
    half_shadow,
    image_position_failures,
    indexer_failures,
    judge,
    judged_beside,
    long_prompt_failures,
    long_prompts,
    padded_around_failures,
    padded_around_pass,
    rounding_sensitivity,
    scale_tolerance,
    sensitivity_recorded,
    side_graph_failures,
    unprompted_checks,
    vocabulary_edge_failures,
    vocabulary_edges_pass,
)

# Relative RMS error of a correctly quantized weight, with room: symmetric RTN over blocks of 32 measures ~0.1 at
# 4 bits and ~0.006 at 8 (one rounding step is 1/8 and 1/128 of the block's largest magnitude); a scale off by 10 %
# adds ~0.1, a wrong or transposed weight ~1.4.
WEIGHT_ERROR = {4: 0.2, 8: 0.02}

# A whole-tensor error hides a fault confined to a few rows (one block's zero point, one expert of 128, the int8 rows
# of a mixed head under an int4 body's limit) or a small one (a layer's scales 15 % off), so each output row is also
# held to the error that onnxruntime's round-to-nearest makes on that very row of the float weight, at the row's own
# bits, blocks and symmetry (``block_rounding_error`` reproduces it). Measured: exactly 1.000x on every row of the
# real SmolLM2-135M's int4, int8 and asymmetric exports and of the tiny test models' (dense, QMoE, the plain graph's
# experts, hybrid, mixed heads); HQQ at most 0.66x; float16 graphs 1.03x (their scales rounded to float16). Planted:
# a layer's scales 15 % off 2.5x, one int8 head row's scale 15 % off 38x, one 4-bit zero point off by 4 10x.
ROW_ROUNDING_LIMIT = 1.25
# The same of each block: one block's wrong scale in a row of hundreds moves the row's error by little (a QA run: a
# scale doubled, 1.1x on a row of 512 blocks of 16; 1.2x with a scale 30 % off on 32 blocks). Measured: 1.000x on
# every block of SmolLM2's int4 (RTN, asymmetric, HQQ) and int8 exports. A block has fewer values to average its
# rounding over than a row, so its limit leaves more room: float16 graphs reach 1.07x (tiny dense, QMoE and hybrid
# models, blocks of 16), where the QA run's doubled scale measured 14.9x.
BLOCK_ROUNDING_LIMIT = 1.5

# onnxruntime's CPU QMoE reads this as each session makes its kernels: "fp32" runs 8-bit experts in blocks with float
# activations (its dequantizing path), which otherwise round their activations to int8 whatever the node's level.
QMOE_COMPUTE_ENV = "ORT_QMOE_CPU_QNBIT_GEMM"


@contextmanager
def experts_in_float() -> Iterator[None]:
    """onnxruntime sessions made inside compute 8-bit experts in blocks with float activations (the same weights),
    for the graph check. A session keeps what it was made with (measured), so only its creation needs to be
    inside."""
    before = os.environ.get(QMOE_COMPUTE_ENV)
    os.environ[QMOE_COMPUTE_ENV] = "fp32"
    try:
        yield
    finally:
        if before is None:
            del os.environ[QMOE_COMPUTE_ENV]
        else:
            os.environ[QMOE_COMPUTE_ENV] = before


@dataclass(frozen=True)
class QualityGate:
    """What a quantized export may cost on the paragraph: top-1 agreement with the float model at least
    ``min_top1``, perplexity at most ``max_perplexity_increase`` (0.1: 10 %) above the float model's."""

    min_top1: float
    max_perplexity_increase: float
    # The limits were set by the user: a cost that cannot be measured (no tokenizer in the folder) fails the check
    # rather than passing it with a note, as the default limits' does.
    required: bool = False

    @classmethod
    def default(cls, bits: int) -> QualityGate:
        # Measured on the real SmolLM2-135M (bench/results/README-quantize.md): int8 98.2 % top-1 and +0.1 %
        # perplexity (96.9 % and +1.1 % with --no-awq); int4 with its default mixed head 85.0 % and +13.4 %, with an
        # int8 head 86.3 % and +5.4 %, with an int4 head 72.6 % and +17.5 %; with --no-awq the mixed head 67.7 % and
        # +20.6 %, an int4 head 59.3 % and +28.4 % (onnxruntime-genai's builder int4: the same); blocks of 128 fail
        # (79.6 %, +42.3 %), and blocks of 64 with an int4 head pass by a hair (67.3 %, +34.7 %). SmolLM2's float
        # weights are a dequantized 4-bit GGUF whose grid a re-quantization does not match, so int4 costs more there
        # than on a model trained in float; the gate leaves room for that and for an int4 head.
        return cls(0.9, 0.05) if bits >= 8 else cls(0.55, 0.35)

    def failure(self, cost: dict) -> str | None:
        if cost["top1_agreement"] < self.min_top1:
            return f"top-1 agreement with the float model {cost['top1_agreement']:.1%} < {_percent(self.min_top1)}"
        if math.isnan(cost["perplexity_change"]):  # no limit holds it: nan > limit is False
            return "perplexity against the float model is NaN: logits that hold inf or NaN"
        if cost["perplexity_change"] > self.max_perplexity_increase:
            return (
                f"perplexity {cost['perplexity_change']:+.1%} against the float model > "
                f"+{_percent(self.max_perplexity_increase)}"
            )
        return None


def _percent(limit: float) -> str:
    """A limit as the user gave it (0.555: 55.5%, not a rounded 56%)."""
    return f"{limit * 100:.4g}%"


def verify_quantized_export(
    model_dir: Path,
    onnx_path: Path,
    dtype: torch.dtype,
    bits: int,
    gate: QualityGate | None = None,
    threads: int | None = None,
    progress: bool = False,
    plan: str = WHOLE,
    asked: QuantizeSpec | None = None,
) -> dict:
    """``thinker export --verify`` of a quantized export: ``verify_quantized`` on the float Thinker of ``model_dir``
    loaded whole, or ``verify_quantized_streamed`` (``plan`` STREAMED, export/verify.py ``verify_plan``);
    ``progress``: a bar over loading, the cost, the weights and the graph's steps; ``asked``: the spec the export
    was asked for, whose layout the graph's weights are held to."""
    from thinker import ThinkerConfig, ThinkerForCausalLM

    deep = deep_cache_steps(ThinkerConfig.from_pretrained(model_dir), dtype)
    steps = 3 + DECODE_STEPS + 1 + 1 + LONG_DECODE_STEPS + deep + CONTINUATION_STEPS
    steps += 1 + DECODE_STEPS + 1 + EDGE_DECODE_STEPS  # the padded-around and vocabulary-edges passes
    with progress_bar(steps, "verifying", unit="step", enabled=progress) as bar:
        graph_bytes = graph_file_bytes(onnx_path)
        most = deep_slots(model_dir, dtype, plan, quantized=True, graph_bytes=graph_bytes)  # as deep as memory allows
        if plan == STREAMED:
            bar.update()
            return verify_quantized_streamed(
                model_dir, onnx_path, dtype, bits, gate, threads, on_step=bar.update, deep_most=most, asked=asked
            )
        model = ThinkerForCausalLM.from_pretrained(model_dir, dtype=REFERENCE_DTYPE, **EAGER).eval()
        bar.update()
        return verify_quantized(
            model, model_dir, onnx_path, bits, gate, threads, bar.update, graph_dtype=dtype, deep_most=most, asked=asked
        )


def graph_file_bytes(onnx_path: Path) -> int:
    """The graph's bytes on disk: its proto and the weights files it names."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    external = onnx.TensorProto.EXTERNAL
    named = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == external
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return onnx_path.stat().st_size + sum((onnx_path.parent / name).stat().st_size for name in named)


def verify_quantized(
    model: torch.nn.Module,
    model_dir: Path,
    onnx_path: Path,
    bits: int,
    gate: QualityGate | None = None,
    threads: int | None = None,
    on_step: Callable[[], object] | None = None,
    graph_dtype: torch.dtype | None = None,
    deep_most: int = DEEP_CACHE_SLOTS,
    asked: QuantizeSpec | None = None,
) -> dict:
    """The three checks on the float ``model`` (changed in place: it ends up holding the dequantized weights);
    ``graph_dtype``: the graph's, which sets the graph check's tolerance (default: the model's).
    Returns the report's figures; ``passed`` False with ``failure`` naming every check that failed. ``on_step``:
    called after the cost, the weights and each step of the graph check (a progress bar's ``update``)."""
    on_step = on_step or (lambda: None)
    cost = quantization_cost(model, model_dir, shipped_session(onnx_path, threads))  # before the weights change
    on_step()

    readers = quantized_weight_readers(onnx_path)
    weights = WeightFigures.for_graph(readers, model)
    untie_head(model)  # a graph may quantize the head and gather the embedding another way: two tables
    for graph_name, read in readers.items():  # one weight dequantized at a time
        for name, quantized in as_thinker_parameters({graph_name: read()}, model).items():
            parameter = model.get_parameter(name)
            weights.add(name, quantized, parameter)
            with torch.no_grad():
                parameter.copy_(quantized.weight)
    on_step()
    graph = graph_check(model, onnx_path, threads, on_step, graph_dtype, deep_most)
    reference = "PyTorch ThinkerForCausalLM with the graph's dequantized weights"
    return quantized_result(reference, "cpu", cost, weights, graph, gate or QualityGate.default(bits), asked)


def verify_quantized_streamed(
    model_dir: Path,
    onnx_path: Path,
    dtype: torch.dtype,
    bits: int,
    gate: QualityGate | None = None,
    threads: int | None = None,
    on_step: Callable[[], object] | None = None,
    deep_most: int = DEEP_CACHE_SLOTS,
    asked: QuantizeSpec | None = None,
) -> dict:
    """The same three checks with the float Thinker read from ``model_dir`` one layer at a time as it runs
    (``converter.streamed``), and each quantized weight read from the graph's weights file and dequantized when its
    layer loads, in place of the float one: the memory of a session of the graph at a time and one layer, for a
    model of any size. The figures are ``verify_quantized``'s."""
    from converter.layer_parity import load_layered_converted

    on_step = on_step or (lambda: None)
    streamed = load_layered_converted(model_dir, REFERENCE_DTYPE)
    model = streamed.model
    try:
        with streamed.streaming():
            cost = quantization_cost(model, model_dir, shipped_session(onnx_path, threads))
        on_step()

        readers = quantized_weight_readers(onnx_path)
        parameters = dict(model.named_parameters(remove_duplicate=False))  # on the meta device: names and shapes
        owners = {part: name for name in readers for part in thinker_names(name, parameters)}
        weights = WeightFigures.for_graph(readers, model)

        def put_dequantized(unit) -> None:
            """The unit's quantized parameters replaced by the graph's dequantized weights (dropped with it)."""
            names = [name for name in [*unit.tensors, *unit.ties] if name in owners]
            for graph_name in dict.fromkeys(owners[name] for name in names):
                for name, quantized in as_thinker_parameters({graph_name: readers[graph_name]()}, model).items():
                    current = streamed.get_tensor(name)
                    weights.add(name, quantized, current)
                    streamed.set_tensor(name, quantized.weight.to(current.dtype))

        on_step()
        streamed.after_load = put_dequantized
        with streamed.streaming():
            graph = graph_check(model, onnx_path, threads, on_step, dtype, deep_most)
    finally:
        streamed.close()
    reference = "PyTorch ThinkerForCausalLM with the graph's dequantized weights, read layer by layer as it runs"
    return quantized_result(reference, "cpu", cost, weights, graph, gate or QualityGate.default(bits), asked)


@dataclass
class WeightFigures:
    """What the weights check found: each dequantized parameter's relative error against its float original and
    its bits, the embedding's op, and for a tied model the largest difference of the embedding's table from the
    head's (None where it does not apply)."""

    errors: dict[str, float]
    bits: dict[str, int]
    embedding: str
    tied_difference: float | None
    # the row furthest beyond its own rounding error: (ratio, parameter, row, bits, block size)
    worst_row: tuple[float, str, int, int, int] | None = None
    worst_block: tuple[float, str, int, int, int] | None = None  # the same, the block furthest from its rounding
    layouts: dict[str, Layout] = field(default_factory=dict)  # how each weight is stored (export/quantized_layout.py)

    @classmethod
    def for_graph(cls, readers: dict[str, Callable[[], QuantizedWeight]], model: torch.nn.Module) -> WeightFigures:
        """Empty figures for the quantized weights of ``readers``, the tied tables already compared: for a tied
        model whose embedding and head are both quantized, the two tables read and held to each other."""
        figures = cls(errors={}, bits={}, embedding="Gather (float)", tied_difference=None)
        if model.config.tie_word_embeddings and EMBEDDING in readers and HEAD in readers:
            tables = as_thinker_parameters({name: readers[name]() for name in (EMBEDDING, HEAD)}, model)
            figures.tied_difference = tied_table_difference(tables, model)
        return figures

    def add(self, name: str, quantized: QuantizedWeight, float_weight: torch.Tensor) -> None:
        """Parameter ``name``'s dequantized weight against its float one (the first time it is seen)."""
        if name not in self.errors:  # a streamed check loads each layer once per forward pass
            self.errors[name] = relative_error(name, quantized.weight, float_weight)
            worst = worst_rounding(quantized, float_weight) or {}
            if (row := worst.get("row")) and (self.worst_row is None or row[0] > self.worst_row[0]):
                self.worst_row = (row[0], name, *row[1:])
            if (block := worst.get("block")) and (self.worst_block is None or block[0] > self.worst_block[0]):
                self.worst_block = (block[0], name, *block[1:])
        self.bits[name] = quantized.bits
        self.layouts[name] = Layout.of(quantized)
        if name == EMBEDDING:
            self.embedding = quantized.op_type


def block_rounding_error(
    rows: torch.Tensor, bits: int, block_size: int, asymmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per block of ``rows`` (R, K), float, (R, blocks): the norm of the error round-to-nearest makes on it
    (export/rounding.py ``rtn_dequantized``, onnxruntime's rounding at ``bits``, ``block_size``, symmetry and
    ``scale_dtype``)."""
    dequantized = rtn_dequantized(rows, bits, block_size, asymmetric, scale_dtype)
    return (dequantized - in_blocks(rows, block_size)).norm(dim=-1)


def worst_rounding(
    quantized: QuantizedWeight, reference: torch.Tensor
) -> dict[str, tuple[float, int, int, int]] | None:
    """The row, and the block, of a dequantized parameter furthest from its float one, each as a multiple of the
    error round-to-nearest makes on it (``block_rounding_error``): {"row": (ratio, row, bits, block size), "block":
    the same, the block's row named}; None where the graph does not say its grid. Rows are the output rows (a
    table's rows; experts' rows, expert after expert). Blocks too: one block's wrong scale in a row of hundreds of
    blocks moves the row's error by little (a QA run: a doubled scale, 1.1x on a row of 512 blocks)."""
    weight = torch.as_tensor(quantized.weight)
    scale_dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float32  # the scales'
    weight, reference = weight.float(), reference.detach().float()
    weight, reference = weight.reshape(-1, weight.shape[-1]), reference.reshape(-1, reference.shape[-1])
    if quantized.row_parts:
        parts = quantized.row_parts
    elif quantized.block_size is not None:
        parts = ((0, weight.shape[0], quantized.bits, quantized.block_size),)
    else:
        return None
    worst: dict[str, tuple[float, int, int, int]] = {}
    for start, stop, bits, block in parts:
        if block is None:
            continue
        rows, error = reference[start:stop], weight[start:stop] - reference[start:stop]
        by_block = (  # (R, blocks) each: the rounding error, the values' size, the graph's error
            block_rounding_error(rows, bits, block, quantized.asymmetric, scale_dtype),
            in_blocks(rows, block).norm(dim=-1),
            in_blocks(error, block).norm(dim=-1),
        )
        by_row = tuple(part.norm(dim=-1, keepdim=True) for part in by_block)
        for unit, (rounding, size, difference) in (("row", by_row), ("block", by_block)):
            # A row already on the grid rounds to itself; a float16 graph still rounds its scales (2^-11 relative)
            ratios = difference / torch.maximum(rounding, (2.0**-10 * size).clamp_min(1e-30))
            ratios = ratios.nan_to_num(nan=math.inf, posinf=math.inf)  # a NaN scale the worst, not never the worst
            row = int(ratios.amax(dim=-1).argmax())
            if unit not in worst or ratios[row].max() > worst[unit][0]:
                worst[unit] = (float(ratios[row].max()), start + row, bits, block)
    return worst or None


def graph_check(
    model: torch.nn.Module,
    onnx_path: Path,
    threads: int | None,
    on_step: Callable[[], object],
    graph_dtype: torch.dtype | None = None,
    deep_most: int = DEEP_CACHE_SLOTS,
) -> dict:
    """The graph with float activations against ``model`` (holding the graph's dequantized weights) over the
    parity batch, with the tolerance: the float graphs', or SENSITIVITY_MARGIN times the input's own rounding
    sensitivity where that is larger. A model with Qwen3.8 indexers also on prompts they prune
    (``indexer_prompts``, judged as the float export's: export/verify.py ``indexer_failures``)."""
    dtype = graph_dtype or next(model.parameters()).dtype
    with closing(ReferenceReplay(onnx_path.parent)) as replay:  # the second graph's passes read back
        return _graph_check(model, onnx_path, threads, on_step, dtype, deep_most, replay)


def _graph_check(
    model: torch.nn.Module,
    onnx_path: Path,
    threads: int | None,
    on_step: Callable[[], object],
    dtype: torch.dtype,
    deep_most: int,
    replay: ReferenceReplay,
) -> dict:
    """``graph_check``'s passes, the reference's runs recorded in ``replay`` (export/reference_replay.py)."""
    batch, genai_path = parity_batch(model.config.vocab_size), genai_graph_of(onnx_path)
    with float_activation_copy(onnx_path) as exact_path:
        exact = OnnxDecoder(exact_path, provider="cpu", threads=threads, probes=checked_probes(exact_path, dtype))
        shadow, long_shadow, deep_shadow, continued_shadow = (half_shadow(model, dtype) for _ in range(4))
        graph = compare_decoders(model, exact, *batch, on_step=on_step, shadow=shadow, replay=replay)
        long_inputs = long_prompts(model, exact)
        again = replay if genai_path else None  # what model.genai.onnx's passes alone read back: kept for them only
        options = {"on_step": on_step, "replay": again}
        graph["long_prompts"] = compare_long(model, exact, long_inputs, shadow=long_shadow, **options)
        deep = {"most_slots": deep_most, "shadow": deep_shadow, "replay": again}
        graph["deep_cache"] = deep_cache_pass(model, exact, dtype, on_step=on_step, **deep)
        graph["continuation"] = continuation_pass(model, exact, shadow=continued_shadow, **options)
        graph[PADDED_AROUND] = padded_around_pass(model, exact, shadow=shadow, on_step=on_step, replay=replay)
        graph[VOCABULARY_EDGES] = vocabulary_edges_pass(
            model, exact, onnx_path, on_step=on_step, shadow=half_shadow(model, dtype)
        )
        if exact.position_rank == 3:  # multimodal RoPE: the batch at an image's positions, whose streams differ
            shadowed = half_shadow(model, dtype)
            graph[IMAGE_POSITIONS] = compare_decoders(model, exact, *batch, shadow=shadowed, image_positions=True)
        if model.config.has_indexed_attention:
            graph["indexer_prompts"] = compare_decoders(model, exact, *indexer_batch(model.config))
            graph["indexer_prompts"]["failures"] = indexer_failures(graph["indexer_prompts"], dtype)
        del exact  # one session of the graph at a time
    if genai_path:  # onnxruntime-genai's graph over the same weights, on the rows padded on the right
        with float_activation_copy(genai_path) as exact_path:
            exact = OnnxDecoder(exact_path, provider="cpu", threads=threads, probes=checked_probes(exact_path, dtype))
            options = {"candidate_padding": RIGHT, "replay": replay}
            graph["genai_graph"] = compare_decoders(model, exact, *batch, shadow=shadow, **options)
            graph["genai_graph_long_prompts"] = compare_long(model, exact, long_inputs, shadow=long_shadow, **options)
            graph["genai_graph_deep_cache"] = deep_cache_pass(model, exact, dtype, **deep)
            graph["genai_graph_continuation"] = continuation_pass(model, exact, shadow=continued_shadow, replay=replay)
    embeds_path = embeds_graph_of(onnx_path)
    if embeds_path:  # the --inputs-embeds graph, on a prompt with foreign embeddings
        with float_activation_copy(embeds_path) as exact_path:
            exact = OnnxDecoder(exact_path, provider="cpu", threads=threads, probes=checked_probes(exact_path, dtype))
            shadow = half_shadow(model, dtype)
            graph["embeds_graph"] = compare_decoders(model, exact, *batch, shadow=shadow, foreign_embeddings=True)
    # Each measure is two prefills of the reference (7.5 s of the Qwen3-0.6B-shaped int4 check): taken only where
    # it can change the verdict, as the float export's check takes them.
    on_batch, on_long = sensitivities_needed(graph, dtype)
    batch_sensitivity = rounding_sensitivity(model, *batch) if on_batch else None
    long_sensitivity = rounding_sensitivity(model, *long_inputs) if on_long else None
    graph |= sensitivity_recorded(batch_sensitivity)
    graph["tolerance"] = graph_tolerance(graph, dtype)
    for keys, measured in ((ON_BATCH, batch_sensitivity), (ON_LONG_PROMPTS, long_sensitivity)):
        for key in keys:
            if key in graph and "not_run" not in graph[key]:
                graph[key] |= sensitivity_recorded(measured)
                graph[key]["tolerance"] = graph_tolerance(graph[key], dtype)
    judged_beside(graph)
    # judged here, where the model's config and the graph's dtype are known (with what lies beyond every prompt);
    # quantized_result reports them
    graph["rope_tables"], unprompted = unprompted_checks(onnx_path, dtype, model.config)
    graph["beyond_batch_failures"] = long_prompt_failures(graph, model.config, dtype) + deep_cache_failures(graph)
    graph["beyond_batch_failures"] += continuation_failures(graph, model.config, dtype)
    graph["beyond_batch_failures"] += image_position_failures(graph) + padded_around_failures(graph)
    graph["beyond_batch_failures"] += vocabulary_edge_failures(graph)
    graph["beyond_batch_failures"] += unprompted
    return graph


# The passes judged at the parity batch's rounding sensitivity (the edges': close), and those at the long prompts'
# (the deep cache's steps attend mostly to random slots, which no perturbation of a prompt's embeddings reaches; a
# continuation is a long prompt fed in two steps).
ON_BATCH = (IMAGE_POSITIONS, PADDED_AROUND, VOCABULARY_EDGES)
ON_LONG_PROMPTS = (*LONG_PASSES, *DEEP_PASSES, *CONTINUATION_PASSES)


def sensitivities_needed(graph: dict, dtype: torch.dtype) -> tuple[bool, bool]:
    """Whether the graph check's figures need the batch's and the long prompts' rounding sensitivity: only where a
    pass judged at it parts beyond the logit scale's tolerance, which is all its allowance can change. The side
    graphs (``genai_graph``, ``embeds_graph``) are judged at the batch's own tolerance, so at its logit scale."""
    sides = [graph[key] for key in ("genai_graph", "embeds_graph") if key in graph]
    on_batch = beyond_scale(dtype, graph, *(graph.get(key) for key in ON_BATCH)) or any(
        side["max_abs_diff"] > scale_tolerance(graph, dtype) for side in sides
    )
    return on_batch, beyond_scale(dtype, *(graph.get(key) for key in ON_LONG_PROMPTS))


def quantized_result(
    reference: str,
    provider: str,
    cost: dict,
    weights: WeightFigures,
    graph: dict,
    gate: QualityGate,
    asked: QuantizeSpec | None = None,
) -> dict:
    """The report's figures from the three checks; ``passed`` False with ``failure`` naming every check that
    failed. ``asked``: the layout the export asked for, which each weight's stored one is held to."""
    errors, bits = weights.errors, weights.bits
    # Each weight against its own bit width's limit (an int8 head under an int4 body), the worst by that margin.
    margins = {name: error / WEIGHT_ERROR[bits[name]] for name, error in errors.items()}
    worst = max(margins, key=margins.get) if margins else None
    result: dict = {"reference": reference, "provider": provider, "cost": cost}
    result["weights"] = {
        "quantized": len(errors),
        "worst": worst,
        "relative_error": errors[worst] if worst else 0.0,
        "limit": WEIGHT_ERROR[bits[worst]] if worst else None,
        "max_relative_error_by_bits": {
            f"int{b}": max((e for n, e in errors.items() if bits[n] == b), default=0.0)
            for b in sorted(set(bits.values()))
        },
        "embedding": weights.embedding,
    }
    if weights.tied_difference is not None:
        result["weights"]["tied_embedding_max_abs_diff_from_head"] = weights.tied_difference
    for key, worst_part, limit in (
        ("worst_row", weights.worst_row, ROW_ROUNDING_LIMIT),
        ("worst_block", weights.worst_block, BLOCK_ROUNDING_LIMIT),
    ):
        if worst_part is not None:
            ratio, name, row, row_bits, block = worst_part
            result["weights"][key] = {
                "weight": name,
                "row": row,
                "bits": row_bits,
                "block_size": block,
                "error_over_rounding": ratio,
                "limit": limit,
            }
    result["graph"] = graph

    failures = layout_failures(weights.layouts, asked) if asked is not None else []
    if worst and margins[worst] > 1:
        limit = result["weights"]["limit"]
        failures.append(f"quantized weight {worst} is {errors[worst]:.3g} off the float one (> {limit})")
    if weights.worst_row is not None and weights.worst_row[0] > ROW_ROUNDING_LIMIT:
        ratio, name, row, row_bits, block = weights.worst_row
        blocks = f"blocks of {block}" if block else "one block per row"
        failures.append(
            _rounding_failure(f"row {row}", "row", name, ratio, f"int{row_bits}, {blocks}", ROW_ROUNDING_LIMIT)
        )
    elif weights.worst_block is not None and weights.worst_block[0] > BLOCK_ROUNDING_LIMIT:
        ratio, name, row, row_bits, block = weights.worst_block
        where, grid = f"a block of row {row}", f"int{row_bits}, blocks of {block}"
        failures.append(_rounding_failure(where, "block", name, ratio, grid, BLOCK_ROUNDING_LIMIT))
    if weights.tied_difference:
        failures.append(
            f"the tied embedding dequantizes to a table up to {weights.tied_difference:.3g} off the head's "
            "(it must gather the head's own quantized weights)"
        )
    graph_failure = judge(graph, graph["tolerance"], " against the model with the same dequantized weights")
    if graph_failure:
        failures.append(batch_failure(graph_failure))
    failures += side_graph_failures(graph, graph["tolerance"])
    failures += graph.pop("beyond_batch_failures")  # long prompts, RoPE tables, attention windows
    if "indexer_prompts" in graph:
        failures += graph["indexer_prompts"].pop("failures")
    if "skipped" in cost and gate.required:
        failures.append(
            f"the quantization cost, which --min-top1 / --max-perplexity-increase limit, was not measured: "
            f"{cost['skipped']}"
        )
    if "skipped" not in cost:
        cost.update(min_top1_agreement=gate.min_top1, max_perplexity_increase=gate.max_perplexity_increase)
        cost_failure = gate.failure(cost)
        if cost_failure and math.isnan(cost["perplexity_change"]):  # no limit the user sets passes it
            failures.append(cost_failure)
        elif cost_failure:
            failures.append(f"{cost_failure} (set the limits with --min-top1 / --max-perplexity-increase)")
    result["passed"] = not failures
    if failures:
        result["failure"] = "; ".join(failures)
    return result


def _rounding_failure(where: str, unit: str, name: str, ratio: float, grid: str, limit: float) -> str:
    """A row's or block's dequantized values against round-to-nearest's on the same grid, ``ratio`` times as far
    from the float ones (inf: they hold inf or NaN)."""
    if not math.isfinite(ratio):
        return f"{where} of quantized weight {name} dequantizes to inf or NaN: a wrong scale or zero point"
    return (
        f"{where} of quantized weight {name} is {ratio:.3g}x as far from the float {unit} as round-to-nearest at "
        f"{grid}, takes it (> {limit}): a wrong scale or zero point"
    )


def tied_table_difference(dequantized: dict, model: torch.nn.Module) -> float | None:
    """For a tied model whose embedding and head are both quantized, the largest |difference| between the two
    dequantized tables: 0 when the embedding gathers from the head's own tensors, as the exporter writes it."""
    if not model.config.tie_word_embeddings or EMBEDDING not in dequantized or HEAD not in dequantized:
        return None
    embedding, head = dequantized[EMBEDDING].weight.float(), dequantized[HEAD].weight.float()
    if embedding.shape != head.shape:
        return float("inf")
    return float((embedding - head).abs().max())


def shipped_session(onnx_path: Path, threads: int | None) -> OnnxDecoder:
    """The graph as shipped, for the cost's one prefill (every position of the paragraph, also from a --logits last
    graph, whose selection the graph check covers), on the CPU, where the cost is measured; let go once the cost is
    taken, before the graph check's sessions (it held its weights and its largest run's buffers beside theirs, to the
    end of the verify)."""
    return OnnxDecoder(onnx_path, provider="cpu", threads=threads, all_positions=True)


@torch.no_grad()
def quantization_cost(model: torch.nn.Module, model_dir: Path, decoder: OnnxDecoder) -> dict:
    """export/fidelity.py's paragraph through the float PyTorch model and the shipped graph."""
    ids, text = fidelity_token_ids(model_dir, model.config.vocab_size, model.config.max_position_embeddings)
    if ids is None:
        return {"skipped": text}
    reference = model(input_ids=torch.from_numpy(ids)[None]).logits[0].float().numpy()
    return {"text": text, **text_fidelity(reference, prefill_logits(decoder, ids), ids)}


@contextmanager
def float_activation_copy(onnx_path: Path) -> Iterator[Path]:
    """The graph with every MatMulNBits and QMoE at accuracy_level 0 (activations in the graph's float type): a
    temporary proto beside the original, reading the same weights file (onnxruntime refuses external data reached
    through a link from another folder), removed afterwards. Sessions made inside also run 8-bit experts in blocks
    with float activations, which they round to int8 at every level (``experts_in_float``)."""
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    levels = {node.name: 0 for node in model.graph.node if node.op_type in LEVELLED_OPS}
    with graph_variant(model, onnx_path, levels) as path, experts_in_float():
        yield path
