"""Qwen3-VL (``model_type: qwen3_vl``): the text decoder of transformers' ``Qwen3VLForConditionalGeneration``
(models/qwen3_vl), which the Hub releases (``Qwen/Qwen3-VL-*``) are saved from.

The decoder (``Qwen3VLTextModel``, at ``model.language_model.*``, the head at ``lm_head``) is Qwen3: per-head q/k
RMSNorm, a free ``head_dim``, GQA, SwiGLU, with interleaved multimodal RoPE (``mrope_section``, [24, 20, 20] when the
config names none), kept in the Thinker config so that the ``(3, B, T)`` positions of its image and video prompts
rotate as the reference's. The vision tower (``model.visual.*``) is dropped by prefix: its embeddings go into the
Thinker's ``inputs_embeds``. Text prompts are exact; image and video prompts are not, as for Qwen3-Omni: the text
decoder also adds the tower's deepstack features to the hidden states of its first layers
(``deepstack_visual_embeds``), an input the Thinker does not take.

Parity reference: ``Qwen3VLForConditionalGeneration`` on text, loaded from the source folder. No way back: a Thinker
folder has no vision tower, without which a Qwen3-VL folder would be incomplete.
"""

from __future__ import annotations

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    QK_NORMS,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    interleaved_mrope,
    layered_reference_by_model_type,
    reference_by_model_type,
)

# Qwen3VLTextRotaryEmbedding's section when the config names none (models/qwen3_vl/modeling_qwen3_vl.py).
REFERENCE_MROPE_SECTION = [24, 20, 20]
VISION_PREFIXES = ("model.visual.",)
REFERENCE_CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration"}

QWEN3_VL = hf_family(
    "qwen3_vl",
    "Qwen3VLForConditionalGeneration",
    "Qwen3-VL text decoder (vision tower dropped)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP),
    lambda hf: {
        "attention_bias": hf.attention_bias,
        "qk_norm": True,
        "rope_parameters": interleaved_mrope(hf, REFERENCE_MROPE_SECTION),
    },
    name="qwen3_vl",
    layouts=(VISION_LANGUAGE_LAYOUT,),
    dropped_prefixes=VISION_PREFIXES,
    reference=reference_by_model_type(REFERENCE_CLASSES),
    layered_reference=layered_reference_by_model_type(REFERENCE_CLASSES),
    way_back=False,
)
