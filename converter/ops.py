"""Declared tensor operations: what a mapping rule does to its source tensors to make the Thinker ones.

Every operation takes a list of tensors and returns a list of tensors, and knows its inverse, so that a family's
table also describes the way back (a Thinker folder written out in the source family's layout). Operations never
read files or look at names; they see tensors and the target ``ThinkerConfig`` (for head counts and sizes).

The engine runs each operation twice: once on meta tensors while planning, which yields the output shapes from the
headers alone and fails on impossible shapes before any byte is read, and once on the real tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError

SizesFn = Callable[[ThinkerConfig], Sequence[int]]


class Op(ABC):
    """A reversible transformation of a list of tensors; ``inverse()`` undoes it exactly.

    ``rearranges``: the outputs hold exactly the input values, moved (split, joined, stacked, transposed, rows
    reordered), so the engine's value check (NaN, Inf, float16 range) may run on the inputs as they are read rather
    than on the outputs. An operation that computes new values leaves it False and has its outputs checked.
    """

    rearranges: bool = False

    @abstractmethod
    def __call__(self, tensors: Sequence[torch.Tensor], config: ThinkerConfig) -> list[torch.Tensor]: ...

    @abstractmethod
    def inverse(self) -> Op: ...


def _one(op: Op, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{type(op).__name__} takes one tensor, got {len(tensors)}")
    return tensors[0]


@dataclass(frozen=True)
class Identity(Op):
    """Tensors pass unchanged: a rename (the names live in the rule, not here)."""

    rearranges = True

    def __call__(self, tensors, config):
        return list(tensors)

    def inverse(self) -> Op:
        return self


@dataclass(frozen=True)
class Transpose(Op):
    """Swap two dimensions of each tensor: GPT-2's ``Conv1D`` stores (in, out) where ``nn.Linear`` wants (out, in)."""

    rearranges = True

    dim0: int = 0
    dim1: int = 1

    def __call__(self, tensors, config):
        return [tensor.transpose(self.dim0, self.dim1) for tensor in tensors]

    def inverse(self) -> Op:
        return self


@dataclass(frozen=True)
class Split(Op):
    """Cut one tensor along ``dim`` into ``parts`` equal pieces, or into ``sizes(config)`` (a fused qkv with GQA)."""

    rearranges = True

    dim: int = 0
    parts: int | None = None
    sizes: SizesFn | None = None

    def __post_init__(self) -> None:
        if (self.parts is None) == (self.sizes is None):
            raise ValueError("Split takes exactly one of parts= or sizes=")

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        if self.sizes is not None:
            sizes = list(self.sizes(config))
            if sum(sizes) != tensor.shape[self.dim]:
                raise ValueError(f"cannot split dimension {self.dim} of {tuple(tensor.shape)} into {sizes}")
            return list(tensor.split(sizes, dim=self.dim))
        if tensor.shape[self.dim] % self.parts:
            raise ValueError(f"cannot split dimension {self.dim} of {tuple(tensor.shape)} into {self.parts} parts")
        return list(tensor.chunk(self.parts, dim=self.dim))

    def inverse(self) -> Op:
        return Concatenate(dim=self.dim, parts=self.parts, sizes=self.sizes)


@dataclass(frozen=True)
class Concatenate(Op):
    """Join tensors along ``dim``; ``parts`` / ``sizes`` describe the pieces so that the inverse can cut them again."""

    rearranges = True

    dim: int = 0
    parts: int | None = None
    sizes: SizesFn | None = None

    def __post_init__(self) -> None:
        if (self.parts is None) == (self.sizes is None):
            raise ValueError("Concatenate takes exactly one of parts= or sizes=")

    def __call__(self, tensors, config):
        return [torch.cat(list(tensors), dim=self.dim)]

    def inverse(self) -> Op:
        return Split(dim=self.dim, parts=self.parts, sizes=self.sizes)


