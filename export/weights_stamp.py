"""Pairing a graph with its weights file: the stamp the export writes in the graph, and the check before a load.

A graph reads its weights by byte ranges, so beside another export's ``model.onnx.data`` it runs, over the wrong
bytes, and prints nonsense with exit status 0. The export stamps the weights file's size and a fingerprint of its
contents in the graph's metadata; the runtime refuses a file that disagrees, naming it.

The fingerprint hashes ``SAMPLE_PAGES`` pages spread evenly over the file instead of the whole file, so that a load
checks it in a few milliseconds whatever the model's size (hashing gigabytes on every load would cost seconds). Two
exports of different weights differ on nearly every page, so any sample tells them apart; a file damaged in a few
bytes between the sampled pages is not what it guards against.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

from thinker_common.errors import ThinkerError

from .names import WEIGHTS_FINGERPRINT_KEY, WEIGHTS_SIZE_KEY

PAGE = 4096
SAMPLE_PAGES = 64


def weights_fingerprint(path: Path) -> str:
    """A SHA-256 over the file's size and ``SAMPLE_PAGES`` pages at evenly spaced offsets (the whole file, where it
    is no larger than the sample)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as data:
        if size <= PAGE * SAMPLE_PAGES:
            digest.update(data.read())
        else:
            last = size - PAGE
            for index in range(SAMPLE_PAGES):
                data.seek(last * index // (SAMPLE_PAGES - 1))
                digest.update(data.read(PAGE))
    return digest.hexdigest()


def stamp_weights(model: onnx.ModelProto, data_path: Path) -> None:
    """Record the size and fingerprint of the weights file ``data_path`` in ``model``'s metadata. Whoever rewrites
    the weights file stamps again."""
    stamps = {WEIGHTS_SIZE_KEY: str(data_path.stat().st_size), WEIGHTS_FINGERPRINT_KEY: weights_fingerprint(data_path)}
    for prop in model.metadata_props:
        if prop.key in stamps:
            prop.value = stamps.pop(prop.key)
    for key, value in stamps.items():
        model.metadata_props.add(key=key, value=value)


def check_weights_stamp(model: onnx.ModelProto, model_path: Path, data_path: Path) -> None:
    """Refuse a weights file whose size or fingerprint differs from the stamp ``model`` carries (a graph written
    before the stamps were has none, and loads as before)."""
    stamps = {prop.key: prop.value for prop in model.metadata_props}
    size, stamped_size = data_path.stat().st_size, stamps.get(WEIGHTS_SIZE_KEY, "")
    if stamped_size.isdigit() and size != int(stamped_size):
        raise ThinkerError(
            f"{data_path}: {size} bytes, but {model_path.name} was exported with a weights file of "
            f"{stamped_size} bytes; the file is truncated or from another export: copy the whole folder again, or "
            "export it again"
        )
    stamped_fingerprint = stamps.get(WEIGHTS_FINGERPRINT_KEY)
    if stamped_fingerprint is not None and weights_fingerprint(data_path) != stamped_fingerprint:
        raise ThinkerError(
            f"{data_path}: not the weights {model_path.name} was exported with (their size agrees, their contents "
            "do not: another export's, or changed since); copy the whole folder again, or export it again"
        )
