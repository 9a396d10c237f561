"""Conversion throughput against ``cp`` of the same files, and peak memory against checkpoint size.

Builds a Qwen3-0.6B-shaped checkpoint with random float32 weights (2.4 GB in 1 GB shards, like a Hub download),
warms the page cache, then times ``cp`` of the shards and ``thinker-convert --no-verify`` (a fresh process, as users
run it) on the same files. While the converter runs, its /proc status is sampled every few milliseconds: the peak
resident set (``VmHWM``, which the kernel keeps exactly) and the peaks of its anonymous part (memory the process
allocated: tensors) and file-backed part (mapped files: libraries, and any mapped checkpoint pages). getrusage's
``ru_maxrss`` is no use here: a child forked from this process inherits this process's high-water mark.

    python bench/bench_convert.py [--work /tmp/thinker-bench] [--keep]

Prints a table and writes bench/results/convert.json. Timings are wall-clock on whatever else the machine is doing;
the fraction of ``cp`` is the figure to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "convert.json"
SHARD_BYTES = 10**9

# Qwen3-0.6B's shapes (https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json), tied embeddings.
QWEN3_0_6B = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    dtype="float32",
)


def qwen3_tensor_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors in the order transformers writes them (embeddings, then layer by layer)."""
    c, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    shapes = {"model.embed_tokens.weight": (config.vocab_size, c)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (c,),
            f"{layer}.self_attn.q_proj.weight": (q, c),
            f"{layer}.self_attn.k_proj.weight": (kv, c),
            f"{layer}.self_attn.v_proj.weight": (kv, c),
            f"{layer}.self_attn.o_proj.weight": (c, q),
            f"{layer}.self_attn.q_norm.weight": (config.head_dim,),
            f"{layer}.self_attn.k_norm.weight": (config.head_dim,),
            f"{layer}.post_attention_layernorm.weight": (c,),
            f"{layer}.mlp.gate_proj.weight": (config.intermediate_size, c),
            f"{layer}.mlp.up_proj.weight": (config.intermediate_size, c),
            f"{layer}.mlp.down_proj.weight": (c, config.intermediate_size),
        }
    return shapes | {"model.norm.weight": (c,)}


def build_checkpoint(folder: Path) -> tuple[int, int]:
    """Random float32 weights in ~1 GB shards, one shard in memory at a time; returns (total, largest) bytes."""
    folder.mkdir(parents=True)
    shapes = qwen3_tensor_shapes(QWEN3_0_6B)
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
    QWEN3_0_6B.save_pretrained(folder)
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
    subprocess.run(["sync", "-f", str(destination)], check=True)  # cp returns before its writes reach the disk
    return time.perf_counter() - started


class MemorySampler:
    """Samples a process's RssAnon / RssFile from /proc every few milliseconds and keeps the peaks."""

    FIELDS = re.compile(r"^(RssAnon|RssFile|VmHWM):\s+(\d+) kB", re.MULTILINE)

    def __init__(self, pid: int, interval: float = 0.005) -> None:
        self.pid, self.interval = pid, interval
        self.peak = {"RssAnon": 0, "RssFile": 0, "Rss": 0, "VmHWM": 0}
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
            values["Rss"] = values.get("RssAnon", 0) + values.get("RssFile", 0)
            for key, value in values.items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            time.sleep(self.interval)


def run_measured(command: list[str], env: dict[str, str]) -> tuple[float, dict[str, int], str]:
    """(wall seconds, sampled memory peaks, stdout) of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    with MemorySampler(process.pid) as sampler:
        _, status = os.waitpid(process.pid, 0)
    seconds = time.perf_counter() - started
    output = process.stdout.read()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed with exit code {process.returncode}")
    return seconds, sampler.peak, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/thinker-bench"), help="scratch folder (deleted)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    source, copied, converted = args.work / "source", args.work / "cp", args.work / "converted"
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    python = sys.executable
    try:
        print(f"building a Qwen3-0.6B-shaped float32 checkpoint in {source} ...", flush=True)
        checkpoint_bytes, largest_tensor = build_checkpoint(source)
        warm_page_cache(source)

        cp_seconds = min(time_cp(source, copied) for _ in range(2))
        shutil.rmtree(copied)

        # The converter's process without the conversion: interpreter, torch, transformers, thinker.
        _, idle, _ = run_measured([python, "-c", "import converter.cli, converter.convert"], env)
        convert = [python, "-c", "from converter.cli import convert_command; convert_command()"]
        convert_seconds, peak, output = run_measured(convert + [str(source), str(converted), "--no-verify"], env)
        subprocess.run(["sync", "-f", str(converted)], check=True)
        inner = re.search(r"weights, ([\d.]+) s", output)
        engine_seconds = float(inner.group(1)) if inner else float("nan")
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)

    gib = 2**30
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "checkpoint": {
            "shape": "Qwen3-0.6B",
            "dtype": "float32",
            "bytes": checkpoint_bytes,
            "largest_tensor_bytes": largest_tensor,
        },
        "cp_seconds": cp_seconds,
        "convert_process_seconds": convert_seconds,
        "convert_seconds_excluding_startup": engine_seconds,
        "throughput_fraction_of_cp": cp_seconds / convert_seconds,
        "throughput_fraction_of_cp_excluding_startup": cp_seconds / engine_seconds,
        "convert_gb_per_s": checkpoint_bytes / 1e9 / engine_seconds,
        "cp_gb_per_s": checkpoint_bytes / 1e9 / cp_seconds,
        "peak_rss_bytes": peak["VmHWM"],
        "peak_rss_anon_bytes": peak["RssAnon"],
        "peak_rss_file_bytes": peak["RssFile"],
        "idle_process_rss_anon_bytes": idle["RssAnon"],
        "idle_process_peak_rss_bytes": idle["VmHWM"],
        "peak_anon_above_idle_bytes": peak["RssAnon"] - idle["RssAnon"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        ("checkpoint (Qwen3-0.6B shapes, fp32)", f"{checkpoint_bytes / gib:.2f} GiB"),
        ("largest tensor (embeddings)", f"{largest_tensor / gib:.2f} GiB"),
        ("cp of the shards (warm cache, synced)", f"{cp_seconds:.1f} s  ({result['cp_gb_per_s']:.2f} GB/s)"),
        ("thinker-convert, whole process", f"{convert_seconds:.1f} s"),
        ("thinker-convert, excluding startup", f"{engine_seconds:.1f} s  ({result['convert_gb_per_s']:.2f} GB/s)"),
        (
            "throughput as a fraction of cp",
            f"{result['throughput_fraction_of_cp']:.2f} (excl. startup "
            f"{result['throughput_fraction_of_cp_excluding_startup']:.2f})",
        ),
        ("peak RSS (VmHWM)", f"{peak['VmHWM'] / gib:.2f} GiB = {peak['VmHWM'] / checkpoint_bytes:.2f} × checkpoint"),
        ("  of which anonymous (allocated)", f"{peak['RssAnon'] / gib:.2f} GiB"),
        ("  of which file-backed (libraries)", f"{peak['RssFile'] / gib:.2f} GiB"),
        ("peak RSS of the same process idle (imports)", f"{idle['VmHWM'] / gib:.2f} GiB"),
        (
            "anonymous above an idle process",
            f"{result['peak_anon_above_idle_bytes'] / gib:.2f} GiB "
            f"= {result['peak_anon_above_idle_bytes'] / largest_tensor:.2f} × largest tensor",
        ),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
