"""The one exception type that the command line turns into a one-line error and a non-zero exit.

Raise ``ThinkerError`` for anything the user can fix (a wrong path, a tensor that does not fit the config, a
missing file). The message must name the file, tensor or key that is wrong and say what to do. Any other
exception is a bug and keeps its traceback.
"""


class ThinkerError(Exception):
    """A user-facing error: its message is printed as one line, without a traceback."""
