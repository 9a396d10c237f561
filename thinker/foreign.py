# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""``ThinkerForCausalLM.from_pretrained`` on a checkpoint of another family (a Qwen folder, a Hub repo id, a GGUF).

transformers would build a Thinker from a Qwen ``config.json`` with only a warning, drop the tensors whose names
it does not know, and initialise the rest at random. Instead, a source whose ``model_type`` is not ``thinker`` is
handed to the converter's loader, which translates its config and renames its weights on load through the same
family tables and completeness checks as ``thinker-convert``; nothing is written to disk.

This module belongs to the installed package only: the files shipped beside checkpoints as remote code
(``configuration_thinker.py``, ``modeling_thinker.py``) never import it, and the converter is imported lazily,
when a foreign checkpoint is actually asked for.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig

from .configuration_thinker import ThinkerConfig

_PASSED_TO_CONFIG_LOOKUP = ("revision", "token", "cache_dir", "local_files_only", "subfolder")


def is_foreign_checkpoint(source: str | Path, **hub_kwargs: Any) -> bool:
    """True when ``source`` is not a Thinker checkpoint: another ``model_type``, or a weights file with no config."""
    path = Path(source)
    if path.is_file():  # a single .gguf / .pth / .safetensors file
        return True
    try:
        config, _ = PreTrainedConfig.get_config_dict(str(source), **hub_kwargs)
    except OSError:
        # No config.json: a local folder of a training script's checkpoint (μOmni, LLMs-from-scratch) or a GGUF.
        return path.is_dir()
    return config.get("model_type") != ThinkerConfig.model_type


def accept_foreign_checkpoints(cls: type) -> None:
    """Wraps ``cls.from_pretrained`` so that foreign checkpoints go through the converter's family tables."""
    original = cls.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(klass, pretrained_model_name_or_path, *args, **kwargs):
        hub_kwargs = {key: kwargs[key] for key in _PASSED_TO_CONFIG_LOOKUP if key in kwargs}
        if (
            pretrained_model_name_or_path is None
            or args
            or kwargs.get("config") is not None
            or not is_foreign_checkpoint(pretrained_model_name_or_path, **hub_kwargs)
        ):
            return original(klass, pretrained_model_name_or_path, *args, **kwargs)
        from converter.load import load_thinker  # the family tables live in the converter

        dtype = kwargs.pop("dtype", "auto")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        revision = kwargs.pop("revision", None)
        for key in ("token", "cache_dir", "local_files_only", "subfolder"):
            kwargs.pop(key, None)  # resolved by the converter's own Hub code (HF_TOKEN, HF_HUB_CACHE, ...)
        return load_thinker(pretrained_model_name_or_path, revision=revision, dtype=dtype, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)
