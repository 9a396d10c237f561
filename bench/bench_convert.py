"""Conversion throughput against ``cp`` + ``sync`` of the same files, and peak memory against the largest tensor.

Builds two Qwen3-0.6B-shaped float32 checkpoints that differ only in their number of layers (1 GB shards, like a
Hub download), then, interleaved and repeated, times ``cp`` of each one's shards followed by ``sync`` and
``thinker-convert --no-verify`` of each (a fresh process, as users run it, its output synced as part of the run).
The figure is the marginal throughput: the bytes the larger checkpoint adds over the time it adds, for the converter
and for ``cp`` alike, which leaves out what does not grow with the model (starting Python, importing torch and
transformers, planning); that fixed cost is reported on its own (the converter's time at zero bytes, extrapolated).
The converter's time is taken two ways: the whole process, and the time it reports itself (from the start of the
conversion, after the imports, to its end: planning, reading, writing, every fsync and the final rename). On a
shared machine the imports alone vary by several seconds from one run to the next, which the whole-process
difference carries and the reported one does not, so the latter is the headline ratio.

While the converter runs, its /proc status is sampled every few milliseconds: the peak resident set (``VmHWM``,
which the kernel keeps exactly) and the peaks of its anonymous part (memory the process allocated: tensors and
buffers) against the same process idle after its imports. getrusage's ``ru_maxrss`` is no use here: a child forked
from this process inherits this process's high-water mark.

    python bench/bench_convert.py [--reps 3] [--work /tmp/thinker-bench] [--keep]
    python bench/bench_convert.py --report     # the README table, from bench/results/convert.json

Timings are wall-clock on whatever else the machine is doing (the load average is recorded before and after); the
ratio to ``cp`` measured in the same interleaved runs is the figure to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from results_io import machine_name, positive_int, write_result

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "convert.json"
COMMAND = "python bench/bench_convert.py"
SHARD_BYTES = 10**9
LAYERS = (4, 40)  # the two checkpoints: ~0.9 GB and ~3.1 GB


def qwen3_config(layers: int):
    """Qwen3-0.6B's shapes (https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json), tied embeddings."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="float32",
    )


def build_checkpoint(folder: Path, layers: int) -> tuple[int, int]:
    """Random float32 weights in ~1 GB shards, one shard in memory at a time; returns (total, largest) bytes.

    The tensor names and shapes are those of transformers' own model built on the meta device (no memory)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(layers)
    with init_empty_weights():
        model = Qwen3ForCausalLM(config)
    tied = set(model.all_tied_weights_keys)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    folder.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = 4 * torch.Size(shape).numel()
        if groups[-1] and used + size > SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for index, names in enumerate(groups):
        file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: torch.randn(shapes[name], generator=generator) * 0.02 for name in names}
        save_file(tensors, folder / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file_name)
        del tensors
    sizes = [4 * torch.Size(shape).numel() for shape in shapes.values()]
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    return sum(sizes), max(sizes)


def warm_page_cache(folder: Path) -> None:
    for path in folder.iterdir():
        with path.open("rb") as handle:
            while handle.read(1 << 24):
                pass


def time_cp(source: Path, destination: Path) -> float:
    shutil.rmtree(destination, ignore_errors=True)
    destination.mkdir()
    shards = sorted(str(path) for path in source.glob("*.safetensors"))
    started = time.perf_counter()
    subprocess.run(["cp", *shards, str(destination)], check=True)
    # cp returns before its writes reach the disk; ``sync FILE...`` fsyncs exactly the copies (the converter fsyncs
    # each shard it writes), not everything else on the disk as ``sync -f`` would.
    subprocess.run(["sync", *(str(destination / Path(shard).name) for shard in shards)], check=True)
    seconds = time.perf_counter() - started
    shutil.rmtree(destination)
    return seconds


class MemorySampler:
    """Samples a process's RssAnon / RssFile from /proc every few milliseconds and keeps the peaks."""

    FIELDS = re.compile(r"^(RssAnon|RssFile|VmHWM):\s+(\d+) kB", re.MULTILINE)

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while not self._stop.is_set():
            try:
                values = {key: int(kb) * 1024 for key, kb in self.FIELDS.findall(status.read_text())}
            except (OSError, ValueError):
                return
            for key, value in values.items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            time.sleep(self.interval)


