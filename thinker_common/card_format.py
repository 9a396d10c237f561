"""What marks a folder as one a thinker command wrote, and unchanged since: its model card.

Every output (a Thinker folder, an ONNX export, the way back's folder) gets a ``README.md`` whose measured checks sit
between two markers (``model_card.write_card``), so that a later ``thinker verify`` can replace them. The same markers
tell ``--force`` that a folder is an earlier output it may replace (``staging.refuse_replacing_another_folder``):
a source checkpoint, a fine-tuned model saved by transformers or another tool's export has no such card.

A card alone does not say the folder is still only what thinker wrote: a fine-tune saved into it with
``save_pretrained`` keeps the card. So every command that writes into a folder records in its card, last, the
newest change time (``st_ctime``) of the other files (``stamp_written``): the kernel sets a file's change time on
every write, rename into place, link or permission change, and no tool can set it back, so a file whose change time
is later than the recorded one was changed by someone else (``changed_after_writing``). The time is the card's text,
not the card's own change time: an edit of the card (a note on the fine-tune saved beside it) would move that past
every earlier change. A copy of the folder gives every file a new change time: refused too, as is safe.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

CARD_FILE = "README.md"
CHECK_START, CHECK_END = "<!-- thinker: checks -->", "<!-- /thinker: checks -->"
# A card is a few KiB; a README.md larger than this is someone's document, and is not read through to find out.
_LARGEST_CARD = 1 << 20
_STAMP = re.compile(rb"<!-- thinker: files written, change time (\d+) ns -->")


def stamp_line(change_time_ns: int = 0) -> str:
    """The card's record of thinker's last write; 19 digits (nanoseconds since 1970 until the year 2286), so that
    recording the time keeps the card's size, which export_report.json has counted."""
    return f"<!-- thinker: files written, change time {change_time_ns:019d} ns -->"


def _card(folder: Path, limit: int = _LARGEST_CARD) -> bytes | None:
    """The card's bytes (its first ``limit``; -1: all) where ``folder`` holds a plain ``README.md`` (no link), else
    None."""
    try:
        # O_NOFOLLOW: a linked README.md is not a card this tool wrote; O_NONBLOCK: a FIFO there must not hang the look
        descriptor = os.open(Path(folder) / CARD_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as card:
        if not stat.S_ISREG(os.fstat(card.fileno()).st_mode):
            return None
        try:
            return card.read(limit)
        except OSError:
            return None


def written_by_thinker(folder: Path) -> bool:
    """Whether ``folder`` holds a model card of this tool's: a plain ``README.md`` (no link) with the checks marker."""
    card = _card(folder)
    return card is not None and CHECK_START.encode() in card


def _files(folder: Path) -> list[os.DirEntry]:
    """The plain files of ``folder`` but its card."""
    with os.scandir(folder) as scan:
        return [entry for entry in scan if entry.name != CARD_FILE and entry.is_file(follow_symlinks=False)]


def stamp_written(folder: Path) -> None:
    """Record in ``folder``'s card the newest change time of its other files, after the last one this tool wrote
    there. A folder without a card of this tool's is left alone."""
    if not written_by_thinker(folder):
        return
    card = _card(folder, limit=-1) or b""  # whole: it is written back
    newest = max((entry.stat(follow_symlinks=False).st_ctime_ns for entry in _files(folder)), default=0)
    line = stamp_line(newest).encode()
    updated = _STAMP.sub(line, card, count=1) if _STAMP.search(card) else card.rstrip(b"\n") + b"\n\n" + line + b"\n"
    # written beside and renamed over, as staging.write_atomically does (staging imports this module)
    partial = Path(folder) / f".{CARD_FILE}.partial-{os.getpid()}"
    partial.write_bytes(updated)
    os.replace(partial, Path(folder) / CARD_FILE)


def changed_after_writing(folder: Path, names: list[str]) -> list[str] | None:
    """Those of ``names`` (files in ``folder``, whose card is this tool's) changed after this tool last wrote the
    folder, the largest first (the weights of a model saved into it before its config); None where the card records
    no time (a card edited, or an output of an earlier thinker)."""
    match = _STAMP.search(_card(folder) or b"")
    if match is None:
        return None
    written = int(match[1])
    changed = []
    for name in names:
        if name == CARD_FILE:
            continue
        try:
            info = os.stat(Path(folder) / name, follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing: nothing of the user's to keep
            continue
        if info.st_ctime_ns > written:
            changed.append((-info.st_size, name))
    return [name for _, name in sorted(changed)]
