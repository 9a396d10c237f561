"""GGUF (llama.cpp) checkpoints as a lazy tensor source.

``GGUFSource`` answers the ``TensorSource`` questions for one ``.gguf`` file. ``gguf.GGUFReader`` memory-maps the
file and parses only the header, so names, shapes and dtypes cost nothing; ``load`` dequantizes one tensor at a time
with transformers' own dequantizers (``dequantized``), so the values are bit-identical to what
``from_pretrained(..., gguf_file=...)`` produces.

This module reads the file; it does not interpret it. Tensor names stay as llama.cpp wrote them
(``blk.0.attn_q.weight``) and ``config()`` is the file's metadata under llama.cpp's keys (``llama.block_count``):
what they mean in Hugging Face terms (names, the q/k RoPE row order, config fields) is the GGUF family's business
(``converter/families/gguf.py``).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ThinkerError
from .gguf_split import is_split_shard, merge_advice, shard_name
from .source_files import redownload, regular_file
from .values import ValueScan

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


def _torch_dtypes() -> dict[Any, torch.dtype]:
    from gguf import GGMLQuantizationType as T

    # Unquantized types keep their own dtype; every other (block-quantized) type dequantizes to float32.
    return {
        T.F32: torch.float32,
        T.F16: torch.float16,
        T.BF16: torch.bfloat16,
        T.F64: torch.float64,
        T.I8: torch.int8,
        T.I16: torch.int16,
        T.I32: torch.int32,
        T.I64: torch.int64,
    }


class GGUFSource:
    """One ``.gguf`` file, read lazily: the header up front, each tensor's bytes only when ``load`` asks for it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.root = self.path.parent
        self._reader = _open_reader(self.path)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self._native = _torch_dtypes()

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-varying first (ggml's ne[0] is the row length); PyTorch is the reverse.
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dtype(self, name: str) -> torch.dtype:
        return self._native.get(self._tensor(name).tensor_type, torch.float32)

    def load(self, name: str, scan: ValueScan | None = None) -> torch.Tensor:
        from gguf import GGMLQuantizationType

        tensor = self._tensor(name)
        kind = tensor.tensor_type
        try:
            if kind == GGMLQuantizationType.BF16:
                # The reader exposes BF16 as raw bytes and ``dequantize`` would widen it to float32; reinterpret
                # the bits instead so the tensor keeps the dtype that ``dtype`` reports.
                raw = np.array(tensor.data, copy=True).view(np.int16)
                result = torch.from_numpy(raw).view(torch.bfloat16)
            elif kind in self._native:
                # Native types are already typed views of the map; copy so the tensor owns writable memory.
                result = torch.from_numpy(np.array(tensor.data, copy=True))
            else:
                result = dequantized(tensor.data, kind)
        except NotImplementedError:
            raise ThinkerError(
                f"{self.path}: tensor {name!r} is stored as {kind.name}, which gguf {_gguf_version()} cannot "
                "dequantize; upgrade the gguf package or use a file with another quantization"
            ) from None
        except (OSError, ValueError) as err:
            raise ThinkerError(f"{self.path}: cannot read tensor {name!r} ({err}); the file is corrupt") from None
        if scan is not None:
            scan.update(result)
        return result.reshape(self.shape(name))

    def file_of(self, name: str) -> str:
        self._tensor(name)
        return str(self.path)

    def config(self) -> dict[str, Any]:
        """GGUF's config is its metadata: ``general.architecture``, ``{arch}.block_count`` ... (a copy)."""
        return dict(self.metadata)

    def save_tokenizer(self, folder: Path) -> list[str]:
        """A GGUF file carries its tokenizer as metadata; transformers rebuilds it, and it is saved as usual files."""
        from transformers import AutoTokenizer

        if "tokenizer.ggml.model" not in self.metadata:  # transformers would say "stating tokenizer None"
            log.warning("%s holds no tokenizer (no tokenizer.ggml.* metadata); the output has no tokenizer", self.path)
            return []
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.root, gguf_file=self.path.name, trust_remote_code=False)
        except Exception as err:  # tokenizer conversion has many failure modes; the weights are still good
            log.warning("the tokenizer in %s could not be converted (%s); the output has no tokenizer", self.path, err)
            return []
        rows = self.shape("token_embd.weight")[0] if "token_embd.weight" in self.names() else None
        if rows is not None and len(tokenizer) > rows:  # llama.cpp's files have one row per token
            self._warn_unembeddable(tokenizer, rows)
        # How transformers loaded the file, not the tokenizer: it writes these into tokenizer_config.json, so the
        # output followed HF_HUB_OFFLINE, and `thinker verify`, which rebuilds the files, refused a folder converted
        # with it set and checked without (found by a benchmark run).
        for key in LOADING_KEYS:
            tokenizer.init_kwargs.pop(key, None)
        if named := self.named_chat_templates():
            default = tokenizer.chat_template
            tokenizer.chat_template = {**named, **({"default": default} if isinstance(default, str) else {})}
        before = _files_in(folder)
        tokenizer.save_pretrained(folder)
        return sorted(_files_in(folder) - before)

    def named_chat_templates(self) -> dict[str, str]:
        """The chat templates besides the default one that llama.cpp's converter writes from a checkpoint's
        ``additional_chat_templates/`` (``tokenizer.chat_templates``, each ``tokenizer.chat_template.NAME``), by name;
        transformers' GGUF tokenizer reads the default one alone, so ``apply_chat_template(chat_template="tool_use")``
        took the name for a template (a review). The tokenizer then saves them where it reads them."""
        names = self.metadata.get("tokenizer.chat_templates") or ()
        found = {str(name): self.metadata.get(f"tokenizer.chat_template.{name}") for name in names}
        return {name: template for name, template in found.items() if isinstance(template, str) and name != "default"}

    def _warn_unembeddable(self, tokenizer: Any, rows: int) -> None:
        """Ids the tokenizer can give that the embedding has no row for, told apart by where they come from: the
        file listing more tokens than rows (it is inconsistent), or transformers' conversion adding its tokenizer
        class's default special tokens (GPT-2's ``<|endoftext|>``) that the file's vocabulary lacks."""
        listed = len(self.metadata.get("tokenizer.ggml.tokens") or ())
        if listed > rows:
            log.warning(
                "the tokenizer in %s holds %d tokens, but its embedding (token_embd.weight) %d rows: ids from %d on "
                "fail the embedding lookup when fed; the file is inconsistent (convert the model again with "
                "llama.cpp)",
                self.path,
                listed,
                rows,
                rows,
            )
            return
        added = {index: str(token) for index, token in tokenizer.added_tokens_decoder.items() if index >= rows}
        log.warning(
            "transformers' conversion of the tokenizer in %s added %s beyond the file's %d tokens (its tokenizer "
            "class's defaults), which the embedding (token_embd.weight, %d rows) has no row for: the output's "
            "tokenizer.json keeps them as transformers' own loading of the file does; do not feed them to the model",
            self.path,
            ", ".join(f"{token!r} (id {index})" for index, token in sorted(added.items())) or "tokens",
            listed,
            rows,
        )

    def close(self) -> None:
        # The memory map is released once nothing refers to it; the tensors handed out by ``load`` are copies.
        self._tensors = {}
        self._reader = None

    @functools.cached_property
    def metadata(self) -> dict[str, Any]:
        """The file's key/value metadata as plain Python values (strings decoded, arrays as lists).

        Computed on first use: the tokenizer vocabulary alone is ~10^5 strings. The reader's ``GGUF.*`` entries
        are the file header (version and counts), not stored metadata, and are left out.
        """
        if self._reader is None:
            raise ThinkerError(f"{self.path}: the source is closed")
        return {key: _field_value(field) for key, field in self._reader.fields.items() if not key.startswith("GGUF.")}

    def metadata_value(self, key: str, default: Any = None) -> Any:
        """One metadata value, without ``metadata``'s decoding of every field (the vocabulary's strings)."""
        if self._reader is None:
            raise ThinkerError(f"{self.path}: the source is closed")
        return _field(self._reader, key, default)

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None


