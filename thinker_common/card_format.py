"""What marks a folder as one a thinker command wrote, and unchanged since: its model card.

Every output (a Thinker folder, an ONNX export, the way back's folder) gets a ``README.md`` whose measured checks sit
between two markers (``model_card.write_card``), so that a later ``thinker verify`` can replace them. The same markers
tell ``--force`` that a folder is an earlier output it may replace (``staging.not_an_earlier_output``): a source
checkpoint, a fine-tuned model saved by transformers or another tool's export has no such card.

A card alone does not say the folder is still only what thinker wrote: a fine-tune saved into it with
``save_pretrained`` keeps the card. So once a command has written a folder, its card records (``stamped_card``):
- the newest change time (``st_ctime``) of the other files: the kernel sets a file's change time on every write,
  rename into place, link or permission change, and no tool can set it back, so a file whose change time is later
  was changed by someone else;
- a digest of the files' names: a file added on a file system whose times count whole seconds, in the second
  thinker finished, has no later time, but a name the record does not hold;
- a digest of the card's own text: a note a user added to the card is theirs.
The record is the card's text, not the card's own change time, which an edit of the card would move past every
earlier change. A copy of the folder gives every file a new change time: refused too, as is safe. ``thinker
verify`` writes its reports and the card's checks section into a finished folder and records them
(``card_after_verify``) only where nothing else changed before or while it ran; its reports, never a user's file,
count as thinker's whatever their time (a verify killed before recording them left them newer).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .processes import alive

CARD_FILE = "README.md"
CHECK_START, CHECK_END = "<!-- thinker: checks -->", "<!-- /thinker: checks -->"
# thinker verify's reports, written into a finished folder (converter/parity_report.py's names)
REPORT_FILES = ("parity.json", "parity.failed.json")
# A card is a few KiB; a README.md larger than this is someone's document, and is not read through to find out.
_LARGEST_CARD = 1 << 20
_RECORD = re.compile(rb"<!-- thinker: written (\d{19}) ns, files ([0-9a-f]{16}), card ([0-9a-f]{16}) -->\n?")
_CHECKS = re.compile(re.escape(CHECK_START.encode()) + rb".*?" + re.escape(CHECK_END.encode()), re.DOTALL)


@dataclass(frozen=True)
class Record:
    """A card's record of thinker's last write: the newest change time then, the digests of the names and the card."""

    time_ns: int = 0
    files: str = "0" * 16
    card: str = "0" * 16

    def line(self) -> str:
        # fixed width (19 digits: nanoseconds until the year 2286), so that recording it keeps the card's size,
        # which export_report.json has counted
        return f"<!-- thinker: written {self.time_ns:019d} ns, files {self.files}, card {self.card} -->"


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


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _names_digest(names: list[str]) -> str:
    """The digest of a folder's file names, its card and thinker verify's reports aside."""
    kept = sorted(name for name in names if name != CARD_FILE and name not in REPORT_FILES)
    return _digest("\n".join(kept).encode("utf-8", "surrogateescape"))


def _card_digest(card: bytes) -> str:
    """The digest of the card's text but the record (a note typed into the checks section, under the parity table
    where it shows, is the user's too: a QA run)."""
    return _digest(_RECORD.sub(b"", card))


def _outside_checks(card: bytes) -> bytes:
    """The card's text but its checks section (``thinker verify`` rewrites it) and the record."""
    return _RECORD.sub(b"", _CHECKS.sub(b"", card))


def card_text(folder: Path) -> bytes:
    """``folder``'s card, whole (empty where it has none)."""
    return _card(folder, limit=-1) or b""


# the files staging.write_atomically writes beside the one they replace in a finished folder: the card, and thinker
# verify's reports
_PARTIAL = re.compile(r"^\.(README\.md|parity\.json|parity\.failed\.json)\.partial-(?P<pid>\d+)$")


def stale_partial(entry: os.DirEntry) -> bool:
    """``entry`` is a file thinker left half-written in a finished folder, its process gone (killed mid-write)."""
    match = _PARTIAL.match(entry.name)
    return bool(match) and entry.is_file(follow_symlinks=False) and not alive(int(match["pid"]))


