"""Tiny Qwen2-VL and Qwen2.5-VL checkpoints built and saved with transformers' own ``Qwen2VLForConditionalGeneration``
and ``Qwen2_5_VLForConditionalGeneration``: the text decoder (Qwen2: q/k/v biases, GQA, multimodal RoPE in contiguous
sections [4, 2, 2] over a head of 16) and a one-block vision tower, an untied ``lm_head``. ``save_pretrained`` writes
the Hub's layout (decoder at ``model.*``, tower at ``visual.*``); ``save(..., memory_layout=True)`` writes the
model's ``state_dict`` names instead (``model.language_model.*``, ``model.visual.*``). RMSNorm weights are moved off
their ones and every other decoder weight drawn at 0.2 (transformers' 0.02 leaves attention near uniform, blind to
positions), so that a tensor the converter dropped, or RoPE in the wrong layout, could not agree by luck.

``image_prompt`` runs an image through the model's own forward (pixels -> tower -> embeddings at the image
placeholders, positions from its ``get_rope_index``) and records what its text decoder received."""

from __future__ import annotations

from pathlib import Path

import torch

from .hybrid import capture_language_model_inputs

TEXT_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]},
}
VISION_CONFIGS = {
    "qwen2_vl": {
        "depth": 1,
        "embed_dim": 16,
        "hidden_size": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "qwen2_5_vl": {
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
    },
}
CLASSES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}
# Special ids inside the tiny vocabulary (the releases' are past 151000).
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 120, 121, 122, 123


def build(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, f"{CLASSES[kind]}Config")(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIGS[kind],
        image_token_id=IMAGE_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    model = getattr(transformers, f"{CLASSES[kind]}ForConditionalGeneration")(config)
    with torch.no_grad():  # the text decoder's weights large enough that attention, and so RoPE, matters
        for name, parameter in model.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            else:
                parameter.normal_(0, 0.2)
    return model.eval()


def save(folder: str | Path, kind: str, seed: int = 0, memory_layout: bool = False) -> Path:
    from safetensors.torch import save_file

    model = build(kind, seed)
    model.save_pretrained(folder)
    if memory_layout:
        tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})
    return Path(folder)


def image_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts, each with one 4 x 6-patch image (6 placeholders after the 2 x 2 merge) among text."""
    image = [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END]
    rows = [[5, 9, 17, 33, 4, *image, 21, 8, 7, 44], [11, 12, *image, 13, 14]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def image_inputs(model, batch: int) -> dict[str, torch.Tensor]:
    """Pixels of one 4 x 6-patch image per row, from a fixed seed, and their grid, as the model's forward takes them."""
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(24 * batch, patch, generator=torch.Generator().manual_seed(6))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 6]] * batch)}


def video_prompt(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One Qwen2.5-VL prompt holding a video of 2 frames of 4 x 6 patches (12 placeholders after the merge), 2 seconds
    a grid, among text: (input_ids, the video inputs with their ``mm_token_type_ids``)."""
    model.config.video_token_id = VIDEO_TOKEN
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    ids = torch.tensor([[5, 9, 17, VISION_START, *[VIDEO_TOKEN] * 12, VISION_END, 21, 8]])
    return ids, {
        "pixel_values_videos": torch.randn(48, patch, generator=torch.Generator().manual_seed(3)),
        "video_grid_thw": torch.tensor([[2, 4, 6]]),
        "second_per_grid_ts": torch.tensor([2.0]),
        "mm_token_type_ids": (ids == VIDEO_TOKEN).int() * 2,  # 2: video, as the processor marks it
    }


@torch.no_grad()
def image_prompt(model, ids: torch.Tensor, attention_mask: torch.Tensor, **media) -> tuple[dict, torch.Tensor]:
    """``ids`` (B, T) holding one image of 4 x 6 patches per row (6 placeholders between vision start and end, after
    the 2 x 2 merge) through ``model``: (what its text decoder received, the logits). ``media``: other inputs in
    place of the image (``video_prompt``'s)."""
    captured = capture_language_model_inputs(model)
    inputs = media or {"mm_token_type_ids": (ids == IMAGE_TOKEN).int(), **image_inputs(model, len(ids))}
    logits = model(input_ids=ids, attention_mask=attention_mask, **inputs).logits
    return dict(captured), logits  # a copy: the hook stays, and later calls would overwrite it
