"""The Thinker folder around the weights: ``config.json`` with the modeling code as remote code, and the generation
config. (Staging and installing OUTPUT atomically is ``thinker_common/staging.py``; the tokenizer comes from the source,
``TensorSource.save_tokenizer``.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from thinker import ThinkerConfig, ThinkerForCausalLM
from thinker.modeling_thinker import name_every_auto_class
from thinker_common.errors import ThinkerError
from thinker_common.source_files import present


def write_thinker_config(folder: Path, config: ThinkerConfig) -> None:
    """``config.json`` with ``auto_map``, plus the modeling source beside it, as ``save_pretrained`` would write.

    transformers' ``custom_object_save`` copies a registered class's module (and its relative imports) and records
    it in ``auto_map``; it wants instances, so the model is built on the meta device, at no memory cost.
    """
    with torch.device("meta"):
        model = ThinkerForCausalLM(config)
    custom_object_save(model, folder, config=config)  # modeling_thinker.py, configuration_thinker.py
    name_every_auto_class(config, type(model).__module__)  # AutoModel and every head, beside AutoModelForCausalLM
    config.save_pretrained(folder)  # AutoConfig -> ThinkerConfig, and config.json itself


def generation_config_for(source_root: Path, config: ThinkerConfig) -> GenerationConfig:
    """The generation config a conversion writes for the source at ``source_root`` (and ``thinker verify``
    expects): the source's ``generation_config.json`` when it has one (sampling defaults matter), else one from the
    ids."""
    if present(source_root / "generation_config.json", source_root):
        try:
            return GenerationConfig.from_pretrained(source_root)
        except (OSError, ValueError) as err:
            raise ThinkerError(f"{source_root / 'generation_config.json'}: unreadable ({err})") from None
    return GenerationConfig.from_model_config(config)


def generation_differences(expected: GenerationConfig, actual: GenerationConfig) -> list[str]:
    """``key (expected -> actual)`` for each generation setting the two disagree on (stop tokens, sampling
    defaults), the version that wrote them aside."""
    first, second = expected.to_dict(), actual.to_dict()
    keys = sorted((first.keys() | second.keys()) - {"transformers_version"})
    return [f"{key} ({first.get(key)!r} -> {second.get(key)!r})" for key in keys if first.get(key) != second.get(key)]


def tokens_past_vocabulary_note(generation: GenerationConfig, config: ThinkerConfig) -> str | None:
    """A note where the special ids the folder's generation config names lie outside the vocabulary: no model of it
    ever produces such an id, so generation never stops at an eos there (and a bos or pad there fails the embedding
    lookup when fed). The conversion is as exact either way; the configs are the source's."""
    past = []
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(generation, key, None)
        ids = value if isinstance(value, list) else [value]
        wrong = [token for token in ids if isinstance(token, int) and not 0 <= token < config.vocab_size]
        if wrong:
            past.append(f"{key} {wrong[0] if len(wrong) == 1 else wrong}")
    if not past:
        return None
    one = len(past) == 1 and not past[0].endswith("]")  # a single id: "is ... it"
    return (
        f"the source's {' and '.join(past)} {'is' if one else 'are'} outside its vocabulary of {config.vocab_size} "
        f"ids, where the model never produces {'it' if one else 'them'} (an eos there never stops generation; a bos "
        "or pad there fails when fed); set the right ids in OUTPUT's generation_config.json and config.json"
    )
