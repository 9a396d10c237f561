"""Hub sources: turn ``SOURCE`` into a local folder, downloading it from the Hugging Face Hub when it is a repo id.

``resolve_source`` is the only entry point. A local path wins; otherwise ``SOURCE`` must be a repo id (``name`` or
``owner/name``) and the files a conversion needs are fetched with huggingface_hub's own ``snapshot_download``, so
the standard cache (``HF_HUB_CACHE``), ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE`` and huggingface_hub's
progress bars all behave as users of other Hugging Face tools expect.

Environment variables are re-read on every call rather than taken only from ``huggingface_hub.constants`` (which
are frozen when huggingface_hub is imported), so a variable set after import, by a wrapper script or a test, is
honoured too.

Every failure the user can act on becomes a one-line ``ThinkerError`` naming the repo id and revision.
"""

from __future__ import annotations

import difflib
import glob
import logging
import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from huggingface_hub import HfApi, constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import filter_repo_objects, validate_repo_id
from huggingface_hub.utils import tqdm as hf_tqdm

from thinker_common.errors import ADAPTER_CONFIG, ThinkerError, peft_adapter_error
from thinker_common.gguf_split import is_split_shard, shard_name, split_gguf
from thinker_common.model_card import CARD_FILE, LICENSE_FILES
from thinker_common.side_files import CONFIG_FILES, TOKENIZER_FILES, is_tokenizer_file, read_json
from thinker_common.source_files import checked_file
from thinker_common.sources import (
    BIN_INDEX,
    LOAD_ORDER,
    SAFETENSORS_INDEX,
    TRANSFORMERS_WEIGHTS,
    WHOLE_BIN,
    WHOLE_SAFETENSORS,
)

try:  # huggingface_hub 2.x talks HTTP through httpx2, 1.x through httpx; both raise TransportError subclasses.
    import httpx2 as _httpx
except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
    import httpx as _httpx

__all__ = ["is_repo_id", "pick_conversion_files", "resolve_source"]

# Failures that mean "the Hub could not be reached", as opposed to the Hub answering "no".
_NETWORK_ERRORS: tuple[type[BaseException], ...] = (_httpx.TransportError, ConnectionError, TimeoutError)
# HTTP answers that are worth falling back to the cache for: the Hub is overloaded or down, not refusing us.
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Files that hold tokenizer vocabularies next to config.json (sentencepiece, tiktoken, BPE merges and vocab).
# The side files a conversion reads or carries: the configs, the shard indexes, the tokenizer's files (a chat
# template in chat_template.jinja too), the card and the license. Nothing else: a repo's other JSON and text files
# (trainer_state.json, training logs, eval results) can be large and are never read.
_INDEXES = (SAFETENSORS_INDEX, BIN_INDEX)
_SIDE_FILES = (*CONFIG_FILES, *_INDEXES, *TOKENIZER_FILES, CARD_FILE, *LICENSE_FILES)
# Beside a GGUF, whose config and tokenizer are its metadata: only the files its conversion reads or carries (the
# generation config, as transformers' from_pretrained(..., gguf_file=) reads it, and the card's license).
_GGUF_SIDE_FILES = ("generation_config.json", CARD_FILE, *LICENSE_FILES)
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
_log = logging.getLogger(__name__)


