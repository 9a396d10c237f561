"""Progress (issue 15): conversion, export, quantization and verification each show a bar on a terminal, and none
when stderr is a file or a pipe; no blank lines either way. Run as real processes, stderr on a pseudo-terminal.

The module's five processes are independent of one another (each reads the session's qwen3 folders and writes a
folder of its own), so the ``runs`` fixture starts them together (``cli_helpers.side_by_side``: two at a time on two
cores); each test waits for its own processes and checks them as before."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from concurrent.futures import Future
from functools import partial

import pytest
from cli_helpers import REPO, side_by_side

pytestmark = pytest.mark.slow


def run_on_terminal(*args: object) -> tuple[int, str]:
    """``thinker ARGS`` with stderr on a pseudo-terminal; its exit status and what the terminal showed."""
    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, which tqdm would fill with an empty bar: size it like a terminal.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "thinker_common.cli", *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return process.wait(timeout=600), shown.decode(errors="replace").replace("\r\n", "\n")


def visible_lines(text: str) -> list[str]:
    """Each line as the terminal leaves it: the last of its carriage-return redraws."""
    return [line.split("\r")[-1] for line in text.split("\n")[:-1]]


def assert_bars(text: str, *descriptions: str) -> None:
    lines = visible_lines(text)
    for description in descriptions:
        assert any(line.startswith(f"{description}: 100%|") for line in lines), (description, text)
    assert all(line.strip() for line in lines), f"a blank line: {lines}"


def run_piped(*args: object) -> subprocess.CompletedProcess:
    """``thinker ARGS`` with stdout and stderr on pipes."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "thinker_common.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def runs(qwen3_source, qwen3_thinker, tmp_path_factory) -> dict[str, Future]:
    """Every process of this module, started at once (``side_by_side``); a test's ``.result()`` waits for its
    own (and raises what running it raised)."""
    root = tmp_path_factory.mktemp("progress")
    jobs = {
        "export": partial(run_on_terminal, "export", qwen3_thinker, root / "onnx", "--verify"),
        "quantize": partial(run_on_terminal, "export", qwen3_thinker, root / "int8", "--quantize", "int8", "--verify"),
        "convert": partial(run_on_terminal, "convert", qwen3_source, root / "out", "--no-verify"),
        "piped convert": partial(run_piped, "convert", qwen3_source, root / "piped-thinker", "--no-verify"),
        "piped export": partial(
            run_piped, "export", qwen3_thinker, root / "piped-onnx", "--verify", "--quantize", "int8"
        ),
    }
    with side_by_side(jobs) as started:
        yield started


def test_export_and_verify_show_progress_on_a_terminal(runs):
    status, shown = runs["export"].result()
    assert status == 0, shown
    assert_bars(shown, "exporting", "verifying")


def test_quantization_shows_progress_on_a_terminal(runs):
    status, shown = runs["quantize"].result()
    assert status == 0, shown
    assert_bars(shown, "quantizing", "accuracy guard", "verifying")


def test_conversion_shows_progress_on_a_terminal(runs):
    status, shown = runs["convert"].result()
    assert status == 0, shown
    assert_bars(shown, "converting")


def test_no_progress_when_stderr_is_not_a_terminal(runs):
    for run in ("piped convert", "piped export"):
        done = runs[run].result()
        assert done.returncode == 0, done.stderr
        assert "%|" not in done.stderr and "\r" not in done.stderr, done.stderr
        assert all(line.strip() for line in done.stderr.splitlines()), f"a blank line: {done.stderr!r}"
