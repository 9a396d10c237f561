"""Where a hybrid decoder's time goes under onnxruntime-genai: onnxruntime's profiler, time per operator type.

    python bench/profile_hybrid.py FOLDER [FOLDER ...] --prompt 128 --new 17 --threads 2

Each folder (ours, the builder's, mobius's decoder-only export) is run once in onnxruntime-genai's environment
(bench/peer_envs.py) with the session option ``enable_profiling`` set through a config overlay: batch 1, a prompt of
random ids, greedy new tokens. The trace's ``model_run`` events split the prefill (the first run) from the decode
steps (the rest); node events are summed per operator type within each. Shares of a run are robust to the load that
other jobs put on a shared machine; absolute times are not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from results_io import command_line, result_file, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script

from peer_envs import python_of  # noqa: E402

# Runs in the genai environment: it imports nothing from this repository.
RUNNER = """
import json, sys
import numpy as np
import onnxruntime_genai as og
folder, prefix, prompt, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
config = og.Config(folder)
config.clear_providers()
options = {"intra_op_num_threads": threads, "enable_profiling": prefix}
config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
model = og.Model(config)
ids = np.random.default_rng(0).integers(0, 49152, size=(1, prompt), dtype=np.int64)
params = og.GeneratorParams(model)
params.set_search_options(do_sample=False, max_length=prompt + new, min_length=prompt + new, batch_size=1)
generator = og.Generator(model, params)
generator.append_tokens(ids)
for _ in range(new):
    generator.generate_next_token()
del generator, model  # the profile is written when the session closes
"""


def op_times(trace: list[dict], by_node: bool = False) -> tuple[dict[str, float], dict[str, float], int]:
    """Microseconds per operator type (``by_node``: per node) in the first run (prefill) and over the later runs
    (decode), and the number of later runs."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "model_run")
    prefill: dict[str, float] = defaultdict(float)
    decode: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        bucket = prefill if runs and event["ts"] < runs[0][1] else decode
        key = event["name"].removesuffix("_kernel_time") if by_node else event["args"]["op_name"]
        bucket[key] += event["dur"]
    prefill["(run)"] = runs[0][1] - runs[0][0] if runs else 0.0
    decode["(run)"] = sum(end - start for start, end in runs[1:])
    return dict(prefill), dict(decode), max(len(runs) - 1, 0)


def profile(folder: Path, prompt: int, new: int, threads: int, by_node: bool) -> tuple[dict, dict, int]:
    with tempfile.TemporaryDirectory() as scratch:
        prefix = str(Path(scratch) / "profile")
        done = subprocess.run(
            [str(python_of("genai")), "-c", RUNNER, str(folder), prefix, str(prompt), str(new), str(threads)],
            capture_output=True,
            text=True,
            cwd=scratch,
        )
        if done.returncode != 0:
            raise SystemExit(f"{folder}: onnxruntime-genai failed:\n{done.stderr[-2000:]}")
        traces = sorted(Path(scratch).glob("profile*.json"))
        if not traces:
            raise SystemExit(f"{folder}: no profile written")
        return op_times(json.loads(traces[-1].read_text()), by_node)


def table(name: str, times: dict[str, float], runs: int) -> str:
    total = times.pop("(run)")
    lines = [f"{name}: {total / 1000 / max(runs, 1):.2f} ms per run ({runs} runs)"]
    for op, us in sorted(times.items(), key=lambda item: -item[1]):
        if us / total >= 0.002:
            lines.append(f"  {op:34.70s} {us / 1000 / max(runs, 1):8.3f} ms  {100 * us / total:5.1f} %")
    lines.append(f"  {'(outside kernels)':34s} {(total - sum(times.values())) / 1000 / max(runs, 1):8.3f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=17)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--nodes", action="store_true", help="time per node instead of per operator type")
    parser.add_argument("--out", type=result_file, help="also write the times (microseconds per run) to this JSON file")
    args = parser.parse_args()
    results = {}
    for folder in args.folders:
        prefill, decode, steps = profile(folder.resolve(), args.prompt, args.new, args.threads, args.nodes)
        results[str(folder)] = {
            "prefill_us": prefill["(run)"],
            "decode_steps": steps,
            "decode_us_per_step": decode["(run)"] / max(steps, 1),
            "decode_by_op_us_per_step": {op: us / max(steps, 1) for op, us in decode.items() if op != "(run)"},
        }
        print(table(f"{folder} prefill {args.prompt}", prefill, 1))
        print(table(f"{folder} decode", decode, steps))
    if args.out:
        settings = {"prompt": args.prompt, "new": args.new, "threads": args.threads, "command": command_line()}
        write_result(args.out, json.dumps({"settings": settings, "folders": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