class _NoProgress(hf_tqdm):
    """huggingface_hub's progress bar class, always disabled: used for ``progress=False``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def is_repo_id(source: str) -> bool:
    """Whether ``source`` is shaped like a Hub repo id (``name`` or ``owner/name``), by huggingface_hub's rules."""
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def pick_conversion_files(
    repo_files: Iterable[str], label: str, gguf_file: str | None = None, folder: str = ""
) -> list[str]:
    """The files of a repo that a conversion reads, chosen from its file listing; ``label`` names it in errors.
    ``gguf_file`` names the one GGUF file to take, of the several a GGUF repo holds (one per quantisation).
    ``folder`` is where ``repo_files`` lie in the repo (``Q8/`` for ``subfolder="Q8"`` or ``--gguf-file
    Q8/NAME.gguf``): the shards of a split GGUF are named by their path in the repo, as its other quantisations'
    folders may hold shards of the same names.

    Only top-level files are taken: sub-folders hold alternative copies (``original/*.pth``, ``onnx/``, ``gguf/``)
    that can be many times the size of the checkpoint itself. Of the weights, one format is taken, the first
    present of: safetensors, PyTorch ``.bin`` (a pickle, so only when no safetensors exist, or where transformers
    loads it first: ``pytorch_model.bin`` or its index beside safetensors of other names than ``model.safetensors``
    and its index; and only under transformers' names: ``training_args.bin`` or llama.cpp's ``imatrix.bin`` are no
    checkpoint), GGUF (only if that
    is all there is, and only a single file, since GGUF repos usually hold one file per quantisation). Within a
    format, the files transformers names so (``thinker_common.sources.TRANSFORMERS_WEIGHTS``) win over others
    (Mistral-style repos ship a ``consolidated.safetensors`` duplicate of the sharded weights, others dtype variants
    such as ``model.fp16.safetensors``); a whole ``model.safetensors`` (or ``pytorch_model.bin``) is read alone,
    as transformers reads it before an index and shards beside it (that index is not fetched). Next to
    them come the small side files a conversion reads or carries (``_SIDE_FILES``): the configs, the shard index,
    the tokenizer's files and chat template, and the model card and license files (``README.md``, ``LICENSE``),
    whose license travels with the weights into OUTPUT. (``_resolve_repo`` then keeps only the shards the index
    names.)
    """
    repo_files = list(repo_files)
    top = sorted({name for name in repo_files if "/" not in name})
    level = f"in its folder {folder}" if folder else "at its top level"  # where it was looked for (--subfolder)

    def ending(suffix: str) -> list[str]:
        return [name for name in top if name.endswith(suffix)]

    gguf = ending(".gguf")
    every_gguf = sorted(name for name in repo_files if name.endswith(".gguf"))
    if gguf_file in every_gguf and is_split_shard(gguf_file):  # refused before the shard is downloaded
        # its own set's shards only: a repo may hold several split quantisations side by side
        beside = [name for name in every_gguf if shard_name(name, 1) == shard_name(gguf_file, 1)]
        raise ThinkerError(
            f"{label} holds {split_gguf([folder + name for name in beside])} (download them all to merge them)"
        )
    if gguf_file is not None:
        if gguf_file not in gguf:
            raise ThinkerError(f"{label} has no GGUF file {gguf_file!r} {level}; {_ggufs_held(gguf)}")
        weights = [gguf_file]
    else:
        safetensors = ending(".safetensors")
        named = [name for name in safetensors if TRANSFORMERS_WEIGHTS.fullmatch(name)]
        # a .bin named otherwise is no checkpoint (training_args.bin, imatrix.bin beside a GGUF)
        bins = [name for name in ending(".bin") if TRANSFORMERS_WEIGHTS.fullmatch(name)]
        if WHOLE_SAFETENSORS not in top and SAFETENSORS_INDEX not in top and {WHOLE_BIN, BIN_INDEX} & set(top):
            weights = bins  # transformers loads pytorch_model.bin (or its index) before other safetensors names
        else:
            weights = named or safetensors or bins
        for whole, _ in LOAD_ORDER:
            if whole in weights:  # transformers reads the whole file alone, before an index and shards beside it
                weights = [whole]
    if not weights and (split := split_gguf([folder + name for name in gguf or every_gguf])):  # here or in a folder
        raise ThinkerError(f"{label} holds {split} (download them all to merge them)")
    if not weights:
        if len(gguf) > 1:  # every GGUF of the repo listed, a quantisation's folder's too
            held = f"pick one with --gguf-file: {_ggufs_held(every_gguf)}"
            raise ThinkerError(f"{label} holds {len(every_gguf)} GGUF files; {held}")
        weights = gguf
    if not weights:
        held = _nested(repo_files, label, folder)
        raise ThinkerError(f"{label} has no .safetensors, .bin or .gguf weights {level}; {held}")
    if all(name.endswith(".gguf") for name in weights):
        side_files = [name for name in top if name in _GGUF_SIDE_FILES]
    elif "config.json" not in top:  # known from the listing: refused before gigabytes of weights come down
        if ADAPTER_CONFIG in top:
            raise peft_adapter_error(f"{label} holds {ADAPTER_CONFIG} and no config.json")
        raise ThinkerError(
            f"{label} has no config.json {level}, which says which model its weights ({_listed(weights)}) "
            "belong to; check the repo id and revision (a GGUF repo needs none: its file's metadata is the config)"
        )
    else:
        side_files = [n for n in top if n in _SIDE_FILES] + [n for n in repo_files if is_tokenizer_file(n)]
    # the one index read: the taken format's, unless its whole file is taken (another format's would send
    # _resolve_repo to shards transformers does not load)
    read = {index for whole, index in LOAD_ORDER if whole not in weights and any(_of_format(n, whole) for n in weights)}
    side_files = [name for name in side_files if name not in _INDEXES or name in read]
    return sorted(set(weights) | set(side_files))


def _of_format(name: str, whole: str) -> bool:
    """Whether the weights file ``name`` is of the format whose whole file is ``whole`` (by its suffix)."""
    return name.endswith(Path(whole).suffix)


def _nested(repo_files: Iterable[str], label: str, folder: str = "") -> str:
    """What to do when a repo's weights are not at its top level: name the folders that hold some (GGUF repos keep
    a quantisation per folder, others ``original/`` or a component's folder), or say to check the id. ``folder``:
    where ``repo_files`` lie in the repo (a ``subfolder``), so that the download advice names the repo's paths."""
    nested = sorted(name for name in repo_files if "/" in name and name.endswith((".safetensors", ".bin", ".gguf")))
    ggufs = [name for name in nested if name.endswith(".gguf")]
    if ggufs:
        return f"its folders hold {_listed(ggufs)}: name one with --gguf-file"
    folders = sorted({folder + name.rpartition("/")[0] for name in nested})
    if not folders:
        return "check the repo id and revision, or download the files yourself and pass the folder"
    shown = _listed([f"{name}/" for name in folders])
    return f"its folders {shown} hold weights: name the one to convert with --subfolder {shlex.quote(folders[0])}"


