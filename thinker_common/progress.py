"""Progress bars, one rule for every command: tqdm on stderr for each step that can take more than a few seconds
(reading and writing weights, quantizing, verifying), shown only where someone watches (stderr a terminal; a log
file or a pipe gets none, so no ``\\r``-redrawn lines end up in it), each bar ending its own line."""

from __future__ import annotations

from tqdm.auto import tqdm


def progress_bar(total: float, desc: str, unit: str = "B", enabled: bool = True) -> tqdm:
    """A bar over ``total`` (bytes when ``unit`` is "B"); ``enabled=False`` hides it even on a terminal."""
    in_bytes = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=in_bytes,
        unit_divisor=1024 if in_bytes else 1000,
        disable=None if enabled else True,  # None: tqdm's own "only when the stream is a terminal"
        leave=True,
    )
