"""The staging of OUTPUT, the side files, sizes, progress bars and the value check: tests written for the survivors
of a mutation run on thinker_common's staging.py, side_files.py, processes.py, progress.py, sizes.py and values.py
(each test names the behaviour a surviving mutation changed)."""

from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import assert_error, thinker

# --- OUTPUT ------------------------------------------------------------------------------------------------------


def test_force_replaces_an_empty_folder(qwen3_source, tmp_path):
    """An empty folder at OUTPUT (made beforehand with mkdir) is no one's data: without --force it is the usual
    "already exists; pass --force", and --force takes it (a mutation that looked for a model card in an empty folder
    refused it as "not an earlier output of thinker")."""
    output = tmp_path / "out"
    output.mkdir()
    refused = thinker("convert", qwen3_source, output, "--no-verify")
    assert_error(refused, f"{output} already exists; pass --force to replace it once the new conversion is complete")
    result = thinker("convert", qwen3_source, output, "--no-verify", "--force")
    assert result.exit_code == 0, result.output
    assert (output / "model.safetensors").is_file() and sorted(os.listdir(tmp_path)) == ["out"]


def test_output_holding_the_working_directory_is_named_by_path(qwen3_source, tmp_path, monkeypatch):
    """OUTPUT a folder above the working directory, typed as a plain path: the message says so, without the hint
    about "another path (a bind mount, a link, another case)", which is for the identity check alone."""
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    result = thinker("convert", qwen3_source, tmp_path / "work", "--force", "--no-verify")
    line = assert_error(
        result,
        f"{tmp_path / 'work'}: OUTPUT is the working directory, or holds it; replacing OUTPUT would delete what you",
    )
    assert "another path" not in line
    assert sorted(os.listdir(tmp_path / "work")) == ["here"]


def test_the_working_directory_reached_through_a_bind_mount_is_refused(bind_mounted, qwen3_source, monkeypatch):
    """The working directory, an empty folder, named as OUTPUT through a bind mount of its parent: no path
    comparison sees it, and --force (an empty folder is replaceable) would swap it away. Refused by identity."""
    real, alias = bind_mounted
    (real / "here").mkdir()
    monkeypatch.chdir(real / "here")
    result = thinker("convert", qwen3_source, alias / "here", "--force", "--no-verify")
    assert_error(result, f"{alias / 'here'}: OUTPUT is the working directory, or holds it, reached by another path")
    assert sorted(os.listdir(real)) == ["here"] and os.listdir(real / "here") == []


def test_verify_writes_into_a_converted_folder_that_holds_its_source(qwen3_source, tmp_path):
    """`thinker verify` writes parity.json into CONVERTED and replaces nothing, so a source kept inside CONVERTED is
    no reason to refuse (only CONVERTED inside the source, or the source itself, is)."""
    converted = tmp_path / "converted"
    assert thinker("convert", qwen3_source, converted, "--no-verify").exit_code == 0
    source = shutil.copytree(qwen3_source, converted / "original")
    result = thinker("verify", source, converted)
    assert result.exit_code == 0, result.output
    assert (converted / "parity.json").is_file()


@pytest.mark.parametrize(
    "free, says",
    [
        (2**20, "needs more than the 1.0 MiB of its weights, 1.0 MiB free there"),  # exactly the weights' bytes free
        (2**20 - 1, "needs about 1.0 MiB, 1.0 MiB free there"),  # a byte short: the estimate itself did not fit
    ],
    ids=["exactly enough", "a byte short"],
)
def test_a_full_disk_with_exactly_the_weights_free_says_more_was_needed(free, says, tmp_path, monkeypatch):
    """A write failed for lack of space although as many bytes as the weights need were free: the rest of OUTPUT
    (tokenizer, reports) is what did not fit, and the message says so rather than "needs about" what was free."""
    from thinker_common import staging

    monkeypatch.setattr(staging, "free_bytes", lambda folder: free)
    message = str(staging.disk_full(tmp_path, 2**20))
    assert message.startswith(f"the disk is full at {tmp_path}: writing OUTPUT {says}"), message


