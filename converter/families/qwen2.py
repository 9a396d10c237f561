"""Qwen2 and Qwen2.5 (``model_type: qwen2``): RMSNorm, RoPE, SwiGLU, GQA, biases on q/k/v but not on o_proj."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..spec import Family
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    ROTARY_BUFFERS,
    decoder_fields,
    hf_export_config,
    load_hf_config,
    same_names,
)


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "qwen2")
    # Qwen2 hard-codes its biases rather than reading a flag: q/k/v have one, o_proj has none.
    return decoder_fields(hf) | {"attention_bias": True, "attention_output_bias": False}


QWEN2 = Family(
    name="qwen2",
    description="Qwen2 / Qwen2.5 (qkv bias)",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    tensor_hints=("model.embed_tokens.weight",),
    translate_config=translate_config,
    tensors=same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP),
    dropped=ROTARY_BUFFERS,
    export_config=hf_export_config("qwen2", "Qwen2ForCausalLM"),
)