def _folders_held(files: list[str]) -> str:
    """The advice for a ``subfolder`` the repo's listing lacks: its top-level folders, named to choose from."""
    folders = sorted({name.partition("/")[0] for name in files if "/" in name})
    return f"check the subfolder name (its folders: {_listed([f'{folder}/' for folder in folders]) or 'none'})"


def _ggufs_held(names: list[str]) -> str:
    return f"the GGUF files there: {_listed(names)}" if names else "there are no GGUF files there"


def _listed(names: list[str], most: int = 6) -> str:
    """``names`` for a message: the first ``most``, then how many in all."""
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def refuse_empty_source(source: str | Path) -> None:
    """``Path("")`` is the working directory, which a user who passed an empty SOURCE (an unset shell variable) did
    not name: refused before anything reads or writes there."""
    if not str(source).strip():
        raise ThinkerError("SOURCE is empty; give a model folder, a weights file or a Hub repo id")


def resolve_source(
    source: str,
    revision: str | None = None,
    *,
    gguf_file: str | None = None,
    allow_patterns: list[str] | None = None,
    token: str | bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    force_download: bool = False,
    subfolder: str | None = None,
    progress: bool = True,
) -> Path:
    """A local folder or file for ``source``: the path itself if it exists, else a Hub snapshot in the cache.

    ``revision`` (branch, tag or commit hash, default ``main``) and ``allow_patterns`` (fnmatch patterns; default:
    ``pick_conversion_files``) only apply to repo ids. ``token`` defaults to huggingface_hub's own lookup
    (``HF_TOKEN``, then the ``hf auth login`` token file); ``cache_dir`` to ``HF_HUB_CACHE``; ``local_files_only``
    uses the cache alone, as ``HF_HUB_OFFLINE=1`` does; ``force_download`` fetches again what is cached;
    ``subfolder`` is the checkpoint's folder inside the repo (or the local folder); ``gguf_file`` the GGUF file to
    take in it, of several (the path of that file is returned). These are the Hub arguments of transformers'
    ``from_pretrained``, with the same meaning. ``progress=False`` hides huggingface_hub's bars.
    """
    refuse_empty_source(source)
    subfolder = asked_in = normal_subfolder(subfolder)  # asked_in: --subfolder, before --gguf-file's folder joins it
    if gguf_file is not None:
        gguf_file, subfolder = _split_gguf_path(gguf_file, subfolder)
    local = Path(source).expanduser()
    if local.exists():
        if revision is not None:
            raise ThinkerError(f"{source}: a revision ({revision!r}) only applies to Hub repo ids, not local paths")
        return _gguf_in(_in_subfolder(local, subfolder, source), gguf_file, source)
    if not is_repo_id(source):
        repo, at, rev = source.rpartition("@")
        if at and rev and is_repo_id(repo):  # the form this tool's own messages name a revision in
            raise ThinkerError(f"{source}: give the revision as an option: {repo} --revision {rev}")
        raise ThinkerError(f"{source}: no such folder, and not a Hub repo id ('name' or 'owner/name'); check the path")
    first = Path(source.split("/")[0]).expanduser()
    if "/" in source and (first.exists() or first.is_symlink()):
        # "ckpt/qwen33" where ./ckpt exists is a local path with a typo, not a Hub repo (which would only fail later,
        # with a network error, or download some stranger's model of that name).
        raise ThinkerError(
            f"{source}: no such folder ({first} exists here, {source} does not); check the path (a Hub repo id "
            f"spelled like a local path is not tried while {first} exists)"
        )
    _refuse_a_file_for_a_folder(cache_dir)
    hub = _HubOptions(token, cache_dir, local_files_only, force_download, subfolder or "", gguf_file, asked_in)
    label = f"{source}@{revision or constants.DEFAULT_REVISION}"
    snapshot = _resolve_repo(source, revision or constants.DEFAULT_REVISION, allow_patterns, hub, progress)
    return _gguf_in(_in_subfolder(snapshot, hub.subfolder, label), gguf_file, label)


def _refuse_a_file_for_a_folder(cache_dir: str | Path | None) -> None:
    """huggingface_hub keeps its token and cache in folders (``HF_HOME``, ``HF_HUB_CACHE``, ``cache_dir``): one that
    is a file, or lies under one, is named with the variable that set it, where huggingface_hub's own error names
    only a path inside it ("HF_HOME/token: Not a directory")."""
    places = {"HF_HOME": os.environ.get("HF_HOME"), "HF_HUB_CACHE": os.environ.get("HF_HUB_CACHE")}
    places["cache_dir"] = str(cache_dir) if cache_dir is not None else None
    for name, value in places.items():
        if not value:
            continue
        path = Path(value).expanduser()
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ThinkerError(
                f"{name}={value}: {existing} is a file, where huggingface_hub keeps its token and downloads in a "
                f"folder; point {name} at a folder (or unset it)"
            )