# Blocks are dequantized this many values at a time: transformers' dequantizers make temporaries a few times their
# output, which for a whole 1 GiB embedding would be gigabytes. Pieces of 4 MiB of float32 are also the fastest
# measured, their temporaries staying in the processor's cache (a 134M-value Q8_0 tensor on two cores: 0.22-0.31 s,
# against 0.31-0.34 s in pieces of 16 MiB and 0.55 s whole).
DEQUANTIZE_PIECE = 1 << 20
# The keys of a tokenizer's init_kwargs that record how transformers loaded it (``save_tokenizer``).
LOADING_KEYS = ("local_files_only", "is_local")


def _files_in(folder: Path) -> set[str]:
    """The paths of ``folder``'s files within it, ``/``-separated (named chat templates lie in a folder)."""
    return {path.relative_to(folder).as_posix() for path in Path(folder).rglob("*") if path.is_file()}


def dequantized(data: np.ndarray, kind: Any) -> torch.Tensor:
    """``gguf.dequantize(data, kind)`` bit for bit, as a float32 tensor of its shape that owns its memory.

    The block types transformers dequantizes itself (``transformers.integrations.gguf.dequant``, what its GGUF
    loading of the newer architectures runs) go through its torch operations, a piece at a time: 1.4-2.3x faster
    than gguf's numpy reference on two cores (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K measured), with a piece's temporaries
    where gguf's make a whole tensor's, and equal to it in every finite value (NaN payloads aside, which the value
    checks refuse anyway: tests/converter/test_gguf_dequantize.py holds each type to that). Every other type, the
    unquantized ones included, goes through gguf's own ``dequantize``."""
    from gguf import quants
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize  # transformers >= 5.23

    if kind not in GGML_BLOCK:
        values = quants.dequantize(data, kind)
        return torch.from_numpy(values if values.flags.writeable else values.copy())  # not a view of the map
    per_block, block_bytes = GGML_BLOCK[kind]
    flat = np.asarray(data).reshape(-1)
    blocks = flat.size // block_bytes
    result = torch.empty(blocks * per_block, dtype=torch.float32)
    step = max(1, DEQUANTIZE_PIECE // per_block)
    for first in range(0, blocks, step):
        last = min(first + step, blocks)
        piece = torch.from_numpy(flat[first * block_bytes : last * block_bytes].copy())  # the map is read-only
        result[first * per_block : last * per_block] = dequantize(piece, int(kind))
    return result.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * per_block)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def mapped_reader(path: Path) -> Any:
    """``gguf.GGUFReader(path)`` over a plain ndarray view of its memory map rather than the ``np.memmap`` itself.

    The reader slices its map once per metadata string and per array element, and every slice of an ``np.memmap``
    runs memmap's ``__array_finalize__`` and ``__getitem__``: 11.6 s to open a file with Qwen3.5's 248,320-token
    vocabulary, against 3.3 s over a view of the same mapped bytes (the view keeps the map alive; nothing is
    copied). The reader and its tensors are otherwise gguf's own. Inside ``gguf_read_once``, the file's one
    reader."""
    if _shared is None:
        return _new_mapped_reader(path)
    identity = _file_identity(path)
    with _shared_lock:
        if identity not in _shared:
            _shared[identity] = _new_mapped_reader(path)
        else:  # as a reader of its own would start: with none of the file resident
            drop_resident_pages(_shared[identity])
        return _shared[identity]


