"""How close onnxruntime's own float32 matmul comes to the memory-bandwidth limit at one token (batch 1 decode).

Issue 13 asks for batch-1 decode at >= 90 % of the bandwidth limit (bench/bandwidth.py). This measures the ceiling
that onnxruntime's CPU kernel itself puts on that figure, with nothing of a model around it. For each projection
shape of a model (SmolLM2-135M, Qwen3-0.6B: from their presets), a graph holds one independent MatMul per layer,
each with its own random (K, N) float32 weight: one row in, as a decode step feeds them. The weights add up to far
more than the caches, so each run streams them from memory. It is timed at --threads intra-op threads, over
--reps runs after a warm-up (median and best), as weight bytes per second against bench/bandwidth.py's read rate
in the same run (itself the best of several samples).
The last row puts every matmul of a decode step into one graph: the whole model's projections and its head.

    python bench/bench_matmul_roofline.py                     # about a minute

Writes bench/results/matmul_roofline.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from results_io import command_line, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from bandwidth import read_bandwidth  # noqa: E402
from report import table  # noqa: E402

from thinker.presets import load_preset  # noqa: E402

RESULTS = Path(__file__).with_name("results")


def projection_shapes(preset: str) -> tuple[dict[str, tuple[int, int]], int, tuple[int, int]]:
    """(K, N) of each of a layer's projections as our fused graph writes them (q, k and v packed; gate and up apart),
    the layer count, and the head's."""
    config = load_preset(preset)
    c, d = config.hidden_size, config.head_dim
    shapes = {
        "q|k|v": (c, (config.num_attention_heads + 2 * config.num_key_value_heads) * d),
        "o": (config.num_attention_heads * d, c),
        "gate": (c, config.intermediate_size),
        "up": (c, config.intermediate_size),
        "down": (config.intermediate_size, c),
    }
    return shapes, config.num_hidden_layers, (c, config.vocab_size)


def matmul_graph(shapes: list[tuple[int, int]]) -> onnx.ModelProto:
    """One MatMul per (K, N), each on its own input row and weight (independent: nothing orders them but the
    executor)."""
    rng = np.random.default_rng(0)
    inputs, outputs, nodes, weights = [], [], [], []
    for i, (k, n) in enumerate(shapes):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]))
        weights.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
    graph = helper.make_graph(nodes, "matmuls", inputs, outputs, weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def weight_rate(shapes: list[tuple[int, int]], threads: int, reps: int) -> dict:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory() as tmp:  # external data: a whole step of Qwen3-0.6B is past protobuf's 2 GB
        path = Path(tmp) / "matmuls.onnx"
        onnx.save_model(matmul_graph(shapes), path, save_as_external_data=True, location="matmuls.onnx.data")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {f"x{i}": rng.standard_normal((1, k), dtype=np.float32) for i, (k, _) in enumerate(shapes)}
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    weight_bytes = sum(4 * k * n for k, n in shapes)
    best, median = min(times), float(np.median(times))
    return {
        "ms_best": 1e3 * best,
        "ms_median": 1e3 * median,
        "weight_bytes": weight_bytes,
        "bytes_per_s_best": weight_bytes / best,
        "bytes_per_s_median": weight_bytes / median,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="smollm2-135m,qwen3-0.6b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=positive_int, default=20)
    args = parser.parse_args()

    bandwidth = read_bandwidth(args.threads)["bytes_per_s"]
    rows, results = [], {"command": command_line()}
    results.update(threads=args.threads, read_bandwidth=bandwidth, models={})
    for preset in args.presets.split(","):
        shapes, layers, head = projection_shapes(preset)
        cases = {f"{name} x {layers}": [shape] * layers for name, shape in shapes.items()}
        cases["head"] = [head]
        cases["a whole decode step"] = [shape for shape in shapes.values() for _ in range(layers)] + [head]
        figures = {}
        for name, case in cases.items():
            print(f"  {preset}: {name}", file=sys.stderr, flush=True)
            figures[name] = weight_rate(case, args.threads, args.reps)
            one = figures[name]
            shape = "" if len(set(case)) > 1 else "{} x {}".format(*case[0])
            row = [preset, name, shape, f"{one['weight_bytes'] / 2**20:.0f}"]
            row += [f"{one['ms_median']:.2f}", f"{one['bytes_per_s_median'] / bandwidth:.0%}"]
            row += [f"{one['ms_best']:.2f}", f"{one['bytes_per_s_best'] / bandwidth:.0%}"]
            rows.append(row)
        results["models"][preset] = figures
    header = ["model", "matmuls (M = 1)", "K x N", "weights (MiB)", "median ms", "of the read bandwidth"]
    header += ["best ms", "of the read bandwidth"]
    text = table(header, rows)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (bench/bandwidth.py), {args.threads} threads\n\n{text}")
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "matmul_roofline.json"), json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
