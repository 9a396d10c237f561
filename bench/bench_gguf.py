"""A Qwen3.5 GGUF file at a real size: ``thinker-convert`` against transformers' own GGUF loading, and the parity
check whole and layer by layer.

Builds a random model with Qwen3.5-0.8B's text decoder shapes (``configs/qwen3.5-0.8b.json``: 24 layers, a tied
248320 x 1024 embedding, 0.75 B parameters) and writes it as llama.cpp writes a ``qwen35`` Q8_0 file (the test
suite's stand-in writer, ``tests/converter/hybrid_gguf.py``). Then, each in a fresh process, interleaved and
repeated, with its wall time and peak resident set (``VmHWM``, sampled from /proc as ``bench_convert.py`` does):

- ``thinker-convert FILE OUT --no-verify``: the Thinker folder in float32, tensor by tensor;
- transformers' way to the same float32 folder: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...,
  dtype=float32)`` then ``save_pretrained`` (its GGUF loading dequantizes the whole model in memory);
- ``thinker verify FILE OUT`` (the two models side by side) and ``thinker verify FILE OUT --verify-by-layer``
  (one layer at a time).

    python bench/bench_gguf.py [--reps 2] [--work /tmp/thinker-bench-gguf] [--keep]
    python bench/bench_gguf.py --report     # the README table, from bench/results/gguf.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

from results_io import command_line, positive_int, write_result

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from bench_convert import load_average, run_measured  # noqa: E402

RESULTS = BENCH / "results" / "gguf.json"
FILE = "qwen3.5-0.8b-shaped.Q8_0.gguf"
TRANSFORMERS_CONVERT = """
import sys, torch
from transformers import AutoModelForCausalLM
folder, name, output = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.save_pretrained(output)
"""


def build_file(work: Path) -> Path:
    """The Qwen3.5-0.8B-shaped random model as a qwen35 Q8_0 GGUF file (made once, kept in ``work``)."""
    path = work / "gguf" / FILE
    if path.is_file():
        return path
    sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "converter")]
    import torch
    from hybrid_gguf import write_hybrid_gguf  # the test suite's llama.cpp stand-in writer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    preset = json.loads((REPO / "configs" / "qwen3.5-0.8b.json").read_text())
    fields = {key: value for key, value in preset.items() if not key.startswith("_") and key != "model_type"}
    for thinker_only in ("qk_norm", "attention_output_gate", "norm_zero_centered"):
        fields.pop(thinker_only)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    write_hybrid_gguf(model, partial, quantization="Q8_0")
    partial.rename(path)
    return path


def parameter_count(path: Path) -> int:
    """The weights a GGUF file holds, by its tensor headers."""
    from gguf import GGUFReader

    return sum(int(tensor.n_elements) for tensor in GGUFReader(path).tensors)


def folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


def measure(work: Path, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    print("writing the Qwen3.5-0.8B-shaped Q8_0 GGUF file ...", flush=True)
    source = build_file(work)
    os.sync()
    outputs = {"ours": work / "ours", "transformers": work / "transformers"}
    python = sys.executable
    thinker = [python, "-m", "thinker_common.cli"]  # the thinker command, as its console script runs it
    ours, theirs = str(outputs["ours"]), str(outputs["transformers"])
    commands = {
        "ours": [*thinker, "convert", str(source), ours, "--no-verify"],
        "transformers": [python, "-c", TRANSFORMERS_CONVERT, str(source.parent), source.name, theirs],
        "verify": [*thinker, "verify", str(source), ours],
        "verify-by-layer": [*thinker, "verify", str(source), ours, "--verify-by-layer"],
    }
    load_before = load_average()
    runs = []
    for rep in range(reps):
        order = ["ours", "transformers"] if rep % 2 == 0 else ["transformers", "ours"]
        for name in [*order, "verify", "verify-by-layer"]:
            if name in outputs:
                shutil.rmtree(outputs[name], ignore_errors=True)
            seconds, peaks, _ = run_measured(commands[name], env)
            if name in outputs:
                os.sync()
            run = {"rep": rep, "what": name, "seconds": round(seconds, 2), "peak_rss": peaks["VmHWM"]}
            if name in outputs:
                run["output_bytes"] = folder_bytes(outputs[name])
            runs.append(run)
            print(json.dumps(run), flush=True)
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": [load_before, load_average()],
        "source_bytes": source.stat().st_size,
        "parameters": parameter_count(source),
        "runs": runs,
    }


def report(results: dict) -> str:
    rows = {}
    for run in results["runs"]:
        rows.setdefault(run["what"], []).append(run)
    labels = {
        "ours": "`thinker-convert FILE OUT --no-verify`",
        "transformers": "transformers: `from_pretrained(gguf_file=...)` + `save_pretrained`",
        "verify": "`thinker verify FILE OUT` (whole models)",
        "verify-by-layer": "`thinker verify FILE OUT --verify-by-layer`",
    }
    lines = [
        "| step | wall (s), median | peak RSS (GiB), median | runs |",
        "|---|---|---|---|",
    ]
    for what, label in labels.items():
        runs = rows.get(what, [])
        if runs:
            seconds = statistics.median(run["seconds"] for run in runs)
            peak = statistics.median(run["peak_rss"] for run in runs) / 2**30
            lines.append(f"| {label} | {seconds:.1f} | {peak:.2f} | {len(runs)} |")
    ours = statistics.median(run["seconds"] for run in rows["ours"])
    theirs = statistics.median(run["seconds"] for run in rows["transformers"])
    ours_rss = statistics.median(run["peak_rss"] for run in rows["ours"])
    theirs_rss = statistics.median(run["peak_rss"] for run in rows["transformers"])
    lines.append("")
    lines.append(
        f"Source {results['source_bytes'] / 2**30:.2f} GiB (Q8_0); output {rows['ours'][0]['output_bytes'] / 2**30:.2f}"
        f" GiB of float32 safetensors. Conversion time {ours / theirs:.2f}x transformers', peak RSS "
        f"{ours_rss / theirs_rss:.2f}x; load average {results['load_average'][0]:.2f} before, "
        f"{results['load_average'][1]:.2f} after."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/thinker-bench-gguf"))
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the GGUF file is reused)")
    parser.add_argument("--report", action="store_true", help="print the README table from the saved results")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(RESULTS.read_text())))
        return
    started = time.time()
    results = {"command": command_line()} | measure(args.work, args.reps)
    results["wall_seconds"] = round(time.time() - started, 1)
    write_result(RESULTS, json.dumps(results, indent=2) + "\n")
    print(report(results))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
