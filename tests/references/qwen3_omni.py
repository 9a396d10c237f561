"""A tiny but complete Qwen3-Omni-MoE checkpoint built with transformers' own classes, and its thinker as the
parity reference on text input.

Every part is present and tiny (thinker text model, audio tower, vision tower, talker with its code predictor,
code2wav), so that a converter must drop the parts that are not the thinker's text decoder by name rather than
by luck. ``save_pretrained`` writes the layout of the Hub checkpoints (transformers reverses its load-time
renaming on save): ``thinker.model.layers.N...``, ``thinker.model.embed_tokens``, ``thinker.model.norm``,
``thinker.lm_head``, ``thinker.audio_tower.*``, ``thinker.visual.*``, ``talker.*``, ``code2wav.*``, with the
MoE experts stored one tensor per expert (``mlp.experts.E.{gate,up,down}_proj.weight``).

The text decoder is the shape seed 002 describes, scaled down: GQA (4 query heads, 2 key/value heads),
``head_dim`` independent of ``hidden_size / heads``, per-head q/k RMSNorm, dense and sparse MLP layers
alternating (``decoder_sparse_step=2``: layers 1, 3 are MoE), ``norm_topk_prob=True``, RoPE θ=1e6, untied head.

Which thinker config fields matter for text-only parity (everything else is multimodal or talker plumbing):
``text_config.{vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, hidden_act, rms_norm_eps, rope_parameters.rope_theta, rope_parameters.rope_type,
max_position_embeddings, attention_bias, num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
decoder_sparse_step, mlp_only_layers}`` and ``thinker_config.tie_word_embeddings``. Irrelevant on text:
``rope_parameters.mrope_section`` / ``interleaved`` (multimodal RoPE gives every section the same position on
text, so it is plain RoPE; ``tests/test_references.py`` checks this), ``sliding_window`` (the text attention
forces it off), the audio/image/video token ids, ``position_id_per_seconds``, and the audio, vision, talker and
code2wav configs. Text-only parity holds only while no input id equals a multimodal placeholder id
(``audio_token_id`` etc.); the tiny vocabulary here is far below them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HIDDEN = 32

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    # The Hub config's form (mrope_section sums to head_dim / 2); on text every section sees the same position.
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True},
}
AUDIO_CONFIG: dict[str, Any] = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 16,
    "d_model": 16,
    "output_dim": HIDDEN,
    "downsample_hidden_size": 8,
    "max_source_positions": 32,
    # As released: the audio tower's output length (_get_feat_extract_output_lengths) counts 13 tokens per chunk of
    # 2 * n_window = 100 mel frames, so a smaller window gives a tower that cannot run on real features.
    "n_window": 50,
    "n_window_infer": 100,
    "conv_chunksize": 8,
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": HIDDEN,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
TALKER_CONFIG: dict[str, Any] = {
    "text_config": {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "moe_intermediate_size": 8,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "shared_expert_intermediate_size": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1], "interleaved": True},
    },
    "code_predictor_config": {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_code_groups": 2,
    },
    "num_code_groups": 2,
    "thinker_hidden_size": HIDDEN,
    "accept_hidden_layer": 1,
    "spatial_merge_size": 2,  # read by the talker's constructor although the dataclass does not declare it
}
CODE2WAV_CONFIG: dict[str, Any] = {
    "codebook_size": 16,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_quantizers": 2,
    "upsample_rates": [2, 2],
    "upsampling_ratios": [2],
    "decoder_dim": 16,
    "sliding_window": 8,
}

VISION_START_TOKEN_ID = 151652  # the Hub config's value

# Top-level prefixes of the on-disk checkpoint that are not the thinker's text decoder.
DROPPED_PREFIXES = ("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav.")


def tiny_config(**text_overrides: Any):
    from transformers import Qwen3OmniMoeConfig

    text = {**TEXT_CONFIG, **text_overrides}
    return Qwen3OmniMoeConfig(
        thinker_config={
            "text_config": text,
            "audio_config": AUDIO_CONFIG,
            "vision_config": VISION_CONFIG,
            # Read by get_rope_index (the Hub config carries it) although the dataclass does not declare it.
            "vision_start_token_id": VISION_START_TOKEN_ID,
        },
        talker_config=TALKER_CONFIG,
        code2wav_config=CODE2WAV_CONFIG,
    )


def build(seed: int = 0, **text_overrides: Any):
    """The full model (thinker, talker, code2wav) in eval mode, with random thinker text weights.

    transformers initialises every norm weight to one; they are randomised here (around one) along with the rest
    of the text decoder, so that a norm mapped to the wrong place cannot go unnoticed.
    """
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_config(**text_overrides)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.thinker.named_parameters():
            if name.startswith("model.language_model.") or name.startswith("lm_head."):
                noise = torch.randn(param.shape, generator=generator) * 0.2
                param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return model


def save(folder: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """Builds the tiny model and writes it with ``save_pretrained`` (config.json, model.safetensors,
    generation_config.json), i.e. in the Hub checkpoint layout."""
    folder = Path(folder)
    build(seed, **text_overrides).save_pretrained(folder)
    return folder


def load_reference_thinker(folder: str | Path):
    """The reference for parity: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``, loaded from the
    full checkpoint folder with the thinker's sub-config (its class strips ``thinker.`` and skips the talker)."""
    from transformers import AutoConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    config = AutoConfig.from_pretrained(folder).thinker_config
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(folder, config=config, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def thinker_logits(thinker, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Text-only logits (B, T, vocab) of the reference thinker.

    The thinker caches multimodal RoPE offsets (``rope_deltas``) between calls; they are cleared so that each call
    stands alone. With ``attention_mask`` the thinker computes 3-D multimodal positions (``get_rope_index``);
    without it the text model counts positions itself. Both must agree with plain RoPE on text.
    """
    thinker.model.rope_deltas = None
    out = thinker(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    thinker.model.rope_deltas = None
    return out.logits
