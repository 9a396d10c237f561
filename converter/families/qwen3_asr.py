"""Qwen3-ASR (``model_type: qwen3_asr``): the text decoder of transformers' ``Qwen3ASRForConditionalGeneration``
(models/qwen3_asr), which the Hub's ``Qwen/Qwen3-ASR-*-hf`` releases are saved from: the "thinker" of a speech model.

The decoder (``model.language_model.*``, a ``Qwen3Model``; the head ``lm_head``, tied to the embedding) is Qwen3:
per-head q/k RMSNorm, a free ``head_dim``, GQA, SwiGLU, one-dimensional positions. The audio tower
(``model.audio_tower.*``) and its projector (``model.multi_modal_projector.*``) are dropped by prefix: the projected
audio frames go into the Thinker's ``inputs_embeds`` at the audio tokens, as the reference scatters them, so an audio
prompt is exact (``tests/converter/test_qwen3_asr.py``). The end-of-sequence and pad ids live in the outer config
(the text config has none) and are carried into the Thinker's.

Parity reference: ``Qwen3ASRForConditionalGeneration`` on text, loaded from the source folder. No way back: a
Thinker folder has no audio tower, without which the folder would be incomplete. Only the layout transformers loads
(the ``-hf`` releases) is read: a config with a ``thinker_config`` in place of its ``text_config`` is refused by
name (``common.refuse_missing_decoder_config``).
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
    layered_reference_by_model_type,
    reference_by_model_type,
)

REFERENCE_CLASSES = {"qwen3_asr": "Qwen3ASRForConditionalGeneration"}
AUDIO_PREFIXES = ("model.audio_tower.", "model.multi_modal_projector.")


QWEN3_ASR = hf_family(
    "qwen3_asr",
    "Qwen3ASRForConditionalGeneration",
    "Qwen3-ASR text decoder (audio tower dropped)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP),
    lambda hf: {"attention_bias": hf.attention_bias, "qk_norm": True},
    layouts=(VISION_LANGUAGE_LAYOUT,),
    dropped_prefixes=AUDIO_PREFIXES,
    reference=reference_by_model_type(REFERENCE_CLASSES),
    layered_reference=layered_reference_by_model_type(REFERENCE_CLASSES),
    way_back=False,
)
