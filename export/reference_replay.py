"""The reference's runs of ``--verify``'s passes, kept from the first comparison that makes them for the next ones.

The check runs the same passes on ``model.onnx`` and again on ``model.genai.onnx`` (and the padded-around pass on
the parity batch's own prompts): the PyTorch model then runs the same inputs, step for step, and gives the same
logits, since the tokens each step feeds are the reference's own greedy choices. Where the reference takes nothing
from the graph, the later comparison reads those logits back (``ReferenceReplay.run``) rather than running the
model again: on the Qwen3-0.6B-shaped model the reference's runs were about a third of the float32 check's time,
and a model streamed from its folder reads every layer again for each of them.

The reference takes something from the graph where it follows the graph's routing (export/routing.py
``RouteFollower``: a half-precision MoE graph's near-ties): its runs then depend on the graph and are made afresh.

A run is found by a digest of everything that decides it: its inputs (token ids or embeddings, mask, positions), the
run it continues (a decode step's cache holds the runs before it), and whether a half-precision spread comes with
its logits. A comparison that finds nothing runs the model, so a replay can only ever return what the same run
gave. The logits wait in an unnamed temporary file in the export's folder (as the accuracy guard's reference does:
export/accuracy_guard.py ``SetAside``), so a long prompt's logits over a large vocabulary (171 MB for Qwen3's two
rows of 141 tokens) do not add to the check's peak while the passes between run.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from thinker_common.staging import DISK_FULL, WritesFully

Run = tuple[np.ndarray, np.ndarray | None]  # the reference's logits, and their half-precision spread (or None)


def run_key(after: str, *parts) -> str:
    """The digest of a run: the run it follows (``after``: "" for one from an empty cache) and its inputs: arrays and
    tensors by their dtype, shape and bytes, tuples, lists and dicts item by item, anything else by ``repr``."""
    digest = hashlib.sha256(after.encode())
    for part in parts:
        _update(digest, part)
    return digest.hexdigest()


def _update(digest, part) -> None:
    if isinstance(part, torch.Tensor):
        part = part.detach().cpu().numpy()
    if isinstance(part, np.ndarray):
        part = np.ascontiguousarray(part)
        digest.update(f"array {part.dtype}{part.shape}".encode())
        digest.update(part.tobytes())
    elif isinstance(part, dict):
        _update(digest, list(part.items()))
    elif isinstance(part, (tuple, list)):
        digest.update(f"{type(part).__name__} {len(part)}".encode())
        for item in part:
            _update(digest, item)
    else:
        digest.update(repr(part).encode())
    digest.update(b"|")


class ReferenceReplay:
    """The runs recorded so far, by ``run_key``; ``folder``: where their file goes (the export's), None to record
    nothing (a comparison made on its own: every run made)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.file = None
        self.offsets: dict[str, tuple[int, bool]] = {}  # key -> (offset in the file, whether a spread follows)
        self.replayed = 0  # runs read back instead of made

    def run(self, key: str, follows_graph: bool, make: Callable[[], Run]) -> Run:
        """The run of ``key``: read back where it was recorded and the reference takes nothing from the graph
        (``follows_graph`` False), else made by ``make()`` (and recorded, where it does not follow the graph)."""
        if follows_graph or self.folder is None:
            return make()
        if key in self.offsets:
            self.replayed += 1
            return self._read(key)
        logits, spread = make()
        try:
            self._write(key, logits, spread)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            # The replay saves the check time and nothing else: a disk too full for it (its file is not in the
            # export's free-space estimate) costs the later comparisons their own runs, not the export. Every run
            # is forgotten, not just this one, so that no comparison reads back a prefill whose steps are missing.
            self.close()
            self.folder = None
        return logits, spread

    def holds(self, key: str) -> bool:
        return key in self.offsets

    def _write(self, key: str, logits: np.ndarray, spread: np.ndarray | None) -> None:
        if self.file is None:
            # unbuffered: a full disk fails the write that met it, never a flush later (at close, or a seek to read)
            self.file = tempfile.TemporaryFile(dir=self.folder, buffering=0)
        self.file.seek(0, 2)
        self.offsets[key] = (self.file.tell(), spread is not None)
        # through write (WritesFully): np.save on a real file writes with tofile, whose full-disk error has no errno
        np.save(WritesFully(self.file), np.ascontiguousarray(logits), allow_pickle=False)
        if spread is not None:
            np.save(WritesFully(self.file), np.ascontiguousarray(spread), allow_pickle=False)

    def _read(self, key: str) -> Run:
        offset, with_spread = self.offsets[key]
        self.file.seek(offset)
        logits = np.load(self.file, allow_pickle=False)
        return logits, np.load(self.file, allow_pickle=False) if with_spread else None

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # an unnamed file: nothing of it outlives the close, whatever it says
                self.file.close()
            self.file = None
        self.offsets.clear()


def replay_of(replay: ReferenceReplay | None) -> ReferenceReplay:
    """``replay``, or one that records nothing (a comparison made on its own)."""
    return replay if replay is not None else ReferenceReplay(None)
