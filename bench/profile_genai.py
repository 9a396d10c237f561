"""Where a decode step's time goes under onnxruntime-genai: onnxruntime's own profiler, per op type.

Runs in the onnxruntime-genai environment (bench/peer_envs.py), one folder per call: the folder's own
genai_config.json with two overlays, the session's intra-op threads and ``enable_profiling``; one greedy
generation (batch B, a P-token prompt, N new tokens) after an untimed warm-up of the same length; then
onnxruntime's trace is read back: the kernel time of every node, grouped by op type and averaged over the decode
steps (the generation's ``model_run`` events after its first, the prompt's, reported apart), next to the wall time
of those steps.

    ~/.cache/thinker-test-genai-venv/bin/python bench/profile_genai.py FOLDER --batch 8 --json out.json
    python bench/profile_genai.py A B --batch 1                # our environment: runs both, prints side by side
    python bench/profile_genai.py A B --provider cuda          # on a GPU (the kit's Python: bench/gpu_kit.py)

On CUDA a node's kernel time is the host's time in it (launching its kernels; the GPU runs them asynchronously),
which is what a launch-bound decode step spends; the table also counts the nodes each provider ran per step, since a
node the CUDA provider leaves to the CPU costs a copy each way and a synchronisation.

Prints a table; ``--json`` writes the figures (bench/bench_fast.py-style results use them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from results_io import command_line, write_result

VOCAB_CAP = 49152
WARM_STEPS = 2  # the warm-up's forwards: its prompt's and one decode step's


def profile(folder: Path, trace_dir: Path, batch: int, prompt: int, new: int, threads: int, provider: str) -> float:
    """One profiled generation; returns the wall seconds of its decode steps. onnxruntime writes the trace into
    ``trace_dir`` when the session ends, which onnxruntime-genai leaves to the end of the process."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    if provider == "cuda":
        config.append_provider("cuda")
    options = {"intra_op_num_threads": threads, "enable_profiling": str(trace_dir / "trace")}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    ids = np.random.default_rng(0).integers(0, VOCAB_CAP, size=(batch, prompt), dtype=np.int64)

    def generator():
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=prompt + new, min_length=prompt + new, batch_size=batch)
        return og.Generator(model, params)

    # A warm-up of the same length first (its runs are left out by ``summarize``): a process's first prompt
    # loads kernels and, on Hopper, builds GroupQueryAttention's cuDNN plan for this KV capacity (about a second)
    warm = generator()
    warm.append_tokens(ids)
    for _ in range(WARM_STEPS):
        warm.generate_next_token()
    del warm
    timed = generator()
    timed.append_tokens(ids)
    started = time.perf_counter()
    for _ in range(new):
        timed.generate_next_token()
    return time.perf_counter() - started


