"""Qwen3.5 and Qwen3.6 dense (``model_type: qwen3_5_text`` / ``qwen3_5``), as transformers' ``Qwen3_5ForCausalLM``
and ``Qwen3_5ForConditionalGeneration`` (models/qwen3_5) write them.

The decoder is Qwen3-Next's hybrid without experts (``common.hybrid_fields``): ``layer_types`` mixes Gated DeltaNet
linear attention (by default three layers in four, ``full_attention_interval``) with full attention whose ``q_proj``
also yields a sigmoid output gate; q/k RMSNorm; every RMSNorm weight stored zero-centred (``1 + w``); partial rotary
(``partial_rotary_factor`` 0.25) with interleaved multimodal RoPE (``mrope_section``, kept so that the image and video
positions of the vision-language model give its logits: ``(3|4, B, T)`` position_ids).

Two layouts, either model_type:
- causal LM (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``): the decoder at ``model.*``;
- vision-language (``Qwen3_5ForConditionalGeneration``, model_type ``qwen3_5``, what the Hub releases are): the
  decoder at ``model.language_model.*``, its head tied by the outer config's ``tie_word_embeddings``.
Dropped by prefix, on purpose: the vision tower ``model.visual.*`` (its embeddings go into ``inputs_embeds``; the
Thinker is the text decoder) and the multi-token-prediction head ``mtp.*`` (used for speculative decoding, not by
the model's forward; transformers' classes skip both on load). A tensor outside the table and these prefixes is
still an error.

Parity reference: ``Qwen3_5ForCausalLM`` for the causal-LM layout, ``Qwen3_5ForConditionalGeneration`` (on text)
for the vision-language one, each loaded from the source folder. The way back (``--to qwen3_5``) writes the
causal-LM layout: a Thinker folder has no vision tower, and without one a ``Qwen3_5ForConditionalGeneration`` folder
would be incomplete.
"""

from __future__ import annotations

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    GATED_DELTANET,
    HYBRID_LAYER_TYPES,
    LAYER_NORMS,
    QK_NORMS,
    VISION_AND_MTP_PREFIXES,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    hybrid_fields,
    layered_reference_by_model_type,
    mrope_parameters,
    reference_by_model_type,
)

# Qwen3_5TextRotaryEmbedding's section when the config names none (models/qwen3_5/modeling_qwen3_5.py).
REFERENCE_MROPE_SECTION = [11, 11, 10]

QWEN3_5 = hf_family(
    ("qwen3_5_text", "qwen3_5"),
    ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    "Qwen3.5 / Qwen3.6 dense (hybrid Gated DeltaNet; causal-LM or vision-language layout)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, GATED_DELTANET, DENSE_MLP),
    lambda hf: hybrid_fields(hf) | {"rope_parameters": mrope_parameters(hf, REFERENCE_MROPE_SECTION)},
    name="qwen3_5",
    layer_types=HYBRID_LAYER_TYPES,
    partial_rotary=True,
    layouts=({}, VISION_LANGUAGE_LAYOUT),
    dropped_prefixes=VISION_AND_MTP_PREFIXES,
    reference=reference_by_model_type({"qwen3_5": "Qwen3_5ForConditionalGeneration"}),
    layered_reference=layered_reference_by_model_type({"qwen3_5": "Qwen3_5ForConditionalGeneration"}),
    layer_count_keys=("num_hidden_layers", "mtp_num_hidden_layers"),
)
