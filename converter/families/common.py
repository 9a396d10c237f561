"""What the Hugging Face families share, and ``hf_family``, which builds one from its differences.

The source config is parsed by the source family's own transformers config class, so that its defaults and its
legacy spellings (``rope_theta`` + ``rope_scaling`` versus ``rope_parameters``, ``num_experts`` versus
``num_local_experts``, a missing ``head_dim``) are resolved exactly as the reference model resolves them.

The tensor groups below are Thinker's own names, which are Qwen's and Llama's: a Hugging Face family's table is the
groups its checkpoints hold, as identities (under a name prefix when the decoder sits inside a larger model). A
group listing a part the model of a given config lacks (a bias, a qk-norm, the untied head, experts on a dense
layer) is inert: the engine keeps only the rules whose targets the model has.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, GenerationConfig, PreTrainedConfig

from thinker import ThinkerConfig
from thinker_common.config_values import dtype_problem
from thinker_common.eager import EAGER
from thinker_common.errors import ThinkerError

from ..ops import StackExperts
from ..spec import DerivedTensors, Family, LayeredReferenceLoader, ReferenceLoader, SourceCheck, TensorRule, rule
from ..special_tokens import SPECIAL_IDS


def load_hf_config(source_config: Mapping[str, Any], model_type: str) -> PreTrainedConfig:
    """The source config dict as an instance of transformers' config class for ``model_type``."""
    if problem := dtype_problem(source_config):
        raise ThinkerError(f"the source config.json is not a valid {model_type} config: {problem}; correct the value")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(source_config, model_type=model_type))
    except (TypeError, ValueError, KeyError, StrictDataclassError) as err:
        reason = " ".join(str(err).split())  # transformers' validation messages span several lines
        raise ThinkerError(f"the source config.json is not a valid {model_type} config: {reason}") from None


# The sub-configs, outermost first, that a text decoder sits in within a larger model's config (an omni model's
# thinker_config, a vision-language model's text_config).
DECODER_SUB_CONFIGS = ("thinker_config", "text_config")


# Config classes that read their text decoder's fields from the top level when the config has no text_config: the
# form transformers 4.x saved Qwen2-VL and Qwen2.5-VL in, which their Hub releases keep (Qwen2VLConfig.__post_init__:
# "Hub configs are saved as flat dicts").
FLAT_TEXT_CONFIG_TYPES = ("qwen2_vl", "qwen2_5_vl")


def refuse_missing_decoder_config(source: Mapping[str, Any], model_type: str) -> None:
    """Refuse a larger model's config without the sub-config its text decoder is described in: transformers would
    fill in its default sizes, and the error would then list every tensor as missing or misshapen."""
    config_class, config, path = CONFIG_MAPPING[model_type], source, []
    if model_type in FLAT_TEXT_CONFIG_TYPES and "text_config" not in source and "hidden_size" in source:
        return
    for key in DECODER_SUB_CONFIGS:
        sub_class = getattr(config_class, "sub_configs", {}).get(key)
        if sub_class is None:
            continue
        path.append(key)
        other = next((k for k in DECODER_SUB_CONFIGS if k != key and isinstance(config.get(k), Mapping)), None)
        if not isinstance(config.get(key), Mapping) and other:  # another release's layout under the same model_type
            raise ThinkerError(
                f"the source config.json (model_type {model_type!r}) holds a {other} where transformers' "
                f"{config_class.__name__} reads a {'.'.join(path)}: a layout transformers does not load (another "
                "release of the model, such as the one its Hugging Face conversion was made from); convert the "
                "release transformers loads"
            )
        if not isinstance(config.get(key), Mapping):
            raise ThinkerError(
                f"the source config.json (model_type {model_type!r}) has no {'.'.join(path)}, which holds its text "
                f"decoder's sizes (transformers would take its defaults); restore it from the model's repository"
            )
        config_class, config = sub_class, config[key]


