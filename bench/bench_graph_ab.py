"""What a graph change buys at decode, resolved below the noise of bench_fast / bench_hybrid: exports of one model,
decode steps interleaved one at a time, every repetition in a fresh process with the load order rotated.

bench_fast.py and bench_hybrid.py compare runtimes in separate processes, where what a process draws (memory
placement, cores) moves a rate by 5-15 % and stays with it: a change worth a few percent is lost there. Here each
repetition is one process that loads every folder (one draw for all), feeds each the same random prompt, and then
runs rounds of one decode step per folder in a shuffled order, so that neither the position in a round nor a drift of
the machine favours one. Two effects inside a process had to be cancelled, both measured on SmolLM2's fused graph:
  - a session's threads keep spinning a while after its run: a step right after another session's took 48 ms, 43
    ms after a 20 ms pause, and 24 ms (the session's own speed alone) after 100 ms or more; so every step waits
    ``--gap`` seconds first;
  - the folder loaded last runs about 5 % faster, whichever it is (the same graph listed first and then second moved
    from 0.95x to 1.05x of the other); so the load order rotates from one repetition to the next, and an even
    number of repetitions puts every folder in every place equally.
A repetition's figure per folder is its median step time; the ratio per folder is the median over repetitions of
the first folder's time divided by its own (above 1: faster than the first), with a 90 % bootstrap interval
(bench/report.py ``ratio_interval``). The folders must agree on the greedy tokens (checked every step), so only
graphs of one function are compared.

    python bench/bench_graph_ab.py BEFORE AFTER [MORE ...] --reps 6 --tag qwen3_5-unpadded-branch
    python bench/bench_graph_ab.py ALL LAST --prefill --prompt 128 --steps 16 --tag smollm2-last-logits

``--prefill`` times whole prefills of ``--prompt`` tokens instead of decode steps (same rounds, gap and rotation).

Writes bench/results/graph_ab_<tag>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from report import ratio_interval, table  # noqa: E402

RESULTS = Path(__file__).with_name("results")


def repetition(folders: list[Path], args: argparse.Namespace) -> dict[str, float]:
    """One process's run: every folder loaded in the given order; median decode step (s) per folder."""
    from export.runtime import OnnxDecoder

    decoders = [OnnxDecoder(folder, provider="cpu", threads=args.threads) for folder in folders]
    ids = np.random.default_rng(0).integers(100, 5000, size=(1, args.prompt))

    def start() -> tuple[list, list]:
        states, tokens = [], []
        for decoder in decoders:
            logits, state = decoder.prefill(ids, np.ones_like(ids))
            states.append(state)
            tokens.append(logits[:, -1].argmax(-1))
        return states, tokens

    if args.prefill:
        return timed_prefills(decoders, folders, ids, args)
    states, tokens = start()
    times = np.zeros((len(decoders), args.steps))
    for step in range(args.steps):
        if any(not np.array_equal(t, tokens[0]) for t in tokens):
            raise SystemExit(f"the folders' greedy tokens differ at step {step}: not one function")
        for k in np.random.default_rng(step).permutation(len(decoders)):
            time.sleep(args.gap)
            started = time.perf_counter()
            logits = decoders[k].decode_one_token(tokens[k], states[k])
            times[k, step] = time.perf_counter() - started
            tokens[k] = logits.argmax(-1)
        if (step + 1) % args.restart == 0:
            states, tokens = start()
    return {str(folder): float(np.median(row)) for folder, row in zip(folders, times, strict=True)}


def timed_prefills(decoders: list, folders: list[Path], ids: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    """``repetition`` for prefills: rounds of one whole prefill per folder, shuffled; median seconds per folder."""
    times = np.zeros((len(decoders), args.steps))
    for step in range(args.steps):
        tokens = {}
        for k in np.random.default_rng(step).permutation(len(decoders)):
            time.sleep(args.gap)
            started = time.perf_counter()
            logits, _ = decoders[k].prefill(ids, np.ones_like(ids))
            times[k, step] = time.perf_counter() - started
            tokens[k] = logits[:, -1].argmax(-1)
        if any(not np.array_equal(t, tokens[0]) for t in tokens.values()):
            raise SystemExit(f"the folders' next tokens differ at round {step}: not one function")
    return {str(folder): float(np.median(row)) for folder, row in zip(folders, times, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="exports of one model; the first is the reference")
    parser.add_argument("--reps", type=int, default=6, help="fresh processes, the load order rotated each time")
    parser.add_argument("--steps", type=int, default=120, help="decode rounds per repetition")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--restart", type=int, default=48, help="a new prefill every this many rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.15, help="seconds of pause before each step")
    parser.add_argument("--prefill", action="store_true", help="time prefills of --prompt tokens, not decode steps")
    parser.add_argument("--tag", help="names the results file (required unless --worker)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one repetition, JSON on stdout
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(repetition(args.folders, args)))
        return
    if len(args.folders) < 2 or not args.tag:
        parser.error("give at least two folders and --tag")

    folders = [str(folder.resolve()) for folder in args.folders]
    settings = ["--steps", args.steps, "--prompt", args.prompt, "--restart", args.restart]
    settings += ["--threads", args.threads, "--gap", args.gap] + (["--prefill"] if args.prefill else [])
    reps = []
    for rep in range(args.reps):
        order = folders[rep % len(folders) :] + folders[: rep % len(folders)]
        command = [sys.executable, __file__, *order, "--worker", *map(str, settings)]
        figures = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        reps.append({"order": order, "step_s": figures})
        print(f"repetition {rep + 1}: " + ", ".join(f"{Path(f).name} {1e3 * figures[f]:.1f} ms" for f in order))

    rows = []
    for folder in folders:
        steps = [r["step_s"][folder] for r in reps]
        figures = ratio_interval([r["step_s"][folders[0]] for r in reps], steps)
        rows.append(
            {
                "folder": folder,
                "median_step_ms": round(1e3 * float(np.median(steps)), 2),
                "speed_vs_first": [round(v, 4) for v in figures],
            }
        )
    result = {"command": " ".join(sys.argv), "settings": vars(args) | {"folders": folders}, "reps": reps}
    result["rows"] = rows
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"graph_ab_{args.tag}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(
        table(
            ["folder", "median step (ms)", "speed vs the first (90 % interval)"],
            [
                [r["folder"], f"{r['median_step_ms']:.1f}", "{:.3f}x ({:.3f}–{:.3f})".format(*r["speed_vs_first"])]
                for r in rows
            ],
        )
    )


if __name__ == "__main__":
    main()
