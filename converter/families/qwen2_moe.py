"""Qwen2-MoE (``model_type: qwen2_moe``), as transformers' ``Qwen2MoeForCausalLM`` (models/qwen2_moe) writes it:
Qwen2 attention; routed experts plus a shared expert behind a sigmoid gate.

Layers are sparse or dense by Qwen's rule (``decoder_sparse_step``, ``mlp_only_layers``), which ThinkerConfig
applies the same way, so the dense-MLP and expert groups below each apply to exactly the layers that have them.
"""

from __future__ import annotations

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERT,
    hf_family,
)

QWEN2_MOE = hf_family(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    "Qwen2-MoE (shared expert)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP, ROUTER, SHARED_EXPERT, ROUTED_EXPERTS),
    lambda hf: {
        "attention_bias": hf.qkv_bias,
        "attention_output_bias": False,
        "shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
    },
    moe=True,
    renamed_fields={"attention_bias": "qkv_bias"},
)
