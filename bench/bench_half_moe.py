"""Half-precision MoE exports under ``--verify``, with and without the reference following the graph's routing.

For each MoE family of the tests (tests/export/export_helpers.py: top 2 of 4 experts, random weights), each seed
and each graph: ``thinker export --dtype float16`` with its default ``--verify``, first as it runs
(export/routing.py: the reference takes the graph's experts where the two routers part), then with the reference
routing on its own (as before that module), and once with a router bug planted (the first MoE layer's experts read
backwards), which must fail. Records whether each passed, the worst pass (max |Δlogit| beyond the half-precision
spread, against its tolerance), the choices followed and the router probabilities' largest difference.

Then the check's resolution: a router bug small enough to pass as rounding, expert 0's router row scaled by 1.01
and by 1.02 in every MoE layer of the tiny Qwen3-Next (seed 0), exported float16 (routing followed, and on its own)
and float32, whose check is exact.

    python bench/bench_half_moe.py                 # five families, seeds 0-2, plain and fused
    python bench/bench_half_moe.py --seeds 1 --families qwen3_next
    python bench/bench_half_moe.py --report        # README's table, from bench/results/half_moe.json

Writes bench/results/half_moe.json and prints a table; ``--report`` prints README's table from that file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from pathlib import Path

from results_io import command_line, write_result

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]  # the tests' model builders

from export_helpers import FAMILIES, reversed_router, router_weights_edited, save_thinker  # noqa: E402

import export.routing as routing  # noqa: E402
from export.exporter import export_model  # noqa: E402
from thinker_common.errors import ThinkerError  # noqa: E402

RESULTS = REPO / "bench" / "results" / "half_moe.json"
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "qwen4_exp")
RESOLUTION_FACTORS = (1.01, 1.02)


@contextlib.contextmanager
def routing_on_its_own():
    """The reference routes by its own router, as before export/routing.py."""
    original = routing.RouteFollower.of
    routing.RouteFollower.of = classmethod(lambda cls, model, decoder: cls(model, {}))
    try:
        yield
    finally:
        routing.RouteFollower.of = original


def first_moe_layer(family: str) -> int:
    """The first MoE layer of the family's tiny model (export_helpers.FAMILIES), where the router bug is planted."""
    config = {"num_hidden_layers": 3, **FAMILIES[family]}
    dense, step = config.get("mlp_only_layers", []), config.get("decoder_sparse_step", 1)
    return next(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def scaled_router_row(factor: float):
    """Every MoE router's row of expert 0 times ``factor``: a router bug as small as rounding, ``factor`` near 1."""

    def scaled(layer: int, weight):
        weight[0] *= factor
        return weight

    return router_weights_edited(scaled)


def comparisons(report: dict, prefix: str = "") -> dict[str, dict]:
    """Every comparison of a verify report (figures holding a logit scale), by its path in the report."""
    found = {}
    for key, value in report.items():
        if isinstance(value, dict):
            if "max_abs_diff" in value and "logit_scale" in value:
                found[prefix + key] = value
            found |= comparisons(value, prefix + key + ".")
    return found


def run(folder: Path, output: Path, graph: str, dtype: str = "float16") -> dict:
    """One export with its verify: passed, the failure, and the figures over its judged comparisons."""
    try:
        report = export_model(folder, output, dtype=dtype, graph=graph, progress=False, force=True)["verify"]
        failure = None
    except ThinkerError as err:
        report, failure = getattr(err, "report", None) or {}, str(err)
    found = comparisons({"batch": report}) if report else {}
    judged = {key: f for key, f in found.items() if f.get("judged", True) and "tolerance" in f}
    worst = max(
        judged.items(),
        key=lambda kv: kv[1].get("max_abs_diff_beyond_spread", kv[1]["max_abs_diff"]) / kv[1]["tolerance"],
        default=None,
    )
    row = {"passed": failure is None, "failure": failure}
    if worst:
        key, f = worst
        row |= {
            "worst_pass": key,
            "worst_beyond_spread": f.get("max_abs_diff_beyond_spread", f["max_abs_diff"]),
            "its_tolerance": f["tolerance"],
        }
    row["routes_followed"] = sum(f.get("routes_followed", 0) for f in found.values())
    # the routers are held to their bound where a comparison is judged (a half-precision Qwen3.8's prompts that its
    # indexers prune are reported only: export/verify.py)
    routers = {key: f.get("router_max_abs_diff", 0.0) for key, f in found.items()}
    row["router_max_abs_diff"] = max((v for key, v in routers.items() if found[key].get("judged", True)), default=0.0)
    row["router_max_abs_diff_unjudged"] = max(
        (v for key, v in routers.items() if not found[key].get("judged", True)), default=None
    )
    row["comparisons"] = {
        key: {name: f.get(name) for name in ("judged", "routes_followed", "router_max_abs_diff", "max_abs_diff")}
        for key, f in found.items()
    }
    return row


def verdict(row: dict | None) -> str:
    return "" if row is None else ("pass" if row["passed"] else "FAIL")


def print_table(rows: list[dict]) -> None:
    columns = ("family", "seed", "graph", "followed", "own routing", "routes", "router dp", "router bug")
    print("\n" + " ".join(f"{column:>12}" for column in columns))
    for row in rows:
        followed = row["followed"]
        cells = (row["family"], row["seed"], row["graph"], verdict(followed), verdict(row["own_routing"]))
        cells += (followed["routes_followed"], f"{followed['router_max_abs_diff']:.3f}", verdict(row.get("router_bug")))
        print(" ".join(f"{cell:>12}" for cell in cells))


def markdown(rows: list[dict]) -> str:
    """README's table: per family, the exports that verify as the check runs and with the reference routing on its
    own, the tokens followed, the routers' largest judged difference, and the planted router bug's."""

    lines = [
        "| family | verify, routing followed | verify, own routing | tokens followed | router Δp (judged) | "
        "router bug: Δp |",
        "|---|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(row["family"] for row in rows):
        mine = [row for row in rows if row["family"] == family]
        followed = [row["followed"] for row in mine]
        own = [row["own_routing"] for row in mine]
        bugs = [row["router_bug"] for row in mine if "router_bug" in row]
        said = [re.search(r"probabilities lie ([0-9.]+)", bug["failure"] or "") for bug in bugs]
        bug = ", ".join(found.group(1) if found else "passed" for found in said)
        counts = [run["routes_followed"] for run in followed]
        lines.append(
            f"| {family} | {sum(run['passed'] for run in followed)} of {len(mine)} | "
            f"{sum(run['passed'] for run in own)} of {len(mine)} | {min(counts)}–{max(counts)} | "
            f"{max(run['router_max_abs_diff'] for run in followed):.3f} | {bug} |"
        )
    return "\n".join(lines)


def resolution_markdown(rows: list[dict]) -> str:
    """README's second table: the router row bugs, each export's verdict and its first failure's figure."""
    lines = [
        "| expert 0's router row | graph | float16, routing followed | float16, own routing | float32 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [said(row[key]) for key in ("float16", "float16_own_routing", "float32")]
        lines.append(f"| × {row['factor']} | {row['graph']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def said(run: dict) -> str:
    """``passes``, or ``fails`` with the first figure its message gives against its tolerance."""
    if run["passed"]:
        return "passes"
    found = re.search(
        r"(max \|Δlogit\| [0-9.e-]+|probabilities lie [0-9.e-]+).*?> tolerance ([0-9.e-]+)", run["failure"]
    )
    if not found:
        return "fails"
    figure = found.group(1).replace("probabilities lie ", "router Δp ").replace("|", "\\|")  # a table cell's pipes
    return f"fails ({figure} > {found.group(2)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--families", default=",".join(MOE_FAMILIES))
    parser.add_argument("--report", action="store_true", help="print README's table from the last run's file")
    args = parser.parse_args()
    if args.report:
        results = json.loads(RESULTS.read_text())
        print(markdown(results["rows"]) + "\n\n" + resolution_markdown(results["resolution"]))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="half-moe-") as tmp:
        root = Path(tmp)
        for family in args.families.split(","):
            for seed in range(args.seeds):
                folder = save_thinker(root / f"{family}-{seed}", family, seed=seed)
                for graph in ("plain", "fused"):
                    out = root / f"{family}-{seed}-{graph}"
                    row = {"family": family, "seed": seed, "graph": graph, "followed": run(folder, out, graph)}
                    with routing_on_its_own():
                        row["own_routing"] = run(folder, out, graph)
                    if seed == 0:
                        with reversed_router(first_moe_layer(family)):
                            row["router_bug"] = run(folder, out, graph)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        resolution = []
        folder = save_thinker(root / "resolution", "qwen3_next", seed=0)
        for factor in RESOLUTION_FACTORS:
            for graph in ("plain", "fused"):
                out, row = root / f"resolution-{graph}", {"factor": factor, "graph": graph}
                with scaled_router_row(factor):
                    row["float16"] = run(folder, out, graph)
                    with routing_on_its_own():
                        row["float16_own_routing"] = run(folder, out, graph)
                    row["float32"] = run(folder, out, graph, dtype="float32")
                resolution.append(row)
                print(json.dumps(row), flush=True)
    print_table(rows)
    print("\n" + markdown(rows) + "\n\n" + resolution_markdown(resolution))
    RESULTS.parent.mkdir(exist_ok=True)
    results = {"command": command_line(), "rows": rows, "resolution": resolution}
    write_result(RESULTS, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