def text_decoder_config(hf: PreTrainedConfig) -> PreTrainedConfig:
    """The text decoder's config: the config itself, or a vision-language config's ``text_config``, given the tie
    setting of the model that holds the head (transformers ties a vision-language model's head by the outer
    config's ``tie_word_embeddings``, which is independent of its text config's) and its special ids
    (``with_generation_ids``)."""
    text = hf.get_text_config(decoder=True)
    if text is not hf:
        text.tie_word_embeddings = hf.tie_word_embeddings
        with_generation_ids(text, hf)
    return text


def with_generation_ids(text: PreTrainedConfig, outer: PreTrainedConfig) -> PreTrainedConfig:
    """``text`` with the bos, eos and pad ids transformers' ``generate`` takes for the model of ``outer``: the outer
    config's where it names them, else its text decoder's (``GenerationConfig.from_model_config``). The text
    config's alone dropped an eos a release names on the outer config, and one named on both and differing
    converted to another stop than the source model's (a review)."""
    generation = GenerationConfig.from_model_config(outer)
    for key in SPECIAL_IDS:
        value = getattr(generation, key, None)
        setattr(text, key, list(value) if isinstance(value, tuple) else value)
    return text


def decoder_fields(
    hf: PreTrainedConfig, layer_types: tuple[str, ...] = ("full_attention",), partial_rotary: bool = False
) -> dict[str, Any]:
    """The ThinkerConfig fields every RoPE / RMSNorm / SwiGLU decoder (Llama, Qwen2, Qwen3 and their MoE) shares;
    ``layer_types``: the kinds of layer the family converts (see ``refuse_layer_types``); ``partial_rotary``: its
    class reads ``partial_rotary_factor`` (see ``reference_rope``)."""
    refuse_layer_types(hf, layer_types)
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        # absent where every layer is sparse (Qwen3.5-MoE): the family sets it then
        **({"intermediate_size": hf.intermediate_size} if hasattr(hf, "intermediate_size") else {}),
        "num_hidden_layers": hf.num_hidden_layers,
        "max_position_embeddings": hf.max_position_embeddings,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads or hf.num_attention_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "attention_dropout": hf.attention_dropout,
        "rope_parameters": reference_rope(hf, partial_rotary),
        "hidden_act": hf.hidden_act,
        "rms_norm_eps": hf.rms_norm_eps,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "initializer_range": hf.initializer_range,
        # Qwen3-VL's text config class declares none of these (generation_config.json carries them)
        "bos_token_id": getattr(hf, "bos_token_id", None),
        "eos_token_id": getattr(hf, "eos_token_id", None),
        "pad_token_id": getattr(hf, "pad_token_id", None),
    }


SCALED_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")
# The RoPE type whose initialiser reads partial_rotary_factor into a whole head's table (zero frequencies past it).
WHOLE_HEAD_PARTIAL = ("proportional",)


def reference_rope(hf: PreTrainedConfig, partial_rotary: bool) -> dict[str, Any]:
    """``rope_parameters`` as the family's class runs them, which is not always as its config reads them:
    - the multimodal keys go only where the class reads them (``mrope_parameters``): a Qwen3-Next or Qwen3 config
      carrying an mrope_section rotates text positions alone;
    - a top-level ``original_max_position_embeddings`` (Phi-3's spelling) wins over the nested one for the scaled
      types that read it: transformers' initialisers standardise the parameters again as they compute, and give it
      that priority (``standardize_rope_params``);
    - a class that does not read ``partial_rotary_factor`` (Llama, Qwen2, Qwen3 and their MoE) rotates the whole
      head under the default type, whatever the config says; with a scaled type transformers sizes the table by it
      and its forward then fails, so such a config is no model to convert: refused by key (but "proportional",
      whose table spans the whole head, zero past the factor)."""
    rope = {key: value for key, value in hf.rope_parameters.items() if key not in MROPE_KEYS}
    rope_type = rope.get("rope_type", "default")
    if rope_type in SCALED_WITH_ORIGINAL_CONTEXT and getattr(hf, "original_max_position_embeddings", None) is not None:
        rope["original_max_position_embeddings"] = hf.original_max_position_embeddings
    if not partial_rotary and rope_type not in WHOLE_HEAD_PARTIAL:
        partial = rope.pop("partial_rotary_factor", None)
        if partial is not None and partial != 1 and rope_type != "default":
            raise ThinkerError(
                f"the source config's rope_parameters set partial_rotary_factor={partial} with rope_type "
                f"{rope_type!r}: transformers' {hf.model_type} class rotates the whole head but sizes a scaled RoPE's "
                "tables by that factor, so it cannot run this config (its forward fails); remove "
                "partial_rotary_factor, or set it to 1.0"
            )
    return rope


