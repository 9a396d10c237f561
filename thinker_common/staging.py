"""Output written atomically: into a hidden staging folder beside OUTPUT, renamed into place only once complete.

An interrupted run never leaves a half-written OUTPUT, and an existing OUTPUT is replaced (with ``--force``) only by
a finished one. Every command that writes a folder (``thinker-convert``, ``thinker export``) goes through here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .card_format import CARD_FILE, changes_since_written, stale_partial, stamped_card, written_by_thinker
from .errors import ThinkerError
from .processes import alive
from .side_files import CONFIG_FILES, TOKENIZER_FILES
from .source_files import hub_caches_of

log = logging.getLogger(__name__)


def refuse_existing_output(
    output: Path, force: bool, replaced_when: str = "", source: str | Path | None = None
) -> None:
    """An existing OUTPUT is only ever replaced on request, and it is checked before any work starts;
    ``replaced_when`` tells the user when ``--force`` would replace it (e.g. "once the new conversion is complete").
    OUTPUT is never the working directory or a folder holding it (``--force .`` would empty it). A local ``source``
    path is checked first (``refuse_output_over_source``): an OUTPUT that is the source is told so, not sent to
    --force, which would only be refused next."""
    refuse_working_directory(output)  # first: ".." that holds it is told so
    if Path(output).name == "..":  # "out/new/..": what it names is known only once "new" exists, made by the run
        raise ThinkerError(
            f"{output}: OUTPUT ends in '..'; name the folder itself ({os.path.normpath(Path(output).absolute())})"
        )
    local = source is not None and Path(source).expanduser().exists()
    if local:
        refuse_output_over_source(output, Path(source).expanduser())
    if not force or (source is not None and not local):
        # with --force, after the checks against the source, whose messages say more; but before a Hub source's
        # download, after which a file at OUTPUT would only be refused (a mutation run: gigabytes fetched for nothing)
        refuse_a_file(output)
    if os.path.ismount(output):  # known before the work, which the replacement would then throw away; --force or not
        raise ThinkerError(
            f"{Path(output).absolute()}: OUTPUT is a mount point, which cannot be replaced (--force swaps folders "
            "by renaming them); write into a folder inside it"
        )
    if (output.exists() or output.is_symlink()) and not force:
        refuse_replacing_another_folder(output)  # what --force would refuse is told so, not sent to --force
        when = f" {replaced_when}" if replaced_when else ""
        raise ThinkerError(f"{output} already exists; pass --force to replace it{when}")


def not_an_earlier_output(output: Path) -> str | None:
    """Why ``--force`` may not replace the folder ``output`` ("holds .git, src", "no README.md ...", "model.safetensors
    changed after ..."), or None: it is a folder a thinker command wrote (``card_format``), holding nothing but plain
    files and none changed since, an empty folder or absent. A link is refused: --force would replace the link, and
    the folder it leads to, the one meant, would keep the old output; so is a file."""
    if output.is_symlink():
        return f"a link to {os.readlink(output)}, which --force would replace, not the folder it leads to"
    if not output.exists():
        return None
    if not output.is_dir():
        return "a file"
    with os.scandir(output) as scan:
        # a report a killed ``thinker verify`` left half-written (``write_atomically``) is thinker's, not the user's
        entries = [entry for entry in scan if not stale_partial(entry)]
    if not entries:
        return None
    others = sorted(e.name for e in entries if e.name.startswith(".") or not e.is_file(follow_symlinks=False))
    if others:
        return f"holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}"
    if not written_by_thinker(output):
        if any(e.name == CARD_FILE for e in entries):
            return f"its {CARD_FILE} is not a thinker model card"
        return f"no {CARD_FILE} model card of thinker's"
    return changes_since_written(output, [e.name for e in entries])


def refuse_replacing_another_folder(output: Path) -> None:
    """``--force`` deletes the folder it replaces, so it replaces only an empty folder or an earlier output: one a
    thinker command wrote, known by its model card, holding nothing but plain files. Anything else is refused by
    name, however OUTPUT was typed: a home or project folder (a QA run replaced the home folder, and every program
    installed in it, with an export), and above all another model's folder, which may be the only copy of a source
    checkpoint or a fine-tuned model."""
    if held := not_an_earlier_output(output):
        raise ThinkerError(
            f"{Path(output).absolute()}: not an earlier output of thinker ({held}), and --force deletes the folder "
            "it replaces: choose another OUTPUT, or delete or empty this folder yourself if it is to go"
        )


def _forms(path: Path) -> set[Path]:
    """A path as written (made absolute, ``..`` folded) and with its symlinks resolved: two spellings of one place
    must not slip past a comparison."""
    # os.path.realpath rather than Path.resolve, which raises on a symlink loop: such a path is refused later, by
    # name, where it is used
    return {Path(os.path.abspath(path)), Path(os.path.realpath(path))}


def _identity(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of what is at ``path``, or None where nothing is: it names one place however it is
    reached, where the path forms above cannot (a bind mount of a folder, another case on a case-insensitive disk)."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _lineage(path: Path) -> list[tuple[int, int]]:
    """The identities of ``path`` (first, where it exists) and of every folder above it."""
    real = Path(os.path.realpath(path))
    return [identity for identity in map(_identity, (real, *real.parents)) if identity is not None]


def refuse_working_directory(output: Path) -> None:
    here = _forms(Path.cwd())
    shown = Path(output).absolute()
    for form in _forms(output):
        if form in here or any(form in folder.parents for folder in here):
            holds = "" if form in here else ", or holds it"
            raise ThinkerError(
                f"{shown}: OUTPUT is the working directory{holds}; replacing OUTPUT would delete "
                "what you are working in: choose another folder"
            )
    output_identity = _identity(output)
    if output_identity is not None and output_identity in _lineage(Path.cwd()):
        raise ThinkerError(
            f"{shown}: OUTPUT is the working directory, or holds it, reached by another path (a bind mount, a "
            "link, another case); replacing OUTPUT would delete what you are working in: choose another folder"
        )


def refuse_output_over_source(
    output: Path, source: Path, writes_into: bool = False, role: str | None = None, a_file: bool = True
) -> None:
    """OUTPUT is replaced as a whole (``--force``), so it must not be the source (a folder, or one weights file),
    nor hold it, nor lie inside a source folder; beside a single source file, it must not be one of the files read
    with it (its config.json, its tokenizer); and it is a folder, never a file. ``writes_into``: OUTPUT is an
    existing folder written into (``thinker verify``'s parity.json, its CONVERTED argument), so only being, or lying
    inside, the source is refused. ``role``: what the messages call OUTPUT (``--report``, a new file); ``a_file``
    False leaves a file at OUTPUT to the caller's own words."""
    shown = Path(output).absolute()
    role = role or ("CONVERTED" if writes_into else "OUTPUT")
    folder_source = Path(source).is_dir()
    for out in _forms(output):
        for src in _forms(source):
            if out == src:
                raise ThinkerError(f"{shown}: {role} is the source {src} itself; choose another folder")
            if out in src.parents and not writes_into:
                raise ThinkerError(
                    f"{shown}: OUTPUT holds the source {src}, which replacing OUTPUT would delete; "
                    "choose another folder"
                )
            beside = not folder_source and out.parent == src.parent and out.name in {*CONFIG_FILES, *TOKENIZER_FILES}
            if (folder_source and src in out.parents) or beside:
                raise ThinkerError(
                    f"{shown}: {role} lies inside the source {src if folder_source else src.parent} (a file the "
                    "conversion reads, or a folder among them); choose a folder outside it"
                )
    refuse_same_place(output, source, writes_into)
    if not writes_into:
        holding = [c for c in hub_caches_of(Path(source)) if any(o == c or c in o.parents for o in _forms(output))]
        if holding:
            # The source's bytes are links into the cache's blobs/ (the repo's or the cache-wide store), outside
            # the snapshot folder: an OUTPUT there, replaced with --force, would delete them or another repo's.
            raise ThinkerError(
                f"{shown}: {role} lies inside the Hugging Face cache {holding[0]} the source is read from, where "
                "replacing it would delete cached files (a snapshot's blobs/); choose a folder outside the cache"
            )
        if a_file:
            refuse_a_file(output)


def refuse_same_place(output: Path, source: Path, writes_into: bool) -> None:
    """``refuse_output_over_source``'s checks by identity: OUTPUT reached by another path than the source's (a bind
    mount, another case on a case-insensitive disk), which no comparison of paths sees, and which ``--force`` would
    replace, source and all."""
    shown, role = Path(output).absolute(), "CONVERTED" if writes_into else "OUTPUT"
    another_path = "reached by another path (a bind mount, a link, another case)"
    output_identity, source_lineage = _identity(output), _lineage(source)
    source_identity = _identity(source)
    if output_identity is not None and output_identity == source_identity:
        raise ThinkerError(f"{shown}: {role} is the source {source} itself, {another_path}; choose another folder")
    if output_identity is not None and output_identity in source_lineage and not writes_into:
        raise ThinkerError(
            f"{shown}: OUTPUT holds the source {source}, {another_path}, which replacing OUTPUT would delete; "
            "choose another folder"
        )
    if Path(source).is_dir() and source_identity in _lineage(output):
        raise ThinkerError(
            f"{shown}: {role} lies inside the source {source}, {another_path}; choose a folder outside it"
        )


def refuse_a_file(output: Path) -> None:
    """A file at OUTPUT is more likely a mistyped path than an old output, so not even --force, which removes what it
    replaces, takes it (transformers' save_pretrained refuses a file too)."""
    if output.exists() and not output.is_dir():
        shown = Path(output).absolute()
        raise ThinkerError(f"{shown} is a file, and OUTPUT is a folder: choose another path (--force replaces folders)")


# --- staging folders -----------------------------------------------------------------------------------------------
# A run writes into ".OUTPUT.partial-HOST-PID-TOKEN" beside OUTPUT. Naming the owner lets a later run into the same
# OUTPUT remove the leftovers of a killed one (its process is gone) without touching a run still in progress, here
# or on another host sharing the folder.
_STAGING = re.compile(r"^\.(?P<output>.+)\.partial-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _host() -> str:
    """Whose process ids a staging name's pid is: the host name, and on Linux the pid namespace (containers that share
    the host's name and network, ``docker --network host``, each have their own, where a live run elsewhere has a pid
    that looks dead here)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
    try:
        return f"{host}_ns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux
        return host


_HOST = _host()


_NAME_MAX = 255  # bytes in one file name, on every file system Linux and macOS use


def _label(name: str) -> str:
    """OUTPUT's name as staging names carry it: whole when the longest staging name fits in a file name, else cut
    short and made unique again by a hash of the whole name (a 250-character OUTPUT is a valid name; its staging
    folder must be one too)."""
    longest = f".{name}.partial-{_HOST}-{'9' * 10}-{'0' * 8}"  # a pid has at most 10 digits
    excess = len(os.fsencode(longest)) - _NAME_MAX
    if excess <= 0:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    kept = os.fsencode(name)[: max(len(os.fsencode(name)) - excess - len(digest) - 1, 1)]
    return f"{kept.decode(errors='ignore')}~{digest}"


def staging_path(output: Path) -> Path:
    return output.with_name(f".{_label(output.name)}.partial-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_staging(output: Path) -> list[Path]:
    """Delete the staging folders of earlier runs into ``output`` whose process has died; returns them."""
    removed = []
    try:
        siblings = list(output.parent.iterdir())
    except OSError:
        return removed
    label = _label(output.name)
    for path in siblings:
        match = _STAGING.match(path.name)
        if match and match["output"] == label and match["host"] == _HOST and not alive(int(match["pid"])):
            _remove(path)
            removed.append(path)
    if removed:
        log.info("removed %d leftover staging folder(s) of interrupted runs beside %s", len(removed), output)
    return removed


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # no space, or over the user's quota


def write_fully(file, data) -> None:
    """All of ``data`` (bytes or a C-contiguous array) written to ``file``: a raw file's write may write part of it
    and say so only by its count, and only the next write raises the full disk's ENOSPC. numpy's own writers
    (``ndarray.tofile``, ``np.save`` on a real file) raise an OSError without an errno there, only their message
    ("... requested and ... written"), which no caller can tell from another failure (an export on a full disk said
    numpy's words, not the disk-full line: helper-242); through here the OSError keeps its errno."""
    view = memoryview(data).cast("B")
    while view:
        view = view[file.write(view) :]


class WritesFully:
    """``file`` as numpy's writers see a file-like object (``np.save(WritesFully(file), ...)``): they then write
    through ``write`` in chunks, and each chunk goes through ``write_fully``."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, data) -> int:
        write_fully(self.file, data)
        return memoryview(data).nbytes


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def disk_full(folder: Path, needed: int | None) -> ThinkerError:
    """The one message for a full disk, whether found before writing or by a write that failed."""
    folder = outside_staging(folder)
    try:
        available = free_bytes(folder)
        free = f"{_mib(available)} free"
    except OSError:
        available, free = None, "free space unknown"
    need = f"needs about {_mib(needed)}" if needed else "needs more space"
    if needed and available is not None and available >= needed:  # the estimate is the weights': the rest (the
        # graph's proto, the tokenizer, the reports) did not fit, or another process filled the disk meanwhile
        need = f"needs more than the {_mib(needed)} of its weights"
    return ThinkerError(
        f"the disk is full at {folder}: writing OUTPUT {need}, {free} there; free some space or put OUTPUT on "
        "another disk (nothing was written)"
    )


def outside_staging(path: Path) -> Path:
    """``path``, or the folder holding the outermost staging folder on it: what a message names, since a staging
    folder (an export's conversion on the way writes into its own) is gone by the time the user reads it."""
    for index, part in enumerate(path.parts):
        if _STAGING.match(part):
            return Path(*path.parts[:index])
    return path


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path``, written beside it and renamed over it: a file updated in a finished folder (``thinker
    verify``'s report, the model card's checks), which a kill or a full disk must leave as it was."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(text, encoding="utf-8", errors="surrogateescape")  # a card's bytes kept as read
        os.replace(partial, path)
    except OSError as err:  # a full disk, a read-only folder: the update is lost, the folder stays as it was
        with contextlib.suppress(OSError):  # never created, on a read-only file system
            partial.unlink()
        advice = "free some space" if err.errno in DISK_FULL else "make the folder writable"
        raise ThinkerError(
            f"{outside_staging(path.parent)}: cannot write {path.name} there ({err.strerror or err}); {advice}"
        ) from None


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


@contextmanager
def work_folder(output: Path, needed: int | None = None) -> Iterator[Path]:
    """A fresh staging folder beside ``output`` (same file system, so renames into place are atomic), always
    removed at the end. ``needed``, the bytes the run will write, is checked against the free space first; a write
    that fails for lack of space, there or later, becomes a ``ThinkerError`` saying so."""
    output = output.absolute()
    # an existing OUTPUT (which only --force lets a run reach) is looked at before the work, after the checks against
    # the source, whose messages say more, and again when it is replaced (``install``)
    refuse_replacing_another_folder(output)
    created: list[Path] = []  # OUTPUT's parents this run made, deepest first
    try:
        for attempt in range(3):
            try:
                make_parents(output.parent, created)
                remove_stale_staging(output)
                staging = staging_path(output)
                staging.mkdir()
                break
            except FileNotFoundError:  # a parent gone since it was made: another run's refusal took it, empty
                if attempt == 2:
                    raise
    except OSError as err:
        _remove_empty(created)
        # Named where it failed: the folder that exists, which is OUTPUT's parent unless the run had to create that.
        where = next((folder for folder in output.parents if folder.exists()), output.parent)
        what = f"{os.path.relpath(output, where)} in it"  # OUTPUT's own name at least (/proc says ENOENT)
        if not where.is_dir():  # mkdir's "File exists" / "Not a directory" would not say which path is the file
            raise ThinkerError(
                f"{where}: a file, not a folder, so {os.path.relpath(output, where)} cannot be created in it; "
                "choose an OUTPUT inside a folder"
            ) from None
        raise ThinkerError(
            f"{where}: cannot create {what} ({err.strerror or err}); choose a folder you can write to"
        ) from None
    try:
        try:
            if needed is not None and free_bytes(output.parent) < needed:
                raise disk_full(output.parent, needed)
            yield staging
        except OSError as err:
            if err.errno in DISK_FULL:
                _remove(staging)  # first, so that the free space the message gives is what the user now has
                raise disk_full(output.parent, needed) from None
            raise
    except BaseException:
        _remove_to_the_end(staging)  # a signal meanwhile gives way to the run's own exception, which goes on
        _remove_empty(created)  # a run that wrote nothing leaves no folders behind, not even OUTPUT's parents
        raise
    # The run's result is in place: its staging folder (an export's float32 copy for the activation-aware scales, or
    # the OUTPUT --force replaced) goes to the end whatever arrives meanwhile; a signal that arrived then is raised
    # once it is gone, so that the caller stops as asked (`thinker demo` went on to its next step), OUTPUT complete
    signalled = _remove_to_the_end(staging)
    if signalled is not None:
        raise signalled


def _remove_to_the_end(path: Path) -> BaseException | None:
    """``_remove(path)`` carried to the end through Ctrl-C, SIGTERM and SIGHUP, which arrive as exceptions
    (KeyboardInterrupt, thinker_common.cli's Terminated) and stopped the removal part way: a signal just after an
    export's OUTPUT was in place left its staging folder beside it, a copy of the model at worst, which no later run
    into another OUTPUT removes (helper-242). Returns the first such exception, for the caller to raise once the
    folder is gone (a failing run's own error goes on instead), or None."""
    signalled = None
    while True:
        try:
            _remove(path)
            return signalled
        except Exception:
            raise
        except BaseException as err:  # a signal's exception (not an error, which rmtree ignores here): remove the rest
            signalled = signalled or err


def make_parents(folder: Path, made: list[Path]) -> None:
    """Make ``folder`` and its missing parents, outermost first, putting each this call made at the front of
    ``made`` as it goes (so that a failure part way still knows them). Only what ``mkdir`` itself made is recorded:
    a folder that existed, or a path that reaches one through ``..`` (``new/../old``), is never taken for the run's,
    to be removed when the run fails."""
    for path in [*reversed(folder.parents), folder]:
        try:
            path.mkdir()
        except FileExistsError:
            continue
        made.insert(0, path)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders this run made for OUTPUT's parent (``make_parents``), deepest first, while they are
    empty: one holding anything, another run's output or staging folder included, stays, and so do those above."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue  # removed already
        except OSError:
            return


@contextmanager
def staged_output(output: Path, force: bool, needed: int | None = None) -> Iterator[Path]:
    """A staging folder beside ``output`` to write into; renamed to ``output`` when the block completes."""
    output = output.absolute()
    with work_folder(output, needed) as staging:
        yield staging
        install(staging, output, force)


# Every OUTPUT this process has put in place, in order: a command interrupted after one was in place says so
# (thinker_common.cli), rather than leaving the user to take a complete folder for a partial one.
INSTALLED: list[Path] = []


def install(staging: Path, output: Path, force: bool) -> None:
    """Put the finished ``staging`` folder at ``output``; with ``force``, an existing ``output`` is replaced.

    The replacement is one atomic exchange of the two names (Linux ``renameat2``), so OUTPUT is at every moment
    either the old folder or the new one; the old one, now at the staging name, is deleted with it. Where the
    exchange is unavailable, OUTPUT is moved aside first: it is then absent (never partial) between two renames.
    A new OUTPUT is renamed into place with RENAME_NOREPLACE, so that a folder someone made there since the look
    (a plain rename would replace an empty one) is refused, not replaced.
    """
    if (card := stamped_card(staging)) is not None:  # last: what --force later takes as unchanged since (card_format)
        write_atomically(staging / CARD_FILE, card)
    if not (output.exists() or output.is_symlink()):
        try:
            # never over a folder that appeared since the look above (a plain rename replaces an empty one)
            if not _renameat2(staging, output, _RENAME_NOREPLACE):
                staging.rename(output)  # no renameat2 here: that window stays open
            INSTALLED.append(output)
            return
        except FileExistsError:
            pass  # it did appear: as below
    if not force:
        raise ThinkerError(f"{output} appeared during the run; pass --force to replace it")
    refuse_replacing_another_folder(output)  # again: it may have changed, or appeared, since the look before the work
    try:
        if _exchange(staging, output):
            INSTALLED.append(output)
            return  # the old OUTPUT is at ``staging`` now and goes with it
        # Not a staging name: were the run killed between the two renames, the old folder must survive the next run.
        retired = output.with_name(f".{_label(output.name)}.{uuid.uuid4().hex[:8]}.old")
        output.rename(retired)
    except OSError as err:  # a mount point (EBUSY), an immutable folder (EPERM): the old OUTPUT stays as it was
        raise ThinkerError(
            f"{output}: cannot replace it ({err.strerror or err}); the new folder was not installed: write to "
            "another path, or into a folder inside this one"
        ) from None
    staging.rename(output)
    INSTALLED.append(output)
    _remove(retired)


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where the platform or file system cannot."""
    return _renameat2(first, second, _RENAME_EXCHANGE)


def _renameat2(first: Path, second: Path, flags: int) -> bool:
    """Linux ``renameat2(first, second, flags)``; False where the platform or file system cannot, an OSError (a
    FileExistsError for RENAME_NOREPLACE onto something) where it fails."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # an old kernel, or a file system without it
        return False
    raise OSError(code, os.strerror(code), str(second))


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # no C library to load by that name (Windows)
        return None
