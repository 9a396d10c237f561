"""Tiny Thinker configs, one per source family the exporter must cover, and a word-level tokenizer for them."""

from __future__ import annotations

from pathlib import Path

from seeded_weights import randomize_parameters

# Three layers so that MoE configs mix sparse and dense layers; every size tiny, so that a test takes a second.
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    # Qwen2: q/k/v bias (no o_proj bias), GQA 4:2
    "qwen2": dict(num_key_value_heads=2, attention_bias=True, attention_output_bias=False),
    # Qwen3: qk-norm, GQA, head_dim 12 != hidden_size / heads (8)
    "qwen3": dict(num_key_value_heads=2, head_dim=12, qk_norm=True),
    # Qwen3-MoE: layers 0 and 2 sparse (layer 1 in mlp_only_layers), top-2 of 4, renormalised
    "qwen3_moe": dict(
        num_key_value_heads=2,
        head_dim=12,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    # Qwen2-MoE: a shared expert behind its sigmoid gate, every second layer sparse, top-2 not renormalised
    "qwen2_moe": dict(
        num_key_value_heads=2,
        attention_bias=True,
        attention_output_bias=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        decoder_sparse_step=2,
    ),
    # μOmni ThinkerLM: MHA, SwiGLU, a head with bias
    "uomni": dict(lm_head_bias=True),
    # GPT-2 (PrimeGPT): learned positions, LayerNorm, plain gelu_new MLP, biases everywhere, tied head, MHA
    "gpt2": dict(
        position_embedding_type="learned",
        norm_type="layernorm",
        mlp_gated=False,
        hidden_act="gelu_new",
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}

WORDS = "the a cat dog sat on mat and ran to house big small red blue one two three is was it".split()


def make_config(family: str, **overrides):
    from thinker import ThinkerConfig

    return ThinkerConfig(**{**COMMON, **FAMILIES[family], **overrides})


def save_thinker(folder: Path, family: str, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """A Thinker folder with random weights (and a tokenizer), as thinker-convert would leave it."""
    from thinker import ThinkerForCausalLM

    model = randomize_parameters(ThinkerForCausalLM(make_config(family, **overrides)), seed).eval()
    model.save_pretrained(folder)
    if tokenizer:
        make_tokenizer().save_pretrained(folder)
    return Path(folder)


def make_tokenizer():
    """A whitespace word-level tokenizer with one word per id of the tiny vocabulary (so that any generated id
    decodes to text): pad 0, bos 1, eos 2, unk 3, then WORDS, then w<id> fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", *WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), COMMON["vocab_size"])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]"
    )
