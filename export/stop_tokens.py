"""The tokens a model folder stops and pads with, as its own files name them: what ``thinker generate`` and
``OnnxDecoder.generate`` stop at unless told otherwise, as transformers' ``generate`` takes its model's
generation config."""

from __future__ import annotations

from pathlib import Path

from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json

from .names import GENAI_CONFIG_FILE


def folder_stop_tokens(folder: Path) -> tuple[list[int] | None, int | None]:
    """eos ids and pad id of a model folder, as transformers takes them (``model_stop_tokens``), which our ONNX
    folders carry too; genai_config.json's only in a folder with neither generation_config.json nor config.json (an
    ONNX folder from another exporter). Not before them: where the model names no eos, ours writes the pad id there
    for onnxruntime-genai, which needs one, and a continuation would stop at the first pad token the model chose.
    The eos ids ``None`` where none are named. Each id is checked, naming its file: a string there reached
    transformers' ``generate`` as it was, which stopped with a traceback (a QA run)."""
    eos, pad, where = model_stop_tokens(folder)
    genai = read_json(folder / GENAI_CONFIG_FILE) if where is None else None
    if genai:
        where = folder / GENAI_CONFIG_FILE
        try:
            eos, pad = genai["model"]["eos_token_id"], genai["model"]["pad_token_id"]
        except (KeyError, TypeError):
            raise ThinkerError(f"{where}: no model.eos_token_id or pad_token_id; export again") from None
        eos = eos if isinstance(eos, list) else [eos]
    for name, value in (("eos_token_id", eos), ("pad_token_id", pad)):
        ids = [] if value is None else value if name == "eos_token_id" else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            shown = value[0] if name == "eos_token_id" and len(value) == 1 else value  # as the file spells it
            expected = "a token id or a list of them" if name == "eos_token_id" else "a token id"
            raise ThinkerError(f"{where}: {name}={shown!r}; expected {expected} (whole numbers, 0 or more)")
    return eos, pad


def model_stop_tokens(folder: Path) -> tuple[list[int] | None, int | None, Path | None]:
    """eos ids, pad id, and the file that names them, as transformers' ``generate`` takes them for the model in
    ``folder``: its generation_config.json whole where there is one (a null or absent eos there stops nowhere,
    whatever config.json says: transformers reads config.json only when there is no generation_config.json), else
    its config.json. Not genai_config.json, whose eos is the pad id where the model names none, since
    onnxruntime-genai needs one."""
    for name in ("generation_config.json", "config.json"):
        config = read_json(folder / name)
        if config is None:
            continue
        if not isinstance(config, dict):
            raise ThinkerError(f"{folder / name}: expected a JSON object")
        eos = config.get("eos_token_id")
        return (
            (None if eos is None else eos if isinstance(eos, list) else [eos]),
            config.get("pad_token_id"),
            folder / name,
        )
    return None, None, None
