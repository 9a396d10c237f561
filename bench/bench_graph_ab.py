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
(bench/report.py ``ratio_interval``). The load-order effect makes those per-repetition ratios two-valued (one value per
order, about 10 % apart under onnxruntime-genai), which widens that interval; so each rotation cycle (as many
consecutive repetitions as folders, every folder once in every place) also gives one ratio, the geometric mean of its
repetitions', in which the effect cancels: "by cycle", the median over cycles with its interval. The folders must
agree on the greedy tokens (checked every step), so only graphs of one function are compared.

    python bench/bench_graph_ab.py BEFORE AFTER [MORE ...] --reps 6 --tag qwen3_5-unpadded-branch
    python bench/bench_graph_ab.py ALL LAST --prefill --prompt 128 --steps 16 --tag smollm2-last-logits

``--prefill`` times whole prefills of ``--prompt`` tokens instead of decode steps (same rounds, gap and rotation).

``--runtime genai`` runs the repetitions in onnxruntime-genai's own environment (bench/peer_envs.py), each folder an
``og.Model`` (its genai_config.json, the intra-op threads overlaid) with an ``og.Generator`` over the same prompt; a
step is one ``generate_next_token`` (one forward and the greedy pick), so folders from different exporters of one
checkpoint compare as onnxruntime-genai runs them (ours against the builder's: the issue's goal under its own
runtime). ``--batch`` feeds that many rows of one prompt length. ``--own-tokens`` compares folders that compute
different functions (two int4 quantizations): each then decodes its own greedy tokens, which at a fixed length costs
the same steps, and the token check is off.

    python bench/bench_graph_ab.py BUILDER OURS --runtime genai --batch 8 --reps 6 --tag smollm2-genai-b8

