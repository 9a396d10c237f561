"""Float32 exports of tiny hybrid models under ``--verify``: which sound ones the check passes against PyTorch's
float32 run alone (as before) and with its second opinion, the reference run in float64 where the float32 run
refuses on logits (export/exact_reference.py), and that a planted bug in either graph still fails.

The builds are bench/bench_half_hybrid.py's (a QA run's Qwen3.5, Qwen3.5-MoE and Qwen3-Next of other widths than
the tests', tests/references/hybrid.py HALF_QA_BUILDS; transformers' own classes, random weights from each seed).
Each is converted and exported float32, fused and plain, unchecked, and the check then runs on it, on its own
(``verify_export``): "before" is the float32 run's verdict, which the report keeps where the float64 run replaced
it. Then, on copies whose last full-attention layer's output projection is scaled 1.01x in model.onnx, then in
model.genai.onnx alone (the fused graph's; the plain graph is onnxruntime-genai's too): each must fail. Each
check's time is recorded.

What the second run costs at a real size (``--smollm2 REPS``): the real SmolLM2-135M exported float32, its last
layer's output projection scaled 1.01x in model.onnx, checked in fresh processes taking turns, with the second
opinion (``verify_export``) and against float32 alone (``checked_against``, the check as before), wall time and
peak resident set of each.

    python bench/bench_exact_reference.py --smollm2 3    # every build, seeds 0 and 1, and SmolLM2's cost
    python bench/bench_exact_reference.py --builds qwen3_5_moe-b --seeds 2
    python bench/bench_exact_reference.py --report       # README's table, from bench/results/exact_reference.json

Writes bench/results/exact_reference.json and prints README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_convert import run_measured
from results_io import command_line, machine_name, names_from, positive_int, writable_folder, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

import torch  # noqa: E402
from export_helpers import qa_build, scale_graph_weight  # noqa: E402
from references.hybrid import HALF_QA_BUILDS as BUILDS  # noqa: E402

from export.exact_reference import FLOAT32_REFUSAL, FLOAT64_REFUSAL  # noqa: E402
from export.exporter import export_model  # noqa: E402
from export.verify import verify_export  # noqa: E402

RESULTS = REPO / "bench" / "results" / "exact_reference.json"
PLANTED_WEIGHT = "model.layers.3.self_attn.o_proj.weight"  # the last full-attention layer's (hybrid.LAYER_TYPES)
PLANT_FACTOR = 1.01
GRAPHS = ("fused", "plain")
SMOLLM2_PLANTED_WEIGHT = "model.layers.29.self_attn.o_proj.weight"  # its last layer's
# The check alone in a fresh process, with its second opinion ("second") or against float32 alone ("float32").
CHECK = """
import json, sys, torch
from pathlib import Path
from export import verify
model_dir, onnx_path, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if mode == "second":
    result = verify.verify_export(model_dir, onnx_path, torch.float32)
else:
    result, _ = verify.checked_against(verify.REFERENCE_DTYPE, model_dir, onnx_path, torch.float32, None, False,
                                       verify.verify_plan(model_dir, torch.float32), None)
