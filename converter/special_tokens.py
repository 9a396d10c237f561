"""The special-token ids of a converted model against its reference's: what no logit shows.

A conversion that reads the source's eos id from the bos key, or drops its pad id, computes every logit exactly and
passes the parity gate; it then stops generation at the wrong token. ``thinker verify`` cannot see such a slip
either, since it translates the source again with the same code. The reference's ids here come from transformers'
own reading of the source (its config class for a folder, its GGUF tables for a file), never from the converter's,
so the parity gate compares them beside the logits (a mutation run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from thinker_common.errors import ThinkerError
from thinker_common.gguf_reader import mapped_reader
from thinker_common.side_files import read_json

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_ids(config: Any) -> dict[str, Any]:
    """bos, eos and pad ids as transformers' ``generate`` takes them from a model config when no
    generation_config.json says otherwise (``GenerationConfig.from_model_config``: the config's own, else its text
    decoder's); an eos as a list."""
    generation = GenerationConfig.from_model_config(config)
    ids = {key: getattr(generation, key, None) for key in SPECIAL_IDS}
    eos = ids["eos_token_id"]
    ids["eos_token_id"] = eos if eos is None or isinstance(eos, list) else [eos]
    return ids


def source_named_ids(source: Path) -> set[str]:
    """The special ids the source's own files name: a GGUF file's ``tokenizer.ggml`` keys (read by the keys of
    transformers' GGUF table), else config.json's at any level (a vision-language or omni config names them on an
    inner config as often as on the outer one)."""
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING, read_field

        reader = mapped_reader(source)
        table = GGUF_TO_TRANSFORMERS_MAPPING["tokenizer"]["tokenizer"]
        return {
            field for key, field in table.items() if field in SPECIAL_IDS and read_field(reader, f"tokenizer.{key}")
        }
    folder = source if source.is_dir() else source.parent
    try:
        config = read_json(folder / "config.json")
    except ThinkerError:  # unreadable: the reference's own loading names it
        config = None
    return {key for key in SPECIAL_IDS if _names(config, key)}


def _names(config: Any, key: str) -> bool:
    if not isinstance(config, dict):
        return False
    return config.get(key) is not None or any(_names(value, key) for value in config.values())


def special_id_differences(reference_config: Any, converted_config: Any, named: set[str]) -> list[str]:
    """``key (reference -> converted)`` for each id the reference's config names and the converted one names
    otherwise. Not compared: an id the reference leaves unset (whatever the converted model names, it stops no
    generation the reference would), nor one the converted model leaves unset where
    the source's files (``named``: ``source_named_ids``) do not name it either: the reference then holds its config
    class's default (a llama GGUF file without ``tokenizer.ggml`` ids: transformers' LlamaConfig says bos 1, eos 2,
    which the file never did). An id the source names that happens to be that default is compared all the same (the
    real SmolLM2's bos 1 and eos 2: a review)."""
    if reference_config is None:  # a reference outside transformers (a from-scratch implementation) names none
        return []
    expected, actual = special_ids(reference_config), special_ids(converted_config)
    return [
        f"{key} ({expected[key]!r} -> {actual[key]!r})"
        for key in SPECIAL_IDS
        if expected[key] is not None and expected[key] != actual[key] and (actual[key] is not None or key in named)
    ]
