"""Load without converting: any supported source checkpoint straight into a ``ThinkerForCausalLM`` in memory.

``load_thinker("Qwen/Qwen3-0.6B")`` (or a local folder, or a μOmni / LLMs-from-scratch ``.pth`` folder) translates
the config and renames the weights through the same family tables and the same checks as ``thinker-convert``
(``plan_conversion``: every source tensor mapped or dropped on purpose, every Thinker parameter produced once with
the right shape), streams the tensors through the same operations, and hands the state dict to transformers'
``from_pretrained``, which builds the model without random initialisation and places it (``device_map``, ``dtype``,
``attn_implementation`` ... pass through). Nothing is written to disk.

Importing this module registers ``load_thinker`` with ``thinker.foreign``, so that
``ThinkerForCausalLM.from_pretrained`` on a checkpoint of another family converts it on load, with every Hub
argument (``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download``, ``subfolder``,
``gguf_file``) going to
the converter's Hub resolution.

transformers 5 can also rename and fuse weights at load time (``WeightRenaming`` / ``WeightConverter`` in its
``conversion_mapping``); the family tables are interpreted here by the converter's own engine instead, because they
need operations transformers has no counterpart for (``Each``, the interleaved-to-half RoPE reorder of a fused
qkv) and because the engine's completeness checks are the point: an unmapped tensor is an error, not a warning.

Only ``config_for`` needs no weights: the translated ``ThinkerConfig`` of a source. For families that already use
Thinker's names (Qwen2, Qwen3, Llama) it is enough to load the source with plain transformers:
``AutoModelForCausalLM.from_pretrained(folder, config=config_for(folder))`` builds the Thinker. Not for Qwen3-MoE as
released and as transformers' ``save_pretrained`` writes it, one tensor per expert (``mlp.experts.0.gate_proj``):
the Thinker's fused experts would be left at random, with only transformers' load report to say so (an audit
measured logits 1.0 apart). ``load_thinker`` reads every layout; the shortcut holds only for experts already fused
(``mlp.experts.gate_up_proj``, ``save_pretrained(save_original_format=False)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from thinker import ThinkerConfig, ThinkerForCausalLM, foreign
from thinker_common.config_values import check_model_config
from thinker_common.sources import open_source

from .engine import plan_conversion, stream_tensors
from .hub import resolve_source
from .output_dtype import resolve_dtype


def config_for(source: str | Path, *, revision: str | None = None, dtype: str = "auto", **hub: Any) -> ThinkerConfig:
    """The Thinker config a source checkpoint translates to (checked against its tensor headers).

    ``hub``: the Hub arguments of ``hub.resolve_source`` (``token``, ``cache_dir`` ...)."""
    root = resolve_source(str(source), revision, progress=False, **hub)
    tensor_source = open_source(root)
    try:
        source_config = tensor_source.config()
        if source_config.get("model_type") == ThinkerConfig.model_type:
            check_model_config(source_config, f"{root}/config.json")  # by key, as thinker export reads the folder
            config = ThinkerConfig.from_pretrained(root)
            if (asked := folder_dtype(dtype, tensor_source)) != "auto":  # as load_thinker loads the folder
                config.dtype = asked
            return config
        return plan_conversion(tensor_source, source_config, dtype).config
    finally:
        tensor_source.close()


def load_thinker(
    source: str | Path,
    *,
    revision: str | None = None,
    dtype: str = "auto",
    progress: bool = False,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    subfolder: str | None = None,
    gguf_file: str | None = None,
    **from_pretrained_kwargs: Any,
) -> ThinkerForCausalLM:
    """``source`` (Hub repo id, folder or weights file of any supported family) as a Thinker model, in eval mode.

    ``dtype`` is the converter's choice (``auto`` keeps the source's); ``token``, ``cache_dir``,
    ``local_files_only``, ``force_download``, ``subfolder`` and ``gguf_file`` locate it (``hub.resolve_source``);
    other keyword arguments go to ``ThinkerForCausalLM.from_pretrained``. A Thinker folder is loaded as it is.
    """
    hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only}
    hub |= {"force_download": force_download, "subfolder": subfolder, "gguf_file": gguf_file}
    root = resolve_source(str(source), revision, progress=progress, **hub)
    tensor_source = open_source(root)
    try:
        source_config = tensor_source.config()
        native = source_config.get("model_type") == ThinkerConfig.model_type
        if native:
            dtype = folder_dtype(dtype, tensor_source)
        else:
            plan = plan_conversion(tensor_source, source_config, dtype)
            state = dict(stream_tensors(plan, tensor_source))
    finally:
        tensor_source.close()
    if native:
        return in_eval_mode(ThinkerForCausalLM.from_pretrained(root, **({"dtype": dtype} | from_pretrained_kwargs)))
    kwargs = {"dtype": plan.dtype} | from_pretrained_kwargs
    return in_eval_mode(ThinkerForCausalLM.from_pretrained(None, config=plan.config, state_dict=state, **kwargs))


def folder_dtype(dtype: Any, tensor_source: Any) -> Any:
    """The dtype a Thinker folder is loaded in: ``auto`` (its own), or one a converted source could be given, checked
    as the conversion checks it, so that a folder and a source take and refuse the same values."""
    return dtype if dtype == "auto" else resolve_dtype(dtype, None, tensor_source)


def in_eval_mode(loaded: Any) -> Any:
    """``from_pretrained``'s result with the model in eval mode: the model, or (model, loading info) when
    ``output_loading_info=True`` asked for the pair."""
    (loaded[0] if isinstance(loaded, tuple) else loaded).eval()
    return loaded


foreign.register_checkpoint_loader(load_thinker)

__all__ = ["config_for", "load_thinker"]
