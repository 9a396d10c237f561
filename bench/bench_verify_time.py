"""How long ``thinker export --verify``'s check takes, this checkout against an earlier commit, on the same exports.

The check (export/verify.py for a float export, export/quantized_verify.py for a quantized one) runs the PyTorch
Thinker beside onnxruntime over every pass: the parity batch, the long prompts, the deep cache, the continuation,
the padded-around rows and the vocabulary's edges, on model.onnx and again on model.genai.onnx. This bench exports
each case once (``--no-verify``; int4 with ``--no-awq``, so that the check runs against the folder itself: the
scales change the weights' values, not the check's work), then times the check alone in fresh processes, the code
of ``--before`` (a git worktree of that commit) and this checkout's taking turns, ``--reps`` each, with the peak
resident set of each process. Both must give the same verdict and the same largest difference on the parity batch
on every case: a faster check that judged otherwise would be a different check (the deep-cache pass's figures may
move between commits that draw its random slots differently).

    python bench/bench_verify_time.py --before 375d6af          # about 12 minutes on 2 cores, models built
    python bench/bench_verify_time.py --report                  # the README table, from the results file
    python bench/bench_verify_time.py --before b6cef91 --cases "smollm2 float16" \
        --output bench/results/verify_time_half.json            # a half-precision check's cost

Cases: the real SmolLM2-135M (float32 and int4) and the Qwen3-0.6B-shaped model (bench/models.py: 28 layers, random
weights; float32 and int4, the quality gate open, as bench/bench_verify_memory.py runs it); on request, SmolLM2 in
float16, whose check runs the reference again in float16 and on perturbed inputs (export/half_spread.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import models  # noqa: E402
from bench_convert import load_average, run_measured  # noqa: E402
from report import fmt, median_interval, ratio_cell, ratio_interval, table  # noqa: E402
from results_io import command_line, machine_name, result_file, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).with_name("results") / "verify_time.json"
EXPORT = [sys.executable, "-c", "from thinker_common.cli import main; main()", "export"]
# The check alone, in the code on PYTHONPATH; prints its verdict and figures as one JSON line.
CHECK = """
import json, sys, torch
from pathlib import Path
model_dir, onnx_path, bits, dtype = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4])
if bits:
    from export.quantized_verify import QualityGate, verify_quantized_export
    gate = QualityGate(min_top1=0.0, max_perplexity_increase=100.0)
    result = verify_quantized_export(model_dir, onnx_path, dtype, bits, gate)
    graph = result["graph"]
else:
    from export.verify import verify_export
    result = graph = verify_export(model_dir, onnx_path, dtype)
import export.verify
print(json.dumps({"code": export.verify.__file__, "passed": result["passed"], "failure": result.get("failure"),
                  "max_abs_diff": graph["max_abs_diff"], "tolerance": graph["tolerance"]}))
"""
CASES = {  # name -> (model, export options, bits)
    "smollm2 float32": ("smollm2", [], 0),
    "smollm2 int4": ("smollm2", ["--quantize", "int4", "--no-awq"], 4),
    "qwen3-0.6b float32": ("qwen3-0.6b", [], 0),
    "qwen3-0.6b int4": ("qwen3-0.6b", ["--quantize", "int4", "--no-awq"], 4),
    # a half-precision check's own runs (export/half_spread.py): the reference again in float16, and perturbed
    "smollm2 float16": ("smollm2", ["--dtype", "float16"], 0),
}
DEFAULT_CASES = [name for name in CASES if "float16" not in name]  # README's first table


def bench_model(name: str):
    return models.smollm2() if name == "smollm2" else models.qwen3_shaped()


def worktree_at(revision: str, work: Path) -> tuple[Path, str]:
    """A checkout of ``revision`` under ``work`` (git worktree, detached), and its full commit id."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if commit.returncode:
        raise SystemExit(f"--before {revision}: not a commit of {REPO}")
    tree = work / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), revision], check=True)
    return tree, commit.stdout.strip()