def summarize(events: list[dict], wall: float, decode_steps: int) -> dict:
    """The figures of the profiled generation: its last ``decode_steps + 1`` runs (its prompt's, then one per
    decode step); the warm-up's runs before them are left out."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    runs = runs[-(decode_steps + 1) :]
    decode_runs = runs[1:]  # the first is the prompt's
    prompt_by_op: dict[str, float] = defaultdict(float)  # the prompt's run, apart (its time is not a step's)
    by_op: dict[str, float] = defaultdict(float)
    by_node: dict[str, float] = defaultdict(float)
    nodes_by_provider: dict[str, int] = defaultdict(int)
    off_device: dict[str, str] = {}  # the nodes the CPU ran while a device provider ran the rest: name -> op type
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if runs and runs[0][0] <= event["ts"] <= runs[0][1]:
            prompt_by_op[event["args"]["op_name"]] += event["dur"]
        if not any(start <= event["ts"] <= end for start, end in decode_runs):
            continue
        by_op[event["args"]["op_name"]] += event["dur"]
        by_node[event["name"].removesuffix("_kernel_time")] += event["dur"]
        provider = event["args"].get("provider", "?").removesuffix("ExecutionProvider")
        nodes_by_provider[provider] += 1
        if provider == "CPU":
            off_device[event["name"].removesuffix("_kernel_time")] = event["args"]["op_name"]
    steps = max(len(decode_runs), 1)
    run_us = sum(end - start for start, end in decode_runs) / steps
    return {
        "decode_steps": len(decode_runs),
        "wall_ms_per_step": 1e3 * wall / max(decode_steps, 1),
        "session_run_ms_per_step": run_us / 1e3,
        "kernel_ms_per_step": sum(by_op.values()) / steps / 1e3,
        "nodes_per_step": {name: count / steps for name, count in sorted(nodes_by_provider.items())},
        "cpu_nodes": dict(sorted(off_device.items())) if len(nodes_by_provider) > 1 else {},
        "prompt_run_ms": (runs[0][1] - runs[0][0]) / 1e3 if runs else None,
        "prompt_by_op_ms": {op: us / 1e3 for op, us in sorted(prompt_by_op.items(), key=lambda kv: -kv[1])[:12]},
        "by_op_ms_per_step": {op: us / steps / 1e3 for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "top_nodes_ms_per_step": {
            node: us / steps / 1e3 for node, us in sorted(by_node.items(), key=lambda kv: -kv[1])[:12]
        },
    }


def report_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def table(results: dict[str, dict]) -> str:
    names = list(results)
    ops = sorted(
        {op for r in results.values() for op in r["by_op_ms_per_step"]},
        key=lambda op: -max(r["by_op_ms_per_step"].get(op, 0.0) for r in results.values()),
    )
    lines = ["| ms per decode step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    prompt_runs = [report_ms(results[n].get("prompt_run_ms")) for n in names]
    lines.append("| the prompt's run (ms, once) | " + " | ".join(prompt_runs) + " |")
    for key in ("wall_ms_per_step", "session_run_ms_per_step", "kernel_ms_per_step"):
        lines.append(
            f"| {key.removesuffix('_ms_per_step').replace('_', ' ')} | "
            + " | ".join(f"{results[n][key]:.2f}" for n in names)
            + " |"
        )
    providers = sorted({name for r in results.values() for name in r["nodes_per_step"]})
    for name in providers:
        counts = [results[n]["nodes_per_step"].get(name, 0.0) for n in names]
        lines.append(f"| nodes run on {name} | " + " | ".join(f"{count:.0f}" for count in counts) + " |")
    for op in ops:
        lines.append(
            f"| {op} | " + " | ".join(f"{results[n]['by_op_ms_per_step'].get(op, 0.0):.2f}" for n in names) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all folders, interleaved; the fastest kept")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run in the genai env
    parser.add_argument("--trace-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        wall = profile(args.folders[0], args.trace_dir, args.batch, args.prompt, args.new, args.threads, args.provider)
        print(json.dumps({"wall": wall}))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_envs import python_of

    python = python_of("genai")
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for folder in args.folders:
            with tempfile.TemporaryDirectory() as trace_dir:
                command = [str(python), __file__, str(folder), "--one", "--trace-dir", trace_dir]
                for option in ("batch", "prompt", "new", "threads", "provider"):
                    command += [f"--{option}", str(getattr(args, option))]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{folder}: {done.stderr[-2000:]}")
                wall = json.loads(done.stdout.strip().splitlines()[-1])["wall"]
                traces = sorted(Path(trace_dir).glob("trace*.json"))
                if not traces:
                    raise RuntimeError(f"{folder}: onnxruntime-genai wrote no profile")
                figures = summarize(json.loads(traces[-1].read_text()), wall, args.new - 1)
            name = folder.name
            if name not in results or figures["wall_ms_per_step"] < results[name]["wall_ms_per_step"]:
                results[name] = figures
    print(f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {args.threads} threads, {args.provider}\n")
    print(table(results))
    for name, figures in results.items():
        if figures["cpu_nodes"]:
            print(
                f"\n{name}: nodes the CPU ran each step: "
                + ", ".join(f"{n} ({op})" for n, op in figures["cpu_nodes"].items())
            )
    if args.json:
        settings = vars(args) | {"folders": [str(f) for f in args.folders], "json": str(args.json)}
        record = {"command": command_line(), "settings": settings, "results": results}
        write_result(args.json, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
