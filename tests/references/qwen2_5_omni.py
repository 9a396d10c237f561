"""A tiny but complete Qwen2.5-Omni checkpoint built with transformers' own classes (thinker with its audio and vision
towers, talker, token2wav), and its thinker as the parity reference.

The thinker's text decoder is Qwen2 (q/k/v biases, GQA 4:2, head 16) with multimodal RoPE in contiguous sections
[4, 2, 2]; every other part is present and tiny so that the converter must drop it by name. ``save_pretrained``
writes the Hub layout: ``thinker.model.*``, ``thinker.lm_head``, ``thinker.audio_tower.*``, ``thinker.visual.*``,
``talker.*``, ``token2wav.*``. The decoder's weights are drawn at 0.2 (norms around one), as in the other
references, so that attention and RoPE matter. Its special ids sit inside the tiny vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch
from seeded_weights import draw_weights

TEXT_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]},
}
AUDIO_CONFIG = {
    "num_mel_bins": 16,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 16,
    "d_model": 16,
    "output_dim": 64,
    "max_source_positions": 64,
    "n_window": 50,
}
VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "fullatt_block_indexes": [0],
    "window_size": 16,
}
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = 200, 201, 202
VISION_START, VISION_END, AUDIO_START, AUDIO_END = 203, 204, 205, 206
THINKER_CONFIG = {
    "text_config": TEXT_CONFIG,
    "audio_config": AUDIO_CONFIG,
    "vision_config": VISION_CONFIG,
    "audio_token_index": AUDIO_TOKEN,
    "image_token_index": IMAGE_TOKEN,
    "video_token_index": VIDEO_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
    "audio_start_token_id": AUDIO_START,
    "audio_end_token_id": AUDIO_END,
}
TALKER_CONFIG = {
    "vocab_size": 64,
    "embedding_size": 64,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]},
}
TOKEN2WAV_CONFIG = {
    "dit_config": {
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "emb_dim": 8,
        "num_embeds": 64,
        "mel_dim": 8,
        "enc_emb_dim": 8,
        "enc_dim": 8,
        "enc_channels": [8, 8, 8, 8, 24],
        "enc_attention_channels": 8,
        "enc_se_channels": 8,
        "look_ahead_layers": [0],
        "look_backward_layers": [0],
    },
    "bigvgan_config": {
        "mel_dim": 8,
        "upsample_initial_channel": 16,
        "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_rates": [2],
        "upsample_kernel_sizes": [4],
    },
}
DROPPED_PREFIXES = ("thinker.audio_tower.", "thinker.visual.", "talker.", "token2wav.")


def build(seed: int = 0):
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5OmniConfig(
        thinker_config=THINKER_CONFIG, talker_config=TALKER_CONFIG, token2wav_config=TOKEN2WAV_CONFIG
    )
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    draw_weights(model.thinker, seed, keep=lambda name: name.startswith(("model.", "lm_head.")))
    return model


def save(folder: str | Path, seed: int = 0) -> Path:
    build(seed).save_pretrained(folder)
    return Path(folder)


def load_reference_thinker(folder: str | Path):
    """transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` from the full checkpoint (its class strips
    ``thinker.`` and skips the talker and token2wav)."""
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    config = AutoConfig.from_pretrained(folder).thinker_config
    return Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def audio_and_image_prompt(thinker) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One prompt holding an audio clip (130 mel frames) and a 4 x 6-patch image among text, as the thinker's forward
    and ``generate`` take it: (input_ids, the audio and image inputs)."""
    features = torch.randn(1, AUDIO_CONFIG["num_mel_bins"], 130, generator=torch.Generator().manual_seed(5))
    inputs = {"input_features": features, "feature_attention_mask": torch.ones(1, 130, dtype=torch.long)}
    with torch.no_grad():
        audio_tokens = thinker.get_audio_features(**inputs).last_hidden_state.shape[0]
    patch = 3 * VISION_CONFIG["temporal_patch_size"] * VISION_CONFIG["patch_size"] ** 2
    inputs["pixel_values"] = torch.randn(24, patch, generator=torch.Generator().manual_seed(6))
    inputs["image_grid_thw"] = torch.tensor([[1, 4, 6]])
    audio = [AUDIO_START] + [AUDIO_TOKEN] * audio_tokens + [AUDIO_END]
    image = [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END]
    return torch.tensor([[5, 9, 17, 33, *audio, 21, 8, 7, *image, 44, 12, 60]]), inputs