def measure(before: str, reps: int, cases: list[str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="thinker-verify-time-"))
    tree = None
    try:
        tree, commit = worktree_at(before, work)
        here = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        base = dict(os.environ, TQDM_DISABLE="1")
        code = {"before": tree, "after": REPO}
        result = {
            "command": command_line(),
            "machine": {"cpu": machine_name(), "cpus": os.cpu_count(), "load_average_before": load_average()},
            "before": commit,
            "after": here.stdout.strip() + (" (uncommitted changes)" if dirty() else ""),
            "reps": reps,
            "cases": {},
        }
        for name in cases:
            model_name, options, bits = CASES[name]
            model = bench_model(model_name)
            output = work / name.replace(" ", "-")
            export = [*EXPORT, str(model.thinker), str(output), "--no-verify", *options]
            run_measured(export, base | {"PYTHONPATH": str(REPO)})  # the same graph for both sides
            runs = {"before": [], "after": []}
            for rep in range(reps):
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                for side in order:
                    env = base | {"PYTHONPATH": str(code[side])}
                    dtype = options[options.index("--dtype") + 1] if "--dtype" in options else "float32"
                    arguments = [str(model.thinker), str(output / "model.onnx"), str(bits), dtype]
                    command = [sys.executable, "-c", CHECK, *arguments]
                    # run outside both trees: ``python -c`` puts its working directory before PYTHONPATH, which
                    # ran this checkout's code on both sides from the repository's root
                    seconds, peak, printed = run_measured(command, env, cwd=work)
                    verdict = json.loads(printed.strip().splitlines()[-1])
                    if verdict.pop("code") != str(code[side] / "export" / "verify.py"):
                        raise SystemExit(f"the {side} side ran {verdict} rather than {code[side]}'s code")
                    runs[side].append({"seconds": round(seconds, 2), "peak_rss_bytes": peak["VmHWM"], **verdict})
                    print(name, side, json.dumps(runs[side][-1]), flush=True)
            shutil.rmtree(output)
            result["cases"][name] = runs
        result["machine"]["load_average_after"] = load_average()
        return result
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def dirty() -> bool:
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    return bool(status.stdout.strip())


def report(result: dict) -> str:
    gib = 2**30
    rows = []
    for name, runs in result["cases"].items():
        before, after = runs["before"], runs["after"]
        wall = [[run["seconds"] for run in side] for side in (before, after)]
        peak = [[run["peak_rss_bytes"] / gib for run in side] for side in (before, after)]
        same = all((b["passed"], b["max_abs_diff"]) == (a["passed"], a["max_abs_diff"]) for b in before for a in after)
        rows.append(
            [
                name,
                fmt(median_interval(wall[0])[0]),
                fmt(median_interval(wall[1])[0]),
                ratio_cell(ratio_interval(wall[1], wall[0])),
                fmt(max(peak[0]), 2),
                fmt(max(peak[1]), 2),
                "yes" if same else "**no**",
                fmt(after[0]["max_abs_diff"] / after[0]["tolerance"], 3) if after[0]["tolerance"] else "—",
            ]
        )
    header = [
        "case",
        "check before (s)",
        "check after (s)",
        "after / before",
        "peak before (GiB)",
        "peak after (GiB)",
        "same verdict and batch max abs Δlogit",
        "batch max abs Δlogit / tolerance",
    ]
    intro = (
        f"Command: `{result['command']}`. Before: {result['before'][:7]}; after: {result['after'][:7]}; "
        f"{result['reps']} fresh processes each, taking turns; {result['machine']['cpu']}, load average "
        f"{result['machine']['load_average_before']:.1f} before, {result['machine']['load_average_after']:.1f} after."
    )
    return intro + "\n\n" + table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the commit whose check to time against this checkout's")
    parser.add_argument("--reps", type=int, default=2, help="fresh processes per side and case (default 2)")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument(
        "--output", type=result_file, default=RESULTS, help=f"the results file (default {RESULTS.relative_to(REPO)})"
    )
    parser.add_argument("--report", action="store_true", help="print the README table from the last run's file")
    args = parser.parse_args()
    if not args.report:
        if not args.before:
            parser.error("--before REV is needed to measure (or --report to print the last run)")
        cases = [case.strip() for case in args.cases.split(",") if case.strip()]
        unknown = [case for case in cases if case not in CASES]
        if unknown:
            parser.error(f"unknown case {unknown[0]!r}; choose from: {', '.join(CASES)}")
        write_result(args.output, json.dumps(measure(args.before, args.reps, cases), indent=2) + "\n")
    print(report(json.loads(args.output.read_text())))


if __name__ == "__main__":
    main()