def moe_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """The Qwen-MoE routing fields; Thinker decides dense versus sparse layers by the same rule as Qwen."""
    return {
        "num_experts": hf.num_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "norm_topk_prob": hf.norm_topk_prob,
        "decoder_sparse_step": hf.decoder_sparse_step,
        "mlp_only_layers": list(hf.mlp_only_layers or []),
    } | router_loss_fields(hf)


def router_loss_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """The router's auxiliary loss: a training setting fine-tuned checkpoints keep. With output_router_logits, a
    labelled forward adds it to the loss, in the Thinker as in the source class."""
    return {
        "router_aux_loss_coef": hf.router_aux_loss_coef,
        "output_router_logits": bool(getattr(hf, "output_router_logits", False)),
    }


def hf_export_config(
    model_type: str,
    architecture: str,
    renamed: Mapping[str, str] | None = None,
    implied: Mapping[str, Any] | None = None,
    undeclared: Callable[[ThinkerConfig], dict[str, Any]] | None = None,
) -> Callable[[ThinkerConfig], dict[str, Any]]:
    """The way back for a family whose config speaks Thinker's (Qwen's) field names: every Thinker field the family's
    config class declares is carried over under the same name (or the one ``renamed`` gives); the rest are implied
    by the family, and ``implied`` sets those of its config's fields that it fixes and the Thinker has no field for
    (Qwen4-Exp's ``indexer_kv_heads``, always 1). ``undeclared`` gives keys the config class does not declare but
    keeps, as ``config.json`` may hold them, for this config (Qwen4-Exp's ``ngram_hash_vocab_size``). Whether the
    result really describes the same model is checked by the caller, which translates it forward again and compares
    (``converter.back``)."""

    def export(config: ThinkerConfig) -> dict[str, Any]:
        config_class = CONFIG_MAPPING[model_type]
        housekeeping = {"architectures", "dtype", "transformers_version"}
        accepted = {field.name for field in dataclasses.fields(config_class)} - housekeeping
        names = renamed or {}
        values = {names.get(key, key): value for key, value in config.to_dict().items()}
        kwargs = {key: value for key, value in values.items() if key in accepted} | dict(implied or {})
        # The Qwen2, Qwen2-MoE and Qwen3-MoE config classes do not declare head_dim, yet their attention reads it
        # (getattr(config, "head_dim", hidden_size // num_attention_heads)), and Qwen3-30B-A3B's config.json sets
        # it: carried where it is not that quotient, as such a config.json writes it.
        if "head_dim" not in accepted and config.head_dim != config.hidden_size // config.num_attention_heads:
            kwargs["head_dim"] = config.head_dim
        hf = config_class(**kwargs)
        hf.architectures = [architecture]
        hf.dtype = config.dtype
        # what save_pretrained writes: no defaults the source never had (id2label ...)
        return hf.to_diff_dict() | (undeclared(config) if undeclared else {})

    return export


