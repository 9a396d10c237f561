"""Fixtures for the export tests: tiny Thinker folders and their ONNX exports, built once per session; the
onnxruntime-genai virtual environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
from export_helpers import save_thinker
from filelock import FileLock

GENAI_VENV = Path(os.environ.get("THINKER_GENAI_VENV", Path.home() / ".cache" / "thinker-test-genai-venv"))
# The onnxruntime-genai versions the exported genai_config.json is written for: from 0.8 (where a config without an
# eos id stops at the pad id, as export/genai_config.py writes explicitly) to 0.18 (which refuses an eos id outside
# the vocabulary). Both ends were run on a no-eos export; the tests use the newest.
GENAI_PACKAGES = ["onnxruntime-genai>=0.8,<0.19", "numpy"]
# onnxruntime-genai's CUDA build (with the onnxruntime-gpu it needs), for the GPU tests only.
GENAI_CUDA_VENV = Path(
    os.environ.get("THINKER_GENAI_CUDA_VENV", Path.home() / ".cache" / "thinker-test-genai-cuda-venv")
)
GENAI_CUDA_PACKAGES = ["onnxruntime-genai-cuda>=0.8,<0.19", "numpy"]


@pytest.fixture(scope="session")
def thinker_folder(tmp_path_factory) -> Callable[..., Path]:
    """``thinker_folder(family)`` -> a saved random Thinker folder with a tokenizer (see export_helpers.FAMILIES),
    made once per session."""
    root = tmp_path_factory.mktemp("thinker")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_thinker(root / family, family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def onnx_folder(tmp_path_factory, thinker_folder) -> Callable[..., Path]:
    """``onnx_folder(family, dtype="float32")`` -> the plain-graph export (``--graph plain``; ``onnx_variant`` makes
    the fused ones, the default) of ``thinker_folder(family)`` (not verified: the tests check parity themselves),
    made once per session."""
    from export.exporter import export_model

    root = tmp_path_factory.mktemp("onnx")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = "float32") -> Path:
        if (family, dtype) not in cache:
            output = root / f"{family}-{dtype}"
            export_model(thinker_folder(family), output, dtype=dtype, graph="plain", verify=False)
            cache[family, dtype] = output
        return cache[family, dtype]

    return get


# The genai venv's build (or probe), started when collection ends (pytest_collection_finish), by venv folder.
_STARTED: dict[Path, Future] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the run holds a test that needs ``genai_python``, the venv's build starts now, in a thread, beside the
    tests that run before the first of those: on a fresh machine (CI) it is a venv and a pip install, 15-20 s that
    mostly wait on pip, which the first genai test used to wait for; where the venv exists, only its probe. It sees
    the session's environment as it was before any test ran (``genai_venv``'s ``env``)."""
    if session.config.option.collectonly or GENAI_VENV in _STARTED:
        return
    if any("genai_python" in getattr(item, "fixturenames", ()) for item in session.items):
        _STARTED[GENAI_VENV] = in_thread(genai_venv, GENAI_VENV, GENAI_PACKAGES, dict(os.environ))


def in_thread(function: Callable, *args) -> Future:
    """``function(*args)`` in a daemon thread; the Future holds what it returns or raises (``pytest.fail``'s
    exception too, re-raised by ``.result()`` in the test that waits for it)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as err:  # handed to the waiting test as it was raised
            future.set_exception(err)

    threading.Thread(target=run, name=f"start {getattr(function, '__name__', function)}", daemon=True).start()
    return future


@pytest.fixture(scope="session")
def genai_python() -> Path:
    """The Python of a virtual environment with onnxruntime-genai and the CPU onnxruntime it pulls in (which must
    not share an environment with onnxruntime-gpu). Built under ~/.cache on first use (THINKER_GENAI_VENV moves
    it), started when collection ends (``pytest_collection_finish``); a failure to build it fails the tests that
    need it, with pip's reason."""
    started = _STARTED.get(GENAI_VENV)
    return started.result() if started is not None else genai_venv(GENAI_VENV, GENAI_PACKAGES)


