"""What ``thinker export --verify`` holds in memory, whole and streamed, on the Qwen3-0.6B-shaped model.

``--verify`` runs the PyTorch Thinker beside the graph's onnxruntime session. Where both fit in the memory
available it loads the PyTorch model whole; where they do not, but the session and one layer do, it streams the
PyTorch model from the Thinker folder one layer at a time (export/verify.py ``verify_plan``). This bench exports the
same folder (``bench/models.py`` qwen3-0.6b: 28 layers, 596 M parameters, float32, random weights) three ways, as
float32 and as ``--quantize int4``, each in a fresh process whose /proc status is sampled every few milliseconds:

1. ``--no-verify``: the export alone;
2. ``--verify`` with the machine's own budget: the whole model beside the session (int4: the float model and its
   dequantized weights beside the graph's two sessions);
3. ``--verify`` with ``THINKER_VERIFY_MEMORY`` set so that only the streamed check fits: the graph's bytes plus
   the largest layer's (int4: twice the graph's and twice the largest layer's), the same graph checked with the
   PyTorch model read layer by layer. The deep-cache pass (export/deep_cache.py), which goes as deep as the memory
   the plan leaves allows, finds none left there and does not run: its cost shows in 2 against the previous run.

It reports each one's wall time and peak resident set (VmHWM), and the verify figures of 2 and 3 (for int4 the graph
check's: the graph against the PyTorch model holding its dequantized weights), which compare the same graph on the
same inputs and must agree.

    python bench/bench_verify_memory.py            # about 6 minutes on 2 cores, after the model is built
    python bench/bench_verify_memory.py --report   # the README table, from bench/results/verify_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from results_io import command_line, machine_name, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import models  # noqa: E402
from bench_convert import load_average, run_measured  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "verify_memory.json"
EXPORT = [sys.executable, "-c", "from thinker_common.cli import main; main()", "export"]


def measure() -> dict:
    import torch

    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import model_bytes

    model = models.qwen3_shaped()
    weights, largest_unit = model_bytes(model.thinker, torch.float32)
    environment = {key: value for key, value in os.environ.items() if key != MEMORY_BUDGET_ENV}
    # the quality gate open: on random weights every distribution is near-flat, so top-1 agreement says nothing
    int4 = ["--quantize", "int4", "--min-top1", "0", "--max-perplexity-increase", "100"]
    runs = {
        "no-verify": (["--no-verify"], environment),
        "verify, whole": (["--verify"], environment),
        "verify, streamed": (["--verify"], {**environment, MEMORY_BUDGET_ENV: str(weights + largest_unit)}),
        "int4, no-verify": ([*int4[:2], "--no-verify"], environment),  # the quality limits are --verify's
        "int4, verify, whole": ([*int4, "--verify"], environment),
        # the budget of the streamed int4 check (two sessions of the graph, one layer float and dequantized) is set
        # once the graph's size is known, from the int4 no-verify run
        "int4, verify, streamed": ([*int4, "--verify"], None),
    }
    result = {
        "command": command_line(),
        "machine": {
            "platform": platform.platform(),
            "cpu": machine_name(),
            "cpus": os.cpu_count(),
            "load_average_before": load_average(),
        },
        "model": {
            "name": model.name,
            "weights_bytes": weights,
            "largest_unit_bytes": largest_unit,
        },
        "runs": {},
    }
    int4_graph = 0  # set by the int4 no-verify run, before the streamed int4 run needs it
    work = Path(tempfile.mkdtemp(prefix="thinker-verify-memory-"))
    try:
        for name, (options, env) in runs.items():
            output = work / name.replace(", ", "-")
            if env is None:
                budget = 2 * int4_graph + 2 * largest_unit
                env = {**environment, MEMORY_BUDGET_ENV: str(budget)}
            seconds, peak, _ = run_measured([*EXPORT, str(model.thinker), str(output), *options], env)
            report = json.loads((output / "export_report.json").read_text())
            if name == "int4, no-verify":
                int4_graph = report["sizes"]["model.onnx.data"]
                result["model"]["int4_graph_bytes"] = int4_graph
            verify = report["verify"] or {}
            result["runs"][name] = {
                "seconds": round(seconds, 1),
                "peak_rss_bytes": peak["VmHWM"],
                "reference": verify.get("reference"),
                # a quantized export's graph check: the graph against the PyTorch model with its dequantized weights
                "max_abs_diff": verify.get("graph", verify).get("max_abs_diff"),
                "top1_agreement": verify.get("graph", verify).get("top1_agreement"),
                "passed": verify.get("passed"),
                # the deep-cache pass goes as deep as the budget the plan leaves allows (export/deep_cache.py)
                "deep_cache_slots": verify.get("graph", verify).get("deep_cache", {}).get("random_slots", 0),
            }
            print(name, json.dumps(result["runs"][name]), flush=True)
            shutil.rmtree(output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["load_average_after"] = load_average()
    return result


def report(result: dict) -> str:
    model = result["model"]
    gib = 2**30
    lines = [
        f"Command: `{result['command']}`. {model['name']}: {model['weights_bytes'] / gib:.2f} GiB of float32 weights, "
        f"largest streamed unit {model['largest_unit_bytes'] / gib:.2f} GiB; load average "
        f"{result['machine']['load_average_before']:.1f} before, {result['machine']['load_average_after']:.1f} after.",
        "",
        "| `thinker export` | wall (s) | peak RSS (GiB) | peak RSS / weights | verify max abs Δlogit | top-1 "
        "| deep-cache slots |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        diff = "—" if run["max_abs_diff"] is None else f"{run['max_abs_diff']:.2e}"
        top1 = "—" if run["top1_agreement"] is None else f"{run['top1_agreement']:.0%}"
        rss = run["peak_rss_bytes"]
        lines.append(
            f"| {name} | {run['seconds']} | {rss / gib:.2f} | {rss / model['weights_bytes']:.2f}x | {diff} | {top1} "
            f"| {run.get('deep_cache_slots', '—') if run['passed'] is not None else '—'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="print the README table from the last run")
    args = parser.parse_args()
    if not args.report:
        write_result(RESULTS, json.dumps(measure(), indent=2) + "\n")
    print(report(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
