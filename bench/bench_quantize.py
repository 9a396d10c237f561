"""The int4/int8 choices of ``thinker export --quantize`` on the real SmolLM2-135M: fidelity and speed, side by side
with onnxruntime-genai's builder int4, to pick the defaults from measurements.

Every variant is our fused graph with other quantization options (VARIANTS), plus the builder's ``-p int4 -e cpu``.
For each:
  fidelity   export/fidelity.py's English paragraph, teacher forced, against the float PyTorch Thinker (what
             ``--verify`` reports as the cost): top-1 agreement and perplexity change
  flips      greedy continuation (64 tokens) of the paragraph's first 32 tokens against the same weights with
             float activations (accuracy level 1): where int8 activations (level 4) change the greedy path
             (onnxruntime issue 29849 reports flips on Qwen3-0.6B)
  speed      batch 1 and 8, 128-token prompt, ``--new`` tokens, greedy, interleaved repetitions (each in fresh
             processes), medians, under onnxruntime (bench/decode_worker.py's one runner) and under onnxruntime-genai
             (each folder's config); ratios to the builder's int4 as median per-repetition ratios with their 90 %
             bootstrap interval (bench/report.py)

    python bench/bench_quantize.py                      # about 20 minutes on 2 shared cores
    python bench/bench_quantize.py --runtimes ort --reps 1

Writes bench/results/quantize.json and bench/results/README-quantize.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from results_io import command_line, machine_name, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402
from workers import Runtime, interleave_fresh, summary  # noqa: E402

RESULTS = Path(__file__).with_name("results")
# name -> `thinker export` options (on top of --graph fused); the flips check pairs each with "+acc1" of itself.
VARIANTS = {
    # the defaults: activation-aware scales (export/awq.py), RTN in blocks of 64 for the projections the scales cover
    # and of 32 for the rest (at int4; int8: 32), accuracy level 4, the mixed head (int8 for the first 8192 rows), the
    # guard at 0.9; every rtn variant below scales too unless it says --no-awq, and the "-rtn" ones are the defaults
    # before the scales
    "int4": ["--quantize", "int4"],
    "int4-b32": ["--quantize", "int4", "--block-size", "32"],  # the default before its scaled projections' blocks of 64
    "int4-rtn": ["--quantize", "int4", "--no-awq"],  # the default before activation-aware scales
    "int4-h4-rtn": ["--quantize", "int4", "--quantize-head", "int4", "--no-awq"],  # the builder's int4, as ours
    "int4-noguard": ["--quantize", "int4", "--accuracy-guard", "0"],  # what the accuracy guard costs an export
    "int4-acc1": ["--quantize", "int4", "--accuracy-level", "1"],
    "int4-h8": ["--quantize", "int4", "--quantize-head", "int8"],
    "int4-h4": ["--quantize", "int4", "--quantize-head", "int4"],
    "int4-asym": ["--quantize", "int4", "--algo", "rtn-asym"],
    "int4-b64": ["--quantize", "int4", "--block-size", "64"],  # the head and its int8 rows in blocks of 64 too
    "int4-b64-rtn": ["--quantize", "int4", "--block-size", "64", "--no-awq"],  # blocks of 64 without the scales
    "int4-b64-h4": ["--quantize", "int4", "--block-size", "64", "--quantize-head", "int4"],
    "int4-b128": ["--quantize", "int4", "--block-size", "128"],
    "int4-hqq": ["--quantize", "int4", "--algo", "hqq"],
    "int4-hqq-h4": ["--quantize", "int4", "--algo", "hqq", "--quantize-head", "int4"],
    "int8": ["--quantize", "int8"],
    "int8-rtn": ["--quantize", "int8", "--no-awq"],
    "int8-acc1": ["--quantize", "int8", "--accuracy-level", "1"],
    # the builder's int8 function: plain RTN, the float table
    "int8-femb-rtn": ["--quantize", "int8", "--embedding", "float", "--no-awq"],
    "int4-femb": ["--quantize", "int4", "--embedding", "float"],
}
FLIP_PAIRS = {"int4": "int4-acc1", "int8": "int8-acc1"}


def export_variant(name: str, model: models.BenchModel, fresh: bool) -> tuple[Path, dict]:
    """The variant's folder and what its export cost: wall seconds and peak RSS (None when an earlier run's export
    is reused), the weight files' bytes, and what the accuracy guard measured (export_report.json)."""
    out = exp.CACHE / "exports" / model.name / f"q-{name}"
    figures: dict = {"seconds": None, "peak_rss": None}
    if fresh or not out.exists():
        command = [
            sys.executable,
            "-m",
            "thinker_common.cli",
            "export",
            str(model.thinker),
            str(out),
            "--no-verify",
            "--force",
        ]
        done = exp.timed([*command, "--graph", "fused", *VARIANTS[name]], cwd=exp.REPO)
        if done["returncode"] != 0:
            raise RuntimeError(f"export {name} failed: {done['stderr'][-2000:]}")
        figures = {"seconds": done["seconds"], "peak_rss": done["peak_rss"]}
    guard = json.loads((out / "export_report.json").read_text()).get("accuracy_guard") or {}
    figures["model_bytes"] = exp.folder_bytes(out)
    figures["accuracy_guard"] = {
        key: guard[key] for key in ("agreement_before", "agreement", "moved_to_level_1", "seconds") if key in guard
    }
    return out, figures


