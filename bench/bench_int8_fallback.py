"""What an 8-bit projection costs with float activations on onnxruntime's CPU provider, by layout.

    python bench/bench_int8_fallback.py [--dim 2048] [--layers 16] [--threads 2] [--reps 9]

The accuracy guard (export/accuracy_guard.py) moves projections whose int8 activations flip tokens to float
activations. For a 4-bit MatMulNBits that is accuracy level 1, which MLAS has a kernel for; for 8 bits it has none,
and this measures the candidates on a chain of ``--layers`` square projections (weights well beyond the caches, as
in a model) at one row (a decode step) and at 64 (a prompt): float32 MatMul, MatMulNBits at 4 and 8 bits at
levels 1 and 4, symmetric in blocks of 32 (onnxruntime's own quantizer). Each output's error against the float32
chain is printed beside its time, which says which layouts compute with int8 activations. Writes
``bench/results/int8_fallback.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from results_io import positive_int

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script

from layout_timing import report_layouts, time_layouts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "int8_fallback.json"
ROWS = (1, 64)


def chain(weights: list[np.ndarray]) -> onnx.ModelProto:
    dim, layers = weights[0].shape[0], len(weights)
    nodes = [helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"x{i + 1}"]) for i in range(layers)]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["rows", dim])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, ["rows", dim])],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def quantized(model: onnx.ModelProto, bits: int, level: int) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    quantizer = MatMulNBitsQuantizer(copy, block_size=32, is_symmetric=True, accuracy_level=level, bits=bits)
    quantizer.process()
    return quantizer.model.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=positive_int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = [
        (rng.standard_normal((args.dim, args.dim)) / np.sqrt(args.dim)).astype(np.float32) for _ in range(args.layers)
    ]
    base = chain(weights)
    variants = {"float32 MatMul": base}
    for bits in (4, 8):
        for level in (1, 4):
            variants[f"MatMulNBits {bits}-bit level {level}"] = quantized(base, bits, level)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    sessions = {
        name: ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for name, model in variants.items()
    }
    results = time_layouts(sessions, ROWS, args.dim, args.reps, seed=0)
    shape = f"{args.layers} projections of {args.dim} x {args.dim}"
    title = f"{shape}, {args.threads} threads, median of {args.reps} interleaved runs"
    settings = {"dim": args.dim, "layers": args.layers, "threads": args.threads, "reps": args.reps}
    report_layouts(results, "MatMulNBits 8-bit level 4", title, RESULTS, settings)


if __name__ == "__main__":
    main()