@dataclass(frozen=True)
class JoinParts(Op):
    """The pieces a checkpoint stores one tensor in (a ``{part}`` template: as many as the config's
    ``split_ngram_parts``) joined along ``dim``, as transformers' ``Concatenate(num_shards_attribute=...)`` loads
    Qwen4-Exp's n-gram tables."""

    rearranges = True

    dim: int = 0

    def __call__(self, tensors, config):
        other = [[size for i, size in enumerate(t.shape) if i != self.dim % t.dim()] for t in tensors]
        if any(sizes != other[0] for sizes in other):
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"pieces of one tensor must match but along dimension {self.dim}: {shapes}")
        return [torch.cat(list(tensors), dim=self.dim)]

    def inverse(self) -> Op:
        return ChunkParts(dim=self.dim)


@dataclass(frozen=True)
class ChunkParts(Op):
    """One tensor cut along ``dim`` into the config's ``split_ngram_parts`` pieces as ``torch.chunk`` cuts it (the
    first pieces the larger), which is how transformers' ``Chunk`` writes Qwen4-Exp's n-gram tables back."""

    rearranges = True

    dim: int = 0

    def __call__(self, tensors, config):
        tensor, parts = _one(self, tensors), config.split_ngram_parts
        pieces = tensor.chunk(parts, dim=self.dim)
        if len(pieces) != parts:
            raise ValueError(
                f"dimension {self.dim} of {tuple(tensor.shape)} cannot be cut into split_ngram_parts={parts} pieces"
            )
        return list(pieces)

    def inverse(self) -> Op:
        return JoinParts(dim=self.dim)


@dataclass(frozen=True)
class StackExperts(Op):
    """Per-expert 2-D tensors into one fused 3-D tensor: (E, ...) by stacking, then the ``parts`` joined on ``dim``.

    The inputs come ordered part-major: ``[gate_0 .. gate_{E-1}, up_0 .. up_{E-1}]`` for ``parts=2``, which gives
    ``gate_up_proj`` (E, 2·I, C) = per expert [gate; up] along dim 1, the layout transformers 5 fuses to at load.
    """

    rearranges = True

    parts: int = 1
    dim: int = 1

    def __call__(self, tensors, config):
        if len(tensors) % self.parts:
            raise ValueError(f"{len(tensors)} expert tensors do not divide into {self.parts} parts")
        per_part = len(tensors) // self.parts
        stacks = [torch.stack(list(tensors[i * per_part : (i + 1) * per_part])) for i in range(self.parts)]
        return [stacks[0] if self.parts == 1 else torch.cat(stacks, dim=self.dim)]

    def inverse(self) -> Op:
        return UnstackExperts(parts=self.parts, dim=self.dim)


@dataclass(frozen=True)
class ExpertsToThinkerLayout(Op):
    """Fused 3-D experts stored transposed, (E, C, 2·I) for ``gate_up_proj`` and (E, I, C) for ``down_proj`` (as
    Qwen3-VL-MoE's Hub checkpoints store them), into the Thinker's (E, 2·I, C) / (E, C, I); a tensor already in that
    shape (transformers' ``save_pretrained`` writes it so) passes as it is. transformers' own loading decides the same
    way, by the expected shape (its ``Transpose(check_dims=True)``), so both read a square expert alike."""

    rearranges = True

    projection: str = "gate_up_proj"  # or "down_proj"

    def thinker_shape(self, config: ThinkerConfig) -> tuple[int, int, int]:
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        return (experts, 2 * inner, hidden) if self.projection == "gate_up_proj" else (experts, hidden, inner)

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [tensor if tuple(tensor.shape) == self.thinker_shape(config) else tensor.transpose(1, 2)]

    def inverse(self) -> Op:
        return Identity()  # written back in the Thinker's layout, as save_pretrained writes it