def _files(folder: Path) -> dict[str, os.stat_result]:
    """The plain files of ``folder`` but its card and thinker's stale half-written files, and what each is."""
    with os.scandir(folder) as scan:
        entries = [
            entry
            for entry in scan
            if entry.name != CARD_FILE and entry.is_file(follow_symlinks=False) and not stale_partial(entry)
        ]
    return {entry.name: entry.stat(follow_symlinks=False) for entry in entries}


def read_record(folder: Path) -> Record | None:
    """The record in ``folder``'s card, or None (no card of this tool's, an earlier thinker's, or the line edited)."""
    match = _RECORD.search(_card(folder) or b"")
    return None if match is None else Record(int(match[1]), match[2].decode(), match[3].decode())


def _with_line(card: bytes, record: Record) -> bytes:
    line = record.line().encode()
    return _RECORD.sub(line + b"\n", card, count=1) if _RECORD.search(card) else card + b"\n" + line + b"\n"


def with_record(card: bytes, record: Record) -> str:
    """``card`` with ``record`` in place of the one it holds (or added), as text for ``staging.write_atomically``:
    bytes that are not UTF-8 (a card edited in another encoding) carried through as they are."""
    return _with_line(card, record).decode("utf-8", "surrogateescape")


def _recorded(card: bytes, time_ns: int, files: str) -> str:
    """``card`` recording a write at ``time_ns`` of the files ``files`` digests, and the card's own digest as it will
    read back: taken with the record line in place, which a card that held none gains with a blank line before it
    (the record itself is left out of the digest, so which record holds the place does not matter)."""
    placed = _with_line(card, Record(time_ns, files))
    return with_record(card, Record(time_ns, files, _card_digest(placed)))


def stamped_card(folder: Path) -> str | None:
    """``folder``'s card recording what this tool wrote there (``Record``), to be written once the folder is
    complete; None for a folder without a card of this tool's, which is left alone."""
    if not written_by_thinker(folder):
        return None
    files = _files(folder)
    newest = max((info.st_ctime_ns for info in files.values()), default=0)
    card = card_text(folder)
    return _recorded(card, newest, _names_digest(list(files)))


def card_after_verify(folder: Path, before: Record, card_before: bytes) -> str | None:
    """After ``thinker verify`` wrote its reports (and the card's checks section) into ``folder``, whose card was
    ``card_before`` with ``before`` recorded as it started (an unchanged earlier output): the card recording them as
    thinker's; None where anything else changed while it ran (a file added or changed, the card's text outside its
    checks), which stays a change."""
    files = _files(folder)
    card = card_text(folder)
    others_changed = any(info.st_ctime_ns > before.time_ns for name, info in files.items() if name not in REPORT_FILES)
    if (
        others_changed
        or _names_digest(list(files)) != before.files
        or _outside_checks(card) != _outside_checks(card_before)
    ):
        return None
    reports = [info.st_ctime_ns for name, info in files.items() if name in REPORT_FILES]
    return _recorded(card, max([before.time_ns, *reports]), before.files)


def changes_since_written(folder: Path, names: list[str]) -> str | None:
    """What changed in ``folder`` (whose card is this tool's; ``names``: its entries) since this tool last wrote it,
    as a reason --force gives for keeping it, or None."""
    record = read_record(folder)
    if record is None:
        return f"its {CARD_FILE} records no write of thinker's (an earlier thinker's output, or the card edited)"
    changed = []
    for name in names:
        if name == CARD_FILE or name in REPORT_FILES:  # thinker verify's, newer where a killed verify left them
            continue
        try:
            info = os.stat(Path(folder) / name, follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing: nothing of the user's to keep
            continue
        if info.st_ctime_ns > record.time_ns:
            changed.append((-info.st_size, name))
    if changed:  # the largest first: the weights of a model saved into it before its config
        named = [name for _, name in sorted(changed)]
        shown = ", ".join(named[:3]) + (" ..." if len(named) > 3 else "")
        return (
            f"{shown} changed after thinker wrote the folder: a model saved into it, a file added, or the folder "
            "copied, which renews every file's change time"
        )
    if _card_digest(card_text(folder)) != record.card:
        return f"its {CARD_FILE} was edited after thinker wrote it (a note of the user's, which --force would delete)"
    if _names_digest(names) != record.files:
        return "files added or removed after thinker wrote the folder (within the second it finished)"
    return None
