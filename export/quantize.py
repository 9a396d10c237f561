"""Weight-only int4/int8 quantization of the projections (``thinker export --quantize int4|int8``): MatMulNBits.

The quantization itself is onnxruntime's: each projection is handed, as a one-node MatMul model, to
``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` with the chosen algorithm, and what comes
back (a MatMulNBits node, packed weights, scales, zero points) is spliced into the graph being built, its tensors
streamed to the external-data file. Quantizing one weight at a time while the graph is written keeps the
exporter's memory at one tensor, as for float graphs, instead of loading a whole float model to quantize it after;
a big one (the head) goes through the quantizer in slices of output columns (``SLICE_BYTES``).

  rtn   the quantizer's default: block-wise round-to-nearest, symmetric (a scale per block, no zero point), the
        layout onnxruntime's CPU kernels run fastest and the one onnxruntime-genai's model builder writes for CPU
  rtn-asym  the same with a zero point per block (uint8): on SmolLM2 more top-1 agreement but a larger perplexity
        cost, at about rtn's speed (README, "Quantized exports")
  hqq   Half-Quadratic Quantization: asymmetric, fits each block's zero point to minimise the error. Much better
        fidelity, but its float zero points take onnxruntime's CPU "unpacked" path, which dequantizes the weights on
        every call: fine for checking fidelity, far too slow for CPU decoding (bench/results/README-figures.md)

What is quantized: every 2-D projection that goes through ``DecoderGraph.emit_matmul`` (attention q/k/v/o, the MLPs,
shared experts, the head). A tied embedding is the head's weight: when the head is quantized the embedding lookup
becomes onnxruntime's ``GatherBlockQuantized`` over the head's own packed weight, scales and zero points
(``emit_gather``), so the table is stored once, quantized, as onnxruntime-genai's builder does. Not with HQQ: its float
zero points are not a type GatherBlockQuantized takes (zero points share the data's uint8 type), so an HQQ export keeps
the float embedding beside its quantized head, as does ``--embedding float`` (``float_embedding``: the builder's int8
layout, whose fidelity the quantized table costs a little of on SmolLM2). An untied embedding stays float: a decode step
reads one row of it per token, so quantizing it would save file size, not time. In the fused graph a layer's routed
experts are onnxruntime's QMoE over the two expert stacks (``quantize_experts``: symmetric whatever ``algo``, QMoE
taking no float zero points; in blocks where the widths are whole blocks: int4, and int8 at accuracy level 4 in a
float32 graph, whose block-wise kernel rounds the activations to int8; else int8 a scale per row, computed in float);
the plain graph dequantizes the same values, held as int8, as it gathers them (``standard_experts``). What is not
quantized: norms, the MoE router, projections too small to gain (fewer input features than one block, or fewer than 16
outputs).

The head, the single most output-sensitive weight, may take its own precision (``--quantize-head``): int8 under an
int4 body (``head_bits=8``) is the truest and reads 18 % more bytes per SmolLM2 token than the builder's int4
layout; ``mixed`` (``head_int8_rows``, the int4 default, ``DEFAULT_HEAD``) quantizes the vocabulary's first rows at
int8 and the rest at int4, as two MatMulNBits whose logits are concatenated (``SplitProjection``), and a tied
embedding gathers each id from its own part. Byte-level BPE vocabularies (GPT-2's, Llama 3's, Qwen's, SmolLM's)
number tokens in merge order, which follows frequency, so the first rows are the tokens a model picks most: on
SmolLM2 the float model's top-1 token lies in the first 8192 ids at 90 % and 96 % of the positions of the two
benchmark texts, and a head with those rows at int8 keeps the int8 head's top-1 agreement (67.7 % / 70.5 % against
68.6 % / 70.7 %; an int4 head 60.2 % / 58.6 %) for 2.8 % more bytes per token than an int4 head, where the int8
head costs 18 %; the perplexity cost lies between the two (+20 % against +13 % and +27 %;
bench/bench_quant_methods.py).

Blocks: ``--block-size`` (every weight), or where it is not given 32, and at int4 under the activation-aware scales
(export/awq.py) 64 for the projections they cover whose inputs are whole blocks of 64 (``SCALED_INT4_BLOCK_SIZE``,
``QuantizeSpec.covering``): a float32 scale per 64 weights is 10 % fewer bytes for those projections than one per 32,
and the scales, searched at that block, buy back the coarser rounding. The head, routed experts, Gated DeltaNet's
projections and a model the scales skip keep blocks of 32, where nothing buys it back.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next): in_proj_qkv, in_proj_z and out_proj are quantized like any projection;
in_proj_a and in_proj_b are not (``KEPT_FLOAT``): they are Hv wide (a few kilobytes), and their outputs set the
decay ``exp(-exp(A_log) * softplus(a + dt_bias))`` and the write strength, to which the whole carried state is
exponentially sensitive (onnxruntime-genai's builder keeps them float too). The conv, A_log, dt_bias and the norms
are not projections and stay float; the recurrence runs in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from thinker_common.errors import ThinkerError

from .dequantize import unpack_nibbles
from .graph_builder import TORCH_TO_ONNX, GraphBuilder
from .names import (
    ACCURACY_LEVELS,
    ALGORITHMS,
    BITS,
    BLOCK_SIZES,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_HEAD_INT8_ROWS,
    EMBEDDINGS,
    HEAD_PRECISIONS,
)

if TYPE_CHECKING:
    from thinker.configuration_thinker import ThinkerConfig

# The head's precision when --quantize-head is not given: mixed under int4 (see the module docstring), int8 under int8.
DEFAULT_HEAD = {"int4": "mixed"}
# Where --awq is on when not given (export/awq.py): round-to-nearest in a float32 graph, int4 and int8 (on SmolLM2 it
# halves the mean KL from the float model at both). A float16 graph of SmolLM2 scaled so failed its own check (after
# a cache of 4102 slots half precision moved the reference's logits beyond the tolerance), so CUDA's float16 takes
# the scales when asked (README, "Quantized exports").
DEFAULT_AWQ = {("int4", "rtn", "float32"), ("int8", "rtn", "float32")}
DEFAULT_BLOCK_SIZE = 32
# Where --block-size is not given, the int4 projections the activation-aware scales cover (export/awq.py; those whose
# inputs are whole blocks of it) are rounded in blocks of 64 and every other weight in blocks of 32: the head, routed
# experts, Gated DeltaNet's projections, a model the scales skip. A scale per 64 weights instead of per 32 is 10 %
# fewer bytes for those projections (float32 scales: 0.5625 bytes a weight against 0.625), and decode at batch 1 is
# bound by those bytes; the scales buy back the coarser rounding. On SmolLM2 (README, "Quantized exports"): decode
# 1.07x the builder's int4 at batch 1 where blocks of 32 throughout ran at 0.98x in the same runs, top-1 agreement
# over both texts 19 points above the builder's (23 in blocks of 32); without the scales blocks of 64 keep 3.5 of
# plain RTN's 8.4 points on the paragraph, so plain rounding stays at 32.
SCALED_INT4_BLOCK_SIZE = 64
# Projections a graph writes packed under a name of their own (export/fused_graph.py ``emit_packed_qkv``): one
# MatMulNBits, so one block size, which is the parts' where all of them have it.
PACKED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
MIN_OUTPUTS = 16  # below this a projection (the shared-expert gate, (C, 1)) is not worth a quantized kernel
HEAD = "lm_head.weight"
# Projections left in float whatever their size, by name suffix (see the module docstring).
KEPT_FLOAT = (".linear_attn.in_proj_a.weight", ".linear_attn.in_proj_b.weight")
# onnxruntime's quantizer holds several float copies of the weight it is handed (padded, transposed, scales in
# float64): 3.5x the weight at the peak, measured, so SmolLM2's 113 MB head cost the export 400 MB. A weight bigger
# than this goes through it in slices of whole output columns. Blocks run along the input axis, so under RTN every
# column is quantized on its own and the slices' tensors, concatenated on N (their outermost axis), are the whole
# weight's bit for bit (tested). Not HQQ: its solver stops on the mean error of the whole tensor.
SLICE_BYTES = 16 * 2**20
COLUMN_WISE_ALGORITHMS = ("rtn", "rtn-asym")


@dataclass(frozen=True)
class QuantizeSpec:
    """``bits`` 4 or 8; ``block_size`` weights per scale along the input axis; ``algo`` rtn or hqq;
    ``accuracy_level`` MatMulNBits' compute type for the activations (0: as the graph, 1: float32, 4: int8,
    onnxruntime's fastest CPU kernels and its model builder's CPU default); ``head_bits`` the head's bits when
    they differ from the body's (rtn); ``head_int8_rows`` a mixed head's rows at 8 bits (the first ones), the rest at
    ``bits`` (rtn); ``float_embedding`` a tied embedding kept as the float table beside the quantized head instead of
    gathered from the head's tensors (the builder's int8 layout); ``awq`` activation-aware scales before rounding
    (export/awq.py; rtn only); ``scaled_block_size`` the block size of the projections the scales cover,
    ``scaled_weights`` (known once the scales are made: ``covering``), where it is not ``block_size``. The fields
    are the layout as given; ``parse`` applies the CLI's defaults (the mixed head at int4, activation-aware scales in
    float32 graphs, and under int4 scales blocks of ``SCALED_INT4_BLOCK_SIZE`` for the projections they cover)."""

    bits: int = 4
    block_size: int = DEFAULT_BLOCK_SIZE
    algo: str = "rtn"
    accuracy_level: int = 4
    head_bits: int | None = None
    head_int8_rows: int = 0
    float_embedding: bool = False
    awq: bool = False
    scaled_block_size: int | None = None
    scaled_weights: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.scaled_block_size and not self.awq:
            raise ThinkerError("scaled_block_size is the block of the projections --awq's scales cover; set awq too")
        if self.awq and self.algo != "rtn":
            raise ThinkerError(
                f"--awq searches scales for symmetric round-to-nearest (--algo rtn), and --algo {self.algo} fits "
                "its own; drop --awq"
            )

    @classmethod
    def parse(
        cls,
        quantize: str,
        block_size: int | None = None,
        algo: str = "rtn",
        accuracy_level: int | None = None,
        head: str | None = None,
        head_int8_rows: int | None = None,
        dtype: str = "float32",
        embedding: str = "quantized",
        awq: bool | None = None,
    ) -> QuantizeSpec:
        """From the CLI's words: ``quantize`` int4 / int8, ``block_size`` None: ``DEFAULT_BLOCK_SIZE``, and for the
        projections int4's activation-aware scales cover ``SCALED_INT4_BLOCK_SIZE``, ``head`` int4 / int8 / mixed
        (None: DEFAULT_HEAD's choice), ``head_int8_rows`` a mixed head's int8 rows (None: ``DEFAULT_HEAD_INT8_ROWS``),
        ``accuracy_level`` None: the graph ``dtype``'s (``DEFAULT_ACCURACY_LEVEL``), ``embedding`` a tied
        embedding's table, quantized (gathered from the head's) or float, ``awq`` None: on for rtn in a
        float32 graph (``DEFAULT_AWQ``; README, "Quantized exports")."""
        if accuracy_level is None:
            accuracy_level = DEFAULT_ACCURACY_LEVEL.get(dtype, 0)
        if quantize not in BITS:
            raise ThinkerError(f"--quantize {quantize}: expected one of {', '.join(BITS)}")
        head = head or DEFAULT_HEAD.get(quantize, quantize)
        if head not in HEAD_PRECISIONS:
            raise ThinkerError(f"--quantize-head {head}: expected one of {', '.join(HEAD_PRECISIONS)}")
        if head == "mixed" and quantize != "int4":
            raise ThinkerError("--quantize-head mixed splits an int4 head; under --quantize int8 the head is int8")
        if head_int8_rows is not None and head != "mixed":
            raise ThinkerError("--head-int8-rows sets the int8 rows of --quantize-head mixed (the int4 default)")
        rows = DEFAULT_HEAD_INT8_ROWS if head_int8_rows is None else head_int8_rows
        if head == "mixed" and rows < 1:
            raise ThinkerError(f"--head-int8-rows {rows}: a mixed head needs at least one int8 row")
        if algo not in ALGORITHMS:
            raise ThinkerError(f"--algo {algo}: expected one of {', '.join(ALGORITHMS)}")
        if algo == "hqq" and quantize != "int4":
            # HQQ writes float zero points, which onnxruntime's CPU MatMulNBits reads for 2 and 4 bits only.
            raise ThinkerError("--algo hqq quantizes to int4 only; use --algo rtn for int8")
        if block_size is not None and block_size not in BLOCK_SIZES:
            raise ThinkerError(f"--block-size {block_size}: expected one of {', '.join(map(str, BLOCK_SIZES))}")
        if accuracy_level not in ACCURACY_LEVELS:
            raise ThinkerError(f"--accuracy-level {accuracy_level}: expected one of {ACCURACY_LEVELS}")
        if embedding not in EMBEDDINGS:
            raise ThinkerError(f"--embedding {embedding}: expected one of {', '.join(EMBEDDINGS)}")
        mixed = head == "mixed"
        awq = awq if awq is not None else (quantize, algo, dtype) in DEFAULT_AWQ
        scaled_block = SCALED_INT4_BLOCK_SIZE if block_size is None and awq and quantize == "int4" else None
        return cls(
            BITS[quantize],
            block_size or DEFAULT_BLOCK_SIZE,
            algo,
            accuracy_level,
            head_bits=None if mixed or head == quantize else BITS[head],
            head_int8_rows=rows if mixed else 0,
            float_embedding=embedding == "float",
            awq=awq,
            scaled_block_size=scaled_block,
        )

    def covering(self, weights: frozenset[str]) -> QuantizeSpec:
        """This spec once the activation-aware scales were made for ``scaled_block_size``: ``weights`` (their
        names in the Thinker folder) take that block, and so does a packed projection all of whose parts do; where
        they cover none, every weight keeps ``block_size``, and the spec says so."""
        if not weights or not self.scaled_block_size:
            return dataclasses.replace(self, scaled_block_size=None, scaled_weights=frozenset())
        packed = {
            f"{prefix}.{name}.weight"
            for name, parts in PACKED_PROJECTIONS.items()
            for prefix in {w.rsplit(".", 2)[0] for w in weights}
            if all(f"{prefix}.{part}.weight" in weights for part in parts)
        }
        return dataclasses.replace(self, scaled_weights=frozenset(weights) | packed)

    def block_for(self, name: str) -> int:
        """Weight ``name``'s block size: ``scaled_block_size`` for the weights the scales cover, else ``block_size``."""
        if self.scaled_block_size and name in self.scaled_weights:
            return self.scaled_block_size
        return self.block_size

    def for_weight(self, name: str) -> QuantizeSpec:
        """The spec for weight ``name``: the head may have its own bits (always rtn: HQQ is int4 only); a mixed
        head's is its int4 part's (its int8 rows: ``head_rows``); a weight the scales cover has their block
        (``block_for``)."""
        if name == HEAD and (self.head_bits or self.head_int8_rows):
            bits = self.head_bits or self.bits
            return dataclasses.replace(self, bits=bits, algo="rtn", head_bits=None, head_int8_rows=0)
        block = self.block_for(name)
        return self if block == self.block_size else dataclasses.replace(self, block_size=block)

    def for_vocab(self, vocab_size: int) -> QuantizeSpec:
        """This spec for a model of ``vocab_size`` rows: a mixed head whose int8 rows cover the whole vocabulary is
        an int8 head, and is reported and labelled as one."""
        if 0 < vocab_size <= self.head_int8_rows:
            return dataclasses.replace(self, head_int8_rows=0, head_bits=None if self.bits == 8 else 8)
        return self

    def whole_head_note(self, vocab_size: int) -> str | None:
        """Said where a mixed head's int8 rows (``--head-int8-rows``, given or the default) cover the whole
        vocabulary, which ``for_vocab`` turns into an int8 head."""
        if 0 < vocab_size <= self.head_int8_rows:
            return (
                f"the mixed head's {self.head_int8_rows} int8 rows (--head-int8-rows) cover the whole vocabulary "
                f"({vocab_size} rows): the head is int8 throughout, as with --quantize-head int8"
            )
        return None

    def head_rows(self, outputs: int) -> list[tuple[int, int, QuantizeSpec]]:
        """The head's row ranges ``(start, stop, spec)``: one, or a mixed head's int8 rows and then the rest."""
        whole = self.for_weight(HEAD)
        if not 0 < self.head_int8_rows < outputs:
            return [(0, outputs, dataclasses.replace(whole, bits=8) if self.head_int8_rows else whole)]
        return [(0, self.head_int8_rows, dataclasses.replace(whole, bits=8)), (self.head_int8_rows, outputs, whole)]

    def describe(self, head_quantized: bool = True) -> dict:
        """For export_report.json; ``head_quantized`` False: the graph kept the head float (narrower than a block,
        or too few outputs), which the report says rather than the head layout asked for."""
        head = "mixed" if self.head_int8_rows else f"int{self.head_bits or self.bits}"
        rows = {"head_int8_rows": self.head_int8_rows} if self.head_int8_rows and head_quantized else {}
        head = head if head_quantized else "float"
        embedding = {"embedding": "float"} if self.float_embedding else {}
        scaled = {"scaled_block_size": self.scaled_block_size} if self.scaled_block_size else {}
        return {
            "weights": f"int{self.bits}",
            "head": head,
            **rows,
            **embedding,
            "block_size": self.block_size,
            **scaled,
            "algo": self.algo,
            "symmetric": self.algo == "rtn",
            "awq": self.awq,
            "accuracy_level": self.accuracy_level,
        }

    def label(self, head_quantized: bool = True) -> str:
        """The spec in words; ``head_quantized`` False: the graph kept the head float (``describe``)."""
        head = f", int{self.head_bits} head" if self.head_bits else ""
        if self.head_int8_rows:
            head = f", mixed head (int8 for its first {self.head_int8_rows} rows)"
        if not head_quantized:
            head = ", float head"
        algo = f"{self.algo} with activation-aware scales" if self.awq else self.algo
        block = f"block {self.block_size}"
        if self.scaled_block_size:
            block = f"block {self.scaled_block_size} where the scales cover, {self.block_size} elsewhere"
        return f"int{self.bits} {algo}, {block}{head}"


