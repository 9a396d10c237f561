"""Qwen2-MoE (``model_type: qwen2_moe``): Qwen2 attention; routed experts plus a shared expert behind a sigmoid gate.

Layers are sparse or dense by Qwen's rule (``decoder_sparse_step``, ``mlp_only_layers``), which ThinkerConfig
applies the same way, so the dense-MLP and expert entries below each apply to exactly the layers that have them.
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
    ROUTER,
    SHARED_EXPERT,
    decoder_fields,
    hf_export_config,
    load_hf_config,
    moe_fields,
    routed_experts,
    same_names,
)


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "qwen2_moe")
    return (
        decoder_fields(hf)
        | moe_fields(hf)
        | {
            "attention_bias": hf.qkv_bias,
            "attention_output_bias": False,
            "shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
        }
    )


QWEN2_MOE = Family(
    name="qwen2_moe",
    description="Qwen2-MoE (shared expert)",
    model_types=("qwen2_moe",),
    architectures=("Qwen2MoeForCausalLM",),
    tensor_hints=("model.embed_tokens.weight",),
    translate_config=translate_config,
    tensors=same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP, ROUTER, SHARED_EXPERT)
    + routed_experts(),
    export_config=hf_export_config("qwen2_moe", "Qwen2MoeForCausalLM", renamed={"attention_bias": "qkv_bias"}),
)
