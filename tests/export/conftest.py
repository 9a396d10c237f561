"""Fixtures for the export tests: tiny Thinker folders and their ONNX exports, built once per session; the
onnxruntime-genai virtual environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from export_helpers import save_thinker

GENAI_VENV = Path(os.environ.get("THINKER_GENAI_VENV", Path.home() / ".cache" / "thinker-test-genai-venv"))
GENAI_PACKAGES = ["onnxruntime-genai", "numpy"]


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
    """``onnx_folder(family, dtype="float32")`` -> the export of ``thinker_folder(family)`` (not verified: the
    tests check parity themselves), made once per session."""
    from export.exporter import export_model

    root = tmp_path_factory.mktemp("onnx")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str = "float32") -> Path:
        if (family, dtype) not in cache:
            output = root / f"{family}-{dtype}"
            export_model(thinker_folder(family), output, dtype=dtype, verify=False)
            cache[family, dtype] = output
        return cache[family, dtype]

    return get


@pytest.fixture(scope="session")
def genai_python() -> Path:
    """The Python of a virtual environment with onnxruntime-genai and the CPU onnxruntime it pulls in (which must
    not share an environment with onnxruntime-gpu). Built under ~/.cache on first use (THINKER_GENAI_VENV moves
    it); a failure to build it fails the tests that need it, with pip's reason."""
    python = GENAI_VENV / "bin" / "python"
    probe = [str(python), "-c", "import onnxruntime_genai, onnxruntime; print(onnxruntime.get_available_providers())"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        for command in (
            [sys.executable, "-m", "venv", "--clear", str(GENAI_VENV)],
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *GENAI_PACKAGES],
        ):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"cannot build the onnxruntime-genai venv ({' '.join(command)}):\n{done.stderr[-2000:]}")
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"onnxruntime-genai does not import in {GENAI_VENV}:\n{done.stderr[-2000:]}")
    return python