@dataclass(frozen=True)
class QuantizedProjection:
    """One projection as onnxruntime's quantizer left it, its tensors already in the graph's weights file:
    ``inputs`` the MatMulNBits inputs after the activations (packed weight, scales, zero points when asymmetric),
    ``shapes`` theirs, ``attributes`` the node's (K, N, bits, block_size, accuracy_level)."""

    inputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    attributes: dict
    domain: str
    float_zero_points: bool  # HQQ's: a MatMulNBits input that GatherBlockQuantized does not take


@dataclass(frozen=True)
class SplitProjection:
    """A weight quantized in ranges of its output rows, each its own MatMulNBits, concatenated on the output axis:
    the mixed head (its first rows at int8). ``pieces`` in row order; each piece's tensors are named
    ``<weight>.rows_<start>_<stop>`` (``split_piece_name``)."""

    pieces: tuple[QuantizedProjection, ...]

    @property
    def float_zero_points(self) -> bool:
        return any(piece.float_zero_points for piece in self.pieces)


def split_piece_name(name: str, start: int, stop: int) -> str:
    """The graph name of rows [start, stop) of weight ``name`` in a ``SplitProjection``."""
    return f"{name}.rows_{start}_{stop}"


SPLIT_PIECE = re.compile(r"\.rows_(\d+)_(\d+)")  # split_piece_name's suffix