def fidelity(model: models.BenchModel, folders: dict[str, Path]) -> dict:
    """The cost ``--verify`` reports, for every folder (the builder's too), and greedy flips of level 4."""
    import torch
    from decode_worker import OrtBackend
    from transformers import AutoTokenizer

    from export.fidelity import FIDELITY_TEXT, text_fidelity
    from thinker import ThinkerForCausalLM

    ids = np.array(AutoTokenizer.from_pretrained(model.thinker)(FIDELITY_TEXT)["input_ids"])
    float_model = ThinkerForCausalLM.from_pretrained(model.thinker).eval()
    with torch.no_grad():
        reference = float_model(input_ids=torch.from_numpy(ids)[None]).logits[0].numpy()
    figures = {}
    continuations = {}
    for name, folder in folders.items():
        backend = OrtBackend(folder, threads=2)
        figures[name] = text_fidelity(reference, backend.prefill_logits(ids), ids)
        continuations[name] = greedy(backend, ids[:32], 64)
    with torch.no_grad():
        float_tokens = float_model.generate(
            torch.from_numpy(ids[:32])[None], max_new_tokens=64, do_sample=False, min_new_tokens=64
        )[0, 32:].tolist()
    for name, tokens in continuations.items():
        figures[name]["greedy_equal_to_float"] = equal_prefix(tokens, float_tokens)
    for level4, level1 in FLIP_PAIRS.items():
        if level4 in continuations and level1 in continuations:
            figures[level4]["greedy_equal_to_float_activations"] = equal_prefix(
                continuations[level4], continuations[level1]
            )
    return {"tokens": len(ids), "greedy_tokens": 64, "graphs": figures}


def greedy(backend, prompt: np.ndarray, new: int) -> list[int]:
    ids = prompt[None].astype(np.int64)
    mask = np.ones_like(ids)
    logits, cache = backend.forward(ids, mask, backend.cache(1, 0))
    tokens = [int(logits.argmax(-1)[0])]
    for _ in range(new - 1):
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
        logits, cache = backend.forward(np.array([[tokens[-1]]], np.int64), mask, cache)
        tokens.append(int(logits.argmax(-1)[0]))
    return tokens


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many greedy tokens agree before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def speed(folders: dict[str, Path], args) -> list[dict]:
    requests = [{"op": "generate", "batch": b, "prompt": 128, "new": args.new} for b in args.batches]
    rows = []
    for backend, runtime_name in (("ort", "onnxruntime"), ("genai", "onnxruntime-genai")):
        if backend not in args.runtimes:
            continue
        runtimes = [Runtime(f"{g} on {runtime_name}", g, backend, f"builder-int4 on {runtime_name}") for g in folders]
        interleave_fresh(runtimes, folders, args.threads, requests, args.reps)
        for runtime in runtimes:
            entry = {"label": runtime.label, "graph": runtime.graph, "backend": backend}
            entry.update({f"batch{r['batch']}": summary(runtime, r) for r in requests})
            rows.append(entry)
    return rows


