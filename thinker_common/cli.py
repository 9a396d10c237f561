"""The ``thinker`` command, and how every command of it and of ``thinker-convert`` ends on a user's mistake.

``reports_errors`` gives a click command a ``--debug`` flag and turns a ``ThinkerError`` into one red line on stderr
and exit status 1 (click's own usage errors exit with 2). Any other exception is a bug and keeps its traceback.

``main`` is the ``thinker`` group. Its commands live with the code they drive (``converter/cli.py``: convert and
verify; ``export/cli.py``: export, generate and demo) and are named here by where they live rather than imported:
this package sits below ``converter`` and ``export``, and a command module is imported only when the command runs
or its help is shown (click's lazily loading group). The command modules themselves import torch, transformers and
onnxruntime inside the commands, so ``thinker --help`` and argument errors answer at once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import select
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pkgutil import resolve_name

import click

from . import staging
from .errors import ThinkerError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}

debug_option = click.option("--debug", is_flag=True, help="Show full tracebacks and debug logging on errors.")


# The dependencies a user may have removed or replaced beside the tool (onnxruntime-genai's CPU onnxruntime swaps out
# onnxruntime-gpu), by the module name an import fails on, and what puts them back.
MISSING_PACKAGE_ADVICE = {
    "onnxruntime": "pip install onnxruntime-gpu (its CPU execution provider runs anywhere; onnxruntime works too, "
    "without CUDA)",
    "onnx": "pip install onnx",
    "gguf": "pip install gguf",
}


def reports_errors(command: Callable) -> Callable:
    """Decorate a click command's function (below its options): adds ``--debug``, reports ``ThinkerError``."""

    @functools.wraps(command)
    def run(*args, debug: bool = False, **kwargs):
        logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s: %(message)s")
        outputs_before = len(staging.INSTALLED)
        try:
            refuse_bad_hub_settings()  # before huggingface_hub is imported, which parses them with int()
            if not debug:
                quiet_libraries()
            with held_warnings(hold=not debug), sigterm_unwinds():
                return command(*args, **kwargs)
        except KeyboardInterrupt:
            # click's words, with the shell's status for a SIGINT (click exits 1)
            click.echo("Aborted!" + _complete_outputs(outputs_before), err=True)
            sys.exit(128 + signal.SIGINT)
        except Terminated as signalled:
            click.echo(signalled.words + _complete_outputs(outputs_before), err=True)
            sys.exit(128 + signalled.signum)
        except OSError as err:  # what no check foresaw (a name too long, a file too large for the file system ...)
            if debug:
                raise
            if isinstance(err, BrokenPipeError) and stdout_gone():
                # stdout's reader went away (`thinker generate ... | head`): stop quietly with the status a shell
                # gives a process SIGPIPE ends, as shell tools do. What was written stays written: a conversion's
                # OUTPUT is in place before its summary is printed.
                sys.exit(128 + signal.SIGPIPE)
            context = click.get_current_context(silent=True)
            sharded = context is not None and any(param.name == "max_shard_size" for param in context.command.params)
            click.secho(f"error: {os_error_line(err, sharded)}", fg="red", err=True)
            sys.exit(1)
        except ModuleNotFoundError as err:  # a dependency uninstalled beside the tool (pip uninstall onnxruntime-gpu)
            if debug or err.name not in MISSING_PACKAGE_ADVICE:
                raise
            click.secho(f"error: {err.name} is not installed; {MISSING_PACKAGE_ADVICE[err.name]}", fg="red", err=True)
            sys.exit(1)
        except ThinkerError as err:
            report = getattr(err, "report", None)  # a failed parity check carries its table: show what differed
            if report is not None:
                try:
                    click.echo(report.table())
                except BrokenPipeError:  # stdout gone (| head): the error line still goes out, on stderr
                    stdout_gone()
                if getattr(report, "mode_note", ""):  # why layer by layer, as a passing check says it
                    click.secho(report.mode_note, fg="yellow", err=True)
            if debug:
                raise
            message = " ".join(str(err).split())  # one line, even when it quotes a multi-line library message
            click.secho(f"error: {message}", fg="red", err=True)
            sys.exit(1)

    return debug_option(run)


def _complete_outputs(before: int) -> str:
    """What an interrupted command had already put in place, in full (``staging.INSTALLED`` past ``before``): a
    signal just after OUTPUT was renamed into place (while the folder it replaced was removed, or the summary
    printed) said "Aborted!" alone, and the user took a complete OUTPUT for a partial one (helper-248)."""
    # not a folder installed inside another run's staging folder (an export's conversion on the way), gone with it
    done = [path for path in staging.INSTALLED[before:] if staging.outside_staging(path) == path]
    if not done:
        return ""
    return f" ({', '.join(map(str, done))}: written in full before the interrupt)"


def stdout_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone, then pointed at /dev/null so that the exit's own
    flush does not fail again: told apart from a broken pipe of anything else, which is an error to report."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
        if gone:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return gone
    except (OSError, ValueError, AttributeError):  # no fileno (a test's captured stream), no poll (Windows)
        return False


# huggingface_hub's settings it reads as whole numbers when it is imported: a bad value raised a ValueError there,
# with a traceback, in every command (a local source's too).
HUB_WHOLE_NUMBER_SETTINGS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")


def refuse_bad_hub_settings() -> None:
    """Each of HUB_WHOLE_NUMBER_SETTINGS, where set, a whole number; else refused by name."""
    for name in HUB_WHOLE_NUMBER_SETTINGS:
        value = os.environ.get(name)
        if value is not None:  # set but empty fails int() too
            try:
                int(value)
            except ValueError:
                raise ThinkerError(
                    f"{name}={value!r} is not a whole number of seconds, which huggingface_hub reads it as; "
                    "correct or unset it"
                ) from None


