"""``--verify``'s deep-cache pass: decode steps far into a cache, where no prompt the check can afford reaches.

The parity batch and the long prompts reach a cache of about 150 slots; a graph serves the whole context (40,960
positions for Qwen3, 262,144 for Qwen3.5). Prefilling thousands of tokens through the PyTorch model would cost
minutes at any real size, so the pass builds the deep cache instead: a short prompt (``deep_prompt``) is prefilled
by both runtimes, then the same block of random keys and values is written before its slots in every full-attention
layer of both caches (up to ``DEEP_CACHE_SLOTS``, cut to the context and to what memory the check's models leave:
``slots_within``), and DEEP_DECODE_STEPS tokens follow at the positions after the whole cache. Both runtimes attend
over identical cached tensors (what they hold is data, whatever positions its keys were rotated at), so their logits
must agree there as anywhere else; an attention window built into a mask, a cache length that overflows, a position
computed in too narrow a type all show.

The random slots are drawn at each layer's own key and value scale (the prompt's cached ones), so that attention
spreads over them as over real keys rather than ignoring them. Linear-attention states keep the prompt's: they hold
no slots. Qwen3.8's indexed layers keep more than KV (their index keys, compressed blocks, positions), which a block
of random slots would not make consistent: the pass is not run for them, and says so.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import torch
from transformers.cache_utils import Cache, DynamicLayer

from thinker.modeling_thinker import CACHE_ARG
from thinker_common.parity_inputs import (
    DEEP_CACHE_SLOTS,
    DEEP_DECODE_STEPS,
    DEEP_PROMPT_LENGTH,
    PROMPT_SEED,
    deep_prompt,
)

from .half_spread import HALF_PRECISIONS, HalfShadow
from .reference_replay import ReferenceReplay, replay_of, run_key
from .routing import RouteFollower
from .runtime import OnnxDecoder

NOT_RUN_INDEXED = (
    "Qwen3.8's indexed layers keep index keys, compressed blocks and positions beside their KV, which random slots "
    "would not make consistent; its indexer prompts reach past its budget instead"
)
NOT_RUN_BFLOAT16 = "a bfloat16 cache has no host array type to write the slots through"


def deep_cache_slots(model_context: int, graph_context: int | None, most: int = DEEP_CACHE_SLOTS) -> int:
    """The random slots before the prompt: ``most`` (DEEP_CACHE_SLOTS, or fewer where memory allows no more), cut so
    that the prompt and its steps stay inside the context both the model and the graph hold."""
    context = min(model_context, graph_context or model_context)
    return max(0, min(most, context - DEEP_PROMPT_LENGTH - DEEP_DECODE_STEPS))


def deep_slot_bytes(config, dtype: torch.dtype, reference: torch.dtype = torch.float32) -> int:
    """What one random slot costs the pass beyond the check's models (a ThinkerConfig's): its keys and values in the
    reference's cache (float32, or ``reference``: export/exact_reference.py), in the graph's ``dtype`` twice (a
    step's pasts and presents), and for a half-precision check in its shadow's two caches (export/half_spread.py: the
    half run's, and the float32 one of its run on perturbed inputs) and in float32 to write them there; and a copy
    more in the reference's dtype for the layer being written and the allocator's slack. On the Qwen3-0.6B-shaped
    model (bench/bench_verify_memory.py) 4096 slots, 0.88 GiB a float32 copy, raised the float32 check's peak by
    2.55 GiB (with the continuation pass), about three copies: the fourth counted is a margin."""
    values = config.layer_types.count("full_attention") * 2 * config.num_key_value_heads * config.head_dim
    shadow = dtype.itemsize + 2 * torch.float32.itemsize if dtype in HALF_PRECISIONS else 0
    return values * (2 * reference.itemsize + 2 * dtype.itemsize + shadow)


def slots_within(budget: int, config, dtype: torch.dtype, reference: torch.dtype = torch.float32) -> int:
    """The random slots ``budget`` bytes hold (the memory the check's models leave), DEEP_CACHE_SLOTS at most: the
    pass goes as deep as memory allows, rather than have a check refused that fits without it."""
    each = deep_slot_bytes(config, dtype, reference)  # 0 without a full-attention layer: no slot to hold
    return max(0, min(DEEP_CACHE_SLOTS, budget // each)) if each else DEEP_CACHE_SLOTS


def not_run_reason(config, dtype: torch.dtype) -> str | None:
    """Why the pass does not run for a model of ``config`` exported in ``dtype``, or None where it runs."""
    if config.has_indexed_attention:
        return NOT_RUN_INDEXED
    if dtype == torch.bfloat16:
        return NOT_RUN_BFLOAT16
    return None


def compare_deep(
    model: torch.nn.Module,
    decoder: OnnxDecoder,
    add: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None],
    on_step: Callable[[], object] | None = None,
    shadow: HalfShadow | None = None,
    most_slots: int = DEEP_CACHE_SLOTS,
    replay: ReferenceReplay | None = None,
) -> dict:
    """The pass (the module docstring), where ``not_run_reason`` gives none, with at most ``most_slots`` random
    slots (``slots_within``): ``add(reference, candidate, spread)`` takes each decode step's logits (an
    ``Agreement``'s ``add``). Returns where the steps ran: the cache's slots, the random ones among them, and the
    steps' first and last positions. ``replay``: where an earlier pass recorded the reference's steps on the same
    slots (export/reference_replay.py), they are read back, and the random slots go into the graph's cache alone."""
    config = model.config
    if shadow is not None:
        shadow.rewind()  # the same reference steps as an earlier pass: their spreads read back
    slots = deep_cache_slots(config.max_position_embeddings, decoder.context_length, most_slots)
    on_step = on_step or (lambda: None)
    ids = deep_prompt(config.vocab_size)
    mask = np.ones_like(ids)
    inputs = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "position_ids": torch.arange(ids.shape[1])[None],
    }
    follower = RouteFollower.of(model, decoder)  # the graph runs first: export/routing.py
    replay, follows = replay_of(replay), bool(follower.probes)
    with torch.no_grad():
        _, state = decoder.prefill(ids, mask, new_tokens=DEEP_DECODE_STEPS)
        with follower.reference(decoder.probed):  # the prompt's cache: the random slots' scales, the first token
            out = model(**inputs, use_cache=True)
            follower.spread(shadow, out.logits, **inputs)
        on_step()
        key = run_key("", "deep cache", inputs, slots, shadow is None)
        cached = slots + ids.shape[1]
        token = out.logits[:, -1].float().numpy().argmax(-1)
        mask_tensor = torch.ones(1, cached, dtype=torch.long)
        first_step = {
            "input_ids": torch.from_numpy(token[:, None]),
            "attention_mask": torch.cat([mask_tensor, torch.ones(1, 1, dtype=torch.long)], dim=1),
            "position_ids": torch.tensor([[cached]]),
        }
        replayed = not follows and replay.holds(run_key(key, first_step))
        reference_cache = getattr(out, CACHE_ARG)
        out = None
        keep = shadow is not None and not replayed
        written = write_random_slots(reference_cache, state.cache, decoder, slots, keep, into_reference=not replayed)
        if keep:  # its own cache, in its dtype: the same slots
            shadow.edit_cache(lambda cache: write_slots(cache, written))
        written = None  # held in the caches now: the blocks need not stay beside them
        past = None if replayed else reference_cache
        reference_cache = None
        state.attention_mask = np.ones((1, cached), np.int64)
        state.cached = cached
        state.next_position = np.full_like(state.next_position, cached)
        for position in range(cached, cached + DEEP_DECODE_STEPS):
            mask_tensor = torch.cat([mask_tensor, torch.ones(1, 1, dtype=torch.long)], dim=1)
            step = {
                "input_ids": torch.from_numpy(token[:, None]),
                "attention_mask": mask_tensor,
                "position_ids": torch.tensor([[position]]),
            }
            candidate = decoder.decode_one_token(token, state)

            def step_reference(step: dict = step) -> tuple[np.ndarray, np.ndarray | None]:
                nonlocal past
                if past is None:  # read back so far: the cache it would continue was never made
                    raise AssertionError("the deep-cache pass's reference steps were recorded in part")
                with follower.reference(decoder.probed):
                    out = model(**step, use_cache=True, **{CACHE_ARG: past})
                    spread = follower.spread(shadow, out.logits[:, -1:], **step)
                past = getattr(out, CACHE_ARG)
                return out.logits[:, -1].float().numpy(), None if spread is None else spread[:, -1]

            key = run_key(key, step)
            reference, spread = replay.run(key, follows, step_reference)
            add(reference, candidate, spread)
            token = reference.argmax(-1)
            on_step()
    steps = [cached, cached + DEEP_DECODE_STEPS - 1]
    return {"cache_slots": cached, "random_slots": slots, "step_positions": steps, **follower.figures()}


def write_random_slots(
    cache: Cache,
    graph_cache: dict,
    decoder: OnnxDecoder,
    slots: int,
    keep: bool = False,
    into_reference: bool = True,
) -> dict[int, tuple]:
    """Writes ``slots`` random keys and values before the cached ones of every full-attention layer of the
    reference's ``cache`` and of the graph's (``past_key_values.{i}.key`` / ``.value``, in its dtype and on its
    device), a layer at a time; with ``keep``, returns them by layer, float32, for a shadow's cache (else an empty
    dict: held twice more, they would double the pass's memory). ``into_reference`` False: the graph's cache alone
    (the reference's steps read back, export/reference_replay.py), ``cache`` giving the slots' scales.

    The slots are drawn by torch in float32 (2.5x faster than numpy's float64 normals and a cast, on the
    Qwen3-0.6B-shaped model's 235 M of them), and the graph's array is written once, with a shared buffer's room for
    the steps after the prompt kept at its end: joined as the prompt's slots alone, it was copied again into a buffer
    twice its size at the first step (``OnnxDecoder._reserve_kv``)."""
    generator = torch.Generator().manual_seed(PROMPT_SEED + 5)
    written = {}
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or layer.get_seq_length() == 0:
            continue  # a linear-attention layer: no slots
        block = []
        for kind, cached in (("key", layer.keys), ("value", layer.values)):
            name = f"past_key_values.{index}.{kind}"
            held = graph_cache[name]
            host = held if isinstance(held, np.ndarray) else held.numpy()  # a shared buffer: the prompt, then room
            if host.shape[:2] + host.shape[3:] != cached.shape[:2] + cached.shape[3:]:
                raise AssertionError(f"{name} is {host.shape} where the model caches {tuple(cached.shape)}")
            random = torch.randn((*cached.shape[:2], slots, cached.shape[3]), generator=generator)
            random.mul_(float(cached.float().std()))
            block.append(random)
            joined = np.empty((*host.shape[:2], slots + host.shape[2], host.shape[3]), host.dtype)
            joined[:, :, :slots] = random.numpy()
            joined[:, :, slots:] = host
            on_device = decoder.device != "cpu"
            graph_cache[name] = ort.OrtValue.ortvalue_from_numpy(joined, "cuda", 0) if on_device else joined
        if into_reference:
            write_slots(cache, {index: block})
        if keep:
            written[index] = tuple(block)
    return written


def write_slots(cache: Cache, written: dict[int, tuple]) -> None:
    """The ``written`` slots before the cached ones of ``cache``'s layers, in each layer's dtype."""
    for index, (keys, values) in written.items():
        layer = cache.layers[index]
        layer.keys = torch.cat([keys.to(layer.keys.dtype), layer.keys], dim=2)
        layer.values = torch.cat([values.to(layer.values.dtype), layer.values], dim=2)
