"""Qwen3 (``model_type: qwen3``): Qwen2 plus per-head q/k RMSNorm, a free ``head_dim``, optional attention bias."""

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
    QK_NORMS,
    decoder_fields,
    hf_export_config,
    load_hf_config,
    same_names,
)


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "qwen3")
    return decoder_fields(hf) | {"attention_bias": hf.attention_bias, "qk_norm": True}


QWEN3 = Family(
    name="qwen3",
    description="Qwen3 (qk-norm)",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    tensor_hints=("model.embed_tokens.weight",),
    translate_config=translate_config,
    tensors=same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP),
    export_config=hf_export_config("qwen3", "Qwen3ForCausalLM"),
)
