"""What ``thinker export --verify`` holds in memory, whole and streamed, on the Qwen3-0.6B-shaped model.

``--verify`` runs the PyTorch Thinker beside the graph's onnxruntime session. Where both fit in the memory
available it loads the PyTorch model whole; where they do not, but the session and one layer do, it streams the
PyTorch model from the Thinker folder one layer at a time (export/verify.py ``verify_plan``). This bench exports the
same folder (``bench/models.py`` qwen3-0.6b: 28 layers, 596 M parameters, float32, random weights) three ways, each
in a fresh process whose /proc status is sampled every few milliseconds:

1. ``--no-verify``: the export alone;
2. ``--verify`` with the machine's own budget: the whole model beside the session;
3. ``--verify`` with ``THINKER_VERIFY_MEMORY`` set to the graph's bytes plus the largest layer's, so that only the
   streamed check fits: the same graph checked layer by layer.

It reports each one's wall time and peak resident set (VmHWM), and the verify figures of 2 and 3, which compare the
same graph on the same inputs and must agree.

    python bench/bench_verify_memory.py            # about 3 minutes on 2 cores, after the model is built
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import models  # noqa: E402
from bench_convert import load_average, run_measured  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "verify_memory.json"
EXPORT = [sys.executable, "-c", "from common.cli import main; main()", "export"]


def measure() -> dict:
    import torch

    from converter.parity import MEMORY_BUDGET_ENV
    from export.verify import model_bytes

    model = models.qwen3_shaped()
    weights, largest_unit = model_bytes(model.thinker, torch.float32)
    environment = {key: value for key, value in os.environ.items() if key != MEMORY_BUDGET_ENV}
    runs = {
        "no-verify": (["--no-verify"], environment),
        "verify, whole": (["--verify"], environment),
        "verify, streamed": (["--verify"], {**environment, MEMORY_BUDGET_ENV: str(weights + largest_unit)}),
    }
    result = {
        "command": "python bench/bench_verify_memory.py",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average_before": load_average()},
        "model": {"name": model.name, "weights_bytes": weights, "largest_unit_bytes": largest_unit},
        "runs": {},
    }
    work = Path(tempfile.mkdtemp(prefix="thinker-verify-memory-"))
    try:
        for name, (options, env) in runs.items():
            output = work / name.replace(", ", "-")
            seconds, peak, _ = run_measured([*EXPORT, str(model.thinker), str(output), *options], env)
            report = json.loads((output / "export_report.json").read_text())
            verify = report["verify"] or {}
            result["runs"][name] = {
                "seconds": round(seconds, 1),
                "peak_rss_bytes": peak["VmHWM"],
                "reference": verify.get("reference"),
                "max_abs_diff": verify.get("max_abs_diff"),
                "top1_agreement": verify.get("top1_agreement"),
                "passed": verify.get("passed"),
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
        "| `thinker export` | wall (s) | peak RSS (GiB) | peak RSS / weights | verify max abs Δlogit | top-1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        diff = "—" if run["max_abs_diff"] is None else f"{run['max_abs_diff']:.2e}"
        top1 = "—" if run["top1_agreement"] is None else f"{run['top1_agreement']:.0%}"
        rss = run["peak_rss_bytes"]
        lines.append(
            f"| {name} | {run['seconds']} | {rss / gib:.2f} | {rss / model['weights_bytes']:.2f}x | {diff} | {top1} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="print the README table from the last run")
    args = parser.parse_args()
    if not args.report:
        RESULTS.write_text(json.dumps(measure(), indent=2) + "\n")
    print(report(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
