"""The tokens a model folder stops and pads with, as its own files name them: what ``thinker generate`` and
``OnnxDecoder.generate`` stop at unless told otherwise, as transformers' ``generate`` takes its model's
generation config."""

from __future__ import annotations

from pathlib import Path

from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json

from .names import GENAI_CONFIG_FILE


def folder_stop_tokens(folder: Path) -> tuple[list[int] | None, int | None]:
    """eos ids and pad id of a model folder: genai_config.json in an ONNX folder, else generation_config.json, else
    config.json (the eos ids ``None`` where none names them)."""
    genai = read_json(folder / GENAI_CONFIG_FILE)
    if genai:
        try:
            eos, pad = genai["model"]["eos_token_id"], genai["model"]["pad_token_id"]
        except (KeyError, TypeError):
            raise ThinkerError(
                f"{folder / GENAI_CONFIG_FILE}: no model.eos_token_id or pad_token_id; export again"
            ) from None
        return (eos if isinstance(eos, list) else [eos]), pad
    return model_stop_tokens(folder)


def model_stop_tokens(folder: Path) -> tuple[list[int] | None, int | None]:
    """eos ids and pad id as transformers' ``generate`` takes them for the model in ``folder``: its
    generation_config.json, else its config.json (not genai_config.json, whose eos is the pad id where the model
    names none, since onnxruntime-genai needs one)."""
    for name in ("generation_config.json", "config.json"):
        config = read_json(folder / name) or {}
        if config.get("eos_token_id") is not None:
            eos = config["eos_token_id"]
            return (eos if isinstance(eos, list) else [eos]), config.get("pad_token_id")
    return None, None