def drop_resident_pages(reader: Any) -> None:
    """Unmaps the pages of the file that ``reader`` (a ``mapped_reader``) has read, as closing it would: a shared
    reader outlives its users, and what they read would otherwise stay in the resident set until the block ends
    (0.75 GiB for a Qwen3.5-0.8B Q8_0 file, beside the models a check holds). The pages stay in the page cache, so
    reading them again costs no disk read; on systems without ``madvise`` nothing is dropped."""
    mapped = getattr(reader, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def release_pages(path: Path) -> None:
    """``drop_resident_pages`` of the reader ``gguf_read_once`` shares for ``path``, once a user is done reading it."""
    if _shared is not None:
        with _shared_lock:
            reader = _shared.get(_file_identity(path))
        if reader is not None:
            drop_resident_pages(reader)


# The readers ``gguf_read_once`` shares, by file identity; None outside it.
_shared: dict[tuple[int, ...], Any] | None = None
_shared_lock = threading.Lock()


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, and each of gguf's tensor-name tables built once.

    ``mapped_reader`` and ``gguf.GGUFReader`` (which transformers' GGUF loading calls anew for a file's config, its
    tokenizer and its weights) return the file's one ``mapped_reader``. Parsing reads every vocabulary string and
    merge through Python, 5 s for SmolLM2's 49,152 tokens (3.3 s for Qwen3.5's 248,320 over the mapped view, 11.6 s
    through transformers' own reader), and a conversion with its parity check parsed its file five times. A reader
    only reads its map, so sharing one is safe; a file changed in between (another size, time or inode) is parsed
    again. ``gguf.get_tensor_name_map(arch, blocks)`` is memoized: transformers' ``get_gguf_hf_weights_map`` calls
    it once per module of the model as it recurses (411 tables for SmolLM2, ~5 s), and a table is only read. Nested
    blocks share the outermost's."""
    global _shared
    import gguf

    if _shared is not None:
        yield
        return
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: os.PathLike | str, mode: str = "r") -> Any:
        return mapped_reader(Path(path)) if mode == "r" else reader_class(path, mode)

    _shared, gguf.GGUFReader, gguf.get_tensor_name_map = {}, shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        _shared, gguf.GGUFReader, gguf.get_tensor_name_map = None, reader_class, name_map


