"""A Thinker folder's weights held against the model of its config.json, before anything loads them.

transformers loads a folder whose safetensors do not fit its config (a tensor missing or renamed, one too many, of
another shape, a trained head under ``tie_word_embeddings``) with those weights freshly initialised, a warning at
most: a model that runs and computes something else. ``thinker verify`` and ``thinker export`` both refuse such a
folder first, naming the tensor and the config key behind it; the converter checks the same from the source's
headers (``converter.engine``).
"""

from __future__ import annotations

from pathlib import Path

from thinker.configuration_thinker import ThinkerConfig
from thinker_common.dtypes import dtype_name
from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource

from .engine import describe_names, thinker_parameter_shapes

HEAD = "lm_head.weight"
# The sizes a tensor's shape follows, tried one by one to say which of them a wrong shape contradicts.
SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "hc_count",
    "hc_lowrank",
    "indexer_n_heads",
    "indexer_head_dim",
    "ple_embed_dim",
    "ple_conv_kernel_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
)


def refuse_weightless(model_dir: Path) -> None:
    """A folder without a single safetensors file lost its weights (or never had them): said so, rather than listed
    tensor by tensor as if config.json described other weights."""
    if not any(model_dir.glob("*.safetensors")):
        raise ThinkerError(f"{model_dir}: a Thinker folder without its weights (no *.safetensors); convert it again")


def check_thinker_weights(model_dir: Path, config: ThinkerConfig, skipped: tuple[str, ...] = ()) -> None:
    """Refuse a folder whose safetensors headers do not fit the model of its config.json: a tensor missing, one too
    many, of another shape or of an integer dtype, or a trained head under ``tie_word_embeddings``. transformers
    would load such a folder with those weights freshly initialised (a warning at most), a model that runs and
    computes nothing the user converted. ``skipped``: name prefixes of tensors the caller does not use (the
    exporter's ``not_exported``), which may be missing; present, they are held to their shapes as every tensor is
    (the export's verify loads them with transformers, which refuses a mismatched size)."""
    refuse_weightless(model_dir)
    config_path = model_dir / "config.json"
    expected = thinker_parameter_shapes(config)
    weights = SafetensorsSource(model_dir)
    try:
        found = {name: weights.shape(name) for name in weights.names()}
        for name in found:
            if not weights.dtype(name).is_floating_point:
                raise ThinkerError(
                    f"{weights.file_of(name)}: tensor {name!r} is stored as {dtype_name(weights.dtype(name))}, but the "
                    "model's weights are floating point; the folder is corrupt: convert it again"
                )
    finally:
        weights.close()
    if config.tie_word_embeddings and HEAD in found:
        raise ThinkerError(
            f"{config_path}: tie_word_embeddings is true, but the folder holds its own trained {HEAD}, which a tied "
            "export would drop for the embeddings; set tie_word_embeddings to false"
        )

    def used(name: str) -> bool:
        return not (skipped and name.startswith(skipped))

    missing = [name for name in expected if name not in found and used(name)]
    extra = [name for name in found if name not in expected and used(name)]
    if missing or extra:
        parts = [f"lacks {describe_names(missing)}, which the model of its config.json has"] if missing else []
        parts += [f"holds {describe_names(extra)}, which the model of its config.json does not have"] if extra else []
        raise ThinkerError(
            f"{model_dir}: the weights do not fit config.json: the folder {' and '.join(parts)} (check "
            "num_hidden_layers, layer_types, tie_word_embeddings and the MoE fields)"
        )
    wrong = [name for name, shape in expected.items() if name in found and found[name] != shape]
    if wrong:
        name = wrong[0]
        keys = _keys_behind(config, name, found[name])
        behind = " or ".join(f"{key}={getattr(config, key)}" for key in keys) if keys else "its sizes"
        more = f" (and {len(wrong) - 1} more tensor(s))" if len(wrong) > 1 else ""
        raise ThinkerError(
            f"{config_path}: {behind} give{'s' if keys else ''} {name} the shape {expected[name]}, but the folder "
            f"holds {tuple(found[name])}{more}; config.json does not describe these weights: correct it"
        )


def _keys_behind(config: ThinkerConfig, name: str, found: tuple[int, ...]) -> list[str]:
    """The sizes of ``config`` on which the dimensions of ``name`` that disagree with ``found`` depend: each is
    changed in turn (keeping the head counts divisible) and the model rebuilt on the meta device."""
    expected = thinker_parameter_shapes(config)[name]
    wrong_dims = {i for i, (a, b) in enumerate(zip(expected, found, strict=False)) if a != b}
    keys = []
    for key in SIZE_KEYS:
        value = getattr(config, key, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if key in ("num_attention_heads", "linear_num_value_heads"):
            changed = value * 2  # still a multiple of the key/value heads
        elif key == "num_key_value_heads":
            changed = 1 if value != 1 else config.num_attention_heads
        elif key == "linear_num_key_heads":
            changed = 1 if value != 1 else config.linear_num_value_heads
        else:
            changed = value + 2  # head_dim stays even, as RoPE needs
        try:
            shapes = thinker_parameter_shapes(ThinkerConfig(**{**config.to_dict(), key: changed}))
        except Exception:  # a variant the config's own validation refuses says nothing about this key
            continue
        moved = {i for i, (a, b) in enumerate(zip(expected, shapes.get(name, expected), strict=False)) if a != b}
        if moved & wrong_dims:
            keys.append(key)
    return keys
