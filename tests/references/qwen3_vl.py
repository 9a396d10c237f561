"""A tiny Qwen3-VL checkpoint built and saved with transformers' own ``Qwen3VLForConditionalGeneration``: the text
decoder (Qwen3 with q/k norm and interleaved multimodal RoPE) at ``model.language_model.*``, a one-block vision tower
with a deepstack merger at ``model.visual.*``, an untied ``lm_head``. Its RMSNorm weights are moved off their ones so
that a norm the converter dropped could not agree by luck."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e6,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}
VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 16,
    "num_heads": 2,
    "out_hidden_size": 32,
    "deepstack_visual_indexes": [0],
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
}


def build(seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def save(folder: str | Path, seed: int = 0) -> Path:
    build(seed).save_pretrained(folder)
    return Path(folder)
