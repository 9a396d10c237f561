"""The peers' own virtual environments, built on first use under ~/.cache (each needs what ours must not share).

genai     onnxruntime-genai with the CPU onnxruntime it pulls in (the same one the tests use; it must not share an
          environment with onnxruntime-gpu)
builder   onnxruntime-genai's model builder: onnxruntime-genai + torch + transformers (the builder reads the HF
          folder with transformers)
optimum   Optimum's ONNX exporter: optimum-onnx, which needs transformers < 4.58
mobius    mobius-onnx 0.1.0's exporter (``mobius build``)

THINKER_GENAI_VENV, THINKER_BUILDER_VENV and THINKER_MOBIUS_VENV move an environment: one that exists there is used
as it is (never rebuilt), and where there is none it is built there, as at its default place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HOME_CACHE = Path.home() / ".cache"
ENVS = {
    "genai": (
        Path(os.environ.get("THINKER_GENAI_VENV", HOME_CACHE / "thinker-test-genai-venv")),
        ["onnxruntime-genai", "numpy"],
        "import onnxruntime_genai",
    ),
    "builder": (
        Path(os.environ.get("THINKER_BUILDER_VENV", HOME_CACHE / "thinker-bench-builder-venv")),
        ["onnxruntime-genai", "torch==2.13.0", "transformers==5.23.0", "onnx", "onnx-ir", "numpy", "protobuf"],
        "import onnxruntime_genai.models.builder, torch, transformers",
    ),
    "optimum": (
        HOME_CACHE / "thinker-bench-optimum-venv",
        ["optimum-onnx[onnxruntime]", "transformers<4.58", "torch==2.13.0"],
        "import optimum.exporters.onnx, transformers",
    ),
    "mobius": (
        Path(os.environ.get("THINKER_MOBIUS_VENV", HOME_CACHE / "thinker-bench-mobius-venv")),
        ["mobius-onnx==0.1.0"],
        "import mobius",
    ),
}


def python_of(name: str) -> Path:
    """The Python of environment ``name``, built if missing; raises RuntimeError with pip's reason if it cannot be.
    One that exists but fails its probe is rebuilt at its default place only: a venv named by a THINKER_*_VENV
    variable is someone's own (the GPU kit's, bench/gpu_kit.py) and raises instead of being cleared."""
    venv, packages, probe = ENVS[name]
    python = venv / "bin" / "python"
    if python.exists():
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if done.returncode == 0:
            return python
        if str(venv) in {os.environ.get(f"THINKER_{key.upper()}_VENV") for key in ENVS}:
            raise RuntimeError(f"the {name} environment {venv} (named by a variable) fails `{probe}`: {done.stderr}")
    for command in (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot build the {name} environment ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return python


def package_versions(name: str) -> dict[str, str]:
    """Versions of the packages that matter for the figures, as installed in environment ``name``: each the first
    on its ``sys.path``, the one its import takes. (Every distribution on the path, the last one winning, recorded the
    GPU image's own transformers 5.17 where the GPU kit's 5.25, first on the path, ran; a CPU onnxruntime the image
    holds beside the kit's onnxruntime-gpu is still listed, under its own name.)"""
    wanted = ["onnxruntime", "onnxruntime-gpu", "onnxruntime-genai", "onnxruntime-genai-cuda", "optimum"]
    wanted += ["optimum-onnx", "mobius-onnx", "transformers", "torch"]
    code = (
        "import importlib.metadata as m, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(found))"
    )
    done = subprocess.run([str(python_of(name)), "-c", code, *wanted], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}