def test_a_staging_folder_that_cannot_be_made_leaves_no_parent_folders(qwen3_source, tmp_path, monkeypatch):
    """OUTPUT's missing parents are made for the run; when the staging folder then cannot be made in them (here: its
    path runs through a file), those parents are taken away again, not left behind empty."""
    from thinker_common import staging

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(staging, "staging_path", lambda output: tmp_path / "a-file" / ".staging")
    result = thinker("convert", qwen3_source, tmp_path / "new" / "nested" / "out", "--no-verify")
    assert_error(result, f"{tmp_path}: cannot create new/nested/out in it (Not a directory)")
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
    # OUTPUT's parent there already: the message names OUTPUT itself in it
    result = thinker("convert", qwen3_source, tmp_path / "out", "--no-verify")
    assert_error(result, f"{tmp_path}: cannot create out in it (Not a directory)")


def test_a_name_too_long_below_a_new_folder_leaves_no_folder(qwen3_source, tmp_path):
    """OUTPUT's parents are made for the run; when one of them cannot be (a name over the file system's 255 bytes,
    below a folder the run had already made), those it made are taken away again, not left behind empty."""
    output = tmp_path / "new" / ("x" * 256) / "out"
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert_error(result, "File name too long")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_folder_reached_through_dotdot_is_not_taken_for_one_the_run_made(qwen3_source, tmp_path):
    """OUTPUT new/../old/LONG/out, where old/ exists (empty) and new/ does not: the refusal removes new/, which the
    run made, and leaves old/, which it only passed through (a review found old/ removed and new/ left)."""
    (tmp_path / "old").mkdir()
    output = tmp_path / "new" / ".." / "old" / ("x" * 256) / "out"
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert_error(result, "File name too long")
    assert sorted(os.listdir(tmp_path)) == ["old"]


def test_a_parent_removed_by_another_runs_refusal_is_made_again(qwen3_source, tmp_path, monkeypatch):
    """Two runs into one new folder, the other refused: its clean-up removes the empty folder this run had found
    made, just before this run's staging folder goes in. The folder is made again and the conversion completes."""
    from thinker_common import staging

    output = tmp_path / "new" / "out"
    looks = []

    def taken_away(out):
        looks.append(out)
        if len(looks) == 1:
            out.parent.rmdir()  # as the other run's _remove_empty would
        return remove_stale_staging(out)

    remove_stale_staging = staging.remove_stale_staging
    monkeypatch.setattr(staging, "remove_stale_staging", taken_away)
    result = thinker("convert", qwen3_source, output, "--no-verify")
    assert result.exit_code == 0, result.output
    assert len(looks) == 2 and (output / "model.safetensors").is_file() and os.listdir(tmp_path) == ["new"]


def test_a_file_system_without_renameat2_still_installs_and_replaces(qwen3_source, tmp_path, monkeypatch):
    """renameat2 present in the C library but refused by the file system (EINVAL, as on some network and FUSE file
    systems): the plain renames take over, for a new OUTPUT and for --force, leaving only OUTPUT."""
    import ctypes
    import errno

    from thinker_common import staging

    calls = []

    class Libc:
        @staticmethod
        def renameat2(*args):
            calls.append(args[-1])
            ctypes.set_errno(errno.EINVAL)
            return -1

    monkeypatch.setattr(staging, "_libc", lambda: Libc)
    output = tmp_path / "out"
    for force in ([], ["--force"]):
        result = thinker("convert", qwen3_source, output, "--no-verify", *force)
        assert result.exit_code == 0, result.output
        assert (output / "model.safetensors").is_file() and sorted(os.listdir(tmp_path)) == ["out"]
    assert calls == [staging._RENAME_NOREPLACE, staging._RENAME_EXCHANGE]


# --- side files --------------------------------------------------------------------------------------------------


def test_a_tiktoken_vocabulary_linking_outside_is_refused(source_copy, tmp_path):
    """A ``*.tiktoken`` vocabulary is picked by pattern, not by name: it too is checked, so a symlink leading out of
    the source folder (to a key, a password file) is refused by name, never copied into OUTPUT."""
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY----- not to be published\n")
    source = source_copy()
    (source / "cl100k_base.tiktoken").symlink_to(secret)
    output = tmp_path / "out"
    result = thinker("convert", source, output, "--no-verify")
    assert_error(result, str(source / "cl100k_base.tiktoken"), "outside", str(source))
    assert not output.exists() and not [p for p in tmp_path.rglob("cl100k_base.tiktoken") if not p.is_symlink()]