@pytest.fixture(scope="session")
def genai_cuda_python() -> Path:
    """As ``genai_python``, with onnxruntime-genai's CUDA build (THINKER_GENAI_CUDA_VENV moves it)."""
    return genai_venv(GENAI_CUDA_VENV, GENAI_CUDA_PACKAGES)


def genai_venv(venv: Path, packages: list[str], env: dict[str, str] | None = None) -> Path:
    """The venv's Python, built first where it has none. One that exists but fails the probe is rebuilt only at
    its default place: a venv named by THINKER_GENAI_VENV / THINKER_GENAI_CUDA_VENV is someone's own (the GPU
    kit's, bench/gpu_kit.py), and fails the test instead of being cleared. ``env``: the environment to read and run
    in (default: the current one)."""
    env = dict(os.environ) if env is None else env
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{venv}.lock"):  # xdist workers build it once between them, not over each other
        return _built_venv(venv, packages, env)


def _built_venv(venv: Path, packages: list[str], env: dict[str, str]) -> Path:
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import onnxruntime_genai, onnxruntime; print(onnxruntime.get_available_providers())"]
    named = str(venv) in {env.get("THINKER_GENAI_VENV"), env.get("THINKER_GENAI_CUDA_VENV")}
    if not python.exists() or (not named and subprocess.run(probe, capture_output=True, env=env).returncode != 0):
        for command in (
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
        ):
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                pytest.fail(f"cannot build the onnxruntime-genai venv ({' '.join(command)}):\n{done.stderr[-2000:]}")
    done = subprocess.run(probe, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        pytest.fail(f"onnxruntime-genai does not import in {venv}:\n{done.stderr[-2000:]}")
    return python


# --- fused and quantized graphs (test_onnx_fused.py, test_onnx_quantized.py) ---------------------------------------

# onnxruntime's GroupQueryAttention applies RoPE itself only when head_dim is a multiple of 16; the tiny families'
# head_dim is 8 or 12, so the fused tests export variants with head_dim 16 unless they test the fallbacks.
FUSED_HEAD_DIM = 16


@pytest.fixture(scope="session")
def thinker_variant(tmp_path_factory) -> Callable[..., Path]:
    """``thinker_variant(family, **overrides)`` -> a saved random Thinker folder (with a tokenizer) of the family
    with config overrides, made once per session."""
    root = tmp_path_factory.mktemp("thinker-variant")
    cache: dict[tuple, Path] = {}

    def get(family: str, **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = save_thinker(root / f"{family}-{len(cache)}", family, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def onnx_variant(tmp_path_factory, thinker_variant) -> Callable[..., Path]:
    """``onnx_variant(family, dtype="float32", graph="fused", quantize=None, head_dim=FUSED_HEAD_DIM, positions=None,
    logits=None, **overrides)`` -> the (unverified) export of ``thinker_variant(family, head_dim=..., **overrides)``;
    ``quantize`` is a ``QuantizeSpec``; ``head_dim=None`` keeps the family's own; ``positions`` and ``logits`` are
    ``--positions`` and ``--logits``. Made once per session."""
    from export.exporter import export_model

    root = tmp_path_factory.mktemp("onnx-variant")
    cache: dict[tuple, Path] = {}

    def get(
        family: str,
        dtype="float32",
        graph="fused",
        quantize=None,
        head_dim=FUSED_HEAD_DIM,
        positions=None,
        logits=None,
        **overrides,
    ) -> Path:
        if head_dim is not None:
            overrides["head_dim"] = head_dim
        key = (family, dtype, graph, quantize, positions, logits, tuple(sorted(overrides.items())))
        if key not in cache:
            output = root / f"{family}-{dtype}-{graph}-{len(cache)}"
            folder = thinker_variant(family, **overrides)
            export_model(
                folder,
                output,
                dtype=dtype,
                graph=graph,
                quantize=quantize,
                verify=False,
                positions=positions,
                logits=logits,
            )
            cache[key] = output
        return cache[key]

    return get
