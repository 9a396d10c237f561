"""What both parity checks feed and allow: the converter's gate (a converted folder against the source family's
transformers class, ``converter/parity.py``) and ``thinker export --verify`` (onnxruntime against PyTorch,
``export/verify.py``).

The inputs are a left-padded batch of random token ids from a fixed seed: two prompts of unequal length, so that the
shorter row is padded on the left and every implementation must mask and number positions per row. The tolerance is
on max |Δlogit| relative to the logit scale, ``TOLERANCE[dtype] * max(1, max |logit|)``, per dtype the compared
models run in: ``GATE_TOLERANCE`` for the converter's gate, ``RELATIVE_TOLERANCE`` for the export's check (the same
in float32; the export's looser in half precision, where it holds a graph to the float32 model).
"""

from __future__ import annotations

import numpy as np
import torch

PROMPT_LENGTHS = (7, 4)  # unequal: the second row is left-padded
PROMPT_SEED = 0

# ``thinker export --verify``'s max |Δlogit| allowed, as a fraction of max(1, max |logit|) (the converter's gate has
# its own, GATE_TOLERANCE below). float32: DESIGN.md's bar for an exact conversion or export. A half-precision graph
# is held to the float32 PyTorch model, and rounds its intermediate results its own way (summation order, which ops
# a runtime widens to float32). float16, measured by bench/bench_tolerance.py (README, "Parity tolerances"): up to
# 2.7e-3 on the tiny checkpoints and 1.9e-2 on SmolLM2's fused graph (onnxruntime's CPU provider against PyTorch
# float32); against a float16 reference, as the check ran before, SmolLM2's plain graph measured 2.2e-2, so 2e-2
# would fail a real 135M model and 5e-2 leaves a margin. The hybrids reach 5.3e-2 at a position half precision
# cannot hold, which export/half_spread.py excuses. bfloat16 keeps the same 5e-2: measured on an H200 only
# (onnxruntime's CPU provider has no bfloat16 kernels), on tiny models, and with 3 fewer mantissa bits than float16
# it may need more on deep real models.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2}

# The converter's gate (and ``thinker verify``) compares two PyTorch models in the same dtype, with the same kernels
# but where a family's layout differs (GPT-2's Conv1D against a Linear): on its prompts (``gate_prompts``) a sound
# half-precision conversion measures 0 on the hybrids, Qwen2, Llama and the real SmolLM2-135M, and a few units of the
# dtype's last place elsewhere (GPT-2 at GPT-2 small's width, 36 layers: float16 2.4e-3, about five ulps of 2**-11,
# bfloat16 1.2e-2, three of 2**-8; tiny Qwen3 in float16 1.4e-3; bench/bench_tolerance.py, README "Parity
# tolerances"). Held to the export's 5e-2, bugs that only half precision shows (a router's softmax, a decay or a
# gated norm kept in the model's dtype where the reference widens to float32) passed (a QA run). So: float16 1e-2, 4x
# the deepest; bfloat16 2e-2, five of its ulps, for the same few ulps a kernel's rounding may move.
GATE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# Qwen3.8's indexers keep every slot until more than their budget are visible, which the fixed prompts never are: a
# model with indexed_attention layers is also checked on prompts of its budget plus this many blocks (the converter's
# unreached probes take as many, converter/unreached.py).
INDEXER_EXTRA_BLOCKS = 8