def test_a_dangling_generation_config_is_named_not_skipped(qwen3_thinker, tmp_path):
    """generation_config.json a symlink to nothing (a cache cleaned under it): named as a broken link, not taken
    for an absent file, which would export without the model's sampling settings and say nothing."""
    folder = shutil.copytree(qwen3_thinker, tmp_path / "thinker")
    (folder / "generation_config.json").unlink(missing_ok=True)
    (folder / "generation_config.json").symlink_to(tmp_path / "gone.json")
    output = tmp_path / "onnx"
    assert_error(thinker("export", folder, output, "--no-verify"), str(folder / "generation_config.json"), "broken")
    assert not output.exists()


# --- sizes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [
        ("1KB", 10**3), ("1MB", 10**6), ("1GB", 10**9), ("1TB", 10**12),  # decimal, as transformers reads them
        ("1KiB", 2**10), ("1MiB", 2**20), ("1GiB", 2**30), ("1TiB", 2**40),  # binary
        ("1K", 2**10), ("1M", 2**20), ("1G", 2**30), ("1T", 2**40),  # docker's, ulimit's and free's letters: binary
        ("7B", 7), (" 2 tb ", 2 * 10**12),
    ],
)  # fmt: skip
def test_every_size_unit(text, size):
    from thinker_common.sizes import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5GB extra", "5GB,", "5GB 2", "5 G B"])
def test_a_size_with_anything_after_its_unit_is_refused(text):
    """``--max-shard-size '5GB extra'`` is not 5GB: a value with more after it is refused whole, not read in part."""
    from thinker_common.errors import ThinkerError
    from thinker_common.sizes import parse_size

    with pytest.raises(ThinkerError, match=f"size '{text}' is not a size like 5GB, 500MB, 2GiB or a byte count"):
        parse_size(text)


# --- the value check ---------------------------------------------------------------------------------------------


def test_integer_tensors_are_not_judged_by_the_float16_range():
    """Integer tensors (packed quantized weights, ids) are written as they are, never cast to float16 (export's
    ``weights.py`` keeps them): values past 65504 are no overflow, and they must not be refused as one."""
    import torch

    from thinker_common.values import ValueScan, value_problem

    packed = torch.tensor([0, 70_000, -(2**31)], dtype=torch.int32)
    assert value_problem(packed, torch.float16) is None
    scan = ValueScan()
    scan.update(packed)
    scan.update(torch.tensor([1.5, -2.0]))
    assert (scan.low, scan.high, scan.problem(torch.float16)) == (-2.0, 1.5, None)


