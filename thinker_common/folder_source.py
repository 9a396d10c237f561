"""A checkpoint folder in Hugging Face's layout, as every folder-backed tensor source reads it: its ``config.json``
and its tokenizer files (``sources`` reads the weights beside them; ``fp8_source`` reads an FP8 release's as floats)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ADAPTER_CONFIG, ThinkerError, peft_adapter_error
from .side_files import copy_files, read_json, tokenizer_files
from .source_files import present


class FolderSource:
    """A checkpoint folder in Hugging Face's layout: ``config.json`` and the tokenizer files beside the weights."""

    root: Path

    def config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        if not present(path, self.root):
            if (self.root / ADAPTER_CONFIG).is_file():  # peft's save_pretrained writes no config.json
                raise peft_adapter_error(f"{self.root / ADAPTER_CONFIG}, no config.json")
            raise ThinkerError(f"{self.root}: no config.json beside the weights; it says which model they belong to")
        config = read_json(path)
        if not isinstance(config, dict):
            raise ThinkerError(f"{path}: expected a JSON object")
        return config

    def save_tokenizer(self, folder: Path) -> list[str]:
        """The folder's tokenizer files, copied (none is fine: weights-only checkpoints)."""
        return copy_files(tokenizer_files(self.root), self.root, folder)