def _file_identity(path: Path) -> tuple[int, ...]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _new_mapped_reader(path: Path) -> Any:
    from gguf.gguf_reader import GGUFReader  # the class itself, not what ``gguf_read_once`` puts in its place

    class MappedReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._mapped

        @data.setter
        def data(self, value: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
            self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value
            self._mmap = getattr(value, "_mmap", None)  # the mapping itself (``drop_resident_pages``)

    return MappedReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else _field_value(field)


def _refuse_a_shard(path: Path, reader: Any) -> None:
    """One shard of a split GGUF holds some of the tensors only: named as such (split.count), not as a file
    missing tensors."""
    count = _field(reader, "split.count", 1)
    if isinstance(count, int) and count > 1:
        number = _field(reader, "split.no", "one")
        number = number + 1 if isinstance(number, int) else number
        if not is_split_shard(path.name):  # llama-gguf-split --merge finds the other shards by their names
            first = f"NAME-00001-of-{count:05d}.gguf"
            advice = (
                f"llama.cpp's `llama-gguf-split --merge` finds a split's shards by their names, which this one has "
                f"lost: name the {count} shards NAME-00001-of-{count:05d}.gguf, NAME-00002-... in order, then "
                + merge_advice(first).replace("merge the shards first with", "merge them with", 1)
            )
        else:  # the shards not beside it named (the first four: a damaged count may be huge): the merge needs all
            names = (shard_name(path.name, n) for n in range(1, count + 1))
            missing = list(islice((name for name in names if not path.with_name(name).exists()), 4))
            absent = f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} not beside it: fetch them, then "
            advice = (absent if missing else "") + merge_advice(str(path.with_name(shard_name(path.name, 1))))
        raise ThinkerError(f"{path}: shard {number} of a GGUF split into {count} files (split.count); {advice}")


def _open_reader(path: Path) -> Any:
    """A ``GGUFReader`` for ``path``, with every way a file can be unreadable turned into one ``ThinkerError``."""
    if os.path.lexists(path):
        regular_file(path)  # a named pipe would block the read below forever
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
        size = path.stat().st_size
    except OSError as err:
        raise ThinkerError(f"{path}: cannot open ({err.strerror or err}); check the path") from None
    if magic != GGUF_MAGIC:
        raise ThinkerError(f"{path}: not a GGUF file (it does not start with b'GGUF'); pass a llama.cpp .gguf file")
    try:
        reader = mapped_reader(path)
    except Exception as err:  # the reader signals a short or garbled file with assorted exception types
        _refuse_what_a_download_cannot_mend(path, err)
        raise ThinkerError(
            f"{path}: not a readable GGUF file ({err.__class__.__name__}: {err}); it is truncated or corrupt, "
            f"{redownload(path)}"
        ) from None
    if reader.byte_order != "I":
        # gguf's dequantizers assume the host's (little-endian) byte order for the packed blocks.
        raise ThinkerError(f"{path}: a GGUF file of the opposite byte order (big-endian); use a little-endian file")
    # A cut inside the tensor data can still parse when numpy silently shortens the last views; check the extents.
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise ThinkerError(
                f"{path}: truncated ({size} bytes, but tensor {tensor.name!r} ends at byte "
                f"{int(tensor.data_offset) + int(tensor.n_bytes)}); re-download it"
            )
    _check_overlaps(path, reader)
    _refuse_a_shard(path, reader)
    _check_the_data_fills_the_file(path, reader, size)
    return reader


