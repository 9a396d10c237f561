"""bench/bench_export_phases.py: one quantized export split into its phases in a fresh process. The phases are the
exporter's own functions, wrapped by name, so a renamed one fails here rather than dropping out of the figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_export_phases  # noqa: E402

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the bench resets Linux's VmHWM, which this system lacks"
)


def test_every_phase_is_timed_and_nested_peaks_stay_within_their_phase(qwen3_thinker):
    run = bench_export_phases.run_once(qwen3_thinker, ["--quantize", "int8"])
    phases = run["phases"]
    assert list(phases) == [
        "imports", "scaled_for_rounding", "best_scale", "build_onnx", "guard_accuracy_level", "prefill", "rest"
    ]  # fmt: skip
    assert phases["prefill"]["calls"] == 2  # the guard's reference and the graph as written: nothing moved
    assert phases["best_scale"]["calls"] >= 2 and phases["scaled_for_rounding"]["calls"] == 1
    for inner, outer in bench_export_phases.NESTED.items():
        assert phases[inner]["seconds"] <= phases[outer]["seconds"]
        assert 0 < phases[inner]["peak"] <= phases[outer]["peak"]
    top = [phase for name, phase in phases.items() if name not in bench_export_phases.NESTED]
    assert all(phase["seconds"] >= 0 for phase in top)
    assert sum(phase["seconds"] for phase in top) == pytest.approx(run["total_seconds"])
    table = bench_export_phases.medians([run, run])
    assert table["build_onnx"]["peak_median"] == phases["build_onnx"]["peak"]
    text = bench_export_phases.markdown(
        {"command": "c", "reps": 2, "variants": {"int8": {"flags": ["--quantize", "int8"], "total_seconds_median": 1.0,
                                                           "phases": table}}}
    )  # fmt: skip
    assert "| &nbsp;&nbsp;prefill | 2 |" in text and "| rest | 1 |" in text


def test_a_nested_phase_keeps_its_own_peak_and_the_outer_one_the_larger():
    """The clock on a fake high-water mark: the outer phase reaches 300 before the inner one runs, the inner 100 (a
    mutation run: with no fold before a reset the outer phase lost its 300, with no reset the inner took it)."""
    marks = {"now": 0}
    phases: dict[str, dict] = {}
    clock = bench_export_phases.PhaseClock(phases, peak=lambda: marks["now"], reset=lambda: marks.update(now=0))

    def inner():
        marks["now"] = max(marks["now"], 100)

    def outer():
        marks["now"] = 300
        clock.timed("inner", inner)()

    clock.timed("outer", outer)()
    assert (phases["outer"]["peak"], phases["inner"]["peak"]) == (300, 100)
    assert phases["outer"]["calls"] == phases["inner"]["calls"] == 1


def test_medians_and_ranges_over_runs():
    runs = [
        {"phases": {"build_onnx": {"seconds": seconds, "peak": peak * 2**20, "calls": 1}}}
        for seconds, peak in ((1.0, 100), (2.0, 50), (9.0, 150))
    ]
    table = bench_export_phases.medians(runs)["build_onnx"]
    assert table["peak_range"] == [50 * 2**20, 150 * 2**20] and table["seconds_median"] == 2.0
    variant = {"flags": ["--quantize", "int8"], "total_seconds_median": 1.0, "phases": {"build_onnx": table}}
    text = bench_export_phases.markdown({"command": "c", "reps": 3, "variants": {"int8": variant}})
    assert "| build_onnx | 1 | 2.00 | 100 | 50-150 |" in text
