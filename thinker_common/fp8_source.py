"""Checkpoints released in fine-grained FP8 (Qwen's ``-FP8`` repos, DeepSeek's layout): read as the float model.

Such a checkpoint stores each quantized linear weight ``X.weight`` as ``float8_e4m3fn`` beside ``X.weight_scale_inv``,
one float scale per block of ``weight_block_size`` (``[128, 128]``) weights, and says so in config.json's
``quantization_config`` (``quant_method: "fp8"``). A weight's value is its FP8 value times its block's scale.
``DequantizedFP8Source`` presents the checkpoint as the float model transformers loads from it on a machine without
an FP8 GPU (``FineGrainedFP8Config(dequantize=True)``, what ``from_pretrained`` falls back to on a CPU): every
quantized weight as those products, its scales and activation scales gone. The converter's family tables then map it
as they map the float release, and the parity gate holds the result to transformers' own dequantized model, which
reaches the products through transformers' code, not this.

Why not transformers' own ``Fp8Dequantize``: it works on the tensors one ``from_pretrained`` call collects, and
derives a weight's block from its scale grid (rows // grid rows), which differs from the format's blocks where a
dimension is not a multiple of the block: it refuses 80 rows in blocks of 32 (3 row blocks), and reads 192 rows in
blocks of 128 (2 row blocks) as 96 + 96 where the format has 128 + 64. Here the block is the config's and the last
block of a dimension may be partial, as the format defines it; where every dimension is a multiple of the block, as
in Qwen's releases, the two agree to the bit (and where not, transformers gives no reference to verify against).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .dtypes import FLOAT_DTYPES, torch_dtype
from .errors import ThinkerError
from .folder_source import FolderSource
from .values import ValueScan

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
# Per-tensor activation scales of a static activation scheme: used by FP8 matmul kernels, meaningless once the
# weights are float (transformers' dequantizing load drops them too).
ACTIVATION_SCALE_SUFFIXES = (".activation_scale", ".input_scale")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# transformers' FineGrainedFP8Config default, which a quantization_config without the key gets.
DEFAULT_BLOCK = (128, 128)
FROM_GRID = (0, 0)  # weight_block_size null: each weight's block from its scale grid, as transformers derives it


def fp8_quantization(config: dict[str, Any], where: Path) -> tuple[int, int] | None:
    """The FP8 block (rows, columns) a checkpoint's ``quantization_config`` declares (``DEFAULT_BLOCK`` where it
    names none, ``FROM_GRID`` where it says null); None when it declares no quantization. Any other quantization is
    refused by name: its weights are not floats this converter can read."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != "fp8":
        raise ThinkerError(
            f"{where}: the checkpoint is quantized with {method!r} (its quantization_config), which thinker-convert "
            "does not read; it reads float checkpoints and fine-grained FP8 ones: convert the model's float (or "
            "-FP8) release instead"
        )
    if "weight_block_size" not in quantization:
        return DEFAULT_BLOCK
    block = quantization["weight_block_size"]
    if block is None:
        return FROM_GRID
    # type() rather than isinstance(): a JSON true is a Python bool, which isinstance takes for an int
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ThinkerError(
            f"{where}: quantization_config.weight_block_size is {block!r}; the FP8 layout takes two positive "
            "integers (rows, columns), such as [128, 128]"
        )
    return (block[0], block[1])


