"""``thinker verify``'s exact check: every tensor of a Thinker folder holds, bit for bit, what converting its source
writes.

The parity gate proves that the conversion computes what the source family's own class computes, within a tolerance
that leaves room for kernels summing in another order. A weight edited after the conversion by less than that room
(one row scaled by 1.001 moved the logits by 5e-5 against a tolerance of 5e-4, in a QA sweep) passed it. The
weights themselves need no room: a conversion is a deterministic mapping (renames, permutations, joins, casts), so
the folder must hold exactly the bytes it writes. The check streams as the conversion does, one step's tensors at a
time (a table joined from pieces, one piece at a time), and compares bytes through a small buffer.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from thinker_common.dtypes import dtype_name
from thinker_common.sources import SafetensorsSource, TensorSource

from .engine import COPY_PIECE, Plan, convert_step, plan_conversion
from .ops import JoinParts
from .parity_report import IDENTICAL


class _Differs(Exception):
    """The first difference found, in words."""


def weights_verdict(source: TensorSource, converted: Path, dtype: torch.dtype, named: str) -> str:
    """IDENTICAL, or the first tensor of ``converted`` (a Thinker folder stored in ``dtype``) whose bytes are not
    what converting ``source`` (called ``named``) writes, with its first differing row (along its first axis)."""
    try:
        _compare_all(source, converted, dtype, named)
    except _Differs as differs:
        return str(differs)
    return IDENTICAL


def _compare_all(source: TensorSource, converted: Path, dtype: torch.dtype, named: str) -> None:
    plan = plan_conversion(source, source.config(), "auto")
    if plan.dtype != dtype:  # converted with --dtype: every tensor cast to it
        plan = plan_conversion(source, source.config(), dtype_name(dtype))
    stored = SafetensorsSource(converted)
    try:
        for step in plan.steps:
            if isinstance(step.op, JoinParts) and step.op.dim == 0:  # a table joined from pieces: piece by piece
                target, offset = step.targets[0], 0
                for name in step.sources:
                    piece = source.load(name).to(plan.dtype_of(target)).contiguous()
                    _compare(stored, target, piece, plan, named, offset)
                    offset += piece.numel() * piece.element_size()
                    del piece
                continue
            for target, tensor in convert_step(step, source, plan):
                _compare(stored, target, tensor, plan, named)
                del tensor
    finally:
        stored.close()


def _compare(
    stored: SafetensorsSource, target: str, tensor: torch.Tensor, plan: Plan, named: str, offset: int = 0
) -> None:
    """``tensor`` (or, at byte ``offset``, a piece of it) against the bytes ``stored`` holds for ``target``. A
    tensor that ``auto`` keeps wider than the folder may be stored at the folder's dtype (a conversion with --dtype
    casts every tensor)."""
    kept = stored.dtype(target)
    if kept != tensor.dtype and not (kept == plan.dtype and target in plan.kept):
        raise _Differs(
            f"{stored.file_of(target)}: tensor {target!r} is stored as {dtype_name(kept)}, where converting {named} "
            f"writes {dtype_name(tensor.dtype)}; the folder was changed after its conversion: convert it again"
        )
    data = tensor.to(kept).contiguous().reshape(-1).view(torch.uint8).numpy()
    descriptor, begin, end = stored.byte_range(target)
    if offset + len(data) > end - begin:
        raise _Differs(f"{stored.file_of(target)}: tensor {target!r} is shorter than converting {named} writes")
    for start in range(0, len(data), COPY_PIECE):
        piece = data[start : start + COPY_PIECE]
        held = os.pread(descriptor, len(piece), begin + offset + start)
        if held != piece.tobytes():
            first = start + next(i for i, (a, b) in enumerate(zip(held, piece.tobytes(), strict=False)) if a != b)
            shape = stored.shape(target)
            row_bytes = math.prod(shape[1:]) * kept.itemsize if len(shape) > 1 else kept.itemsize
            row = (offset + first) // row_bytes
            raise _Differs(
                f"{stored.file_of(target)}: tensor {target!r} is not what converting {named} writes (row {row} of "
                f"{tuple(shape)} differs first); the folder was changed after its conversion, or converted from "
                "another checkpoint: convert it again"
            )
