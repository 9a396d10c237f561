"""Fixtures for the converter tests: tiny reference checkpoints saved to disk, and a quiet ``convert``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from convert_helpers import build_reference
from transformers import PreTrainedConfig, PreTrainedModel

from converter.convert import ConversionResult, convert


@pytest.fixture
def save_reference(tmp_path: Path) -> Callable[..., tuple[PreTrainedModel, Path]]:
    """``save_reference(config, name="source", seed=0, **save_pretrained_kwargs)`` -> (model, folder)."""

    def save(config: PreTrainedConfig, name: str = "source", seed: int = 0, **kwargs) -> tuple[PreTrainedModel, Path]:
        model = build_reference(config, seed)
        model.save_pretrained(tmp_path / name, **kwargs)
        return model, tmp_path / name

    return save


@pytest.fixture
def run_convert(tmp_path: Path) -> Callable[..., ConversionResult]:
    """``run_convert(source, name="out", **options)``: ``convert`` without progress bars, verified by default."""

    def run(source: Path, name: str = "out", **options) -> ConversionResult:
        options.setdefault("verify", True)
        options.setdefault("progress", False)
        return convert(source, tmp_path / name, **options)

    return run
