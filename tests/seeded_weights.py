"""Seeded weights for tests, shared by the model, converter and export tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def randomize_parameters(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fills every parameter with seeded values that have no trivial structure: matrices ~ N(0, 1/fan_in), norm
    scales ~ 1 + N(0, 0.1²), biases ~ N(0, 0.1²). Default inits (zero biases, unit norms) would hide a missing bias or
    a norm applied to the wrong tensor."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim > 1:
                param.copy_(noise / param.shape[-1] ** 0.5)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(1.0 + 0.1 * noise)
    return model


def draw_weights(model: torch.nn.Module, seed: int = 0, scale: float = 0.2, keep=lambda name: True) -> torch.nn.Module:
    """Every parameter whose name ``keep`` takes drawn from N(0, scale²), a norm's (a name holding "norm") around one:
    the references' larger weights, under which a tiny model's attention and RoPE matter and its greedy tokens vary."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if keep(name):
                noise = torch.randn(parameter.shape, generator=generator) * scale
                parameter.copy_(1.0 + noise if "norm" in name else noise)
    return model


def rewritten_copy(source: Path, folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """A copy of the checkpoint folder ``source`` at ``folder`` whose model.safetensors ``change`` edited in place
    (a dict of its tensors, by name)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
