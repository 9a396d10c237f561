"""Qwen3.8 (``model_type: qwen4_exp_text`` / ``qwen4_exp``), as transformers' ``Qwen4ExpForCausalLM`` and
``Qwen4ExpForConditionalGeneration`` (models/qwen4_exp, transformers 5.24) write them.

Qwen3.5-MoE's hybrid decoder (Gated DeltaNet and gated attention, zero-centred norms, interleaved mRoPE, every layer
sparse with a gated shared expert; routing renormalised by ``norm_topk_prob``), with three additions, each a Thinker
switch of the same name:
- hyper-connections (``hc_count`` streams, ``{attn,mlp}_hyper_connection`` per layer and a final
  ``hyper_connection_mixer``) in place of the layer norms and the final norm;
- the QSA indexer (``self_attn.indexer.*``) on the attention layers, which Qwen4-Exp calls ``indexed_attention``
  (a config's ``full_attention`` entries are read so, as its config class reads them);
- per-layer embeddings of hashed token n-grams (``ple.*``) on the linear-attention layers in ``ple_layer_ids``.

Its defaults differ from Qwen3.5's: the whole head rotates unless ``partial_rotary_factor`` says otherwise, and the
gated norm's activation is ``output_gate_type``, else ``hidden_act``.

On disk, each n-gram table is ``split_ngram_parts`` pieces (``ngram_embedding.shard_{i}.weight``, transformers'
layout: its loading joins them, its saving cuts them with ``torch.chunk``), joined here into the Thinker's one table
(``ops.JoinParts``; the way back cuts it again); a table saved whole is copied. The tables' hash buffers
(``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``) are dropped by name: the Thinker
derives them from the config (``seed``, the primes above ``ngram_vocab_size_base``, and the vocabulary the
multipliers were drawn for: ``vocab_size``, or ``ngram_hash_vocab_size`` where the config names it), and a stored one
that differs (a vocabulary resized after the hash was drawn, which transformers' ``resize_token_embeddings`` allows,
or an edited config) is refused by name before anything is written (``check_hash_buffers``), since the reference runs
the stored ones. The way back writes them again, derived (``hash_buffers_back``), as transformers saves them.
Layouts, drops (vision tower, ``mtp.*``) and the way back (causal-LM layout, experts per expert, the tables in
pieces) are those of ``qwen3_5_moe``.

Sizes: at Qwen4-Exp's defaults a PLE layer's table has 320 million rows (41e9 weights, in 512 pieces); the engine
writes each piece in its place in the output (``engine.piece_by_piece``), so a conversion holds one piece, never a
whole table. Verifying still holds one (layer by layer, a PLE layer's unit includes its table).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig

from thinker import ThinkerConfig
from thinker.modeling_thinker import ngram_hash_buffers
from thinker_common.errors import ThinkerError
from thinker_common.sources import TensorSource

from ..ops import JoinParts
from ..spec import rule
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    EMBEDDINGS_AND_HEAD,
    GATED_DELTANET,
    QK_NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERT,
    THINKER_LAYER,
    VISION_AND_MTP_PREFIXES,
    VISION_LANGUAGE_LAYOUT,
    hf_family,
    hybrid_fields,
    layer_names,
    layered_reference_by_model_type,
    mrope_parameters,
    reference_by_model_type,
    renamed,
    same_names,
)
from .qwen3_5 import REFERENCE_MROPE_SECTION
from .qwen3_5_moe import every_layer_sparse

LAYER_TYPES = ("linear_attention", "indexed_attention")
_MIXER = ("hc_norm.weight", "input_mix_weight_down.weight", "input_mix_weight_up.weight")
_INJECT = ("block_inject_weight.weight",)
HYPER_CONNECTIONS = layer_names(
    *(f"{sublayer}_hyper_connection.{part}" for sublayer in ("attn", "mlp") for part in _MIXER + _INJECT)
) + same_names(*(f"model.hyper_connection_mixer.{part}" for part in _MIXER))
INDEXER = layer_names(*(f"self_attn.indexer.{name}.weight" for name in ("index_qk_proj", "q_layernorm", "k_layernorm")))
_NGRAM_TABLE = THINKER_LAYER + "ple.ple_embedding.ngram_embedding"
PLE = layer_names(
    *(f"ple.{name}.weight" for name in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d"))
) + (
    rule(f"{_NGRAM_TABLE}.shard_{{part}}.weight", f"{_NGRAM_TABLE}.weight", JoinParts()),
    *same_names(f"{_NGRAM_TABLE}.weight"),
)
# The hash's buffers, which transformers saves with the weights, by the Thinker's names for them: derived from the
# config by the Thinker.
HASH_BUFFERS = {
    "multipliers": "layer_multipliers",
    "table_sizes": "ngram_heads_vocab_sizes",
    "table_offsets": "ngram_heads_offsets",
}
LAYOUTS = ({}, VISION_LANGUAGE_LAYOUT)


def qwen4_exp_fields(hf: PreTrainedConfig) -> dict[str, Any]:
    """What Qwen4-Exp adds to Qwen3.5-MoE's switches, field by field (the same names but ``seed``)."""
    same = (
        "hc_count hc_lowrank indexer_n_heads indexer_head_dim indexer_budget indexer_compress_ratio ple_layer_ids "
        "ple_embed_dim ple_conv_kernel_size ngram_size heads_per_ngram ngram_vocab_size_base "
        "make_ngram_vocab_size_divisible_by split_ngram_parts norm_topk_prob"
    ).split()
    return {name: getattr(hf, name) for name in same} | {
        "ngram_seed": hf.seed,
        "ngram_hash_vocab_size": getattr(hf, "ngram_hash_vocab_size", None) or hf.vocab_size,
        "output_gate_type": hf.output_gate_type or hf.hidden_act,
    }