def split_rows(graph: onnx.GraphProto) -> set[int]:
    """The rows at which a ``SplitProjection`` of ``graph`` starts a piece after its first (the mixed head's first
    int4 row): where a tied embedding's lookup turns from one table to the other."""
    return {
        int(found.group(1))
        for tensor in graph.initializer
        if (found := SPLIT_PIECE.search(tensor.name)) and int(found.group(1)) > 0
    }


def column_wise_int8(stack: torch.Tensor, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """An (E, N, K) stack as symmetric 8-bit weights with one scale per row: uint8 q (E, N, K) and scales (E, N) in
    ``scale_dtype``, the weight (q - 128) * scale. Written here because onnxruntime's quantizer takes blocks of 16
    to 256 only (QMoE's row-wise layout is one block of K); one expert at a time, so the float temporaries stay
    one expert's. Each row is rounded against its stored scale, so the weights are exactly what the kernel reads."""
    packed = np.empty(stack.shape, dtype=np.uint8)
    scales = np.empty(stack.shape[:2], dtype=scale_dtype)
    for expert, weight in enumerate(stack):
        weight = weight.float()
        scale = torch.from_numpy((weight.abs().amax(-1) / 127).numpy().astype(scale_dtype)).float()
        scale[scale == 0] = 1.0
        q = torch.round(weight / scale[:, None]).clamp_(-127, 127).add_(128)
        packed[expert] = q.to(torch.uint8).numpy()
        scales[expert] = scale.numpy().astype(scale_dtype)
    return packed, scales


@dataclass(frozen=True)
class QuantizedExperts:
    """One expert stack as QMoE reads it, its tensors already in the graph's weights file: ``inputs`` the packed
    weights (E, N, K * bits / 8) and scales: (E, N, K / block_size) in blocks, (E, N) per row (``block_size`` 0,
    8 bits)."""

    inputs: tuple[str, str]
    bits: int
    block_size: int
    accuracy_level: int


@dataclass(frozen=True)
class StandardExperts:
    """One expert stack in standard onnx types (``WeightQuantizer.standard_experts``): ``values`` (E, K, N) int8,
    ``scales`` (E, K / block_size, N), or (E, N) where ``block_size`` is 0, of onnx type ``scale_type``."""

    values: str
    scales: str
    block_size: int
    scale_type: int


@dataclass(frozen=True)
class QuantizedSlice:
    """The quantizer's MatMulNBits node for some of a weight's output columns, as plain values: its inputs after
    the activations, attributes, domain and tensors by name."""

    inputs: tuple[str, ...]
    attributes: dict
    domain: str
    arrays: dict[str, np.ndarray]


class WeightQuantizer:
    """Turns ``x @ W`` into MatMulNBits through onnxruntime's MatMulNBitsQuantizer, one weight at a time."""

    def __init__(self, spec: QuantizeSpec, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.float16):
            raise ThinkerError("--quantize needs --dtype float32 or float16 (MatMulNBits' activation types)")
        self.spec = spec
        self.dtype = dtype
        self.narrower_than_a_block: dict[str, int] = {}  # projection -> its input width, under the block size
        # The quantizer logs two INFO lines per weight on its own handler; keep its warnings only.
        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

    def applies(self, weight: torch.Tensor, name: str = "") -> bool:
        """Whether projection ``name`` with (in, out) ``weight`` is quantized; one left float only because its input
        is narrower than a block is noted (``narrow_note``)."""
        in_features, out_features = weight.shape
        if in_features < self.spec.block_size and out_features >= MIN_OUTPUTS and not name.endswith(KEPT_FLOAT):
            self.narrower_than_a_block[name] = in_features
        return self.applies_to_shape(tuple(weight.shape), name)

    @staticmethod
    def few_outputs_head_note(config, head_quantized: bool) -> str | None:
        """What the export tells a user whose head stayed float for its vocabulary: fewer outputs than a quantized
        kernel takes (a head narrower than a block is ``narrow_note``'s)."""
        if head_quantized or config.vocab_size >= MIN_OUTPUTS:
            return None
        return (
            f"the head stays float: its {config.vocab_size} outputs (vocab_size) are fewer than the {MIN_OUTPUTS} a "
            "quantized projection takes, whatever --quantize-head says"
        )

    def narrow_note(self) -> str | None:
        """What the export tells a user whose --block-size left projections float (a small model's widths)."""
        if not self.narrower_than_a_block:
            return None
        widths = sorted(set(self.narrower_than_a_block.values()))
        names = sorted(self.narrower_than_a_block)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (
            f"{len(names)} projection(s) stay float: their input width ({', '.join(map(str, widths))}) is under "
            f"--block-size {self.spec.block_size} ({shown}); export with --block-size "
            f"{max((b for b in BLOCK_SIZES if b <= widths[0]), default=min(BLOCK_SIZES))} or less to quantize them"
        )

    def applies_to_shape(self, shape: tuple[int, ...], name: str = "") -> bool:
        in_features, out_features = shape
        big_enough = in_features >= self.spec.block_size and out_features >= MIN_OUTPUTS
        return big_enough and not name.endswith(KEPT_FLOAT)

    def shares_embedding(self, head_shape: tuple[int, ...]) -> bool:
        """Whether a tied embedding is gathered from the quantized head of (in, out) ``head_shape``: the head is
        quantized, not with float zero points (HQQ), which GatherBlockQuantized does not take, and the float table
        was not asked for (``float_embedding``)."""
        if self.spec.float_embedding:
            return False
        return self.applies_to_shape(head_shape, HEAD) and self.spec.for_weight(HEAD).algo != "hqq"

    @staticmethod
    def algo_config(spec: QuantizeSpec):
        from onnxruntime.quantization import matmul_nbits_quantizer as nbits

        if spec.algo == "hqq":  # asymmetric by construction: HQQ optimises the zero points
            return nbits.HQQWeightOnlyQuantConfig(block_size=spec.block_size, bits=spec.bits)
        return nbits.DefaultWeightOnlyQuantConfig(
            block_size=spec.block_size,
            is_symmetric=spec.algo == "rtn",
            accuracy_level=spec.accuracy_level,
            bits=spec.bits,
        )

    def emit(self, b: GraphBuilder, x: str, name: str, weight: torch.Tensor) -> str:
        """Adds ``x @ weight`` as a MatMulNBits node (a mixed head: two, and a Concat) to ``b``; returns its output."""
        return self.emit_matmul(b, x, self.quantize(b, name, weight))

    def quantize(self, b: GraphBuilder, name: str, weight: torch.Tensor) -> QuantizedProjection | SplitProjection:
        """``weight`` (in, out) quantized by onnxruntime's quantizer, its tensors written to ``b``'s weights; the
        head of a mixed spec in its row ranges (``QuantizeSpec.head_rows``)."""
        if name == HEAD:
            ranges = self.spec.head_rows(weight.shape[1])
            if len(ranges) > 1:
                return SplitProjection(
                    tuple(
                        self.quantize_whole(b, split_piece_name(name, start, stop), weight[:, start:stop], spec)
                        for start, stop, spec in ranges
                    )
                )
            return self.quantize_whole(b, name, weight, ranges[0][2])
        return self.quantize_whole(b, name, weight, self.spec.for_weight(name))

    def quantize_whole(
        self, b: GraphBuilder, name: str, weight: torch.Tensor, spec: QuantizeSpec
    ) -> QuantizedProjection:
        """``weight`` as one MatMulNBits' tensors (``quantize_columns``), written to ``b``'s weights."""
        out_features = weight.shape[1]
        first, arrays = self.quantize_columns(name, weight, spec)
        for tensor_name, array in arrays.items():  # packed weights, scales (zero points): the external-data file
            b.weight(tensor_name, array)
        zero_points = arrays[first.inputs[2]] if len(first.inputs) > 2 and first.inputs[2] else None
        return QuantizedProjection(
            inputs=first.inputs,
            shapes=tuple(arrays[i].shape if i else () for i in first.inputs),
            attributes={**first.attributes, "N": out_features},
            domain=first.domain,
            float_zero_points=zero_points is not None and zero_points.dtype != np.uint8,
        )

    def quantize_columns(
        self, name: str, weight: torch.Tensor, spec: QuantizeSpec
    ) -> tuple[QuantizedSlice, dict[str, np.ndarray]]:
        """``weight`` (in, out) through the quantizer in slices of output columns (``SLICE_BYTES``): the first
        slice's node (inputs, attributes) and the slices' tensors joined along N (their outermost axis), by name."""
        in_features, out_features = weight.shape
        columns = out_features
        if spec.algo in COLUMN_WISE_ALGORITHMS:
            columns = max(MIN_OUTPUTS, SLICE_BYTES // (in_features * weight.element_size()))
        slices = [
            self.quantize_slice(name, weight[:, start : start + columns], spec)
            for start in range(0, out_features, columns)
        ]
        first = slices[0]
        arrays = {}
        for position, tensor_name in enumerate(first.inputs):
            if tensor_name:
                parts = [part.arrays[part.inputs[position]] for part in slices]
                arrays[tensor_name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return first, arrays

    def applies_to_experts(self, rows: int, in_features: int) -> bool:
        """Whether a stack of experts of ``rows`` outputs and ``in_features`` inputs each is quantized (QMoE):
        at 4 bits its inputs must be whole blocks (QMoE reads no padding), and its rows a projection's
        (``applies_to_shape``)."""
        whole_blocks = self.spec.bits == 8 or in_features % self.spec.block_size == 0
        return whole_blocks and self.applies_to_shape((in_features, rows))

    def experts_advice(self, hidden_size: int, expert_size: int) -> str:
        """What quantizes routed experts of these widths that this spec left float (``applies_to_experts`` of both
        stacks, (2I, C) and (C, I)): the widest --block-size that does, else int8 (a scale per row takes any
        width), else why nothing does."""
        stacks = ((2 * expert_size, hidden_size), (hidden_size, expert_size))
        if min(rows for rows, _ in stacks) < MIN_OUTPUTS:
            return f"an expert gives fewer than {MIN_OUTPUTS} outputs, which no --block-size changes"

        def quantized(spec: QuantizeSpec) -> bool:
            return all(WeightQuantizer(spec, self.dtype).applies_to_experts(*stack) for stack in stacks)

        blocks = [block for block in BLOCK_SIZES if quantized(replace(self.spec, block_size=block))]
        if blocks:
            return f"--block-size {max(blocks)} quantizes them"
        int8 = [block for block in BLOCK_SIZES if quantized(replace(self.spec, bits=8, block_size=block))]
        if int8:  # int4 only here: int8 takes any block its widths hold (the one asked for, where it is among them)
            flags = "" if self.spec.block_size in int8 else f" --block-size {max(int8)}"
            return (
                f"no --block-size divides both widths, as int4 experts need; --quantize int8{flags} quantizes them "
                "(a scale per row where the widths are not whole blocks)"
            )
        return f"they are narrower than the smallest block ({min(BLOCK_SIZES)})"

    def experts_in_blocks(self, *in_features: int) -> bool:
        """Whether one QMoE's expert stacks, of these input widths, go in blocks along their inputs (its one
        ``block_size`` is both stacks'): at 4 bits always (``applies_to_experts``); at 8 bits where every width is
        whole blocks and the graph is a float32 one at accuracy level 4, else a scale per row. QMoE's block-wise
        8-bit CPU kernel rounds the experts' activations to int8 per block at any accuracy level (measured: it
        computes the float MoE of the same weights over activations rounded as level 4 rounds MatMulNBits', per
        block a scale of max |a| / 127), which is level 4's function, and runs a decode step 1.6x faster than the
        row-wise kernel, which computes in float (bench/bench_qmoe_int8.py). So at a float-activation level
        (``--accuracy-level 1``), or in a float16 graph (whose QMoE is CUDA's), 8-bit experts keep a scale per
        row. CUDA's QMoE computes 8-bit blocks right too (float16 activations; an H100,
        ``test_cuda_quantized_experts_equal_the_cpu``), and no faster: on an H200, twelve layers of 64 experts took
        1.83 / 1.81 ms in blocks of 32 against 1.78 / 1.80 with a scale per row, 1 / 128 rows
        (bench/results/qmoe_int8-cuda.json)."""
        if self.spec.bits == 4:
            return True
        level_4 = self.spec.accuracy_level == 4 and self.dtype == torch.float32
        return level_4 and all(width % self.spec.block_size == 0 for width in in_features)

    def quantize_experts(self, b: GraphBuilder, name: str, stack: torch.Tensor, in_blocks: bool) -> QuantizedExperts:
        """A layer's (E, N, K) expert stack (each expert's rows its outputs) as QMoE's tensors, written to ``b``'s
        weights, symmetric (QMoE's CPU kernel reads 2^(bits-1) as the zero point when none is given, and takes no
        float ones, HQQ's), whatever ``algo``.

        ``in_blocks`` (``experts_in_blocks``), in blocks along K: every row of every expert is one column of an
        (K, E * N) weight to onnxruntime's quantizer, so each expert comes out as if quantized alone (RTN quantizes
        every column on its own), and its (E * N, blocks, block * bits / 8) packed rows and (E * N, blocks) scales
        are QMoE's (E, N, K * bits / 8) and (E, N, K / block), the layout the op documents as "produced by
        quantize_matmul_{4,8}bits"; ``accuracy_level`` as MatMulNBits'. Else (8 bits) a scale per row
        (``column_wise_int8``)."""
        packed, scales, block_size = self.expert_arrays(name, stack, in_blocks)
        fc = (f"{name}_Q{self.spec.bits}", f"{name}_scales")
        b.weight(fc[0], packed)
        b.weight(fc[1], scales)
        return QuantizedExperts(fc, self.spec.bits, block_size, self.spec.accuracy_level if block_size else 0)

    def standard_experts(self, b: GraphBuilder, name: str, stack: torch.Tensor) -> StandardExperts:
        """The same quantized weights as ``quantize_experts`` in standard onnx types, for the plain graph's experts
        (dequantized as they are gathered: a prompt's Loop expert by expert, a decode step's picked experts as one
        batch): the values signed (q - 2^(bits-1), so no zero point) and int8 at either width, because onnx's
        Gather takes no int4 (so a 4-bit stack costs a byte a weight here, half the fused graph's bytes and a quarter
        of float32's), transposed to (E, K, N) as MatMul multiplies by them; scales (E, K / block, N) in blocks along
        K, or (E, N) one per output."""
        packed, scales, block_size = self.expert_arrays(name, stack, in_blocks=self.spec.bits == 4)
        if self.spec.bits == 4:
            values = unpack_nibbles(torch.from_numpy(packed)).numpy()  # (E, N, K), 0..15
            values, scales = values.astype(np.int8) - 8, scales.transpose(0, 2, 1)
        else:
            values = (packed.astype(np.int16) - 128).astype(np.int8)
        values_name = b.weight(f"{name}_Q{self.spec.bits}", np.ascontiguousarray(values.transpose(0, 2, 1)))
        scales_name = b.weight(f"{name}_scales", np.ascontiguousarray(scales))
        return StandardExperts(values_name, scales_name, block_size, helper.np_dtype_to_tensor_dtype(scales.dtype))

    def expert_arrays(self, name: str, stack: torch.Tensor, in_blocks: bool) -> tuple[np.ndarray, np.ndarray, int]:
        """(E, N, K) -> QMoE's packed weights (E, N, K * bits / 8), scales and block size: in blocks of the spec's
        size along K, or (8 bits, not ``in_blocks``) a scale per row, block size 0."""
        experts, rows, in_features = stack.shape
        if not in_blocks:
            packed, scales = column_wise_int8(stack, np.float16 if self.dtype == torch.float16 else np.float32)
            return packed, scales, 0
        spec = dataclasses.replace(self.spec, algo="rtn", head_bits=None, head_int8_rows=0)
        first, arrays = self.quantize_columns(name, stack.reshape(experts * rows, in_features).T, spec)
        packed, scales = (arrays[first.inputs[i]] for i in (0, 1))
        return packed.reshape(experts, rows, -1), scales.reshape(experts, rows, -1), spec.block_size

    def quantize_slice(self, name: str, weight: torch.Tensor, spec: QuantizeSpec) -> QuantizedSlice:
        """What onnxruntime's quantizer makes of ``x @ weight``, copied out of its model: a reference into a
        protobuf message keeps the whole message alive, the float weight it was given included."""
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(self.one_matmul_model(name, weight), algo_config=self.algo_config(spec))
        with warnings.catch_warnings():
            # HQQ hands torch a read-only view of the weight it only reads; torch warns of writes that never come.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            quantizer.process()
        graph = quantizer.model.model.graph
        (node,) = graph.node
        if node.op_type != "MatMulNBits":
            raise RuntimeError(f"onnxruntime's quantizer left {name} as {node.op_type} (a bug in the exporter)")
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attributes["accuracy_level"] = spec.accuracy_level  # HQQ's config has no field for it
        return QuantizedSlice(
            inputs=tuple(node.input[1:]),  # positional: an input left out is "" (none here but trailing ones)
            attributes=attributes,
            domain=node.domain,
            arrays={tensor.name: numpy_helper.to_array(tensor).copy() for tensor in graph.initializer},
        )

    @classmethod
    def emit_matmul(cls, b: GraphBuilder, x: str, projection: QuantizedProjection | SplitProjection) -> str:
        """``x @ W`` as the MatMulNBits node over ``projection``'s tensors (a split one: a node per piece, their
        outputs concatenated in row order)."""
        if isinstance(projection, SplitProjection):
            parts = [cls.emit_matmul(b, x, piece) for piece in projection.pieces]
            return b.op("Concat", *parts, axis=-1)
        return b.op("MatMulNBits", x, *projection.inputs, domain=projection.domain, **projection.attributes)

    @classmethod
    def emit_gather(cls, b: GraphBuilder, head: QuantizedProjection | SplitProjection, indices: str) -> str:
        """Rows ``indices`` of the head's weight (``emit_gather_rows``); a mixed head's two parts each gathered with
        the ids clamped into its range, the right one chosen per id (one more gather of B x T rows, no table)."""
        if not isinstance(head, SplitProjection):
            return cls.emit_gather_rows(b, head, indices)
        if len(head.pieces) != 2:
            raise RuntimeError(f"a head in {len(head.pieces)} pieces (a bug in the exporter)")
        first, rest = head.pieces
        rows = first.attributes["N"]
        low = cls.emit_gather_rows(b, first, b.op("Min", indices, b.const(rows - 1)))
        high = cls.emit_gather_rows(b, rest, b.op("Max", b.op("Sub", indices, b.const(rows)), b.const(0)))
        in_first = b.op("Unsqueeze", b.op("Less", indices, b.const(rows)), b.const([-1]))
        return b.op("Where", in_first, low, high)

    @staticmethod
    def emit_gather_rows(b: GraphBuilder, head: QuantizedProjection, indices: str) -> str:
        """Rows ``indices`` of the head's (N, K) weight, i.e. of the tied embedding, dequantized by
        GatherBlockQuantized from the head's own tensors: (..., K) in the scales' dtype.

        Layouts (onnxruntime 1.31's contrib schemas and CPU kernels): MatMulNBits' packed weight is (N, blocks,
        block * bits / 8) uint8 and its scales (N, blocks), its uint8 zero points (N, ceil(blocks * bits / 8));
        GatherBlockQuantized with uint8 data, ``gather_axis`` 0 and ``quantize_axis`` 1 reads data (N, blocks *
        block * bits / 8), values packed along the row low bits first (4 bits) or one a byte (8), scales (N, blocks)
        and uint8 zero points packed along the row the same way, the defaults when absent 2^(bits-1) as MatMulNBits'
        symmetric ones. So the same bytes serve both: the packed weight goes through a Reshape (MatMulNBits insists
        on its 3-D initializer; a Reshape of a constant is folded by onnxruntime when the session loads), the
        scales and zero points as they are. A K that is not a whole number of blocks is padded in the packed rows:
        the gathered rows are cut back to K."""
        if head.float_zero_points:
            raise RuntimeError("GatherBlockQuantized takes no float zero points (a bug in the exporter)")
        attrs = head.attributes
        k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
        packed, scales_and_zeros = head.inputs[0], [i for i in head.inputs[1:3] if i]
        packed_shape, scales_shape = head.shapes[:2]
        blocks = packed_shape[1]
        if len(head.inputs) > 3 or packed_shape != (n, blocks, block * bits // 8) or scales_shape != (n, blocks):
            raise RuntimeError(f"quantized head of shapes {head.shapes}: not the layout GatherBlockQuantized reads")
        table = b.op("Reshape", packed, b.const([n, blocks * block * bits // 8]))
        rows = b.op(
            "GatherBlockQuantized",
            table,
            indices,
            *scales_and_zeros,
            domain=head.domain,
            bits=bits,
            block_size=block,
            gather_axis=0,
            quantize_axis=1,
        )
        if blocks * block == k:
            return rows
        return b.op("Slice", rows, b.const([0]), b.const([k]), b.const([-1]))

    def one_matmul_model(self, name: str, weight: torch.Tensor) -> onnx.ModelProto:
        """``y = x @ weight`` with ``x`` of rank 3 (so the quantizer needs no reshape), the weight in the graph's
        dtype (its scales follow it)."""
        in_features, out_features = weight.shape
        elem_type = TORCH_TO_ONNX[self.dtype]
        node = helper.make_node("MatMul", ["x", name], ["y"], name=name)
        graph = helper.make_graph(
            [node],
            "projection",
            [helper.make_tensor_value_info("x", elem_type, ["batch", "seq", in_features])],
            [helper.make_tensor_value_info("y", elem_type, ["batch", "seq", out_features])],
            # a stack handed over in float32 for a float16 graph would leave float32 scales, which CUDA's QMoE
            # refuses ("fc1_scales must match the activation type")
            initializer=[numpy_helper.from_array(weight.detach().to(self.dtype).contiguous().numpy(), name)],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


# What CUDA's QMoE takes (onnxruntime-gpu 1.31.1 on an H100, its own error messages): expert widths that are whole
# multiples of 64 ("the interleaved-weight K tile") and blocks of 32, 64 or 128.
CUDA_QMOE_WIDTH = 64
CUDA_QMOE_BLOCKS = (32, 64, 128)


def cuda_experts_note(
    config: ThinkerConfig, dtype: str, spec: QuantizeSpec | None, nodes: dict[str, int]
) -> str | None:
    """What the export tells the user of a float16 graph (one for CUDA) whose QMoE CUDA's kernel refuses: it runs on
    the CPU only, which widths or block size is why, and what to export instead."""
    if dtype != "float16" or spec is None or not nodes.get("QMoE"):
        return None
    widths = {"hidden_size": config.hidden_size, "moe_intermediate_size": config.moe_intermediate_size}
    wrong = [f"{name} {width}" for name, width in widths.items() if width % CUDA_QMOE_WIDTH]
    if wrong:
        instead = "export without --quantize for CUDA (its float MoE takes any width)"
    elif spec.bits == 4 and spec.block_size not in CUDA_QMOE_BLOCKS:  # a float16 graph's 8-bit experts: per row
        wrong, instead = [f"--block-size {spec.block_size}"], "export with --block-size 32 for CUDA"
    else:
        return None
    return (
        f"the routed experts' QMoE runs on the CPU but not on CUDA, whose kernel takes widths that are multiples of "
        f"{CUDA_QMOE_WIDTH} and blocks of {', '.join(map(str, CUDA_QMOE_BLOCKS))} ({', '.join(wrong)}): {instead}"
    )
