"""What a mutation run of ``converter/cli.py`` and ``thinker_common/cli.py`` found no test for: option defaults and
options passed through to the work, how ``reports_errors`` ends a command (``--debug``, warnings, signal handlers,
one-line messages) and the advice of ``os_error_line``. Each test names the change it catches."""

from __future__ import annotations

import errno
import json
import signal
import warnings

import click
import pytest
import torch
from cli_helpers import edit_config, thinker
from click.testing import CliRunner
from convert_helpers import QWEN2, build_reference
from safetensors import safe_open
from transformers import Qwen3Config

from converter.cli import convert_command
from thinker_common.cli import main, os_error_line, reports_errors
from thinker_common.errors import ThinkerError

QWEN3 = Qwen3Config(**QWEN2, head_dim=8)


def stored_dtypes(folder) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as weights:
        return {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}


# --- thinker-convert's options -------------------------------------------------------------------------------------


def test_the_default_dtype_keeps_the_sources(tmp_path):
    """No --dtype is --dtype auto: a bfloat16 source stays bfloat16 (a default of float32 doubled every such
    output and passed every test, whose sources were float32)."""
    build_reference(QWEN3).to(torch.bfloat16).save_pretrained(tmp_path / "source")
    result = thinker(tmp_path / "source", tmp_path / "out", "--no-verify", command=convert_command)
    assert result.exit_code == 0, result.output
    assert stored_dtypes(tmp_path / "out") == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_convert_takes_the_revision_it_is_given(fake_hub, source_copy, tmp_path):
    """--revision reaches the download: v2 of the repo is converted, not main."""
    fake_hub.add_repo("tiny-org/tiny-qwen3", source_copy("main"))
    longer = source_copy("v2")
    edit_config(longer, max_position_embeddings=128)
    fake_hub.add_repo("tiny-org/tiny-qwen3", longer, revision="v2")
    output = tmp_path / "out"
    result = thinker("convert", "tiny-org/tiny-qwen3", output, "--revision", "v2", "--no-verify")
    assert result.exit_code == 0, result.output
    assert json.loads((output / "config.json").read_text())["max_position_embeddings"] == 128


def test_the_way_back_with_force_replaces_an_earlier_way_back(qwen3_thinker, tmp_path):
    """--force reaches the way back (--to): an earlier output of it is replaced, not refused."""
    output = tmp_path / "back"
    assert thinker(qwen3_thinker, output, "--to", "qwen3", "--no-verify", command=convert_command).exit_code == 0
    assert stored_dtypes(output) == {"F32"}
    again = [qwen3_thinker, output, "--to", "qwen3", "--no-verify", "--dtype", "bfloat16", "--force"]
    result = thinker(*again, command=convert_command)
    assert result.exit_code == 0, result.output
    assert stored_dtypes(output) == {"BF16"}  # the new folder in place of the old


# --- thinker verify's options (refused by click, before any work: exit 2) ------------------------------------------


@pytest.mark.parametrize("report", ["", "   "], ids=["empty", "blank"])
def test_verify_refuses_a_report_path_of_blanks(report, tmp_path):
    """--report of spaces is no file name either (it was taken for a file named "   " in the working directory)."""
    result = thinker("verify", "tiny-org/tiny-qwen3", tmp_path, "--report", report)
    assert result.exit_code == 2 and "'--report': an empty path; name a new JSON file" in result.stderr, result.output


def test_verify_refuses_a_report_path_that_is_a_folder(tmp_path):
    result = thinker("verify", "tiny-org/tiny-qwen3", tmp_path, "--report", tmp_path)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--report': File '{tmp_path}' is a directory." in " ".join(result.stderr.split())


# --- reports_errors: how every command ends ------------------------------------------------------------------------


def command_that(action) -> click.Command:
    """A click command of ``reports_errors`` that runs ``action``."""

    @click.command()
    @reports_errors
    def run() -> None:
        action()

    return run


def raising(error: BaseException):
    def action() -> None:
        raise error

    return action


def test_a_multi_line_error_is_one_line():
    result = CliRunner().invoke(command_that(raising(ThinkerError("the first line\n  and the second\n"))))
    assert result.exit_code == 1 and result.stderr == "error: the first line and the second\n", result.output


def test_an_os_error_is_one_line_and_debug_keeps_its_traceback():
    error = PermissionError(errno.EACCES, "Permission denied", "/data/model.safetensors")
    result = CliRunner().invoke(command_that(raising(error)))
    assert result.exit_code == 1 and result.stderr == (
        "error: /data/model.safetensors: Permission denied; permission denied: make it readable (and its folder "
        "writable)\n"
    )
    debug = CliRunner().invoke(command_that(raising(error)), ["--debug"])
    assert debug.exit_code == 1 and debug.exception is error and "error:" not in debug.stderr


