"""How a busy machine slows the command line's PyTorch and onnxruntime runs, and what waiting passively saves.

PyTorch's CPU kernels run their parallel regions on OpenMP threads (libgomp in the PyPI wheels), which by default
spin at each barrier before they sleep; onnxruntime's intra-op pool spins the same way between kernels
(``session.intra_op.allow_spinning``). On an idle machine that trims a wake-up from every small kernel. On a busy one,
a thread of the run that the scheduler set aside leaves the others spinning at the next barrier until it is back, at
every one of a decode step's hundreds of parallel regions (greedy decoding in PyTorch is what `thinker generate` does
with a Thinker folder, and the parity checks of `convert`, `verify` and `export` run their reference model so).

This times, in fresh processes, greedy decoding of SmolLM2-135M (its real weights) with each wait policy, on the idle
machine, beside one low-priority (nice 19) busy loop per core ("busy"), and beside another PyTorch program at nice 19
whose threads spin as ours do ("torch-busy": small matrix products without end, as a test suite's or a job's):
  torch-spin      transformers' ``generate`` on the Thinker folder, libgomp's default waits (the variable unset)
  torch-passive   the same with ``OMP_WAIT_POLICY=PASSIVE``
  torch-spin-10k  the same with ``GOMP_SPINCOUNT=10000``, a shorter spin before sleeping (libgomp's default is 300000)
  ort-spin        onnxruntime over the fused float32 export (export/runtime.py ``OnnxDecoder``), its default
  ort-passive     the same with ``session.intra_op.allow_spinning`` 0
Each variant's processes take turns, rep by rep; the figures are medians of the tokens' seconds (after one warm-up
generation in each process) and each variant's ratio to its default's, per condition. Whether the commands should
wait passively by default is what this measures: a passive wait costs a wake-up at each parallel region on an idle
machine, and saves the spinning on a busy one. Run it with nothing else running (the idle rows are only that then).
The answer so far (README, "Thread waits"): the defaults, spinning, are faster in every condition here, so the
commands keep them.

    python bench/bench_thread_wait.py                    # 3 reps, 24 tokens
    python bench/bench_thread_wait.py --reps 5 --tokens 32

Writes bench/results/thread_wait.json and bench/results/README-thread-wait.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from results_io import command_line, machine_name, positive_int, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {  # name -> (runtime, environment added, onnxruntime's allow_spinning)
    "torch-spin": ("torch", {}, None),
    "torch-passive": ("torch", {"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "torch-spin-10k": ("torch", {"GOMP_SPINCOUNT": "10000"}, None),
    "ort-spin": ("ort", {}, "1"),
    "ort-passive": ("ort", {}, "0"),
}
# what each ratio is taken against
DEFAULTS = {"torch-passive": "torch-spin", "torch-spin-10k": "torch-spin", "ort-passive": "ort-spin"}
CONDITIONS = ("idle", "busy", "torch-busy")
PROMPT = "The capital of France is"
# A test suite's or a training job's PyTorch beside the run: small matrix products on every core, without end.
TORCH_LOOP = "import torch\na = torch.randn(256, 256)\nwhile True: a = torch.tanh(a @ a)"


def child(runtime: str, folder: Path, tokens: int, spinning: str | None) -> None:
    """One process: load, one warm-up generation, then ``tokens`` greedy tokens timed; prints the seconds."""
    if runtime == "torch":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import thinker  # noqa: F401  (registers the Thinker classes)

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = AutoTokenizer.from_pretrained(folder)(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    else:
        import numpy as np
        from transformers import AutoTokenizer

        import export.runtime as runtime_module

        plain_options = runtime_module.session_options

        def options(threads=None):
            made = plain_options(threads)
            made.add_session_config_entry("session.intra_op.allow_spinning", spinning)
            return made

        runtime_module.session_options = options
        decoder = runtime_module.OnnxDecoder(folder, provider="cpu")
        ids = np.asarray(AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"], dtype=np.int64)[None]
        decoder.generate(ids, max_new_tokens=2)
        started = time.perf_counter()
        decoder.generate(ids, max_new_tokens=tokens)  # SmolLM2 does not stop this early on this prompt
    print(json.dumps({"seconds": time.perf_counter() - started}))


def run_variant(name: str, folders: dict[str, Path], tokens: int) -> float:
    runtime, environment, spinning = VARIANTS[name]
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    command = [sys.executable, __file__, "--child", runtime, str(folders[runtime]), str(tokens), spinning or "-"]
    done = subprocess.run(command, capture_output=True, text=True, env={**env, **environment})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


@contextlib.contextmanager
def busy_cores(condition: str) -> Iterator[None]:
    """Nothing for "idle"; for "busy", one busy loop per core at nice 19, stopped after."""
    if condition == "idle":
        yield
        return
    if condition == "torch-busy":  # another PyTorch program, its OpenMP threads spinning as ours do
        loops = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", TORCH_LOOP])]
    else:
        loops = [
            subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
    try:
        time.sleep(1)  # the loops running before the timed process starts
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def markdown(results: dict) -> str:
    lines = [
        f"Command: `{results['command']}` on {results['machine']} ({results['cores']} cores); {results['tokens']} "
        f"greedy tokens of SmolLM2-135M, fresh processes taking turns, {results['reps']} each; median seconds and "
        "each variant's time over its default's (below 1: faster). Busy: one busy loop per core at nice 19; "
        "torch-busy: a PyTorch program's matrix products at nice 19.",
        "",
        "| variant | " + " | ".join(f"{c} s | {c} ratio" for c in CONDITIONS) + " |",
        "|---|" + "---|---|" * len(CONDITIONS),
    ]
    for name in VARIANTS:
        cells = []
        for condition in CONDITIONS:
            row = results["conditions"][condition][name]
            ratio = row.get("time_ratio")
            cells += [f"{row['seconds_median']:.2f}", "—" if ratio is None else f"{ratio:.2f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        runtime, folder, tokens, spinning = sys.argv[2:6]
        child(runtime, Path(folder), int(tokens), None if spinning == "-" else spinning)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--tokens", type=positive_int, default=24)
    args = parser.parse_args()

    import exports
    import models

    model = models.smollm2()
    fused = exports.run_export("ours-fused", model, threads=os.cpu_count() or 1, fresh=False)
    if fused.error:
        raise SystemExit(f"the fused export failed: {fused.error}")
    folders = {"torch": model.thinker, "ort": fused.folder}
    conditions: dict[str, dict] = {}
    for condition in CONDITIONS:
        seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        with busy_cores(condition):
            for rep in range(args.reps):
                order = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
                for name in order:
                    print(f"  {condition}, rep {rep + 1}/{args.reps}: {name}", file=sys.stderr, flush=True)
                    seconds[name].append(run_variant(name, folders, args.tokens))
        table = {name: {"seconds": runs, "seconds_median": statistics.median(runs)} for name, runs in seconds.items()}
        for name, default in DEFAULTS.items():
            table[name]["time_ratio"] = table[name]["seconds_median"] / table[default]["seconds_median"]
        conditions[condition] = table
    results = {
        "command": command_line(),
        "machine": machine_name(),
        "cores": os.cpu_count(),
        "reps": args.reps,
        "tokens": args.tokens,
        "conditions": conditions,
    }
    RESULTS.mkdir(exist_ok=True)
    write_result(RESULTS / "thread_wait.json", json.dumps(results, indent=2) + "\n")
    write_result(RESULTS / "README-thread-wait.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
