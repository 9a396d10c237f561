"""A Thinker folder's weights, read one tensor at a time and cast to the export dtype.

The exporter asks for tensors by their Thinker parameter name in the order it emits the graph; nothing else is
held, so peak memory stays near the largest tensor. ``unused()`` names what was never asked for (but the parts
the graph leaves out on purpose, ``not_exported``), so that a feature the graph forgot is an error rather than a
silently different model.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from thinker_common.errors import ThinkerError
from thinker_common.sources import SafetensorsSource, safetensors_files
from thinker_common.values import value_problem


class ThinkerWeights:
    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype,
        tie_word_embeddings: bool,
        not_exported: tuple[str, ...] = (),
        progress: tqdm | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        if not safetensors_files(self.folder):
            raise ThinkerError(
                f"{self.folder}: no *.safetensors weights; is this a Thinker folder written by thinker-convert?"
            )
        self._source = SafetensorsSource(self.folder)
        self._names = set(self._source.names())
        self._used: set[str] = set()
        self._tied = tie_word_embeddings
        self._not_exported = not_exported  # name prefixes of the parts the graph leaves out on purpose
        self.progress = progress  # advanced by each tensor's bytes the first time the graph reads it

    def __contains__(self, name: str) -> bool:
        return self._resolve(name) in self._names

    def _resolve(self, name: str) -> str:
        # transformers drops a tied head from the checkpoint; it is the embedding matrix.
        if name == "lm_head.weight" and self._tied and name not in self._names:
            return "model.embed_tokens.weight"
        return name

    def get(self, name: str) -> torch.Tensor:
        """The tensor in the export dtype (floating-point tensors only are cast)."""
        source_name = self._resolve(name)
        if source_name not in self._names:
            raise ThinkerError(
                f"{self.folder}: tensor {name!r} is missing, but config.json asks for it; "
                "the folder's weights do not match its config"
            )
        tensor = self._source.load(source_name)
        if self.progress is not None and source_name not in self._used:
            self.progress.update(tensor.nbytes)
        self._used.add(source_name)
        problem = value_problem(tensor, self.dtype)
        if problem:
            advice = "the folder is corrupt" if "NaN" in problem else "export with --dtype bfloat16 or float32 instead"
            raise ThinkerError(f"{self._source.file_of(source_name)}: tensor {source_name!r} {problem}; {advice}")
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def parameters_read(self) -> int:
        """The model's parameters as the graph holds them, each stored tensor once (a tied head is the embedding
        matrix, read again but not counted again): the one rule by which PyTorch (``model.parameters()``) and the
        converter (the index's ``total_parameters``) count, whatever copies a graph keeps (a transposed or
        quantized head)."""
        return sum(math.prod(self._source.shape(name)) for name in self._used)

    def exported_bytes(self) -> int:
        """The bytes of every tensor the graph reads: the total of ``progress``."""
        names = [name for name in self._names if not name.startswith(self._not_exported)]
        return sum(math.prod(self._source.shape(n)) * self._source.dtype(n).itemsize for n in names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(self._resolve(name))

    def unused(self) -> list[str]:
        """Tensors of the folder that the graph never read (a tied head saved anyway is the embedding)."""
        ignored = {"lm_head.weight"} if self._tied else set()
        return sorted(n for n in self._names - self._used - ignored if not n.startswith(self._not_exported))

    def close(self) -> None:
        self._source.close()
