"""What the Qwen-style families share: reading a source config through transformers, and its common fields.

The source config is parsed by the source family's own transformers config class, so that its defaults and its
legacy spellings (``rope_theta`` + ``rope_scaling`` versus ``rope_parameters``, ``num_experts`` versus
``num_local_experts``, a missing ``head_dim``) are resolved exactly as the reference model resolves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, PreTrainedConfig

from thinker import ThinkerConfig

from ..errors import ThinkerError
from ..ops import StackExperts
from ..spec import TensorRule, rule


def load_hf_config(source_config: Mapping[str, Any], model_type: str) -> PreTrainedConfig:
    """The source config dict as an instance of transformers' config class for ``model_type``."""
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(source_config, model_type=model_type))
    except (TypeError, ValueError, KeyError, StrictDataclassError) as err:
        reason = " ".join(str(err).split())  # transformers' validation messages span several lines
        raise ThinkerError(f"the source config.json is not a valid {model_type} config: {reason}") from None


def decoder_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """The ThinkerConfig fields every RoPE / RMSNorm / SwiGLU decoder (Llama, Qwen2, Qwen3 and their MoE) shares."""
    refuse_sliding_window(hf)
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "max_position_embeddings": hf.max_position_embeddings,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads or hf.num_attention_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "attention_dropout": hf.attention_dropout,
        "rope_parameters": dict(hf.rope_parameters),
        "hidden_act": hf.hidden_act,
        "rms_norm_eps": hf.rms_norm_eps,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "initializer_range": hf.initializer_range,
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": hf.eos_token_id,
        "pad_token_id": hf.pad_token_id,
    }


def moe_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """The Qwen-MoE routing fields; Thinker decides dense versus sparse layers by the same rule as Qwen."""
    return {
        "num_experts": hf.num_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "norm_topk_prob": hf.norm_topk_prob,
        "decoder_sparse_step": hf.decoder_sparse_step,
        "mlp_only_layers": list(hf.mlp_only_layers or []),
        "router_aux_loss_coef": hf.router_aux_loss_coef,
    }


def hf_export_config(
    model_type: str, architecture: str, renamed: Mapping[str, str] | None = None
) -> Callable[[ThinkerConfig], dict[str, Any]]:
    """The way back for a family whose config speaks Thinker's (Qwen's) field names: every Thinker field the family's
    config class declares is carried over under the same name (or the one ``renamed`` gives); the rest are implied
    by the family. Whether the result really describes the same model is checked by the caller, which translates it
    forward again and compares (``converter.back``)."""

    def export(config: ThinkerConfig) -> dict[str, Any]:
        config_class = CONFIG_MAPPING[model_type]
        housekeeping = {"architectures", "dtype", "transformers_version"}
        accepted = {field.name for field in dataclasses.fields(config_class)} - housekeeping
        names = renamed or {}
        values = {names.get(key, key): value for key, value in config.to_dict().items()}
        hf = config_class(**{key: value for key, value in values.items() if key in accepted})
        hf.architectures = [architecture]
        hf.dtype = config.dtype
        return hf.to_dict()

    return export


def refuse_sliding_window(hf: PreTrainedConfig) -> None:
    """Thinker attends over the full context; a checkpoint trained with sliding-window layers is another model."""
    layer_types = getattr(hf, "layer_types", None) or []
    windowed = [index for index, kind in enumerate(layer_types) if kind != "full_attention"]
    if windowed:
        raise ThinkerError(
            f"the source config uses sliding-window attention on layers {windowed[:8]}"
            f"{' ...' if len(windowed) > 8 else ''} (use_sliding_window / layer_types), which Thinker does not "
            "implement; only full-attention checkpoints convert"
        )


# --- tensor names shared by the Llama-style families ---------------------------------------------------------------
# These checkpoints already use Thinker's (Qwen's) names, so their tables are identities; a name listed for a part
# the model of a given config lacks (a bias, a qk-norm, the untied head) is simply inert.

EMBEDDINGS_AND_HEAD = (
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
)
LAYER_NORMS = (
    "model.layers.{layer}.input_layernorm.weight",
    "model.layers.{layer}.post_attention_layernorm.weight",
)
ATTENTION = (
    "model.layers.{layer}.self_attn.q_proj.weight",
    "model.layers.{layer}.self_attn.k_proj.weight",
    "model.layers.{layer}.self_attn.v_proj.weight",
    "model.layers.{layer}.self_attn.o_proj.weight",
)
ATTENTION_BIASES = (
    "model.layers.{layer}.self_attn.q_proj.bias",
    "model.layers.{layer}.self_attn.k_proj.bias",
    "model.layers.{layer}.self_attn.v_proj.bias",
    "model.layers.{layer}.self_attn.o_proj.bias",
)
QK_NORMS = (
    "model.layers.{layer}.self_attn.q_norm.weight",
    "model.layers.{layer}.self_attn.k_norm.weight",
)
DENSE_MLP = (
    "model.layers.{layer}.mlp.gate_proj.weight",
    "model.layers.{layer}.mlp.up_proj.weight",
    "model.layers.{layer}.mlp.down_proj.weight",
)
DENSE_MLP_BIASES = (
    "model.layers.{layer}.mlp.gate_proj.bias",
    "model.layers.{layer}.mlp.up_proj.bias",
    "model.layers.{layer}.mlp.down_proj.bias",
)
ROUTER = ("model.layers.{layer}.mlp.gate.weight",)
SHARED_EXPERT = (
    "model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
    "model.layers.{layer}.mlp.shared_expert.up_proj.weight",
    "model.layers.{layer}.mlp.shared_expert.down_proj.weight",
    "model.layers.{layer}.mlp.shared_expert_gate.weight",
)
# Buffers that older transformers versions saved with the weights; they are recomputed from the config.
ROTARY_BUFFERS = ("model.layers.{layer}.self_attn.rotary_emb.inv_freq",)


def same_names(*groups: tuple[str, ...]) -> tuple[TensorRule, ...]:
    """Rules that keep each listed name: the source already speaks Thinker's names."""
    return tuple(rule(name, name) for group in groups for name in group)


def routed_experts() -> tuple[TensorRule, ...]:
    """A Qwen-MoE layer's routed experts, from either layout on disk; the first whose tensors exist is used.

    Hub checkpoints store every expert's projections separately (``mlp.experts.{e}.gate_proj.weight``, and
    transformers 5 writes them back that way by default); they are stacked into Thinker's fused 3-D tensors one
    layer at a time. A checkpoint saved with ``save_original_format=False`` is already fused and is copied.
    """
    experts = "model.layers.{layer}.mlp.experts"
    return (
        rule(
            (f"{experts}.{{expert}}.gate_proj.weight", f"{experts}.{{expert}}.up_proj.weight"),
            f"{experts}.gate_up_proj",
            StackExperts(parts=2, dim=1),
        ),
        rule(f"{experts}.{{expert}}.down_proj.weight", f"{experts}.down_proj", StackExperts()),
        rule(f"{experts}.gate_up_proj", f"{experts}.gate_up_proj"),
        rule(f"{experts}.down_proj", f"{experts}.down_proj"),
    )