@dataclass(frozen=True)
class UnstackExperts(Op):
    """A fused 3-D expert tensor back into per-expert 2-D tensors, part-major (the inverse of ``StackExperts``)."""

    rearranges = True

    parts: int = 1
    dim: int = 1

    def __call__(self, tensors, config):
        fused = _one(self, tensors)
        pieces = fused.chunk(self.parts, dim=self.dim) if self.parts > 1 else (fused,)
        return [expert for piece in pieces for expert in piece.unbind(0)]

    def inverse(self) -> Op:
        return StackExperts(parts=self.parts, dim=self.dim)


@dataclass(frozen=True)
class AsRow(Op):
    """A vector as a one-row matrix: llama.cpp stores Qwen2-MoE's shared-expert gate (an ``nn.Linear(C, 1)``, weight
    (1, C)) as the vector (C,). A tensor that kept its (1, C) shape passes unchanged."""

    rearranges = True

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [tensor.reshape(1, -1) if tensor.ndim == 1 else tensor]

    def inverse(self) -> Op:
        return AsVector()


@dataclass(frozen=True)
class AsVector(Op):
    """A one-row matrix as a vector, the layout llama.cpp stores (the inverse of ``AsRow``)."""

    rearranges = True

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        if tensor.ndim != 2 or tensor.shape[0] != 1:
            raise ValueError(f"AsVector takes a one-row matrix, got {tuple(tensor.shape)}")
        return [tensor.reshape(-1)]

    def inverse(self) -> Op:
        return AsRow()


@dataclass(frozen=True)
class Unsqueeze(Op):
    """A size-1 dimension inserted at ``dim``: llama.cpp stores a depthwise conv1d weight (C, 1, K) squeezed to (C, K).
    A tensor that kept its size-1 dimension passes unchanged."""

    rearranges = True

    dim: int = 1
    ndim: int = 3  # the tensor's dimensions once unsqueezed

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [tensor if tensor.ndim == self.ndim else tensor.unsqueeze(self.dim)]

    def inverse(self) -> Op:
        return Squeeze(self.dim, self.ndim)


@dataclass(frozen=True)
class Squeeze(Op):
    """The size-1 dimension ``dim`` removed (the inverse of ``Unsqueeze``)."""

    rearranges = True

    dim: int = 1
    ndim: int = 3

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        if tensor.ndim != self.ndim or tensor.shape[self.dim] != 1:
            raise ValueError(
                f"Squeeze({self.dim}) takes {self.ndim} dimensions, size 1 there; got {tuple(tensor.shape)}"
            )
        return [tensor.squeeze(self.dim)]

    def inverse(self) -> Op:
        return Unsqueeze(self.dim, self.ndim)


@dataclass(frozen=True, eq=False)
class FromConfig(Op):
    """A tensor the Thinker derives from its config and so does not store, written for a family whose class saves
    it (Qwen4-Exp's hash buffers, ``Family.derived_back``): no inputs, the values given. The way back only: the
    forward direction drops such a tensor (``Family.dropped``), so there is nothing to invert."""

    values: torch.Tensor

    def __call__(self, tensors, config):
        if tensors:
            raise ValueError(f"FromConfig takes no tensors, got {len(tensors)}")
        return [self.values.clone()]

    def inverse(self) -> Op:
        raise TypeError("a tensor derived from the config has no inverse: the forward direction drops it")


# --- values llama.cpp stores transformed -----------------------------------------------------------------------------
#
# Computed in float32 and cast back, as transformers' GGUF loading computes them (its ``SubtractOne`` and
# ``LogNegate``), so that a Thinker converted from a GGUF file holds the very values of transformers' model.


@dataclass(frozen=True)
class Offset(Op):
    """``amount`` added to every value: llama.cpp stores zero-centred RMSNorm weights as ``1 + w`` (Qwen3.5's),
    which ``Offset(-1.0)`` undoes."""

    amount: float

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [(tensor.float() + self.amount).to(tensor.dtype)]

    def inverse(self) -> Op:
        return Offset(-self.amount)


