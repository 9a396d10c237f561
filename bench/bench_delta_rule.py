"""The plain graph's gated delta rule alone: a Scan over tokens against chunks of 64 (export/chunked_delta_rule.py).

One layer's rule at Qwen3.5-0.8B's sizes (16 value heads, keys and values of 128; batch 1), as the plain graph
emits it (``GatedDeltaNetGraph.emit_delta_scan`` and ``emit_delta_chunks``), on random unit keys and gates of a
trained model's range, for prompt lengths from 1 to 512 tokens. Both forms run in one onnxruntime process, their
repetitions interleaved, each call after a pause (``--gap``: a session's threads spin a while after its run and slow
the other's); the figure is each one's median time per call and their ratio. The same call also checks
that both give the same outputs and state (max |Δ|). The graph's ``CHUNKED_FROM`` (where a step's length switches
it from the Scan to the chunks) is read off this table: the shortest length from which the chunks stay ahead.

    python bench/bench_delta_rule.py                    # about a minute on 2 cores
    python bench/bench_delta_rule.py --lengths 16,32,64 --reps 30

Writes bench/results/delta_rule.json and bench/results/README-delta-rule.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from results_io import command_line, machine_name, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages


from export.chunked_delta_rule import DeltaRuleInputs  # noqa: E402
from export.decoder_graph import IR_VERSION, OPSET  # noqa: E402
from export.graph_builder import GraphBuilder, WeightFile, value_info  # noqa: E402
from export.linear_attention_graph import CHUNKED_FROM, GatedDeltaNetDims, GatedDeltaNetGraph  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DIMS = GatedDeltaNetDims(
    hidden_size=1024, num_key_heads=16, num_value_heads=16, key_head_dim=128, value_head_dim=128,
    conv_kernel=4, rms_norm_eps=1e-6,
)  # fmt: skip
INPUTS = ("query", "key", "value", "log_decay", "beta", "past")


def rule_model(form: str, folder: Path) -> Path:
    """A model of one delta rule in ``form`` ("tokens" or "chunks") over (B, T, ...) inputs as the layer feeds it."""
    d = DIMS
    weights = WeightFile(folder / f"{form}.onnx.data")
    builder = GraphBuilder(weights)
    layer = GatedDeltaNetGraph(builder, d, torch.float32, weight=lambda name: None)
    rule = layer.emit_delta_scan if form == "tokens" else layer.emit_delta_chunks
    out = rule(DeltaRuleInputs(*INPUTS[:-1]), "past", "present")
    builder.op_to("Identity", [out], ["out"])
    weights.close()
    float32 = TensorProto.FLOAT
    inputs = [
        value_info("query", float32, [1, None, d.key_dim]),
        value_info("key", float32, [1, None, d.key_dim]),
        value_info("value", float32, [1, None, d.value_dim]),
        value_info("log_decay", float32, [1, None, d.num_value_heads]),
        value_info("beta", float32, [1, None, d.num_value_heads]),
        value_info("past", float32, [1, d.num_value_heads, d.key_head_dim, d.value_head_dim]),
    ]
    outputs = [value_info("out", float32, None), value_info("present", float32, None)]
    graph = builder.make_graph(f"delta_rule_{form}", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    path = folder / f"{form}.onnx"
    onnx.save_model(model, path)
    return path


def feeds(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Unit keys and queries (as the layer's l2norm leaves them; q scaled by dk^-0.5), decays and write strengths
    in a trained model's range, a random state."""
    rng = np.random.default_rng(seed)
    d = DIMS

    def unit(width: int) -> np.ndarray:
        x = rng.standard_normal((1, length, d.num_key_heads, width)).astype(np.float32)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).reshape(1, length, -1)

    return {
        "query": unit(d.key_head_dim) * np.float32(d.key_head_dim**-0.5),
        "key": unit(d.key_head_dim),
        "value": rng.standard_normal((1, length, d.value_dim)).astype(np.float32),
        "log_decay": -rng.uniform(0.0, 0.1, (1, length, d.num_value_heads)).astype(np.float32),
        "beta": rng.uniform(0.2, 0.9, (1, length, d.num_value_heads)).astype(np.float32),
        "past": 0.1 * rng.standard_normal((1, d.num_value_heads, d.key_head_dim, d.value_head_dim)).astype(np.float32),
    }


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1,16,32,48,64,96,128,256,512")
    parser.add_argument("--reps", type=positive_int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds of pause before each timed call")
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        sessions = {
            form: ort.InferenceSession(
                str(rule_model(form, Path(scratch))), options, providers=["CPUExecutionProvider"]
            )
            for form in ("tokens", "chunks")
        }
        for length in [int(n) for n in args.lengths.split(",")]:
            inputs = feeds(length)
            results = {
                form: session.run(None, inputs) for form, session in sessions.items()
            }  # a warm-up, and the check
            difference = max(float(np.abs(a - b).max()) for a, b in zip(*results.values(), strict=True))
            times: dict[str, list[float]] = {form: [] for form in sessions}
            for rep in range(args.reps):
                for form in list(sessions) if rep % 2 == 0 else list(sessions)[::-1]:
                    time.sleep(args.gap)  # the other session's threads spin a while after its run (bench_graph_ab.py)
                    started = time.perf_counter()
                    sessions[form].run(None, inputs)
                    times[form].append(time.perf_counter() - started)
            medians = {form: statistics.median(values) * 1e3 for form, values in times.items()}
            rows.append({"tokens": length, "ms": medians, "chunks_over_tokens": medians["chunks"] / medians["tokens"]})
            rows[-1]["max_abs_difference"] = difference
            print(
                f"{length:4d} tokens: {medians}, ratio {rows[-1]['chunks_over_tokens']:.3f}, max |Δ| {difference:.2e}"
            )
    results = {
        "command": command_line(),
        "machine": machine_name(),
        "threads": args.threads,
        "reps": args.reps,
        "chunked_from": CHUNKED_FROM,
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "delta_rule.json"), json.dumps(results, indent=2) + "\n")
    lines = [
        f"Command: `{results['command']}`; one layer at Qwen3.5-0.8B's sizes, batch 1, {args.threads} threads, medians"
        f" of {args.reps} interleaved calls; the graph switches to chunks from {CHUNKED_FROM} tokens.",
        "",
        "| prompt tokens | Scan over tokens (ms) | chunks of 64 (ms) | chunks / tokens | max \\|Δ\\| |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ms = row["ms"]
        lines.append(
            f"| {row['tokens']} | {ms['tokens']:.2f} | {ms['chunks']:.2f} | {row['chunks_over_tokens']:.3f}"
            f" | {row['max_abs_difference']:.1e} |"
        )
    write_result((RESULTS / "README-delta-rule.md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