def markdown(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}`; load average before/after: {results['load_before']} / "
        f"{results['load_after']}.\n",
        f"Fidelity over {results['fidelity']['tokens']} tokens of English against the float PyTorch model; greedy: "
        f"tokens of a {results['fidelity']['greedy_tokens']}-token continuation equal before the first difference.\n",
    ]
    runtimes = sorted({r["backend"] for r in results["speed"]})
    header = "| graph | options | top-1 | perplexity | greedy = float | greedy = float activations |"
    rule = "|---|---|---|---|---|---|"
    for backend in runtimes:
        for batch in results["settings"]["batches"]:
            header += f" decode b{batch} {backend} (vs builder) |"
            rule += "---|"
    lines += [header, rule]
    speeds = {(r["graph"], r["backend"]): r for r in results["speed"]}
    for name, fig in results["fidelity"]["graphs"].items():
        options = " ".join(VARIANTS.get(name, ["builder -p int4 -e cpu"]))
        flips = fig.get("greedy_equal_to_float_activations")
        row = (
            f"| {name} | `{options}` | {fig['top1_agreement']:.1%} | {fig['perplexity_change']:+.1%} | "
            f"{fig['greedy_equal_to_float']} | {'—' if flips is None else flips} |"
        )
        for backend in runtimes:
            for batch in results["settings"]["batches"]:
                ours = (speeds.get((name, backend)) or {}).get(f"batch{batch}")
                peer = (speeds.get(("builder-int4", backend)) or {}).get(f"batch{batch}")
                if figures := report.compared(ours, peer, "decode_tokens_per_s"):
                    row += f" {ours['batch_tokens_per_s']:.1f} ({report.ratio_cell(figures)}) |"
                else:
                    row += " — |"
        lines.append(row)
    lines += [
        "",
        "Export (`--no-verify`; the accuracy guard, on by default at 0.9, compares the level-4 graph with the same "
        "weights at level 1 over the paragraph):",
        "",
        "| graph | wall (s) | peak RSS (MB) | model files (MB) | guard: level 4 = level 1 | units moved | guard (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, fig in results.get("exports", {}).items():
        guard = fig["accuracy_guard"]
        cells = [
            name,
            optional(fig["seconds"], "{:.1f}"),
            optional(fig["peak_rss"] and fig["peak_rss"] / 1e6, "{:.0f}"),
            f"{fig['model_bytes'] / 1e6:.1f}",
            optional(guard.get("agreement"), "{:.1%}"),
            optional(guard and len(guard["moved_to_level_1"]), "{}"),
            optional(guard.get("seconds"), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def optional(value, spec: str) -> str:
    return "—" if value is None or value == {} else spec.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--speed-variants",
        default="int4,int4-b32,int4-rtn,int4-h8,int4-h4,int4-asym,int4-b64,int4-b64-h4,int8,int8-rtn",
    )
    parser.add_argument("--runtimes", default="ort,genai")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--fresh", action="store_true", help="export again even where a cached export exists")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.runtimes = args.runtimes.split(",")

    model = models.smollm2()
    load_before = os.getloadavg()[0]
    exported = {name: export_variant(name, model, args.fresh) for name in args.variants.split(",")}
    folders = {name: folder for name, (folder, _) in exported.items()}
    builder = exp.run_export("builder-int4", model, args.threads, fresh=False)
    folders["builder-int4"] = builder.folder
    exports = {name: figures for name, (_, figures) in exported.items()}
    exports["builder-int4"] = {
        "seconds": builder.seconds,
        "peak_rss": builder.peak_rss,
        "model_bytes": exp.folder_bytes(builder.folder),
        "accuracy_guard": {},
    }
    results = {
        "command": command_line(),
        "machine": {"processor": machine_name(), "threads": args.threads},
        "settings": vars(args),
        "load_before": round(load_before, 2),
        "exports": exports,
        "fidelity": fidelity(model, folders),
    }
    timed = {n: f for n, f in folders.items() if n in args.speed_variants.split(",") or n == "builder-int4"}
    started_at = time.time()
    results["speed"] = speed(timed, args)
    results["speed_minutes"] = round((time.time() - started_at) / 60, 1)
    results["load_after"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / "quantize.json"), json.dumps(results, indent=2, default=str) + "\n")
    write_result((RESULTS / "README-quantize.md"), markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