@dataclass(frozen=True)
class LogOfNegated(Op):
    """``log(-x)``: llama.cpp stores a Gated DeltaNet layer's ``A_log`` as the decay rate ``-exp(A_log)`` (its
    ``ssm_a``). A value that is not negative has no logarithm and becomes NaN, which the engine's value check
    reports with the tensor's name."""

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [torch.log(-tensor.float()).to(tensor.dtype)]

    def inverse(self) -> Op:
        return NegatedExp()


@dataclass(frozen=True)
class NegatedExp(Op):
    """``-exp(x)``, llama.cpp's ``ssm_a`` from ``A_log`` (the inverse of ``LogOfNegated``)."""

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        return [(-torch.exp(tensor.float())).to(tensor.dtype)]

    def inverse(self) -> Op:
        return LogOfNegated()


# --- value heads, tiled or grouped ---------------------------------------------------------------------------------
#
# A Gated DeltaNet layer with more value heads than key heads (r = value heads per key head) serves key head g with
# value heads g·r ... g·r + r - 1 in transformers' order ("grouped": v0k0 v1k0 v0k1 v1k1, written v{j}k{g}).
# llama.cpp's converter reorders them so that its ggml broadcast can repeat the key heads ("tiled": v0k0 v0k1 v1k0
# v1k1), on every tensor with a row (or, for out_proj, a column) per value head or per value element. transformers'
# GGUF loading undoes it (``TiledToGroupedRows``); so does this.


def _tiled_from_grouped(config: ThinkerConfig, per_head: int) -> torch.Tensor:
    """For each position in tiled order, the grouped position it holds (``per_head`` rows or columns per head)."""
    key_heads = config.linear_num_key_heads
    per_key = config.linear_num_value_heads // key_heads
    grouped = torch.arange(key_heads * per_key * per_head)
    return grouped.reshape(key_heads, per_key, per_head).transpose(0, 1).reshape(-1)


@dataclass(frozen=True)
class TiledToGroupedValueHeads(Op):
    """Value heads from llama.cpp's tiled order into transformers' grouped one, along ``dim``.

    ``elements``: each head spans ``linear_value_head_dim`` rows (True: in_proj_z, the value part of in_proj_qkv
    and conv1d, out_proj's columns) or one (False: A_log, dt_bias, in_proj_a, in_proj_b). ``after_query_key``: the
    value rows follow the query and key rows (in_proj_qkv, conv1d), which stay where they are."""

    rearranges = True

    elements: bool
    dim: int = 0
    after_query_key: bool = False
    to_grouped: bool = True

    def __call__(self, tensors, config):
        tensor = _one(self, tensors)
        order = _tiled_from_grouped(config, config.linear_value_head_dim if self.elements else 1)
        if self.to_grouped:
            order = torch.argsort(order)
        start = 2 * config.linear_key_head_dim * config.linear_num_key_heads if self.after_query_key else 0
        if tensor.shape[self.dim] != start + len(order):
            raise ValueError(
                f"dimension {self.dim} of {tuple(tensor.shape)} is not {start} query/key + {len(order)} value entries"
            )
        head, values = tensor.split([start, len(order)], dim=self.dim)
        return [torch.cat([head, values.index_select(self.dim, order.to(tensor.device))], dim=self.dim)]

    def inverse(self) -> Op:
        return TiledToGroupedValueHeads(self.elements, self.dim, self.after_query_key, not self.to_grouped)