def hash_vocabulary(config: ThinkerConfig) -> dict[str, Any]:
    """The way back's ``ngram_hash_vocab_size``, which Qwen4-Exp's config class does not declare: written where the
    hash was drawn for another vocabulary than the model's (one resized since), as the source's config.json held it."""
    if config.ngram_hash_vocab_size in (None, config.vocab_size):
        return {}
    return {"ngram_hash_vocab_size": config.ngram_hash_vocab_size}


def hash_buffer_prefix(layer: int) -> str:
    """Where the source keeps a PLE layer's hash buffers (``ple_layer_ids`` count layers from 1), in Thinker's
    names (the causal-LM layout)."""
    return f"model.layers.{layer - 1}.ple.ple_embedding."


def hash_buffers_back(config: ThinkerConfig) -> dict[str, torch.Tensor]:
    """The hash buffers transformers saves with the weights, for the way back: derived, as the Thinker derives them."""
    return {
        hash_buffer_prefix(layer) + theirs: ngram_hash_buffers(config, ple_index)[ours]
        for ple_index, layer in enumerate(config.ple_layer_ids)
        for ours, theirs in HASH_BUFFERS.items()
    }


def check_hash_buffers(config: ThinkerConfig, source: TensorSource) -> None:
    """Each stored hash buffer holds what the Thinker derives from the config (small integer tensors, read whole).
    Its values are compared, not its dtype: transformers loads a float buffer into its int64 one, so a float32 copy of
    small integers is the same model; one that rounded a large multiplier (past 2^24) is not, and is refused."""
    names = set(source.names())
    for ple_index, layer in enumerate(config.ple_layer_ids):
        for ours, theirs in HASH_BUFFERS.items():
            expected = ngram_hash_buffers(config, ple_index)[ours]
            for name in {renamed(layout, hash_buffer_prefix(layer) + theirs) for layout in LAYOUTS} & names:
                stored = source.load(name)
                whole = stored.dtype != torch.bool and not (stored.is_floating_point() and stored.frac().any())
                if whole and stored.shape == expected.shape and torch.equal(stored.long(), expected):
                    continue
                what = f"{str(stored.dtype).removeprefix('torch.')} {stored.tolist()}"
                raise ThinkerError(
                    f"{source.file_of(name)}: tensor {name!r} ({what}) is not the n-gram hash the config implies "
                    f"(int64 {expected.tolist()}, from vocab_size / ngram_hash_vocab_size "
                    f"{config.ngram_hash_vocab_size}, seed {config.ngram_seed}, ngram_vocab_size_base "
                    f"{config.ngram_vocab_size_base}); the Thinker derives it, transformers runs the stored one. If "
                    'the vocabulary was resized after the hash was drawn, add "ngram_hash_vocab_size": the size '
                    "before, to config.json; otherwise the config or the tensor was edited"
                )


QWEN4_EXP = hf_family(
    ("qwen4_exp_text", "qwen4_exp"),
    ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"),
    "Qwen3.8 (hyper-connections, a sparse-attention indexer, hashed n-gram embeddings; causal-LM or vision-language "
    "layout)",
    (EMBEDDINGS_AND_HEAD, ATTENTION, ATTENTION_BIASES, QK_NORMS, GATED_DELTANET, ROUTER, SHARED_EXPERT)
    + (ROUTED_EXPERTS, INDEXER, HYPER_CONNECTIONS, PLE),
    lambda hf: (
        hybrid_fields(hf)
        | every_layer_sparse(hf)
        | qwen4_exp_fields(hf)
        | {"rope_parameters": mrope_parameters(hf, REFERENCE_MROPE_SECTION)}
    ),
    name="qwen4_exp",
    layer_types=LAYER_TYPES,
    partial_rotary=True,
    layouts=LAYOUTS,
    dropped=tuple(f"{THINKER_LAYER}ple.ple_embedding.{name}" for name in HASH_BUFFERS.values()),
    dropped_prefixes=VISION_AND_MTP_PREFIXES,
    reference=reference_by_model_type({"qwen4_exp": "Qwen4ExpForConditionalGeneration"}),
    layered_reference=layered_reference_by_model_type({"qwen4_exp": "Qwen4ExpForConditionalGeneration"}),
    renamed_fields={"ngram_seed": "seed"},
    implied_fields={"indexer_kv_heads": 1},  # Qwen4-Exp's indexer has one key head; its config requires 1
    undeclared_fields=hash_vocabulary,
    check_source=check_hash_buffers,
    derived_back=hash_buffers_back,
)
