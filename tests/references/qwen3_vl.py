"""Tiny Qwen3-VL checkpoints built and saved with transformers' own ``Qwen3VLForConditionalGeneration`` and
``Qwen3VLMoeForConditionalGeneration``: the text decoder (Qwen3 with q/k norm and interleaved multimodal RoPE; the MoE
one sparse but for layer 1) at ``model.language_model.*``, a one-block vision tower with a deepstack merger at
``model.visual.*``, an untied ``lm_head``. Their RMSNorm weights are moved off their ones so that a norm the converter
dropped could not agree by luck. ``save(..., hub_layout=True)`` stores the MoE experts transposed, as the Hub's
Qwen3-VL-MoE checkpoints do (transformers' ``save_pretrained`` writes them as they are held)."""

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


MOE_TEXT_CONFIG = {
    **TEXT_CONFIG,
    "num_hidden_layers": 3,
    "moe_intermediate_size": 24,  # 2 x 24 != 32: a transposed expert has another shape
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}


def build(seed: int = 0, moe: bool = False):
    import transformers

    torch.manual_seed(seed)
    kind = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{kind}Config")(
        text_config=MOE_TEXT_CONFIG if moe else TEXT_CONFIG, vision_config=VISION_CONFIG
    )
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif ".experts." in name or ".mlp.gate." in name:  # routing that differs from expert to expert
                parameter.normal_(0, 0.2)
    return model.eval()


def save(folder: str | Path, seed: int = 0, moe: bool = False, hub_layout: bool = False) -> Path:
    from safetensors.torch import load_file, save_file

    build(seed, moe).save_pretrained(folder)
    if hub_layout:
        path = Path(folder) / "model.safetensors"
        tensors = load_file(path)
        transposed = {name: t.transpose(1, 2).contiguous() if ".experts." in name else t for name, t in tensors.items()}
        save_file(transposed, path, metadata={"format": "pt"})
    return Path(folder)
