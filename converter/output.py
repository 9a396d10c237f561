"""The converted folder around the weights: config with remote code, generation config, tokenizer, atomic install.

Everything is written into a hidden staging folder beside OUTPUT and renamed into place only once complete, so an
interrupted conversion never leaves a half-written OUTPUT, and an existing OUTPUT is replaced (with ``--force``)
only by a finished one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.dynamic_module_utils import custom_object_save

from thinker import ThinkerConfig, ThinkerForCausalLM

from .errors import ThinkerError

log = logging.getLogger(__name__)

# Files a tokenizer (or chat template) may live in, for every tokenizer type transformers ships.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_PATTERNS = ("*.tiktoken",)


def refuse_existing_output(output: Path, force: bool) -> None:
    """An existing OUTPUT is only ever replaced on request, and it is checked before any work starts."""
    if (output.exists() or output.is_symlink()) and not force:
        raise ThinkerError(f"{output} already exists; pass --force to replace it once the new conversion is complete")


def refuse_overwriting_source(output: Path, source_root: Path) -> None:
    """``--force`` must not replace the folder the weights are read from (or one holding it)."""
    output, source_root = output.resolve(), source_root.resolve()
    if output == source_root or output in source_root.parents:
        raise ThinkerError(f"{output}: OUTPUT would replace the source checkpoint itself; choose another folder")


@contextmanager
def staged_output(output: Path, force: bool) -> Iterator[Path]:
    """A fresh folder beside ``output`` to write into; renamed to ``output`` when the block completes."""
    output = output.absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would otherwise become OUTPUT's permissions
    try:
        yield staging
        install(staging, output, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def install(staging: Path, output: Path, force: bool) -> None:
    """Rename the finished ``staging`` folder to ``output``, moving an existing one aside first (``--force``).

    Two renames on the same filesystem: OUTPUT is briefly absent between them, but never partial.
    """
    if not (output.exists() or output.is_symlink()):
        staging.rename(output)
        return
    if not force:
        raise ThinkerError(f"{output} appeared during the conversion; pass --force to replace it")
    retired = output.with_name(f".{output.name}.{uuid.uuid4().hex[:8]}.old")
    output.rename(retired)
    staging.rename(output)
    if retired.is_dir() and not retired.is_symlink():
        shutil.rmtree(retired, ignore_errors=True)
    else:
        retired.unlink()


def write_thinker_config(folder: Path, config: ThinkerConfig) -> None:
    """``config.json`` with ``auto_map``, plus the modeling source beside it, as ``save_pretrained`` would write.

    transformers' ``custom_object_save`` copies a registered class's module (and its relative imports) and records
    it in ``auto_map``; it wants instances, so the model is built on the meta device, at no memory cost.
    """
    with torch.device("meta"):
        model = ThinkerForCausalLM(config)
    custom_object_save(model, folder, config=config)  # modeling_thinker.py, configuration_thinker.py
    custom_object_save(model.model, folder, config=config)  # AutoModel -> ThinkerModel
    config.save_pretrained(folder)  # AutoConfig -> ThinkerConfig, and config.json itself


def write_generation_config(folder: Path, source_root: Path, config: ThinkerConfig) -> None:
    """The source's ``generation_config.json`` when it has one (sampling defaults matter), else one from the ids."""
    if (source_root / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(source_root)
        except (OSError, ValueError) as err:
            raise ThinkerError(f"{source_root / 'generation_config.json'}: unreadable ({err})") from None
    else:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(folder)


def copy_tokenizer_files(source_root: Path, folder: Path) -> list[str]:
    """Copy the source folder's tokenizer files; returns their names (none is fine: weights-only checkpoints)."""
    names = [name for name in TOKENIZER_FILES if (source_root / name).is_file()]
    names += sorted(path.name for pattern in TOKENIZER_PATTERNS for path in source_root.glob(pattern))
    for name in names:
        shutil.copyfile(source_root / name, folder / name)
    return names


def save_gguf_tokenizer(gguf_path: Path, folder: Path) -> list[str]:
    """A GGUF file carries its tokenizer as metadata; transformers rebuilds it, and it is saved as usual files."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as err:  # tokenizer conversion has many failure modes; the weights are still good
        log.warning("the tokenizer in %s could not be converted (%s); the output has no tokenizer", gguf_path, err)
        return []
    before = set(os.listdir(folder))
    tokenizer.save_pretrained(folder)
    return sorted(set(os.listdir(folder)) - before)
