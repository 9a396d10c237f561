"""Qwen3-Next (``model_type: qwen3_next``), as transformers' ``Qwen3NextForCausalLM`` (models/qwen3_next) writes it.

The hybrid decoder Qwen3.5 descends from (``common.hybrid_fields``): Gated DeltaNet linear attention in most layers
(``layer_types``, by default three in four), full attention with a sigmoid output gate and q/k RMSNorm in the rest,
zero-centred RMSNorm weights, partial rotary (0.25, plain RoPE: no multimodal sections), and Qwen-MoE feed-forward
layers: routed experts (per expert on the Hub, or fused 3-D) with a gated shared expert, ``norm_topk_prob``, dense
layers where ``decoder_sparse_step`` / ``mlp_only_layers`` say.

Its Gated DeltaNet fuses the input projections and groups their rows per key head: ``in_proj_qkvz`` holds, for each
key head in turn, its query and key rows and the value and gate (z) rows of the value heads it serves;
``in_proj_ba`` the b and a rows of those value heads (``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``). The
Thinker keeps Qwen3.5's split ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; the declared
operation ``ops.SplitHeadGroups`` reorders the rows (and ``JoinHeadGroups`` restores them on the way back). The conv
weight already lists its channels as [all q | all k | all v] and is copied.

Dropped by prefix: the multi-token-prediction head ``mtp.*`` (speculative decoding; transformers skips it on load).
Parity reference: ``Qwen3NextForCausalLM``. The way back: ``--to qwen3_next``.
"""

from __future__ import annotations

from thinker import ThinkerConfig

from ..ops import SplitHeadGroups
from ..spec import rule
from .common import (
    ATTENTION,
    ATTENTION_BIASES,
    DENSE_MLP,
    EMBEDDINGS_AND_HEAD,
    GATED_DELTANET_STATE,
    HYBRID_LAYER_TYPES,
    LAYER_NORMS,
    QK_NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERT,
    THINKER_LAYER,
    hf_family,
    hybrid_fields,
)


def qkvz_groups(config: ThinkerConfig) -> tuple[int, tuple[int, ...]]:
    """Per key head: q (key head size), k (key head size), then v and z for each value head it serves."""
    per_key_head = config.linear_num_value_heads // config.linear_num_key_heads
    key, value = config.linear_key_head_dim, per_key_head * config.linear_value_head_dim
    return config.linear_num_key_heads, (key, key, value, value)


def ba_groups(config: ThinkerConfig) -> tuple[int, tuple[int, ...]]:
    """Per key head: b, then a, one row for each value head it serves."""
    per_key_head = config.linear_num_value_heads // config.linear_num_key_heads
    return config.linear_num_key_heads, (per_key_head, per_key_head)


_LINEAR = THINKER_LAYER + "linear_attn."
FUSED_PROJECTIONS = (
    rule(
        _LINEAR + "in_proj_qkvz.weight",
        (_LINEAR + "in_proj_qkv.weight", _LINEAR + "in_proj_z.weight"),
        SplitHeadGroups(qkvz_groups, outputs=(3, 1)),  # [q | k | v] and [z]
    ),
    rule(
        _LINEAR + "in_proj_ba.weight",
        (_LINEAR + "in_proj_b.weight", _LINEAR + "in_proj_a.weight"),
        SplitHeadGroups(ba_groups, outputs=(1, 1)),
    ),
)

QWEN3_NEXT = hf_family(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    "Qwen3-Next (hybrid Gated DeltaNet, fused per-key-head projections, MoE with shared expert)",
    (EMBEDDINGS_AND_HEAD, LAYER_NORMS, ATTENTION, ATTENTION_BIASES, QK_NORMS, GATED_DELTANET_STATE)
    + (FUSED_PROJECTIONS, DENSE_MLP, ROUTER, SHARED_EXPERT, ROUTED_EXPERTS),
    lambda hf: hybrid_fields(hf) | {"shared_expert_intermediate_size": hf.shared_expert_intermediate_size},
    moe=True,
    layer_types=HYBRID_LAYER_TYPES,
    partial_rotary=True,
    dropped_prefixes=("mtp.",),
)
