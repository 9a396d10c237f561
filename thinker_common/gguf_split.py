"""GGUF files split into shards by llama.cpp's gguf-split (``NAME-00001-of-00003.gguf`` ..., ``split.count`` in each):
told apart from a folder's or a repo's several quantisations by their names, and refused with how to merge them, since
transformers, the parity reference, reads a GGUF from one file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

# llama.cpp's gguf-split names its shards NAME-00001-of-00003.gguf and records split.count / split.no in each.
SPLIT_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def merge_advice(first_shard: str) -> str:
    """What to do with a GGUF split into several files: transformers, the parity reference, reads one file."""
    return (
        f"merge the shards first with llama.cpp's `llama-gguf-split --merge {shlex.quote(first_shard)} merged.gguf` "
        "and convert merged.gguf (transformers, the parity reference, reads a GGUF from one file)"
    )


def shard_name(name: str, number: int) -> str:
    """The ``number``-th shard's name of the split ``name`` is a shard of (``name`` itself if it is none)."""
    return SPLIT_SHARD.sub(lambda match: f"{match['stem']}-{number:05d}-of-{match['count']}.gguf", name)


def is_split_shard(name: str) -> bool:
    """Whether ``name`` is named as a shard of a split GGUF (``NAME-00002-of-00003.gguf``)."""
    return SPLIT_SHARD.match(Path(name).name) is not None


def split_gguf(names: list[str]) -> str | None:
    """Where ``names`` (the ``.gguf`` files of a folder or a repo, paths in it) are the shards of one split GGUF (a
    multimodal projector ``mmproj*.gguf`` beside them aside): what to say of them, the shards missing and how to
    merge them; else None."""
    shards = [(Path(name), match) for name in names if (match := SPLIT_SHARD.match(Path(name).name))]
    others = [name for name in names if not is_split_shard(name) and not Path(name).name.startswith("mmproj")]
    sets = {(path.parent.as_posix(), match["stem"], match["count"]) for path, match in shards}
    if not shards or others or len(sets) != 1:
        return None
    folder, stem, count = next(iter(sets))
    shard = f"{'' if folder == '.' else folder + '/'}{stem}-{{:05d}}-of-{count}.gguf"
    held = {int(match["no"]) for _, match in shards}
    missing = [shard.format(n) for n in range(1, int(count) + 1) if n not in held]
    absent = f", {len(missing)} of them not here ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})"
    return f"a GGUF split into {int(count)} files{absent if missing else ''}; {merge_advice(shard.format(1))}"
