"""Float16 exports of tiny hybrid models under ``--verify``: which sound ones the check passes, with its rules as they
are and as they were, and that a planted bug in either graph still fails.

The builds are a QA run's, of other shapes than the tests' (tests/references/hybrid.py's configs with these
widths; transformers' own classes, random weights from each seed): Qwen3.5 (hidden 64, MLP 72), Qwen3.5-MoE (a:
hidden 64, 16 experts, top 4, expert width 24, shared 40; b: hidden 48, 5 experts, top 1, width 36, shared 20) and
Qwen3-Next (a: hidden 64, 8 experts, top 3, width 40, shared 28; b: hidden 96, 4 experts, top 2, width 20, shared 52,
not renormalised). Each is converted and exported ``--dtype float16`` with the fused graph, unchecked, and the check
(export/verify.py ``verify_export``) then runs on it:

- as it runs now;
- with four perturbed samples per step of several positions and no more where the graph lands beyond
  (export/half_spread.py MOST_PERTURBED_SAMPLES = PERTURBED_SAMPLES);
- with one perturbed sample per step, as before;
- with onnxruntime-genai's graph's passes judged alone (export/verify.py ``judged_beside`` and the excused
  positions its counterpart allows left out), as before;
- with both, the check as it was;
- and, as it runs now, on a copy whose last full-attention layer's output projection is scaled 1.5x in model.onnx,
  then in model.genai.onnx alone: each must fail.

    python bench/bench_half_hybrid.py                # every build, seeds 0 and 1
    python bench/bench_half_hybrid.py --builds qwen3_next-a --seeds 1
    python bench/bench_half_hybrid.py --report       # README's table, from bench/results/half_hybrid.json

Writes bench/results/half_hybrid.json and prints README's table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from results_io import command_line, machine_name, names_from, positive_int, writable_folder, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

import torch  # noqa: E402
from export_helpers import qa_build, scale_graph_weight  # noqa: E402
from references.hybrid import HALF_QA_BUILDS as BUILDS  # noqa: E402

import export.verify as verify  # noqa: E402
from export import half_spread  # noqa: E402
from export.exporter import export_model  # noqa: E402

RESULTS = REPO / "bench" / "results" / "half_hybrid.json"
PLANTED_WEIGHT = "model.layers.3.self_attn.o_proj.weight"  # the last full-attention layer's (hybrid.LAYER_TYPES)
PLANT_FACTOR = 1.5


@contextlib.contextmanager
def samples(count: int | None = None):
    """``count`` perturbed float32 runs per step of several positions (None: PERTURBED_SAMPLES), and no more where
    the graph lands beyond (export/half_spread.py MOST_PERTURBED_SAMPLES)."""
    original = half_spread.PERTURBED_SAMPLES, half_spread.MOST_PERTURBED_SAMPLES
    count = count or original[0]
    half_spread.PERTURBED_SAMPLES = half_spread.MOST_PERTURBED_SAMPLES = count
    try:
        yield
    finally:
        half_spread.PERTURBED_SAMPLES, half_spread.MOST_PERTURBED_SAMPLES = original


def one_perturbed_sample():
    """One perturbed float32 run per step, as before PERTURBED_SAMPLES."""
    return samples(1)


@contextlib.contextmanager
def genai_passes_alone():
    """onnxruntime-genai's graph's passes at their own tolerance and their own share of excused positions, as
    before ``judged_beside``."""
    judge, beside = verify.judge, verify.judged_beside
    verify.judge = lambda figures, tolerance, against="", excusable=0: judge(figures, tolerance, against)
    verify.judged_beside = lambda result: None
    try:
        yield
    finally:
        verify.judge, verify.judged_beside = judge, beside


RULES = {
    "now": contextlib.nullcontext,
    "no_more_samples": samples,
    "one_sample": one_perturbed_sample,
    "genai_alone": genai_passes_alone,
    "before": lambda: _both(one_perturbed_sample, genai_passes_alone),
}


@contextlib.contextmanager
def _both(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        yield


def checked(folder: Path, onnx_folder: Path) -> dict:
    """The check's verdict on ``onnx_folder``'s graphs: passed, and the failure where it failed."""
    result = verify.verify_export(folder, onnx_folder / "model.onnx", torch.float16, threads=1)
    excused = {
        key: f["positions_excused"] for key, f in result.items() if isinstance(f, dict) and f.get("positions_excused")
    }
    return {"passed": result["passed"], "failure": result.get("failure"), "positions_excused": excused}


def measure(root: Path, name: str, seed: int) -> dict:
    folder = qa_build(root, name, seed)
    onnx_folder = root / f"{name}-{seed}-onnx"
    export_model(folder, onnx_folder, dtype="float16", progress=False, verify=False, threads=1)
    row: dict = {"build": name, "seed": seed}
    for rules, context in RULES.items():
        with context():
            row[rules] = checked(folder, onnx_folder)
    for graph in ("model.onnx", "model.genai.onnx"):
        planted = root / f"{name}-{seed}-planted"
        shutil.rmtree(planted, ignore_errors=True)
        shutil.copytree(onnx_folder, planted)
        scale_graph_weight(planted / graph, PLANTED_WEIGHT, PLANT_FACTOR)
        row[f"planted in {graph}"] = checked(folder, planted)
    return row


def refusal(run: dict) -> str:
    """Why the check refused, in a table cell: its first failure's figure and the pass it ran."""
    if run["passed"]:
        return ""
    where, _, why = run["failure"].split("; ")[0].partition(": ")
    share = re.match(r"(\d+ of \d+) positions lie beyond the tolerance ([0-9.]+)", why)
    router = re.match(r"the graph's MoE routers' probabilities lie ([0-9.]+) .*?> tolerance ([0-9.]+)", why)
    logits = re.match(r"max \|Δlogit\| ([0-9.]+).*> tolerance ([0-9.]+)", why)
    if share:
        said = f"{share.group(1)} positions beyond {share.group(2)}, where half precision moves the reference as far"
    elif router:
        said = f"router Δp {router.group(1)} > {router.group(2)}"
    elif logits:
        said = f"max \\|Δlogit\\| {logits.group(1)} > {logits.group(2)}"  # a table cell's pipes
    else:
        said = why
    return f"{said} ({where.removeprefix('model.onnx on ')})"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| build | seed | now | four samples, no more | one perturbed sample | genai passes alone | before (one "
        "sample, genai alone) | refused now: the first failure | o_proj 1.5x in model.onnx | in model.genai.onnx |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    graphs = ("model.onnx", "model.genai.onnx")
    for row in rows:
        cells = ["passes" if row[key]["passed"] else "refused" for key in RULES] + [refusal(row["now"])]
        cells += ["passes" if row[f"planted in {graph}"]["passed"] else "fails" for graph in graphs]
        lines.append(f"| {row['build']} | {row['seed']} | " + " | ".join(cells) + " |")
    totals = [f"{sum(row[key]['passed'] for row in rows)} of {len(rows)}" for key in RULES]
    caught = [
        f"{sum(not row[f'planted in {graph}']['passed'] for row in rows)} of {len(rows)} fail" for graph in graphs
    ]
    lines.append("| **sound exports passed** | | " + " | ".join([*totals, "", *caught]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builds", type=names_from(BUILDS), default=list(BUILDS))
    parser.add_argument("--seeds", type=positive_int, default=2, help="seeds 0 .. N-1 of each build")
    parser.add_argument("--report", action="store_true", help="print README's table from the last run's file")
    args = parser.parse_args()
    if args.report:
        print(markdown(json.loads(RESULTS.read_text())["rows"]))
        return
    writable_folder(RESULTS.parent)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="half-hybrid-") as tmp:
        for name in args.builds:
            for seed in range(args.seeds):
                rows.append(measure(Path(tmp), name, seed))
                print(json.dumps(rows[-1]), flush=True)
    print("\n" + markdown(rows))
    write_result(
        RESULTS, json.dumps({"command": command_line(), "machine": machine_name(), "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
