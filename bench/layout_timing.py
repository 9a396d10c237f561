"""Times onnxruntime sessions of one function in several layouts, interleaved, and reports them: the shared part of
bench_int8_fallback.py and bench_qmoe_int8.py.

Every session takes ``x0`` (rows, width) and gives one output. Per row count: a warm-up run of each, whose output's
largest error against the first session's (the float reference) is recorded relative to that output's largest
magnitude; then ``reps`` rounds in which every session runs once, so a burst of load hits every layout alike, each
run after ``gap`` seconds (a session's threads keep spinning a while after its run and slow the next session's:
bench_graph_ab.py); the median time per layout.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from results_io import command_line, machine_name, write_result


def time_layouts(
    sessions: dict[str, ort.InferenceSession],
    rows: tuple[int, ...],
    width: int,
    reps: int,
    gap: float = 0.0,
    function: Callable[[np.ndarray, np.ndarray], np.ndarray] = lambda out, x: out,
    seed: int = 1,
    dtype: type = np.float32,
) -> dict[str, dict[int, dict[str, float]]]:
    """``results[layout][rows]``: ``relative_error`` against the first session and ``ms``, the median run (on
    CUDA a run includes copying ``x`` in and the output out, which waits for the device). The error is taken on
    ``function(output, x)`` (e.g. a residual chain's output without its input), in float32; ``dtype``: the input's."""
    rng = np.random.default_rng(seed)
    results: dict = {}
    for count in rows:
        x = rng.standard_normal((count, width)).astype(dtype)
        outputs = {
            name: function(session.run(None, {"x0": x})[0], x).astype(np.float32) for name, session in sessions.items()
        }
        for name, out in outputs.items():
            if not np.isfinite(out).all():  # a NaN error column would read as a layout's fault, and NaN routes alike
                raise SystemExit(f"{name}: the output at {count} rows is not finite; make the inputs smaller")
        reference = next(iter(outputs.values()))
        for name, out in outputs.items():
            error = float(np.abs(out - reference).max() / np.abs(reference).max())
            results.setdefault(name, {})[count] = {"relative_error": error}
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(reps):
            for name, session in sessions.items():
                time.sleep(gap)
                start = time.perf_counter()
                session.run(None, {"x0": x})
                times[name].append(time.perf_counter() - start)
        for name, samples in times.items():
            results[name][count]["ms"] = statistics.median(samples) * 1e3
    return results


def report_layouts(results: dict, baseline: str, title: str, path: Path, settings: dict) -> None:
    """Prints ``title`` and the table (times per row count, the ratio to ``baseline``, the first row count's error)
    and writes ``settings`` with the results to ``path``."""
    rows = list(next(iter(results.values())))
    print(title)
    print(f"| layout | {' | '.join(f'{r} row(s) (ms)' for r in rows)} | vs {baseline} | error vs the first |")
    print("|---|" + "---|" * (len(rows) + 2))
    for name, by_rows in results.items():
        ratio = " / ".join(f"{by_rows[r]['ms'] / results[baseline][r]['ms']:.2f}x" for r in rows)
        times = " | ".join(f"{by_rows[r]['ms']:.2f}" for r in rows)
        print(f"| {name} | {times} | {ratio} | {by_rows[rows[0]]['relative_error']:.1e} |")
    path.parent.mkdir(exist_ok=True)
    record = {
        "command": command_line(),
        **settings,
        "onnxruntime": ort.__version__,
        "machine": machine_name(),
        "results": results,
    }
    write_result(path, json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
