"""Qwen3 (``model_type: qwen3``), as transformers' ``Qwen3ForCausalLM`` (models/qwen3) writes it: Qwen2 plus per-head
q/k RMSNorm, a free ``head_dim``, an optional attention bias."""

from __future__ import annotations

from .common import ATTENTION, ATTENTION_BIASES, DENSE_MLP, EMBEDDINGS_AND_HEAD, LAYER_NORMS, QK_NORMS, hf_family

QWEN3 = hf_family(
    "qwen3",
    "Qwen3ForCausalLM",
    "Qwen3 (qk-norm)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, DENSE_MLP),
    lambda hf: {"attention_bias": hf.attention_bias, "qk_norm": True},
)
