"""The files that travel with a model folder besides its weights: the tokenizer (every kind transformers ships),
the chat template, and the model's own configs. One list, used by the converter (tokenizer files from the source)
and by the exporter (tokenizer and configs beside the graph), so that no stage drops a file another one keeps.
"""

from __future__ import annotations

import json
import os
import shutil
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from .errors import ThinkerError
from .source_files import checked_file, present, redownload, regular_file

# Files a tokenizer (or chat template) may live in, for every tokenizer type transformers ships: fast (tokenizer.json),
# BPE (vocab.json + merges.txt), WordPiece (vocab.txt), SentencePiece (tokenizer.model / spiece.model).
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
# tiktoken vocabularies are named after their encoding (cl100k_base.tiktoken); a tokenizer's named chat templates
# besides its default one ("tool_use", "rag") lie in a folder of their own, which transformers' tokenizer and processor
# read by name (``apply_chat_template(chat_template="tool_use")``; transformers.utils.hub CHAT_TEMPLATE_DIR)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_PATTERNS = ("*.tiktoken", f"{CHAT_TEMPLATE_DIR}/*.jinja")
# The files among those that hold a vocabulary: without one, the others (a chat template, a tokenizer_config.json, the
# special tokens) are no tokenizer AutoTokenizer can build.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")

# The model's own configs, which a Thinker folder carries beside its weights.
CONFIG_FILES = ("config.json", "generation_config.json")


def has_vocabulary(names: list[str]) -> bool:
    """Whether tokenizer files of these names (``tokenizer_files``) make a tokenizer: one holds a vocabulary."""
    return any(name in VOCABULARY_FILES or name.endswith(".tiktoken") for name in names)


def is_tokenizer_file(name: str) -> bool:
    """Whether ``name``, a ``/``-separated path in a model folder (a Hub repo's listing), is one of its tokenizer files
    by the lists above: a pattern's ``*`` stays within one folder level, as ``Path.glob``'s does."""
    parts = name.split("/")
    return name in TOKENIZER_FILES or any(
        len(parts) == len(levels) and all(fnmatchcase(part, level) for part, level in zip(parts, levels, strict=True))
        for levels in (pattern.split("/") for pattern in TOKENIZER_PATTERNS)
    )


def tokenizer_files(folder: Path) -> list[str]:
    """The paths of ``folder``'s tokenizer files within it (``/``-separated: a named chat template lies in a folder of
    its own), by the lists above; code or anything else is never picked. Each is checked
    (``source_files.checked_file``): a symlink leading out of the folder, or a named pipe, is refused."""
    names = [name for name in TOKENIZER_FILES if present(folder / name, folder)]
    matches = sorted(
        {path.relative_to(folder).as_posix() for pattern in TOKENIZER_PATTERNS for path in folder.glob(pattern)}
    )
    for name in matches:
        checked_file(folder / name, folder)
    return names + matches


# The tokenizer files whose text a reader can check cheaply: JSON, the fast tokenizer, the chat template.
_JSON_TOKENIZER_FILES = frozenset(name for name in TOKENIZER_FILES if name.endswith(".json"))


def readable_tokenizer_files(folder: Path) -> list[str]:
    """``tokenizer_files(folder)``, each JSON one parsed, ``tokenizer.json`` built by ``tokenizers`` and the Jinja chat
    template compiled, so that a file cut short in a download is refused by name when a folder is read, not carried
    into an output whose ``generate`` then fails. (Binary SentencePiece models are copied as they are.)"""
    names = tokenizer_files(folder)
    for name in names:
        path = folder / name
        try:
            if name in _JSON_TOKENIZER_FILES:
                text = regular_file(path).read_text(encoding="utf-8")
                json.loads(text)
                if name == "tokenizer.json":
                    from tokenizers import Tokenizer

                    Tokenizer.from_str(text)
            elif name.endswith(".jinja") and (jinja := _jinja()) is not None:
                jinja.Environment().parse(regular_file(path).read_text(encoding="utf-8"))
        except ThinkerError:
            raise
        except Exception as err:  # json's (RecursionError too), UnicodeDecodeError, tokenizers' and jinja2's own
            reason = " ".join(f"{err.__class__.__name__}: {err}".split())
            raise ThinkerError(f"{path}: not a readable tokenizer file ({reason}); {redownload(path)}") from None
    return names


def _jinja():
    """jinja2, which transformers' chat templates need (torch installs it); None where it is absent."""
    try:
        import jinja2
    except ImportError:
        return None
    return jinja2


def copy_files(names: list[str], source: Path, destination: Path) -> list[str]:
    """Copy the named files of ``source`` (paths within it) into the same places in ``destination``; returns the
    names."""
    for name in names:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, destination / name)
    return names


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None when there is no such file; ``ThinkerError`` naming it when it is not a regular
    file or does not parse (a named pipe would block the read; nesting deeper than Python's recursion limit is
    refused, not a crash)."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    try:
        return json.loads(regular_file(path).read_text())
    except RecursionError:
        raise ThinkerError(f"{path}: not readable JSON (nested too deeply); a config is a few levels deep") from None
    except (OSError, ValueError) as err:
        raise ThinkerError(f"{path}: not readable JSON ({err})") from None
