"""Qwen2-VL and Qwen2.5-VL (``model_type: qwen2_vl`` / ``qwen2_5_vl``): the text decoder of transformers'
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` (models/qwen2_vl, models/qwen2_5_vl),
which the Hub releases (``Qwen/Qwen2-VL-*``, ``Qwen/Qwen2.5-VL-*``) are saved from.

The decoder is Qwen2: biases on q/k/v but not on o_proj, GQA, SwiGLU, RMSNorm, with multimodal RoPE in contiguous
sections (``mrope_section`` [t, h, w], [16, 24, 24] when the config names none: the first t frequencies turn with the
temporal position, the next h with the height, the last w with the width; ``Qwen2VLRotaryEmbedding``), kept in the
Thinker config (``mrope_interleaved: False``) so that the ``(3, B, T)`` positions of image and video prompts rotate as
the reference's. Unlike Qwen3-VL, the vision tower adds nothing inside the decoder (no deepstack): its embeddings go
into ``inputs_embeds`` at the image placeholders, so image and video prompts are exact too.

Two layouts: the Hub's (and ``save_pretrained``'s, which reverses transformers' load-time renaming) with the decoder
at ``model.*`` and the tower at ``visual.*``, and transformers' in-memory one, ``model.language_model.*`` and
``model.visual.*``. The tower is dropped by prefix in either.

Parity reference: the family's own class on text, loaded from the source folder. No way back: a Thinker folder has no
vision tower, without which the folder would be incomplete.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    ROTARY_BUFFERS,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    layered_reference_by_model_type,
    mrope_parameters,
    reference_by_model_type,
)

# Qwen2VLRotaryEmbedding's (and Qwen2_5_VL's) section when the config names none.
REFERENCE_MROPE_SECTION = [16, 24, 24]
VISION_PREFIXES = ("visual.", "model.visual.")
REFERENCE_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def text_fields(hf: PreTrainedConfig) -> dict:
    # Qwen2's attention hard-codes its biases: q/k/v have one, o_proj has none.
    return {
        "attention_bias": True,
        "attention_output_bias": False,
        "rope_parameters": mrope_parameters(hf, REFERENCE_MROPE_SECTION, interleaved=False),
    }


QWEN2_VL = hf_family(
    ("qwen2_vl", "qwen2_5_vl"),
    ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen2-VL / Qwen2.5-VL text decoder (vision tower dropped)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP),
    text_fields,
    name="qwen2_vl",
    layouts=({}, VISION_LANGUAGE_LAYOUT),
    dropped=ROTARY_BUFFERS,
    dropped_prefixes=VISION_PREFIXES,
    reference=reference_by_model_type(REFERENCE_CLASSES),
    layered_reference=layered_reference_by_model_type(REFERENCE_CLASSES),
    way_back=False,
)
