"""The dtype a conversion writes: the one asked for, or (``auto``) the one the source declares or mostly holds, with
the tensors the source stores in a dtype the output's cannot hold kept as they are (``kept_wider``).

Apart from the engine so that the layer-by-layer check, which the family modules reach, can read a converted
folder's dtype without importing the engine (and, through it, the family modules again).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from thinker_common.dtypes import FLOAT_DTYPES, dtype_name, torch_dtype
from thinker_common.errors import ThinkerError
from thinker_common.sources import TensorSource


def resolve_dtype(requested: str | torch.dtype, declared: Any, source: TensorSource) -> torch.dtype:
    """The output dtype. ``auto``: ``declared`` (the dtype the source's config names) when it is one a folder may
    hold, else the floating dtype holding most of the source's bytes. A Python caller may name it as a
    ``torch.dtype``, as transformers' ``dtype=`` takes it."""
    if isinstance(requested, torch.dtype):
        requested = dtype_name(requested)
    if requested != "auto":
        if requested not in FLOAT_DTYPES:
            raise ThinkerError(f"--dtype {requested!r} is not one of auto, {', '.join(FLOAT_DTYPES)}")
        return torch_dtype(requested)
    if isinstance(declared, torch.dtype):
        declared = dtype_name(declared)
    if isinstance(declared, str) and declared in FLOAT_DTYPES:
        return torch_dtype(declared)
    bytes_by_dtype: Counter[torch.dtype] = Counter()
    for name in source.names():
        dtype = source.dtype(name)
        if dtype_name(dtype) in FLOAT_DTYPES:
            bytes_by_dtype[dtype] += math.prod(source.shape(name)) * dtype.itemsize
    return bytes_by_dtype.most_common(1)[0][0] if bytes_by_dtype else torch.float32


def kept_wider(requested: str | torch.dtype, dtype: torch.dtype, steps: list, source: TensorSource) -> dict:
    """``auto``: the output tensors whose source tensors are stored in a floating dtype the folder's cannot hold (a
    wider one, or float16 in a bfloat16 folder and the other way round) keep it, so that no value is rounded.
    Qwen3.5's releases store each linear-attention layer's ``A_log`` and gated norm in float32 beside bfloat16
    weights (a GGUF its norms in F32 beside F16 weights): the folder is bfloat16,
    its config says so, and ``from_pretrained(dtype="auto")`` loads it as the source class loads the source, while
    float32 loads get the stored values and the way back writes the source's bits. A dtype asked for casts all."""
    if requested != "auto":
        return {}
    kept = {}
    for step in steps:
        stored = {source.dtype(name) for name in step.sources if dtype_name(source.dtype(name)) in FLOAT_DTYPES}
        if all(holds(dtype, stored_dtype) for stored_dtype in stored):
            continue
        # one stored dtype holding the others, else float32 (float16 beside bfloat16: neither holds the other)
        keep = next((wide for wide in stored if all(holds(wide, other) for other in stored)), torch.float32)
        kept.update(dict.fromkeys(step.targets, keep))
    return kept


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of ``narrow`` is one of ``wide``'s: float32 holds both half precisions, but float16 and
    bfloat16 each hold values the other rounds (bfloat16 float16's fine steps, float16 bfloat16's range)."""
    return wide == narrow or wide.itemsize > narrow.itemsize
