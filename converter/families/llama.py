"""Llama-style checkpoints (``model_type: llama``; also SmolLM, TinyLlama ...), as transformers' ``LlamaForCausalLM``
(models/llama) writes them: RMSNorm, RoPE (any scaling type, e.g. Llama 3's), SwiGLU, GQA; ``attention_bias``
covers q/k/v and o_proj alike, ``mlp_bias`` the MLP.

Hugging Face Llama checkpoints already hold q/k in the half-split RoPE layout (the Meta-to-HF conversion permuted
them), so the table is identities; llama.cpp's interleaved layout is undone in ``gguf.py``.
"""

from __future__ import annotations

from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    DENSE_MLP_BIASES,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    ROTARY_BUFFERS,
    hf_family,
)

LLAMA = hf_family(
    "llama",
    "LlamaForCausalLM",
    "Llama-style (SmolLM, TinyLlama, ...)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP, DENSE_MLP_BIASES),
    lambda hf: {"attention_bias": hf.attention_bias, "mlp_bias": hf.mlp_bias},
    dropped=ROTARY_BUFFERS,
)
