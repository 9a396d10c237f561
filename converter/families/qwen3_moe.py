"""Qwen3-MoE (``model_type: qwen3_moe``), as transformers' ``Qwen3MoeForCausalLM`` (models/qwen3_moe) writes it:
Qwen3 attention (qk-norm); routed experts, no shared expert.

Experts come per expert (Hub checkpoints) or fused 3-D (transformers 5's in-memory layout); see
``common.ROUTED_EXPERTS``. ``decoder_sparse_step`` and ``mlp_only_layers`` pick the dense layers.
"""

from __future__ import annotations

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
    refuse_sliding_window,
)

QWEN3_MOE = hf_family(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    "Qwen3-MoE (fused or per-expert tensors)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP, ROUTER, ROUTED_EXPERTS),
    lambda hf: {"attention_bias": refuse_sliding_window(hf).attention_bias, "qk_norm": True},
    moe=True,
)
