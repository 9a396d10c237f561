"""What every benchmark does with its arguments and its result files: counts of one or more, a result folder checked
before minutes of measuring rather than after, and result files replaced whole, never left half-written.

README's figures come out of these files: a run stopped midway (Ctrl-C, a full disk) must leave the figures of the run
before as they were, so each file is written beside its final name and renamed over it in one step.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path


def positive_int(text: str) -> int:
    """argparse type of a count (repetitions, tokens): a whole number, 1 or more; 0 would measure nothing and fail
    at the end, in the statistics, with a traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def names_from(choices) -> Callable[[str], list[str]]:
    """argparse type of a comma-separated list of ``choices`` (--models smollm2,qwen3): an unknown name is refused
    with the choices before any work (building a peer's environment can take minutes)."""

    def names(text: str) -> list[str]:
        picked = text.split(",")
        unknown = [name for name in picked if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown name {unknown[0]!r}; choose from {', '.join(choices)}")
        return picked

    return names


def writable_folder(path: Path) -> Path:
    """``path`` if it is an existing folder this process may write in; else a one-line ``SystemExit`` naming it,
    at the start of a run, not after it (a missing folder is not created: a mistyped path would scatter results)."""
    if not str(path).strip():  # Path("") is the working directory, which an unset shell variable did not name
        raise SystemExit("error: an empty path for the results; name a folder")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {path}: a file, not a folder for the results; name a folder")
    if not path.is_dir():
        raise SystemExit(f"error: {path}: no such folder for the results; create it or name another")
    if not os.access(path, os.W_OK):
        raise SystemExit(f"error: {path}: not writable; name a folder for the results you may write in")
    return path


def result_file(text: str) -> Path:
    """argparse type of a result file's path: its folder checked with ``writable_folder`` before the run."""
    path = Path(text)
    writable_folder(path.parent if str(path.parent) else Path("."))
    return path


def write_result(path: Path, text: str) -> None:
    """``text`` into ``path``, whole or not at all: written beside it, flushed, then renamed over it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with partial.open("w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def command_line() -> str:
    """How this run was started, as README writes its commands (``python bench/SCRIPT ARGS``), for the result file
    to record beside its figures; each argument quoted where a shell needs it."""
    return shlex.join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def machine_name() -> str:
    """The CPU a result was measured on: /proc/cpuinfo's model name where Linux gives one (timings and even the
    quantized exports' judged fidelity move with it: MLAS picks its kernels by CPU), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
