"""The from-scratch Qwen3 of Sebastian Raschka's "Build a Large Language Model (From Scratch)" (the standalone Qwen3
notebook, ``ch05/11_qwen3`` of github.com/rasbt/LLMs-from-scratch), saved as a plain state dict.

The checkpoint is a folder with the weights as a ``*.pth`` / ``*.pt`` ``torch.save(model.state_dict())`` and
``config.json`` holding the notebook's config dict (``QWEN_CONFIG_06_B``-style: ``vocab_size, context_length,
emb_dim, n_heads, n_layers, hidden_dim, head_dim, qk_norm, n_kv_groups, rope_base, dtype``, with ``dtype`` written
as its name, e.g. ``"bfloat16"``). It has no ``model_type``: it is recognised by those keys and its tensor names.

The architecture is Qwen3 exactly (RMSNorm in float32 with eps 1e-6, per-head q/k RMSNorm, half-split RoPE, GQA
by ``repeat_interleave``, SwiGLU ``silu(fc1) * fc2 -> fc3``, no biases), so the table is renames only. The head
``out_head`` is always stored (the notebook copies the embedding into it for tied releases), so it converts untied.
The notebook keeps its norm scales in float32 inside a bfloat16 model; ``--dtype auto`` follows the config's
``dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinker_common.errors import ThinkerError

from ..spec import Family, renames
from .common import THINKER_LAYER

RMS_NORM_EPS = 1e-6  # every RMSNorm of the notebook is built with eps=1e-6


def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return {
            "vocab_size": source["vocab_size"],
            "hidden_size": source["emb_dim"],
            "intermediate_size": source["hidden_dim"],
            "num_hidden_layers": source["n_layers"],
            "num_attention_heads": source["n_heads"],
            "num_key_value_heads": source["n_kv_groups"],
            "head_dim": source.get("head_dim"),  # None: emb_dim // n_heads, as the notebook decides
            "qk_norm": bool(source.get("qk_norm", False)),
            "max_position_embeddings": source["context_length"],
            "rope_parameters": {"rope_type": "default", "rope_theta": float(source["rope_base"])},
            "rms_norm_eps": RMS_NORM_EPS,
            "tie_word_embeddings": False,
        }
    except KeyError as err:
        raise ThinkerError(f"LLMs-from-scratch Qwen3 config.json lacks the key {err.args[0]!r}") from None


BLOCK = "trf_blocks.{layer}."  # a notebook transformer block's tensors

LLMS_FROM_SCRATCH_QWEN3 = Family(
    name="llms_from_scratch_qwen3",
    description="LLMs-from-scratch Qwen3 (tok_emb / trf_blocks.N.att.W_query ... / out_head; plain .pth)",
    model_types=(),
    config_keys=("emb_dim", "n_kv_groups", "hidden_dim", "n_layers"),
    layer_count_keys=("n_layers",),
    tensor_hints=("tok_emb.weight",),
    translate_config=translate_config,
    tensors=renames(
        {
            "tok_emb.weight": "model.embed_tokens.weight",
            "final_norm.scale": "model.norm.weight",
            "out_head.weight": "lm_head.weight",
            BLOCK + "norm1.scale": THINKER_LAYER + "input_layernorm.weight",
            BLOCK + "norm2.scale": THINKER_LAYER + "post_attention_layernorm.weight",
            BLOCK + "att.W_query.weight": THINKER_LAYER + "self_attn.q_proj.weight",
            BLOCK + "att.W_key.weight": THINKER_LAYER + "self_attn.k_proj.weight",
            BLOCK + "att.W_value.weight": THINKER_LAYER + "self_attn.v_proj.weight",
            BLOCK + "att.out_proj.weight": THINKER_LAYER + "self_attn.o_proj.weight",
            BLOCK + "att.q_norm.scale": THINKER_LAYER + "self_attn.q_norm.weight",
            BLOCK + "att.k_norm.scale": THINKER_LAYER + "self_attn.k_norm.weight",
            BLOCK + "ff.fc1.weight": THINKER_LAYER + "mlp.gate_proj.weight",
            BLOCK + "ff.fc2.weight": THINKER_LAYER + "mlp.up_proj.weight",
            BLOCK + "ff.fc3.weight": THINKER_LAYER + "mlp.down_proj.weight",
        }
    ),
    head="out_head.weight",
    no_reference="the LLMs-from-scratch Qwen3 has no transformers class; its parity is proven against the "
    "reference implementation in tests/references/llms_from_scratch_qwen3.py (tests/converter/test_seed_families.py)",
)
