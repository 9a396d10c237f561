"""Every graph the benchmark runs, exported by its own tool, each export timed (wall clock, peak RSS).

  ours-plain     thinker export --graph plain                 (standard ONNX operators)
  ours-fused     thinker export --graph fused                 (onnxruntime contrib operators)
  ours-fused-last  ... --logits last                          (the head on each row's last position only)
  ours-int4      thinker export --graph fused --quantize int4 (its defaults: symmetric RTN, block 32, accuracy level
                 4, the mixed head: its first 8192 rows at 8 bits)
  ours-int4-h8   ... --quantize-head int8                     (the whole head at 8 bits)
  ours-int4-h4   ... --quantize-head int4                     (the head at 4 bits too, as the builder's)
  ours-int4-hqq  ... --algo hqq                               (fidelity only: onnxruntime's CPU kernel is slow)
  ours-int8      ... --quantize int8
  ours-fp16      thinker export --graph fused --dtype float16 (bench_gpu.py)
  ours-int4-fp16 ... --quantize int4, float16 activations (bench_gpu.py: the CUDA int4 graph)
  builder-fp32   python -m onnxruntime_genai.models.builder -p fp32 -e cpu   (its own environment)
  builder-int4   python -m onnxruntime_genai.models.builder -p int4 -e cpu   (its defaults: symmetric RTN, block 32,
                 accuracy level 4, int4 head and int4 embedding table)
  builder-int8   ... -p int8 -e cpu (bench_int8.py)
  builder-fp16-cuda, builder-int4-cuda   the builder's -p fp16 / int4 -e cuda (bench_gpu.py)
  optimum-fp32   python -m optimum.exporters.onnx --task text-generation-with-past (its own environment)

Each tool runs in a child process started by a small Python wrapper, so the peak RSS is the tool's own (the
wrapper's ``RUSAGE_CHILDREN`` covers the tool and whatever it starts).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from models import CACHE, BenchModel
from peer_envs import python_of

REPO = Path(__file__).resolve().parent.parent
WRAPPER = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"seconds": time.perf_counter() - started, "returncode": done.returncode,
                  "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "stderr": done.stderr[-3000:]}))
"""
OURS = {
    "ours-plain": ["--graph", "plain"],
    "ours-fused": ["--graph", "fused"],
    "ours-fused-last": ["--graph", "fused", "--logits", "last"],
    "ours-fused-embeds": ["--graph", "fused", "--inputs-embeds"],
    "ours-int4": ["--graph", "fused", "--quantize", "int4"],
    "ours-int4-h8": ["--graph", "fused", "--quantize", "int4", "--quantize-head", "int8"],
    "ours-int4-h4": ["--graph", "fused", "--quantize", "int4", "--quantize-head", "int4"],
    "ours-int4-hqq": ["--graph", "fused", "--quantize", "int4", "--algo", "hqq"],
    "ours-int8": ["--graph", "fused", "--quantize", "int8"],
    "ours-fp16": ["--graph", "fused", "--dtype", "float16"],
    "ours-int4-fp16": ["--graph", "fused", "--dtype", "float16", "--quantize", "int4"],
    "ours-int4-fp16-h4": ["--graph", "fused", "--dtype", "float16", "--quantize", "int4", "--quantize-head", "int4"],
}
# name -> the builder's (-p precision, -e execution provider)
BUILDER = {
    "builder-fp32": ("fp32", "cpu"),
    "builder-int4": ("int4", "cpu"),
    "builder-int8": ("int8", "cpu"),
    "builder-fp16-cuda": ("fp16", "cuda"),
    "builder-int4-cuda": ("int4", "cuda"),
}
CPU_EXPORTS = [
    "ours-plain",
    "ours-fused",
    "ours-fused-last",
    "ours-int4",
    "ours-int4-h8",
    "ours-int4-h4",
    "ours-int4-hqq",
    "ours-int8",
    "builder-fp32",
]
CPU_EXPORTS += ["builder-int4", "optimum-fp32"]  # bench_fast.py's


@dataclass
class Export:
    name: str
    folder: Path
    seconds: float | None  # None: taken from an earlier run's cache
    peak_rss: int | None
    error: str | None = None


def timed(command: list[str], cwd: Path | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"the timing wrapper failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def export_command(name: str, model: BenchModel, out: Path, threads: int) -> list[str]:
    if name in OURS:
        return [
            sys.executable,
            "-m",
            "thinker_common.cli",
            "export",
            str(model.thinker),
            str(out),
            "--no-verify",
            "--threads",
            str(threads),
            *OURS[name],
        ]
    if name in BUILDER:
        builder = [str(python_of("builder")), "-m", "onnxruntime_genai.models.builder"]
        precision, provider = BUILDER[name]
        return [
            *builder,
            "-i",
            str(model.hf),
            "-o",
            str(out),
            "-p",
            precision,
            "-e",
            provider,
            "-c",
            str(CACHE / "builder-cache"),
        ]
    if name == "optimum-fp32":
        source = optimum_source(model)
        return [
            str(python_of("optimum")),
            "-m",
            "optimum.exporters.onnx",
            "--model",
            str(source),
            "--task",
            "text-generation-with-past",
            str(out),
        ]
    raise ValueError(name)


def optimum_source(model: BenchModel) -> Path:
    """The HF folder as transformers 4.x reads it: v5 writes ``rope_parameters``, v4 wants ``rope_theta`` at the
    top level (without it, v4 silently uses its default theta). Weights and tokenizer are linked, not copied."""
    folder = CACHE / f"{model.name}-hf-v4"
    if folder.exists():
        return folder
    folder.mkdir()
    for path in model.hf.iterdir():
        if path.name != "config.json":
            (folder / path.name).symlink_to(path)
    config = json.loads((model.hf / "config.json").read_text())
    config.update({k: v for k, v in (config.get("rope_parameters") or {}).items() if k == "rope_theta"})
    config["torch_dtype"] = config.get("dtype", "float32")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_export(name: str, model: BenchModel, threads: int, fresh: bool) -> Export:
    """Exports ``name`` into the cache (again when ``fresh``: the timings come from this run)."""
    out = CACHE / "exports" / model.name / name
    if out.exists() and not fresh:
        return Export(name, out, None, None)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = timed(export_command(name, model, out, threads), cwd=REPO)
    if figures["returncode"] != 0:
        return Export(name, out, None, None, error=figures["stderr"].strip().splitlines()[-1:][0][:500])
    return Export(name, out, figures["seconds"], figures["peak_rss"])


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model") and p.is_file())
