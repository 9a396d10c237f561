"""transformers' own common model tests (``ModelTesterMixin`` and the mixins beside it), for the installed version.

They are not in transformers' wheel. Its source distribution on PyPI ships the top level of its ``tests`` folder
(``test_modeling_common.py``, ``test_configuration_common.py``, ``test_pipeline_mixin.py``,
``test_tensor_parallel_mixin.py`` ...), so ``common_tests()`` downloads that sdist with pip once per version into
``~/.cache/thinker-transformers-tests/<version>/`` (``$THINKER_TRANSFORMERS_TESTS_CACHE`` moves it), keeps only its
``tests`` folder, and imports that folder as the package ``transformers_common_tests``. Nothing of it is copied
into this repository.

The sdist leaves out the subfolders that those modules import: ``generation/test_utils.py``
(``GenerationTesterMixin``), ``exporters/test_export.py`` (``ExportTesterMixin``, ``torch.export`` checks),
``distributed_testing_utils.py`` (multi-process launches) and ``utils/test_configuration_utils.py`` (the common
config kwargs). Each one that is missing is replaced by a stand-in (``STAND_INS``) so that the rest imports: the
two mixins become empty classes, so their tests are not run (``tests/test_transformers_conformance.py`` checks what
the issue asked of generation itself); ``run_distributed`` is written here to the helper's contract; the config
kwargs are a small set chosen here. Point ``$THINKER_TRANSFORMERS_TESTS`` at the ``tests`` folder of a transformers
source tree of the installed version (a git checkout of its tag) to run the real ones: stand-ins then only fill what
that folder lacks, and ``uses_stand_in(name)`` says which were used.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers
from filelock import FileLock

PACKAGE = "transformers_common_tests"
CACHE_ROOT = Path(os.environ.get("THINKER_TRANSFORMERS_TESTS_CACHE", Path.home() / ".cache/thinker-transformers-tests"))


def _export_stand_in(module: types.ModuleType) -> None:
    class ExportTesterMixin:
        """Stand-in: the sdist does not ship tests/exporters/test_export.py."""

    module.ExportTesterMixin = ExportTesterMixin


def _generation_stand_in(module: types.ModuleType) -> None:
    class GenerationTesterMixin:
        """Stand-in: the sdist does not ship tests/generation/test_utils.py."""

    module.GenerationTesterMixin = GenerationTesterMixin


def _distributed_stand_in(module: types.ModuleType) -> None:
    module.run_distributed = run_distributed


def run_distributed(world_size: int):
    """``run_distributed(world_size)(fn)(*args)`` runs ``fn(rank, *args)`` in ``world_size`` fresh processes, each in
    a gloo process group on 127.0.0.1, and raises if any rank fails: the contract of transformers' own helper (in
    tests/distributed_testing_utils.py, not in the sdist), written here."""

    def launch(fn):
        def run(*args) -> None:
            import torch.multiprocessing as mp

            with socket.socket() as probe:  # a free port for the rendezvous
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            target = (fn.__module__, fn.__qualname__)
            mp.spawn(_rank_main, args=(world_size, port, str(tests_folder()), target, args), nprocs=world_size)

        return run

    return launch


def _rank_main(rank: int, world_size: int, port: int, folder: str, target: tuple[str, str], args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    _install_package(Path(folder))
    module, name = target
    fn = getattr(importlib.import_module(module), name)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _config_kwargs_stand_in(module: types.ModuleType) -> None:
    # Common PreTrainedConfig arguments with values other than their defaults; ConfigTester checks that a config
    # built with them keeps each one (dtype is compared as torch.float16).
    module.config_common_kwargs = {
        "return_dict": False,
        "output_hidden_states": True,
        "dtype": "float16",
        "id2label": {0: "negative", 1: "positive"},
        "label2id": {"negative": 0, "positive": 1},
        "problem_type": "single_label_classification",
        "chunk_size_feed_forward": 5,
        "architectures": ["ThinkerForCausalLM"],
        "tie_word_embeddings": True,
        "bos_token_id": 3,
        "eos_token_id": 4,
        "pad_token_id": 5,
    }


# module (relative to the tests folder) -> what fills it in when the folder lacks it
STAND_INS = {
    "exporters.test_export": _export_stand_in,
    "generation.test_utils": _generation_stand_in,
    "distributed_testing_utils": _distributed_stand_in,
    "utils.test_configuration_utils": _config_kwargs_stand_in,
}
_used_stand_ins: set[str] = set()


def sdist_tests_folder(version: str = transformers.__version__) -> Path:
    """The ``tests`` folder of transformers' sdist for ``version``, downloaded with pip on first use."""
    target = CACHE_ROOT / version / "tests"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / "download.lock"):  # xdist workers download it once between them
        return _downloaded(version, target)


