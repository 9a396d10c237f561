"""Sizes as people write them: ``5GB``, ``500MB``, ``2GiB`` or a byte count."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import ThinkerError

# Where a converted folder is split into shards: transformers 4's default for save_pretrained, and the shard size
# most Hub checkpoints have (transformers 5 writes up to 50GB per file).
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Decimal units as transformers reads them ("5GB" = 5e9 bytes); binary ones ("5GiB") too, and the bare letters of
# docker, ulimit and free ("8G", "8g"), which mean binary units there.
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_UNITS |= {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"8G"`` (binary) or a plain byte count -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ThinkerError(f"size {text!r} is not a size: a byte count is a whole number above 0")
        return text
    if not isinstance(text, str):
        raise ThinkerError(f"size {text!r} is not a size like 5GB, 500MB, 2GiB or a byte count")
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ThinkerError(f"size {text!r} is not a size like 5GB, 500MB, 2GiB or a byte count")
    number = Fraction(match.group(1))  # exact: a float would lose a long byte count, or overflow to infinity
    if number <= 0:
        raise ThinkerError(f"size {text!r}: a size must be above 0")
    size = int(number * _SIZE_UNITS[unit])
    if size < 1:  # "0.5" or "0.1B": above 0, yet no whole byte, which a shard or budget of 0 bytes would take
        raise ThinkerError(f"size {text!r} is less than one byte; give a size of at least 1 byte (5GB, 500MB, 1024)")
    return size


def human_size(size: float, round_up: bool = False) -> str:
    """Bytes as a person reads them, in binary units with one decimal (``1.5 GiB``, ``10.0 KiB``): the unit follows
    the size, so a small budget does not print as ``0.0 GiB``. ``round_up``: a need a user may copy into a setting,
    never below the bytes it stands for."""
    units, power = ("B", "KiB", "MiB", "GiB"), 0
    while abs(size) >= 1024 and power < len(units) - 1:
        size, power = size / 1024, power + 1
    digits = 0 if power == 0 else 1
    if round_up:
        size = math.ceil(size * 10**digits) / 10**digits
    return f"{size:.0f} B" if power == 0 else f"{size:.1f} {units[power]}"
