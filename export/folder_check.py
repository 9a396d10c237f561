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

from converter.folder_weights import check_thinker_weights as check_weights_fit
from thinker.configuration_thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import PROMPT_LENGTHS
from thinker_common.sizes import human_size

from .decoder_graph import check_exportable as graph_can_build
from .decoder_graph import not_exported, rope_table_bytes
from .names import export_context


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


def check_thinker_weights(model_dir: Path, config: ThinkerConfig) -> None:
    """``converter.folder_weights.check_thinker_weights``, the tensors the export leaves out (``not_exported``) not
    required, but held to their shapes where present."""
    check_weights_fit(model_dir, config, not_exported(config))
