"""Float32 exports of tiny hybrid models under ``--verify``: which sound ones the check passes against PyTorch's
float32 run alone (as before) and with its second opinion, the reference run in float64 where the float32 run
refuses on logits (export/exact_reference.py), and that a planted bug in either graph still fails.

The builds are bench/bench_half_hybrid.py's (a QA run's Qwen3.5, Qwen3.5-MoE and Qwen3-Next of other widths than
the tests', tests/references/hybrid.py HALF_QA_BUILDS; transformers' own classes, random weights from each seed).
Each is converted and exported float32, fused and plain, unchecked, and the check then runs on it, on its own
(``verify_export``): "before" is the float32 run's verdict, which the report keeps where the float64 run replaced
it. Then, on copies whose last full-attention layer's output projection is scaled 1.01x in model.onnx, then in
model.genai.onnx alone: each must fail. Each check's time is recorded: a second run costs a refused export's check
about as much again.

    python bench/bench_exact_reference.py                # every build, seeds 0 and 1
    python bench/bench_exact_reference.py --builds qwen3_5_moe-b --seeds 2
    python bench/bench_exact_reference.py --report       # README's table, from bench/results/exact_reference.json

Writes bench/results/exact_reference.json and prints README's table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from results_io import command_line, machine_name, names_from, positive_int, writable_folder, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

import torch  # noqa: E402
from export_helpers import qa_build, scale_graph_weight  # noqa: E402
from references.hybrid import HALF_QA_BUILDS as BUILDS  # noqa: E402

from export.exact_reference import FLOAT32_REFUSAL  # noqa: E402
from export.exporter import export_model  # noqa: E402
from export.verify import verify_export  # noqa: E402

RESULTS = REPO / "bench" / "results" / "exact_reference.json"
PLANTED_WEIGHT = "model.layers.3.self_attn.o_proj.weight"  # the last full-attention layer's (hybrid.LAYER_TYPES)
PLANT_FACTOR = 1.01
GRAPHS = ("fused", "plain")


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
        "judged_again": FLOAT32_REFUSAL in result,
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
        cells += ["passes" if row[plant]["passed"] else "fails" for plant in plants]
        lines.append(f"| {row['build']} | {row['seed']} | {row['graph']} | " + " | ".join(cells) + " |")
    before = sum(row["sound"]["passed_against_float32"] for row in rows)
    now = sum(row["sound"]["passed"] for row in rows)
    caught = [f"{sum(not row[plant]['passed'] for row in rows)} of {len(rows)} fail" for plant in plants]
    totals = f"| **sound exports passed** | | | {before} of {len(rows)} | {now} of {len(rows)} | | "
    lines.append(totals + " | ".join(caught) + " |")
    return "\n".join(lines)


def cost(rows: list[dict]) -> str:
    """What a second run costs: the median check's time judged once and judged again (sound and planted alike)."""
    checks = [row[key] for row in rows for key in ("sound", "planted in model.onnx", "planted in model.genai.onnx")]
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
    parser.add_argument("--report", action="store_true", help="print README's table from the last run's file")
    args = parser.parse_args()
    if args.report:
        rows = json.loads(RESULTS.read_text())["rows"]
        print(markdown(rows) + "\n\n" + cost(rows))
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
    print("\n" + markdown(rows) + "\n\n" + cost(rows))
    write_result(
        RESULTS, json.dumps({"command": command_line(), "machine": machine_name(), "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
