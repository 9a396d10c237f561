"""Llama-style checkpoints (``model_type: llama``; also SmolLM, TinyLlama ...): RMSNorm, RoPE (any scaling type,
e.g. Llama 3's), SwiGLU, GQA; ``attention_bias`` covers q/k/v and o_proj alike, ``mlp_bias`` the MLP.

Hugging Face Llama checkpoints already hold q/k in the half-split RoPE layout (the Meta-to-HF conversion permuted
them), so the table is identities; llama.cpp's interleaved layout is undone in ``gguf.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..spec import Family
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    DENSE_MLP_BIASES,
    EMBEDDINGS_AND_HEAD,
    LAYER_NORMS,
    ROTARY_BUFFERS,
    decoder_fields,
    hf_export_config,
    load_hf_config,
    same_names,
)


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "llama")
    return decoder_fields(hf) | {"attention_bias": hf.attention_bias, "mlp_bias": hf.mlp_bias}


LLAMA = Family(
    name="llama",
    description="Llama-style (SmolLM, TinyLlama, ...)",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    tensor_hints=("model.embed_tokens.weight",),
    translate_config=translate_config,
    tensors=same_names(EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, DENSE_MLP, DENSE_MLP_BIASES),
    dropped=ROTARY_BUFFERS,
    export_config=hf_export_config("llama", "LlamaForCausalLM"),
)
