"""Faults (issue 7): a conversion or an export killed at any moment leaves no partial OUTPUT, the next run into the
same OUTPUT works (and removes what the killed one left), and ``--force`` replaces OUTPUT only with a complete one.

Each run is a real process killed with SIGKILL at a chosen point: the function named by ``KillPoint`` kills its own
process on its n-th call, before or after doing its work. The processes are forked from a forkserver that imported
the converter and the exporter once, so a run costs a fraction of a second rather than an interpreter start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from pkgutil import resolve_name

import pytest
from cli_helpers import earlier_output, side_by_side

from converter.convert import convert
from export.exporter import export_model
from thinker_common.errors import ThinkerError
from thinker_common.sources import open_source
from thinker_common.staging import _HOST as HOST
from thinker_common.staging import remove_stale_staging, staging_path

CONVERT = {"verify": False, "progress": False, "max_shard_size": "20KB"}  # several shards and an index
EXPORT = {"verify": False}


@dataclass(frozen=True)
class KillPoint:
    """SIGKILL on the ``call``-th call of ``owner.attribute`` (``owner`` as pkgutil.resolve_name reads it)."""

    owner: str
    attribute: str
    call: int = 1
    after: bool = False  # die once the call has done its work, rather than before it starts

    def __str__(self) -> str:
        return f"{'after' if self.after else 'at'} {self.owner}.{self.attribute} #{self.call}"


def _die_at(point: KillPoint, job, args: tuple, kwargs: dict) -> None:
    """The child: arm the kill point, run the job. Returning normally means the point was never reached."""
    owner = resolve_name(point.owner)
    original = getattr(owner, point.attribute)
    calls = 0

    def dying(*call_args, **call_kwargs):
        nonlocal calls
        calls += 1
        if calls == point.call and not point.after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*call_args, **call_kwargs)
        if calls == point.call and point.after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, point.attribute, dying)
    job(*args, **kwargs)


@pytest.fixture(scope="module")
def killed():
    """``killed(point, job, *args, **kwargs)``: run ``job`` in a child process that the kill point ends."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["converter.convert", "export.exporter"])

    def run(point: KillPoint, job, *args, **kwargs) -> None:
        child = context.Process(target=_die_at, args=(point, job, args, kwargs))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == -signal.SIGKILL, f"not killed {point} (exit code {child.exitcode})"

    return run


def leftovers(output: Path) -> list[str]:
    return sorted(path.name for path in output.parent.iterdir() if path.name.startswith(f".{output.name}."))


def assert_complete_conversion(output: Path, source: Path) -> None:
    assert (output / "config.json").is_file() and (output / "model.safetensors.index.json").is_file()
    converted = open_source(output)  # every shard the index names is there, and every header reads
    try:
        assert len(converted.names()) == len(open_source(source).names())
    finally:
        converted.close()


def assert_complete_export(output: Path) -> None:
    assert {"model.onnx", "model.onnx.data", "genai_config.json", "export_report.json"} <= {
        path.name for path in output.iterdir()
    }


CONVERT_POINTS = [
    # Every tensor's bytes, written or copied by the kernel, go into their slot between _slot and _filled.
    KillPoint("converter.shards:ShardWriter", "_slot", call=2),  # the first shard half written
    KillPoint("converter.shards:ShardWriter", "_filled", call=9, after=True),  # some shards done, some not
    KillPoint("converter.convert", "write_thinker_config"),  # every weight written, no config yet
    KillPoint("thinker_common.staging", "install"),  # everything written, not yet renamed
]


@pytest.mark.parametrize("point", CONVERT_POINTS, ids=str)
def test_a_killed_conversion_leaves_no_output_and_the_next_run_works(point, killed, qwen3_source, tmp_path):
    output = tmp_path / "out"
    killed(point, convert, qwen3_source, output, **CONVERT)
    assert not output.exists()
    assert leftovers(output)  # the killed run's staging folder, which the next run must not trip over

    convert(qwen3_source, output, **CONVERT)
    assert_complete_conversion(output, qwen3_source)
    assert leftovers(output) == []  # removed: its process is dead


