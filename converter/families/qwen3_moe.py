"""Qwen3-MoE (``model_type: qwen3_moe``): Qwen3 attention (qk-norm); routed experts, no shared expert.

Experts come per expert (Hub checkpoints) or fused 3-D (transformers 5's in-memory layout); see
``common.routed_experts``. ``decoder_sparse_step`` and ``mlp_only_layers`` pick the dense layers.
"""

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
    ROUTER,
    decoder_fields,
    hf_export_config,
    load_hf_config,
    moe_fields,
    routed_experts,
    same_names,
)


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "qwen3_moe")
    return decoder_fields(hf) | moe_fields(hf) | {"attention_bias": hf.attention_bias, "qk_norm": True}


QWEN3_MOE = Family(
    name="qwen3_moe",
    description="Qwen3-MoE (fused or per-expert tensors)",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    tensor_hints=("model.embed_tokens.weight",),
    translate_config=translate_config,
    tensors=same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP, ROUTER)
    + routed_experts(),
    export_config=hf_export_config("qwen3_moe", "Qwen3MoeForCausalLM"),
)
