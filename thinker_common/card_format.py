"""What marks a folder as one a thinker command wrote, and unchanged since: its model card.

Every output (a Thinker folder, an ONNX export, the way back's folder) gets a ``README.md`` whose measured checks sit
between two markers (``model_card.write_card``), so that a later ``thinker verify`` can replace them. The same markers
tell ``--force`` that a folder is an earlier output it may replace (``staging.refuse_replacing_another_folder``):
a source checkpoint, a fine-tuned model saved by transformers or another tool's export has no such card.

A card alone does not say the folder is still only what thinker wrote: a fine-tune saved into it with
``save_pretrained`` keeps the card. So every command that writes into a folder touches its card last
(``stamp_written``), and a file whose inode changed after the card's (``st_ctime``: set by the kernel on every write,
rename into place or permission change, never by a user's tool) was changed by someone else
(``changed_after_writing``). Copying a folder without keeping times can look like such a change: refused, as is safe.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CARD_FILE = "README.md"
CHECK_START, CHECK_END = "<!-- thinker: checks -->", "<!-- /thinker: checks -->"
# A card is a few KiB; a README.md larger than this is someone's document, and is not read through to find out.
_LARGEST_CARD = 1 << 20


def written_by_thinker(folder: Path) -> bool:
    """Whether ``folder`` holds a model card of this tool's: a plain ``README.md`` (no link) with the checks marker."""
    try:
        # O_NOFOLLOW: a linked README.md is not a card this tool wrote; O_NONBLOCK: a FIFO there must not hang the look
        descriptor = os.open(Path(folder) / CARD_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(descriptor, "rb") as card:
        if not stat.S_ISREG(os.fstat(card.fileno()).st_mode):
            return False
        try:
            return CHECK_START.encode() in card.read(_LARGEST_CARD)
        except OSError:
            return False


def stamp_written(folder: Path) -> None:
    """Touch ``folder``'s card, after the last file this tool wrote there: no file of its own is newer than the card.
    A folder without a card of this tool's is left alone."""
    if written_by_thinker(folder):
        os.utime(Path(folder) / CARD_FILE, follow_symlinks=False)


def changed_after_writing(folder: Path, names: list[str]) -> list[str]:
    """Those of ``names`` (files in ``folder``, whose card is this tool's) changed after this tool last wrote the
    folder, the largest first (the weights of a model saved into it before its config)."""
    written = os.stat(Path(folder) / CARD_FILE, follow_symlinks=False).st_ctime_ns
    changed = []
    for name in names:
        try:
            info = os.stat(Path(folder) / name, follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing: nothing of the user's to keep
            continue
        if info.st_ctime_ns > written:
            changed.append((-info.st_size, name))
    return [name for _, name in sorted(changed)]
