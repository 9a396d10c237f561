"""μOmni ThinkerLM, written from seeds 000 and 001 as the reference for the ``uomni`` converter family.

What the seeds fix, and this file follows:
  - ``tok_emb`` (nn.Embedding), ``blocks.N``, a final ``norm``, and ``head = nn.Linear(d_model, vocab_size)``:
    a plain Linear, so it has a bias (seed 000, "Output Head"); no embedding scaling in ThinkerLM's forward.
  - pre-norm blocks ``x + attn(norm1(x))``, ``x + mlp(norm2(x))`` (seed 001, TransformerBlock / seed 000 shapes).
  - RMSNorm with a learnable ``scale``: ``x / sqrt(mean(x²) + 1e-6) * scale``, in the input dtype (seed 000).
  - attention without biases: one fused ``qkv = Linear(d, 3d)`` for standard attention, separate ``q``, ``k``,
    ``v`` with ``kv_groups`` key/value heads under GQA (seed 000, "Q/K/V Projections"); causal softmax attention
    scaled by 1/sqrt(dk).
  - SwiGLU MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))`` without biases (seed 000, "MLP (SwiGLU)").
  - interleaved RoPE: the pairs (0, 1), (2, 3), ... of each head are rotated by ``pos / θ^(2i/dk)`` (seed 001,
    ``apply_rope`` with ``x[..., 0::2]`` / ``x[..., 1::2]``). Transformers-style models rotate the halves
    (i, i + dk/2) instead, so a converter permutes the rows of q and k (see ``interleaved_to_half_permutation``).

Where the seeds are silent this file decides, and says so:
  - the output projection is ``attn.o`` (seed 000 elides it; short names like ``q``/``k``/``v``);
  - the fused ``qkv`` splits as ``q, k, v = qkv(x).chunk(3, -1)``, each then viewed as (heads, dk);
  - GQA shares key/value head g with the query heads g·r ... g·r + r - 1 (``repeat_interleave``), and
    ``kv_groups`` defaults to ``n_heads // 2`` (seed 000's example: 4 query heads, 2 key/value heads);
  - only the SwiGLU dense MLP is modelled: the seed's MoE ("output = selected[0](x) + selected[1](x)") does not
    fix the routing weights, so ``use_moe=True`` is refused rather than guessed.

The checkpoint format (``save_checkpoint``): a folder holding ``config.json`` with the keys of seed 000's
``configs/thinker_tiny.json`` (vocab_size, n_layers, d_model, n_heads, d_ff, dropout, rope_theta, ctx_len,
use_swiglu, use_gqa, use_moe; plus ``kv_groups`` when GQA is on, which the seed's file does not show) and
``thinker.pt``, a plain ``torch.save(model.state_dict())``. The seeds do not name the weights file; RoPE has no
parameters or persistent buffers, so the state dict holds only the weights listed above.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "thinker.pt"


@dataclass
class UOmniConfig:
    """Seed 000's ``configs/thinker_tiny.json``; the defaults are that file's values."""

    vocab_size: int = 5000
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    rope_theta: float = 10000.0
    ctx_len: int = 512
    use_swiglu: bool = True
    use_gqa: bool = False
    use_moe: bool = False
    kv_groups: int | None = None  # GQA only; None: n_heads // 2

    def __post_init__(self) -> None:
        if not self.use_swiglu or self.use_moe:
            raise NotImplementedError("the reference models the SwiGLU dense MLP only (see the module docstring)")
        if self.use_gqa and self.kv_groups is None:
            self.kv_groups = max(1, self.n_heads // 2)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_groups if self.use_gqa else self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return x / rms * self.scale


def apply_interleaved_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Seed 001's rotation of each (even, odd) pair; x is (B, H, T, dk), pos is (T,)."""
    dk = x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, dk, 2, device=x.device, dtype=torch.float32) / dk))
    angles = pos.to(torch.float32)[:, None] * freqs[None, :]  # (T, dk/2)
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    x_real, x_imag = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x_real * cos - x_imag * sin
    out[..., 1::2] = x_real * sin + x_imag * cos
    return out


class Attention(nn.Module):
    def __init__(self, cfg: UOmniConfig) -> None:
        super().__init__()
        self.h, self.dk, self.theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        self.use_gqa = cfg.use_gqa
        d = cfg.d_model
        if self.use_gqa:
            self.kv_groups = cfg.kv_groups
            self.q = nn.Linear(d, self.h * self.dk, bias=False)
            self.k = nn.Linear(d, self.kv_groups * self.dk, bias=False)
            self.v = nn.Linear(d, self.kv_groups * self.dk, bias=False)
        else:
            self.kv_groups = self.h
            self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.use_gqa:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(B, T, self.h, self.dk).transpose(1, 2)  # (B, h, T, dk)
        k = k.view(B, T, self.kv_groups, self.dk).transpose(1, 2)  # (B, g, T, dk)
        v = v.view(B, T, self.kv_groups, self.dk).transpose(1, 2)
        pos = torch.arange(T, device=x.device)
        q, k = apply_interleaved_rope(q, pos, self.theta), apply_interleaved_rope(k, pos, self.theta)
        repeat = self.h // self.kv_groups
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (B, h, T, dk)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dk)  # (B, h, T, T)
        future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(B, T, self.h * self.dk)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, ff, bias=False)
        self.up_proj = nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        return self.down_proj(gate * torch.sigmoid(gate) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: UOmniConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)
        self.drop = nn.Dropout(cfg.dropout)  # no parameters; identity in eval mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class ThinkerLM(nn.Module):
    def __init__(self, cfg: UOmniConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor | None = None, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_emb(x) if embeddings is None else embeddings  # (B, T, d_model)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, T, vocab_size)


def randomize_(model: nn.Module, seed: int = 0, std: float = 0.2) -> nn.Module:
    """Random values in every parameter, norms and the head bias included, so that no mapping slip can hide
    behind an initial value of one or zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            param.copy_(1.0 + noise if name.endswith("scale") else noise)
    return model


def save_checkpoint(model: ThinkerLM, folder: str | Path) -> Path:
    """Writes ``config.json`` (seed 000's keys) and ``thinker.pt`` (a plain state dict) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = asdict(model.cfg)
    if not model.cfg.use_gqa:
        del config["kv_groups"]  # not a key of the seed's file; only written when it means something
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    torch.save(model.state_dict(), folder / WEIGHTS_NAME)
    return folder


def load_checkpoint(folder: str | Path) -> ThinkerLM:
    folder = Path(folder)
    model = ThinkerLM(UOmniConfig(**json.loads((folder / CONFIG_NAME).read_text())))
    model.load_state_dict(torch.load(folder / WEIGHTS_NAME, map_location="cpu", weights_only=True))
    return model.eval()


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Row order, within one head, that turns interleaved-pair RoPE into half-split RoPE: even rows, then odd.

    Pair i of the interleaved layout is (2i, 2i+1); the half-split layout rotates (i, i + head_dim/2) by the
    same angle. Reordering the output rows of q and k (and nothing else: q·k is invariant when both are permuted
    alike) makes the half-split rotation compute exactly what the interleaved one did.
    """
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def tiny_config(gqa: bool = False) -> UOmniConfig:
    """A few thousand parameters, with GQA 4 query heads sharing 2 key/value heads (as in seed 000)."""
    return UOmniConfig(vocab_size=97, n_layers=2, d_model=32, n_heads=4, d_ff=48, ctx_len=64, use_gqa=gqa)
