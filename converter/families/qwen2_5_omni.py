"""Qwen2.5-Omni: the thinker's text decoder, taken out of a full Qwen2.5-Omni checkpoint or a thinker saved alone.

The format is transformers' ``Qwen2_5OmniForConditionalGeneration`` (models/qwen2_5_omni), which the Hub releases
(``Qwen/Qwen2.5-Omni-3B``, ``-7B``) are saved from: the thinker's text decoder under ``thinker.model.*`` and
``thinker.lm_head``, beside its audio tower (``thinker.audio_tower.*``) and vision tower (``thinker.visual.*``), and,
for speech output, the talker (``talker.*``) and the token2wav vocoder (``token2wav.*``). Only the text decoder
converts; the rest is dropped by prefix, on purpose and by name. The thinker saved alone
(``Qwen2_5OmniThinkerForConditionalGeneration``, ``model_type`` ``qwen2_5_omni_thinker``) holds the same decoder
beside its towers, with or without the ``thinker.`` prefix (as for Qwen3-Omni).

The decoder (``Qwen2_5OmniThinkerTextModel``) is Qwen2: biases on q/k/v but not on o_proj, GQA, SwiGLU, with
multimodal RoPE in contiguous sections (``mrope_section``, [16, 24, 24] when the config names none; Qwen2-VL's
layout, ``Qwen2_5OmniRotaryEmbedding``), kept in the Thinker config (``mrope_interleaved: False``). Nothing from the
towers enters the decoder but ``inputs_embeds`` (no deepstack), so text, audio, image and video prompts are all
exact given the thinker's embeddings and its ``(3, B, T)`` positions.

Parity reference: ``Qwen2_5OmniThinkerForConditionalGeneration`` on text, loaded from the source. No way back: a
Thinker folder has no towers, without which neither layout is whole.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    hf_family,
    mrope_parameters,
)
from .qwen3_omni import layered_thinker_reference, text_decoder_config, thinker_reference, thinker_text_config

DROPPED_PREFIXES = ("thinker.audio_tower.", "thinker.visual.", "talker.", "token2wav.")
THINKER_DROPPED_PREFIXES = ("audio_tower.", "visual.", "thinker.audio_tower.", "thinker.visual.")
# Qwen2_5OmniRotaryEmbedding's section when the config names none.
REFERENCE_MROPE_SECTION = [16, 24, 24]
THINKER_CLASS = "Qwen2_5OmniThinkerForConditionalGeneration"


def text_decoder_fields(text: PreTrainedConfig) -> dict[str, Any]:
    # Qwen2's attention hard-codes its biases: q/k/v have one, o_proj has none.
    rope = mrope_parameters(text, REFERENCE_MROPE_SECTION, interleaved=False)
    return {"attention_bias": True, "attention_output_bias": False, "rope_parameters": rope}


DECODER = dict(
    groups=(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP),
    fields=text_decoder_fields,
    reference=thinker_reference(THINKER_CLASS),
    layered_reference=layered_thinker_reference(THINKER_CLASS),
    way_back=False,
)

QWEN2_5_OMNI = hf_family(
    "qwen2_5_omni",
    "Qwen2_5OmniForConditionalGeneration",
    "Qwen2.5-Omni thinker text decoder (audio, vision, talker and token2wav dropped)",
    name="qwen2_5_omni",
    decoder_config=text_decoder_config,
    layouts=({"": "thinker."},),
    tie_key="thinker_config.tie_word_embeddings",
    dropped_prefixes=DROPPED_PREFIXES,
    **DECODER,
)

QWEN2_5_OMNI_THINKER = hf_family(
    "qwen2_5_omni_thinker",
    THINKER_CLASS,
    "Qwen2.5-Omni thinker saved alone: its text decoder (audio and vision towers dropped)",
    decoder_config=thinker_text_config,
    name="qwen2_5_omni_thinker",
    layouts=({}, {"": "thinker."}),
    dropped_prefixes=THINKER_DROPPED_PREFIXES,
    **DECODER,
)
