"""Where onnxruntime runs: the execution providers (CUDA where a CUDA session really starts, else CPU), the
session options, and a session's load with its failures told by the graph's file.

Kept apart from the decoder (``export/runtime.py``) because the tests' GPU marker (tests/conftest.py), the GPU
benchmarks and ``thinker generate --provider`` ask the same questions without running a model.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail as OrtFail
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument, InvalidGraph, InvalidProtobuf, NoSuchFile
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as NotImplementedByOrt

from thinker_common.errors import ThinkerError

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# onnxruntime's CUDA provider runs float32 MatMul and Gemm in TF32 unless told not to (use_tf32 defaults to 1: 10
# bits of mantissa), where PyTorch's CUDA matmuls keep float32's 23 (torch.backends.cuda.matmul.allow_tf32 is off by
# default). A float32 graph is exported for float32's precision, which parity and --verify hold it to, and TF32's
# rounding also flips near-ties in discrete choices (Qwen3.8's indexer picked other blocks: 0.5 off the reference on
# the H200), so our sessions keep full float32. Half-precision graphs are unaffected (TF32 is a float32 mode).
CUDA_PROVIDER = (CUDA, {"use_tf32": "0"})


def physical_cores() -> int:
    """Physical cores (hyper-threads share a core's matrix units, so more threads than cores slow matmuls down)."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def session_options(threads: int | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or physical_cores()
    options.log_severity_level = 3  # errors only: the CPU fallback warnings are expected and noisy
    return options


@functools.cache
def cuda_usable() -> bool:
    """Whether a CUDA session really runs here. The provider list names CUDA wherever onnxruntime-gpu is
    installed, with or without a GPU and its libraries, and a session then falls back to CPU, so a one-node
    model is run. Asked once per process."""
    if CUDA not in ort.get_available_providers():
        return False
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    ort.set_default_logger_severity(4)  # a missing libcublas is the answer here, not an error to print
    try:
        session = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=[CUDA])
        session.run(None, {"x": np.ones(1, np.float32)})
        return CUDA in session.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(2)  # onnxruntime's default: warnings


def cuda_absence() -> str:
    """Why ``cuda_usable`` said no, for the error message."""
    if CUDA not in ort.get_available_providers():
        return "this onnxruntime has no CUDA execution provider; install onnxruntime-gpu"
    gpu = visible_gpu()
    if gpu is None:
        return "onnxruntime's CUDA execution provider does not start: there is no GPU here"
    return (
        f"onnxruntime's CUDA execution provider does not start although a GPU is here ({gpu}): its CUDA libraries "
        "are missing or do not match"
    )


def visible_gpu(
    environ: Mapping[str, str] = os.environ,
    devices: Path = Path("/dev"),
    nvidia_smi: Callable[[], str | None] | None = None,
) -> str | None:
    """The NVIDIA GPU this process is meant to use, described (``/dev/nvidia0``, ``GPU 0: NVIDIA H100 ...``), or
    None. Independent of onnxruntime, so that a GPU whose CUDA provider does not load is told from no GPU at all.
    ``CUDA_VISIBLE_DEVICES`` set empty (or to -1) hides every GPU on purpose; otherwise a device node or
    ``nvidia-smi -L`` shows one. The probes are parameters so that the decision can be tested without a GPU."""
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1", "NoDevFiles"):
        return None
    nodes = sorted(path for path in devices.glob("nvidia[0-9]*") if path.name[6:].isdigit())
    if nodes:
        return str(nodes[0])
    return (nvidia_smi or _nvidia_smi_first_gpu)()


def _nvidia_smi_first_gpu() -> str | None:
    command = shutil.which("nvidia-smi")
    if command is None:
        return None
    try:
        done = subprocess.run([command, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((line.strip() for line in done.stdout.splitlines() if line.startswith("GPU ")), None)


def gpu_test_verdict(usable: bool, gpu: str | None, why: str) -> tuple[str, str]:
    """What a GPU test does here: ("run", ""), ("skip", reason) where there is no GPU, or ("fail", reason) where a
    GPU is visible but CUDA sessions do not run: a machine set up wrongly must not pass its GPU tests by skipping
    them. ``usable``: ``cuda_usable()``; ``gpu``: ``visible_gpu()``; ``why``: ``cuda_absence()``."""
    if usable:
        return "run", ""
    if gpu is None:
        return "skip", "no GPU here (no /dev/nvidia*, nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)"
    return "fail", f"a GPU is visible ({gpu}) but CUDA sessions do not run: {why}"


def execution_providers(use_cuda: bool) -> list:
    """The provider list a session is opened with: CUDA (full float32: ``CUDA_PROVIDER``) before the CPU, which
    takes the nodes CUDA has no kernel for; the CPU alone otherwise."""
    return [CUDA_PROVIDER, CPU] if use_cuda else [CPU]


def load_session(path: Path, source: str | bytes, options: ort.SessionOptions, providers: list):
    """An onnxruntime session over ``source`` (``path``'s graph, or a variant of it as bytes), its failures told by
    the file's name."""
    try:
        # onnxruntime prints an "EP Error" banner on stdout before retrying a failed load: the error below says it
        with contextlib.redirect_stdout(io.StringIO()):
            return ort.InferenceSession(source, options, providers=providers)
    except NotImplementedByOrt as err:  # a kernel the provider lacks: bfloat16 on CPU, typically
        reason = str(err).splitlines()[0]
        raise ThinkerError(f"{path}: onnxruntime cannot run it on {provider_label(providers)}: {reason}") from None
    except (OrtFail, InvalidArgument, InvalidProtobuf, InvalidGraph, NoSuchFile) as err:  # a damaged export
        reason = " ".join(str(err).split())
        raise ThinkerError(f"{path}: onnxruntime cannot load it ({reason}); export the model again") from None
    except UnicodeDecodeError:  # onnxruntime's error quotes the damaged bytes, which Python cannot decode
        raise ThinkerError(
            f"{path}: onnxruntime cannot load it (the file is damaged); export the model again"
        ) from None


def provider_label(providers: list) -> str:
    """What a load error calls the device: CUDA where the list names it (with its options, or bare), else the CPU."""
    names = [provider[0] if isinstance(provider, tuple) else provider for provider in providers]
    return "CUDA" if CUDA in names else "CPU (export float16 or float32 for CPU)"