def refuse_layer_types(hf: PreTrainedConfig, allowed: tuple[str, ...] = ("full_attention",)) -> None:
    """A checkpoint whose ``layer_types`` name layers the family's Thinker does not build (sliding-window attention,
    for one: Thinker attends over the full context) is another model; refused, naming the layers."""
    layer_types = getattr(hf, "layer_types", None) or []
    other = [index for index, kind in enumerate(layer_types) if kind not in allowed]
    if not other:
        if layer_types and not {"full_attention", "indexed_attention"} & set(layer_types):
            # transformers' caches count the context on an attention layer (get_seq_length); with none, the reference
            # class, and the Thinker built on the same caches, can run no forward with a cache, hence no generate().
            raise ThinkerError(
                f"the source config's layer_types has no full_attention layer ({len(layer_types)} x "
                f"{layer_types[0]}); transformers' {hf.model_type} classes cannot decode such a model (their cache "
                "needs an attention layer), so it is not a checkpoint of this family: check layer_types"
            )
        return
    shown = f"{other[:8]}{' ...' if len(other) > 8 else ''}"
    kinds = sorted({layer_types[index] for index in other})
    if kinds == ["sliding_attention"]:
        raise ThinkerError(
            f"the source config uses sliding-window attention on layers {shown} (use_sliding_window / layer_types), "
            "which Thinker does not implement; only full-attention checkpoints convert"
        )
    raise ThinkerError(
        f"the config has {', '.join(kinds)} layers {shown} (layer_types), which {hf.model_type} models do not have; "
        f"theirs are {', '.join(allowed)} layers"
    )


def refuse_sliding_window(hf: PreTrainedConfig) -> PreTrainedConfig:
    """For a family whose config has no ``layer_types`` and whose transformers class slides the attention window over
    every layer once ``use_sliding_window`` is set (Qwen3-MoE): such a checkpoint is refused as ``refuse_layer_types``
    refuses sliding layers. Returns ``hf``."""
    if getattr(hf, "use_sliding_window", False) and getattr(hf, "sliding_window", None):
        raise ThinkerError(
            f"the source config uses sliding-window attention on every layer (use_sliding_window, sliding_window "
            f"{hf.sliding_window}), which Thinker does not implement; only full-attention checkpoints convert"
        )
    return hf


# --- tensor groups ---------------------------------------------------------------------------------------------------

THINKER_LAYER = "model.layers.{layer}."  # the prefix of a decoder layer's tensors, in Thinker's names


def same_names(*names: str) -> tuple[TensorRule, ...]:
    """Rules that keep each listed name: the source already speaks Thinker's names."""
    return tuple(rule(name, name) for name in names)


def layer_names(*suffixes: str) -> tuple[TensorRule, ...]:
    """``same_names`` for tensors of every decoder layer: ``layer_names("mlp.gate.weight")``."""
    return same_names(*(THINKER_LAYER + suffix for suffix in suffixes))