# What an OSError that reaches the command's end means for the user, by errno: the last resort after the checks
# that name their own file and remedy.
_OS_ERROR_ADVICE = {
    errno.ENAMETOOLONG: "a name is longer than the file system takes (255 bytes a name): choose a shorter path",
    errno.EFBIG: "a file is larger than the file system (FAT32: 4 GiB) or the process's file-size limit takes: "
    "write to another file system",
    errno.ELOOP: "a symlink there leads back to itself: fix or remove it",
    errno.EACCES: "permission denied: make it readable (and its folder writable)",
    errno.EPERM: "not permitted (an immutable or read-only file?): choose another path",
    errno.EROFS: "the file system is read-only: choose another path",
    errno.EBUSY: "in use or a mount point: choose another path",
    errno.ENOENT: "it vanished during the run (deleted by another process?): run again",
}


def os_error_line(err: OSError, sharded: bool = False) -> str:
    """One line for an OSError: the file it names, what happened, and what to do. ``sharded``: the command takes
    --max-shard-size (a conversion), whose shards are then advised smaller; an export's files are not its shards
    (``model.onnx.data``, or the activation-aware scales' staged copy in shards of its own)."""
    where = f"{err.filename}: " if err.filename else ""
    advice = _OS_ERROR_ADVICE.get(err.errno)
    if err.errno == errno.EFBIG and sharded and str(err.filename or "").endswith(".safetensors"):
        advice += ", or with a smaller --max-shard-size"
    if err.errno == errno.ENAMETOOLONG and err.filename and not _a_name_too_long(err.filename):
        # every name fits: the whole path is what is too long (Linux's PATH_MAX, 4096 bytes)
        advice = "the whole path is longer than the system takes (4096 bytes): choose a shorter path"
    return f"{where}{err.strerror or err}" + (f"; {advice}" if advice else "")


def _a_name_too_long(path) -> bool:
    return any(len(part) > 255 for part in os.fsencode(path).split(b"/"))


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the command was: a BaseException, as KeyboardInterrupt is, so no ``except
    Exception`` swallows it on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.words = "Hung up." if signum == signal.SIGHUP else "Terminated."


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (kill, timeout, docker stop, systemd) and SIGHUP end a command as Ctrl-C does, by unwinding: the
    staging folders' cleanup runs. Python's default for them is to die on the spot, leaving a partial OUTPUT's staging
    folder behind. Only the main thread can take signals; elsewhere (a library caller's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGHUP too: a closed terminal or a dropped ssh session, which otherwise leaves the staging folder behind
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def held_warnings(hold: bool = True) -> Iterator[None]:
    """Python warnings raised while a command runs (torch's, numpy's, transformers' ...) are held back and shown
    when it ends well: a run that ends in a user's mistake prints its one line, not library warnings about the bad
    input before it. ``hold=False`` (``--debug``) prints them as they come."""
    if not hold:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is shown, as before
        yield
    for warning in caught:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def quiet_libraries() -> None:
    # transformers' loading notices and per-load progress bars would drown our own progress, tables and summaries;
    # huggingface_hub's download retries ("Trying to resume download...", each printed twice: by its own handler and,
    # propagated, by the root logger's) would bury the one line that says what failed and what to do.
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
    # torch's word on an empty Linear, with its site-packages path: a Qwen2-MoE class builds its shared expert 0 wide
    # when the config says so, which is the model, not a problem
    warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op", category=UserWarning)


# The commands of `thinker`, in the order of a session, and the click command object each one is.
COMMANDS = {
    "convert": "converter.cli:convert_command",
    "verify": "converter.cli:verify_command",
    "export": "export.cli:export_command",
    "generate": "export.cli:generate_command",
    "demo": "export.cli:demo_command",
}


class LazyGroup(click.Group):
    """A group whose commands are imported from ``module:attribute`` names when first asked for."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*self.lazy_commands, *(name for name in super().list_commands(ctx) if name not in self.lazy_commands)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            return resolve_name(self.lazy_commands[name])
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings=CONTEXT)
@click.version_option(package_name="thinker", message="%(prog)s %(version)s")
def main() -> None:
    """Thinker: Qwen-style checkpoints to a transformers model, and on to ONNX.

    \b
    A typical session:
      thinker convert Qwen/Qwen3-0.6B ./qwen3            # Hub repo or folder -> Thinker folder
      thinker export ./qwen3 ./qwen3-onnx --dtype float16 # Thinker folder -> ONNX folder (+ parity check)
      thinker generate ./qwen3-onnx --prompt "Hello"      # greedy text with onnxruntime

    Run `thinker COMMAND --help` for each command's options.
    """


def console_script(command: click.Command) -> Callable[[], None]:
    """``command`` as a console script: click's standalone run, after which, the run over and its status decided,
    Ctrl-C, SIGTERM and SIGHUP are ignored. A Ctrl-C arriving while the interpreter shuts down printed a traceback
    from torch's atexit hook, or gave a conversion already in place SIGINT's status; a SIGTERM there killed a
    conversion already in place with -15 and nothing said (QA runs)."""

    def run() -> None:
        try:
            command.main()
        finally:
            if threading.current_thread() is threading.main_thread():
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_IGN)

    return run


thinker = console_script(main)  # the `thinker` console script (pyproject.toml)

__all__ = ["CONTEXT", "console_script", "main", "quiet_libraries", "reports_errors", "thinker"]


if __name__ == "__main__":  # python -m thinker_common.cli COMMAND ... (the benchmarks run it so)
    thinker()
