"""How far a bfloat16 export widened to float32 parts from its reference: the figures behind ``export.verify``'s
tolerance for it (``TOLERANCES[WIDENED_BFLOAT16]``, one bfloat16 ulp of the logit scale).

Where no CUDA runs, ``thinker export --dtype bfloat16`` checks its graphs widened to float32 (export/widened.py)
against the PyTorch Thinker holding the same bfloat16 weights. Widened, a sound graph runs the reference's arithmetic
on the reference's weights and parts from it only by the scalars it writes in bfloat16 (an attention scale, GELU's
coefficients). For every family of the tests (tests/export/export_helpers.py, one seed, its own config, and again
with head_dim 16 where the family takes it, so that the fused graph rotates inside GroupQueryAttention) and the real
SmolLM2-135M, fused and plain graphs: each export's default ``--verify``, its furthest pass relative to max(1, logit
scale), and its wall time.

    python bench/bench_widened.py                  # every family and SmolLM2 (about 10 minutes on 2 cores)
    python bench/bench_widened.py --no-smollm2 --families qwen3,gpt2
    python bench/bench_widened.py --report         # README's table from the last run's file

Writes bench/results/widened.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from results_io import command_line, names_from, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

from export_helpers import FAMILIES, save_thinker  # noqa: E402
from models import smollm2  # noqa: E402

from export.exporter import export_model  # noqa: E402
from export.providers import cuda_usable  # noqa: E402

RESULTS = REPO / "bench" / "results" / "widened.json"
# The families whose configs take head_dim 16 (GroupQueryAttention's own RoPE needs a multiple of 16); the hybrids'
# multimodal sections are sized for their own head_dim.
HEAD_DIM_16 = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "uomni")


def passes(figures: dict) -> dict[str, dict]:
    """Every compared pass of a verify report, the batch's under "batch"."""
    found = {"batch": figures}
    found.update({k: v for k, v in figures.items() if isinstance(v, dict) and "max_abs_diff" in v})
    return {k: v for k, v in found.items() if "logit_scale" in v}


def measured(name: str, folder: Path, output: Path, graph: str) -> dict:
    start = time.perf_counter()
    report = export_model(folder, output, dtype="bfloat16", graph=graph, progress=False, force=True)
    wall = time.perf_counter() - start
    figures = report["verify"]
    relative = {key: f["max_abs_diff"] / max(1.0, f["logit_scale"]) for key, f in passes(figures).items()}
    worst = max(relative, key=relative.get)
    return {
        "model": name,
        "graph": graph,
        "passed": figures["passed"],
        "widened": "widened" in figures,
        "worst_relative": relative[worst],
        "worst_pass": worst,
        "tolerance_relative": figures["tolerance"] / max(1.0, figures["logit_scale"]),
        "passes": len(relative),
        "export_and_verify_s": round(wall, 1),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | graph | passed | furthest pass / max(1, logit scale) | at | export + verify (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['graph']} | {'yes' if row['passed'] else 'no'} | {row['worst_relative']:.1e} "
            f"| {row['worst_pass']} | {row['export_and_verify_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", type=names_from(list(FAMILIES)), default=list(FAMILIES))
    parser.add_argument("--no-smollm2", action="store_true")
    parser.add_argument("--report", action="store_true", help="print README's table from the last run's file")
    args = parser.parse_args()
    if args.report:
        print(markdown(json.loads(RESULTS.read_text())["rows"]))
        return
    if cuda_usable():
        sys.exit("CUDA is usable here: bfloat16 exports are verified on it, not widened; run this on a CPU machine")
    RESULTS.parent.mkdir(exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="widened-") as tmp:
        root = Path(tmp)
        models = []
        for family in args.families:
            models.append((family, save_thinker(root / family, family)))
            if family in HEAD_DIM_16:
                models.append((f"{family}, head_dim 16", save_thinker(root / f"{family}-16", family, head_dim=16)))
        if not args.no_smollm2:
            models.append(("smollm2-135m", smollm2().thinker))
        for name, folder in models:
            for graph in ("fused", "plain"):
                row = measured(name, folder, root / f"{folder.name}-{graph}", graph)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n" + markdown(rows))
    worst = max(rows, key=lambda row: row["worst_relative"])
    print(
        f"\nfurthest: {worst['model']} {worst['graph']}, {worst['worst_relative']:.2e} of the logit scale, at "
        f"{worst['worst_pass']}; tolerance {rows[0]['tolerance_relative']:.2e}"
    )
    write_result(RESULTS, json.dumps({"command": command_line(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
