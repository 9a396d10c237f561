# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""Thinker: one decoder-only transformer that every Qwen-style checkpoint converts into.

Features, each a config switch (see ``ThinkerConfig``):
  - RMSNorm computed in float32 (Qwen3), with weights stored as offsets from one if zero-centred (Qwen3.5,
    Qwen3-Next), or LayerNorm with bias (GPT-2)
  - RoPE with every scaling type of transformers' ``ROPE_INIT_FUNCTIONS``, partial rotary, or learned absolute
    positions; multimodal RoPE (interleaved: Qwen3-VL, Qwen3.5, Qwen3-Omni; in sections: Qwen2-VL, Qwen2.5-Omni)
    from ``(3|4, B, T)`` position_ids
  - multi-head, grouped-query and multi-query attention; ``head_dim`` independent of ``hidden_size``
  - q/k/v and output biases (Qwen2, GPT-2), per-head q/k RMSNorm (Qwen3), a sigmoid output gate (Qwen3.5)
  - hybrid token mixers per layer (``layer_types``): full attention or Gated DeltaNet linear attention (a causal
    depthwise conv, the gated delta rule over a recurrent state, a gated RMSNorm; Qwen3.5, Qwen3-Next), with
    transformers' own kernels (chunked prefill, one-step decode) and its linear-attention cache layers
  - Qwen3.8's (qwen4_exp) additions: hyper-connections (several residual streams, mixed into each sub-layer's input
    and written back with learned weights, in place of the layer norms), a sparse-attention indexer choosing, per
    query, the blocks of keys an ``indexed_attention`` layer attends to, and per-layer embeddings of hashed token
    n-grams (PLE) gated into the streams of some linear-attention layers
  - SwiGLU or plain GELU MLP, with or without bias
  - Mixture of Experts with Qwen's routing (softmax, top-k, optional renormalisation), fused 3-D expert weights
    (only the chosen experts run, eagerly or under ``torch.compile(fullgraph=True)``), transformers' experts
    implementations (grouped_mm, batched_mm), an optional shared expert behind a sigmoid gate (Qwen2-MoE), dense
    layers picked by ``decoder_sparse_step`` and ``mlp_only_layers``
  - tied embeddings; ``inputs_embeds`` for multimodal input, an audio projection and a talker head (Qwen3-Omni)
  - sequence-classification, token-classification and question-answering heads (transformers' generic ones)
  - transformers 5.x plumbing: ``Cache`` objects, the attention-function registry (eager, sdpa, flash, flex),
    transformers' mask builders, ``generate()`` (static caches and compiled decoding too), gradient checkpointing,
    tensor-, expert- and pipeline-parallel plans

This file is shipped beside converted checkpoints as remote code, so it imports only torch, transformers and
its own configuration module. (No ``from __future__ import annotations``: transformers reads the forward methods'
return annotations as classes, to know which outputs a head declares.)
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation, use_kernel_forward_from_hub, use_kernelized_func
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

# The Gated DeltaNet kernels: transformers' torch fallbacks, which defer to hub kernels or the fla / causal-conv1d
# packages when those are installed, exactly as for Qwen3.5 and Qwen3-Next. Imported rather than re-derived so that
# the numerics are the reference's by construction; qwen3_next is the module that has held them in every 5.x.
from transformers.models.qwen3_next.modeling_qwen3_next import (
    apply_mask_to_padding_states,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_thinker import ThinkerConfig, mrope_interleaved

# transformers 5.24 renamed the cache, as an argument of forward() and the mask builders and as an output field, from
# ``past_key_values`` to ``cache`` (the old name still works there, with a deprecation warning). The model passes and
# returns it under the installed version's name, and its forwards take either name, so callers of both eras work.
CACHE_ARG = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# From 5.24 the old name is a deprecated alias, renamed with its warning by transformers' own decorator, as its models
# take it; before, it is the name generate() passes, taken as it is.
if CACHE_ARG == "cache":
    takes_old_cache_name = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
else:

    def takes_old_cache_name(forward: Callable) -> Callable:
        return forward


def either_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache a forward was given, under its transformers 5.24 name or the one before."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def computed_in(dtype: torch.dtype) -> torch.dtype:
    """What the norms, softmaxes, decays and recurrences compute in for a model running in ``dtype``: float32, as
    transformers' Qwen code computes them whatever the model's dtype, or ``dtype`` where wider. So a model run in
    float64 (export/verify.py's second opinion on a float32 graph) keeps float64 throughout, where transformers' own
    casts would round each norm and softmax to float32 (and its float32 softmax turns a float64 mask's fully masked
    row, a left pad's, into NaN)."""
    return torch.promote_types(dtype, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# norms


class ThinkerRMSNorm(nn.Module):
    """RMSNorm in float32 (``computed_in``). Plain: cast back, then scale by ``w`` (Qwen3's and Llama's order of
    operations). Zero-centred: scale by ``1 + w`` in float32, then cast (Qwen3.5's, Qwen3-Next's and Gemma's order);
    the weight is kept as the checkpoint stores it, so conversions stay bit-exact both ways."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False, group_size: int | None = None) -> None:
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.variance_epsilon = eps
        self.group_size = group_size  # set: each group of this many channels normalised on its own (one per stream)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(computed_in(input_dtype))
        if self.group_size is not None:
            x = x.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.group_size is not None:
            x = x.flatten(-2)
        if self.zero_centered:
            return (x * (1.0 + self.weight.to(x.dtype))).to(input_dtype)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        centred = ", zero_centered=True" if self.zero_centered else ""
        grouped = f", group_size={self.group_size}" if self.group_size else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{centred}{grouped}"


@use_kernel_forward_from_hub("RMSNormGated")  # the hub kernel transformers offers for Qwen3.5's gated norm
class ThinkerRMSNormGated(nn.Module):
    """The Gated DeltaNet's output norm: RMSNorm in float32 (``computed_in``) with a plain weight (not
    zero-centred), then times ``act(gate)`` in float32, ``act`` silu (Qwen3.5, Qwen3-Next) or sigmoid (a Qwen4-Exp
    setting); Qwen3NextRMSNormGated's order of operations."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.activation = activation
        self.act_fn = ACT2FN[activation]

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(computed_in(input_dtype))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight * x.to(input_dtype)
        return (x * self.act_fn(gate.to(computed_in(input_dtype)))).to(input_dtype)


def make_norm(config: ThinkerConfig, dim: int, group_size: int | None = None) -> nn.Module:
    if config.norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=config.rms_norm_eps)
    return ThinkerRMSNorm(dim, eps=config.rms_norm_eps, zero_centered=config.norm_zero_centered, group_size=group_size)


# ----------------------------------------------------------------------------------------------------------------
# rotary position embedding


def mrope_streams(mrope_section: list[int], interleaved: bool = True) -> torch.Tensor:
    """(rotary_dim / 2,) int64: which position stream (0 temporal, 1 height, 2 width) each RoPE frequency reads under
    multimodal RoPE with ``mrope_section`` [t, h, w] frequencies. Interleaved (Qwen3-VL, Qwen3.5, Qwen3-Omni):
    frequency ``i`` reads height when ``i % 3 == 1`` and ``i < 3 * h``, width when ``i % 3 == 2`` and ``i < 3 * w``,
    temporal otherwise (Qwen3VLTextRotaryEmbedding's layout). Not interleaved (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni):
    the first t frequencies temporal, the next h height, the last w width (Qwen2VLRotaryEmbedding's sections). The
    ONNX export gathers its tables by the same streams."""
    if interleaved:
        streams = torch.zeros(sum(mrope_section), dtype=torch.int64)  # temporal unless overwritten
        for row in (1, 2):
            streams[row : 3 * mrope_section[row] : 3] = row
        return streams
    return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))


