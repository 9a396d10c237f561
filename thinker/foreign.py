# Copyright 2026 The Thinker authors.
# SPDX-License-Identifier: Apache-2.0
"""``from_pretrained`` of the Thinker classes on a checkpoint of another family (a Qwen folder, a Hub repo id, a GGUF).

transformers would build a Thinker from a Qwen ``config.json`` with only a warning, drop the tensors whose names it
does not know, and initialise the rest at random. Instead, ``from_pretrained`` (below) looks at what it is given:

- a Thinker checkpoint (``model_type: thinker``), or a call with ``config=`` or extra positional arguments, goes to
  transformers' own ``from_pretrained`` unchanged;
- any other checkpoint goes to the loader registered here (``register_checkpoint_loader``), with every argument:
  the Hub ones (``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download``, ``subfolder``,
  which locate the checkpoint) and the model ones (``dtype``, ``device_map``, ``attn_implementation`` ...);
- so does a call with ``gguf_file=`` (one GGUF file of a repo or folder, as for transformers' models): a Thinker
  checkpoint is never a GGUF file.

The loader is the converter's ``converter.load.load_thinker``, which renames the weights on load through the same
family tables and checks as ``thinker-convert``; it gives a ``ThinkerForCausalLM``, whose decoder ``ThinkerModel``
takes. The task heads (``ThinkerForSequenceClassification`` ...) refuse a foreign checkpoint: it holds no head for
them, and the base classes of other families give theirs random weights with a mere warning. The converter
registers the loader when it is imported (``import converter.load``); this package imports nothing outside itself,
so a foreign checkpoint asked for before that is refused with an error saying so, rather than loaded at random.

This module belongs to the installed package only: the files shipped beside checkpoints as remote code
(``configuration_thinker.py``, ``modeling_thinker.py``) never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig

from .configuration_thinker import ThinkerConfig

# The Hub arguments of transformers' from_pretrained that locate a checkpoint; the loader receives them all.
HUB_ARGUMENTS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")

# (source, **from_pretrained arguments) -> a ThinkerForCausalLM.
CheckpointLoader = Callable[..., Any]
_loaders: list[CheckpointLoader] = []


def register_checkpoint_loader(loader: CheckpointLoader) -> None:
    """Make ``loader`` the one that ``ThinkerForCausalLM.from_pretrained`` hands foreign checkpoints to."""
    _loaders[:] = [loader]


def is_foreign_checkpoint(source: str | Path, **hub_arguments: Any) -> bool:
    """True when ``source`` is not a Thinker checkpoint: another ``model_type``, or a weights file with no config."""
    path = Path(source)
    if path.is_file():  # a single .gguf / .pth / .safetensors file
        return True
    try:
        config, _ = PreTrainedConfig.get_config_dict(str(source), **hub_arguments)
    except OSError:
        # No config.json: a local folder of a training script's checkpoint (μOmni, LLMs-from-scratch) or a GGUF.
        return path.is_dir()
    return config.get("model_type") != ThinkerConfig.model_type


def from_pretrained(
    cls: type,
    transformers_from_pretrained: Callable,
    from_causal_lm: Callable[[Any], Any] | None,
    pretrained_model_name_or_path: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``from_pretrained`` of the Thinker classes: transformers' own for Thinker checkpoints, the registered loader
    for the checkpoints of other families (see the module docstring), its ThinkerForCausalLM turned into ``cls`` by
    ``from_causal_lm`` (None: ``cls`` has weights no foreign checkpoint holds, so it is refused)."""
    hub_arguments = {key: kwargs[key] for key in HUB_ARGUMENTS if key in kwargs}
    if (
        pretrained_model_name_or_path is None
        or args
        or kwargs.get("config") is not None
        or (
            kwargs.get("gguf_file") is None
            and not is_foreign_checkpoint(pretrained_model_name_or_path, **hub_arguments)
        )
    ):
        return transformers_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
    if from_causal_lm is None:
        raise ValueError(
            f"{pretrained_model_name_or_path} is not a Thinker checkpoint, and {cls.__name__} loads Thinker "
            "checkpoints only (its head is in no other family's); convert it first (thinker-convert SOURCE "
            f"OUTPUT), then {cls.__name__}.from_pretrained(OUTPUT), or load it as ThinkerForCausalLM / ThinkerModel"
        )
    if not _loaders:
        raise ValueError(
            f"{pretrained_model_name_or_path} is not a Thinker checkpoint; to convert it on load, `import "
            "converter.load` first (it registers the converter's family tables), or convert it with thinker-convert"
        )
    if "torch_dtype" in kwargs:  # transformers' former name for it, which transformers' own loading still takes
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    dtype = kwargs.pop("dtype", "auto")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    loaded = _loaders[0](pretrained_model_name_or_path, dtype=dtype, **kwargs)
    if isinstance(loaded, tuple):  # output_loading_info=True: (model, info)
        return (from_causal_lm(loaded[0]), *loaded[1:])
    return from_causal_lm(loaded)


def accept_foreign_checkpoints(model_class: type, from_causal_lm: Callable[[Any], Any] | None) -> None:
    """Give ``model_class`` the ``from_pretrained`` above, around the one it inherits from transformers:
    ``from_causal_lm`` makes a ``model_class`` of the ThinkerForCausalLM the loader gives, or is None where a foreign
    checkpoint has nothing to fill the class with (a task head), which is then refused rather than left random."""
    inherited = model_class.from_pretrained.__func__

    def dispatching_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        return from_pretrained(cls, inherited, from_causal_lm, pretrained_model_name_or_path, *args, **kwargs)

    dispatching_from_pretrained.__doc__ = from_pretrained.__doc__
    model_class.from_pretrained = classmethod(dispatching_from_pretrained)
