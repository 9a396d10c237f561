"""``--verify``'s continuation pass: several tokens fed in one step after a non-empty cache.

Every other pass of the check prefills from an empty cache, then decodes one token a step. ``OnnxDecoder.forward``
also takes several tokens after a cache (a chat's next turn, a long prompt fed in chunks), and that takes branches
of the graphs nothing else runs: the plain hybrid graph's chunked delta rule starting from a carried state (from 64
new tokens), an attention mask over cached and new slots at once, the fused graph's several tokens after a cache.
A QA sweep planted a chunked rule that dropped the carried state and a causal mask dropped whenever the cache was
non-empty (exact for every prefill and every one-token step): both moved logits by more than their scale and passed
every other pass.

So a prompt (``continuation_prompt``) is prefilled, continued by CONTINUATION_LENGTHS[1] tokens in one step, and
decoded CONTINUATION_DECODE_STEPS steps more, by both runtimes, at batch 1 (the fused graph's GroupQueryAttention
takes several tokens after a cache at batch 1 only). Every continued position is compared (a ``--logits last``
graph's last one), and each decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from thinker.modeling_thinker import CACHE_ARG, lowest_block_wins_ties
from thinker_common.parity_inputs import CONTINUATION_DECODE_STEPS, continuation_prompt

from .half_spread import HalfShadow, cached, graph_distances
from .reference_replay import ReferenceReplay, replay_of, run_key
from .routing import RouteFollower
from .runtime import OnnxDecoder


def compare_continuation(
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    add: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None],
    on_step: Callable[[], object] | None = None,
    shadow: HalfShadow | None = None,
    replay: ReferenceReplay | None = None,
) -> dict:
    """The pass (the module docstring): ``add(reference, candidate, spread)`` takes the continued positions' logits,
    then each decode step's (an ``Agreement``'s ``add``). Returns the prompt's and the continuation's lengths.
    ``replay``: the reference's runs recorded by an earlier pass on the same prompt, read back rather than run
    again (export/reference_replay.py)."""
    on_step = on_step or (lambda: None)
    if shadow is not None:
        shadow.rewind()  # the same reference steps as an earlier pass: their spreads read back
    context = min(model.config.max_position_embeddings, decoder.context_length or model.config.max_position_embeddings)
    prompt, continued = continuation_prompt(model.config.vocab_size, context)
    first, then = prompt.shape[1], continued.shape[1]

    follower = RouteFollower.of(model, decoder)
    replay, follows, past = replay_of(replay), bool(follower.probes), None

    def reference_step(
        ids: np.ndarray, start: int, candidate: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The reference's run of the tokens the graph has just run (its routing followed: export/routing.py), on
        the cache of the runs before it; ``candidate``: the graph's logits of the run, where compared."""
        nonlocal past
        if past is None and start:  # read back so far: the cache it would continue was never made
            raise AssertionError("the continuation pass's reference runs were recorded in part")
        inputs = {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.ones(1, start + ids.shape[1], dtype=torch.long),
            "position_ids": torch.arange(start, start + ids.shape[1])[None],
        }
        with follower.reference(decoder.probed):
            out = model(**inputs, use_cache=True, **cached(past))
            distances = None  # where the graph lands, for the spread to cover (HalfShadow.spread)
            if shadow is not None and candidate is not None:
                kept = np.ones(ids.shape, bool)
                if decoder.last_logits_only:  # its last position alone
                    kept[:, :-1] = False
                distances = graph_distances(out.logits, candidate, kept, np.ones(candidate.shape[:2], bool))
            spread = follower.spread(shadow, out.logits, distances, **inputs)
        past = getattr(out, CACHE_ARG)
        return out.logits.float().numpy(), spread

    # Qwen3.8's indexers: exact ties to the earlier blocks, as ONNX's TopK breaks them (export/verify.py)
    with torch.no_grad(), lowest_block_wins_ties():
        _, state = decoder.prefill(prompt, np.ones_like(prompt), new_tokens=then + CONTINUATION_DECODE_STEPS)
        key = run_key("", "continuation", prompt, shadow is None)
        if follows or not replay.holds(run_key(key, continued)):  # the prompt's cache, for the runs after it
            reference_step(prompt, 0)
        on_step()
        state.attention_mask = np.ones((1, first + then), np.int64)
        candidate = decoder.forward(continued, np.arange(first, first + then)[None], state)
        key = run_key(key, continued)
        logits, spread = replay.run(key, follows, lambda: reference_step(continued, first, candidate))
        state.next_position = state.next_position + then
        if decoder.last_logits_only:  # each row's last position alone
            logits, spread = logits[:, -1:], None if spread is None else spread[:, -1:]
        add(logits[0], candidate[0], None if spread is None else spread[0])
        on_step()
        token = logits[:, -1].argmax(-1)
        for step in range(CONTINUATION_DECODE_STEPS):
            candidate = decoder.decode_one_token(token, state)
            key = run_key(key, token)
            ids, start = token[:, None], first + then + step
            logits, spread = replay.run(key, follows, lambda ids=ids, start=start: reference_step(ids, start))
            reference = logits[:, -1]
            add(reference, candidate, None if spread is None else spread[:, -1])
            token = reference.argmax(-1)
            on_step()
    return {"prompt_length": first, "continued_by": then, **follower.figures()}