def interrupted_once(monkeypatch, signal_exception: BaseException) -> list[str]:
    """shutil.rmtree as the staging module calls it, stopped by ``signal_exception`` the first time part way (one
    file removed), as a signal's exception stops it; the calls' paths are returned as they come."""
    import thinker_common.staging as staging

    real, calls = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        calls.append(str(path))
        if len(calls) == 1:
            next(p for p in Path(path).iterdir() if p.is_file()).unlink()
            raise signal_exception
        return real(path, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", rmtree)
    return calls


def staged(work: Path) -> None:
    for name in ("a", "b"):
        (work / name).write_text(name)


@pytest.mark.parametrize("signalled", ["SIGINT", "SIGTERM"])
def test_a_signal_while_a_finished_runs_staging_folder_goes_leaves_nothing_and_then_stops_the_caller(
    signalled, tmp_path, monkeypatch
):
    """Ctrl-C or SIGTERM just after OUTPUT is in place, while the staging folder is removed: the removal goes to the
    end, OUTPUT stays, and then the signal goes on to the caller (the signal stopped rmtree part way and left the
    staging folder beside OUTPUT, a float32 copy of the model for an export with the activation-aware scales,
    helper-242; then the fix dropped it, and `thinker demo` went on to its next step)."""
    import signal

    from thinker_common.cli import Terminated
    from thinker_common.staging import work_folder

    exception = KeyboardInterrupt() if signalled == "SIGINT" else Terminated(signal.SIGTERM)
    calls = interrupted_once(monkeypatch, exception)
    output = tmp_path / "out"
    with pytest.raises(type(exception)) as raised, work_folder(output) as work:
        staged(work)
        (work / "result").mkdir()
        os.rename(work / "result", output)  # the run's install
    assert raised.value is exception
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and len(calls) == 2, calls


@pytest.mark.parametrize("signalled", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["before OUTPUT is in place", "after OUTPUT is in place"])
def test_an_interrupted_command_says_which_outputs_are_complete(signalled, when, tmp_path, monkeypatch):
    """A command stopped by a signal exits with the shell's status for it, and names what it had put in place in
    full: with --force, a Ctrl-C while the replaced folder was removed said "Aborted!" alone of an OUTPUT that was
    the new, complete folder (helper-248). Stopped before the install, the words are the signal's alone."""
    import signal

    import click
    from click.testing import CliRunner

    from thinker_common.cli import Terminated, reports_errors
    from thinker_common.staging import staged_output

    exception = KeyboardInterrupt() if signalled == "SIGINT" else Terminated(signal.SIGTERM)
    output = tmp_path / "out"
    output.mkdir()  # an earlier output, which --force replaces
    (output / "old").write_text("old")
    monkeypatch.setattr("thinker_common.staging.refuse_replacing_another_folder", lambda path: None)
    if when == "after OUTPUT is in place":
        interrupted_once(monkeypatch, exception)  # while the replaced folder, now at the staging name, goes

    @click.command()
    @reports_errors
    def write() -> None:
        with staged_output(output, force=True) as work:
            staged(work)
            if when == "before OUTPUT is in place":
                raise exception

    result = CliRunner().invoke(write, [])
    words = "Aborted!" if signalled == "SIGINT" else "Terminated."
    complete = f" ({output}: written in full before the interrupt)" if when.startswith("after") else ""
    assert result.exit_code == 128 + getattr(signal, signalled), result.output
    assert result.stderr.strip() == words + complete
    assert sorted(p.name for p in output.iterdir()) == (["a", "b"] if complete else ["old"])
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_output_installed_inside_a_staging_folder_is_not_named_complete(tmp_path):
    """An export converts its source on the way into a folder inside its own staging folder, installed there as
    any conversion's OUTPUT is; interrupted after that, the export has put nothing in place, and says so."""
    import click
    from click.testing import CliRunner

    from thinker_common.cli import reports_errors
    from thinker_common.staging import staged_output

    output = tmp_path / "onnx"

    @click.command()
    @reports_errors
    def export() -> None:
        with staged_output(output, force=False) as work:
            with staged_output(work / "thinker", force=False) as converted:
                staged(converted)
            assert (work / "thinker" / "a").is_file()  # the conversion on the way is in place, in the staging folder
            raise KeyboardInterrupt

    result = CliRunner().invoke(export, [])
    assert result.exit_code == 130 and result.stderr.strip() == "Aborted!", result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_signal_while_a_failed_runs_staging_folder_goes_leaves_nothing_and_the_error_stands(tmp_path, monkeypatch):
    """The same signal while a failing run's staging folder is removed: nothing is left, not even the parent folder
    the run made, and the run's own error is what comes out."""
    from thinker_common.errors import ThinkerError
    from thinker_common.staging import work_folder

    calls = interrupted_once(monkeypatch, KeyboardInterrupt())
    with pytest.raises(ThinkerError, match="the run's own error"), work_folder(tmp_path / "new" / "out") as work:
        staged(work)
        raise ThinkerError("the run's own error")
    assert list(tmp_path.iterdir()) == [] and len(calls) == 2, calls


class ShortWrites:
    """A raw file on a disk with ``room`` bytes left that writes at most ``most`` bytes a call, as a raw file may:
    the write that finds no room left raises ENOSPC, the one before it writes what fits and says so by its count."""

    def __init__(self, room: int, most: int) -> None:
        self.room, self.most, self.data = room, most, bytearray()

    def write(self, data) -> int:
        count = min(len(data), self.most, self.room - len(self.data))
        if count == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += bytes(data[:count])
        return count


def test_write_fully_writes_everything_and_a_full_disk_keeps_its_errno():
    """Short writes are carried on to the end, in order; a full disk's error comes out with ENOSPC, which the
    disk-full line is chosen by (numpy's tofile said only "... requested and ... written": helper-242)."""
    import numpy as np

    from thinker_common.staging import WritesFully, write_fully

    values = np.arange(100, dtype=np.float32)
    file = ShortWrites(room=10**6, most=7)
    write_fully(file, values)
    assert bytes(file.data) == values.tobytes()
    file = ShortWrites(room=100, most=7)
    with pytest.raises(OSError) as raised:
        write_fully(file, values)
    assert raised.value.errno == errno.ENOSPC and bytes(file.data) == values.tobytes()[:100]
    file = ShortWrites(room=10**6, most=7)
    np.save(WritesFully(file), values, allow_pickle=False)
    assert np.array_equal(np.load(io.BytesIO(bytes(file.data))), values)
