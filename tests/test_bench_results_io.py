"""bench/results_io.py: a benchmark's bad arguments refused before the run, and result files (README's figures come out
of them) replaced whole or not at all. No benchmark is run."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import results_io  # noqa: E402


def test_counts_and_names_are_refused_before_the_run():
    assert results_io.positive_int("3") == 3
    for wrong in ("0", "-2", "three"):
        with pytest.raises(argparse.ArgumentTypeError):
            results_io.positive_int(wrong)
    models = results_io.names_from(("smollm2", "qwen3"))
    assert models("qwen3,smollm2") == ["qwen3", "smollm2"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown name 'qwen9'; choose from smollm2, qwen3"):
        models("smollm2,qwen9")


def test_a_result_folder_that_is_not_there_is_refused_not_created(tmp_path):
    with pytest.raises(SystemExit, match="no such folder for the results"):
        results_io.result_file(str(tmp_path / "missing" / "x.json"))
    assert not (tmp_path / "missing").exists()
    assert results_io.result_file(str(tmp_path / "x.json")) == tmp_path / "x.json"


def test_a_file_or_an_empty_path_is_no_result_folder(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="a-file: a file, not a folder for the results"):
        results_io.writable_folder(tmp_path / "a-file")
    with pytest.raises(SystemExit, match="an empty path for the results"):  # not the working directory
        results_io.writable_folder("")
    assert results_io.writable_folder(tmp_path) == tmp_path


def test_a_write_that_fails_leaves_the_previous_figures(tmp_path, monkeypatch):
    published = tmp_path / "fast.json"
    published.write_text('{"old": 1}\n')

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        results_io.write_result(published, '{"new": 2}\n')
    assert published.read_text() == '{"old": 1}\n'
    assert [path.name for path in tmp_path.iterdir()] == ["fast.json"]  # no partial file left beside it
    monkeypatch.undo()
    results_io.write_result(published, '{"new": 2}\n')
    assert published.read_text() == '{"new": 2}\n'


@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        ("bench_fast.py", ["--models", "bogus"], "unknown name 'bogus'"),
        ("bench_hybrid.py", ["--models", "dense,bogus"], "unknown name 'bogus'"),
        ("bench_shared_cache.py", ["--models", "bogus"], "unknown name 'bogus'"),
        ("bench_graph_ab.py", ["A", "B", "--reps", "0", "--tag", "x"], "--reps: 0 is not 1 or more"),
        ("bench_model.py", ["--reps", "0"], "--reps: 0 is not 1 or more"),
    ],
)
def test_benchmarks_refuse_bad_arguments_in_one_line(script, arguments, message):
    """Each at once (no peer environment built, no model made), with a message and no traceback."""
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_the_recorded_command_is_the_one_readme_writes(monkeypatch):
    """Whatever path the script was started by, ``python bench/SCRIPT`` and its arguments, quoted so that the line
    runs again as recorded."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_widened.py"), "--models", "qwen3,gpt2", "--tag", "a b"])
    assert results_io.command_line() == "python bench/bench_widened.py --models qwen3,gpt2 --tag 'a b'"