def run_measured(command: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[float, dict[str, int], str]:
    """(wall seconds, sampled memory peaks, stdout) of one child process, run in ``cwd`` (default: this one's)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with MemorySampler(process.pid) as sampler:
        output, errors = process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {errors[-2000:]}")
    return seconds, sampler.peak, output


def time_convert(source: Path, output: Path, env: dict[str, str]) -> tuple[float, float, dict[str, int]]:
    """(whole-process seconds, the seconds the converter reports, memory peaks)."""
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-c", "from converter.cli import convert_command; convert_command()"]
    seconds, peak, printed = run_measured(command + [str(source), str(output), "--no-verify"], env)
    shutil.rmtree(output)
    reported = re.search(r"weights, ([\d.]+) s", printed)
    if reported is None:
        raise SystemExit(f"thinker-convert printed no time: {printed[-500:]}")
    return seconds, float(reported.group(1)), peak


def load_average() -> float:
    return os.getloadavg()[0]


def measure(work: Path, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    sources, sizes = {}, {}
    for layers in LAYERS:
        sources[layers] = work / f"source-{layers}"
        print(f"building a {layers}-layer Qwen3-0.6B-shaped float32 checkpoint ...", flush=True)
        sizes[layers] = build_checkpoint(sources[layers], layers)
    load_before = load_average()
    runs: list[dict] = []
    for rep in range(reps):
        # Alternate the order, so that a drift in the machine's load favours neither size.
        for layers in LAYERS if rep % 2 == 0 else LAYERS[::-1]:
            warm_page_cache(sources[layers])
            cp = time_cp(sources[layers], work / "cp")
            convert, reported, peak = time_convert(sources[layers], work / "converted", env)
            runs.append(
                {
                    "layers": layers,
                    "rep": rep,
                    "cp_seconds": cp,
                    "convert_seconds": convert,
                    "convert_reported_seconds": reported,
                    "peak": peak,
                }
            )
            print(
                f"  rep {rep} {layers:>2} layers: cp+sync {cp:6.2f} s  thinker-convert {convert:6.2f} s "
                f"(reported {reported:.1f} s)",
                flush=True,
            )
    idle_seconds, idle, _ = run_measured([sys.executable, "-c", "import converter.cli, converter.convert"], env)

    small, large = LAYERS
    added = sizes[large][0] - sizes[small][0]

    def median(layers: int, key: str) -> float:
        return statistics.median(run[key] for run in runs if run["layers"] == layers)

    def marginal(key: str) -> float:
        return added / (median(large, key) - median(small, key))

    per_rep = []
    for rep in range(reps):
        pair = {run["layers"]: run for run in runs if run["rep"] == rep}
        cp_time = pair[large]["cp_seconds"] - pair[small]["cp_seconds"]
        convert_time = pair[large]["convert_reported_seconds"] - pair[small]["convert_reported_seconds"]
        per_rep.append(cp_time / convert_time)
    convert_rate, cp_rate = marginal("convert_reported_seconds"), marginal("cp_seconds")
    process_rate = marginal("convert_seconds")
    largest_tensor = max(size[1] for size in sizes.values())
    peak = {key: max(run["peak"][key] for run in runs) for key in ("VmHWM", "RssAnon", "RssFile")}
    return {
        "machine": {
            "platform": platform.platform(),
            "cpu": machine_name(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "command": COMMAND + (f" --reps {reps}" if reps != 3 else ""),
        "checkpoints": [
            {"shape": "Qwen3-0.6B", "dtype": "float32", "layers": layers, "bytes": sizes[layers][0]}
            for layers in LAYERS
        ],
        "largest_tensor_bytes": largest_tensor,
        "runs": runs,
        "median_seconds": {
            str(layers): {
                "cp": median(layers, "cp_seconds"),
                "convert_process": median(layers, "convert_seconds"),
                "convert_reported": median(layers, "convert_reported_seconds"),
            }
            for layers in LAYERS
        },
        "marginal_bytes": added,
        "cp_marginal_gb_per_s": cp_rate / 1e9,
        "convert_marginal_gb_per_s": convert_rate / 1e9,
        "convert_process_marginal_gb_per_s": process_rate / 1e9,
        "marginal_throughput_fraction_of_cp": convert_rate / cp_rate,
        "process_marginal_throughput_fraction_of_cp": process_rate / cp_rate,
        "per_rep_fraction_of_cp": per_rep,
        "convert_fixed_seconds": median(small, "convert_seconds") - sizes[small][0] / process_rate,
        "idle_process_seconds": idle_seconds,
        "peak_rss_bytes": peak["VmHWM"],
        "peak_rss_anon_bytes": peak["RssAnon"],
        "peak_rss_file_bytes": peak["RssFile"],
        "idle_process_rss_anon_bytes": idle["RssAnon"],
        "peak_anon_above_idle_bytes": peak["RssAnon"] - idle["RssAnon"],
    }


def report(result: dict) -> str:
    """The README table."""
    gib = 2**30
    small, large = result["checkpoints"]
    seconds = result["median_seconds"]
    rows = [
        (
            "checkpoints (Qwen3-0.6B shapes, float32)",
            f"{small['layers']} and {large['layers']} layers: {small['bytes'] / gib:.2f} and "
            f"{large['bytes'] / gib:.2f} GiB; largest tensor (embeddings) "
            f"{result['largest_tensor_bytes'] / gib:.2f} GiB",
        ),
        (
            "`cp` + `sync`, median",
            f"{seconds[str(small['layers'])]['cp']:.1f} s and {seconds[str(large['layers'])]['cp']:.1f} s: "
            f"{result['cp_marginal_gb_per_s']:.2f} GB/s marginal",
        ),
        (
            "`thinker-convert --no-verify`, the time it reports (after imports), median",
            f"{seconds[str(small['layers'])]['convert_reported']:.1f} s and "
            f"{seconds[str(large['layers'])]['convert_reported']:.1f} s: "
            f"{result['convert_marginal_gb_per_s']:.2f} GB/s marginal",
        ),
        (
            "marginal throughput as a fraction of `cp` + `sync` (goal ≥ 0.8)",
            f"**{result['marginal_throughput_fraction_of_cp']:.2f}** (each repetition on its own: "
            + ", ".join(f"{value:.2f}" for value in result["per_rep_fraction_of_cp"])
            + ")",
        ),
        (
            "the same from whole-process times, median",
            f"{seconds[str(small['layers'])]['convert_process']:.1f} s and "
            f"{seconds[str(large['layers'])]['convert_process']:.1f} s: "
            f"{result['convert_process_marginal_gb_per_s']:.2f} GB/s marginal, "
            f"{result['process_marginal_throughput_fraction_of_cp']:.2f} of `cp`",
        ),
        (
            "fixed cost of a conversion (time at zero bytes)",
            f"{result['convert_fixed_seconds']:.1f} s; the process that only imports the converter: "
            f"{result['idle_process_seconds']:.1f} s",
        ),
        (
            "peak RSS",
            f"{result['peak_rss_bytes'] / gib:.2f} GiB (idle process after imports: "
            f"{result['idle_process_rss_anon_bytes'] / gib:.2f} GiB allocated)",
        ),
        (
            "memory allocated above the idle process",
            f"{result['peak_anon_above_idle_bytes'] / gib:.2f} GiB = "
            f"{result['peak_anon_above_idle_bytes'] / result['largest_tensor_bytes']:.2f} × the largest tensor",
        ),
        (
            "load average (2 cores, shared) before / after",
            f"{result['machine']['load_average_before']:.1f} / {result['machine']['load_average_after']:.1f}",
        ),
    ]
    lines = [f"Command: `{result['command']}`", "", "| | |", "|---|---|"]
    return "\n".join(lines + [f"| {label} | {value} |" for label, value in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/thinker-bench"), help="scratch folder (deleted)")
    parser.add_argument("--reps", type=positive_int, default=3, help="interleaved repetitions of each measurement")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--report", action="store_true", help="print the README table from the results file")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(RESULTS.read_text())))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    try:
        result = measure(args.work, args.reps)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS, json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
