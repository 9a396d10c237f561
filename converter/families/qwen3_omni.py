"""Qwen3-Omni-MoE: the thinker's text decoder, taken out of a full Qwen3-Omni checkpoint.

The format is transformers' ``Qwen3OmniMoeForConditionalGeneration`` (models/qwen3_omni_moe), which the Hub releases
(``Qwen/Qwen3-Omni-30B-A3B-Instruct`` and its Thinking / Captioner siblings) are saved from. It holds the thinker's
text decoder under ``thinker.model.*`` and ``thinker.lm_head``, beside the thinker's audio tower
(``thinker.audio_tower.*``) and vision tower (``thinker.visual.*``), and, when it can speak, the talker
(``talker.*``) and the code2wav vocoder (``code2wav.*``). Only the text decoder converts; the rest is dropped by
prefix, on purpose and by name, so a tensor outside all of these is still an error.

The decoder is ``Qwen3OmniMoeThinkerTextModel``: Qwen3-MoE with q/k RMSNorm (GQA, dense and sparse MLP layers
chosen by ``decoder_sparse_step`` / ``mlp_only_layers``, top-k routing with ``norm_topk_prob``, untied head). Its
RoPE is interleaved multimodal RoPE (``mrope_section``; the class always interleaves and falls back to [24, 20, 20]
when the config names no section), kept in the Thinker config: given the thinker's ``inputs_embeds`` and its
``(3, B, T)`` temporal/height/width positions, the Thinker gives the text decoder's logits. That makes text and
audio prompts exact (the audio tower's embeddings go into ``inputs_embeds``; audio positions are sequential). Image
and video prompts too: Qwen3-Omni's text decoder also adds the vision tower's DeepStack features to the hidden states
of its first layers, which the Thinker takes as the text decoder does (``visual_pos_masks``,
``deepstack_visual_embeds``; ``thinker export --inputs-embeds``' graph as ``deepstack_embeds``). The converted config
records how many layers take them (``deepstack_layers``, the vision tower's ``deepstack_visual_indexes``).

The thinker saved alone (``Qwen3OmniMoeThinkerForConditionalGeneration.save_pretrained``, ``model_type``
``qwen3_omni_moe_thinker``: what a user who loaded just the thinker, the parity reference itself, writes back) holds
the same decoder beside its own towers, with the ``thinker.`` prefix where the thinker was loaded from a full
checkpoint (transformers reverses its load-time renaming on save) and without it where it was built alone: the same
tensors, the second family here (``qwen3_omni_thinker``), whose config is the thinker config itself.

The Qwen3-Omni design notes also name an ``audio_embed`` projection and a ``talker_head`` on the thinker; the
released checkpoints have neither (their audio tower projects to the hidden size itself, and the talker is a separate
model), so the Thinker's ``audio_proj`` / ``talker_head`` stay off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedConfig

from thinker_common.eager import EAGER
from thinker_common.errors import ThinkerError

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    QK_NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    hf_family,
    mrope_parameters,
    with_generation_ids,
)
from .qwen3_vl import deepstack_layers

# Everything of the full model that is not the thinker's text decoder; of the thinker saved alone, its towers.
DROPPED_PREFIXES = ("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav.")
THINKER_DROPPED_PREFIXES = ("audio_tower.", "visual.", "thinker.audio_tower.", "thinker.visual.")
# Qwen3OmniMoeThinkerTextRotaryEmbedding's section when the config names none (models/qwen3_omni_moe).
REFERENCE_MROPE_SECTION = [24, 20, 20]


def text_decoder_config(full: PreTrainedConfig) -> PreTrainedConfig:
    """The text config of an omni model's thinker (Qwen3-Omni's, Qwen2.5-Omni's), with what the thinker config
    declares for it."""
    return thinker_text_config(full.thinker_config)


def thinker_text_config(thinker: PreTrainedConfig) -> PreTrainedConfig:
    """A thinker config's text config (the thinker saved alone, or a full model's ``thinker_config``), with what the
    thinker config declares for it: the head's tie, and the special ids as the thinker's generate takes them."""
    text = thinker.text_config
    # The head's tying is declared on the thinker config; the text config class has no such field.
    text.tie_word_embeddings = thinker.tie_word_embeddings
    with_generation_ids(text, thinker)  # the thinker config's where it names them, as its generate takes them
    text.deepstack_layers = deepstack_layers(getattr(thinker, "vision_config", None))
    return text


def text_decoder_fields(text: PreTrainedConfig) -> dict[str, Any]:
    rope = mrope_parameters(text, REFERENCE_MROPE_SECTION)
    return {
        "qk_norm": True,
        "attention_bias": text.attention_bias,
        "rope_parameters": rope,
        "deepstack_layers": text.deepstack_layers,
    }


def thinker_config(folder: Path) -> PreTrainedConfig:
    """The thinker's config: the full model's ``thinker_config``, or the config of a thinker saved alone."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ThinkerError(f"{folder}: the omni model's config does not load with transformers ({err})") from None
    return getattr(config, "thinker_config", config)