class ThinkerRotaryEmbedding(nn.Module):
    """cos/sin tables for the half-split rotation; frequencies come from transformers' RoPE initialisers.

    Multimodal RoPE (``rope_parameters["mrope_section"]``): given (3, B, T) temporal/height/width positions, each
    frequency reads the stream ``mrope_streams`` gives it, in the interleaved layout or, with ``mrope_interleaved``
    False, in contiguous sections. (B, T) positions are the text case, where all three coincide.
    """

    inv_freq: torch.Tensor

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.mrope_section = config.rope_parameters.get("mrope_section")
        self.mrope_interleaved = mrope_interleaved(config.rope_parameters)

    @staticmethod
    def compute_default_rope_parameters(config: ThinkerConfig, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        # transformers keeps the unscaled initialiser on each model class rather than in ROPE_INIT_FUNCTIONS.
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
        )
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update  # recomputes inv_freq for the "dynamic" and "longrope" types as the context grows
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)  # ([3,] B, T, rot/2)
        if position_ids.ndim == 3:
            freqs = self.select_sections(freqs)  # (B, T, rot/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, rot)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def select_sections(self, freqs: torch.Tensor) -> torch.Tensor:
        """(B, T, rot/2) from the (3, B, T, rot/2) frequencies of the three streams, each frequency its own stream's."""
        if self.mrope_section is None:
            raise ValueError(
                "position_ids of shape (3, B, T) or (4, B, T) need multimodal RoPE; rope_parameters has no "
                "mrope_section"
            )
        streams = mrope_streams(self.mrope_section, self.mrope_interleaved).to(freqs.device)
        return freqs.gather(0, streams.expand(1, *freqs.shape[1:]))[0]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, rot): broadcast over heads
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of ``x`` (all of them but with partial_rotary_factor, or in the
    indexer's wider heads); ``cos`` / ``sin`` broadcast against ``x``."""
    rot = cos.shape[-1]  # the tail of each head past it passes through unrotated
    if rot < x.shape[-1]:
        x, x_pass = x.split([rot, x.shape[-1] - rot], -1)
        return torch.cat((x * cos + rotate_half(x) * sin, x_pass), -1)
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------------------------
# attention


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (B, nh, T, hs)
    key: torch.Tensor,  # (B, n_kv, S, hs)
    value: torch.Tensor,  # (B, n_kv, S, hs)
    attention_mask: torch.Tensor | None,  # additive (B, 1, T, S)
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    # The registry's fallback when no fused kernel is asked for; written out so that attention weights can be
    # returned (output_attentions) and the reference order of operations (softmax in fp32) is explicit.
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)  # (B, nh, S, hs)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, nh, T, S)
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=computed_in(query.dtype)).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, nh, hs)
    return out, weights


