"""A float32 export's second opinion: where its check refuses on logits, the reference runs again in float64.

A float32 graph is held to 1e-4 x the logit scale against PyTorch's float32 run (export/verify.py), two float32
implementations each rounding its own way. Where the model is badly conditioned, the reference's own rounding can
carry it beyond that tolerance while the graph lies within it of the exact result: a tiny random Qwen3.5-MoE (hidden
48, five experts, top 1; seed 1), exported fused and sound, was refused on the continuation pass at 1.74e-3
against 7.51e-4, where the graph lies 3.4e-4 from the model run in float64 and PyTorch's float32 chunked delta rule
1.3e-3 (a QA run; the same continuation run token by token in float32, 3.2e-4). A user had to pass --no-verify.

So a float32 check that fails on some pass's logits runs again, every pass, with the reference in float64
(``running_exactly``), at the same tolerances, and the graph passes where that run passes it: it lies within the
tolerance of one of the two references, the float64 one standing in for the exact model. The report keeps the float32
run's failure (``FLOAT32_REFUSAL``). Where the float64 run refuses too, the float32 run's figures are the check's,
said so (``REFUSED_BY_BOTH``; the float64 run's failure beside them, ``FLOAT64_REFUSAL``), on the passes both
refuse: at a badly conditioned position the graph's own float32 rounding can part from the exact result by more
than the tolerance, and there the float64 run's figure says less about the graph than the float32 one's. A QA run
over seeds 2-7 of the ten builds: 3 of 60 sound exports refused by the float32 run, each refused by the float64 run
too, the graph the further from it (its figures up to 5x the float32 run's); the float64 run alone would have
refused 7 of the 60, among them 4 the float32 run passes, one at 3.9x the tolerance, which is why it is a second
opinion and not the check. A graph bug parts from both references by what it moves: every planted bug of the float32
checks' tests fails both runs, and in that QA run so did every plant of 1.001x to 1.01x on an output projection; of
1.0001x to 1.0003x ones, four that the float32 run alone refused on the Qwen3.5-MoE's continuation pass pass, each
within the tolerance of the float64 run, where the float32 reference lies 1.53e-3 from it. The second run costs a
refused export's check its time again (a sound one that passes runs once), and runs only where its largest layer in
float64, and its deep-cache pass's slots in a float64 cache, fit in the memory the check leaves (export/verify.py
``float64_room``).

The model stays as held, whole or streamed layer by layer, in float32: each unit's parameters are cast to float64 as
it runs and put back after (export/half_spread.py ``running_in``), and the floating inputs it is called with (a
prompt's input embeddings) cast too; the Thinker's norms, softmaxes, decays and recurrence then compute in float64
(thinker/modeling_thinker.py ``computed_in``). The RoPE tables stay float32's, as the graph ships them, as do
Qwen3.8's indexer scores (their choice is compared exactly, apart from the logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .half_spread import running_in

EXACT_DTYPE = torch.float64
# The report's key for the float32 run's failure, where the float64 run passed the graph.
FLOAT32_REFUSAL = "float32_reference_failure"
# ... and for the float64 run's, where it refused the graph too: the float32 run's failure is the check's, said so.
FLOAT64_REFUSAL = "float64_reference_failure"
REFUSED_BY_BOTH = "and against the model run in float64 too"


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
    """``value`` in float64 where it is a floating tensor (input embeddings; Qwen3-VL's deepstack features, a list,
    the Thinker casts to its hidden states' dtype itself)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(EXACT_DTYPE)
    return value
