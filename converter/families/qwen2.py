"""Qwen2 and Qwen2.5 (``model_type: qwen2``), as transformers' ``Qwen2ForCausalLM`` (models/qwen2) writes them:
RMSNorm, RoPE, SwiGLU, GQA, biases on q/k/v but not on o_proj."""

from __future__ import annotations

from .common import ATTENTION, ATTENTION_BIASES, DENSE_MLP, EMBEDDINGS_AND_HEAD, LAYER_NORMS, ROTARY_BUFFERS, hf_family

QWEN2 = hf_family(
    "qwen2",
    "Qwen2ForCausalLM",
    "Qwen2 / Qwen2.5 (qkv bias)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP),
    # Qwen2 hard-codes its biases rather than reading a flag: q/k/v have one, o_proj has none.
    lambda hf: {"attention_bias": True, "attention_output_bias": False},
    dropped=ROTARY_BUFFERS,
)
