"""The model card (``README.md``) of the folders the tools write, and the license that travels with the weights.

A folder pushed to the Hub as it is should say what it is: huggingface_hub reads the card's YAML metadata (the
library that loads it, the model it derives from, its license) for the repo page, its filters and its "base model"
tree, and a reader wants to know where the weights came from and what was checked. So every output gets a card,
written with huggingface_hub's ``ModelCard`` / ``ModelCardData``, and a copy of the source's license file: a
conversion or an export is a copy of someone's weights, under their terms.

What the source's own card says about its license and languages is carried over; what this tool measured (the parity
check, the export's verify) goes in a section between markers, so that a later ``thinker verify`` can replace it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .card_format import CARD_FILE, CHECK_END, CHECK_START, Record
from .side_files import copy_files
from .source_files import present, regular_file
from .staging import write_atomically

# The files that carry a model's terms with its weights; NOTICE too, which Apache-2.0 (section 4(d)) asks every
# redistribution to include.
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "COPYING", "NOTICE", "NOTICE.txt", "NOTICE.md")
# Card metadata that describes the weights themselves, so it holds for a copy of them.
CARRIED_METADATA = ("license", "license_name", "license_link", "language")
_CHECKS = re.compile(re.escape(CHECK_START) + ".*?" + re.escape(CHECK_END), re.DOTALL)
_REPO_FOLDER = re.compile(r"models--(?P<owner>[^/]+?)--(?P<name>[^/]+)")
_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


def card_metadata(folder: Path) -> dict[str, Any]:
    """The metadata of ``folder``'s card that holds for a copy of its weights (license, languages), and its
    ``base_model``; empty where it has no card or one huggingface_hub cannot read."""
    from huggingface_hub import ModelCard

    path = Path(folder) / CARD_FILE
    if not present(path, Path(folder)):
        return {}
    try:
        data = ModelCard.load(regular_file(path)).data.to_dict()
    except Exception:  # a card is documentation: an unreadable one costs its metadata, not the conversion
        return {}
    return {key: data[key] for key in (*CARRIED_METADATA, "base_model") if data.get(key)}


def hub_repo_of(source: str, root: Path) -> str | None:
    """The Hub repo id the weights came from: SOURCE itself when it names one, else the repo whose cached snapshot
    ``root`` is; None for a folder of one's own."""
    if _REPO_ID.fullmatch(source) and not os.path.exists(source):
        return source
    for part in reversed(Path(os.path.abspath(root)).parts):
        match = _REPO_FOLDER.fullmatch(part)
        if match:
            return f"{match['owner']}/{match['name']}"
    return None


def _snapshot_mark(parts: tuple[str, ...]) -> int | None:
    """The index of ``snapshots`` in a path's parts within a Hub cache (``models--owner--name/snapshots/COMMIT``)."""
    marks = [
        index
        for index, part in enumerate(parts[:-1])
        if part == "snapshots" and index and _REPO_FOLDER.fullmatch(parts[index - 1])  # models--owner--name/
    ]
    return marks[-1] if marks else None


def in_hub_snapshot(path: Path) -> tuple[str | None, str]:
    """(the commit of the Hub cache snapshot ``path`` lies in, ``path`` within that snapshot); (None, its name) for
    a path outside the cache. The snapshot's folder after ``snapshots/`` is the commit, where a file in a sub-folder
    (a GGUF repo's ``Q8/``) is read."""
    parts = Path(path).parts
    mark = _snapshot_mark(parts)
    if mark is None:
        return None, Path(path).name
    return parts[mark + 1], "/".join(parts[mark + 2 :])


def hub_snapshot(path: Path) -> Path | None:
    """The Hub cache snapshot (``.../snapshots/COMMIT``) that ``path`` lies in, or is; None outside the cache."""
    parts = Path(path).parts
    mark = _snapshot_mark(parts)
    return None if mark is None else Path(*parts[: mark + 2])


# The card keys that state the license, which must agree with the license file carried beside them.
_LICENSE_METADATA = ("license", "license_name", "license_link")


def source_card(folder: Path, top: Path | None) -> tuple[dict[str, Any], Path]:
    """(the card metadata a copy of ``folder``'s weights carries, the folder whose license files go with it). A
    checkpoint in a folder of a repo (``--subfolder``, a GGUF quantisation's folder) is covered by the card and license
    at the repo's top, ``top`` (the folder SOURCE names), as the Hub shows them for every file of the repo: the
    folder's own card adds to the top's and wins where both say something, and its own license file wins over the
    top's. The license metadata goes with the license file carried: the folder's own file without its own card's
    word on it leaves the top's word out (it describes another file)."""
    folder = Path(folder)
    own = card_metadata(folder)
    if top is None or not os.path.abspath(folder).startswith(os.path.join(os.path.abspath(top), "")):
        return own, folder  # SOURCE itself, or a folder of no repo: its own card and license alone
    covering = card_metadata(Path(top))
    own_license = any(present(folder / name, folder) for name in LICENSE_FILES)
    if own_license and not any(key in own for key in _LICENSE_METADATA):
        covering = {key: value for key, value in covering.items() if key not in _LICENSE_METADATA}
    return {**covering, **own}, folder if own_license else Path(top)


def weights_of(carried: dict[str, Any]) -> str:
    """ " (the weights of [`owner/name`](link))" for a card whose carried metadata names its base model, else ""."""
    base = carried.get("base_model")
    return f" (the weights of [`{base}`](https://huggingface.co/{base}))" if base else ""


def copy_license(source_folder: Path, folder: Path) -> list[str]:
    """The source folder's license files, copied into ``folder`` (each checked as tokenizer files are); their
    names."""
    source_folder = Path(source_folder)
    names = [name for name in LICENSE_FILES if present(source_folder / name, source_folder)]
    return copy_files(names, source_folder, Path(folder))


def write_card(folder: Path, metadata: dict[str, Any], body: str, checks: str) -> None:
    """``folder/README.md``: ``metadata`` as the card's YAML header, then ``body``, then ``checks`` between the
    markers ``replace_checks`` looks for."""
    from huggingface_hub import ModelCard, ModelCardData

    # a folder name that is not UTF-8 (bytes the file system allows) is shown with replacement characters
    body = body.encode("utf-8", "replace").decode("utf-8")
    data = ModelCardData(**{key: value for key, value in metadata.items() if value})
    checks = f"{CHECK_START}\n{checks.strip()}\n{CHECK_END}"
    # the record of thinker's last write in its place, filled in once the folder is complete (card_format.stamped_card)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.strip()}\n\n{checks}\n\n{Record().line()}\n")
    card.save(Path(folder) / CARD_FILE)


def replace_checks(folder: Path, checks: str) -> bool:
    """Puts ``checks`` in place of the checks section of ``folder``'s card, written beside and renamed over; False
    (nothing written) where the folder has no card of this tool's."""
    path = Path(folder) / CARD_FILE
    if not path.is_file() or path.is_symlink():
        return False
    # bytes that are not UTF-8 (a card edited in another encoding) are carried through as they are, not refused
    text = path.read_bytes().decode("utf-8", "surrogateescape")
    if not _CHECKS.search(text):
        return False
    updated = _CHECKS.sub(lambda _: f"{CHECK_START}\n{checks.strip()}\n{CHECK_END}", text, count=1)
    write_atomically(path, updated)
    return True


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
