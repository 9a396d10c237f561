"""What every command of ``thinker-convert`` and ``thinker`` shares: how a user-facing error ends the program.

``reports_errors`` gives a click command a ``--debug`` flag and turns a ``ThinkerError`` into one red line on stderr
and exit status 1 (click's own usage errors exit with 2). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

import click

from .errors import ThinkerError

debug_option = click.option("--debug", is_flag=True, help="Show full tracebacks and debug logging on errors.")


def reports_errors(command: Callable) -> Callable:
    """Decorate a click command's function (below its options): adds ``--debug``, reports ``ThinkerError``."""

    @functools.wraps(command)
    def run(*args, debug: bool = False, **kwargs):
        logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s: %(message)s")
        if not debug:
            quiet_transformers()
        try:
            return command(*args, **kwargs)
        except ThinkerError as err:
            report = getattr(err, "report", None)  # a failed parity check carries its table: show what differed
            if report is not None:
                click.echo(report.table())
            if debug:
                raise
            message = " ".join(str(err).split())  # one line, even when it quotes a multi-line library message
            click.secho(f"error: {message}", fg="red", err=True)
            sys.exit(1)

    return debug_option(run)


def quiet_transformers() -> None:
    # transformers' loading notices and per-load progress bars would drown our own progress, tables and summaries.
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


__all__ = ["quiet_transformers", "reports_errors"]
