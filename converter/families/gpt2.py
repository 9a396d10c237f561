"""GPT-2-style checkpoints (``model_type: gpt2``), as transformers' ``GPT2LMHeadModel`` (models/gpt2) and OpenAI's
original ``gpt2`` release store them; the PrimeGPT design (a from-scratch GPT: pre-norm LayerNorm with bias, learned
absolute positions, a plain GELU MLP, ``gelu_new``, biases everywhere, the head tied to the embeddings) is this
architecture.

Two layout changes: GPT-2's ``Conv1D`` stores weights as (in, out), the transpose of ``nn.Linear``; and its
attention projects q, k and v with one fused ``c_attn`` whose output columns are [q | k | v]. Checkpoints name the
tensors with a ``transformer.`` prefix (``GPT2LMHeadModel``) or without one (the original ``gpt2`` repo, saved from
``GPT2Model``); both layouts are listed, the one present is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinker_common.errors import ThinkerError

from ..ops import Chain, Split, Transpose
from ..spec import Family, TensorRule, rule
from .common import THINKER_LAYER, load_hf_config


def tensor_table(prefix: str) -> tuple[TensorRule, ...]:
    block, layer = prefix + "h.{layer}.", THINKER_LAYER  # a GPT-2 block's tensors, and a Thinker layer's
    return (
        rule(f"{prefix}wte.weight", "model.embed_tokens.weight"),
        rule(f"{prefix}wpe.weight", "model.embed_positions.weight"),
        rule(f"{block}ln_1.weight", f"{layer}input_layernorm.weight"),
        rule(f"{block}ln_1.bias", f"{layer}input_layernorm.bias"),
        rule(
            f"{block}attn.c_attn.weight",
            [f"{layer}self_attn.{p}_proj.weight" for p in "qkv"],
            Chain(Transpose(), Split(dim=0, parts=3)),
        ),
        rule(f"{block}attn.c_attn.bias", [f"{layer}self_attn.{p}_proj.bias" for p in "qkv"], Split(dim=0, parts=3)),
        rule(f"{block}attn.c_proj.weight", f"{layer}self_attn.o_proj.weight", Transpose()),
        rule(f"{block}attn.c_proj.bias", f"{layer}self_attn.o_proj.bias"),
        rule(f"{block}ln_2.weight", f"{layer}post_attention_layernorm.weight"),
        rule(f"{block}ln_2.bias", f"{layer}post_attention_layernorm.bias"),
        rule(f"{block}mlp.c_fc.weight", f"{layer}mlp.up_proj.weight", Transpose()),
        rule(f"{block}mlp.c_fc.bias", f"{layer}mlp.up_proj.bias"),
        rule(f"{block}mlp.c_proj.weight", f"{layer}mlp.down_proj.weight", Transpose()),
        rule(f"{block}mlp.c_proj.bias", f"{layer}mlp.down_proj.bias"),
        rule(f"{prefix}ln_f.weight", "model.norm.weight"),
        rule(f"{prefix}ln_f.bias", "model.norm.bias"),
    )


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    hf = load_hf_config(source, "gpt2")
    for flag, supported in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
        if getattr(hf, flag) != supported:
            raise ThinkerError(f"the source config sets {flag}={getattr(hf, flag)}, an attention scaling Thinker lacks")
    if hf.add_cross_attention:
        raise ThinkerError("the source config adds cross-attention (add_cross_attention=true); Thinker is decoder-only")
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.n_embd,
        "intermediate_size": hf.n_inner or 4 * hf.n_embd,
        "num_hidden_layers": hf.n_layer,
        "max_position_embeddings": hf.n_positions,
        "num_attention_heads": hf.n_head,
        "attention_bias": True,
        "attention_output_bias": True,
        "position_embedding_type": "learned",
        "hidden_act": hf.activation_function,
        "mlp_gated": False,
        "mlp_bias": True,
        "norm_type": "layernorm",
        "rms_norm_eps": hf.layer_norm_epsilon,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "initializer_range": hf.initializer_range,
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "pad_token_id": hf.pad_token_id,
    }


GPT2 = Family(
    name="gpt2",
    description="GPT-2-style (PrimeGPT: LayerNorm, learned positions, GELU, Conv1D)",
    model_types=("gpt2",),
    architectures=("GPT2LMHeadModel",),
    layer_count_keys=("n_layer",),
    tensor_hints=("transformer.wte.weight", "wte.weight"),
    translate_config=translate_config,
    tensors=tensor_table("transformer.") + tensor_table("") + (rule("lm_head.weight", "lm_head.weight"),),
    # The causal-mask buffers that older transformers versions saved with the weights.
    dropped=tuple(f"{p}h.{{layer}}.attn.{buffer}" for p in ("transformer.", "") for buffer in ("bias", "masked_bias")),
)
