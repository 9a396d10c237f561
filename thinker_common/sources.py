"""Tensor sources: one lazy view over a checkpoint's tensors, whatever the file format.

The converter plans a conversion from names and shapes alone (``names``, ``shape``) and only then reads bytes, one
tensor at a time (``load``), so a source must never materialise the whole model. Every source answers the same
questions, including what its checkpoint says about itself (``config``) and where its tokenizer is
(``save_tokenizer``); the file a tensor lives in is kept for error messages. ``open_source`` picks the reader:
safetensors and PyTorch state dicts here, GGUF in ``gguf_reader``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch
from safetensors import safe_open

from .dtypes import SAFETENSORS_DTYPES, torch_dtype
from .errors import ThinkerError
from .folder_source import FolderSource
from .fp8_source import DequantizedFP8Source, fp8_quantization, loaded_dtype
from .side_files import read_json
from .source_files import checked_file, hub_caches_of, present, redownload, regular_file
from .values import ValueScan

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# The whole-checkpoint files, which transformers' from_pretrained loads before an index beside them (a folder can
# hold both: a whole copy uploaded beside the shards), so the index and its shards then go unread.
WHOLE_SAFETENSORS = "model.safetensors"
WHOLE_BIN = "pytorch_model.bin"
# Each format's (whole file, index), in the order transformers' from_pretrained looks for them.
LOAD_ORDER = ((WHOLE_SAFETENSORS, SAFETENSORS_INDEX), (WHOLE_BIN, BIN_INDEX))
EXPLICIT_WEIGHTS = "transformers_weights"  # a config key naming the weights file transformers loads instead

# The names transformers' from_pretrained reads a checkpoint's weights under, without an index: a whole file, or
# numbered shards. Other weight-like files beside them are dtype variants (model.fp16.safetensors, read only with
# variant=), duplicates (Mistral's consolidated.safetensors) or no weights at all (a Trainer's training_args.bin,
# llama.cpp's imatrix.bin), whose tensors would clash with the checkpoint's or refuse to load.
TRANSFORMERS_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)")


def transformers_weights(names: list[str], whole: str) -> list[str]:
    """Of a folder's weight file ``names`` without an index, the ones transformers reads: ``whole``
    (model.safetensors, pytorch_model.bin) alone where it is there, else its numbered shards, else (no file named
    as transformers names them) every one."""
    if whole in names:
        return [whole]
    return [name for name in names if TRANSFORMERS_WEIGHTS.fullmatch(name)] or names


class TensorSource(Protocol):
    """What the engine needs of a checkpoint: names and shapes up front, bytes on demand, and its own config."""

    root: Path

    def config(self) -> dict[str, Any]:
        """The config the checkpoint carries, as its format writes it (``config.json``; a GGUF file's metadata)."""
        ...

    def save_tokenizer(self, folder: Path) -> list[str]:
        """Write the checkpoint's tokenizer into ``folder`` as transformers' files; returns their names."""
        ...

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def load(self, name: str, scan: ValueScan | None = None) -> torch.Tensor:
        """The tensor's values; ``scan``, when given, sees them all (``thinker_common.values``)."""
        ...

    def file_of(self, name: str) -> str: ...

    def close(self) -> None: ...


def _read_index(index_path: Path, root: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> shard file name), checked to be that and to name at least one."""
    checked_file(index_path, root)
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except RecursionError:
        raise ThinkerError(
            f"{index_path}: not a readable shard index (nested too deeply); {redownload(index_path)}"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ThinkerError(f"{index_path}: not a readable shard index ({err}); {redownload(index_path)}") from None
    if not isinstance(weight_map, dict):
        raise ThinkerError(f"{index_path}: 'weight_map' must map tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ThinkerError(
                f"{index_path}: 'weight_map' maps {name!r} to {shard!r}, not to a shard file name; the index is "
                "corrupt: re-download the checkpoint"
            )
    if not weight_map:
        raise ThinkerError(
            f"{index_path}: its 'weight_map' names no tensor, so no shard; the index is corrupt: re-download the "
            "checkpoint, or delete the index if the folder's weights are one file"
        )
    return weight_map


def check_index_holds(root: Path, index_name: str, file_of: dict[str, Path]) -> None:
    """Each tensor the folder's shard index names lies in the shard it names: an index from another download
    would otherwise send a tensor's readers to a shard that lacks it, and the tensor would look absent from the
    checkpoint (an untied head "missing", say) when it is only misfiled."""
    index_path = root / index_name
    whole = next(whole for whole, index in LOAD_ORDER if index == index_name)
    if not os.path.lexists(index_path) or os.path.lexists(root / whole):  # the index goes unread
        return
    for name, shard in _read_index(index_path, root).items():
        found = file_of.get(name)
        if found != root / PurePosixPath(shard.replace("\\", "/")):
            where = f"it lies in {os.path.relpath(found, root)}" if found else "no shard it names holds it"
            raise ThinkerError(
                f"{index_path}: maps tensor {name!r} to {shard!r}, which does not hold it ({where}); the index and "
                "the shards come from different downloads: re-download the checkpoint"
            )


def _shard_path(root: Path, index_path: Path, file_name: str) -> Path:
    """A shard named by an index, refused if the name would leave the checkpoint folder.

    The name is checked first, then the file (``checked_file``: in a Hub cache every file is a symlink into
    ``blobs/``, which is fine; a symlinked shard or shard folder leading anywhere else is not).
    """
    name = PurePosixPath(file_name.replace("\\", "/"))
    if name.is_absolute() or ".." in name.parts or not name.parts:
        raise ThinkerError(f"{index_path}: shard name {file_name!r} points outside {root}; refusing to read it")
    path = root / name
    if not os.path.lexists(path):
        raise ThinkerError(
            f"{index_path}: names shard {file_name!r}, which is missing from {root}; the download is incomplete: "
            f"{redownload(path)}"
        )
    return checked_file(path, root)


class SafetensorsSource(FolderSource):
    """Safetensors shards (one file, or several with ``model.safetensors.index.json``), read lazily.

    ``safe_open`` validates the headers and answers names, shapes and dtypes. Bytes are read with ``pread`` into a
    buffer the returned tensor owns, rather than through ``safe_open``'s memory map: a mapped tensor stays resident
    (counted in the process's RSS) until the whole file is unmapped, so converting through the map would grow the
    resident set to the size of the checkpoint. Read this way, memory is what the caller holds, and it is freed
    with the tensor.
    """

    def __init__(self, root: Path, files: list[Path] | None = None) -> None:
        self.root = Path(root)
        from_index = files is None
        if files is None:
            files = safetensors_files(self.root)
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._file_of: dict[str, Path] = {}
        self._byte_ranges: dict[str, tuple[int, int]] = {}  # tensor -> [begin, end) within its file
        self._descriptors: dict[Path, int] = {}
        for path in files:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as err:  # safetensors raises its own error types for bad headers
                self.close()
                try:
                    os.fsencode(path).decode("utf-8")
                except UnicodeDecodeError:  # safetensors takes UTF-8 paths only: the name is at fault, not the file
                    raise ThinkerError(
                        f"{path}: its path is not valid UTF-8, which safetensors cannot open; rename the folder"
                    ) from None
                raise ThinkerError(
                    f"{path}: not a readable safetensors file ({err}); the file is truncated or corrupt, "
                    f"{redownload(path)}"
                ) from None
            for name in handle.keys():
                if name in self._file_of:
                    self.close()
                    raise ThinkerError(
                        f"{path.parent}: tensor {name!r} is in both {self._file_of[name].name} and {path.name}, so its "
                        f"files are not all of one checkpoint (a shard of another download beside them?); "
                        f"{redownload(path)}"
                    )
                self._file_of[name] = path
                self._handles[name] = handle
            self._byte_ranges.update(_data_byte_ranges(path))
            self._descriptors[path] = self._stack.enter_context(path.open("rb")).fileno()
        if from_index:
            try:
                check_index_holds(self.root, SAFETENSORS_INDEX, self._file_of)
            except ThinkerError:
                self.close()
                raise

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._handles[name].get_slice(name).get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise ThinkerError(
                f"{self._file_of[name]}: tensor {name!r} has dtype {code}, which PyTorch cannot hold; "
                f"supported: {', '.join(SAFETENSORS_DTYPES)}"
            )
        return torch_dtype(SAFETENSORS_DTYPES[code])

    def load(self, name: str, scan: ValueScan | None = None) -> torch.Tensor:
        """Read with ``pread``; with ``scan``, in pieces small enough to stay in the processor's cache, each piece
        scanned as soon as it has arrived (the value check then costs no second pass over memory)."""
        path = self._file_of[name]
        begin, end = self._byte_ranges[name]
        dtype = self.dtype(name)
        data = torch.empty(end - begin, dtype=torch.uint8)  # not zero-filled: the read fills every byte
        view, done, scanned = memoryview(data.numpy()), 0, 0
        piece = _READ_CHUNK if scan is None else _SCAN_CHUNK
        while done < len(view):  # pread returns at most ~2 GiB per call, and less at end of file
            count = os.preadv(self._descriptors[path], [view[done : done + piece]], begin + done)
            if count == 0:
                raise ThinkerError(f"{path}: ends inside tensor {name!r}; the file is truncated, {redownload(path)}")
            done += count
            if scan is not None:
                whole = done - done % dtype.itemsize  # only whole elements; a partial one waits for the next read
                if whole > scanned:
                    scan.update(data[scanned:whole].view(dtype))
                    scanned = whole
        return data.view(dtype).reshape(self.shape(name))

    def byte_range(self, name: str) -> tuple[int, int, int]:
        """(open descriptor, first byte, end) of the tensor's bytes in its file, for a copy made by the kernel."""
        begin, end = self._byte_ranges[name]
        return self._descriptors[self._file_of[name]], begin, end

    def read_pieces(self, name: str, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """The tensor's bytes, read into ``buffer`` (uint8, reused: no memory of the tensor's size, no fresh pages
        to fault in) one piece at a time; each piece holds whole elements and is valid until the next is read."""
        path = self._file_of[name]
        begin, end = self._byte_ranges[name]
        itemsize = self.dtype(name).itemsize
        size = len(buffer) - len(buffer) % itemsize
        view = memoryview(buffer.numpy())
        for start in range(begin, end, size):
            length, done = min(size, end - start), 0
            while done < length:
                count = os.preadv(self._descriptors[path], [view[done:length]], start + done)
                if count == 0:
                    raise ThinkerError(
                        f"{path}: ends inside tensor {name!r}; the file is truncated, {redownload(path)}"
                    )
                done += count
            yield buffer[:length]

    def file_of(self, name: str) -> str:
        return str(self._file_of[name])

    def close(self) -> None:
        self._stack.close()


_READ_CHUNK = 1 << 30
_SCAN_CHUNK = 4 << 20  # within a core's share of the last-level cache on common machines


def _data_byte_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range within a safetensors file: after the 8-byte header length and the JSON header, at
    the header's ``data_offsets``. The header was already validated by ``safe_open``."""
    with path.open("rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
    start = 8 + header_size
    return {
        name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


# transformers' shard names, "model-00001-of-00003.safetensors": the set they belong to says how many there are.
_NUMBERED_SHARD = re.compile(r"(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.(?P<suffix>safetensors|bin)")


def unindexed_shards(root: Path, index_name: str) -> list[str]:
    """The numbered shards (``model-00001-of-00002.safetensors``) of a folder that lacks their index ``index_name``
    (which transformers needs to load them), by name; empty where there is an index or no numbered shard."""
    suffix = index_name.removesuffix(".index.json").rsplit(".", 1)[-1]
    if os.path.lexists(root / index_name):
        return []
    found = (_NUMBERED_SHARD.fullmatch(path.name) for path in root.glob(f"*.{suffix}"))
    return sorted(match[0] for match in found if match)


def check_shard_set(root: Path, index_name: str) -> None:
    """Refuse a folder of numbered shards without their index when one of the set is missing: the tensors it holds
    would otherwise be reported as absent from the checkpoint, not as a file missing from the folder."""
    present_names = unindexed_shards(root, index_name)
    sets = {(m["stem"], m["count"], m["suffix"]) for m in map(_NUMBERED_SHARD.fullmatch, present_names)}
    for stem, count, suffix in sorted(sets):
        expected = [f"{stem}-{number:05d}-of-{count}.{suffix}" for number in range(1, int(count) + 1)]
        missing = [name for name in expected if name not in present_names]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ThinkerError(
                f"{root}: holds shards of a set of {int(count)} ({present_names[0]}, ...) but not {missing[0]}{more}, "
                f"and no {index_name}; the download is incomplete: {redownload(root / missing[0])}"
            )


def indexed_shards(root: Path, index_name: str) -> list[Path]:
    """The shards the folder's index names (checked to exist), refused where a numbered shard of the same set lies
    beside them unnamed: transformers would load the folder without that shard's tensors (an untied head then
    initialised at random), and the converter would report them as absent from the checkpoint, not the index as
    damaged."""
    index_path = root / index_name
    names = sorted(set(_read_index(index_path, root).values()))
    paths = [_shard_path(root, index_path, name) for name in names]
    named = [match for name in names if (match := _NUMBERED_SHARD.fullmatch(name))]
    for stem, count, suffix in sorted({(m["stem"], m["count"], m["suffix"]) for m in named}):
        unnamed = [
            shard
            for number in range(1, int(count) + 1)
            if (shard := f"{stem}-{number:05d}-of-{count}.{suffix}") not in names and os.path.lexists(root / shard)
        ]
        if unnamed:
            more = f" and {len(unnamed) - 1} more" if len(unnamed) > 1 else ""
            # a Hub snapshot holds one commit's files: its index is the repo's own there
            advice = (
                "the repo's index leaves it out at this commit: try another revision (--revision), or tell the "
                "repo's owner"
                if hub_caches_of(root)
                else f"the index is damaged or from another download: {redownload(index_path)}"
            )
            raise ThinkerError(
                f"{index_path}: names no tensor in {unnamed[0]}{more}, a shard of its own set beside it, so the "
                f"tensors in that shard would go unread; {advice}"
            )
    return paths


def safetensors_files(root: Path) -> list[Path]:
    """The files of a folder that transformers loads: ``model.safetensors`` where it is there (transformers reads
    it before any index beside it), else the shards the index names (checked to exist), else every
    ``*.safetensors`` file (a numbered set checked to be whole)."""
    if os.path.lexists(root / WHOLE_SAFETENSORS):
        return [checked_file(root / WHOLE_SAFETENSORS, root)]
    if os.path.lexists(root / SAFETENSORS_INDEX):
        return indexed_shards(root, SAFETENSORS_INDEX)
    check_shard_set(root, SAFETENSORS_INDEX)
    names = transformers_weights(sorted(path.name for path in root.glob("*.safetensors")), WHOLE_SAFETENSORS)
    return [checked_file(root / name, root) for name in names]


class TorchBinSource(FolderSource):
    """``pytorch_model*.bin`` state dicts, opened with ``weights_only=True`` (nothing is unpickled beyond tensors)
    and ``mmap=True`` (tensors stay on disk until read)."""

    def __init__(self, root: Path, files: list[Path] | None = None) -> None:
        self.root = Path(root)
        from_index = files is None
        if files is None:
            files = bin_files(self.root)
        self._tensors: dict[str, torch.Tensor] = {}
        self._file_of: dict[str, Path] = {}
        for path in files:
            state = _load_weights_only(path)
            for name, tensor in _flatten_state(state, path):
                self._tensors[name] = tensor
                self._file_of[name] = path
        if from_index:
            check_index_holds(self.root, BIN_INDEX, self._file_of)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def load(self, name: str, scan: ValueScan | None = None) -> torch.Tensor:
        tensor = self._tensors[name]
        if scan is not None:
            scan.update(tensor)  # the first touch of the mapped bytes
        return tensor

    def file_of(self, name: str) -> str:
        return str(self._file_of[name])

    def close(self) -> None:
        self._tensors.clear()


# How torch names the object weights_only refused to unpickle, in its two wordings: "Unsupported global: GLOBAL
# builtins.exec was not an allowed global by default" and "Trying to load unsupported GLOBAL posix.system whose
# module posix is blocked".
_UNSUPPORTED_GLOBAL = re.compile(r"unsupported (?:global: )?GLOBAL ([\w.]+)", re.IGNORECASE)
_UNPICKLER_REASON = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def _load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of ``path``, memory-mapped where the format allows; every refusal becomes a
    ``ThinkerError`` that names what torch refused. torch's own warnings (about pickle protocols, on the way to
    refusing a file) are not printed: the error says it all."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap can only be used" not in str(err):
                    raise
            # The legacy (pre-1.6, not zip) format cannot be memory-mapped; it is read whole, still weights only.
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # weights_only met something that is not a tensor or a container
        text = str(err)
        found, reason = _UNSUPPORTED_GLOBAL.search(text), _UNPICKLER_REASON.search(text)
        what = f"e.g. {found[1]}, which torch's weights-only loader blocks" if found else None
        what = what or (reason[1].strip() if reason else "objects torch's weights-only loader refuses")
        raise ThinkerError(
            f"{path}: holds pickled Python objects besides tensors ({what}); they are refused, never run "
            "(weights_only loading); get a safetensors copy of this checkpoint"
        ) from None
    except Exception as err:
        if _truncated_zip(path):
            raise ThinkerError(
                f"{path}: the file is truncated or corrupt (a zip checkpoint without the directory a zip ends with); "
                "re-download it"
            ) from None
        reason = " ".join(str(err).split())[:200]
        raise ThinkerError(
            f"{path}: not a loadable weights-only PyTorch state dict ({err.__class__.__name__}: {reason}); "
            "convert it to safetensors or re-download it"
        ) from None


def _truncated_zip(path: Path) -> bool:
    """A zip checkpoint (torch.save's format since 1.6) whose end is missing: torch's own error for it is the
    mmap's or the zip reader's ("Invalid argument", "failed finding central directory"), which says nothing of the
    cause a user can act on."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(path)
    except OSError:
        return False


def _flatten_state(state: object, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # Training scripts often save {"model": state_dict, "optimizer": ...}; take the one dict of tensors.
    if isinstance(state, dict) and not any(isinstance(v, torch.Tensor) for v in state.values()):
        for key in ("model", "state_dict", "model_state_dict", "module"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict):
        raise ThinkerError(f"{path}: expected a dict of tensors (a state dict), found {type(state).__name__}")
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            yield name, value


def transformers_weights_format(root: Path) -> str | None:
    """``"safetensors"`` or ``"bin"``: the format of the weights transformers' from_pretrained loads from the folder
    ``root``, found as it looks, in its order (model.safetensors, its index, pytorch_model.bin, its index); None where
    none of those names is there. A variant or a consolidated copy beside a pytorch_model.bin goes unread by
    transformers, so by the converter too; without any of those names (numbered shards without their index, a lone
    variant) the converter still reads what there is, which transformers cannot load, so no check of it can run
    (``converter.parity``)."""
    for names, kind in zip(LOAD_ORDER, ("safetensors", "bin"), strict=True):
        if any(os.path.lexists(root / name) for name in names):
            return kind
    return None


def refuse_explicit_weights(root: Path) -> None:
    """Refuse a folder whose config.json names its weights file (``transformers_weights``): transformers 5 loads that
    file rather than model.safetensors or its index, and the converter reads only those names."""
    path = root / "config.json"
    if not os.path.isfile(path):
        return
    config = read_json(path)
    named = config.get(EXPLICIT_WEIGHTS) if isinstance(config, dict) else None
    if named is not None:
        raise ThinkerError(
            f"{path}: names its weights file {named!r} ({EXPLICIT_WEIGHTS}), which transformers loads instead of "
            f"{WHOLE_SAFETENSORS} or {SAFETENSORS_INDEX}; the converter reads only those names: rename the file (or "
            f"its index) to one of them and remove {EXPLICIT_WEIGHTS} from the config"
        )


def bin_files(root: Path) -> list[Path]:
    """As ``safetensors_files``, for PyTorch pickles: ``pytorch_model.bin`` before any index beside it."""
    if os.path.lexists(root / WHOLE_BIN):
        return [checked_file(root / WHOLE_BIN, root)]
    if os.path.lexists(root / BIN_INDEX):
        return indexed_shards(root, BIN_INDEX)
    check_shard_set(root, BIN_INDEX)
    found = sorted(path.name for pattern in ("*.bin", "*.pth", "*.pt") for path in root.glob(pattern))
    return [checked_file(root / name, root) for name in transformers_weights(found, WHOLE_BIN)]


# Files beside a checkpoint's weights that a user may name as SOURCE by mistake (config.json, tokenizer.json,
# tokenizer.model, README.md ...): never a PyTorch pickle.
NOT_WEIGHTS_SUFFIXES = (".json", ".jinja", ".txt", ".md", ".model", ".py", ".yaml")


def open_source(root: Path, dequantize: bool = True) -> TensorSource:
    """The source for a checkpoint folder (or a single weights file), preferring safetensors. A checkpoint its
    config.json declares fine-grained FP8 is read as the float model it stands for (``fp8_source``), unless
    ``dequantize=False`` (the parity reference, which dequantizes through transformers' own code)."""
    source = _open_source(Path(root))
    if not dequantize or not isinstance(source, FolderSource):
        return source
    try:
        return dequantized_if_fp8(source)
    except ThinkerError:
        source.close()
        raise


def dequantized_if_fp8(source: FolderSource) -> TensorSource:
    """``source`` itself, or, where its config.json declares FP8 quantization, the float model it stands for."""
    path = source.root / "config.json"
    if not present(path, source.root):
        return source  # refused, naming the missing config, where the config is read
    config = source.config()
    block = fp8_quantization(config, path)
    return source if block is None else DequantizedFP8Source(source, block, loaded_dtype(config))


def refuse_one_shard(path: Path) -> None:
    """A weights file that an index beside it names as one of several shards is a part of a checkpoint: refused as
    such, where its tensors alone were refused as an incomplete checkpoint (a QA run)."""
    for index in sorted(path.parent.glob("*.index.json")):
        try:
            shards = set(_read_index(index, path.parent).values())
        except ThinkerError:
            continue  # not a sound index of weights: refused, or ignored, where it is read
        if path.name in shards and len(shards) > 1:
            raise ThinkerError(
                f"{path}: one of the {len(shards)} shards {index.name} names; give the folder that holds them "
                f"({path.parent}) as SOURCE"
            )


def _open_source(root: Path) -> TensorSource:
    if os.path.lexists(root) and not root.is_dir():
        regular_file(root)  # SOURCE named on the command line: a symlink is the user's choice, a pipe is not a file
        refuse_one_shard(root)
        if root.suffix == ".safetensors":
            return SafetensorsSource(root.parent, [root])
        if root.suffix == ".gguf":
            from .gguf_reader import GGUFSource

            return GGUFSource(root)
        if root.suffix in NOT_WEIGHTS_SUFFIXES:  # a PyTorch pickle would be refused as holding other objects
            raise ThinkerError(
                f"{root}: a {root.suffix} file of the checkpoint, not its weights; give the folder that holds it"
            )
        return TorchBinSource(root.parent, [root])
    if not root.is_dir():
        raise ThinkerError(f"{root}: no such file or folder")
    refuse_explicit_weights(root)
    loaded = transformers_weights_format(root)
    if loaded == "safetensors" or (loaded is None and safetensors_files(root)):
        return SafetensorsSource(root)
    if loaded == "bin" or bin_files(root):
        return TorchBinSource(root)
    ggufs = [checked_file(path, root) for path in sorted(root.glob("*.gguf"))]
    if len(ggufs) == 1:
        from .gguf_reader import GGUFSource

        return GGUFSource(ggufs[0])
    if len(ggufs) > 1:
        from .gguf_split import split_gguf

        if split := split_gguf([str(path) for path in ggufs]):  # the shards' paths: the merge advice runs as given
            raise ThinkerError(f"{root}: holds {split}")
        shown = ", ".join(path.name for path in ggufs[:4]) + (f", ... ({len(ggufs)} in all)" if len(ggufs) > 4 else "")
        raise ThinkerError(
            f"{root}: holds several .gguf files ({shown}); pass the one to convert as SOURCE, or name it with "
            "--gguf-file"
        )
    nested = sorted(path.relative_to(root).as_posix() for path in root.glob("*/**/*.gguf"))
    if nested:  # GGUF repos often keep each quantisation in a folder of its own
        shown = ", ".join(nested[:4]) + (f", ... ({len(nested)} in all)" if len(nested) > 4 else "")
        raise ThinkerError(
            f"{root}: no checkpoint at its top level; its folders hold {shown}: name one with --gguf-file"
        )
    folders = sorted({path.parent for path in root.glob("*/**/*.safetensors")})
    if folders:  # a repo's checkpoint in a folder of its own (original/, a component's folder)
        shown = ", ".join(str(folder) for folder in folders[:4]) + (
            f", ... ({len(folders)} in all)" if len(folders) > 4 else ""
        )
        raise ThinkerError(
            f"{root}: no checkpoint at its top level; its folders hold weights: pass one as SOURCE ({shown})"
        )
    raise ThinkerError(
        f"{root}: no checkpoint here (no *.safetensors, pytorch_model*.bin, *.pth or *.gguf); "
        "point SOURCE at a model folder or a Hub repo id"
    )
