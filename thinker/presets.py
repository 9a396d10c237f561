# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""Named configurations: the JSON files of ``configs/``, installed as the package ``thinker_configs``.

Each file is a ``ThinkerConfig`` plus keys that start with ``_`` (``_source``: the config it copies, ``_comment``),
which are documentation and are dropped on load.

```python
>>> from thinker.presets import list_presets, load_preset
>>> load_preset("qwen3-0.6b").num_key_value_heads
8
```
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

from .configuration_thinker import ThinkerConfig

PRESET_PACKAGE = "thinker_configs"


def _preset_dir() -> Traversable:
    try:
        return resources.files(PRESET_PACKAGE)
    except ModuleNotFoundError:
        # A source checkout that was never installed: configs/ sits beside the package.
        return Path(__file__).resolve().parent.parent / "configs"


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted (file names without ``.json``)."""
    return sorted(entry.name.removesuffix(".json") for entry in _preset_dir().iterdir() if entry.name.endswith(".json"))


# Per-layer lists, which a shallower copy of a preset keeps the first entries of.
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types")


def load_preset(name: str, **overrides) -> ThinkerConfig:
    """The ``ThinkerConfig`` of preset ``name`` (one of ``list_presets()``); a ``ValueError`` lists them if unknown.

    ``overrides`` replace the preset's fields. A smaller ``num_hidden_layers`` keeps the first layers as they are
    (their entries of ``layer_types`` and ``mlp_layer_types``, where not overridden too): a shallower run of the same
    shapes, a hybrid preset's mix of linear and full attention included."""
    presets = list_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; the presets are: {', '.join(presets)}")
    text = (_preset_dir() / f"{name}.json").read_text(encoding="utf-8")
    fields = {key: value for key, value in json.loads(text).items() if not key.startswith("_")}
    model_type = fields.pop("model_type", ThinkerConfig.model_type)
    if model_type != ThinkerConfig.model_type:
        raise ValueError(f"preset {name!r} has model_type {model_type!r}, not {ThinkerConfig.model_type!r}")
    layers = overrides.get("num_hidden_layers", fields.get("num_hidden_layers"))
    for key in PER_LAYER_FIELDS:
        if key not in overrides and isinstance(fields.get(key), list) and layers is not None:
            if layers > len(fields[key]):
                raise ValueError(f"preset {name!r} lists {key} for {len(fields[key])} layers; asked for {layers}")
            fields[key] = fields[key][:layers]
    return ThinkerConfig(**{**fields, **overrides})


__all__ = ["list_presets", "load_preset"]