``--runtime session`` is plain onnxruntime without OnnxDecoder: one bare ``InferenceSession`` per folder, numpy feeds,
the KV cache handed back each step (bench_fast's onnxruntime harness), so the builder's folders take part too:

    python bench/bench_graph_ab.py BUILDER OURS --runtime session --prefill --prompt 128 --steps 12 --tag TAG

Writes bench/results/graph_ab_<tag>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from results_io import command_line, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from peer_envs import python_of  # noqa: E402
from report import median_interval, ratio_interval, table  # noqa: E402

RESULTS = Path(__file__).with_name("results")
PROMPT_IDS = (100, 5000)  # the random prompt's ids: ordinary tokens of any real vocabulary


def repetition(folders: list[Path], args: argparse.Namespace) -> dict[str, float]:
    """One process's run: every folder loaded in the given order; median decode step (s) per folder."""
    ids = np.random.default_rng(0).integers(*PROMPT_IDS, size=(args.batch, args.prompt))
    if args.runtime == "genai":
        return genai_repetition(folders, ids, args)
    if args.runtime == "session":
        return session_repetition(folders, ids, args)
    from export.runtime import OnnxDecoder

    decoders = [OnnxDecoder(folder, provider="cpu", threads=args.threads) for folder in folders]
    if args.prefill:
        mask = np.ones_like(ids)
        return timed_prefills([lambda d=d: d.prefill(ids, mask)[0][:, -1] for d in decoders], folders, args)
    logits, states = [None] * len(decoders), [None] * len(decoders)

    def start() -> None:
        for k, decoder in enumerate(decoders):
            prompt_logits, states[k] = decoder.prefill(ids, np.ones_like(ids))
            logits[k] = prompt_logits[:, -1]

    def step(k: int, token: np.ndarray) -> None:
        logits[k] = decoders[k].decode_one_token(token, states[k])

    return decode_rounds(folders, args, start, step, lambda k: logits[k].argmax(-1))


def session_repetition(folders: list[Path], ids: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    """``repetition`` under plain onnxruntime with no runtime of ours: one bare InferenceSession per folder, numpy
    feeds and fetches, the KV cache handed back each step (bench/decode_worker.py's OrtBackend, bench_fast's
    onnxruntime rows), so any exporter's folder takes part: the builder's against ours, under onnxruntime."""
    from decode_worker import OrtBackend

    backends = [OrtBackend(folder, threads=args.threads) for folder in folders]
    mask = np.ones_like(ids)
    if args.prefill:
        prefills = [lambda b=b: b.forward(ids, mask, b.cache(len(ids), 0))[0] for b in backends]
        return timed_prefills(prefills, folders, args)
    logits, caches, masks = [None] * len(backends), [None] * len(backends), [mask] * len(backends)

    def start() -> None:
        for k, backend in enumerate(backends):
            logits[k], caches[k] = backend.forward(ids, mask, backend.cache(len(ids), 0))
            masks[k] = mask

    def step(k: int, token: np.ndarray) -> None:
        masks[k] = np.ones((len(ids), masks[k].shape[1] + 1), np.int64)
        logits[k], caches[k] = backends[k].forward(token[:, None].astype(np.int64), masks[k], caches[k])

    return decode_rounds(folders, args, start, step, lambda k: logits[k].argmax(-1))


def genai_repetition(folders: list[Path], ids: np.ndarray, args: argparse.Namespace) -> dict[str, float]:
    """``repetition`` under onnxruntime-genai (decode steps only): imports nothing from this repository, since it
    runs in the genai environment."""
    import onnxruntime_genai as og

    models = []
    for folder in folders:
        config = og.Config(str(folder))
        config.clear_providers()  # the CPU
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": args.threads}}}}))
        models.append(og.Model(config))
    generators = [None] * len(models)

    def start() -> None:
        for k, model in enumerate(models):
            params = og.GeneratorParams(model)
            length = ids.shape[1] + args.restart + 1
            params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(ids))
            generators[k] = og.Generator(model, params)
            generators[k].append_tokens(ids)  # the prompt's forward
            generators[k].generate_next_token()  # the first pick, from the prompt's logits

    def step(k: int, token: np.ndarray) -> None:
        generators[k].generate_next_token()  # the last token's forward, then the pick

    return decode_rounds(folders, args, start, step, lambda k: generators[k].get_next_tokens())


def decode_rounds(
    folders: list[Path],
    args: argparse.Namespace,
    start: Callable[[], None],
    step: Callable[[int, np.ndarray], None],
    tokens: Callable[[int], np.ndarray],
) -> dict[str, float]:
    """``args.steps`` rounds of one decode step per folder in a shuffled order, each after ``args.gap`` seconds and
    timed alone: ``start`` prefills every folder (again every ``args.restart`` rounds), ``tokens(k)`` is folder k's
    next greedy tokens (checked equal across folders unless ``--own-tokens``), ``step(k, tokens)`` decodes them.
    Median seconds per step, per folder."""
    start()
    times = np.zeros((len(folders), args.steps))
    for round_ in range(args.steps):
        current = [tokens(k) for k in range(len(folders))]
        if not args.own_tokens and any(not np.array_equal(t, current[0]) for t in current):
            raise SystemExit(f"the folders' greedy tokens differ at step {round_}: not one function")
        for k in np.random.default_rng(round_).permutation(len(folders)):
            time.sleep(args.gap)
            started = time.perf_counter()
            step(k, current[k])
            times[k, round_] = time.perf_counter() - started
        if (round_ + 1) % args.restart == 0:
            start()
    return {str(folder): float(np.median(row)) for folder, row in zip(folders, times, strict=True)}


def timed_prefills(
    prefills: list[Callable[[], np.ndarray]], folders: list[Path], args: argparse.Namespace
) -> dict[str, float]:
    """``repetition`` for prefills: rounds of one whole prefill per folder (``prefills[k]()`` runs folder k's and
    returns its last position's logits), shuffled; median seconds per folder."""
    times = np.zeros((len(prefills), args.steps))
    for step in range(args.steps):
        tokens = {}
        for k in np.random.default_rng(step).permutation(len(prefills)):
            time.sleep(args.gap)
            started = time.perf_counter()
            logits = prefills[k]()
            times[k, step] = time.perf_counter() - started
            tokens[k] = logits.argmax(-1)
        if any(not np.array_equal(t, tokens[0]) for t in tokens.values()):
            raise SystemExit(f"the folders' next tokens differ at round {step}: not one function")
    return {str(folder): float(np.median(row)) for folder, row in zip(folders, times, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", type=Path, help="exports of one model; the first is the reference")
    parser.add_argument(
        "--reps", type=positive_int, default=6, help="fresh processes, the load order rotated each time"
    )
    parser.add_argument("--steps", type=int, default=120, help="decode rounds per repetition")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--restart", type=int, default=48, help="a new prefill every this many rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gap", type=float, default=0.15, help="seconds of pause before each step")
    parser.add_argument("--prefill", action="store_true", help="time prefills of --prompt tokens, not decode steps")
    parser.add_argument("--batch", type=int, default=1, help="rows of the prompt")
    runtimes = {
        "ort": "onnxruntime through OnnxDecoder",
        "session": "a bare onnxruntime session (any exporter's folder)",
        "genai": "onnxruntime-genai",
    }
    parser.add_argument("--runtime", choices=list(runtimes), default="ort", help=", or ".join(runtimes.values()))
    parser.add_argument(
        "--own-tokens",
        action="store_true",
        help="folders of different functions (two quantizations), each decoding its own greedy tokens",
    )
    parser.add_argument("--tag", help="names the results file (required unless --worker)")
    parser.add_argument("--report", action="store_true", help="print --tag's table from its results file, no run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one repetition, JSON on stdout
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(repetition(args.folders, args)))
        return
    if args.report:
        report(args.tag or parser.error("--report needs --tag"))
        return
    if len(args.folders) < 2 or not args.tag:
        parser.error("give at least two folders and --tag")
    if args.runtime == "genai" and args.prefill:
        parser.error("--prefill times whole prefills under onnxruntime (--runtime ort or session): not genai")
    if args.own_tokens and args.runtime == "ort":
        parser.error("--own-tokens is for --runtime genai or session")

    folders = [str(folder.resolve()) for folder in args.folders]
    settings = ["--steps", args.steps, "--prompt", args.prompt, "--restart", args.restart]
    settings += ["--threads", args.threads, "--gap", args.gap, "--batch", args.batch, "--runtime", args.runtime]
    settings += (["--prefill"] if args.prefill else []) + (["--own-tokens"] if args.own_tokens else [])
    python = python_of("genai") if args.runtime == "genai" else sys.executable
    reps = []
    for rep in range(args.reps):
        order = folders[rep % len(folders) :] + folders[: rep % len(folders)]
        command = [str(python), __file__, *order, "--worker", *map(str, settings)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:  # the worker's own last line says why (tokens that differ, a folder that fails)
            raise SystemExit(f"repetition {rep + 1} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        figures = json.loads(done.stdout)
        reps.append({"order": order, "step_s": figures})
        print(f"repetition {rep + 1}: " + ", ".join(f"{Path(f).name} {1e3 * figures[f]:.1f} ms" for f in order))

    result = {"command": command_line(), "settings": vars(args) | {"folders": folders}, "reps": reps}
    result["rows"] = summary(reps, folders)
    RESULTS.mkdir(exist_ok=True)
    write_result((RESULTS / f"graph_ab_{args.tag}.json"), json.dumps(result, indent=2, default=str) + "\n")
    print(report_table(result["rows"]))


def summary(reps: list[dict], folders: list[str]) -> list[dict]:
    """Per folder: its median step and its speed against the first folder, by repetition and by rotation cycle."""
    rows = []
    for folder in folders:
        steps = [r["step_s"][folder] for r in reps]
        figures = ratio_interval([r["step_s"][folders[0]] for r in reps], steps)
        cycles = median_interval(cycle_ratios(reps, folders[0], folder, len(folders))) or (np.nan,) * 3
        rows.append(
            {
                "folder": folder,
                "median_step_ms": round(1e3 * float(np.median(steps)), 2),
                "speed_vs_first": [round(v, 4) for v in figures],
                "speed_vs_first_by_cycle": [round(v, 4) for v in cycles],
            }
        )
    return rows


def report(tag: str, results: Path = RESULTS) -> None:
    """The table of a results file again, its summary recomputed from its repetitions. Read only: files written
    before a summary column existed print it too, and stay as their run wrote them."""
    result = json.loads((results / f"graph_ab_{tag}.json").read_text())
    print(report_table(summary(result["reps"], result["settings"]["folders"])))


def cycle_ratios(reps: list[dict], first: str, folder: str, size: int) -> list[float]:
    """Per whole rotation cycle (``size`` consecutive repetitions): the geometric mean of its repetitions' speed
    ratios of ``folder`` against ``first``."""
    ratios = [r["step_s"][first] / r["step_s"][folder] for r in reps]
    cycles = [ratios[i : i + size] for i in range(0, len(ratios) - size + 1, size)]
    return [float(np.exp(np.mean(np.log(cycle)))) for cycle in cycles]


def report_table(rows: list[dict]) -> str:
    def cell(figures: list[float] | None) -> str:
        return "—" if not figures or np.isnan(figures[0]) else "{:.3f}x ({:.3f}–{:.3f})".format(*figures)

    header = ["folder", "median step (ms)", "speed vs the first (90 % interval)", "by cycle (90 % interval)"]
    cells = [
        [r["folder"], f"{r['median_step_ms']:.1f}", cell(r["speed_vs_first"]), cell(r.get("speed_vs_first_by_cycle"))]
        for r in rows
    ]
    return table(header, cells)


if __name__ == "__main__":
    main()