def thinker_reference(class_name: str) -> Callable[[Path, Any], Any]:
    """A parity reference loader for an omni model's thinker: transformers' ``class_name`` (its thinker class) from
    the full checkpoint or the thinker saved alone.

    Only the thinker is built: its class strips the ``thinker.`` prefix on load and ignores the talker's and the
    vocoder's tensors, so the reference costs the thinker's memory, not the whole model's.
    """

    def load(source: Path, dtype: Any) -> Any:
        import transformers

        folder = source.parent if source.is_file() else source
        try:
            model = getattr(transformers, class_name).from_pretrained(
                folder, config=thinker_config(folder), dtype=dtype, **EAGER
            )
        except (OSError, ValueError) as err:
            raise ThinkerError(f"{folder}: the omni model's thinker does not load with transformers ({err})") from None
        return model.eval()

    return load


def layered_thinker_reference(class_name: str) -> Callable[[Path, Any], Any]:
    """The same thinker built on the meta device, read one layer at a time from the checkpoint (its class's loading
    conversions strip ``thinker.``; the towers, talker and vocoder never run on text, so never load)."""

    def load(source: Path, dtype: Any) -> Any:
        import transformers

        from thinker_common.sources import open_source

        from ..streamed import StreamedModel, empty_model, lazy_tensors

        folder = source.parent if source.is_file() else source
        thinker_class = getattr(transformers, class_name)
        model = empty_model(thinker_class._from_config, thinker_config(folder), dtype)
        tensors = open_source(source)
        return StreamedModel(model, lazy_tensors(tensors), close=tensors.close)

    return load


# What both layouts share: the thinker's text decoder, its transformers class as the reference, no way back (a
# Thinker folder has no towers, without which neither layout is whole).
DECODER = dict(
    groups=(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP, ROUTER, ROUTED_EXPERTS),
    fields=text_decoder_fields,
    moe=True,
    reference=thinker_reference("Qwen3OmniMoeThinkerForConditionalGeneration"),
    layered_reference=layered_thinker_reference("Qwen3OmniMoeThinkerForConditionalGeneration"),
    way_back=False,
)

QWEN3_OMNI = hf_family(
    "qwen3_omni_moe",
    "Qwen3OmniMoeForConditionalGeneration",
    "Qwen3-Omni-MoE thinker text decoder (audio, vision, talker and code2wav dropped)",
    name="qwen3_omni",
    decoder_config=text_decoder_config,
    layouts=({"": "thinker."},),
    tie_key="thinker_config.tie_word_embeddings",
    dropped_prefixes=DROPPED_PREFIXES,
    **DECODER,
)

QWEN3_OMNI_THINKER = hf_family(
    "qwen3_omni_moe_thinker",
    "Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen3-Omni-MoE thinker saved alone: its text decoder (audio and vision towers dropped)",
    decoder_config=thinker_text_config,
    name="qwen3_omni_thinker",
    layouts=({}, {"": "thinker."}),
    dropped_prefixes=THINKER_DROPPED_PREFIXES,
    **DECODER,
)
