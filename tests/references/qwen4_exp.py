"""Tiny Qwen4-Exp (Qwen3.8, ``model_type: qwen4_exp_text`` / ``qwen4_exp``) references built with transformers' own
classes. Shared by the model tests (``tests/test_modeling_qwen4_exp.py``) and the converter tests
(``tests/converter/test_qwen4_exp_family.py``).

Awkward on purpose, and small enough that every part shapes the logits: linear-attention layers before and after
the indexed ones, PLE on two linear layers (the first and the last), a single index head (its relu scores tie at
zero often, so the block choice among ties is exercised) and a budget that prunes from 12 visible tokens on, partial
rotary (0.25) under interleaved mRoPE that the indexer's wider heads take in part, three streams, MoE with a shared
expert, an untied head; the n-gram tables hash to small primes so that their rows are few. ``reference`` (from
``references.hybrid``) randomises every weight, the PLE conv (zero at init) included.
"""

from __future__ import annotations

from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

from references.hybrid import HYBRID_SIZES, MOE_SIZES, VISION_SIZES

VOCAB = HYBRID_SIZES["vocab_size"]
EOS = 1
LAYER_TYPES = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "linear_attention"]
# Qwen3.5-MoE's tiny shapes (references.hybrid), five layers, and what Qwen4-Exp adds.
TEXT_SIZES = {
    **HYBRID_SIZES,
    **MOE_SIZES,
    "num_hidden_layers": 5,
    "layer_types": LAYER_TYPES,
    "hc_count": 3,
    "hc_lowrank": 8,
    "ple_layer_ids": [1, 5],
    "ple_embed_dim": 16,
    "ple_conv_kernel_size": 3,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 100,
    "make_ngram_vocab_size_divisible_by": 16,
    "split_ngram_parts": 2,
    "indexer_n_heads": 1,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 12,  # wider than the 8 rotary dims it takes from the attention's RoPE
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "eos_token_id": EOS,
    "pad_token_id": 0,
}


def qwen4_exp_config(**overrides) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(**{**TEXT_SIZES, **overrides})


def qwen4_exp_vl_config(**text_overrides) -> Qwen4ExpConfig:
    """The vision-language layout the Hub releases would use (text decoder under ``model.language_model``)."""
    vision = dict(VISION_SIZES, out_hidden_size=TEXT_SIZES["hidden_size"])
    return Qwen4ExpConfig(text_config={**TEXT_SIZES, **text_overrides}, vision_config=vision)