def normal_subfolder(subfolder: str | None) -> str:
    """``subfolder`` as a path inside SOURCE, the same for every spelling of it (``text/``, ``/text``, ``./text``,
    ``a//text``: ``text``, ``a/text``; ``/`` or ``""``: SOURCE itself, ``""``). A ``..`` is refused: the folder is
    one of SOURCE's, as on the Hub, whose paths have no way out of the repo."""
    parts = [part for part in (subfolder or "").split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ThinkerError(
            f"--subfolder {subfolder!r}: a folder inside SOURCE, named by its path there (text, or parts/text), "
            "without '..'; to convert a folder elsewhere, give that folder as SOURCE"
        )
    return "/".join(parts)


def local_checkpoint(source: str | Path, subfolder: str | None) -> str | Path:
    """Where SOURCE's checkpoint lies when SOURCE is a local folder (its ``subfolder``), for the checks of OUTPUT
    made before any work; SOURCE itself otherwise (a Hub repo id names no local path, whatever its subfolder)."""
    path = Path(source).expanduser()
    return path / normal_subfolder(subfolder) if subfolder and path.is_dir() else source


def _split_gguf_path(gguf_file: str, subfolder: str | None) -> tuple[str, str | None]:
    """``--gguf-file`` as a file name and the folder it lies in: many GGUF repos keep each quantisation in a folder
    of its own (``Q4_K_M/model-Q4_K_M.gguf``), so a path inside SOURCE is taken too, its folder joined to
    ``subfolder``."""
    folder, _, name = gguf_file.replace("\\", "/").rpartition("/")
    parts = [part for part in folder.split("/") if part]
    if not name.endswith(".gguf") or name.startswith(".") or gguf_file.startswith("/") or ".." in parts:
        raise ThinkerError(
            f"--gguf-file {gguf_file!r}: give a .gguf file's name, or its path inside SOURCE (a folder of the repo: "
            "Q4_K_M/model-Q4_K_M.gguf)"
        )
    if parts:
        subfolder = "/".join([*filter(None, [(subfolder or "").strip("/")]), *parts])
    return name, subfolder


@dataclass(frozen=True)
class _HubOptions:
    token: str | bool | None
    cache_dir: str | Path | None
    local_files_only: bool
    force_download: bool
    subfolder: str
    gguf_file: str | None = None
    asked_in: str = ""  # the subfolder the user named; ``subfolder`` adds the folder of a --gguf-file path to it


def _in_subfolder(folder: Path, subfolder: str | None, label: str) -> Path:
    if not subfolder:
        return folder
    if not folder.is_dir():
        raise ThinkerError(f"{label}: --subfolder picks a folder in a folder or a Hub repo; SOURCE is already a file")
    path = folder / subfolder
    if not path.exists():
        raise ThinkerError(f"{label}: no subfolder {subfolder!r} in {folder}; check the subfolder name")
    return path


def _gguf_in(path: Path, gguf_file: str | None, label: str) -> Path:
    """The GGUF file ``gguf_file`` names in the folder ``path`` (``path`` itself when none is named)."""
    if gguf_file is None:
        return path
    if not path.is_dir():
        raise ThinkerError(f"{label}: --gguf-file picks a file in a folder or a Hub repo; SOURCE is already a file")
    file = path / gguf_file
    if not file.is_file():
        held = sorted(entry.relative_to(path).as_posix() for entry in path.glob("**/*.gguf"))
        raise ThinkerError(f"{label}: no GGUF file {gguf_file!r} in {path}; {_ggufs_held(held)}")
    # by the rule for every file of a source folder: a link out of it is refused, as it was when the folder's only
    # GGUF was found without --gguf-file, which read the same link (helper-251)
    return checked_file(file, path)


def _resolve_repo(
    repo_id: str, revision: str, allow_patterns: list[str] | None, hub: _HubOptions, progress: bool
) -> Path:
    label = f"{repo_id}@{revision}"
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    cache_dir = Path(hub.cache_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()
    offline = _offline() or hub.local_files_only
    token = hub.token

    # The file listing picks what to download. Online it comes from the Hub; offline, or when the Hub cannot be
    # reached, from the listing huggingface_hub cached with the snapshot, so the same files are chosen either way
    # (and huggingface_hub can then tell a complete cached snapshot from a partial one).
    files: list[str] | None = None
    unreachable: Exception | None = None
    pinned = revision  # what the downloads ask for: the listing's commit once the Hub has named it
    if not offline:
        try:
            pinned, files = _remote_listing(repo_id, revision, endpoint, token)
            _record_ref(cache_dir, repo_id, revision, pinned)
        except HfHubHTTPError as err:
            # A definite "no" from the Hub (missing repo or revision, gated, bad token) is reported, not papered
            # over with a stale cached copy; an overloaded or failing Hub falls back to the cache.
            if _status(err) not in _TRANSIENT_STATUS:
                raise _explain(err, repo_id, label, endpoint, cache_dir) from None
            unreachable = err
        except _NETWORK_ERRORS as err:
            unreachable = err
    listed = True  # False: the names are a cached snapshot's, which may hold only some of the repo's files
    if files is None:
        pinned = _cached_commit(repo_id, revision, cache_dir) or revision
        files, listed = _cached_listing(repo_id, pinned, cache_dir)
        if files is None:
            raise _not_cached(repo_id, label, endpoint, cache_dir, offline, hub.local_files_only, unreachable)

    index = None  # the shard index among the files picked, read first: the shards it names are the weights
    prefix = f"{hub.subfolder}/" if hub.subfolder else ""
    if allow_patterns is None:
        if hub.gguf_file is not None and prefix + hub.gguf_file not in files:
            # Named wherever the repo (or the subfolder) keeps them, by the path --gguf-file takes: GGUF repos often
            # hold each quantisation in a folder of its own.
            base = f"{hub.asked_in}/" if hub.asked_in else ""
            held = sorted(name.removeprefix(base) for name in files if name.startswith(base) and name.endswith(".gguf"))
            asked = (prefix + hub.gguf_file).removeprefix(base)
            where = f"{asked!r} in its folder {base}" if base else repr(asked)
            raise ThinkerError(f"{label} has no GGUF file {where}; {_ggufs_held(held)}")
        inside = [name.removeprefix(prefix) for name in files if name.startswith(prefix)]
        if not inside and listed:  # named here: else the empty listing reads as a repo without weights
            raise ThinkerError(f"{label}: no subfolder {hub.subfolder!r} in the repo; {_folders_held(files)}")
        if not inside:
            closed = _hub_closed(offline, hub.local_files_only, endpoint, unreachable)
            raise ThinkerError(
                f"{label}: no subfolder {hub.subfolder!r} in the cached snapshot, which was filled file by file and "
                f"may lack folders the repo holds, and {closed}; run once online to fetch it"
            )
        picked = pick_conversion_files(inside, label, hub.gguf_file, prefix)
        gguf = next((name for name in picked if name.endswith(".gguf")), None)
        if gguf is not None and hub.gguf_file is None and not listed:
            # Online, a repo of several GGUF files is refused until one is named; a snapshot cached file by file
            # cannot tell, and converting the one it holds would pick the quantisation by what was downloaded.
            raise ThinkerError(
                f"{label}: the cache holds {gguf} but no listing of the repo's files (filled file by file), so "
                f"whether the repo holds other GGUF files is unknown offline; name it: --gguf-file {gguf}"
            )
        allow_patterns = [glob.escape(prefix + name) for name in picked]
        if prefix:  # a folder of the repo: the card and license at the repo's top cover it (its own, if any, win)
            covering = [name for name in files if name in (CARD_FILE, *LICENSE_FILES)]
            if offline or unreachable is not None:  # the cache alone: taken where it holds them, never asked for
                snapshot = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / pinned
                covering = [name for name in covering if (snapshot / name).is_file()]
            allow_patterns += [glob.escape(name) for name in covering]
        index = next((name for name in _INDEXES if name in picked), None)
    for name in filter_repo_objects(files, allow_patterns=allow_patterns):
        _check_file_name(name, label)

    def download(patterns: list[str]) -> Path:
        return Path(
            snapshot_download(
                repo_id,
                revision=pinned,
                allow_patterns=patterns,
                cache_dir=cache_dir,
                endpoint=endpoint,
                token=token,
                force_download=hub.force_download,
                # Files from the cache's listing: the Hub is off limits or out of reach, so do not try it again.
                local_files_only=offline or unreachable is not None,
                tqdm_class=None if progress else _NoProgress,
            )
        )

    try:
        if index is not None:  # the index first: shards it does not name (an older set left beside) are not fetched
            named = _indexed_shards(download([glob.escape(prefix + index)]) / prefix / index, inside, label)
            shards = sorted(glob.escape(prefix + name) for name in named)
            allow_patterns = [p for p in allow_patterns if not p.endswith(_WEIGHT_SUFFIXES)] + shards
        folder = download(allow_patterns)
    except IncompleteSnapshotError as err:
        snapshot = Path(err.snapshot_path)
        wanted = filter_repo_objects(files, allow_patterns=allow_patterns)
        missing = [name for name in wanted if not os.path.isfile(snapshot / name)]  # a link to a deleted blob too
        shown = f" ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})" if missing else ""
        raise ThinkerError(
            f"{label}: the cached snapshot at {err.snapshot_path} is missing files{shown} and "
            f"{_hub_closed(offline, hub.local_files_only, endpoint, unreachable)}; run once online to complete it"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        refused = _refusal_within(err)
        if refused is not None:  # a file's download refused (a token without access, a proxy), not the network
            raise _explain(refused, repo_id, label, endpoint, cache_dir) from None
        # the Hub's own failure where the listing already met one (the files were then sought in the cache alone)
        why = unreachable or err.__cause__ or err
        raise _not_cached(repo_id, label, endpoint, cache_dir, offline, hub.local_files_only, why) from None
    except HfHubHTTPError as err:
        raise _explain(err, repo_id, label, endpoint, cache_dir) from None
    except (*_NETWORK_ERRORS, RecursionError) as err:  # the connection dropped in the middle of a download
        # RecursionError: huggingface_hub retries a cut download by calling itself, with its count of retries
        # reset by every chunk that arrives, so an endpoint that cuts each try after some bytes (a proxy that
        # ignores Range) ends in the recursion limit rather than its own error
        why = "cut on every try" if isinstance(err, RecursionError) else f"{type(err).__name__}: {_first_line(err)}"
        slow = ""
        if isinstance(err, (_httpx.TimeoutException, TimeoutError)):  # no byte for HF_HUB_DOWNLOAD_TIMEOUT seconds
            slow = f" (a slow link or mirror: raise HF_HUB_DOWNLOAD_TIMEOUT, now {constants.HF_HUB_DOWNLOAD_TIMEOUT} s)"
        raise ThinkerError(
            f"{label}: the connection to the Hub at {endpoint} dropped during the download ({why}); the files "
            f"fetched whole stay in the cache at {cache_dir}, and running the command again fetches the rest{slow}"
        ) from None
    except OSError as err:  # a full disk, an unwritable cache, a size mismatch after download
        raise ThinkerError(
            f"{label}: download into {cache_dir} failed ({_first_line(err)}); fix that and retry"
        ) from None
    snapshot = folder
    _check_snapshot(snapshot, cache_dir, repo_id, label)
    if unreachable is not None and not _COMMIT_HASH.fullmatch(pinned):
        # A branch or tag moves: what the cache holds may be older than what the Hub serves now.
        _log.warning(
            "%s: the Hub at %s cannot be reached%s; using the cached snapshot, commit %s, which may be older than "
            "what %s names on the Hub now",
            label, endpoint, _reason(unreachable), snapshot.name[:12], revision,
        )  # fmt: skip
    return snapshot


_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _indexed_shards(index_path: Path, listing: list[str], label: str) -> list[str]:
    """The shard names a downloaded index maps tensors to, each checked to be in the repo's ``listing``: a name
    it lacks is a broken upload, which no retry or re-download mends."""
    weight_map = read_json(index_path)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ThinkerError(f"{label}: its {index_path.name} has no weight_map of tensor names to shard files")
    named = sorted(set(weight_map.values()))
    absent = [name for name in named if name not in listing]
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise ThinkerError(
            f"{label}: its {index_path.name} names shard {absent[0]!r}{more}, which the repo does not hold (an upload "
            "left incomplete); try another revision (--revision), or ask the repo's owner to upload it"
        )
    return named


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or now.upper() in _TRUE_VALUES


def _offline_switches(local_files_only: bool) -> tuple[str, str]:
    """What keeps the Hub unasked, and how to lift it, naming every switch that does, so that one round of advice
    is enough: the variables as huggingface_hub reads them (HF_HUB_OFFLINE when set, to any value, else
    TRANSFORMERS_OFFLINE), one it read at import and keeps though unset since, and ``local_files_only``."""
    hub_value = os.environ.get("HF_HUB_OFFLINE") or ""
    named = [f"HF_HUB_OFFLINE={hub_value}"] if hub_value.upper() in _TRUE_VALUES else []
    transformers_value = os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if transformers_value.upper() in _TRUE_VALUES and (not hub_value or named):  # read once HF_HUB_OFFLINE is gone
        named.append(f"TRANSFORMERS_OFFLINE={transformers_value}")
    said = list(named)
    undo = [f"unset {' and '.join(name.partition('=')[0] for name in named)}"] if named else []
    if not named and constants.is_offline_mode():
        said.append("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) was set when huggingface_hub was imported")
        undo.append("start Python again without it")
    if local_files_only:
        said.append("local_files_only=True")
        undo.append("pass local_files_only=False")
    return " and ".join(said), " and ".join(undo)


def _hub_closed(offline: bool, local_files_only: bool, endpoint: str, unreachable: BaseException | None) -> str:
    """Why the Hub was not asked: the switches that keep it off limits, or the failure that left it out of reach."""
    if offline:
        return f"the Hub is off limits ({_offline_switches(local_files_only)[0]})"
    return f"the Hub at {endpoint} cannot be reached{_reason(unreachable)}"


def _remote_listing(repo_id: str, revision: str, endpoint: str, token: str | bool | None) -> tuple[str, list[str]]:
    """The commit ``revision`` names now and every file name of the repo there, from one model-info call (its
    ``sha`` and ``siblings``). Every download then asks for that commit: a branch pushed to between the listing,
    the shard index and the shards cannot mix two commits, and huggingface_hub need not ask the Hub again."""
    api = HfApi(endpoint=endpoint, token=token)
    # huggingface_hub's client waits forever by default: an endpoint that takes the connection and never answers
    # would hang the command, cached snapshot or not. Its metadata timeout (HF_HUB_ETAG_TIMEOUT, 10 s) ends the
    # wait as "unreachable", which falls back to the cache.
    info = api.model_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    commit = info.sha if info.sha and _COMMIT_HASH.fullmatch(info.sha) else revision  # a mirror may leave it out
    if info.siblings is None:  # not expected from the Hub, but a mirror may leave it out
        return commit, api.list_repo_files(repo_id, revision=commit)
    return commit, [sibling.rfilename for sibling in info.siblings]


def _record_ref(cache_dir: Path, repo_id: str, revision: str, commit: str) -> None:
    """Write ``refs/<revision>`` in the cache as huggingface_hub does, so that an offline run (or one that cannot
    reach the Hub) finds this snapshot by its branch or tag name.

    snapshot_download records the ref only when it resolves the branch itself, and here it is handed the commit.
    ``HfApi.resolve_revision`` would record it but takes no timeout (a stalled endpoint would hang it), so the
    ref is written here: one file holding the commit hash, replaced atomically."""
    if revision == commit:
        return
    ref = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
        partial.write_text(commit)
        os.replace(partial, ref)
    except OSError as err:  # a read-only cache: the download itself will say so if it matters
        _log.debug("could not record %s -> %s in the cache: %s", revision, commit, err)


def _cached_commit(repo_id: str, revision: str, cache_dir: Path) -> str | None:
    """The cached snapshot a commit hash's prefix names, without the Hub (which resolves prefixes online): the one
    snapshot whose commit starts with ``revision``, unless a ref of that name exists (a branch or tag wins, as
    online); None where none matches, and refused, naming them, where several do (the Hub would refuse it too)."""
    folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not re.fullmatch(r"[0-9a-f]{7,39}", revision) or (folder / "refs" / revision).is_file():
        return None
    try:
        matches = [entry.name for entry in (folder / "snapshots").iterdir() if entry.name.startswith(revision)]
    except OSError:
        return None
    if len(matches) > 1:
        shown = ", ".join(sorted(match[:12] for match in matches))
        raise ThinkerError(
            f"{repo_id}@{revision} matches {len(matches)} cached commits ({shown}); give more of the commit hash"
        )
    return matches[0] if matches else None


def _cached_listing(repo_id: str, revision: str, cache_dir: Path) -> tuple[list[str] | None, bool]:
    """The file names huggingface_hub cached with an earlier download of ``revision`` (and True: the repo's whole
    listing), else the files its cached snapshot holds (and False: a cache filled file by file, as transformers'
    from_pretrained fills it, keeps no listing, and its snapshot holds what that load read); None if neither."""
    try:
        return [entry.path for entry in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)], True
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        pass
    folder = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    try:
        commit = revision if _COMMIT_HASH.fullmatch(revision) else (folder / "refs" / revision).read_text().strip()
    except (OSError, ValueError):
        return None, False
    snapshot = folder / "snapshots" / commit
    if not _COMMIT_HASH.fullmatch(commit) or not snapshot.is_dir():
        return None, False
    held = sorted(str(path.relative_to(snapshot).as_posix()) for path in snapshot.rglob("*") if not path.is_dir())
    return held, False


def _check_file_name(name: str, label: str) -> None:
    """Refuse a repo file name that would land outside the snapshot folder once joined onto it.

    huggingface_hub refuses these too (``_validate_relative_filename``); checking here as well keeps the guarantee
    independent of its version and fails before anything is downloaded. Both POSIX and Windows rules are applied
    because the cache may later be read on either.
    """
    parts = name.replace("\\", "/").split("/")
    if ".." in parts or PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        raise ThinkerError(f"{label}: repo file name {name!r} would escape the download folder; refusing the repo")


def _check_snapshot(snapshot: Path, cache_dir: Path, repo_id: str, label: str) -> None:
    """Refuse a snapshot that is not where the cache layout says, or whose files lead out of the cache.

    Cached files are symlinks from ``snapshots/<commit>/`` into ``blobs/`` (the repo's, or the cache-wide shared
    store), so "inside" means: the entry's own path lies in the snapshot folder, and what it resolves to lies in
    the cache. A commit hash or ETag sent by a hostile HF_ENDPOINT, or a tampered cache, fails this check.
    """
    cache_root = cache_dir.resolve()
    expected_parent = cache_root / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if Path(os.path.abspath(snapshot)).parent != expected_parent or not _COMMIT_HASH.fullmatch(snapshot.name):
        raise ThinkerError(f"{label}: snapshot folder {snapshot} is not under {expected_parent}; refusing it")
    for folder, dir_names, file_names in os.walk(snapshot):  # does not descend into symlinked folders
        for name in dir_names + file_names:
            entry = Path(folder, name)
            target = entry.resolve()
            if cache_root != target and cache_root not in target.parents:
                raise ThinkerError(
                    f"{label}: cached file {entry.relative_to(snapshot)} points outside the cache {cache_root} "
                    f"(to {target}); delete {expected_parent.parent} and download again"
                )


def _refusal_within(err: BaseException) -> HfHubHTTPError | None:
    """The HTTP refusal (401, 403, 404) huggingface_hub wrapped as "not found locally", if that is what ``err``
    holds: snapshot_download reports a file download's error so when the file is not cached either."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, HfHubHTTPError) and _status(err) in (401, 403, 404):
            return err
        err = err.__cause__ or err.__context__
    return None


def _status(err: HfHubHTTPError) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _reason(err: BaseException | None) -> str:
    """`` (Type: first line)`` of ``err``, said after what failed; nothing for None."""
    return f" ({type(err).__name__}: {_first_line(err)})" if err is not None else ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _not_cached(
    repo_id: str,
    label: str,
    endpoint: str,
    cache_dir: Path,
    offline: bool,
    local_files_only: bool,
    reason: BaseException | None,
) -> ThinkerError:
    """Nothing usable in the cache, and the Hub is off limits (offline) or out of reach."""
    if offline:
        switch, undo = _offline_switches(local_files_only)
        return ThinkerError(
            f"{label} is not in the cache at {cache_dir} and {switch}; run once online or {undo}{_not_local(repo_id)}"
        )
    why = _reason(reason)
    return ThinkerError(
        f"cannot reach the Hub at {endpoint} to fetch {label}{why}, and it is not in the cache at {cache_dir}; "
        "check the network, set HF_ENDPOINT to a reachable mirror, or run once online and then use "
        f"HF_HUB_OFFLINE=1{_not_local(repo_id)}"
    )


def _not_local(repo_id: str) -> str:
    """What to add where a repo id found nothing on the Hub: that no local path of that name exists either, and the
    entries here (or in the id's first folder) spelled closest to it, since SOURCE is more often a mistyped local
    path ("qwen3-06b" for ./qwen3-0.6b) than a Hub id the user meant to try."""
    parent, name = (Path(repo_id).parent, Path(repo_id).name) if "/" in repo_id else (Path("."), repo_id)
    try:
        entries = [entry.name for entry in parent.iterdir()] if parent.is_dir() else []
    except OSError:
        entries = []
    close = difflib.get_close_matches(name, entries, n=2, cutoff=0.75)
    shown = " or ".join(str(parent / entry) if "/" in repo_id else f"./{entry}" for entry in close)
    return f"; no local path {repo_id!r} exists either" + (f" (did you mean {shown}?)" if close else "")


def _explain(err: HfHubHTTPError, repo_id: str, label: str, endpoint: str, cache_dir: Path) -> ThinkerError:
    """A one-line, actionable message for an HTTP error from the Hub (or HF_ENDPOINT)."""
    status = _status(err)
    if isinstance(err, RevisionNotFoundError):
        return ThinkerError(
            f"{label}: revision not found in {repo_id} on {endpoint}; pass an existing branch, tag or commit hash"
        )
    if isinstance(err, GatedRepoError):
        return ThinkerError(
            f"{label}: {repo_id} is a gated repo and access was refused (HTTP {status}); accept its terms at "
            f"{endpoint}/{repo_id} and set HF_TOKEN to a token of that account"
        )
    if isinstance(err, RepositoryNotFoundError):
        return ThinkerError(
            f"{label}: repo not found on {endpoint} (or it is private and no valid token was sent); check the repo id, "
            f"or set HF_TOKEN if it is private{_not_local(repo_id)}"
        )
    if isinstance(err, RemoteEntryNotFoundError):
        # huggingface_hub's first line is "404 Client Error."; the file is in the URL of a later one
        url = re.search(r"for url: (\S+?)\.?$", str(err), re.MULTILINE)
        missing = url.group(1).rsplit("/resolve/", 1)[-1].split("/", 1)[-1] if url else _first_line(err)
        return ThinkerError(f"{label}: a listed file is missing on {endpoint} ({missing}); retry later")
    if status == 401:
        return ThinkerError(f"{label}: the Hub at {endpoint} refused the token (HTTP 401); set HF_TOKEN to a valid one")
    if status == 403:
        return ThinkerError(
            f"{label}: the token has no access to {repo_id} (HTTP 403); use a token with read access (HF_TOKEN)"
        )
    return ThinkerError(
        f"{label}: the Hub at {endpoint} answered HTTP {status} ({_first_line(err)}); retry later, or use the cache "
        f"at {cache_dir} with HF_HUB_OFFLINE=1"
    )
