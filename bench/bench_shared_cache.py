"""What the shared KV buffer saves `OnnxDecoder` (``thinker generate``, plain onnxruntime) per decode step on the CPU.

OnnxDecoder binds each GroupQueryAttention's past and present to one buffer that the kernel writes in place
(export/runtime.py); the copying form (``OnnxDecoder(share_kv=False)``) hands the kernel the cache and gets a new
present back each step, a copy of the whole cache. The copy grows with the context, so this times one decode step
after contexts of several lengths, both forms loaded in one process and taking turns (rounds of ``--steps`` steps
each, the order swapped every round), batch 1, on the default fused export of each model (bench/exports.py's
``ours-fused``, made here if missing). The cache before the timed steps is random (a context of that many slots,
as bench/decode_worker.py's ``decode_at``): the time of a step does not depend on its values, and a prompt that long
would take minutes to prefill on this machine.

    python bench/bench_shared_cache.py                      # SmolLM2-135M and the Qwen3-0.6B shape, ~6 minutes
    python bench/bench_shared_cache.py --report             # the table again, from the results file

Writes bench/results/shared_cache.json and bench/results/README-shared-cache.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from results_io import command_line, names_from, writable_folder, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402

RESULTS = Path(__file__).with_name("results")
FORMS = ("copying", "shared")


def random_context(decoder, context: int) -> dict[str, np.ndarray]:
    """Random keys and values for ``context`` slots of every KV input (batch 1), made once per context."""
    rng = np.random.default_rng(context)
    kv = {}
    for name, value in decoder.empty_cache(1).items():
        if name.rsplit(".", 1)[1] in ("key", "value"):
            shape = (*value.shape[:2], context, value.shape[3])
            kv[name] = (0.5 * rng.standard_normal(shape, dtype=np.float32)).astype(value.dtype)
    return kv


def state_after(decoder, kv: dict[str, np.ndarray], context: int, steps: int):
    """A DecoderState as after a prompt of ``context`` tokens: ``kv`` as the copying form's past (never written:
    each step returns a new present), or copied into a shared buffer with room for ``steps`` more."""
    from export.runtime import DecoderState

    cache = decoder.empty_cache(1, slots=context + steps)
    for name, past in kv.items():
        if name in decoder.shared_kv:
            cache[name][:, :, :context] = past
        else:
            cache[name] = past
    return DecoderState(np.ones((1, context), np.int64), np.array([context]), cache)


def step_seconds(decoder, kv: dict[str, np.ndarray], context: int, steps: int) -> float:
    """The median wall time of ``steps`` decode steps after ``context`` slots of ``kv``."""
    state = state_after(decoder, kv, context, steps)
    token = np.array([1], np.int64)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        token = decoder.decode_one_token(token, state).argmax(-1)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(folder: Path, contexts: list[int], steps: int, rounds: int, threads: int) -> dict:
    from export.runtime import OnnxDecoder

    decoders = {
        "copying": OnnxDecoder(folder, provider="cpu", threads=threads, share_kv=False),
        "shared": OnnxDecoder(folder, provider="cpu", threads=threads),
    }
    if not decoders["shared"].shared_kv:
        raise SystemExit(f"{folder}: no GroupQueryAttention KV to share (a plain graph?)")
    for decoder in decoders.values():  # warm-up: the first runs of a session allocate its arenas
        step_seconds(decoder, random_context(decoder, 16), 16, 4)
    results = {}
    for context in contexts:
        kv = random_context(decoders["copying"], context)
        seconds = {form: [] for form in FORMS}
        for round_ in range(rounds):
            for form in FORMS if round_ % 2 == 0 else FORMS[::-1]:
                seconds[form].append(step_seconds(decoders[form], kv, context, steps))
        speed = report.ratio_interval(seconds["copying"], seconds["shared"])  # time copying / time shared
        results[str(context)] = {"step_s": seconds, "speedup": speed}
        print(
            f"  context {context}: copying {1e3 * statistics.median(seconds['copying']):.2f} ms, "
            f"shared {1e3 * statistics.median(seconds['shared']):.2f} ms, {report.ratio_cell(speed)}",
            file=sys.stderr,
            flush=True,
        )
    return results


def markdown(results: dict) -> str:
    rows = []
    for name, by_context in results["models"].items():
        for context, figures in by_context.items():
            copying, shared = (statistics.median(figures["step_s"][form]) for form in FORMS)
            speedup = tuple(figures["speedup"]) if figures["speedup"] else None
            rows.append([name, context, f"{1e3 * copying:.2f}", f"{1e3 * shared:.2f}", report.ratio_cell(speedup)])
    header = ["model", "context (tokens)", "copying (ms/step)", "shared (ms/step)", "speed-up"]
    return (
        f"Command: `{results['command']}`; batch 1, {results['threads']} threads, {results['rounds']} rounds of "
        f"{results['steps']} steps per form and context, medians; speed-up: the median of the per-round ratios "
        "(copying time / shared time) with its 90 % bootstrap interval (bench/report.py).\n\n"
        + report.table(header, rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="128,512,1024,2048,4096")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per context, the forms' order swapped each")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", type=names_from(("smollm2-135m", "qwen3-0.6b")), default="smollm2-135m,qwen3-0.6b")
    parser.add_argument("--report", action="store_true", help="print the table of the results file and stop")
    parser.add_argument("--out", type=writable_folder, default=RESULTS)
    args = parser.parse_args()
    out_json = args.out / "shared_cache.json"
    if args.report:
        print(markdown(json.loads(out_json.read_text())))
        return
    makers = {"smollm2-135m": models.smollm2, "qwen3-0.6b": models.qwen3_shaped}
    results = {
        "command": command_line(),
        "threads": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "models": {},
    }
    for name in args.models:
        model = makers[name]()
        export = exp.run_export("ours-fused", model, args.threads, fresh=False)
        if export.error:
            raise SystemExit(f"{name}: the export failed: {export.error}")
        print(f"[{name}] {export.folder}", file=sys.stderr, flush=True)
        contexts = [int(c) for c in args.contexts.split(",")]
        results["models"][name] = measure(export.folder, contexts, args.steps, args.rounds, args.threads)
        args.out.mkdir(parents=True, exist_ok=True)
        write_result(out_json, json.dumps(results, indent=2) + "\n")
        write_result((args.out / "README-shared-cache.md"), markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