def test_a_missing_package_is_one_line_and_debug_keeps_its_traceback():
    error = ModuleNotFoundError("No module named 'onnx'", name="onnx")
    result = CliRunner().invoke(command_that(raising(error)))
    assert result.exit_code == 1 and result.stderr == "error: onnx is not installed; pip install onnx\n"
    debug = CliRunner().invoke(command_that(raising(error)), ["--debug"])
    assert debug.exit_code == 1 and debug.exception is error and "error:" not in debug.stderr


def test_the_signal_handlers_are_given_back_after_a_command():
    """SIGTERM and SIGHUP unwind a command, and only while it runs: a library caller's (or a test's) own handlers
    are in place again afterwards, whether the command ended well or with an error."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    assert CliRunner().invoke(command_that(lambda: None)).exit_code == 0
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert CliRunner().invoke(command_that(raising(ThinkerError("no")))).exit_code == 1
    assert {signum: signal.getsignal(signum) for signum in before} == before


def warns_then(action):
    def run() -> None:
        warnings.warn("a library's word on the input", UserWarning, stacklevel=1)
        action()

    return run


def test_warnings_are_shown_after_a_command_that_ends_well():
    """Held while the command runs, then shown: not lost."""
    with pytest.warns(UserWarning, match="a library's word on the input"):
        result = CliRunner().invoke(command_that(warns_then(lambda: None)))
    assert result.exit_code == 0, result.output


def test_warnings_are_not_shown_before_a_users_mistake():
    """A run ending in an ``error:`` line prints that line alone; --debug shows the warnings as they come."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        result = CliRunner().invoke(command_that(warns_then(raising(ThinkerError("bad input")))))
    assert result.exit_code == 1 and result.stderr == "error: bad input\n"
    assert [str(warning.message) for warning in shown] == []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        CliRunner().invoke(command_that(warns_then(raising(ThinkerError("bad input")))), ["--debug"])
    assert [str(warning.message) for warning in shown] == ["a library's word on the input"]


# --- os_error_line's advice ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "number, advice",
    [
        (errno.EACCES, "permission denied: make it readable (and its folder writable)"),
        (errno.ENOENT, "it vanished during the run (deleted by another process?): run again"),
        (errno.EROFS, "the file system is read-only: choose another path"),
        (errno.ELOOP, "a symlink there leads back to itself: fix or remove it"),
    ],
    ids=["EACCES", "ENOENT", "EROFS", "ELOOP"],
)
def test_an_os_error_names_the_file_and_what_to_do(number, advice):
    import os

    line = os_error_line(OSError(number, os.strerror(number), "/data/out/model.safetensors"))
    assert line == f"/data/out/model.safetensors: {os.strerror(number)}; {advice}"


def test_a_name_of_255_bytes_fits_so_the_whole_path_is_blamed():
    """255 bytes is the longest name Linux takes: a path of such names past 4096 bytes is too long as a whole."""
    path = "/" + "/".join(["n" * 255] * 17)
    line = os_error_line(OSError(errno.ENAMETOOLONG, "File name too long", path))
    assert line.endswith("; the whole path is longer than the system takes (4096 bytes): choose a shorter path")
    too_long = os_error_line(OSError(errno.ENAMETOOLONG, "File name too long", "/data/" + "n" * 256))
    assert too_long.endswith("; a name is longer than the file system takes (255 bytes a name): choose a shorter path")


# --- the thinker group ---------------------------------------------------------------------------------------------


def test_thinker_help_lists_its_commands_in_a_sessions_order():
    text = CliRunner().invoke(main, ["--help"]).output
    listed = [line.split()[0] for line in text.split("Commands:")[1].splitlines() if line.startswith("  ")]
    assert listed == ["convert", "verify", "export", "generate", "demo"], text


def test_a_passing_verify_says_why_it_ran_layer_by_layer(qwen3_thinker, qwen3_source, tmp_path, monkeypatch):
    """Switched to layer by layer by the memory budget, a passing ``thinker verify`` says so on stderr, as
    thinker-convert's check and a failing verify do."""
    from converter.parity import BY_LAYER, MEMORY_BUDGET_ENV

    monkeypatch.setenv(MEMORY_BUDGET_ENV, "1KB")
    result = thinker("verify", qwen3_source, qwen3_thinker, "--report", tmp_path / "report.json")
    assert result.exit_code == 0, result.output
    assert "verifying layer by layer" in result.stderr and MEMORY_BUDGET_ENV in result.stderr, result.stderr
    assert json.loads((tmp_path / "report.json").read_text())["mode"] == BY_LAYER