# --- RoPE row order ------------------------------------------------------------------------------------------------
#
# Thinker (like Hugging Face Llama and Qwen) rotates each head's dimensions in two halves: dimension j pairs with
# j + head_dim/2 (``rotate_half``). Other code rotates adjacent pairs (2j, 2j+1): ggml's default ("normal") RoPE,
# which llama.cpp uses for the llama architecture, and μOmni's ``apply_rope``. The two are the same model once the
# rows of q_proj and k_proj (weights and biases) are reordered within each head: HF's pair (j, j + head_dim/2) sits
# on rows (2j, 2j+1) of the interleaved layout, i.e. reshape(n_head, 2, head_dim/2, ...) with the two middle axes
# swapped. llama.cpp's convert_hf_to_gguf.py applies that permutation to llama models (``LlamaModel.permute``), and
# transformers' GGUF loader undoes it (``LlamaTensorProcessor``). The head count is the tensor's own:
# num_attention_heads for q, num_key_value_heads for k.


def _rope_heads_view(weight: torch.Tensor, n_head: int) -> tuple[int, int]:
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ThinkerError(
            f"a q/k projection with {rows} rows cannot hold {n_head} heads of even size; "
            "the file's head counts do not match its tensors"
        )
    return n_head, rows // n_head // 2


def permute_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Half-split layout -> interleaved layout (what llama.cpp's convert_hf_to_gguf.py does); weight or bias."""
    heads, half = _rope_heads_view(weight, n_head)
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Interleaved layout -> half-split layout: the inverse of ``permute_llama_rope``; weight or bias."""
    heads, half = _rope_heads_view(weight, n_head)
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class InterleavedToHalfRope(Op):
    """Reorder q/k projection rows from interleaved RoPE pairs (2j, 2j+1) to Thinker's half split (j, j + hs/2).

    ``heads`` names the config field holding the tensor's head count (``num_attention_heads`` for q,
    ``num_key_value_heads`` for k). Applies to weights and biases alike: only dimension 0 is reordered.
    """

    rearranges = True

    heads: str

    def __call__(self, tensors, config):
        return [unpermute_llama_rope(tensor, getattr(config, self.heads)) for tensor in tensors]

    def inverse(self) -> Op:
        return HalfToInterleavedRope(self.heads)


@dataclass(frozen=True)
class HalfToInterleavedRope(Op):
    """Thinker's half-split q/k rows back to interleaved pairs (the inverse of ``InterleavedToHalfRope``)."""

    rearranges = True

    heads: str

    def __call__(self, tensors, config):
        return [permute_llama_rope(tensor, getattr(config, self.heads)) for tensor in tensors]

    def inverse(self) -> Op:
        return InterleavedToHalfRope(self.heads)


class Each(Op):
    """One operation per tensor, by position: ``Each(a, b, c)`` applies ``a`` to the first tensor, ``b`` to the
    second and ``c`` to the third (a fused qkv split into q, k, v, of which only q and k need a RoPE reorder)."""

    def __init__(self, *ops: Op) -> None:
        self.ops = ops

    @property
    def rearranges(self) -> bool:
        return all(op.rearranges for op in self.ops)

    def __call__(self, tensors, config):
        if len(tensors) != len(self.ops):
            raise ValueError(f"Each has {len(self.ops)} operations for {len(tensors)} tensors")
        return [out for op, tensor in zip(self.ops, tensors, strict=True) for out in op([tensor], config)]

    def inverse(self) -> Op:
        return Each(*(op.inverse() for op in self.ops))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Each) and self.ops == other.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __repr__(self) -> str:
        return f"Each{self.ops!r}"