# Quantization types llama.cpp wrote in 2024 and then removed (ARM layouts repacked at load time since): the gguf
# package no longer knows their ids, so a file holding them reads as garbled to it.
REMOVED_TYPES = {31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8"}


def _refuse_what_a_download_cannot_mend(path: Path, err: Exception) -> None:
    """The reader's refusals of a sound file that it cannot read, each with what will help: another GGUF version, a
    quantization type it does not know. (Any other failure is a damaged file: the caller says to re-download.)"""
    from gguf import GGMLQuantizationType
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    message = str(err)
    if "version" in message and "cannot handle" in message:
        version = message.split("version", 1)[1].split()[0]
        supported = " and ".join(map(str, READER_SUPPORTED_VERSIONS))
        advice = (
            "upgrade the gguf package"
            if version.isdigit() and int(version) > max(READER_SUPPORTED_VERSIONS)
            else "convert the model again with a current llama.cpp"
        )
        raise ThinkerError(
            f"{path}: GGUF version {version}, which the gguf package reads only in versions {supported}; {advice}"
        ) from None
    if "is not a valid GGMLQuantizationType" in message:
        found = re.search(r"(\d+)\)? is not a valid", message)  # "np.uint32(31) is not a valid ..."
        number = found.group(1) if found else "?"
        kind = int(number) if found else None
        if kind in REMOVED_TYPES:
            raise ThinkerError(
                f"{path}: tensors stored as {REMOVED_TYPES[kind]} (type {kind}), an ARM layout llama.cpp has removed; "
                "use the repository's Q4_0 or Q8_0 file, or quantize the model again with llama-quantize"
            ) from None
        known = max(int(member) for member in GGMLQuantizationType)
        raise ThinkerError(
            f"{path}: a tensor stored as quantization type {number}, which the gguf package (types up to "
            f"{known}) does not know; upgrade the gguf package or use a file with another quantization"
        ) from None


def _check_the_data_fills_the_file(path: Path, reader: Any, size: int) -> None:
    """The tensors' data runs to the end of the file (a writer pads each tensor to the alignment, so less than that
    may follow the last). A header listing fewer tensors than were written parses, but the reader then takes the
    leftover tensor records as the start of the data and every tensor's bytes from the wrong place: finite garbage
    that both this converter and transformers' GGUF loading would read alike, so parity could not notice."""
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    if size - end >= max(int(reader.alignment), 1):
        raise ThinkerError(
            f"{path}: {size - end} bytes follow the data of its {len(reader.tensors)} tensors (the last ends at byte "
            f"{end} of {size}); its header does not describe the file, which is corrupt or crafted: "
            f"{redownload(path)}"
        )


def _check_overlaps(path: Path, reader: Any) -> None:
    """Every tensor's bytes its own: the reader takes each tensor's offset from the header as given, so a file whose
    tensors share bytes (one tensor read as another, or a crafted file) would convert without a word."""
    extents = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    extents = [extent for extent in extents if extent[1] > extent[0]]  # empty tensors occupy no bytes
    for (_, end, name), (start, following_end, following) in zip(extents, extents[1:], strict=False):
        if start < end:
            last = min(end, following_end) - 1
            raise ThinkerError(
                f"{path}: the data of tensors {name!r} and {following!r} overlap (both hold bytes {start} to {last} "
                "of the file); the file is corrupt or crafted: re-download it"
            )


def _field_value(field: Any) -> Any:
    """Decode one ``ReaderField``: ``field.types`` is ``[ARRAY, item type]`` for arrays, else ``[type]``, and
    ``field.data`` indexes the parts holding the value(s)."""
    from gguf import GGUFValueType

    if not field.types:
        return None

    def item(index: int, kind: Any) -> Any:
        part = field.parts[index]
        if kind == GGUFValueType.STRING:
            # Token strings may hold byte fragments that are not valid UTF-8 on their own; keep them visible.
            return bytes(part).decode("utf-8", errors="replace")
        return part[0].item()  # numpy scalar -> Python int / float / bool

    if field.types[0] == GGUFValueType.ARRAY:
        # Nested arrays are flattened by the reader; their innermost type describes every element.
        kind = field.types[-1]
        return [item(index, kind) for index in field.data]
    return item(field.data[0], field.types[0])