def _downloaded(version: str, target: Path) -> Path:
    if (target / "test_modeling_common.py").is_file():
        _add_stand_in_files(target.parent)
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        staging = Path(staging)
        command = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-deps"]
        command += ["--no-binary", ":all:", "--quiet", "--dest", str(staging / "download")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"pip could not download transformers=={version}'s sdist:\n{result.stderr[-2000:]}")
        (archive,) = (staging / "download").glob("transformers-*.tar.gz")
        prefix = f"{archive.name.removesuffix('.tar.gz')}/tests/"
        with tarfile.open(archive) as sdist:
            members = [m for m in sdist.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name.removeprefix(prefix.removesuffix("tests/"))
            sdist.extractall(staging / "unpacked", members=members, **_safe_extraction())
        _add_stand_in_files(staging / "unpacked")
        os.replace(staging / "unpacked" / "tests", target)  # whole or not at all
    _add_stand_in_files(target.parent)
    return target


def _add_stand_in_files(root: Path) -> None:
    """The files of transformers' source tree that the common tests read and the sdist lacks, as stand-ins: the
    empty ``tests/__init__.py`` (``direct_transformers_import`` executes it), an empty pipeline tiny-model summary
    (no Hub tiny models here: every pipeline test skips, as Qwen3's tester skips them all anyway), and an empty
    ``src/transformers/__init__.py``, so that the pipeline mixin's ``direct_transformers_import`` of the source tree
    returns the installed transformers."""
    for stand_in, text in (
        ("tests/__init__.py", ""),
        ("tests/utils/tiny_model_summary.json", "{}"),
        ("src/transformers/__init__.py", ""),
    ):
        if not (root / stand_in).exists():
            (root / stand_in).parent.mkdir(parents=True, exist_ok=True)
            (root / stand_in).write_text(text)


def _safe_extraction() -> dict:
    # tarfile's "data" filter (Python 3.12, backported to 3.10.12 / 3.11.4) refuses links and paths out of the folder.
    return {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def tests_folder() -> Path:
    if folder := os.environ.get("THINKER_TRANSFORMERS_TESTS"):
        if not (Path(folder) / "test_modeling_common.py").is_file():
            raise RuntimeError(f"THINKER_TRANSFORMERS_TESTS={folder} has no test_modeling_common.py")
        return Path(folder)
    return sdist_tests_folder()


def _install_package(folder: Path) -> None:
    if PACKAGE in sys.modules:
        return
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    package.__spec__ = importlib.util.spec_from_loader(PACKAGE, loader=None, is_package=True)
    package.__spec__.submodule_search_locations = [str(folder)]
    sys.modules[PACKAGE] = package
    for relative, fill in STAND_INS.items():
        if (folder / (relative.replace(".", "/") + ".py")).is_file():
            continue
        parts = relative.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join([PACKAGE, *parts[:depth]])
            if name in sys.modules:
                continue
            if depth < len(parts) and (folder / Path(*parts[:depth])).is_dir():
                importlib.import_module(name)  # a real subpackage of the folder that lacks only this module
                continue
            module = types.ModuleType(name)
            if depth < len(parts):
                module.__path__ = []
            sys.modules[name] = module
            setattr(sys.modules[name.rsplit(".", 1)[0]], parts[depth - 1], module)
        fill(sys.modules[f"{PACKAGE}.{relative}"])
        _used_stand_ins.add(relative)


def common_tests(module: str) -> types.ModuleType:
    """``common_tests("test_modeling_common")``: a module of transformers' common tests, imported from the sdist."""
    _install_package(tests_folder())
    return importlib.import_module(f"{PACKAGE}.{module}")


def uses_stand_in(module: str) -> bool:
    """Whether ``module`` (e.g. ``"generation.test_utils"``) is a stand-in rather than transformers' own."""
    return module in _used_stand_ins
