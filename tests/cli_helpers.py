"""How the bad-input tests run a command and judge its ending: in process through click's runner, one ``error:``
line last on stderr, exit status 1, no traceback and no library warning before the line, nothing left at OUTPUT."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from thinker_common.cli import main

REPO = Path(__file__).resolve().parents[1]


def earlier_output(folder: Path, files: dict[str, str | bytes] | None = None) -> Path:
    """``folder`` made to stand for an earlier output of a thinker command, which ``--force`` may replace: a
    ``config.json``, ``files`` (name: contents) and the model card every output gets (``model_card.write_card``,
    its checks marker), recording thinker's write last as every command does (``card_format.stamped_card``)."""
    from thinker_common.card_format import CARD_FILE, stamped_card
    from thinker_common.model_card import write_card

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    for name, contents in (files or {}).items():
        path = folder / name
        path.write_bytes(contents) if isinstance(contents, bytes) else path.write_text(contents)
    write_card(folder, {}, "# an earlier output", "no checks")
    (folder / CARD_FILE).write_text(stamped_card(folder), errors="surrogateescape")
    return folder


def thinker(*args: object, command=main) -> Result:
    return CliRunner().invoke(command, [str(arg) for arg in args])


def thinker_meeting_pipes(*args: object, pipes: Iterable[Path], timeout: float = 120) -> Result:
    """``thinker ARGS`` in process, for a run that meets named pipes: a refusal returns at once, but a run that opens
    a pipe blocks until someone writes to it. So the run gets ``timeout`` seconds in a thread; past them each pipe's
    writing end is opened and closed (which releases a reader blocked on it, with end of file) and the test fails.
    In process rather than in a real one (``run_cli``), which would cost a fresh interpreter's imports each time."""
    outcome: dict[str, Result] = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("result", thinker(*args)), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        # The run may open a pipe again after each end of file (a retry, a second reader): release it until it ends
        # (or, if it never does, leave the thread behind: it is a daemon, and the test fails either way).
        deadline = time.monotonic() + timeout
        while worker.is_alive() and time.monotonic() < deadline:
            for pipe in pipes:
                with contextlib.suppress(OSError):  # ENXIO: nobody is reading this one now
                    os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(0.05)
        pytest.fail(f"thinker {' '.join(map(str, args))} was still running after {timeout} s: it read a named pipe")
    return outcome["result"]


def assert_error(result: Result, *fragments: str) -> str:
    """Exit 1 with one ``error: ...`` line, last on stderr (after any progress bar), holding every fragment; no
    traceback anywhere, and no error or library warning printed before the line."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # not an exception escaping the command
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert not [line for line in lines[:-1] if "error" in line.lower() or "warning" in line.lower()], result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert "Traceback" not in result.output
    return lines[-1]


def assert_usage_error(result: Result, *fragments: str) -> None:
    """click's own refusal of an option value: exit 2, its ``Error:`` line, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def assert_nothing_written(output: Path) -> None:
    """No OUTPUT, and no staging folder (``.OUTPUT.partial-*``) or other hidden leftover beside it."""
    assert not output.exists()
    assert not [path.name for path in output.parent.iterdir() if path.name.startswith(".")]


def run_cli(
    *args: object,
    cwd: Path | None = None,
    timeout: float = 240,
    address_space: int | None = None,
    file_size: int | None = None,
) -> subprocess.CompletedProcess:
    """``thinker ARGS`` in a real process: for what must run within ``address_space`` bytes of memory, or write no
    file larger than ``file_size`` bytes (RLIMIT_FSIZE, as a small file system's limit), or must be seen as a user's
    shell sees it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "thinker_common.cli", *map(str, args)]

    def limit() -> None:
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    # No preexec_fn without a limit: Python code between fork and exec is unsafe where other threads run
    # (``side_by_side``).
    preexec = limit if address_space is not None or file_size is not None else None
    return subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout, preexec_fn=preexec
    )


@contextlib.contextmanager
def side_by_side(jobs: dict[Any, Callable[[], object]]) -> Iterator[dict[Any, Future]]:
    """Starts ``jobs`` (name -> a function of no arguments that runs a real process and returns what it gives) in
    threads, as many at once as the machine has cores (two at least); yields name -> Future, whose ``.result()``
    waits for that job and returns (or raises) what it did; waits for them all on exit. For a module's processes
    that do not depend on one another: most of a fresh interpreter's time goes to importing torch and transformers
    on one core, so two side by side take about the time of one on a two-core machine. Each test still judges its
    own process, with the same assertions. The jobs must not use ``preexec_fn`` (see ``run_cli``)."""
    workers = max(1, min(len(jobs), max(2, os.cpu_count() or 2)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


def assert_process_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    """As ``assert_error``, for a real process."""
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), done.stderr
    assert not [line for line in lines[:-1] if "error" in line.lower() or "warning" in line.lower()], done.stderr
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert "Traceback" not in done.stdout + done.stderr
    return lines[-1]


# --- breaking a checkpoint ---------------------------------------------------------------------------------------


def edit_config(folder: Path, drop: tuple[str, ...] = (), **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in drop:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


def as_shard(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model.safetensors renamed to a shard, model-a.safetensors, and its tensors: transformers (and
    the converter) read a whole model.safetensors before any index beside it, so an index only counts without one."""
    (folder / "model.safetensors").rename(folder / "model-a.safetensors")
    return load_file(folder / "model-a.safetensors")


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


_WORDS = "the a cat dog sat on mat and ran to house big small red blue one two three is was it".split()


def save_word_tokenizer(folder, vocab_size: int = 64):
    """A whitespace word-level tokenizer with one token per id (pad 0, bos 1, eos 2, unk 3, words, w<id> fillers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", *_WORDS]
    tokens += [f"w{i}" for i in range(len(tokens), vocab_size)]
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]"
    )
    tokenizer.save_pretrained(folder)
