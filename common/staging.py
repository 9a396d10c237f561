"""Output written atomically: into a hidden staging folder beside OUTPUT, renamed into place only once complete.

An interrupted run never leaves a half-written OUTPUT, and an existing OUTPUT is replaced (with ``--force``) only by
a finished one. Every command that writes a folder (``thinker-convert``, ``thinker export``) goes through here.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import ThinkerError

log = logging.getLogger(__name__)


def refuse_existing_output(output: Path, force: bool, replaced_when: str = "") -> None:
    """An existing OUTPUT is only ever replaced on request, and it is checked before any work starts;
    ``replaced_when`` tells the user when ``--force`` would replace it (e.g. "once the new conversion is complete")."""
    if (output.exists() or output.is_symlink()) and not force:
        when = f" {replaced_when}" if replaced_when else ""
        raise ThinkerError(f"{output} already exists; pass --force to replace it{when}")


def refuse_overwriting_source(output: Path, source_root: Path) -> None:
    """``--force`` must not replace the folder the weights are read from (or one holding it)."""
    output, source_root = output.resolve(), source_root.resolve()
    if output == source_root or output in source_root.parents:
        raise ThinkerError(f"{output}: OUTPUT would replace the source checkpoint itself; choose another folder")


# --- staging folders -----------------------------------------------------------------------------------------------
# A run writes into ".OUTPUT.partial-HOST-PID-TOKEN" beside OUTPUT. Naming the owner lets a later run into the same
# OUTPUT remove the leftovers of a killed one (its process is gone) without touching a run still in progress, here
# or on another host sharing the folder.
_STAGING = re.compile(r"^\.(?P<output>.+)\.partial-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def staging_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.partial-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_staging(output: Path) -> list[Path]:
    """Delete the staging folders of earlier runs into ``output`` whose process has died; returns them."""
    removed = []
    try:
        siblings = list(output.parent.iterdir())
    except OSError:
        return removed
    for path in siblings:
        match = _STAGING.match(path.name)
        if match and match["output"] == output.name and match["host"] == _HOST and not _alive(int(match["pid"])):
            _remove(path)
            removed.append(path)
    if removed:
        log.info("removed %d leftover staging folder(s) of interrupted runs beside %s", len(removed), output)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # no space, or over the user's quota


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def disk_full(folder: Path, needed: int | None) -> ThinkerError:
    """The one message for a full disk, whether found before writing or by a write that failed."""
    try:
        free = f"{_mib(free_bytes(folder))} free"
    except OSError:
        free = "free space unknown"
    need = f"needs about {_mib(needed)}" if needed else "needs more space"
    return ThinkerError(
        f"the disk is full at {folder}: writing OUTPUT {need}, {free} there; free some space or put OUTPUT on "
        "another disk (nothing was written)"
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


@contextmanager
def work_folder(output: Path, needed: int | None = None) -> Iterator[Path]:
    """A fresh staging folder beside ``output`` (same file system, so renames into place are atomic), always
    removed at the end. ``needed``, the bytes the run will write, is checked against the free space first; a write
    that fails for lack of space, there or later, becomes a ``ThinkerError`` saying so."""
    output = output.absolute()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(output)
        staging = staging_path(output)
        staging.mkdir()
    except OSError as err:
        raise ThinkerError(
            f"{output.parent}: cannot create OUTPUT there ({err.strerror or err}); choose a folder you can write to"
        ) from None
    try:
        if needed is not None and free_bytes(output.parent) < needed:
            raise disk_full(output.parent, needed)
        yield staging
    except OSError as err:
        if err.errno in _DISK_FULL:
            raise disk_full(output.parent, needed) from None
        raise
    finally:
        _remove(staging)


@contextmanager
def staged_output(output: Path, force: bool, needed: int | None = None) -> Iterator[Path]:
    """A staging folder beside ``output`` to write into; renamed to ``output`` when the block completes."""
    output = output.absolute()
    with work_folder(output, needed) as staging:
        yield staging
        install(staging, output, force)


def install(staging: Path, output: Path, force: bool) -> None:
    """Put the finished ``staging`` folder at ``output``; with ``force``, an existing ``output`` is replaced.

    The replacement is one atomic exchange of the two names (Linux ``renameat2``), so OUTPUT is at every moment
    either the old folder or the new one; the old one, now at the staging name, is deleted with it. Where the
    exchange is unavailable, OUTPUT is moved aside first: it is then absent (never partial) between two renames.
    """
    if not (output.exists() or output.is_symlink()):
        staging.rename(output)
        return
    if not force:
        raise ThinkerError(f"{output} appeared during the run; pass --force to replace it")
    if _exchange(staging, output):
        return  # the old OUTPUT is at ``staging`` now and goes with it
    # Not a staging name: were the run killed between the two renames, the old folder must survive the next run.
    retired = output.with_name(f".{output.name}.{uuid.uuid4().hex[:8]}.old")
    output.rename(retired)
    staging.rename(output)
    _remove(retired)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where the platform or file system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
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
