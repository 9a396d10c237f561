"""llama.cpp GGUF files of the llama, qwen2 and qwen3 architectures (dequantized on read by ``GGUFSource``).

The tables come from ``gguf_source.GGUF_TENSOR_NAMES`` (llama.cpp name -> Hugging Face name, which for these
architectures is Thinker's name). llama.cpp's converter reorders the q/k rows of llama models for its interleaved
RoPE; the llama table undoes that with ``InterleavedToHalfRope`` (qwen2 and qwen3 are stored unpermuted). The config
is ``gguf_to_hf_config``'s, a Hugging Face config dict, so each architecture reuses its HF family's translation.
"""

from __future__ import annotations

from ..gguf_source import GGUF_TENSOR_NAMES, ROPE_PERMUTED_ARCHITECTURES, ROPE_PERMUTED_TENSORS
from ..ops import InterleavedToHalfRope
from ..spec import LAYER, Family, TensorRule, rule
from . import llama, qwen2, qwen3


def tensor_table(architecture: str) -> tuple[TensorRule, ...]:
    permuted = ROPE_PERMUTED_TENSORS if architecture in ROPE_PERMUTED_ARCHITECTURES else {}
    return tuple(
        rule(
            gguf_name.replace("{i}", LAYER),
            hf_name.replace("{i}", LAYER),
            InterleavedToHalfRope(permuted[gguf_name]) if gguf_name in permuted else None,
        )
        for gguf_name, hf_name in GGUF_TENSOR_NAMES.items()
    )


def gguf_family(architecture: str, translate_config, description: str) -> Family:
    return Family(
        name=f"gguf-{architecture}",
        description=description,
        model_types=(architecture,),
        tensor_hints=("token_embd.weight",),
        translate_config=translate_config,
        tensors=tensor_table(architecture),
        head="output.weight",
    )


GGUF_FAMILIES = (
    gguf_family("llama", llama.translate_config, "llama.cpp GGUF, llama architecture"),
    gguf_family("qwen2", qwen2.translate_config, "llama.cpp GGUF, qwen2 architecture"),
    gguf_family("qwen3", qwen3.translate_config, "llama.cpp GGUF, qwen3 architecture"),
)
