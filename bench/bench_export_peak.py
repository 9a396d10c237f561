"""Peak memory of ``thinker export --quantize`` on the real SmolLM2-135M, with and without the accuracy guard.

The speed issue's export goal is a peak RSS of at most 1.6x the float32 model's bytes. One fresh export's peak
moves by about ±50 MB on this machine, and bench_quantize.py exports each variant once, so this bench exports each
of ``--variants`` (bench_quantize.VARIANTS' flags, ``--no-verify``) ``--reps`` times, the variants interleaved,
each in a fresh process, and reports the median wall and peak RSS, and the peak as a multiple of the float32 fused
export's bytes (the denominator bench_fast.py uses). The pairs with and without the guard (int8 / int8-acc1,
int4 / int4-noguard) price the guard's onnxruntime sessions.

    python bench/bench_export_peak.py                  # about 3 minutes on 2 shared cores
    python bench/bench_export_peak.py --variants int8,int8-acc1 --reps 5
    python bench/bench_export_peak.py --variants int4,int4-rtn,int8,int8-rtn,builder-int4,builder-int8

``builder-int4`` / ``builder-int8`` (onnxruntime-genai's builder, ``-p int4|int8 -e cpu``) take their turns with
ours, so the export-wall goal (at most 2x the builder's) is a ratio from one run.

Writes bench/results/export_peak.json and bench/results/README-export-peak.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from results_io import command_line, machine_name, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
from bench_quantize import VARIANTS, export_variant  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 1.6  # peak RSS / float32 model bytes
BUILDERS = ("builder-int4", "builder-int8")  # onnxruntime-genai's builder, -p int4 / int8 -e cpu (bench/exports.py)


def markdown(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}`; {results['reps']} fresh exports of each variant, interleaved; medians (and"
        f" the range); the float32 fused export is {results['float32_model_bytes'] / 1e6:.0f} MB; wall against the"
        " builder's export of the same bit width in this run (goal ≤ 2x).",
        "",
        "| variant | flags | wall (s) | / builder's | peak RSS (MB) | range (MB) | / float32 model bytes | goal ≤ 1.6x"
        " |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = results["variants"]
    for name, row in rows.items():
        ratio = row["peak_rss_median"] / results["float32_model_bytes"]
        low, high = min(row["peak_rss"]) / 1e6, max(row["peak_rss"]) / 1e6
        peaks = f"{row['peak_rss_median'] / 1e6:.0f} | {low:.0f}-{high:.0f}"
        builder = rows.get(f"builder-{name.split('-')[0]}") if not name.startswith("builder-") else None
        wall = f"{row['seconds_median'] / builder['seconds_median']:.2f}x" if builder else "—"
        lines.append(
            f"| {name} | `{flags(name)}` | {row['seconds_median']:.1f} | {wall} | {peaks} | {ratio:.2f}x "
            f"| {'met' if ratio <= GOAL else 'not met'} |"
        )
    return "\n".join(lines) + "\n"


def flags(name: str) -> str:
    return f"builder -p {name.removeprefix('builder-')} -e cpu" if name in BUILDERS else " ".join(VARIANTS[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="int8,int8-acc1,int4,int4-noguard")
    parser.add_argument("--reps", type=positive_int, default=3)
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := sorted(set(names) - set(VARIANTS) - set(BUILDERS)):
        parser.error(f"--variants: {', '.join(unknown)} not among {', '.join([*VARIANTS, *BUILDERS])}")

    model = models.smollm2()
    float32 = exp.run_export("ours-fused", model, threads=2, fresh=False)
    rows: dict[str, dict] = {name: {"seconds": [], "peak_rss": []} for name in names}
    started = time.perf_counter()
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            print(f"  rep {rep + 1}/{args.reps}: export {name}", file=sys.stderr, flush=True)
            if name in BUILDERS:
                built = exp.run_export(name, model, threads=2, fresh=True)
                if built.error:
                    raise SystemExit(f"the builder's export {name} failed: {built.error}")
                figures = {"seconds": built.seconds, "peak_rss": built.peak_rss}
            else:
                _, figures = export_variant(name, model, fresh=True)
            rows[name]["seconds"].append(figures["seconds"])
            rows[name]["peak_rss"].append(figures["peak_rss"])
    for row in rows.values():
        row["seconds_median"] = statistics.median(row["seconds"])
        row["peak_rss_median"] = statistics.median(row["peak_rss"])
    results = {
        "command": command_line(),
        "machine": machine_name(),
        "reps": args.reps,
        "float32_model_bytes": exp.folder_bytes(float32.folder),
        "variants": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "export_peak.json"), json.dumps(results, indent=2) + "\n")
    write_result((RESULTS / "README-export-peak.md"), markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
