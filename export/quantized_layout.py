"""``--verify``'s check that a quantized graph holds the layout the export asked for.

The graph check runs the PyTorch model on the graph's own dequantized weights, so it holds the graph to whatever the
graph stores: a projection written at int8 under ``--quantize int4``, asymmetric RTN written without its zero
points, a mixed head's int8 rows written at int4, each passes it (and an int8 weight passes the quantization cost's
gate the more easily). Here each MatMulNBits weight's stored layout (bits, block size, zero points; a head's row
ranges) is held to the one ``QuantizeSpec`` names, computed from the spec's own fields rather than through the
quantizer's code that wrote it, and so is its accuracy level (int8 activations written where float ones were asked
for passed every other check, a QA run's mutation); level 1 is also allowed where level 4 was asked, the accuracy
guard's fallback (export/accuracy_guard.py). Experts (QMoE, and the plain graph's gathered experts) and the guard's
float fallbacks are left out: their layouts follow the kernels' constraints, not the spec alone
(export/quantize.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .dequantize import QuantizedWeight
from .quantize import HEAD, QuantizeSpec

# (first row, row after the last, bits, block size) of a weight's row range
RowRange = tuple[int, int, int, int | None]


@dataclass(frozen=True)
class Layout:
    """How one weight is stored: its op, its row ranges' bits and block sizes, and whether it has zero points, and
    in which type: HQQ's are float, asymmetric RTN's integers, so an export asked for one and quantized by the
    other (a mutation run: --algo hqq silently ran RTN) is told apart."""

    op_type: str
    rows: tuple[RowRange, ...]
    asymmetric: bool
    accuracy_levels: tuple[int, ...] = ()
    float_zero_points: bool = False

    @classmethod
    def of(cls, quantized: QuantizedWeight) -> Layout:
        whole = ((0, int(quantized.weight.shape[0]), quantized.bits, quantized.block_size),)
        rows = tuple(quantized.row_parts) or whole
        return cls(
            quantized.op_type, rows, quantized.asymmetric, quantized.accuracy_levels, quantized.float_zero_points
        )

    def describe(self) -> str:
        ranges = [
            (f"rows {start}-{stop - 1} " if len(self.rows) > 1 else "") + f"int{bits}, blocks of {block}"
            for start, stop, bits, block in self.rows
        ]
        zero = ", with float zero points (HQQ's)" if self.float_zero_points else ", with integer zero points"
        return "; ".join(ranges) + (zero if self.asymmetric else ", symmetric")


def asked_layout(name: str, stored: Layout, asked: QuantizeSpec) -> Layout:
    """The layout ``asked`` names for weight ``name`` of ``stored``'s rows: the body at its bits, block size
    (``QuantizeSpec.block_for``: the scales' own where they cover it) and algorithm (zero points for rtn-asym and
    hqq); the head at its own bits where it has them, symmetric (the quantizer writes a head of other bits than the
    body's with RTN), its first ``head_int8_rows`` at 8 bits."""
    rows = stored.rows[-1][1]
    block = asked.block_for(name)
    if name != HEAD or not (asked.head_bits or asked.head_int8_rows):
        return Layout(
            stored.op_type, ((0, rows, asked.bits, block),), asked.algo != "rtn", float_zero_points=asked.algo == "hqq"
        )
    split = asked.head_int8_rows
    if 0 < split < rows:
        return Layout(stored.op_type, ((0, split, 8, block), (split, rows, asked.bits, block)), False)
    return Layout(stored.op_type, ((0, rows, 8 if split else asked.head_bits, block),), False)


def allowed_levels(asked: QuantizeSpec) -> set[int]:
    """The accuracy levels a MatMulNBits of an export asked for ``asked`` may run at: the one asked, and level 1
    where that is 4 (a unit the accuracy guard moved back to float activations)."""
    return {asked.accuracy_level, 1} if asked.accuracy_level == 4 else {asked.accuracy_level}


def layout_failures(layouts: dict[str, Layout], asked: QuantizeSpec) -> list[str]:
    """One failure for each MatMulNBits weight stored otherwise than ``asked`` says (the first three named)."""
    wrong = []
    for name, stored in layouts.items():
        if stored.op_type != "MatMulNBits":
            continue
        expected = asked_layout(name, stored, asked)
        if replace(stored, accuracy_levels=()) != expected:
            wrong.append(f"{name} is stored {stored.describe()}, where {asked.label()} asks for {expected.describe()}")
        elif levels := set(stored.accuracy_levels) - allowed_levels(asked):
            wrong.append(
                f"{name} runs at accuracy level {min(levels)}, where {asked.label()} asks for level "
                f"{asked.accuracy_level}"
            )
    more = f" (and {len(wrong) - 3} more weights)" if len(wrong) > 3 else ""
    return [f"quantized weight {text}" for text in wrong[:3]] + ([more.strip(" ()")] if more else [])
