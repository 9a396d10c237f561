"""What marks a folder as one a thinker command wrote: the checks section of its model card.

Every output (a Thinker folder, an ONNX export, the way back's folder) gets a ``README.md`` whose measured checks sit
between two markers (``model_card.write_card``), so that a later ``thinker verify`` can replace them. The same markers
tell ``--force`` that a folder is an earlier output it may replace (``staging.refuse_replacing_another_folder``):
a source checkpoint, a fine-tuned model saved by transformers or another tool's export has no such card.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CARD_FILE = "README.md"
CHECK_START, CHECK_END = "<!-- thinker: checks -->", "<!-- /thinker: checks -->"
# A card is a few KiB; a README.md larger than this is someone's document, and is not read through to find out.
_LARGEST_CARD = 1 << 20


def written_by_thinker(folder: Path) -> bool:
    """Whether ``folder`` holds a model card of this tool's: a plain ``README.md`` (no link) with the checks marker."""
    try:
        # O_NOFOLLOW: a linked README.md is not a card this tool wrote; O_NONBLOCK: a FIFO there must not hang the look
        descriptor = os.open(Path(folder) / CARD_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(descriptor, "rb") as card:
        if not stat.S_ISREG(os.fstat(card.fileno()).st_mode):
            return False
        try:
            return CHECK_START.encode() in card.read(_LARGEST_CARD)
        except OSError:
            return False
