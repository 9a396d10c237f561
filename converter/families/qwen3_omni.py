"""Qwen3-Omni-MoE: the thinker's text decoder, taken out of a full Qwen3-Omni checkpoint.

A Hub checkpoint (``Qwen/Qwen3-Omni-30B-A3B-Instruct`` and its Thinking / Captioner siblings) holds the thinker's
text decoder under ``thinker.model.*`` and ``thinker.lm_head``, beside the thinker's audio tower
(``thinker.audio_tower.*``) and vision tower (``thinker.visual.*``), and, when it can speak, the talker
(``talker.*``) and the code2wav vocoder (``code2wav.*``). Only the text decoder converts; the rest is dropped by
prefix, on purpose and by name, so a tensor outside all of these is still an error.

The decoder is Qwen3-MoE with q/k RMSNorm (seed 002: GQA, dense and sparse MLP layers chosen by
``decoder_sparse_step`` / ``mlp_only_layers``, top-k routing with ``norm_topk_prob``, untied head). Its RoPE is
multimodal (``mrope_section``, interleaved): the temporal, height and width sections take the same position on
text, which makes it plain RoPE, so the mrope keys are left out of the Thinker config (exact on text input; image,
video and audio positions are the multimodal towers' business). Seed 002 also names an ``audio_embed`` projection
and a ``talker_head`` on the thinker; Qwen3-Omni checkpoints have neither (their audio tower projects to the
hidden size itself, and the talker is a separate model), so the Thinker's ``audio_proj`` / ``talker_head`` stay off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ThinkerError
from ..spec import Family, TensorRule
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    QK_NORMS,
    ROUTER,
    decoder_fields,
    load_hf_config,
    moe_fields,
    routed_experts,
    same_names,
)

PREFIX = "thinker."
# Everything of the full model that is not the thinker's text decoder.
DROPPED_PREFIXES = ("thinker.audio_tower.", "thinker.visual.", "talker.", "code2wav.")
# Multimodal-RoPE keys: they only split positions across sections, which coincide on text.
MROPE_KEYS = ("mrope_section", "interleaved", "mrope_interleaved")


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    full = load_hf_config(source, "qwen3_omni_moe")
    thinker = full.thinker_config
    text = thinker.text_config
    # The head's tying is declared on the thinker config; the text config class has no such field.
    text.tie_word_embeddings = thinker.tie_word_embeddings
    fields = decoder_fields(text) | moe_fields(text)
    fields["rope_parameters"] = {k: v for k, v in fields["rope_parameters"].items() if k not in MROPE_KEYS}
    return fields | {"qk_norm": True, "attention_bias": text.attention_bias}


def load_reference(source: Path, dtype: Any) -> Any:
    """transformers' own thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``) from the full checkpoint.

    Only the thinker is built: its class strips the ``thinker.`` prefix on load and ignores the talker and code2wav
    tensors, so the reference costs the thinker's memory, not the whole model's.
    """
    from transformers import AutoConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    folder = source.parent if source.is_file() else source
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False).thinker_config
        model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
            folder, config=config, dtype=dtype, attn_implementation="eager"
        )
    except (OSError, ValueError) as err:
        raise ThinkerError(f"{folder}: the Qwen3-Omni thinker does not load with transformers ({err})") from None
    return model.eval()


def _from_thinker(rules: tuple[TensorRule, ...]) -> tuple[TensorRule, ...]:
    """The same table with every source name under ``thinker.``: the decoder's names are Thinker's own."""
    return tuple(replace(entry, sources=tuple(PREFIX + name for name in entry.sources)) for entry in rules)


QWEN3_OMNI = Family(
    name="qwen3_omni",
    description="Qwen3-Omni-MoE thinker text decoder (audio, vision, talker and code2wav dropped)",
    model_types=("qwen3_omni_moe",),
    architectures=("Qwen3OmniMoeForConditionalGeneration",),
    translate_config=translate_config,
    tensors=_from_thinker(
        same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP, ROUTER)
        + routed_experts()
    ),
    dropped_prefixes=DROPPED_PREFIXES,
    head=PREFIX + "lm_head.weight",
    reference=load_reference,
)
