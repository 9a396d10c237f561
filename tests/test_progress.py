"""Progress (issue 15): conversion, export, quantization and verification each show a bar on a terminal, and none
when stderr is a file or a pipe; no blank lines either way. Run as real processes, stderr on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest
from cli_helpers import REPO

pytestmark = pytest.mark.slow


def run_on_terminal(*args: object) -> tuple[int, str]:
    """``thinker ARGS`` with stderr on a pseudo-terminal; its exit status and what the terminal showed."""
    master, slave = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, which tqdm would fill with an empty bar: size it like a terminal.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "common.cli", *map(str, args)]
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


def test_export_and_verify_show_progress_on_a_terminal(qwen3_thinker, tmp_path):
    status, shown = run_on_terminal("export", qwen3_thinker, tmp_path / "onnx", "--verify")
    assert status == 0, shown
    assert_bars(shown, "exporting", "verifying")


def test_quantization_shows_progress_on_a_terminal(qwen3_thinker, tmp_path):
    status, shown = run_on_terminal("export", qwen3_thinker, tmp_path / "onnx", "--quantize", "int8", "--verify")
    assert status == 0, shown
    assert_bars(shown, "quantizing", "accuracy guard", "verifying")


def test_conversion_shows_progress_on_a_terminal(qwen3_source, tmp_path):
    status, shown = run_on_terminal("convert", qwen3_source, tmp_path / "out", "--no-verify")
    assert status == 0, shown
    assert_bars(shown, "converting")


def test_no_progress_when_stderr_is_not_a_terminal(qwen3_source, qwen3_thinker, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args in (
        ["convert", qwen3_source, tmp_path / "thinker", "--no-verify"],
        ["export", qwen3_thinker, tmp_path / "onnx", "--verify", "--quantize", "int8"],
    ):
        command = [sys.executable, "-m", "common.cli", *map(str, args)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        assert "%|" not in done.stderr and "\r" not in done.stderr, done.stderr
        assert all(line.strip() for line in done.stderr.splitlines()), f"a blank line: {done.stderr!r}"