@pytest.mark.parametrize(
    "point",
    [KillPoint("converter.shards:ShardWriter", "_slot", call=3), KillPoint("thinker_common.staging", "_exchange")],
    ids=str,
)
def test_a_killed_force_run_leaves_the_old_output_intact(point, killed, qwen3_source, tmp_path, digest):
    output = earlier_output(tmp_path / "out", {"notes.txt": "the previous conversion"})  # which --force may replace
    before = digest(output)
    killed(point, convert, qwen3_source, output, force=True, **CONVERT)
    assert digest(output) == before

    convert(qwen3_source, output, force=True, **CONVERT)
    assert_complete_conversion(output, qwen3_source)
    assert not (output / "notes.txt").exists() and leftovers(output) == []


def test_killed_just_after_the_swap_the_output_is_the_new_one(killed, qwen3_source, tmp_path):
    output = earlier_output(tmp_path / "out", {"notes.txt": "the previous conversion"})  # which --force may replace
    killed(
        KillPoint("thinker_common.staging", "_exchange", after=True),
        convert,
        qwen3_source,
        output,
        force=True,
        **CONVERT,
    )
    assert_complete_conversion(output, qwen3_source)
    assert len(leftovers(output)) == 1  # the old folder, now under the staging name: the next run removes it
    remove_stale_staging(output.absolute())
    assert leftovers(output) == []


EXPORT_POINTS = [
    KillPoint("export.graph_builder:WeightFile", "_append", call=4),  # model.onnx.data half written
    KillPoint("export.exporter", "copy_side_files"),  # the graph written, no tokenizer or genai_config yet
    KillPoint("export.exporter", "install"),  # everything written, not yet renamed
]


@pytest.mark.parametrize("point", EXPORT_POINTS, ids=str)
def test_a_killed_export_leaves_no_output_and_the_next_run_works(point, killed, qwen3_thinker, tmp_path):
    output = tmp_path / "onnx"
    killed(point, export_model, qwen3_thinker, output, **EXPORT)
    assert not output.exists() and leftovers(output)

    export_model(qwen3_thinker, output, **EXPORT)
    assert_complete_export(output)
    assert leftovers(output) == []


def test_a_killed_export_that_converts_on_the_way(killed, qwen3_source, tmp_path):
    """Killed inside the conversion that an export of a non-Thinker SOURCE runs in its own staging folder."""
    output = tmp_path / "onnx"
    killed(KillPoint("converter.shards:ShardWriter", "_slot", call=2), export_model, qwen3_source, output, **EXPORT)
    assert not output.exists()
    export_model(qwen3_source, output, **EXPORT)
    assert_complete_export(output)
    assert leftovers(output) == []


def test_a_killed_export_with_force_leaves_the_old_output_intact(killed, qwen3_thinker, qwen3_onnx, tmp_path, digest):
    output = earlier_output(tmp_path / "onnx", {"model.onnx": b"the previous export"})  # which --force may replace
    before = digest(output)
    point = KillPoint("export.graph_builder:WeightFile", "_append", call=2)
    killed(point, export_model, qwen3_thinker, output, force=True, **EXPORT)
    assert digest(output) == before
    killed(KillPoint("thinker_common.staging", "_exchange"), export_model, qwen3_thinker, output, force=True, **EXPORT)
    assert digest(output) == before

    export_model(qwen3_thinker, output, force=True, **EXPORT)
    assert_complete_export(output)
    assert leftovers(output) == []


