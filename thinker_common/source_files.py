"""Which files of a model folder may be read: regular files, inside the folder (or the Hub cache holding it).

Users convert folders they downloaded from strangers and publish what comes out, so every file read from a
folder, or copied out of it (weights, shard index, ``config.json``, the tokenizer), passes ``checked_file``:

- a symlink is followed only when it resolves inside the folder itself, or inside the blob stores of the Hugging Face
  cache that holds the folder (a snapshot's files are symlinks into the repo's ``blobs/``). A link to anything else
  (``merges.txt`` -> ``~/.ssh/id_rsa``) would carry a file the user never meant to publish into OUTPUT, so it is
  refused by name;
- what it resolves to must be a regular file: reading a named pipe blocks forever, a device never ends, and a
  folder named ``model.safetensors`` is not weights.

A path the user names on the command line (SOURCE itself, a folder or one weights file) is theirs to choose and may
be a symlink; what lies in it may not lead out of it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from .errors import ThinkerError

# huggingface_hub's cache: CACHE/models--owner--name/snapshots/<commit>/<files>, the files linking into
# CACHE/models--owner--name/blobs/ or the cache-wide CACHE/blobs/ store.
_CACHE_REPO_FOLDER = re.compile(r"(models|datasets|spaces)--.+")


def _cache_repo_of(folder: Path) -> tuple[Path, Path] | None:
    """(the cache, the repo folder) a folder's path places it in, as ``models--owner--name/snapshots/...`` names
    them, resolved (a symlink may keep the repo folder elsewhere, on a bigger disk, say); None outside any cache."""
    for form in (Path(os.path.abspath(folder)), Path(folder).resolve()):  # the path named, else where it leads
        parts = form.parts
        for index in range(len(parts) - 2, 0, -1):
            if parts[index] == "snapshots" and _CACHE_REPO_FOLDER.fullmatch(parts[index - 1]):
                repo = Path(*parts[:index])
                return repo.parent.resolve(), repo.resolve()
    return None


def hub_caches_of(folder: Path) -> list[Path]:
    """What of a Hugging Face cache a folder in it stands on, resolved: the cache its path names (the folder above
    ``models--owner--name``), and, where a symlink keeps that repo folder elsewhere, the repo folder it really is.
    What a run must not write into; empty outside any cache."""
    found = _cache_repo_of(folder)
    if found is None:
        return []
    cache, repo = found
    return [cache] if _inside(repo, cache) else [cache, repo]


def hub_blob_stores_of(folder: Path) -> list[Path]:
    """Where a folder in a Hugging Face cache may read its files from besides itself: the blob stores a snapshot's
    links lead into, the repo's ``blobs/`` and the cache-wide ``blobs/``, resolved. Not the whole cache: a folder
    merely laid out like one (``~/models--stranger--tiny/snapshots/main``, extracted from an archive) would let a
    link reach anything beside it, a key in ``~/.ssh`` included (helper-253). Empty outside any cache."""
    found = _cache_repo_of(folder)
    if found is None:
        return []
    cache, repo = found
    return [(repo / "blobs").resolve(), (cache / "blobs").resolve()]


def redownload(path: Path | str) -> str:
    """What to do about a truncated or corrupt source file. A Hub download is huggingface_hub's cached copy, which
    every later run takes again as it is: only once deleted (the blob its snapshot link points to) is it fetched
    afresh."""
    path = Path(path)
    if hub_caches_of(path.parent):
        if _matches_its_checksum(path.resolve()):
            return (
                "its cached copy is what the repo holds (its sha256 is the one the Hub gave for it), so deleting it "
                "would fetch the same bytes: the file in the repo is itself damaged, or in a form newer than the "
                "installed libraries read (upgrade them), or try another revision (--revision)"
            )
        return f"re-download it: delete the cached copy {path.resolve()} and run again, which fetches it afresh"
    if _written_by_thinker(path.parent):
        return "convert its source again (thinker-convert wrote this folder)"
    return "re-download it"


def _matches_its_checksum(blob: Path) -> bool:
    """Whether a cached blob holds what the Hub sent: huggingface_hub names a large (LFS) file's blob by the sha256
    the Hub gave for it. Read only where the file already failed, so the hash costs nothing on the way that works."""
    import hashlib

    if not re.fullmatch(r"[0-9a-f]{64}", blob.name):  # a git-stored file's blob is named by its git hash
        return False
    digest = hashlib.sha256()
    try:
        with blob.open("rb") as file:
            while piece := file.read(1 << 24):
                digest.update(piece)
    except OSError:
        return False
    return digest.hexdigest() == blob.name


def _written_by_thinker(folder: Path) -> bool:
    """Whether ``folder`` is a Thinker folder (its config.json's model_type), made locally rather than downloaded."""
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "thinker"
    except (OSError, ValueError, AttributeError):
        return False


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (reading it would wait forever)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


# What to do about a file that is not a plain one, by what it belongs to (the default: a checkpoint folder).
CHECKPOINT_FILES = (
    "a checkpoint's weights, config and tokenizer are plain files: replace it with the file it stands for"
)
ONNX_FILES = "an ONNX folder's model and weights are plain files: copy the whole folder again, or export it again"


def regular_file(path: Path, advice: str = CHECKPOINT_FILES) -> Path:
    """``path`` if it is (or links to) a regular file; else a ``ThinkerError`` saying what it is instead, and
    ``advice``."""
    path = Path(path)
    try:
        mode = path.stat().st_mode  # follows symlinks
    except FileNotFoundError:
        if path.is_symlink():
            raise ThinkerError(
                f"{path}: a broken symlink (to {os.readlink(path)}); restore the file it points to, or delete it"
            ) from None
        raise ThinkerError(f"{path}: no such file") from None
    except OSError as err:
        raise ThinkerError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise ThinkerError(f"{path}: {_kind(mode)}, not a regular file; {advice}")
    return path


def checked_file(path: Path, folder: Path) -> Path:
    """``path`` (a file in ``folder``, possibly in a sub-folder), if it may be read; see the module's rules."""
    path, folder = Path(path), Path(folder)
    target = path.resolve()
    stores = hub_blob_stores_of(folder)
    allowed = [folder.resolve(), *stores]
    if not any(_inside(target, root) for root in allowed):
        where = f"{folder}" + (
            f" and the blob stores of the Hugging Face cache holding it ({stores[0]})" if stores else ""
        )
        raise ThinkerError(
            f"{path}: a symlink to {target}, outside {where}; refusing to read it (what a file from elsewhere holds "
            "would be written into OUTPUT, converted or copied): put the file itself into the folder if it belongs to "
            "the model"
        )
    return regular_file(path)


def present(path: Path, folder: Path) -> bool:
    """Whether an optional file is there (``checked_file`` then vouches for it); a broken symlink is an error too."""
    if not os.path.lexists(path):
        return False
    checked_file(path, folder)
    return True
