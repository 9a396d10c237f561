"""Where a quantized export's time and peak memory go, phase by phase, on the real SmolLM2-135M.

bench_export_peak.py measures an export's wall and peak RSS as a whole; this bench splits one export (``--no-verify``)
into its phases, each in a fresh process: the imports, the activation-aware scales (and within them the search for
each group's alpha), the graph's writing and quantization, the accuracy guard (and within it each onnxruntime
prefill), and the rest. Each phase's peak RSS is read from the kernel's high-water mark (VmHWM), reset as the phase
begins (``/proc/self/clear_refs``), so it is the phase's own peak over what the process held before it; the
seconds are wall time. The export goals' analysis in README ("Where the goals of the speed issue stand") reads its
figures from here.

    python bench/bench_export_phases.py                              # --quantize int8, 3 fresh exports
    python bench/bench_export_phases.py --variants int4,int8 --reps 5

Linux only (VmHWM and its reset). Writes bench/results/export_phases.json and bench/results/README-export-phases.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from results_io import command_line, machine_name, positive_int, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (module, function): the phases, in the order an export runs them; a phase inside another is listed after it
PHASES = (
    ("export.exporter", "scaled_for_rounding"),
    ("export.awq", "best_scale"),
    ("export.exporter", "build_onnx"),
    ("export.accuracy_guard", "guard_accuracy_level"),
    ("export.accuracy_guard", "prefill"),
)
NESTED = {"best_scale": "scaled_for_rounding", "prefill": "guard_accuracy_level"}


def high_water_mark() -> int:
    """The process's peak RSS since the last ``reset_peak`` (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == "VmHWM":
            return int(rest.split()[0]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS


class PhaseClock:
    """Wall seconds, calls and peak RSS per phase. Each phase resets the high-water mark as it begins and as it ends
    (``reset``), having first folded the mark so far into every phase still running (``peak``): a nested phase's
    peak is its own, and the phase around it keeps the larger of its own and the nested one's."""

    def __init__(self, phases: dict[str, dict], peak=high_water_mark, reset=reset_peak) -> None:
        self.phases, self.peak, self.reset = phases, peak, reset
        self.running: list[str] = []  # outermost first

    def fold(self) -> None:
        mark = self.peak()
        for name in self.running:
            self.phases[name]["peak"] = max(self.phases[name]["peak"], mark)

    def timed(self, name: str, function):
        def run(*args, **kwargs):
            phase = self.phases.setdefault(name, {"seconds": 0.0, "peak": 0, "calls": 0})
            self.fold()
            self.reset()
            self.running.append(name)
            entered = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phase["seconds"] += time.perf_counter() - entered
                phase["calls"] += 1
                self.fold()
                self.running.pop()
                self.reset()

        return run


def child(arguments: list[str], record: Path) -> None:
    """One export in this process, its phases timed and their peaks read; the figures go to ``record``."""
    started = time.perf_counter()
    import importlib

    from thinker_common.cli import main as cli

    phases: dict[str, dict] = {}
    modules = [importlib.import_module(module) for module, _ in PHASES]  # the export's own imports
    phases["imports"] = {"seconds": time.perf_counter() - started, "peak": high_water_mark(), "calls": 1}
    reset_peak()
    clock = PhaseClock(phases)
    for (_, name), module in zip(PHASES, modules, strict=True):
        setattr(module, name, clock.timed(name, getattr(module, name)))
    try:
        cli.main(["export", *arguments], prog_name="thinker", standalone_mode=False)
    finally:
        total = time.perf_counter() - started
        rest = total - sum(p["seconds"] for n, p in phases.items() if n not in NESTED)
        phases["rest"] = {"seconds": rest, "peak": None, "calls": 1}
        record.write_text(json.dumps({"total_seconds": total, "phases": phases}))


def run_once(model_dir: Path, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="thinker-phases-") as scratch:
        record = Path(scratch) / "phases.json"
        command = [sys.executable, __file__, "--child", str(record), str(model_dir), str(Path(scratch) / "out")]
        done = subprocess.run([*command, "--no-verify", *flags], capture_output=True, text=True)
        if done.returncode != 0 or not record.exists():
            raise SystemExit(f"the export failed: {done.stderr[-2000:]}")
        return json.loads(record.read_text())


def medians(runs: list[dict]) -> dict:
    names = list(runs[0]["phases"])
    table = {}
    for name in names:
        seconds = [run["phases"][name]["seconds"] for run in runs]
        peaks = [run["phases"][name]["peak"] for run in runs if run["phases"][name]["peak"] is not None]
        table[name] = {
            "seconds_median": statistics.median(seconds),
            "peak_median": statistics.median(peaks) if peaks else None,
            "peak_range": [min(peaks), max(peaks)] if peaks else None,
            "calls": runs[0]["phases"][name]["calls"],
        }
    return table


def markdown(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}`; {results['reps']} fresh exports of each variant (`--no-verify`), "
        "interleaved; medians. A phase's peak is its own high-water mark of RSS (reset as it begins); an indented "
        "phase runs inside the one above it.",
        "",
    ]
    for variant, row in results["variants"].items():
        lines += [
            f"**{variant}** (`{' '.join(row['flags'])}`): wall {row['total_seconds_median']:.1f} s",
            "",
            "| phase | calls | seconds | peak RSS (MiB) | range (MiB) |",
            "|---|---|---|---|---|",
        ]
        for name, phase in row["phases"].items():
            label = f"&nbsp;&nbsp;{name}" if name in NESTED else name
            peak = "—" if phase["peak_median"] is None else f"{phase['peak_median'] / 2**20:.0f}"
            spread = "—" if phase["peak_range"] is None else "-".join(f"{v / 2**20:.0f}" for v in phase["peak_range"])
            lines.append(f"| {label} | {phase['calls']} | {phase['seconds_median']:.2f} | {peak} | {spread} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[3:], Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="int8", help="comma-separated: int4, int8 (each its --quantize)")
    parser.add_argument("--reps", type=positive_int, default=3)
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := sorted(set(names) - {"int4", "int8"}):
        parser.error(f"--variants: {', '.join(unknown)} not among int4, int8")
    if not Path("/proc/self/clear_refs").exists():
        parser.error("this bench reads and resets Linux's VmHWM (/proc/self/clear_refs), which this system lacks")

    import models

    model = models.smollm2()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            print(f"  rep {rep + 1}/{args.reps}: export {name}", file=sys.stderr, flush=True)
            runs[name].append(run_once(model.thinker, ["--quantize", name]))
    results = {
        "command": command_line(),
        "machine": machine_name(),
        "reps": args.reps,
        "variants": {
            name: {
                "flags": ["--quantize", name, "--no-verify"],
                "total_seconds_median": statistics.median(run["total_seconds"] for run in done),
                "phases": medians(done),
                "runs": done,
            }
            for name, done in runs.items()
        },
    }
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "export_phases.json", json.dumps(results, indent=2) + "\n")
    write_result(RESULTS / "README-export-phases.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
