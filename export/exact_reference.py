"""A float32 export's second opinion: where its check refuses on logits, the reference runs again in float64.

A float32 graph is held to 1e-4 x the logit scale against PyTorch's float32 run (export/verify.py), two float32
implementations each rounding its own way. Where the model is badly conditioned, the reference's own rounding can
carry it beyond that tolerance while the graph lies within it of the exact result: a tiny random Qwen3.5-MoE (hidden
48, five experts, top 1; seed 1), exported fused and sound, was refused on the continuation pass at 1.74e-3
against 7.51e-4, where the graph lies 3.4e-4 from the model run in float64 and PyTorch's float32 chunked delta rule
1.3e-3 (a QA run; the same continuation run token by token in float32, 3.2e-4). A user had to pass --no-verify.

So a float32 check that fails on some pass's logits runs again, every pass, with the reference in float64
(``running_exactly``), and that run's verdict stands; the report keeps the float32 run's failure
(``FLOAT32_REFUSAL``). The tolerances stay what they were: the float64 run is nearer the exact model than either
float32 implementation, so a sound graph lies within its own rounding of it, and a graph bug parts from it by what
the bug moves (the float32 reference's rounding could as well hide as show such a part). Every planted bug of the
float32 checks' tests fails both runs. The second run costs a check's time again, on refused exports alone.

The model stays as held, whole or streamed layer by layer, in float32: each unit's parameters are cast to float64 as
it runs and put back after (export/half_spread.py ``running_in``), and the floating inputs it is called with (a
prompt's input embeddings, Qwen3-VL's deepstack features) cast too; the Thinker's norms, softmaxes, decays and
recurrence then compute in float64 (thinker/modeling_thinker.py ``computed_in``). The RoPE tables stay float32's,
as the graph ships them, as do Qwen3.8's indexer scores (their choice is compared exactly, apart from the logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .half_spread import running_in

EXACT_DTYPE = torch.float64
# The report's key for the float32 run's failure, where the float64 run's verdict replaced it.
FLOAT32_REFUSAL = "float32_reference_failure"


@contextmanager
def running_exactly(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model`` runs in float64 (the module docstring)."""

    def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(_widened(value) for value in args), {name: _widened(value) for name, value in kwargs.items()}

    handle = model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    try:
        with running_in(model, EXACT_DTYPE):
            yield
    finally:
        handle.remove()


def _widened(value):
    """``value`` in float64 where it is a floating tensor, or a list or tuple of them (deepstack features)."""
    if isinstance(value, torch.Tensor):
        return value.to(EXACT_DTYPE) if value.is_floating_point() else value
    if isinstance(value, list | tuple):
        return type(value)(_widened(item) for item in value)
    return value
