"""Qwen3-VL (``model_type: qwen3_vl``): the text decoder of transformers' ``Qwen3VLForConditionalGeneration``
(models/qwen3_vl), which the Hub releases (``Qwen/Qwen3-VL-*``) are saved from.

The decoder (``Qwen3VLTextModel``, at ``model.language_model.*``, the head at ``lm_head``) is Qwen3: per-head q/k
RMSNorm, a free ``head_dim``, GQA, SwiGLU, with interleaved multimodal RoPE (``mrope_section``, [24, 20, 20] when the
config names none), kept in the Thinker config so that the ``(3, B, T)`` positions of its image and video prompts
rotate as the reference's. The vision tower (``model.visual.*``) is dropped by prefix: its embeddings go into the
Thinker's ``inputs_embeds``. Text, image and video prompts are exact: the text decoder also adds the tower's
DeepStack features to the hidden states of its first layers, which the Thinker takes as it does
(``visual_pos_masks``, ``deepstack_visual_embeds``; ``thinker export --inputs-embeds``' graph as ``deepstack_embeds``);
the converted config records how many layers take them (``deepstack_layers``).

Qwen3-VL-MoE (``qwen3_vl_moe``, ``Qwen3VLMoeForConditionalGeneration``) is the same decoder with Qwen3-MoE's sparse
layers, but its Hub checkpoints store each layer's experts fused and transposed from transformers' in-memory layout
(``mlp.experts.gate_up_proj`` as (experts, hidden, 2 x intermediate), ``down_proj`` as (experts, intermediate,
hidden); transformers' loading transposes them where the shape says so, and ``save_pretrained`` writes them
untransposed: ``ExpertsToThinkerLayout`` reads both), and its router always renormalises the top-k weights, a setting
its config does not name.

Parity reference: ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration`` on text, loaded from
the source folder. No way back: a Thinker folder has no vision tower, without which either folder would be
incomplete.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..ops import ExpertsToThinkerLayout
from ..spec import rule
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    QK_NORMS,
    ROUTER,
    THINKER_LAYER,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    layered_reference_by_model_type,
    mrope_parameters,
    reference_by_model_type,
    text_decoder_config,
)

# Qwen3VLTextRotaryEmbedding's section when the config names none (models/qwen3_vl/modeling_qwen3_vl.py).
REFERENCE_MROPE_SECTION = [24, 20, 20]
VISION_PREFIXES = ("model.visual.",)
REFERENCE_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
# Qwen3-VL-MoE's experts, transposed where its checkpoints store them so (the Hub's), as they are where not
# (transformers' save_pretrained).
_EXPERTS = THINKER_LAYER + "mlp.experts"
TRANSPOSED_EXPERTS = tuple(
    rule(f"{_EXPERTS}.{name}", f"{_EXPERTS}.{name}", ExpertsToThinkerLayout(name))
    for name in ("gate_up_proj", "down_proj")
)


def text_fields(hf: PreTrainedConfig) -> dict:
    return {
        "attention_bias": hf.attention_bias,
        "qk_norm": True,
        "rope_parameters": mrope_parameters(hf, REFERENCE_MROPE_SECTION),
        "deepstack_layers": hf.deepstack_layers,
    }


def vision_language_text_config(hf: PreTrainedConfig) -> PreTrainedConfig:
    """The text config, with the number of layers its vision tower's DeepStack features follow."""
    text = text_decoder_config(hf)
    text.deepstack_layers = deepstack_layers(hf.vision_config)
    return text


def deepstack_layers(vision: PreTrainedConfig | None) -> int:
    """How many first decoder layers take the DeepStack features of a vision tower (one per deepstack index)."""
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def renormalising_text_config(hf: PreTrainedConfig) -> PreTrainedConfig:
    """The text config, with the renormalisation its router always does (Qwen3VLMoeTextTopKRouter) named."""
    text = vision_language_text_config(hf)
    text.norm_topk_prob = True
    return text


# What both share: the decoder at model.language_model, the tower dropped, the class that holds them the reference.
VISION_LANGUAGE = dict(
    layouts=(VISION_LANGUAGE_LAYOUT,),
    dropped_prefixes=VISION_PREFIXES,
    reference=reference_by_model_type(REFERENCE_CLASSES),
    layered_reference=layered_reference_by_model_type(REFERENCE_CLASSES),
    way_back=False,
)

QWEN3_VL = hf_family(
    "qwen3_vl",
    "Qwen3VLForConditionalGeneration",
    "Qwen3-VL text decoder (vision tower dropped)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP),
    text_fields,
    name="qwen3_vl",
    decoder_config=vision_language_text_config,
    **VISION_LANGUAGE,
)

QWEN3_VL_MOE = hf_family(
    "qwen3_vl_moe",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3-VL-MoE text decoder (vision tower dropped; experts stored transposed)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP, ROUTER, TRANSPOSED_EXPERTS),
    text_fields,
    name="qwen3_vl_moe",
    moe=True,
    decoder_config=renormalising_text_config,
    **VISION_LANGUAGE,
)
