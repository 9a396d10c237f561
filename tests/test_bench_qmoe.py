"""bench/bench_qmoe_int8.py's chains, built without a GPU: the float16 ones its ``--provider cuda`` mode times run on
the CPU too, and each quantized layout computes the float MoE's function to its rounding (so a CUDA run's times
compare layouts of one function)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_qmoe_int8  # noqa: E402

from export.graph_builder import TORCH_TO_ONNX  # noqa: E402
from export.quantize import QuantizeSpec  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_chains_compute_the_float_chain(dtype):
    rng = np.random.default_rng(0)
    experts, hidden, inner = 8, 64, 64
    scale = 0.1  # experts' weights: the MoE term as large as x, so that out - x loses nothing in float16
    layers = [
        {
            "router": (rng.standard_normal((hidden, experts)) / np.sqrt(hidden)).astype(np.float32),
            "fc1": (rng.standard_normal((experts, 2 * inner, hidden)) * scale).astype(np.float32),
            "fc2": (rng.standard_normal((experts, hidden, inner)) * scale).astype(np.float32),
        }
        for _ in range(2)
    ]
    x = rng.standard_normal((5, hidden)).astype(bench_qmoe_int8.NUMPY_TYPES[dtype])

    def moe(spec, in_blocks):
        model = bench_qmoe_int8.moe_chain(layers, 2, spec, in_blocks, dtype)
        # CUDA's QMoE refuses scales of another type than the activations' ("fc1_scales must match the activation
        # type", an H100); the CPU's runs them, so the type is checked here
        scales = {t.data_type for t in model.graph.initializer if t.name.endswith("_scales")}
        assert scales == ({TORCH_TO_ONNX[dtype]} if spec else set()), (spec, in_blocks)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return (session.run(None, {"x0": x})[0] - x).astype(np.float32)

    reference = moe(None, False)
    # 8 bits a scale per row, 8 bits in blocks (level 1: float activations but for the block-wise 8-bit kernel's own
    # int8 rounding), 4 bits in blocks: each within its rounding of the float MoE
    for spec, in_blocks, bound in [
        (QuantizeSpec(bits=8, accuracy_level=1), False, 0.03),
        (QuantizeSpec(bits=8, accuracy_level=1), True, 0.03),
        (QuantizeSpec(bits=4, accuracy_level=1), True, 0.3),
    ]:
        error = np.abs(moe(spec, in_blocks) - reference).max() / np.abs(reference).max()
        assert error < bound, (spec, in_blocks, error)


def test_the_cuda_chain_stays_within_float16():
    """The CUDA mode's twelve layers of the default shapes (fewer experts, all routed: the same sums per row) keep x
    near its own size; at the 0.1 it used to take, x left float16's range at the third layer (an H200's run
    reported NaN errors)."""
    layers = bench_qmoe_int8.random_layers(12, 8, 1024, 128, bench_qmoe_int8.EXPERT_SCALE["cuda"])
    x = np.random.default_rng(1).standard_normal((16, 1024)).astype(np.float32)
    session = ort.InferenceSession(
        bench_qmoe_int8.moe_chain(layers, 8, None, False).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    out = session.run(None, {"x0": x})[0]
    assert np.abs(out).max() < 1.5 * np.abs(x).max()
    assert np.abs(out - x).max() > 0.1 * np.abs(x).max()  # and the MoE term is not lost in float16's rounding of x
