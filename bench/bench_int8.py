"""Our int8 against onnxruntime-genai's builder's int8 on the real SmolLM2-135M: fidelity and decode speed.

    python bench/bench_int8.py [--reps 6] [--steps 40]

bench_quantize.py judges every quantized layout against the builder's int4; this puts ``thinker export --quantize
int8`` (its defaults: activation-aware scales, symmetric RTN in blocks of 32, accuracy level 4, the int8 head that
the tied embedding is gathered from, the accuracy guard) beside ``builder -p int8 -e cpu`` (its own defaults) on
both axes:
  fidelity  export/fidelity.py's paragraph, teacher forced, against the float PyTorch model (what ``--verify``
            reports as the cost: top-1 agreement, perplexity change), and how many tokens of a 64-token greedy
            continuation equal the float model's (bench_quantize.py's measures);
  speed     decode steps in one onnxruntime-genai process, the two folders taking turns, every repetition a fresh
            process with the load order rotated (bench_graph_ab.py --runtime genai --own-tokens), batch 1 and 8.
The exports are each tool's own under ~/.cache/thinker-bench (bench/exports.py; ours made afresh each run). A third
row, fidelity and size only, is ours with ``--embedding float --no-awq`` (plain RTN and the float table beside the
int8 head instead of the gather from it: the builder's function), which answers where the fidelity differs. Writes
bench/results/int8.json (the speed repetitions in graph_ab_smollm2-genai-int8-b1.json
/ -b8.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from results_io import command_line, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
from bench_quantize import export_variant, fidelity  # noqa: E402

RESULTS = Path(__file__).with_name("results")
BATCHES = (1, 8)
FLOAT_EMBEDDING = "ours-int8 --embedding float --no-awq"


def speed(builder: Path, ours: Path, batch: int, args) -> dict:
    tag = f"smollm2-genai-int8-b{batch}"
    command = [sys.executable, str(Path(__file__).with_name("bench_graph_ab.py")), str(builder), str(ours)]
    command += ["--runtime", "genai", "--own-tokens", "--batch", str(batch), "--reps", str(args.reps)]
    command += ["--steps", str(args.steps), "--tag", tag]
    subprocess.run(command, check=True)
    rows = json.loads((RESULTS / f"graph_ab_{tag}.json").read_text())["rows"]
    return {"results_file": f"graph_ab_{tag}.json", "builder": rows[0], "ours": rows[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=positive_int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    model = models.smollm2()
    builder = exp.run_export("builder-int8", model, threads=2, fresh=False)
    if builder.error:
        raise SystemExit(f"the builder's int8 export failed: {builder.error}")
    ours, _ = export_variant("int8", model, fresh=True)  # today's code (the builder's export is cached)
    float_embedding, _ = export_variant("int8-femb-rtn", model, fresh=True)
    folders = {"ours-int8": ours, "builder-int8": builder.folder, FLOAT_EMBEDDING: float_embedding}
    result = {
        "command": command_line(),
        "model": model.name,
        "fidelity": fidelity(model, folders),
        "model_bytes": {name: exp.folder_bytes(folder) for name, folder in folders.items()},
        "speed": {f"batch{batch}": speed(builder.folder, ours, batch, args) for batch in BATCHES},
    }
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "int8.json"), json.dumps(result, indent=2) + "\n")
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "| export | top-1 | perplexity | greedy = float | model files (MB) |"
        + "".join(f" decode b{b}: step (ms), vs builder |" for b in BATCHES),
        "|---|---|---|---|---|" + "---|" * len(BATCHES),
    ]
    for name in ("ours-int8", "builder-int8", FLOAT_EMBEDDING):
        fig = result["fidelity"]["graphs"][name]
        cells = [f"{fig['top1_agreement']:.1%}", f"{fig['perplexity_change']:+.1%}", str(fig["greedy_equal_to_float"])]
        cells.append(f"{result['model_bytes'][name] / 1e6:.1f}")
        for batch in BATCHES:
            if name == FLOAT_EMBEDDING:  # not timed: the same graph but for one Gather of a row per token
                cells.append("—")
                continue
            row = result["speed"][f"batch{batch}"]["ours" if name == "ours-int8" else "builder"]
            value, low, high = row["speed_vs_first_by_cycle"]
            cells.append(f"{row['median_step_ms']:.1f}, {value:.3f}x ({low:.3f}–{high:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