# A real `thinker-convert` process that sends itself SIGTERM (what kill, timeout and docker stop send) while its
# second tensor is being written.
TERMINATED_MIDWAY = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a pytest started with SIGINT ignored passes that on
from converter import shards
from converter.cli import convert_command
original, calls = shards.ShardWriter._slot, []
def slot(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)
shards.ShardWriter._slot = slot
convert_command(sys.argv[1:])
"""


SIGNALS = [(signal.SIGINT, "Aborted!"), (signal.SIGTERM, "Terminated."), (signal.SIGHUP, "Hung up.")]


def terminated_midway(signum: int, source: Path, output: Path) -> subprocess.CompletedProcess:
    code = TERMINATED_MIDWAY.replace("signal.SIGTERM", f"signal.{signal.Signals(signum).name}")
    command = [sys.executable, "-c", code, str(source), str(output), "--no-verify"]
    return subprocess.run([*command, "--max-shard-size", "20KB"], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def signalled(qwen3_source, tmp_path_factory) -> dict[int, tuple[Future, Path]]:
    """Both signals' processes, started at once (``cli_helpers.side_by_side``): each converts into an OUTPUT of its
    own folder. Signal -> (the run, its OUTPUT)."""
    outputs = {signum: tmp_path_factory.mktemp(signal.Signals(signum).name) / "out" for signum, _ in SIGNALS}
    jobs = {signum: partial(terminated_midway, signum, qwen3_source, output) for signum, output in outputs.items()}
    with side_by_side(jobs) as started:
        yield {signum: (started[signum], outputs[signum]) for signum in jobs}


@pytest.mark.parametrize("signum, words", SIGNALS)
def test_signals_unwind_and_exit_with_the_shells_status(signum, words, signalled):
    """SIGINT (Ctrl-C), SIGTERM (kill, timeout, docker stop) and SIGHUP (a closed terminal, a dropped ssh session):
    the staging folder removed on the way out, exit 128 + the signal's number, as a shell reports a process it ended
    (click's own exit for Ctrl-C is 1)."""
    started, output = signalled[signum]
    result = started.result()
    assert result.returncode == 128 + signum and result.stderr.strip() == words, result.stderr
    assert not output.exists() and leftovers(output) == []  # its staging folder removed on the way out


# The console script's run, then a Ctrl-C while the interpreter shuts down: an exit hook (as torch's) that says when
# it has started, then waits.
INTERRUPTED_AT_EXIT = """
import atexit, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a pytest started with SIGINT ignored passes that on
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # and one under nohup SIGHUP ignored: each signal kills, as by default
signal.signal(signal.SIGHUP, signal.SIG_DFL)
def late():
    print("exiting", flush=True)
    time.sleep(3)
atexit.register(late)
from converter.cli import thinker_convert
sys.argv = ["thinker-convert", "--version"]
thinker_convert()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_after_the_run_is_ignored(signum):
    """Once the command has run, its status decided, Ctrl-C no longer reaches the interpreter's exit hooks: it printed
    a traceback from torch's (a QA run's Ctrl-C half a second after a conversion's summary), or gave a conversion
    already in place SIGINT's status. SIGTERM and SIGHUP too, whose default killed the process there: a conversion in
    place exited -15 with nothing said (a QA run)."""
    code = [sys.executable, "-c", INTERRUPTED_AT_EXIT]
    process = subprocess.Popen(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("thinker-convert ")  # --version's line
    assert process.stdout.readline() == "exiting\n"
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and "KeyboardInterrupt" not in err and "Traceback" not in err, err


def test_a_closed_stdout_ends_quietly_after_the_work(qwen3_source, tmp_path):
    """stdout's reader gone (`thinker-convert ... | head`, here a pipe closed before the run): the conversion is in
    place, and the summary it could not print ends the run as SIGPIPE ends a shell tool (141), without the "error:
    Broken pipe" that read as a failed run."""
    output = tmp_path / "out"
    done = closed_stdout_run("convert", qwen3_source, output, "--no-verify")
    assert done.returncode == 128 + signal.SIGPIPE, done.stderr
    assert done.stderr == ""
    assert (output / "config.json").is_file() and leftovers(output) == []


def closed_stdout_run(*arguments: object) -> subprocess.CompletedProcess:
    """``thinker ARGUMENTS`` with stdout a pipe whose reader is gone before the run starts."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    command = [sys.executable, "-m", "thinker_common.cli", *map(str, arguments)]
    with open(write_end, "wb") as broken:
        return subprocess.run(command, stdout=broken, stderr=subprocess.PIPE, text=True, env=env, timeout=300)


def test_a_failure_with_stdout_closed_still_says_so(qwen3_source, tmp_path):
    """A failing verify prints its table to stdout first: with stdout gone, the error line still reaches stderr,
    exit 1 (the broken pipe was raised inside the failure's own report, and it used to end the run without a word)."""
    from safetensors.torch import load_file, save_file

    converted = tmp_path / "converted"
    convert(qwen3_source, converted, **CONVERT | {"max_shard_size": "5GB"})
    weights = load_file(converted / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 1.5
    save_file(weights, converted / "model.safetensors", metadata={"format": "pt"})
    done = closed_stdout_run("verify", qwen3_source, converted)
    assert done.returncode == 1, done.stderr
    assert "error: " in done.stderr and "does not match its reference" in done.stderr


@pytest.mark.parametrize("reader", ["gone", "there"])
def test_only_stdout_whose_reader_is_gone_counts_as_gone(reader):
    """A broken pipe is a quiet exit only where it is stdout's (`| head`); any other is an error to report."""
    code = "import sys; from thinker_common.cli import stdout_gone; print(stdout_gone(), file=sys.stderr)"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if reader == "gone":
        read_end, write_end = os.pipe()
        os.close(read_end)
        with open(write_end, "wb") as broken:
            done = subprocess.run(
                [sys.executable, "-c", code], stdout=broken, stderr=subprocess.PIPE, text=True, env=env
            )
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stderr.strip() == ("True" if reader == "gone" else "False")


def test_an_output_that_appears_during_the_run_is_never_replaced(tmp_path, monkeypatch):
    """OUTPUT made by someone else after the run looked (here an empty folder, which a plain rename replaces without
    a word): refused, the folder as it was, the run's own still at its staging name for the cleanup."""
    from thinker_common import staging

    output, work = tmp_path / "out", tmp_path / ".out.partial"
    work.mkdir()
    (work / "config.json").write_text("{}")
    output.mkdir()
    (tmp_path / "theirs.txt").write_text("mine")
    looked = {output}  # the look before the rename sees nothing there, as it did an instant before
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda path: False if path in looked else real_exists(path))
    with pytest.raises(ThinkerError, match="out appeared during the run; pass --force to replace it"):
        staging.install(work, output, force=False)
    assert list(output.iterdir()) == [] and (work / "config.json").is_file()


# --- staging folders of other runs -------------------------------------------------------------------------------


def test_only_the_staging_folders_of_dead_processes_are_removed(tmp_path):
    output = tmp_path / "out"
    live = staging_path(output)  # this process's own: a run in progress
    dead = tmp_path / f".out.partial-{HOST}-{_dead_pid()}-0123abcd"
    elsewhere = tmp_path / ".out.partial-another-host-1-0123abcd"  # its process may live, on that host
    other_output = tmp_path / f".other.partial-{HOST}-{_dead_pid()}-0123abcd"
    # the same host name in another pid namespace (a container on the host's network): its pids are not ours
    another_namespace = tmp_path / f".out.partial-{HOST.rsplit('_ns', 1)[0]}_ns1-{_dead_pid()}-0123abcd"
    for folder in (live, dead, elsewhere, other_output, another_namespace):
        folder.mkdir()
    assert remove_stale_staging(output) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, elsewhere, other_output, another_namespace])
    if Path("/proc/self/ns/pid").exists():
        assert HOST.endswith(f"_ns{os.stat('/proc/self/ns/pid').st_ino}")


def _dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