class Chain(Op):
    """Operations applied in order; the inverse applies their inverses in reverse order."""

    def __init__(self, *ops: Op) -> None:
        self.ops = ops

    @property
    def rearranges(self) -> bool:
        return all(op.rearranges for op in self.ops)

    def __call__(self, tensors, config):
        for op in self.ops:
            tensors = op(tensors, config)
        return list(tensors)

    def inverse(self) -> Op:
        return Chain(*(op.inverse() for op in reversed(self.ops)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and self.ops == other.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __repr__(self) -> str:
        return f"Chain{self.ops!r}"


# --- rows grouped per head -----------------------------------------------------------------------------------------
#
# Qwen3-Next fuses its Gated DeltaNet input projections and groups their rows per key head: in_proj_qkvz holds, for
# each key head g in turn, [q_g, k_g, v_g, z_g] (v_g and z_g covering the value heads that key head serves), and
# in_proj_ba holds [b_g, a_g]. Qwen3.5 and the Thinker keep one projection per part with every head of that part
# together (in_proj_qkv = all q, all k, all v; in_proj_z; in_proj_b; in_proj_a). The same linear maps, rows reordered.

# config -> (number of groups, rows of each part within one group)
GroupLayout = Callable[[ThinkerConfig], tuple[int, Sequence[int]]]


def _group_layout(op: Op, layout: GroupLayout, outputs: Sequence[int], config: ThinkerConfig):
    groups, parts = layout(config)
    parts = list(parts)
    if sum(outputs) != len(parts):
        raise ValueError(f"{type(op).__name__}: outputs {tuple(outputs)} do not cover the {len(parts)} parts")
    return groups, parts


@dataclass(frozen=True)
class SplitHeadGroups(Op):
    """One tensor whose rows come group by group, each group holding a slice of every part (``layout``: the group
    count and the rows of each part in a group), into tensors that hold the parts one after another, each part with
    every group's rows in group order. ``outputs`` says how many consecutive parts each output tensor joins:
    ``(3, 1)`` makes [q | k | v] and [z] of Qwen3-Next's [q_g, k_g, v_g, z_g] groups. Dimension 0 only, so it
    applies to weights and biases alike."""

    rearranges = True

    layout: GroupLayout
    outputs: tuple[int, ...]

    def __call__(self, tensors, config):
        fused = _one(self, tensors)
        groups, parts = _group_layout(self, self.layout, self.outputs, config)
        if fused.shape[0] != groups * sum(parts):
            rows = " + ".join(map(str, parts))
            raise ValueError(f"{fused.shape[0]} rows are not {groups} head groups of {sum(parts)} rows ({rows})")
        rest = fused.shape[1:]
        pieces = fused.reshape(groups, sum(parts), *rest).split(parts, dim=1)  # per part: (groups, rows, ...)
        by_part = [piece.reshape(groups * rows, *rest) for piece, rows in zip(pieces, parts, strict=True)]
        joined, start = [], 0
        for count in self.outputs:
            joined.append(torch.cat(by_part[start : start + count]) if count > 1 else by_part[start])
            start += count
        return joined

    def inverse(self) -> Op:
        return JoinHeadGroups(self.layout, self.outputs)


@dataclass(frozen=True)
class JoinHeadGroups(Op):
    """The inverse of ``SplitHeadGroups``: tensors holding the parts one after another back into one tensor whose
    rows come group by group (Qwen3.5's split projections into Qwen3-Next's fused ones)."""

    rearranges = True

    layout: GroupLayout
    outputs: tuple[int, ...]

    def __call__(self, tensors, config):
        groups, parts = _group_layout(self, self.layout, self.outputs, config)
        if len(tensors) != len(self.outputs):
            raise ValueError(f"JoinHeadGroups joins {len(self.outputs)} tensors, got {len(tensors)}")
        by_part, start = [], 0
        for tensor, count in zip(tensors, self.outputs, strict=True):
            sizes = [groups * rows for rows in parts[start : start + count]]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{tensor.shape[0]} rows are not the {' + '.join(map(str, sizes))} rows of its parts")
            by_part += tensor.split(sizes)
            start += count
        rest = tensors[0].shape[1:]
        grouped = [part.reshape(groups, rows, *rest) for part, rows in zip(by_part, parts, strict=True)]
        return [torch.cat(grouped, dim=1).reshape(groups * sum(parts), *rest)]

    def inverse(self) -> Op:
        return SplitHeadGroups(self.layout, self.outputs)
