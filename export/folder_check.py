"""What ``thinker export`` checks of a Thinker folder before it writes a byte, with or without ``--verify``.

Skipping the numeric check (``--no-verify``) must not skip the structural one: a config.json whose sizes were edited,
a tensor of another shape or of an integer dtype, or ``tie_word_embeddings`` switched on over a trained head would
otherwise be exported (exit 0) into a graph onnxruntime cannot load, or one that silently computes another model.
The converter checks the same from the source's headers (``converter.engine``); here the folder's own safetensors
headers are held against the parameters the model of its config.json has (``thinker_parameter_shapes``, the
Thinker built on the meta device), and the context against what the export builds and verifies.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.dtypes import dtype_name
from common.errors import ThinkerError
from common.parity_inputs import PROMPT_LENGTHS
from common.sizes import human_size
from common.sources import SafetensorsSource
from converter.engine import describe_names, thinker_parameter_shapes
from thinker.configuration_thinker import ThinkerConfig

from .decoder_graph import check_exportable as graph_can_build
from .decoder_graph import not_exported, rope_table_bytes
from .names import export_context

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


def check_thinker_folder(model_dir: Path, config: ThinkerConfig, dtype: torch.dtype, verify: bool) -> None:
    """Refuse a folder whose weights do not fit its config.json, or a context the export cannot build or verify;
    the message names the tensor, the key and the file."""
    check_exportable(config, model_dir / "config.json")
    check_thinker_weights(model_dir, config)
    _check_context(config, model_dir / "config.json", dtype, verify)
    if verify:
        check_decodable(config, model_dir / "config.json", "--verify cannot run it: export with --no-verify")


def check_exportable(config: ThinkerConfig, config_path: Path) -> None:
    """Refuse what the graphs do not build (export/decoder_graph.py ``check_exportable``), naming the config: before
    a byte is written, and for a SOURCE before it is converted."""
    try:
        graph_can_build(config)
    except ThinkerError as err:
        raise ThinkerError(f"{config_path}: {err}") from None


def check_decodable(config: ThinkerConfig, config_path: Path, consequence: str) -> None:
    """Refuse a model the PyTorch Thinker cannot decode: with no full-attention layer, transformers' caches (the
    Thinker's, and the reference classes') have no layer that counts the context, and any forward with a cache
    fails. The ONNX graph carries its own states and runs such a model."""
    if config.layer_types and not {"full_attention", "indexed_attention"} & set(config.layer_types):
        raise ThinkerError(
            f"{config_path}: layer_types has no full_attention layer ({len(config.layer_types)} x "
            f"{config.layer_types[0]}), and transformers' caches, with which the PyTorch Thinker decodes, count the "
            f"context on an attention layer; {consequence}"
        )


def check_thinker_weights(model_dir: Path, config: ThinkerConfig) -> None:
    """Refuse a folder whose safetensors headers do not fit the model of its config.json: a tensor missing, one too
    many, of another shape or of an integer dtype, or a trained head under ``tie_word_embeddings``. transformers
    would load such a folder with those weights freshly initialised (a warning at most), a model that runs and
    computes nothing the user converted."""
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
    skipped = not_exported(config)
    missing = [name for name in expected if name not in found]
    extra = [name for name in found if name not in expected and not name.startswith(skipped)]
    if missing or extra:
        parts = [f"lacks {describe_names(missing)}, which the model of its config.json has"] if missing else []
        parts += [f"holds {describe_names(extra)}, which the model of its config.json does not have"] if extra else []
        raise ThinkerError(
            f"{model_dir}: the weights do not fit config.json: the folder {' and '.join(parts)} (check "
            "num_hidden_layers, layer_types, tie_word_embeddings and the MoE fields)"
        )
    wrong = [name for name, shape in expected.items() if found[name] != shape]
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


def _check_context(config: ThinkerConfig, config_path: Path, dtype: torch.dtype, verify: bool) -> None:
    """The RoPE tables cover the whole context and must fit in memory; ``--verify`` runs a prompt and decode steps
    that need that many positions."""
    import psutil  # a dependency of accelerate, which transformers' loading uses

    from .verify import DECODE_STEPS

    positions = config.max_position_embeddings
    context, covered_by = export_context(positions, config.rope_parameters)
    needed = max(PROMPT_LENGTHS) + DECODE_STEPS
    if verify and context < needed:
        raise ThinkerError(
            f"{config_path}: max_position_embeddings={positions} is fewer positions than --verify runs ({needed}: a "
            f"{max(PROMPT_LENGTHS)}-token prompt and {DECODE_STEPS} decode steps); correct it, or export with "
            "--no-verify"
        )
    table = rope_table_bytes(config, dtype)
    available = psutil.virtual_memory().available
    if table > available:
        raise ThinkerError(
            f"{config_path}: a context of {context} positions ({covered_by}) needs RoPE tables of "
            f"{human_size(table)}, more than the {human_size(available)} of memory available; lower "
            "max_position_embeddings (or the RoPE scaling's factor) to the context you will use, or export on a larger "
            "machine"
        )
