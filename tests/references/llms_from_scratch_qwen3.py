"""The from-scratch Qwen3 of seed 004 (the public LLMs-from-scratch Qwen3 notebook), as a parity reference.

The module and parameter names are the notebook's, so that this model's ``state_dict`` is the checkpoint format
the ``llms_from_scratch_qwen3`` converter family reads:

    tok_emb.weight
    trf_blocks.N.att.W_query.weight / W_key.weight / W_value.weight / out_proj.weight
    trf_blocks.N.att.q_norm.scale / k_norm.scale          (when qk_norm)
    trf_blocks.N.norm1.scale / norm2.scale
    trf_blocks.N.ff.fc1.weight / fc2.weight / fc3.weight   (silu(fc1(x)) * fc2(x) -> fc3)
    final_norm.scale
    out_head.weight

Numerics follow seed 004: RMSNorm computed in float32 with the scale applied before casting back
(``qwen3_compatible``), an optional ``shift`` (off, as in Qwen3), half-split RoPE from precomputed cos/sin tables
(non-persistent buffers, so not in the state dict), GQA by ``repeat_interleave`` of the key/value heads, no
biases anywhere, and the head fed ``x.to(dtype)``. The seed's RMSNorm listing has two typos (``def __init`` and
``torch.zeroes``); this file writes what they evidently mean.

As in the notebook, the Linear and Embedding layers are created in ``cfg["dtype"]`` while the norm scales stay
float32, so a bfloat16 checkpoint mixes dtypes.

The checkpoint format (``save_checkpoint``): ``model.pth``, a plain ``torch.save(model.state_dict())``, and
``config.json``, the notebook's config dict (``QWEN_CONFIG_06_B``-style keys) with ``dtype`` written as a string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.pth"
CONFIG_KEYS = (
    "vocab_size",
    "context_length",
    "emb_dim",
    "n_heads",
    "n_layers",
    "hidden_dim",
    "head_dim",
    "qk_norm",
    "n_kv_groups",
    "rope_base",
    "dtype",
)

# The shape of the notebook's Qwen3-0.6B dict, for reference and for meta-device mapping checks.
QWEN_CONFIG_06_B: dict[str, Any] = {
    "vocab_size": 151_936,
    "context_length": 40_960,
    "emb_dim": 1024,
    "n_heads": 16,
    "n_layers": 28,
    "hidden_dim": 3072,
    "head_dim": 128,
    "qk_norm": True,
    "n_kv_groups": 8,
    "rope_base": 1_000_000.0,
    "dtype": torch.bfloat16,
}


class RMSNorm(nn.Module):
    def __init__(self, emb_dim: int, eps: float = 1e-6, bias: bool = False, qwen3_compatible: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.qwen3_compatible = qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        norm_x = x * torch.rsqrt(variance + self.eps) * self.scale
        if self.shift is not None:
            norm_x = norm_x + self.shift
        return norm_x.to(input_dtype)


def compute_rope_params(
    head_dim: int, theta_base: float = 10_000, context_length: int = 4096, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (context_length, head_dim): the angles of the first half repeated for the second half."""
    assert head_dim % 2 == 0, "head_dim must be even"
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=dtype)[: head_dim // 2].float() / head_dim))
    positions = torch.arange(context_length, dtype=dtype)
    angles = positions[:, None] * inv_freq[None, :]  # (context_length, head_dim/2)
    angles = torch.cat([angles, angles], dim=1)  # (context_length, head_dim)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x (B, H, T, head_dim): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    seq_len, head_dim = x.shape[2], x.shape[3]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    cos, sin = cos[:seq_len][None, None], sin[:seq_len][None, None]  # (1, 1, T, head_dim)
    rotated = torch.cat((-x2, x1), dim=-1)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class FeedForward(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], dtype=cfg["dtype"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(nn.functional.silu(self.fc1(x)) * self.fc2(x))


class GroupedQueryAttention(nn.Module):
    def __init__(
        self,
        d_in: int,
        num_heads: int,
        num_kv_groups: int,
        head_dim: int | None = None,
        qk_norm: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.num_heads = num_heads
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim if head_dim is not None else d_in // num_heads
        self.d_out = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=1e-6)
            self.k_norm = RMSNorm(self.head_dim, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, num_tokens, _ = x.shape
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            queries = self.q_norm(queries)
        if self.k_norm is not None:
            keys = self.k_norm(keys)
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)  # (B, H, T, head_dim)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.att = GroupedQueryAttention(
            d_in=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            head_dim=cfg["head_dim"],
            num_kv_groups=cfg["n_kv_groups"],
            qk_norm=cfg["qk_norm"],
            dtype=cfg["dtype"],
        )
        self.ff = FeedForward(cfg)
        self.norm1 = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.norm2 = RMSNorm(cfg["emb_dim"], eps=1e-6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.norm1(x), mask, cos, sin)
        return x + self.ff(self.norm2(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = RMSNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        head_dim = cfg["head_dim"] if cfg["head_dim"] is not None else cfg["emb_dim"] // cfg["n_heads"]
        cos, sin = compute_rope_params(head_dim, theta_base=cfg["rope_base"], context_length=cfg["context_length"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(in_idx)  # (B, T, emb_dim)
        num_tokens = x.shape[1]
        mask = torch.triu(torch.ones(num_tokens, num_tokens, device=x.device, dtype=torch.bool), diagonal=1)
        for block in self.trf_blocks:
            x = block(x, mask, self.cos, self.sin)
        x = self.final_norm(x)
        return self.out_head(x.to(self.cfg["dtype"]))  # (B, T, vocab_size)


def randomize_(model: nn.Module, seed: int = 0, std: float = 0.2) -> nn.Module:
    """Random values in every parameter (norm scales around one), so that no mapping slip hides behind an
    initial value."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            param.copy_(1.0 + noise if name.endswith("scale") else noise)
    return model


def config_to_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """The notebook's dict with ``dtype`` as its name ("bfloat16"), the one value JSON cannot hold."""
    return {key: (str(value).removeprefix("torch.") if key == "dtype" else value) for key, value in cfg.items()}


def config_from_json(data: dict[str, Any]) -> dict[str, Any]:
    return {key: (getattr(torch, value) if key == "dtype" else value) for key, value in data.items()}


def save_checkpoint(model: Qwen3Model, folder: str | Path) -> Path:
    """Writes ``model.pth`` (a plain state dict) and ``config.json`` (the notebook's config dict) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config_to_json(model.cfg), indent=2) + "\n")
    torch.save(model.state_dict(), folder / WEIGHTS_NAME)
    return folder


def load_checkpoint(folder: str | Path) -> Qwen3Model:
    folder = Path(folder)
    model = Qwen3Model(config_from_json(json.loads((folder / CONFIG_NAME).read_text())))
    model.load_state_dict(torch.load(folder / WEIGHTS_NAME, map_location="cpu", weights_only=True))
    return model.eval()


def tiny_config(dtype: torch.dtype = torch.float32, qk_norm: bool = True) -> dict[str, Any]:
    """QWEN_CONFIG_06_B's shape in miniature: GQA 4 -> 2, head_dim (16) independent of emb_dim / n_heads (8)."""
    return {
        "vocab_size": 101,
        "context_length": 64,
        "emb_dim": 32,
        "n_heads": 4,
        "n_layers": 2,
        "hidden_dim": 48,
        "head_dim": 16,
        "qk_norm": qk_norm,
        "n_kv_groups": 2,
        "rope_base": 1_000_000.0,
        "dtype": dtype,
    }