print(json.dumps({"passed": result["passed"], "reference": result["reference"], "failure": result.get("failure")}))
"""


def checked(folder: Path, onnx_folder: Path) -> dict:
    """The check's verdicts on ``onnx_folder``'s graphs (the float32 run's, and the one that stands), its first
    failure where refused, and its time."""
    start = time.perf_counter()
    result = verify_export(folder, onnx_folder / "model.onnx", torch.float32, threads=1)
    seconds = time.perf_counter() - start
    float32_failure = result.get(FLOAT32_REFUSAL) or (None if result["passed"] else result["failure"])
    return {
        "passed": result["passed"],
        "passed_against_float32": float32_failure is None,
        "judged_again": FLOAT32_REFUSAL in result or FLOAT64_REFUSAL in result,
        "float32_failure": float32_failure,
        "failure": result.get("failure"),
        "seconds": round(seconds, 2),
    }


def measure(root: Path, name: str, seed: int) -> list[dict]:
    folder = qa_build(root, name, seed)
    rows = []
    for graph in GRAPHS:
        onnx_folder = root / f"{name}-{seed}-{graph}"
        export_model(folder, onnx_folder, graph=graph, progress=False, verify=False, threads=1)
        row: dict = {"build": name, "seed": seed, "graph": graph, "sound": checked(folder, onnx_folder)}
        for planted_graph in ("model.onnx", "model.genai.onnx"):
            if not (onnx_folder / planted_graph).exists():  # the plain graph writes model.onnx alone
                continue
            planted = root / f"{name}-{seed}-planted"
            shutil.rmtree(planted, ignore_errors=True)
            shutil.copytree(onnx_folder, planted)
            scale_graph_weight(planted / planted_graph, PLANTED_WEIGHT, PLANT_FACTOR)
            row[f"planted in {planted_graph}"] = checked(folder, planted)
        rows.append(row)
    return rows


def first_failure(failure: str | None) -> str:
    """A failure's first part, in a table cell (its pipes escaped)."""
    return "" if not failure else failure.split("; ")[0].replace("|", "\\|")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| build | seed | graph | against float32 alone (before) | now | the float32 run's refusal | o_proj 1.01x in "
        "model.onnx | in model.genai.onnx |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plants = ("planted in model.onnx", "planted in model.genai.onnx")
    for row in rows:
        sound = row["sound"]
        cells = ["passes" if sound["passed_against_float32"] else "refused", "passes" if sound["passed"] else "refused"]
        cells += [first_failure(sound["float32_failure"])]
        cells += ["" if plant not in row else "passes" if row[plant]["passed"] else "fails" for plant in plants]
        lines.append(f"| {row['build']} | {row['seed']} | {row['graph']} | " + " | ".join(cells) + " |")
    before = sum(row["sound"]["passed_against_float32"] for row in rows)
    now = sum(row["sound"]["passed"] for row in rows)
    caught = []
    for plant in plants:
        planted = [row[plant] for row in rows if plant in row]
        caught.append(f"{sum(not check['passed'] for check in planted)} of {len(planted)} fail")
    totals = f"| **sound exports passed** | | | {before} of {len(rows)} | {now} of {len(rows)} | | "
    lines.append(totals + " | ".join(caught) + " |")
    return "\n".join(lines)


def smollm2_cost(reps: int) -> dict:
    """SmolLM2-135M's planted float32 export checked ``reps`` times each way, in fresh processes taking turns."""
    import models

    model = models.smollm2()
    runs: dict[str, list] = {"float32": [], "second": []}
    with tempfile.TemporaryDirectory(prefix="exact-reference-smollm2-") as tmp:
        output = Path(tmp) / "onnx"
        export_model(model.thinker, output, progress=False, verify=False)
        scale_graph_weight(output / "model.onnx", SMOLLM2_PLANTED_WEIGHT, PLANT_FACTOR)
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=str(REPO))
        for rep in range(reps):
            for mode in ("float32", "second") if rep % 2 == 0 else ("second", "float32"):
                command = [sys.executable, "-c", CHECK, str(model.thinker), str(output / "model.onnx"), mode]
                seconds, peak, printed = run_measured(command, env, cwd=Path(tmp))
                verdict = json.loads(printed.strip().splitlines()[-1])
                runs[mode].append({"seconds": round(seconds, 2), "peak_rss_bytes": peak["VmHWM"], **verdict})
                print("smollm2", mode, json.dumps(runs[mode][-1]), flush=True)
    return runs


def smollm2_words(runs: dict) -> str:
    """The cost line: the medians of both ways, and their ratios."""
    medians = {
        mode: (statistics.median(r["seconds"] for r in checks), statistics.median(r["peak_rss_bytes"] for r in checks))
        for mode, checks in runs.items()
    }
    (alone, alone_peak), (second, second_peak) = medians["float32"], medians["second"]
    return (
        f"SmolLM2-135M, o_proj 1.01x: refused against float32 alone in {alone:.1f} s (peak {alone_peak / 2**30:.2f} "
        f"GiB), and with the second opinion in {second:.1f} s ({second / alone:.2f}x; peak {second_peak / 2**30:.2f} "
        f"GiB, {second_peak / alone_peak:.2f}x), medians of {len(runs['float32'])} fresh processes each"
    )


def cost(rows: list[dict]) -> str:
    """What a second run costs: the median check's time judged once and judged again (sound and planted alike)."""
    keys = ("sound", "planted in model.onnx", "planted in model.genai.onnx")
    checks = [row[key] for row in rows for key in keys if key in row]
    once = [check["seconds"] for check in checks if not check["judged_again"]]
    again = [check["seconds"] for check in checks if check["judged_again"]]
    if not once or not again:
        return "every check ran " + ("once" if once else "twice")
    return (
        f"median check {statistics.median(once):.2f} s run once ({len(once)} checks), "
        f"{statistics.median(again):.2f} s judged again in float64 ({len(again)} checks)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", type=names_from(BUILDS), default=list(BUILDS))
    parser.add_argument("--seeds", type=positive_int, default=2, help="seeds 0 .. N-1 of each build")
    parser.add_argument("--smollm2", type=positive_int, metavar="REPS", help="and the second run's cost on SmolLM2")
    parser.add_argument("--report", action="store_true", help="print README's table from the last run's file")
    args = parser.parse_args()
    if args.report:
        result = json.loads(RESULTS.read_text())
        print(markdown(result["rows"]) + "\n\n" + cost(result["rows"]))
        if "smollm2" in result:
            print(smollm2_words(result["smollm2"]))
        return
    writable_folder(RESULTS.parent)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="exact-reference-") as tmp:
        for name in args.builds:
            for seed in range(args.seeds):
                for row in measure(Path(tmp), name, seed):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    result = {"command": command_line(), "machine": machine_name(), "rows": rows}
    if args.smollm2:
        result["smollm2"] = smollm2_cost(args.smollm2)
    print("\n" + markdown(rows) + "\n\n" + cost(rows))
    if args.smollm2:
        print(smollm2_words(result["smollm2"]))
    write_result(RESULTS, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
