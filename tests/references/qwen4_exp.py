"""Tiny Qwen4-Exp (Qwen3.8, ``model_type: qwen4_exp_text`` / ``qwen4_exp``) references built with transformers' own
classes. Shared by the model tests (``tests/test_modeling_qwen4_exp.py``) and the converter tests
(``tests/converter/test_qwen4_exp_family.py``).

Awkward on purpose, and small enough that every part shapes the logits: linear-attention layers before and after
the indexed ones, PLE on two linear layers (the first and the last), a single index head (its relu scores tie at
zero often, so the block choice among ties is exercised) and a budget that prunes from 12 visible tokens on, partial
rotary (0.5) under interleaved mRoPE that the indexer's wider heads take in part, four streams, MoE with a shared
expert, an untied head; the n-gram tables hash to small primes so that their rows are few. ``reference`` (from
``references.hybrid``) randomises every weight, the PLE conv (zero at init) included.
"""

from __future__ import annotations

from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

from references.hybrid import VISION_SIZES

VOCAB = 96
EOS = 1
LAYER_TYPES = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "linear_attention"]
TEXT_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # rotary 0.5 of it: 8 dims, 4 frequencies = mrope_section 2 + 1 + 1
    layer_types=LAYER_TYPES,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    hc_count=3,
    hc_lowrank=8,
    ple_layer_ids=[1, 5],
    ple_embed_dim=16,
    ple_conv_kernel_size=3,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=100,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=2,
    indexer_n_heads=1,
    indexer_kv_heads=1,
    indexer_head_dim=12,  # wider than the 8 rotary dims it takes from the attention's RoPE
    indexer_budget=8,
    indexer_compress_ratio=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    eos_token_id=EOS,
    pad_token_id=0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def qwen4_exp_config(**overrides) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(**{**TEXT_SIZES, **overrides})


def qwen4_exp_vl_config(**text_overrides) -> Qwen4ExpConfig:
    """The vision-language layout the Hub releases would use (text decoder under ``model.language_model``)."""
    vision = dict(VISION_SIZES, out_hidden_size=TEXT_SIZES["hidden_size"])
    return Qwen4ExpConfig(text_config={**TEXT_SIZES, **text_overrides}, vision_config=vision)