EMBEDDINGS_AND_HEAD = same_names("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LAYER_NORMS = layer_names("input_layernorm.weight", "post_attention_layernorm.weight")
ATTENTION = layer_names(*(f"self_attn.{p}_proj.weight" for p in "qkvo"))
ATTENTION_BIASES = layer_names(*(f"self_attn.{p}_proj.bias" for p in "qkvo"))
QK_NORMS = layer_names("self_attn.q_norm.weight", "self_attn.k_norm.weight")
DENSE_MLP = layer_names(*(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
DENSE_MLP_BIASES = layer_names(*(f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")))
ROUTER = layer_names("mlp.gate.weight")
SHARED_EXPERT = layer_names(
    *(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")), "mlp.shared_expert_gate.weight"
)

# A Qwen-MoE layer's routed experts, from either layout on disk; the first whose tensors exist is used. Hub
# checkpoints store every expert's projections separately (``mlp.experts.{e}.gate_proj.weight``, and transformers 5
# writes them back that way by default); they are stacked into Thinker's fused 3-D tensors one layer at a time. A
# checkpoint saved with ``save_original_format=False`` is already fused and is copied.
_EXPERTS = THINKER_LAYER + "mlp.experts"
ROUTED_EXPERTS = (
    rule(
        (f"{_EXPERTS}.{{expert}}.gate_proj.weight", f"{_EXPERTS}.{{expert}}.up_proj.weight"),
        f"{_EXPERTS}.gate_up_proj",
        StackExperts(parts=2, dim=1),
    ),
    rule(f"{_EXPERTS}.{{expert}}.down_proj.weight", f"{_EXPERTS}.down_proj", StackExperts()),
    *same_names(f"{_EXPERTS}.gate_up_proj", f"{_EXPERTS}.down_proj"),
)

# Buffers that older transformers versions saved with the weights; they are recomputed from the config.
ROTARY_BUFFERS = (THINKER_LAYER + "self_attn.rotary_emb.inv_freq",)


# --- hybrid linear attention (Qwen3-Next and its descendants Qwen3.5 / Qwen3.6) -------------------------------------

HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")
# A Gated DeltaNet layer's tensors besides its input projections (which Qwen3-Next fuses differently).
GATED_DELTANET_STATE = layer_names(
    *(f"linear_attn.{name}" for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight"))
)
# Qwen3.5's layout, which is the Thinker's: one input projection per part, every head of the part together.
GATED_DELTANET = GATED_DELTANET_STATE + layer_names(
    *(f"linear_attn.in_proj_{part}.weight" for part in ("qkv", "z", "b", "a"))
)
# The vision-language layout of a decoder (Qwen3.5, Qwen3.6): the text model under ``model.language_model``.
VISION_LANGUAGE_LAYOUT = {"model.": "model.language_model."}
# What Qwen3.5's Hub checkpoints hold beside the text decoder: the vision tower and the multi-token-prediction head,
# which transformers' own classes skip on load too (``_keys_to_ignore_on_load_unexpected``).
VISION_AND_MTP_PREFIXES = ("model.visual.", "mtp.")


def hybrid_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """The Thinker switches of Qwen3-Next's decoder, which Qwen3.5 and Qwen3.5-MoE keep: ``layer_types`` with the
    Gated DeltaNet sizes, full attention with a sigmoid output gate and per-head q/k RMSNorm, and every RMSNorm
    weight stored zero-centred. transformers' classes hard-code the gate, the qk-norm and the centring."""
    gate = getattr(hf, "attn_output_gate", True)  # read by vLLM and written in Hub configs; transformers ignores it
    if gate is not True:
        raise ThinkerError(
            f"the source config sets attn_output_gate={gate!r}; transformers' {hf.model_type} classes always gate the "
            "attention output, so these weights do not describe one of its models"
        )
    return {
        "layer_types": list(hf.layer_types),
        "linear_conv_kernel_dim": hf.linear_conv_kernel_dim,
        "linear_key_head_dim": hf.linear_key_head_dim,
        "linear_value_head_dim": hf.linear_value_head_dim,
        "linear_num_key_heads": hf.linear_num_key_heads,
        "linear_num_value_heads": hf.linear_num_value_heads,
        "attention_bias": hf.attention_bias,
        "attention_output_gate": True,
        "qk_norm": True,
        "norm_zero_centered": True,
    }


MROPE_KEYS = ("mrope_section", "mrope_interleaved", "interleaved")


def mrope_parameters(hf: PreTrainedConfig, reference_section: list[int], interleaved: bool = True) -> dict[str, Any]:
    """``rope_parameters`` with the multimodal-RoPE keys as the Thinker reads them, matching the reference text
    models: each class lays its sections out one way whatever the config says (neither reads ``mrope_interleaved``
    / ``interleaved``): ``interleaved`` for Qwen3.5's, Qwen3-VL's and Qwen3-Omni's, in contiguous sections for
    Qwen2-VL's, Qwen2.5-VL's and Qwen2.5-Omni's; and uses ``reference_section`` when the config names none. That
    fallback is kept only when it covers the head's rotary frequencies; otherwise the config converts without one
    (exact on text, where the sections coincide; the Thinker then refuses 3-D positions rather than guess)."""
    # "type": rope_type's old spelling ("mrope" in the Hub's Qwen2-VL configs), which transformers keeps beside it
    legacy = ("type",) if "rope_type" in hf.rope_parameters else ()
    rope = {key: value for key, value in hf.rope_parameters.items() if key not in MROPE_KEYS + legacy}
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rotary_pairs = (int(head_dim * rope.get("partial_rotary_factor", 1.0)) + 1) // 2  # as ThinkerConfig counts them
    section = hf.rope_parameters.get("mrope_section")
    if section is None and sum(reference_section) == rotary_pairs:
        section = list(reference_section)
    if section is None:
        return rope
    return rope | {"mrope_section": list(section), "mrope_interleaved": interleaved}


def reference_by_model_type(classes: Mapping[str, str]) -> ReferenceLoader:
    """A parity reference that follows the checkpoint's ``model_type``: transformers' class named in ``classes`` for
    those types (a vision-language model, run on text), ``AutoModelForCausalLM`` for the others."""

    def load(source: Path, dtype: Any) -> Any:
        import transformers

        from ..layer_parity import refuse_other_weights_file
        from ..parity import load_reference

        refuse_other_weights_file(source)
        folder = source.parent if source.is_file() else source
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None  # load_reference reports what is wrong with the folder
        if model_type not in classes:
            return load_reference(folder, dtype)
        try:
            model = getattr(transformers, classes[model_type]).from_pretrained(folder, dtype=dtype, **EAGER)
        except Exception as err:  # as parity.load_reference: whatever the folder makes transformers raise
            raise ThinkerError(f"{folder}: the reference {classes[model_type]} does not load ({err})") from None
        return model.eval()

    return load


def layered_reference_by_model_type(classes: Mapping[str, str]) -> LayeredReferenceLoader:
    """``reference_by_model_type`` for parity layer by layer: the same class for the same ``model_type``, built on the
    meta device and read one layer at a time (``converter.layer_parity.load_layered_reference``)."""

    def load(source: Path, dtype: Any) -> Any:
        import transformers

        from ..layer_parity import load_layered_reference

        folder = source.parent if source.is_file() else source
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None  # load_layered_reference reports what is wrong with the folder
        model_class = getattr(transformers, classes[model_type]) if model_type in classes else None
        return load_layered_reference(source, dtype, model_class)

    return load


# --- a Hugging Face family from its differences -------------------------------------------------------------------


def hf_family(
    model_types: str | tuple[str, ...],
    architectures: str | tuple[str, ...],
    description: str,
    groups: Sequence[tuple[TensorRule, ...]],
    fields: Callable[[PreTrainedConfig], dict[str, Any]] = lambda hf: {},
    *,
    name: str | None = None,
    moe: bool = False,
    decoder_config: Callable[[PreTrainedConfig], PreTrainedConfig] | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
    partial_rotary: bool = False,
    layouts: Sequence[Mapping[str, str]] = ({},),
    dropped: tuple[str, ...] = (),
    dropped_prefixes: tuple[str, ...] = (),
    reference: ReferenceLoader | None = None,
    layered_reference: LayeredReferenceLoader | None = None,
    way_back: bool = True,
    renamed_fields: Mapping[str, str] | None = None,
    implied_fields: Mapping[str, Any] | None = None,
    undeclared_fields: Callable[[ThinkerConfig], dict[str, Any]] | None = None,
    check_source: SourceCheck | None = None,
    derived_back: DerivedTensors | None = None,
    layer_count_keys: tuple[str, ...] = ("num_hidden_layers",),
    expert_count_keys: tuple[str, ...] = ("num_experts", "num_local_experts"),
    tie_key: str = "tie_word_embeddings",
) -> Family:
    """A family whose checkpoints transformers writes (``config.json`` with ``model_type``), by what sets it apart.

    - ``model_types`` / ``architectures``: transformers' config type(s) and model class(es) (``"qwen3"``,
      ``"Qwen3ForCausalLM"``); any of them recognises the family, the config is read by the config class of its
      own model_type, and the way back writes the first of each. Several when one decoder is saved both alone and
      inside a larger model (``("qwen3_5_text", "qwen3_5")``).
    - ``groups``: the tensor groups its checkpoints hold (``EMBEDDINGS_AND_HEAD``, ``ATTENTION``, ...), in Thinker's
      names; ``moe`` adds the routing fields (and ``ROUTED_EXPERTS`` belongs in ``groups``).
    - ``fields``: what the family's config sets beyond ``decoder_fields`` (and ``moe_fields``), from the decoder's
      config: ``lambda hf: {"qk_norm": True, "attention_bias": hf.attention_bias}``.
    - ``decoder_config``: the text decoder's config within the family's config; default: ``text_decoder_config``
      (the config itself, or a vision-language config's ``text_config`` with the outer config's tie setting).
    - ``layer_types``: the kinds of layer (the config's ``layer_types``) the family converts; a checkpoint with
      others is refused. Full attention only, unless the family says more (``("full_attention", "linear_attention")``).
    - ``partial_rotary``: the family's class rotates the first ``partial_rotary_factor`` of each head (Qwen3.5,
      Qwen3-Next); others rotate the whole head whatever their config says (``reference_rope``).
    - ``layouts``: where the decoder's tensors sit in the checkpoint, as prefix renames from Thinker's names to the
      source's (``{"": "thinker."}``, ``{"model.": "model.language_model."}``); several layouts are alternatives and
      the engine uses the one present. ``dropped`` names tensors skipped on purpose (in Thinker's names, like the
      groups), ``dropped_prefixes`` whole sub-models skipped by source prefix (a vision tower, ``mtp.``).
    - ``reference``: the parity reference when it is not ``AutoModelForCausalLM`` (a sub-model), and
      ``layered_reference`` the same for parity layer by layer (``converter/layer_parity.py``), which otherwise
      builds the class ``AutoModelForCausalLM`` picks and reads the folder's tensors one layer at a time.
    - ``way_back``: a Thinker folder can be written back as this family (``--to``); ``renamed_fields`` names the
      config fields the family spells differently from Thinker (``{"attention_bias": "qkv_bias"}``), and
      ``implied_fields`` the values of fields its config has and the Thinker's has not, ``undeclared_fields`` the
      keys its config class does not declare that this config needs (``hf_export_config``).
    - ``check_source``, ``derived_back``: see ``Family``.
    - ``layer_count_keys`` / ``expert_count_keys``: the config keys (at any depth) holding layer and expert counts,
      bounded by the checkpoint's size before a config class builds anything from them (``Family``).
    - ``tie_key``: where the config sets the head's tie (``Family``).
    """

    model_types = (model_types,) if isinstance(model_types, str) else tuple(model_types)
    architectures = (architectures,) if isinstance(architectures, str) else tuple(architectures)

    def translate_config(source: Mapping[str, Any]) -> dict[str, Any]:
        declared = source.get("model_type")
        model_type = declared if declared in model_types else model_types[0]
        refuse_missing_decoder_config(source, model_type)
        hf = load_hf_config(source, model_type)
        decoder = (decoder_config or text_decoder_config)(hf)
        common = decoder_fields(decoder, layer_types, partial_rotary)
        return common | (moe_fields(decoder) if moe else {}) | fields(decoder)

    tensors = tuple(under(layout, entry) for layout in layouts for entry in (e for group in groups for e in group))
    return Family(
        name=name or model_types[0],
        description=description,
        model_types=model_types,
        architectures=architectures,
        tensor_hints=tuple(renamed(layout, "model.embed_tokens.weight") for layout in layouts),
        translate_config=translate_config,
        tensors=tensors,
        dropped=tuple(renamed(layout, entry) for layout in layouts for entry in dropped),
        dropped_prefixes=dropped_prefixes,
        head=renamed(layouts[0], "lm_head.weight"),
        other_heads=tuple(renamed(layout, "lm_head.weight") for layout in layouts[1:]),
        reference=reference,
        layered_reference=layered_reference,
        check_source=check_source,
        derived_back=derived_back,
        export_config=(
            hf_export_config(model_types[0], architectures[0], renamed_fields, implied_fields, undeclared_fields)
            if way_back
            else None
        ),
        layer_count_keys=layer_count_keys,
        expert_count_keys=expert_count_keys,
        tie_key=tie_key,
    )


def renamed(layout: Mapping[str, str], name: str) -> str:
    """``name`` (a Thinker name) as the source spells it under ``layout``: the longest matching prefix replaced."""
    for prefix in sorted(layout, key=len, reverse=True):
        if name.startswith(prefix):
            return layout[prefix] + name[len(prefix) :]
    return name


def under(layout: Mapping[str, str], entry: TensorRule) -> TensorRule:
    """The rule with its source names as ``layout`` spells them."""
    return dataclasses.replace(entry, sources=tuple(renamed(layout, name) for name in entry.sources))