class ThinkerQSAIndexer(nn.Module):
    """Qwen4-Exp's QSA indexer: which key slots each query of an ``indexed_attention`` layer may attend to.

    Per query, the visible slots (causal and padding mask) are cut, in order, into blocks of ``compress_ratio``; a
    block's key is the mean of its raw index keys (float32), RMS-normed, rotated at its first slot's position; a
    block scores ``sum over index heads of relu(q_h . k_block) / sqrt(head_dim)``; the best ``budget //
    compress_ratio`` complete blocks are kept, with the slots of the unfinished last block. Raw keys (unnormed,
    unrotated) are cached per slot; blocks are pooled afresh each step, as the reference pools them.
    """

    def __init__(self, config: ThinkerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.indexer_n_heads, config.indexer_head_dim
        self.compress_ratio, self.budget = config.indexer_compress_ratio, config.indexer_budget
        # the query heads' rows, then one key head's (Qwen4-Exp's single index key head)
        self.index_qk_proj = nn.Linear(config.hidden_size, (self.num_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = make_norm(config, self.head_dim)
        self.k_layernorm = make_norm(config, self.head_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, S, C)
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin of every slot: (B, T, rot)
        attention_mask: torch.Tensor,  # (B, 1, S, T): bool (True = visible) or additive float
        cache: Cache | None,
    ) -> torch.Tensor:  # (B, 1, S, T) bool: the slots each query keeps
        batch, seq, _ = hidden_states.shape
        cos, sin = (table.expand(batch, -1, -1) for table in position_embeddings)  # one row may serve every row
        q, raw_keys = self.index_qk_proj(hidden_states).split([self.num_heads * self.head_dim, self.head_dim], -1)
        q = self.q_layernorm(q.view(batch, seq, self.num_heads, self.head_dim))  # (B, S, In, Id)
        q = rotate(q, cos[:, -seq:, None], sin[:, -seq:, None])
        if cache is not None:
            raw_keys = cache.update_indexer(raw_keys, self.layer_idx)  # (B, T, Id)
        visible = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
        selected = qsa_selection(q, raw_keys, visible, cos, sin, self.k_layernorm, self.compress_ratio, self.budget)
        return selected[:, None]


# How an indexer picks among blocks of exactly equal scores (relu zeroes every head's product for several blocks):
# "torch", torch.topk's choice, which transformers' Qwen4-Exp takes (on the CPU from four blocks on it follows no
# fixed rule: four blocks scoring 0 keep blocks 2 and 3, five keep 2 and 4, torch 2.13); "lowest", the earlier
# blocks, a rule any runtime can follow (ONNX's TopK's), which ``lowest_block_wins_ties`` sets for a comparison.
_INDEX_TIES = {"rule": "torch"}


@contextmanager
def lowest_block_wins_ties() -> Iterator[None]:
    """Inside the ``with`` statement, an indexer's exact ties between key blocks go to the earlier blocks, as ONNX's
    TopK breaks them (the ONNX export's checks compare against the Thinker so): transformers' choice among equal
    scores is torch.topk's implementation, a runtime's is its own, and the model does not say which is right."""
    previous, _INDEX_TIES["rule"] = _INDEX_TIES["rule"], "lowest"
    try:
        yield
    finally:
        _INDEX_TIES["rule"] = previous


def qsa_selection(
    query: torch.Tensor,  # (B, S, In, Id), normed and rotated
    raw_keys: torch.Tensor,  # (B, T, Id)
    visible: torch.Tensor,  # (B, S, T) bool
    cos: torch.Tensor,  # (B, T, rot)
    sin: torch.Tensor,
    key_norm: nn.Module,
    ratio: int,
    budget: int,
) -> torch.Tensor:  # (B, S, T) bool
    """The slots each query keeps (``ThinkerQSAIndexer``), equal to the reference's choice, which it makes query by
    query in a Python loop.

    Where each query sees a prefix of what its row's widest-seeing query sees (causal masks with padding, with or
    without a cache), the blocks are the row's: pooled once, scored for every query in one matmul. The reference's
    own scores are not a function of the query and the block alone: its per-query matmul and sum over heads round
    differently with the number of blocks a query sees. So a query's batched scores decide only where its best blocks
    lie further from the others than twice a bound on either computation's rounding error, and then that set is the
    reference's too; a query with ties (relu gives zeros) or near-ties is scored again exactly as the reference
    scores it, and a query whose visible slots are no such prefix is run through the reference's steps.
    """
    batch, seq, heads, dim = query.shape
    keep = budget // ratio
    counts = visible.sum(-1)  # (B, S): visible slots per query
    widest = visible[torch.arange(batch, device=visible.device), counts.argmax(-1)]  # (B, T): the row's widest view
    rank = widest.long().cumsum(-1) - 1  # each slot's place among the row's visible ones
    prefix = (visible == (widest[:, None] & (rank[:, None] < counts[..., None]))).all(-1)  # (B, S)
    blocks = int(counts.max()) // ratio
    slots = torch.sort((~widest).to(torch.int8), dim=-1, stable=True).indices[:, : blocks * ratio]  # visible first
    slots = slots.view(batch, blocks, ratio)  # (B, NB, r): each block's slots (past a row's blocks: unused)
    # the reference's per-block steps: fp32 mean, cast back, norm, rotated at the block's first slot
    pooled = raw_keys.gather(1, slots.flatten(1)[..., None].expand(-1, -1, dim)).view(batch, blocks, ratio, dim)
    pooled = key_norm(pooled.float().mean(2).to(raw_keys.dtype))
    starts = slots[..., 0, None].expand(-1, -1, cos.shape[-1])
    keys = rotate(pooled, cos.gather(1, starts), sin.gather(1, starts)).float()  # (B, NB, Id)

    seen = counts // ratio  # (B, S): complete blocks each query sees
    kept_blocks = torch.arange(blocks, device=query.device) < seen[..., None]  # (B, S, NB)
    certain = seen <= keep  # every block a query sees is kept: nothing to rank
    if keep and not bool(certain.all()):
        chunk = max(1, 2**24 // max(1, batch * heads * blocks))  # queries at a time: the scores' memory bounded
        for start in range(0, seq, chunk):
            part = slice(start, start + chunk)
            best, sure = best_blocks(query[:, part], keys, kept_blocks[:, part], keep)
            kept_blocks[:, part] = torch.where(certain[:, part, None], kept_blocks[:, part], best)
            certain[:, part] |= sure
    block_of_slot = (rank // ratio).clamp(0, max(blocks - 1, 0))
    kept = kept_blocks.gather(2, block_of_slot[:, None].expand(-1, seq, -1)) if blocks else torch.zeros_like(visible)
    tail = rank[:, None] >= (seen * ratio)[..., None]  # the unfinished last block's slots
    selected = visible & (kept | tail)

    # ties or near-ties, and masks of any other form: the reference's own steps, so its own roundings
    for b, i in (~(prefix & certain)).nonzero().tolist():
        selected[b, i] = reference_selection(
            query[b, i], raw_keys[b], visible[b, i], cos[b], sin[b], key_norm, ratio, budget
        )
    return selected


def best_blocks(
    query: torch.Tensor,  # (B, S, In, Id)
    keys: torch.Tensor,  # (B, NB, Id) float32
    seen: torch.Tensor,  # (B, S, NB) bool: the blocks each query sees
    keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, S, NB) the best blocks, (B, S) whether the reference's are the same
    """Each query's ``keep`` best blocks by scores computed for all at once, and whether they are certainly the
    reference's: exactly ``keep`` of them, further from every other block than twice the bound on the rounding
    error of either computation (``|error| <= gamma sum_h |q_h|.|k| / sqrt(Id)`` whatever the order of the sums)."""
    batch, seq, heads, dim = query.shape
    q = query.float()
    scores = torch.matmul(q.flatten(1, 2), keys.transpose(1, 2)).view(batch, seq, heads, -1)
    scores = scores.relu().sum(2) / dim**0.5  # (B, S, NB)
    # float32 products and sums; a matmul allowed to round its inputs (TF32, bfloat16) widens it
    unit = 2.0**-24 + (2.0**-8 if torch.get_float32_matmul_precision() != "highest" else 0.0)
    gamma = 2.2 * (dim + heads + 4) * unit  # both computations' error, and the bound's own rounding
    bound = torch.matmul(q.abs().sum(2), keys.abs().transpose(1, 2)) * gamma / dim**0.5 + 2.0**-110
    ranked = scores.masked_fill(~seen, -math.inf)
    best = seen & (ranked >= ranked.topk(keep, dim=-1).values[..., -1:])
    lowest_kept = torch.where(best, scores - bound, math.inf).amin(-1)
    highest_dropped = torch.where(seen & ~best, scores + bound, -math.inf).amax(-1)
    return best, (best.sum(-1) == keep) & (lowest_kept > highest_dropped)


def reference_selection(
    query: torch.Tensor,  # (In, Id)
    raw_keys: torch.Tensor,  # (T, Id)
    visible: torch.Tensor,  # (T,)
    cos: torch.Tensor,  # (T, rot)
    sin: torch.Tensor,
    key_norm: nn.Module,
    ratio: int,
    budget: int,
) -> torch.Tensor:  # (T,) bool
    """One query's kept slots, step by step as Qwen4ExpTextQSAIndexer takes them."""
    slots = visible.nonzero().flatten()  # ascending
    complete = len(slots) // ratio
    selected = torch.zeros_like(visible)
    if complete:
        blocks = slots[: complete * ratio].view(complete, ratio)
        pooled = raw_keys[blocks.flatten()].view(complete, ratio, -1).float().mean(1).to(raw_keys.dtype)
        starts = blocks[:, 0]
        keys = rotate(key_norm(pooled).unsqueeze(1), cos[starts, None], sin[starts, None]).squeeze(1)
        scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)).transpose(-1, -2)
        scores = torch.relu(scores).sum(-1) / query.shape[-1] ** 0.5  # (complete,)
        keep = min(budget // ratio, complete)
        if _INDEX_TIES["rule"] == "lowest":  # the stable sort keeps equal scores in block order
            best = torch.sort(scores, descending=True, stable=True).indices[:keep]
        else:
            best = scores.topk(keep, dim=0).indices
        selected[blocks[best].flatten()] = True
    selected[slots[complete * ratio :]] = True
    return selected


class ThinkerAttention(nn.Module):
    def __init__(self, config: ThinkerConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_key_value_groups
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.output_gate = config.attention_output_gate
        # With the output gate, q_proj's rows hold [query, gate] for each head in turn (Qwen3.5's layout).
        q_rows = 2 * q_size if self.output_gate else q_size
        self.q_proj = nn.Linear(config.hidden_size, q_rows, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_output_bias)
        if config.qk_norm:  # per head, so it needs no reshape after the projection's view
            centred = config.norm_zero_centered
            self.q_norm = ThinkerRMSNorm(self.head_dim, eps=config.rms_norm_eps, zero_centered=centred)
            self.k_norm = ThinkerRMSNorm(self.head_dim, eps=config.rms_norm_eps, zero_centered=centred)
        if config.layer_types[layer_idx] == "indexed_attention":
            self.indexer = ThinkerQSAIndexer(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, C)
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        indexer_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # every slot's cos, sin
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if hasattr(self, "indexer"):
            attention_mask = self.indexed_mask(hidden_states, attention_mask, cache, indexer_position_embeddings)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # (B, T, n, hs)
        if self.output_gate:
            q, gate = self.q_proj(hidden_states).view(*input_shape, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*input_shape, -1)  # (B, T, nh * hs)
        else:
            q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, n_kv, T, hs)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, n_kv, T, hs)
        if position_embeddings is not None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            # kwargs: what a paged cache (continuous batching, `generate_batch`) reads and fills for the attention
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, n_kv, past + T, hs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()  # (B, T, nh * hs)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out), weights

    def indexed_mask(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The causal mask narrowed to the slots the indexer keeps, in the mask's own form (bool for sdpa, additive
        for eager: the dropped slots at the dtype's minimum, not -inf, as the reference masks them)."""
        if not isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                f"indexed_attention layers need a dense mask to narrow (sdpa or eager attention); "
                f"attn_implementation={self.config._attn_implementation!r} gives {type(attention_mask).__name__}"
            )
        selected = self.indexer(hidden_states, position_embeddings, attention_mask, cache)  # (B, 1, S, T)
        if attention_mask.dtype == torch.bool:
            return attention_mask & selected
        return attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)


# ----------------------------------------------------------------------------------------------------------------
# linear attention: Gated DeltaNet


def count_in_place_step(cache: Cache, layer_idx: int) -> None:
    """Count a decode step whose conv state was updated in place. From transformers 5.25 a linear-attention cache
    layer counts its own tokens (``get_seq_length``, which masks and positions read) from what ``update_conv_state``
    is given, so a step that bypasses it must say so (``increase_count``); earlier releases count only the
    attention layers, and have no such method."""
    increase = getattr(cache, "increase_count", None)
    if increase is not None:
        increase(layer_idx, 0)


def states_to_keep(cache: Cache | None, layer_idx: int) -> int:
    """How many of a call's last recurrent states the cache records (transformers >= 5.25, while assisted decoding
    records the past so that ``crop`` can roll a linear layer back); 0 otherwise."""
    keep = getattr(cache, "get_recurrent_states_to_keep", None)
    return (keep(layer_idx) or 0) if keep is not None else 0


def gated_delta_rule_in_own_dtype(
    query: torch.Tensor,  # (B, T, nk, hk)
    key: torch.Tensor,
    value: torch.Tensor,  # (B, T, nv, hv)
    g: torch.Tensor,  # (B, T, nv) log decay
    beta: torch.Tensor,  # (B, T, nv)
    initial_state: torch.Tensor | None = None,  # (B, nv, hk, hv)
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token in its inputs' dtype: ``torch_recurrent_gated_delta_rule``'s definition
    (l2-normed q and k, q over sqrt(hk), decay, then the delta update, then the read-out), which transformers'
    forms and the hub kernels that replace them compute in float32 whatever their inputs. Written out for a model
    run in float64 (``computed_in``), whose recurrence is then float64 throughout."""
    if cu_seqlens is not None:
        raise ValueError("packed sequences (cu_seqlens) run in float32 or half precision only")
    groups = value.shape[2] // key.shape[2]  # each q/k head serves this many consecutive value heads
    query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query / query.shape[-1] ** 0.5
    batch, seq, heads, k_dim = key.shape
    state = (
        initial_state.to(value.dtype)
        if initial_state is not None
        else value.new_zeros(batch, heads, k_dim, value.shape[-1])
    )
    outs = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        remembered = (state * key[:, t, ..., None]).sum(-2)  # (B, nv, hv): what the state recalls for this key
        delta = (value[:, t] - remembered) * beta[:, t, :, None]
        state = state + key[:, t, ..., None] * delta[..., None, :]
        outs.append((state * query[:, t, ..., None]).sum(-2))
    return torch.stack(outs, dim=1), state if output_final_state else None


@use_kernelized_func(
    [torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule, causal_conv1d_fn, causal_conv1d_update]
)
class ThinkerGatedDeltaNet(nn.Module):
    """Gated DeltaNet in Qwen3.5's parameter layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``), so a Qwen3.5 state dict loads by name; Qwen3-Next's
    fused, per-key-head grouped ``in_proj_qkvz`` / ``in_proj_ba`` are reordered into it by the converter.

    q, k, v go through a causal depthwise conv (SiLU); the state S (per value head, k_dim x v_dim) decays by
    ``exp(g)`` and takes the delta-rule update ``S += k (beta (v - S^T k))^T`` for each token; the output
    ``S^T q`` goes through an RMSNorm gated by ``silu(z)``. Each key head serves ``v_heads / k_heads`` value heads.
    The cache (transformers' LinearAttentionLayer) holds the last ``linear_conv_kernel_dim`` conv inputs and S.
    """

    def __init__(self, config: ThinkerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation = config.hidden_act

        self.conv_dim = 2 * self.key_dim + self.value_dim  # channels of [q | k | v]
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=False,
        )
        self.in_proj_qkv = nn.Linear(config.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)  # output gate
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)  # write strength beta
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)  # decay step
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        # log of the decay rate A; its range keeps log(A) finite (transformers' initialisation)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log_())
        self.norm = ThinkerRMSNormGated(self.head_v_dim, eps=config.rms_norm_eps, activation=config.output_gate_type)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    @force_accelerate_hooks("conv1d")  # its weight is read directly by the conv kernels, not through forward()
    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, C)
        attention_mask: torch.Tensor | None = None,  # 2-D padding mask (B, T) or None
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        # Padding positions become zeros: with no biases they write nothing into the state (transformers' rule).
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, seq, _ = hidden_states.shape
        conv_state = cache.get_conv_state(self.layer_idx) if cache is not None else None
        recurrent_state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None

        qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, 2·Dk + Dv, T)
        z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)  # (B, T, nv, hv)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)  # (B, T, nv)

        weight = self.conv1d.weight.squeeze(1)  # (channels, kernel)
        if conv_state is not None and seq == 1 and not cache.is_recording_past(self.layer_idx):
            count_in_place_step(cache, self.layer_idx)
            qkv = causal_conv1d_update(qkv, conv_state, weight, self.conv1d.bias, self.activation)  # state in place
        else:
            if cache is not None:  # prefill or a multi-token step: the cached inputs become the left context
                qkv = cache.update_conv_state(qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            qkv = causal_conv1d_fn(qkv, weight, self.conv1d.bias, activation=self.activation, **kwargs)
            if cache is not None:
                qkv = qkv[:, :, -seq:]  # drop the outputs of the cached context
        query, key, value = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, seq, -1, self.head_k_dim)  # (B, T, nk, hk)
        key = key.reshape(batch, seq, -1, self.head_k_dim)
        value = value.reshape(batch, seq, -1, self.head_v_dim)  # (B, T, nv, hv)

        beta = b.sigmoid()
        wide = computed_in(a.dtype)
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias.to(wide))  # log decay <= 0, in fp32
        one_step = recurrent_state is not None and seq == 1  # decode; prefill runs the chunked form
        # Assisted decoding (transformers >= 5.25) keeps the states after each of the last few tokens, to roll the
        # state back to the last draft token accepted: those tokens run one step at a time after the chunked rest.
        stepped = 0 if one_step else min(states_to_keep(cache, self.layer_idx), seq)
        delta_rule = torch_recurrent_gated_delta_rule if one_step else torch_chunk_gated_delta_rule
        stepwise = torch_recurrent_gated_delta_rule
        if wide != torch.float32:  # transformers' forms would round a float64 model's recurrence to float32
            delta_rule = stepwise = gated_delta_rule_in_own_dtype
        chunked = seq - stepped
        outs, last_state, states = [], recurrent_state, []
        if chunked:
            out, last_state = delta_rule(
                query[:, :chunked],
                key[:, :chunked],
                value[:, :chunked],
                g=g[:, :chunked],
                beta=beta[:, :chunked],
                initial_state=recurrent_state,
                output_final_state=cache is not None,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=kwargs.pop("cu_seq_lens_q", None),
                **kwargs,
            )  # (B, T, nv, hv)
            outs.append(out)
        for t in range(chunked, seq):
            step = slice(t, t + 1)
            out, last_state = stepwise(
                query[:, step],
                key[:, step],
                value[:, step],
                g=g[:, step],
                beta=beta[:, step],
                initial_state=last_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            outs.append(out)
            states.append(last_state)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if cache is not None:
            cache.update_recurrent_state(states or last_state, self.layer_idx)

        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(batch, seq, -1))


# ----------------------------------------------------------------------------------------------------------------
# feed-forward: dense MLP, experts, router, sparse block


class ThinkerMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` when gated (SwiGLU), else ``down(act(up(x)))`` (GPT-2)."""

    def __init__(self, config: ThinkerConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gated = config.mlp_gated
        if self.gated:
            self.gate_proj = nn.Linear(config.hidden_size, size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


@use_experts_implementation  # lets users pick transformers' grouped_mm / batched_mm kernels for the same weights
class ThinkerExperts(nn.Module):
    """All experts of a layer as two 3-D tensors: ``gate_up_proj`` (E, 2·I, C) and ``down_proj`` (E, C, I)."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(
        self,
        hidden_states: torch.Tensor,  # (N, C) tokens flattened
        top_k_index: torch.Tensor,  # (N, k)
        top_k_weights: torch.Tensor,  # (N, k)
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # The loop below has a data-dependent trip count, which torch.compile(fullgraph=True) cannot trace.
            # transformers' grouped form has none: tokens sorted by expert, one grouped matmul over per-expert row
            # ranges (an opaque op where the grouped kernel cannot be compiled), so still only chosen experts work.
            return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        # Visit only the experts some token was routed to: the work is proportional to k, not to E. Under expert
        # parallelism, ids past this rank's experts are routes to other ranks (weight 0): skipped.
        for expert in top_k_index.unique().tolist():
            if expert >= self.num_experts:
                continue
            # slot-major, as transformers' eager experts order the rows: the same matmuls, so the same bits
            slot, token_idx = torch.where(top_k_index.T == expert)
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(out.dtype))
        return out


class ThinkerTopKRouter(nn.Module):
    """Qwen's router: softmax over all experts in fp32, top-k, optionally renormalised to sum to one."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states, self.weight)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=computed_in(logits.dtype))
        top_values, top_index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        return logits, top_values.to(logits.dtype), top_index


class ThinkerSparseMoeBlock(nn.Module):
    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.gate = ThinkerTopKRouter(config)
        self.experts = ThinkerExperts(config)
        if config.shared_expert_intermediate_size:
            self.shared_expert = ThinkerMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = hidden_states.shape
        flat = hidden_states.view(-1, dim)  # (N, C)
        _, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        if hasattr(self, "shared_expert"):
            out = out + F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(batch, seq, dim)


# ----------------------------------------------------------------------------------------------------------------
# Qwen4-Exp's residual streams and per-layer n-gram embeddings


class ThinkerHyperConnection(nn.Module):
    """Hyper-connections around one sub-layer: the residual is ``hc_count`` streams of ``hidden_size``.

    The streams are RMS-normed each on its own; a sigmoid of a low-rank projection of them weighs each channel of
    each stream, and their mean is the sub-layer's input (in place of a pre-norm). The sub-layer's output is added
    to every stream, times ``2 sigmoid(.)`` of a per-stream weight. Without ``inject`` (the model's last one) only
    the mixed input comes out, in place of the final norm.
    """

    def __init__(self, config: ThinkerConfig, inject: bool = True) -> None:
        super().__init__()
        self.streams, width = config.hc_count, config.hc_count * config.hidden_size
        self.hc_norm = make_norm(config, width, group_size=config.hidden_size)
        self.input_mix_weight_down = nn.Linear(width, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(config.hc_lowrank, width, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(width, self.streams, bias=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, n·C) streams -> the sub-layer's input (B, T, C) and the injection weights (B, T, n)."""
        normed = self.hc_norm(streams)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.streams)))
        mixed = (mix.unflatten(-1, (self.streams, -1)) * normed.unflatten(-1, (self.streams, -1))).mean(dim=-2)
        if not hasattr(self, "block_inject_weight"):
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.streams)

    @staticmethod
    def inject(streams: torch.Tensor, output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each stream plus the sub-layer's output (B, T, C) times its weight (B, T, n)."""
        return streams + (output.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


# The n-gram hash is part of a checkpoint's definition, as fixed as its weights: Qwen4-Exp derives each PLE table's
# multipliers from SplitMix64 and its sizes from primes. Written out here rather than imported from transformers'
# qwen4_exp module, whose helpers are private (and which transformers before 5.24 lacks, where the other families of
# this file still load); tests/test_modeling_qwen4_exp.py holds the values equal to transformers'.
_MASK64 = (1 << 64) - 1
# ThinkerModel.reverse_embedding compares inputs_embeds with so many table elements at a time, at the most.
REVERSE_EMBEDDING_ELEMENTS = 2**26


def splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """One odd multiplier per n-gram position, below (2^63 - 1) / vocab_size so that id x multiplier fits int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    draws = [splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) for i in range(ngram_size)]
    return [2 * (draw % half_bound) + 1 for draw in draws]


def is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % divisor for divisor in range(3, math.isqrt(value) + 1, 2))


def primes_after(start: int, count: int) -> list[int]:
    """The first ``count`` primes above ``start``."""
    primes, value = [], start
    while len(primes) < count:
        value += 1
        if is_prime(value):
            primes.append(value)
    return primes


def ngram_hash_buffers(config: ThinkerConfig, ple_index: int) -> dict[str, torch.Tensor]:
    """The hash of the ``ple_index``-th PLE layer: its multipliers, its tables' sizes (the primes go on from one PLE
    layer to the next: every table of every layer has a size of its own) and their first rows in the shared
    embedding; Qwen4-Exp's ``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``."""
    heads = (config.ngram_size - 1) * config.heads_per_ngram
    sizes = primes_after(config.ngram_vocab_size_base - 1, (ple_index + 1) * heads)[-heads:]
    vocab = config.ngram_hash_vocab_size or config.vocab_size
    with torch.device("cpu"):  # real values even where a model is built on the meta device
        return {
            "multipliers": torch.tensor(ngram_multipliers(vocab, config.ngram_size, ple_index, config.ngram_seed)),
            "table_sizes": torch.tensor(sizes),
            "table_offsets": torch.tensor([sum(sizes[:i]) for i in range(heads)]),
        }


class ThinkerNGramEmbedding(nn.Module):
    """Hashed token n-grams (2 .. ``ngram_size``), ``heads_per_ngram`` tables each, as Qwen4-Exp hashes them.

    Every table of every PLE layer has a distinct prime size; their rows share one embedding. A position's n-gram is
    its token and the ``n - 1`` before it, an eos before them cutting it short (the missing ones read as eos); the
    last ``ngram_size - 1`` ids are cached (conv state slot 2 of the layer) for the next step.
    """

    multipliers: torch.Tensor
    table_sizes: torch.Tensor
    table_offsets: torch.Tensor

    def __init__(self, config: ThinkerConfig, layer_idx: int, ple_index: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.ple_index = config, layer_idx, ple_index
        self.ngram_size, self.heads_per_ngram = config.ngram_size, config.heads_per_ngram
        self.context = config.ngram_size - 1
        self.eos_token_id = config.ngram_eos_token_id
        # derived from the config, never read from a checkpoint (non-persistent; _init_weights derives them again
        # for a model built on the meta device)
        buffers = ngram_hash_buffers(config, ple_index)
        for name, values in buffers.items():
            self.register_buffer(name, values, persistent=False)
        divisor = config.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(buffers["table_sizes"].tolist()) / divisor) * divisor  # the tables' rows, padded
        self.ngram_embedding = nn.Embedding(rows, config.ple_embed_dim // len(buffers["table_sizes"]))

    def forward(self, input_ids: torch.Tensor, cache: Cache | None) -> torch.Tensor:  # (B, T) -> (B, T, P)
        input_ids = input_ids.long()
        cached = cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        if cached is not None:
            context = cached.clone()  # the cache's copy is overwritten just below
        else:
            context = input_ids.new_full((input_ids.shape[0], self.context), self.eos_token_id)
        if cache is not None:
            # a first chunk shorter than the context is padded with eos, not with the cache's zeros
            to_cache = input_ids
            if cached is None and input_ids.shape[1] < self.context:
                to_cache = F.pad(input_ids, (self.context - input_ids.shape[1], 0), value=self.eos_token_id)
            cache.update_conv_state(to_cache, self.layer_idx, state_idx=2, conv_kernel_size=self.context)
        history = torch.cat([context, input_ids], dim=-1)  # (B, n-1 + T)
        shifted = [self.shifted(history, shift) for shift in range(self.ngram_size)]
        ids = []
        for order in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for position in range(1, order):
                mixed = torch.bitwise_xor(mixed, shifted[position] * self.multipliers[position])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            ids.append(torch.remainder(mixed.unsqueeze(-1), self.table_sizes[heads]) + self.table_offsets[heads])
        ids = torch.cat(ids, dim=-1)[:, -input_ids.shape[1] :]  # (B, T, heads)
        return self.ngram_embedding(ids).flatten(-2)

    def shifted(self, ids: torch.Tensor, shift: int) -> torch.Tensor:
        """``ids`` moved ``shift`` positions right within each eos-delimited segment; eos where none is left."""
        if shift == 0:
            return ids
        positions = torch.arange(ids.shape[1], device=ids.device)
        eos_at = torch.where(ids == self.eos_token_id, positions, -1)
        last_eos_before = F.pad(torch.cummax(eos_at, dim=1).values[:, :-1], (1, 0), value=-1)
        in_segment = positions - (last_eos_before + 1)  # position within its segment
        source = positions - shift
        moved = ids.gather(1, source.clamp_min(0).expand_as(ids))
        keep = (in_segment >= shift) & (source >= 0)
        return torch.where(keep, moved, ids.new_full((), self.eos_token_id))


class ThinkerPLELayer(nn.Module):
    """Per-layer embedding (Qwen4-Exp's PLE): the position's n-gram embedding, projected to one value and to a key
    per stream; each stream's RMS-normed state gates the value by ``sigmoid(signed sqrt(key . state / sqrt(C)))``;
    the gated values plus a SiLU dilated depthwise conv over their normed past (kernel ``ple_conv_kernel_size``,
    dilation ``ngram_size``, its window cached in conv state slot 1) are added to the streams."""

    def __init__(self, config: ThinkerConfig, layer_idx: int, ple_index: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size, self.streams = config.hidden_size, config.hc_count
        width = config.hc_count * config.hidden_size
        self.ple_embedding = ThinkerNGramEmbedding(config, layer_idx, ple_index)
        self.key_proj = nn.Linear(config.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(config.ple_embed_dim, config.hidden_size, bias=False)
        self.norm_key = make_norm(config, width, group_size=config.hidden_size)
        self.norm_query = make_norm(config, width, group_size=config.hidden_size)
        self.norm_conv = make_norm(config, width, group_size=config.hidden_size)
        kernel, dilation = config.ple_conv_kernel_size, config.ngram_size
        self.window = (kernel - 1) * dilation
        self.conv1d = nn.Conv1d(width, width, kernel, groups=width, dilation=dilation, bias=False)

    def forward(
        self,
        streams: torch.Tensor,  # (B, T, n·C)
        input_ids: torch.Tensor,  # (B, T)
        cache: Cache | None,
        padding_mask: torch.Tensor | None,  # (B, T) or None
    ) -> torch.Tensor:  # (B, T, n·C), to add to the streams
        embeddings = self.ple_embedding(input_ids, cache)  # (B, T, P)
        keys = self.norm_key(self.key_proj(embeddings)).unflatten(-1, (self.streams, -1))  # (B, T, n, C)
        queries = self.norm_query(streams).unflatten(-1, (self.streams, -1))
        gate = (keys * queries).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # (B, T, n, 1)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * self.value_proj(embeddings).unsqueeze(-2)).flatten(-2)  # (B, T, n·C)
        normed = self.norm_conv(gated)
        gated = apply_mask_to_padding_states(gated, padding_mask)
        normed = apply_mask_to_padding_states(normed, padding_mask)
        return gated + self.short_conv(normed, cache)

    def short_conv(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        seq = x.shape[1]
        x = x.transpose(1, 2)  # (B, n·C, T)
        if cache is not None and not self.window:
            raise ValueError(
                "ple_conv_kernel_size=1: the PLE conv keeps no window, which the cache cannot hold (as in "
                "Qwen4-Exp, whose update_conv_state fails on it); run without a cache (use_cache=False)"
            )
        if cache is not None:  # the cached window becomes the left context
            x = cache.update_conv_state(x, self.layer_idx, state_idx=1, conv_kernel_size=self.window)
        x = F.pad(x, (self.window, 0))[..., -(self.window + seq) :]  # dilation: transformers' conv kernels do not apply
        return F.silu(self.conv1d(x)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# decoder layer and model


def cached_length(cache: Cache | None, config: ThinkerConfig) -> int:
    """The tokens before this call: what the first attention layer holds, which the masks span (transformers'
    ``get_mask_sizes``). ``Cache.get_seq_length()`` reads layer 0, which on a hybrid model is a linear-attention
    layer: transformers 5.24 looked past it to an attention layer, 5.25 counts that layer's own tokens; the two agree
    but where a cache's attention layers were given context the linear ones were not (export/deep_cache.py)."""
    if cache is None:
        return 0
    attention = [i for i, kind in enumerate(config.layer_types) if kind != "linear_attention"]
    return cache.get_seq_length(attention[0]) if attention else cache.get_seq_length()


def split_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(text positions for the causal mask, positions for RoPE), taking position_ids as Qwen3.5's and Qwen3-Omni's
    text models do: (B, T) text; (3, B, T) temporal/height/width, no separate text row (the mask then counts
    positions from the cache); (4, B, T) a text row followed by temporal/height/width."""
    if position_ids.ndim == 2:
        return position_ids, position_ids
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    if position_ids.ndim == 3 and position_ids.shape[0] == 3:
        return None, position_ids
    raise ValueError(f"position_ids must be (B, T), (3, B, T) or (4, B, T); got {tuple(position_ids.shape)}")


# The inputs that carry a prompt's DeepStack features (``ThinkerModel.forward``): its positions only, so generation
# passes them on the first forward alone (``ThinkerForCausalLM.prepare_inputs_for_generation``).
DEEPSTACK_INPUTS = ("visual_pos_masks", "deepstack_visual_embeds")


def check_deepstack(
    config: ThinkerConfig,
    inputs_embeds: torch.Tensor,
    visual_pos_masks: torch.Tensor | None,
    deepstack_visual_embeds: list[torch.Tensor] | None,
) -> None:
    """Refuses DeepStack inputs that do not fit the prompt by name, rather than with an indexing error (or, for a
    list longer than the layers, without a word)."""
    if (visual_pos_masks is None) != (deepstack_visual_embeds is None):
        raise ValueError("visual_pos_masks and deepstack_visual_embeds go together: pass both or neither")
    if deepstack_visual_embeds is None:
        return
    if config.hc_count > 1:
        raise ValueError("deepstack_visual_embeds: this model's hidden states are hyper-connection streams")
    if visual_pos_masks.shape != inputs_embeds.shape[:2]:
        raise ValueError(
            f"visual_pos_masks of shape {tuple(visual_pos_masks.shape)}; expected (batch, seq) = "
            f"{tuple(inputs_embeds.shape[:2])}"
        )
    if len(deepstack_visual_embeds) > config.num_hidden_layers:
        raise ValueError(
            f"{len(deepstack_visual_embeds)} deepstack_visual_embeds for {config.num_hidden_layers} decoder layers"
        )
    # a mask marks positions: any other value was counted by its size, and the features blamed for it (a QA run)
    if visual_pos_masks.dtype != torch.bool and not bool(((visual_pos_masks == 0) | (visual_pos_masks == 1)).all()):
        raise ValueError("visual_pos_masks holds values other than 0 and 1 (False and True)")
    visual, width = int(visual_pos_masks.sum()), inputs_embeds.shape[-1]
    for index, features in enumerate(deepstack_visual_embeds):
        if tuple(features.shape) != (visual, width):
            raise ValueError(
                f"deepstack_visual_embeds[{index}] of shape {tuple(features.shape)}; expected ({visual}, {width}): a "
                "row for each of visual_pos_masks' positions"
            )


def add_at_positions(hidden_states: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` (B, T, C) with ``features`` (N, C) added at the N positions ``positions`` (B, T) marks, in
    the hidden states' dtype, as Qwen3VLTextModel's ``_deepstack_process`` adds them."""
    hidden_states = hidden_states.clone()
    positions = positions.to(hidden_states.device).bool()
    hidden_states[positions] = hidden_states[positions] + features.to(hidden_states.device, hidden_states.dtype)
    return hidden_states


def check_input_shapes(
    config: ThinkerConfig,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    cache: Cache | None,
) -> None:
    """Refuses, by name, inputs whose shapes disagree: torch would otherwise fail deep inside with a broadcast error
    naming neither, or (an attention mask of the wrong length beside a cache) give other logits without a word."""
    if inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(
            f"inputs_embeds of shape {tuple(inputs_embeds.shape)}; expected (batch, seq, hidden_size "
            f"{config.hidden_size})"
        )
    batch, seq = inputs_embeds.shape[:2]
    if position_ids.ndim in (2, 3) and (position_ids.shape[-1] != seq or position_ids.shape[-2] not in (1, batch)):
        multimodal = " (multimodal ones are (3, batch, seq), also for a batch of 1)" if position_ids.ndim == 2 else ""
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} for inputs of batch {batch} and length {seq}; "
            f"expected (batch, seq), (3, batch, seq) or (4, batch, seq){multimodal}"
        )
    # a cache that counts what it holds (transformers' continuous batching's paged one does not, nor takes such masks)
    counted = cache is None or hasattr(cache, "get_seq_length")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 and counted:
        past_seen = cached_length(cache, config)
        if attention_mask.shape != (batch, past_seen + seq):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)}; expected (batch {batch}, the {past_seen} "
                f"cached tokens + this call's {seq}) = ({batch}, {past_seen + seq})"
            )


class ThinkerDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``; the mixer is full attention
    (``self_attn``, its keys narrowed by an indexer on ``indexed_attention`` layers) or Gated DeltaNet
    (``linear_attn``) as ``layer_types`` says. With hyper-connections (``hc_count`` > 1) ``x`` is several streams,
    mixed into each sub-layer's input in place of its norm and given its output back; on a PLE layer the n-gram
    embedding is added to them first."""

    def __init__(self, config: ThinkerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = ThinkerGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = ThinkerAttention(config, layer_idx)
        sparse = config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = ThinkerSparseMoeBlock(config) if sparse else ThinkerMLP(config)
        self.hyper_connections = config.hc_count > 1
        if self.hyper_connections:
            self.attn_hyper_connection = ThinkerHyperConnection(config)
            self.mlp_hyper_connection = ThinkerHyperConnection(config)
        else:
            self.input_layernorm = make_norm(config, config.hidden_size)
            self.post_attention_layernorm = make_norm(config, config.hidden_size)
        if layer_idx + 1 in config.ple_layer_ids:  # one-indexed, as Qwen4-Exp lists them
            self.ple = ThinkerPLELayer(config, layer_idx, config.ple_layer_ids.index(layer_idx + 1))

    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, T, C), or (B, T, n·C) with hyper-connections
        attention_mask: torch.Tensor | None = None,  # this layer type's mask (4-D additive, or 2-D padding)
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,  # the name before transformers 5.24, which its checkpointing reads
        ple_input_ids: torch.LongTensor | None = None,  # the token ids PLE layers hash
        indexer_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,  # every slot's, for indexers
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        cache = either_cache(cache, past_key_values)
        if hasattr(self, "ple"):  # on linear-attention layers, whose mask is the 2-D padding mask
            hidden_states = hidden_states + self.ple(hidden_states, ple_input_ids, cache, attention_mask)
        mixer_input, weights = self.sublayer_input(hidden_states, "attn")
        if self.layer_type == "linear_attention":
            out = self.linear_attn(mixer_input, attention_mask, cache, **kwargs)
        else:
            out, _ = self.self_attn(
                mixer_input,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                indexer_position_embeddings=indexer_position_embeddings,
                **kwargs,
            )
        hidden_states = self.residual(hidden_states, out, weights)
        mlp_input, weights = self.sublayer_input(hidden_states, "mlp")
        return self.residual(hidden_states, self.mlp(mlp_input), weights)

    def sublayer_input(self, hidden_states: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention's or the MLP's input: the pre-norm, or the hyper-connections' mix (and their weights)."""
        if self.hyper_connections:
            return getattr(self, f"{which}_hyper_connection")(hidden_states)
        norm = self.input_layernorm if which == "attn" else self.post_attention_layernorm
        return norm(hidden_states), None

    def residual(self, hidden_states: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return hidden_states + out if weights is None else ThinkerHyperConnection.inject(hidden_states, out, weights)


class ThinkerPreTrainedModel(PreTrainedModel):
    config_class = ThinkerConfig
    config: ThinkerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ThinkerDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True  # the experts' loop gives way to a grouped form under torch.compile
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(ThinkerTopKRouter, index=0),
        "hidden_states": ThinkerDecoderLayer,
        "attentions": ThinkerAttention,
    }

    def __init__(self, config: ThinkerConfig, *inputs, **kwargs) -> None:
        super().__init__(config, *inputs, **kwargs)
        # A recurrent state cannot be rolled back to a prefix, so generate() must refuse assisted decoding.
        self._is_stateful = config.has_linear_attention

    # The indexer narrows a dense mask (``ThinkerAttention.indexed_mask``), which flash and flex attention do not
    # take: refused when the model is built, as transformers' Qwen4-Exp refuses them, not at the first forward.
    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        self._refuse_for_indexed_attention(f"flash_attention_{flash_attn_version}")
        return super()._flash_attn_can_dispatch(flash_attn_version, is_init_check)

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        self._refuse_for_indexed_attention("flex_attention")
        if self.config.has_linear_attention:
            # As transformers' Qwen3.5 and Qwen3-Next classes, which offer no flex attention: there is no reference
            # to check it against (and on the CPU torch's inductor fails to compile the hybrid model's masks).
            raise ValueError(
                "attn_implementation='flex_attention': models with linear-attention layers (Qwen3.5, Qwen3-Next) "
                "take sdpa, eager or flash attention, not flex, as transformers' own classes for them do; load with "
                "attn_implementation='sdpa' (the default), 'eager' or a flash attention"
            )
        return super()._flex_attn_can_dispatch(is_init_check)

    def _refuse_for_indexed_attention(self, implementation: str) -> None:
        if self.config.has_indexed_attention:
            raise ValueError(
                f"attn_implementation={implementation!r}: indexed_attention layers (the QSA indexer) narrow a dense "
                f"mask, which only sdpa and eager attention take; load with attn_implementation='sdpa' or 'eager'"
            )

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self._auto_class is not None:  # registered: by ``import thinker``, or loaded as remote code
            name_every_auto_class(self.config, type(self).__module__)
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, ThinkerRMSNorm) and module.zero_centered:
            init.zeros_(module.weight)  # a scale of one, stored as its offset from one
        elif isinstance(module, ThinkerGatedDeltaNet):  # as Qwen3.5 initialises them
            init.ones_(module.dt_bias)
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(0.01, 16).log_())
        elif isinstance(module, ThinkerExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, ThinkerTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ThinkerNGramEmbedding):  # derived from the config (built on meta by from_pretrained)
            for name, values in ngram_hash_buffers(module.config, module.ple_index).items():
                init.copy_(getattr(module, name), values)
        elif isinstance(module, ThinkerPLELayer):
            init.zeros_(module.conv1d.weight)  # as Qwen4-Exp starts it: the conv adds nothing until trained


class ThinkerModel(ThinkerPreTrainedModel):
    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        if config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = ThinkerRotaryEmbedding(config)
        if config.audio_embed_size:
            self.audio_proj = nn.Linear(config.audio_embed_size, config.hidden_size)
        if len(config.layer_types) < config.num_hidden_layers:
            raise ValueError(
                f"config.layer_types lists {len(config.layer_types)} layers but num_hidden_layers is "
                f"{config.num_hidden_layers}: set layer_types for every layer"
            )
        # from_pretrained(folder, num_hidden_layers=N) sets N after the config's checks, as transformers' classes
        # take it: the first N layers, the list cut to them (so the config saves and loads again)
        config.layer_types = config.layer_types[: config.num_hidden_layers]
        self.layers = nn.ModuleList([ThinkerDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.has_linear_attention = config.has_linear_attention
        if config.hc_count > 1:  # the streams' last mix is the final hidden state: no final norm
            self.hyper_connection_mixer = ThinkerHyperConnection(config, inject=False)
        else:
            self.norm = make_norm(config, config.hidden_size)
        self.gradient_checkpointing = False
        self.post_init()

    def embed_audio(self, audio_embeds: torch.Tensor) -> torch.Tensor:
        """Projects audio-token embeddings (B, A, audio_embed_size) into the text embedding space (B, A, C), to be
        concatenated with text embeddings and passed as ``inputs_embeds`` (Qwen3-Omni's ``audio_embed``)."""
        if not hasattr(self, "audio_proj"):
            raise ValueError("this model has no audio projection (config.audio_embed_size is not set)")
        return self.audio_proj(audio_embeds)

    @merge_with_config_defaults
    @capture_outputs
    @takes_old_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,  # the cache's name before transformers 5.24
        ple_input_ids: torch.LongTensor | None = None,
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        r"""
        ple_input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The token ids PLE layers hash (Qwen4-Exp), for a call with ``inputs_embeds``: an image placeholder's id
            where the vision tower's embedding stands. Without them, the ids are found back from ``inputs_embeds``
            rows that equal a row of the embedding table (and refused if some do not).
        visual_pos_masks (`torch.BoolTensor` of shape `(batch_size, sequence_length)`, *optional*):
            The image and video positions, where ``deepstack_visual_embeds`` go.
        deepstack_visual_embeds (`list[torch.Tensor]`, each of shape `(visual positions, hidden_size)`, *optional*):
            Qwen3-VL's and Qwen3-Omni's DeepStack: features of the vision tower's inner layers, the i-th added to the
            hidden states at the visual positions after decoder layer i, as their text models take them.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, C)
        elif not inputs_embeds.is_floating_point():
            # integer embeddings ran through the model without a word (a QA run), or met the PLE lookup's refusal
            # first; a float type other than the model's is left to torch, which names it, and to autocast
            raise ValueError(f"inputs_embeds of dtype {inputs_embeds.dtype}; expected floating-point embeddings")
        if self.config.ple_layer_ids and ple_input_ids is None:
            ple_input_ids = input_ids if input_ids is not None else self.reverse_embedding(inputs_embeds)
        cache = either_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if self.has_linear_attention and cache is not None and not any(cache.is_linear):
            raise ValueError(
                "this model's linear-attention layers keep conv and recurrent state in the cache: build it with "
                "DynamicCache(config=model.config)"
            )
        if position_ids is None:
            past_seen = cached_length(cache, self.config)
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen)[None]
        check_input_shapes(self.config, inputs_embeds, position_ids, attention_mask, cache)
        check_deepstack(self.config, inputs_embeds, visual_pos_masks, deepstack_visual_embeds)
        text_positions, rope_positions = split_position_ids(position_ids)

        if not isinstance(masks := attention_mask, dict):  # generate() may have built them (compileable caches)
            mask_kwargs = dict(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=text_positions,
                **{CACHE_ARG: cache},
            )
            masks = {"full_attention": create_causal_mask(**mask_kwargs)}
            if self.has_linear_attention:
                masks["linear_attention"] = create_recurrent_attention_mask(**mask_kwargs)
            if self.config.has_indexed_attention:  # always a dense mask, for the indexer to narrow
                masks["indexed_attention"] = create_causal_mask(**mask_kwargs, allow_is_causal_skip=False)
        if self.config.ple_layer_ids and masks.get("linear_attention") is not None:
            # padding hashes as eos: it then starts no n-gram of the tokens after it
            ple_input_ids = torch.where(masks["linear_attention"].bool(), ple_input_ids, self.config.ngram_eos_token_id)

        hidden_states = inputs_embeds
        position_embeddings = indexer_position_embeddings = None
        if self.config.position_embedding_type == "learned":
            if rope_positions.ndim == 3:
                raise ValueError("multimodal (3, B, T) position_ids need rotary positions, not learned ones")
            hidden_states = hidden_states + self.embed_positions(rope_positions)
        elif self.config.has_indexed_attention:
            # the indexer rotates past blocks at their own positions: the tables of every slot, the last T this step's
            history = self.position_history(rope_positions, hidden_states.shape[0], cache)
            indexer_position_embeddings = self.rotary_emb(hidden_states, history)
            position_embeddings = tuple(table[:, -hidden_states.shape[1] :] for table in indexer_position_embeddings)
        else:
            position_embeddings = self.rotary_emb(hidden_states, rope_positions)
        if self.config.hc_count > 1:
            hidden_states = hidden_states.repeat(1, 1, self.config.hc_count)  # (B, T, n·C): every stream starts equal

        for index, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer.layer_type],
                position_ids=text_positions,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **{CACHE_ARG: cache},  # the name transformers' gradient checkpointing looks for
                ple_input_ids=ple_input_ids,
                indexer_position_embeddings=indexer_position_embeddings,
                **kwargs,
            )
            if deepstack_visual_embeds is not None and index < len(deepstack_visual_embeds):
                hidden_states = add_at_positions(hidden_states, visual_pos_masks, deepstack_visual_embeds[index])
        return MoeModelOutputWithPast(
            last_hidden_state=self.final_hidden_state(hidden_states), **{CACHE_ARG: cache if use_cache else None}
        )

    def final_hidden_state(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The last layer's output made the head's input: the final norm, or the hyper-connections' last mix."""
        if self.config.hc_count > 1:
            return self.hyper_connection_mixer(hidden_states)[0]
        return self.norm(hidden_states)

    def position_history(self, rope_positions: torch.Tensor, batch: int, cache: Cache | None) -> torch.Tensor:
        """The RoPE positions of every slot, cached ones first: kept on the first indexed layer's cache (transformers'
        DynamicIndexedLayer, whose crop, reorder and reset keep it in step), as Qwen4-Exp keeps them; one row per
        batch row, so that beams reorder them."""
        if rope_positions.ndim == 2 and self.rotary_emb.mrope_section is not None:
            rope_positions = rope_positions[None].expand(3, -1, -1)  # one form to concatenate; the same tables
        rope_positions = rope_positions.expand(*rope_positions.shape[:-2], batch, -1)
        if cache is None:
            return rope_positions
        layer = cache.layers[self.config.layer_types.index("indexed_attention")]
        if not hasattr(layer, "indexer_position_ids"):
            raise ValueError(
                "this model's indexed_attention layers keep their index keys and positions in the cache: build it "
                "with DynamicCache(config=model.config)"
            )
        if layer.indexer_position_ids is not None:
            rope_positions = torch.cat([layer.indexer_position_ids, rope_positions], dim=-1)
        layer.indexer_position_ids = rope_positions
        return rope_positions

    @torch.no_grad()
    def reverse_embedding(self, inputs_embeds: torch.Tensor) -> torch.LongTensor:
        """The token ids whose embedding rows ``inputs_embeds`` are, for PLE when only embeddings are given. The
        table is compared a slice at a time (Qwen4-Exp compares all of it with every position at once: for its
        248k x 2048 table, half a gigabyte per token)."""
        table = self.embed_tokens.weight
        flat = inputs_embeds.reshape(-1, inputs_embeds.shape[-1])  # (N, C)
        ids = torch.full(flat.shape[:1], -1, dtype=torch.long, device=flat.device)
        rows = max(1, REVERSE_EMBEDDING_ELEMENTS // max(1, flat.numel()))  # table rows compared at a time
        for start in range(0, table.shape[0], rows):
            equal = (flat[:, None] == table[None, start : start + rows]).all(-1)  # (N, rows)
            found = equal.any(-1) & (ids < 0)  # the first row that matches, as the table orders them
            ids[found] = start + equal[found].int().argmax(-1)
        if bool((ids < 0).any()):
            raise ValueError(
                "PLE layers hash token ids, and some inputs_embeds rows are no row of the embedding table (image or "
                "audio embeddings): pass ple_input_ids, the ids those positions stand for"
            )
        return ids.view(inputs_embeds.shape[:-1])


@dataclass
class ThinkerCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    talker_logits (`torch.FloatTensor` of shape `(batch_size, sequence_length, talker_head_size)`, *optional*):
        The talker head's logits (Qwen3-Omni), present when the config sets ``talker_head_size``.
    """

    talker_logits: torch.FloatTensor | None = None


class ThinkerForCausalLM(ThinkerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__(config)
        self.model = ThinkerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        if config.talker_head_size:
            self.talker_head = nn.Linear(config.hidden_size, config.talker_head_size, bias=False)
        self.post_init()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ) -> dict:
        """As transformers prepares them (GenerationMixin's signature, which ``generate`` inspects), less the
        prompt's DeepStack features after the first forward: they belong to the prompt's visual positions (Qwen3-VL's
        model drops its pixels there alike)."""
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            cache=cache,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if not is_first_iteration:
            for key in DEEPSTACK_INPUTS:
                model_inputs.pop(key, None)
        return model_inputs

    def _expand_inputs_for_generation(
        self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None, **model_kwargs
    ) -> tuple[torch.LongTensor | None, dict]:
        """As transformers expands them for beams and ``num_return_sequences`` (each row's tensors repeated in place),
        and the DeepStack features with them: a list of (visual positions, hidden) tensors whose rows follow the
        batch's rows in ``visual_pos_masks``, which the generic expansion leaves as they are."""
        mask, features = model_kwargs.get("visual_pos_masks"), model_kwargs.get("deepstack_visual_embeds")
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs
        )
        if expand_size > 1 and mask is not None and features is not None:
            counts = mask.sum(-1).tolist()  # each row's visual positions
            model_kwargs["deepstack_visual_embeds"] = [
                torch.cat([part for part in layer.split(counts) for _ in range(expand_size)]) for layer in features
            ]
        return input_ids, model_kwargs

    @takes_old_cache_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,  # the cache's name before transformers 5.24
        visual_pos_masks: torch.Tensor | None = None,
        deepstack_visual_embeds: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ThinkerCausalLMOutputWithPast:
        r"""
        visual_pos_masks, deepstack_visual_embeds: a Qwen3-VL or Qwen3-Omni prompt's DeepStack inputs
            (``ThinkerModel``), named here so that ``generate`` takes them.
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits and self.config.num_experts > 0
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=either_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack_visual_embeds,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)  # (B, T', C)
        logits = self.lm_head(hidden_states)
        talker_logits = self.talker_head(hidden_states) if hasattr(self, "talker_head") else None

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits and outputs.router_logits:
            # The router saw the new tokens only: their columns of a 2-D mask (the whole mask, as transformers' own
            # classes pass it, fails on a step after a cache: one token's router logits against the context's mask).
            # Only a 2-D padding mask says which tokens are real; a 4-D mask, or the masks by layer type that
            # generate() builds for a static cache, are taken as every token counting (as with no mask).
            mask = None
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                mask = attention_mask[:, -outputs.last_hidden_state.shape[1] :]
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, mask
            )
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)

        return ThinkerCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            talker_logits=talker_logits,
            **{CACHE_ARG: getattr(outputs, CACHE_ARG)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


def register_base_model_for(config: ThinkerConfig) -> None:
    """transformers' generic heads build their base model with ``AutoModel.from_config(config)``. Loaded as remote
    code, where ``import thinker`` (which registers the Auto classes) never ran, the config's class comes from
    another copy of configuration_thinker than this module's (transformers keys each remote module by a hash of its
    own files), so ThinkerModel is registered for the config's own class."""
    AutoModel.register(type(config), ThinkerModel, exist_ok=True)


class ThinkerForSequenceClassification(GenericForSequenceClassification, ThinkerPreTrainedModel):
    """A score per label from the last non-padding token's hidden state."""

    def __init__(self, config: ThinkerConfig) -> None:
        register_base_model_for(config)
        super().__init__(config)


class ThinkerForTokenClassification(GenericForTokenClassification, ThinkerPreTrainedModel):
    """A score per label for every token."""

    def __init__(self, config: ThinkerConfig) -> None:
        register_base_model_for(config)
        super().__init__(config)


class ThinkerForQuestionAnswering(GenericForQuestionAnswering, ThinkerPreTrainedModel):
    """Start and end logits of an answer span, per token."""

    def __init__(self, config: ThinkerConfig) -> None:
        register_base_model_for(config)
        super().__init__(config)


# The Auto class each model class loads through. A saved folder's auto_map names them all, whichever one was saved
# (transformers records only that one): its copy of this file holds every head, and a Qwen3 folder loads any head.
AUTO_CLASSES = {
    "AutoModel": "ThinkerModel",
    "AutoModelForCausalLM": "ThinkerForCausalLM",
    "AutoModelForSequenceClassification": "ThinkerForSequenceClassification",
    "AutoModelForTokenClassification": "ThinkerForTokenClassification",
    "AutoModelForQuestionAnswering": "ThinkerForQuestionAnswering",
}


def name_every_auto_class(config: ThinkerConfig, module: str) -> None:
    """Put every class of ``AUTO_CLASSES`` in ``config.auto_map``, as found in ``module`` (this file's module name:
    ``thinker.modeling_thinker``, or ``transformers_modules.<hash>.modeling_thinker`` when loaded as remote code)."""
    file = module.split(".")[-1]
    named = {auto_class: f"{file}.{name}" for auto_class, name in AUTO_CLASSES.items()}
    config.auto_map = {**(getattr(config, "auto_map", None) or {}), **named}


__all__ = [
    "AUTO_CLASSES",
    "name_every_auto_class",
    "ThinkerPreTrainedModel",
    "ThinkerModel",
    "ThinkerForCausalLM",
    "ThinkerCausalLMOutputWithPast",
    "ThinkerForSequenceClassification",
    "ThinkerForTokenClassification",
    "ThinkerForQuestionAnswering",
]
