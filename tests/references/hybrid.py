"""Tiny hybrid references built with transformers' own classes: Qwen3.5 (causal LM and vision-language), Qwen3.5-MoE
and Qwen3-Next, and what their multimodal forward hands to the text decoder. Shared by the model tests
(``tests/test_modeling_hybrid.py``) and the converter tests (``tests/converter/test_hybrid_families.py``).

Each config is tiny and awkward on purpose: linear-attention and full-attention layers mixed (a linear one first),
two value heads per key head, key and value head sizes that differ, partial rotary (0.25) with an interleaved mrope
section, an untied head, MoE with a gated shared expert (and a dense layer among the sparse ones for Qwen3-Next).
``reference`` randomises every weight (norms, ``A_log``, ``dt_bias``, the conv kernel included), so the zero-centred
norms, the attention output gate and the gated norm all shape the logits.
"""

from __future__ import annotations

import torch
from seeded_weights import randomize_parameters
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB = 96
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HYBRID_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # rotary 0.25 of it: 8 dims, 4 frequencies = mrope_section 2 + 1 + 1
    layer_types=LAYER_TYPES,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=12,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
VISION_SIZES = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=16,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=16,
)
# Placeholder ids inside the tiny vocabulary; text ids are drawn below VISION_START so none collides with them.
VISION_TOKENS = dict(vision_start_token_id=88, vision_end_token_id=89, image_token_id=90, video_token_id=91)


def qwen3_5_config(**overrides) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**{**HYBRID_SIZES, "intermediate_size": 48, **overrides})


def qwen3_5_moe_config(**overrides) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(**{**HYBRID_SIZES, **MOE_SIZES, **overrides})


def qwen3_next_config(**overrides) -> Qwen3NextConfig:
    # Plain partial RoPE (Qwen3-Next has no multimodal sections); layer 2 dense among sparse layers (mlp_only_layers).
    rope = {key: value for key, value in HYBRID_SIZES["rope_parameters"].items() if not key.startswith("mrope")}
    sizes = {**HYBRID_SIZES, **MOE_SIZES, "rope_parameters": rope, "intermediate_size": 40, "mlp_only_layers": [2]}
    return Qwen3NextConfig(**{**sizes, "norm_topk_prob": True, **overrides})


def qwen3_5_vl_config(**text_overrides) -> Qwen3_5Config:
    return Qwen3_5Config(
        text_config={**HYBRID_SIZES, "intermediate_size": 48, **text_overrides},
        vision_config=VISION_SIZES,
        **VISION_TOKENS,
    )


def qwen3_5_moe_vl_config() -> Qwen3_5MoeConfig:
    return Qwen3_5MoeConfig(text_config={**HYBRID_SIZES, **MOE_SIZES}, vision_config=VISION_SIZES, **VISION_TOKENS)


def reference(model_class, config, attn: str = "eager", seed: int = 0):
    """transformers' ``model_class`` of ``config`` with every parameter seeded (``randomize_parameters``)."""
    model = model_class._from_config(config, attn_implementation=attn, experts_implementation="eager")
    return randomize_parameters(model, seed=seed).eval()


def token_ids(batch: int = 2, length: int = 11, seed: int = 1, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(1, high, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``rows`` padded on the left with id 0."""
    length = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------------------
# multimodal: what a vision-language model's own forward hands to its text decoder


def capture_language_model_inputs(model) -> dict:
    """Records the ``inputs_embeds`` and ``position_ids`` that ``model`` (a vision-language model whose text decoder
    is ``model.model.language_model``) passes to its text decoder on each forward, and Qwen3-VL's and Qwen3-Omni's
    DeepStack inputs (``visual_pos_masks``, ``deepstack_visual_embeds``) where an image or video hands them on."""
    captured = {}

    def hook(module, args, kwargs):
        captured.update(inputs_embeds=kwargs["inputs_embeds"], position_ids=kwargs["position_ids"])
        for key in ("visual_pos_masks", "deepstack_visual_embeds"):
            if kwargs.get(key) is not None:
                captured[key] = kwargs[key]

    model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    return captured


@torch.no_grad()
def run_image_prompt(model) -> tuple[dict, torch.Tensor]:
    """A prompt holding one 4x6-patch image (6 tokens after the 2x2 merge) through a Qwen3.5 vision-language
    ``model``: (what its text decoder received, the logits)."""
    config = model.config
    image = [config.vision_start_token_id] + [config.image_token_id] * 6 + [config.vision_end_token_id]
    text = token_ids(batch=1, length=12, seed=4, high=config.vision_start_token_id)[0]
    ids = torch.cat([text[:5], torch.tensor(image), text[5:]])[None]  # no stray special token among the text
    grid = torch.tensor([[1, 4, 6]])
    patch_size = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    pixels = torch.randn(24, patch_size, generator=torch.Generator().manual_seed(6))
    captured = capture_language_model_inputs(model)
    logits = model(
        ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == config.image_token_id).int()
    ).logits
    return captured, logits


def image_positions(start: int, grid_t: int, grid_h: int, grid_w: int) -> torch.Tensor:
    """(3, t·h·w) temporal/height/width positions of an image block starting at `start` (Qwen3-VL's layout)."""
    t, h, w = torch.meshgrid(torch.arange(grid_t), torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    return torch.stack([t, h, w]).reshape(3, -1) + start


def text_image_text_positions(batch: int) -> torch.Tensor:
    """(3, B, 15) positions of 4 text tokens, a 1x2x3 image block whose t/h/w rows differ, and 5 text tokens."""
    block = image_positions(4, 1, 2, 3)
    positions = torch.cat([torch.arange(4).expand(3, -1), block, (torch.arange(5) + 7).expand(3, -1)], dim=1)
    return positions[:, None].expand(3, batch, -1)


# A half-precision QA run's builds, of other shapes than the tests' own, by name: (class, its config); seeded by the
# caller (tests/export/export_helpers.py ``qa_build``: bench/bench_half_hybrid.py, bench/bench_exact_reference.py and
# their tests).
HALF_QA_BUILDS = {
    "qwen3_5-a": (Qwen3_5ForCausalLM, lambda: qwen3_5_config(hidden_size=64, intermediate_size=72)),
    "qwen3_5_moe-a": (
        Qwen3_5MoeForCausalLM,
        lambda: qwen3_5_moe_config(
            hidden_size=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
    ),
    "qwen3_5_moe-b": (
        Qwen3_5MoeForCausalLM,
        lambda: qwen3_5_moe_config(
            hidden_size=48,
            num_experts=5,
            num_experts_per_tok=1,
            moe_intermediate_size=36,
            shared_expert_intermediate_size=20,
        ),
    ),
    "qwen3_next-a": (
        Qwen3NextForCausalLM,
        lambda: qwen3_next_config(
            hidden_size=64,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=28,
        ),
    ),
    "qwen3_next-b": (
        Qwen3NextForCausalLM,
        lambda: qwen3_next_config(
            hidden_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=52,
            norm_topk_prob=False,
        ),
    ),
}