def indexer_batch(config) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts long enough for ``config``'s indexers (a ThinkerConfig's) to choose: its budget plus
    INDEXER_EXTRA_BLOCKS blocks, and half that, so left-padded; each with an eos inside (where Qwen3.8's n-gram
    contexts restart). Numpy arrays."""
    longest = config.indexer_budget + INDEXER_EXTRA_BLOCKS * config.indexer_compress_ratio
    eos = config.ngram_eos_token_id
    rng = np.random.default_rng(PROMPT_SEED + 1)
    drawn = rng.integers(0, config.vocab_size, size=(2, longest), dtype=np.int64)
    prompts = [drawn[0].tolist(), drawn[1, longest // 2 :].tolist()]
    if eos is not None:
        for prompt in prompts:
            prompt[len(prompt) // 3] = eos
    ids, mask, _ = left_padded(prompts)
    return ids.numpy(), mask.numpy()


# The fixed prompts reach position 12 and a cache of 13 slots: what only longer prompts exercise (a RoPE table's later
# rows, an attention window, the plain hybrid graph's chunked delta rule from 64 tokens in chunks of 64, decode
# steps far into the context) is checked on two more, left-padded, of these lengths (both past two chunks' start,
# the first across a chunk boundary into a partial third), cut to the model's context, then LONG_DECODE_STEPS steps.
LONG_PROMPT_LENGTHS = (141, 100)
LONG_DECODE_STEPS = 3  # each a whole forward: a streamed check reads the model from disk once a step


def long_prompts(vocab_size: int, context: int, reserve: int = LONG_DECODE_STEPS) -> list[list[int]]:
    """Two prompts of LONG_PROMPT_LENGTHS tokens from a fixed seed, shortened in proportion where ``context`` (the
    model's positions) would not hold them and ``reserve`` more tokens."""
    longest = max(1, min(LONG_PROMPT_LENGTHS[0], context - reserve))
    lengths = [max(1, longest * length // LONG_PROMPT_LENGTHS[0]) for length in LONG_PROMPT_LENGTHS]
    drawn = np.random.default_rng(PROMPT_SEED + 3).integers(0, vocab_size, size=(2, longest), dtype=np.int64)
    return [row[longest - length :].tolist() for row, length in zip(drawn, lengths, strict=True)]


def long_batch(vocab_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """``long_prompts`` with room for LONG_DECODE_STEPS more tokens, as left-padded numpy arrays."""
    ids, mask, _ = left_padded(long_prompts(vocab_size, context))
    return ids.numpy(), mask.numpy()


# The long prompts reach a cache of about 150 slots; the graphs serve the whole context. A short prompt is then
# checked behind a cache of up to DEEP_CACHE_SLOTS slots (export/deep_cache.py: random keys and values at the model's
# own scale, written into both runtimes' caches), cut to the context, with DEEP_DECODE_STEPS decode steps at the
# positions that follow: whatever attention does far into a cache (a window built into a mask, a length that
# overflows) is compared there. 4096 slots cost a Qwen3-0.6B-shaped model 0.9 GB of float32 cache.
DEEP_CACHE_SLOTS = 4096
DEEP_PROMPT_LENGTH = 6
DEEP_DECODE_STEPS = 2


def deep_prompt(vocab_size: int) -> np.ndarray:
    """The short prompt the deep-cache pass runs first: (1, DEEP_PROMPT_LENGTH) int64 ids from a fixed seed."""
    return np.random.default_rng(PROMPT_SEED + 4).integers(0, vocab_size, size=(1, DEEP_PROMPT_LENGTH), dtype=np.int64)


def vocabulary_edges(vocab_size: int, splits: set[int] | frozenset[int] = frozenset()) -> np.ndarray:
    """(1, n) int64 ids at the edges of the vocabulary a graph may treat apart, in ascending order: its first and last
    ids, each side of every power of two from 256 (a table split at a round size), and each side of ``splits`` (the
    rows where a graph's head turns from one precision to the other, export/quantize.py ``split_rows``). Random
    prompts almost never reach them: one id in 8192 of a 150k vocabulary."""
    edges = {0, 1, vocab_size - 2, vocab_size - 1}
    edges |= {row + side for row in [2**k for k in range(8, vocab_size.bit_length())] for side in (-1, 0)}
    edges |= {row + side for row in splits for side in (-1, 0)}
    return np.array([sorted(edge for edge in edges if 0 <= edge < vocab_size)], np.int64)


# Every other pass prefills from an empty cache and then decodes one token a step. A caller may also feed several
# tokens after a cache (a chat's next turn, a prompt in chunks), which takes other branches of the graphs (the plain
# hybrid graph's chunked delta rule from a carried state, a mask over cached and new slots at once, the fused graph's
# several tokens after a cache at batch 1): a prompt of CONTINUATION_LENGTHS[0] tokens, continued by
# CONTINUATION_LENGTHS[1] in one step (past the delta rule's chunk of 64), then CONTINUATION_DECODE_STEPS steps, at
# batch 1 (the fused graph's only batch for it) (export/continuation.py).
CONTINUATION_LENGTHS = (10, 70)
CONTINUATION_DECODE_STEPS = 2


def continuation_prompt(vocab_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt and its continuation, (1, n) int64 ids each from a fixed seed, the continuation cut so that both
    and CONTINUATION_DECODE_STEPS more stay within ``context`` positions (a prompt of 1 at least)."""
    first = max(1, min(CONTINUATION_LENGTHS[0], context // 4))
    then = max(1, min(CONTINUATION_LENGTHS[1], context - first - CONTINUATION_DECODE_STEPS))
    drawn = np.random.default_rng(PROMPT_SEED + 6).integers(0, vocab_size, size=(1, first + then), dtype=np.int64)
    return drawn[:, :first], drawn[:, first:]


def fixed_prompts(vocab_size: int) -> list[list[int]]:
    """Token ids from a fixed seed: the same prompts for every run with the same vocabulary size. Drawn as one
    (prompts, longest) matrix, row i keeping its last ``PROMPT_LENGTHS[i]`` ids."""
    rng = np.random.default_rng(PROMPT_SEED)
    width = max(PROMPT_LENGTHS)
    drawn = rng.integers(0, vocab_size, size=(len(PROMPT_LENGTHS), width), dtype=np.int64)
    return [drawn[row, width - length :].tolist() for row, length in enumerate(PROMPT_LENGTHS)]


def gate_prompts(vocab_size: int, context: int | None, reserve: int) -> list[list[int]]:
    """The converter's gate's prompts, one left-padded batch: the fixed prompts and the long ones, each cut so that it
    and ``reserve`` tokens more fit ``context`` (whole where it is unknown; a context under ``reserve`` leaves one
    id, which the caller refuses to run). Half precision's rounding bugs grow with
    a prompt's length: a Gated DeltaNet decay, a gated norm or a router's softmax kept in float16 where the reference
    widens it measured 2e-3 to 5e-3 of the logit scale on the fixed prompts, under float16's 1e-2, and 1.4e-2 to
    4.4e-2 with the long ones beside them (a QA run's mutations, tests/converter/test_gate_precision.py); so does what
    a chunked delta rule carries from one chunk of 64 to the next."""
    context = context if context else LONG_PROMPT_LENGTHS[0] + reserve
    room = max(1, context - reserve)  # a short context cuts the fixed prompts too, each keeping its last ids
    return [prompt[-room:] for prompt in fixed_prompts(vocab_size)] + long_prompts(vocab_size, context, reserve)


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (B, T) int64: pads on the left, positions counted from 0 per
    row (pads at 0)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def parity_batch(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed prompts, left-padded, as numpy arrays for onnxruntime: (input_ids, attention_mask), both (2, 7)."""
    ids, mask, _ = left_padded(fixed_prompts(vocab_size))
    return ids.numpy(), mask.numpy()


# The largest block of foreign embeddings ``foreign_block_prompt`` writes into a row: a 2 x 2 image grid.
FOREIGN_BLOCK = 4


def image_block_positions(attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(3, B, T) int64 positions as Qwen's ``get_rope_index`` numbers a prompt holding an image of rows x 2 patches in
    each row's kept slots 1, 2, ... (up to FOREIGN_BLOCK, leaving the row's last slot a token): the block at one
    temporal position, its height and width streams counting its rows and columns from there, and the text after it
    resuming one past the block's largest position; pads at position 0. With the (B, T) bool mask of the block's
    slots."""
    batch, width = attention_mask.shape
    positions = np.zeros((3, batch, width), np.int64)
    foreign = np.zeros((batch, width), bool)
    for row in range(batch):
        slots = np.flatnonzero(attention_mask[row])
        size = 2 * (max(0, min(FOREIGN_BLOCK, len(slots) - 2)) // 2)  # whole rows of two patches; none in 1 or 2
        block = slots[1 : 1 + size]
        foreign[row, block] = True
        grid = np.stack([np.zeros(size, np.int64), np.arange(size) // 2, np.arange(size) % 2])  # t, h, w
        resume = 2 + int(grid.max()) if size else 1  # one past the block's largest position
        positions[:, row, slots[0]] = 0
        positions[:, row, block] = 1 + grid
        positions[:, row, slots[1 + size :]] = resume + np.arange(len(slots) - 1 - size)
    return positions, foreign


def foreign_block_prompt(
    token_embeddings: np.ndarray, attention_mask: np.ndarray, multimodal: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt as an omni or vision-language model's towers hand it to the text decoder: each row's token
    embeddings (B, T, hidden) with a block of foreign vectors written over the slots ``image_block_positions``
    gives it, drawn from a fixed seed at the tokens' own scale. With ``multimodal``, those (3, B, T) positions; else
    (B, T) positions counted from the mask. Returns (inputs_embeds float32, position_ids int64, the (B, T) bool mask
    of the foreign slots); pads sit at position 0."""
    embeds = np.array(token_embeddings, dtype=np.float32)
    positions, foreign = image_block_positions(attention_mask)
    rng = np.random.default_rng(PROMPT_SEED + 2)
    scale = float(embeds[attention_mask.astype(bool)].std())
    for row in range(attention_mask.shape[0]):
        block = np.flatnonzero(foreign[row])
        embeds[row, block] = rng.normal(0.0, scale, (len(block), embeds.shape[-1]))
    if not multimodal:
        positions = np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0).astype(np.int64)
    return embeds, positions, foreign


def foreign_deepstack(foreign: np.ndarray, layers: int, hidden_size: int, scale: float) -> list[np.ndarray]:
    """DeepStack features for ``foreign_block_prompt``'s foreign slots (``foreign``, (B, T) bool): for each of
    ``layers`` layers, a (foreign slots, hidden_size) float32 block drawn from a fixed seed at ``scale``, in the form
    Qwen3-VL's model hands its text decoder."""
    rng = np.random.default_rng(PROMPT_SEED + 3)
    slots = int(foreign.sum())
    return [rng.normal(0.0, scale, (slots, hidden_size)).astype(np.float32) for _ in range(layers)]
