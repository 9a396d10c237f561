"""How close a lossy graph (int4/int8 weights) stays to its float reference on real text.

One teacher-forced pass (a prefill) of a fixed English paragraph through both decoders gives, at every position,
each one's next-token distribution: ``top1_agreement`` is the share of positions where both pick the same next
token, and each decoder's perplexity on the paragraph's own next tokens says how much worse the lossy one predicts
real text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .runtime import OnnxDecoder

# An original paragraph of plain English prose (written for this test, so no licence attaches to it): ordinary
# vocabulary, numbers and punctuation, about 250 tokens with the SmolLM2 tokenizer.
FIDELITY_TEXT = (
    "The lighthouse on the northern cape was built in 1867, after two ships ran aground on the rocks below it in "
    "a single winter. For most of its life a keeper and his family lived in the small stone house beside the "
    "tower. Every evening at dusk the keeper climbed the one hundred and twelve steps, trimmed the wick, polished "
    "the great glass lens and lit the lamp. The light turned once every thirty seconds, and sailors learned to "
    "count the flashes to know which coast they were passing. In bad weather the keeper stayed awake all night, "
    "because a cracked pane or a clogged vent could put the flame out in minutes. The work was lonely but not "
    "idle: there were logbooks to fill, brass to clean, paint to renew before the salt ate through it, and a "
    "garden that had to be rebuilt after every storm. When electricity reached the cape in 1951 the lamp was "
    "replaced by a bulb and a motor, and twenty years later the last keeper left. Today the tower is a museum, "
    "and visitors who climb the stairs on a clear day can see the islands forty kilometres away."
)


FIDELITY_SOURCE = "export/fidelity.py FIDELITY_TEXT"


def fidelity_token_ids(model_dir: Path, vocab_size: int, max_positions: int) -> tuple[np.ndarray | None, str]:
    """FIDELITY_TEXT through the model's own tokenizer, cut to its context (the tiny test models read the
    paragraph's beginning), and where the ids come from; (None, why) when the folder has no tokenizer transformers
    can read or its ids exceed the model's vocabulary."""
    from transformers import AutoTokenizer

    from converter.streamed import trim_freed_memory

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as err:  # no tokenizer files, or ones transformers cannot read
        # not the folder's path: a source converted on the way lies in a staging folder gone by the time this is read
        return None, f"no usable tokenizer in the model ({type(err).__name__})"
    ids = np.asarray(tokenizer(FIDELITY_TEXT)["input_ids"], dtype=np.int64)[:max_positions]
    # The tokenizer's memory, once freed, stays in malloc's heap (SmolLM2's: 45 MB), under the accuracy guard's
    # onnxruntime sessions that come next and are a quantized export's peak: handed back to the system here.
    del tokenizer
    trim_freed_memory()
    if ids.max(initial=0) >= vocab_size:
        return None, "the tokenizer's ids exceed the model's vocabulary"
    return ids, FIDELITY_SOURCE


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def prefill_logits(decoder: OnnxDecoder, token_ids: np.ndarray) -> np.ndarray:
    """(T, V) logits of one row through an empty cache; a ``--logits last`` graph gives them opened with
    ``all_positions=True``."""
    if decoder.last_logits_only:
        raise ValueError(f"{decoder.model_path} gives the last position's logits only; open it with all_positions")
    ids = np.asarray(token_ids, dtype=np.int64)[None]
    return decoder.prefill(ids, np.ones_like(ids))[0][0]


def mean_kl(reference: np.ndarray, candidate: np.ndarray, rows: int = 16) -> float:
    """Mean over positions of KL(reference || candidate) of the next-token distributions, ``rows`` positions at a
    time: in float64 a whole paragraph's distributions over a 49152-word vocabulary are 90 MB an array, and the
    export's peak memory was this function's (measured)."""
    total = 0.0
    for start in range(0, len(reference), rows):
        log_p, log_q = log_softmax(reference[start : start + rows]), log_softmax(candidate[start : start + rows])
        total += float((np.exp(log_p) * (log_p - log_q)).sum())
    return total / len(reference)


def text_fidelity(reference_logits: np.ndarray, candidate_logits: np.ndarray, token_ids: np.ndarray) -> dict:
    """Figures over the len - 1 next-token predictions of ``token_ids`` (1-D), given each decoder's (T, V) logits
    over it (``prefill_logits``)."""
    targets = np.asarray(token_ids)[1:]
    reference, candidate = reference_logits[:-1], candidate_logits[:-1]
    positions = np.arange(len(targets))
    ref_nll = -log_softmax(reference)[positions, targets].mean()
    cand_nll = -log_softmax(candidate)[positions, targets].mean()
    return {
        "tokens": len(targets) + 1,
        "top1_agreement": float((reference.argmax(-1) == candidate.argmax(-1)).mean()),
        "perplexity_reference": float(np.exp(ref_nll)),
        "perplexity": float(np.exp(cand_nll)),
        "perplexity_change": float(np.exp(cand_nll - ref_nll) - 1.0),  # relative: +0.05 is 5 % worse
    }