class DequantizedFP8Source(FolderSource):
    """``inner`` (a folder source of a fine-grained FP8 checkpoint) as the float model its weights stand for.

    ``dtype(name)`` of a quantized weight is the dtype transformers loads it in (the config's ``dtype``, which
    ``--dtype auto`` then writes); ``load(name)`` returns its exact products in float32, which the converter casts to
    the output dtype as transformers casts its own: so a float32 conversion is exact and a bfloat16 one rounds each
    product once, as transformers does. No ``byte_range``: a quantized weight's stored bytes are never the output's.
    """

    def __init__(self, inner: Any, block: tuple[int, int], loaded_dtype: torch.dtype) -> None:
        self.inner = inner
        self.root = inner.root
        self.block = block
        self.loaded_dtype = loaded_dtype
        names = inner.names()
        present = set(names)
        self._scale_of = {
            name: name + SCALE_SUFFIX
            for name in names
            if name + SCALE_SUFFIX in present and inner.dtype(name) in FP8_DTYPES
        }
        hidden = set(self._scale_of.values())
        self._names = [n for n in names if n not in hidden and not n.endswith(ACTIVATION_SCALE_SUFFIXES)]
        if not self._scale_of:
            raise ThinkerError(
                f"{self.root}: config.json declares FP8 quantization, but no tensor is stored in FP8 beside a "
                f"{SCALE_SUFFIX} scale; the weights and the config belong to different downloads: re-download it"
            )
        unscaled = [n for n in self._names if inner.dtype(n) in FP8_DTYPES and n not in self._scale_of]
        if unscaled:
            raise ThinkerError(
                f"{inner.file_of(unscaled[0])}: tensor {unscaled[0]!r} is stored in FP8 with no {unscaled[0]}"
                f"{SCALE_SUFFIX} beside it, so its values are unknown; the checkpoint is incomplete: re-download it"
            )

    # --- what any source answers, passed through (config and tokenizer: the folder's, as ``FolderSource`` reads them)

    def file_of(self, name: str) -> str:
        return self.inner.file_of(name)

    def close(self) -> None:
        self.inner.close()

    # --- the float model ---

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.loaded_dtype if name in self._scale_of else self.inner.dtype(name)

    def load(self, name: str, scan: ValueScan | None = None) -> torch.Tensor:
        if name not in self._scale_of:
            return self.inner.load(name, scan=scan)
        values = self.dequantized(name)
        if scan is not None:
            scan.update(values)
        return values

    def no_reference(self) -> str | None:
        """Why transformers gives no reference for this checkpoint, if it does not: its dequantizing load leaves FP8
        experts stored as one 3-D tensor (FP8Experts' own parameters, ``mlp.experts.gate_up_proj``) as FP8 values,
        their scales unread (transformers 5.24), so a gate against it would fail a sound conversion."""
        stacked = sorted(name for name in self._scale_of if len(self.inner.shape(name)) > 2)
        if not stacked:
            return None
        more = f" and {len(stacked) - 1} more" if len(stacked) > 1 else ""
        return (
            f"transformers' dequantizing load leaves FP8 experts stored as 3-D tensors ({stacked[0]}{more}) "
            "undequantized, so it gives no reference to verify against"
        )

    def summary(self, output_dtype: str) -> str:
        """What the conversion did with the FP8 weights, for the user."""
        if self.block == FROM_GRID:
            block = "blocks from each scale grid"
        else:
            block = f"scales per {self.block[0]}x{self.block[1]} block"
        return (
            f"{len(self._scale_of)} FP8 weights ({block}) dequantized to {output_dtype}, as transformers loads them "
            "without an FP8 GPU"
        )

    def dequantized(self, name: str) -> torch.Tensor:
        """``name``'s FP8 values times its blocks' scales, in float32 (each product exact)."""
        weight = self.inner.load(name).to(torch.float32)
        scale_name = self._scale_of[name]
        scales = self._scales(scale_name)
        if scales.numel() == 1 or weight.dim() < 2:  # one scale for the whole tensor
            if scales.numel() != 1:
                raise self._grid_error(name, scale_name, scales, "one scale, for a tensor of fewer than 2 dimensions")
            return weight * scales.reshape(())
        rows, columns = weight.shape[-2:]
        leading = tuple(weight.shape[:-2])  # experts stored as one 3-D tensor: a grid per expert
        from_grid = self.block == FROM_GRID
        block_rows, block_columns = self._block_from(name, scale_name, scales) if from_grid else self.block
        grid = (math.ceil(rows / block_rows), math.ceil(columns / block_columns))
        if tuple(scales.shape) != (*leading, *grid):
            expected = f"{(*leading, *grid)}, one per {block_rows}x{block_columns} block"
            raise self._grid_error(name, scale_name, scales, expected)
        if rows % block_rows == 0 and columns % block_columns == 0:  # whole blocks: each scale broadcast over its own
            blocks = weight.reshape(*leading, grid[0], block_rows, grid[1], block_columns)
            return (blocks * scales.reshape(*leading, grid[0], 1, grid[1], 1)).reshape(weight.shape)
        # A partial last block: each scale repeated over its block, then cut to what is left of the dimension.
        spread = scales.repeat_interleave(block_rows, dim=-2)[..., :rows, :]
        return weight * spread.repeat_interleave(block_columns, dim=-1)[..., :columns]

    def _scales(self, scale_name: str) -> torch.Tensor:
        """A weight's scales in float32, refused by name where one is NaN or infinite (every weight of its block
        would be) or negative. Scales stored as bytes are E8M0 exponents (``scale_fmt: "ue8m0"``, MXFP8 releases):
        2 ** (byte - 127), as transformers reads them."""
        stored = self.inner.load(scale_name)
        scales = (stored.to(torch.float32) - 127.0).exp2() if stored.dtype == torch.uint8 else stored.to(torch.float32)
        if not torch.isfinite(scales).all():
            raise ThinkerError(
                f"{self.inner.file_of(scale_name)}: {scale_name!r} holds NaN or infinite scales, which would make "
                "every weight of their blocks so; the checkpoint is corrupt: re-download it"
            )
        if (scales < 0).any():  # a block's largest magnitude over FP8's: zero for a block of zeros, never below
            raise ThinkerError(
                f"{self.inner.file_of(scale_name)}: {scale_name!r} holds negative scales, which no FP8 quantizer "
                "writes (they would flip their blocks' signs); the checkpoint is corrupt: re-download it"
            )
        return scales

    def _block_from(self, name: str, scale_name: str, scales: torch.Tensor) -> tuple[int, int]:
        """The block a scale grid implies where the config names none (weight_block_size null): each dimension
        divided by the grid's, as transformers derives it; a grid that does not divide it is refused."""
        rows, columns = self.inner.shape(name)[-2:]
        grid_rows, grid_columns = scales.shape[-2:] if scales.dim() >= 2 else (0, 0)
        if not grid_rows or not grid_columns or rows % grid_rows or columns % grid_columns:
            raise self._grid_error(name, scale_name, scales, "a grid that divides the weight (no weight_block_size)")
        return rows // grid_rows, columns // grid_columns

    def _grid_error(self, name: str, scale_name: str, scales: torch.Tensor, expected: str) -> ThinkerError:
        return ThinkerError(
            f"{self.inner.file_of(scale_name)}: {scale_name!r} holds {tuple(scales.shape)} scales for "
            f"{name!r} of shape {self.inner.shape(name)}, where the checkpoint's quantization_config asks for "
            f"{expected}; the scales and the config do not belong together: re-download the checkpoint"
        )


def loaded_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` gives a dequantized weight: the config's, else float32."""
    declared = config.get("dtype") or config.get("torch_dtype")
    text = config.get("text_config")
    if declared is None and isinstance(text, dict):
        declared = text.get("dtype") or text.get("torch_dtype")
    return torch_dtype(declared) if declared in FLOAT_DTYPES else torch.float32
