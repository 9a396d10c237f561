"""A checkpoint larger than half the machine's memory, converted and verified layer by layer, with the peak memory of
each step.

Builds a Qwen3-MoE checkpoint in bfloat16 with Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts of 768, GQA
32/4, vocabulary 151936, untied head) and fewer layers (12 by default: about 16 GB), in the per-expert layout of the
Hub releases: the tensor names and shapes come from transformers' ``Qwen3MoeForCausalLM`` built on the meta device,
the values are random, and each layer is generated and written as its own shard, so this process never holds more
than one layer. Then, each in a fresh process whose /proc status is sampled every few milliseconds:

1. ``thinker-convert SOURCE OUT --no-verify``: the conversion alone (experts stacked one layer at a time);
2. ``thinker verify SOURCE OUT``: the two models in float32 would need 8 bytes per parameter, far beyond the memory
   budget, so it verifies layer by layer by itself (float32, then bfloat16); its report must say so and pass;
3. a process that only imports the converter: its resident set after the imports is the idle figure the bound is
   stated against.

The bound checked: peak RSS of the verification ≤ the idle process + 4 x the largest layer's bytes on disk.

    python bench/bench_big.py [--layers 12] [--source-dtype bfloat16] [--dtype bfloat16] [--work DIR] [--keep]
    python bench/bench_big.py --report        # the README table, from bench/results/big.json

The checkpoint and the converted folder (twice its size on disk in all) are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from results_io import machine_name, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import MemorySampler, load_average  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "big.json"
COMMAND = "python bench/bench_big.py"
GIB = 2**30


def qwen3_moe_config(layers: int, dtype: str = "bfloat16"):
    """Qwen3-30B-A3B's shapes (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json), fewer layers."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype=dtype,
    )


def per_expert_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hub layout, by name: transformers 5 holds the experts fused (``experts.gate_up_proj``
    (E, 2I, C), ``experts.down_proj`` (E, C, I)) and writes them back per expert, as the Hub checkpoints are."""
    from accelerate import init_empty_weights
    from transformers import Qwen3MoeForCausalLM

    with init_empty_weights():
        model = Qwen3MoeForCausalLM(config)
    shapes = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, (experts, rows, columns) = name.removesuffix("gate_up_proj"), tensor.shape
            for expert in range(experts):
                shapes[f"{prefix}{expert}.gate_proj.weight"] = (rows // 2, columns)
                shapes[f"{prefix}{expert}.up_proj.weight"] = (rows // 2, columns)
        elif name.endswith("mlp.experts.down_proj"):
            prefix, (experts, rows, columns) = name.removesuffix("down_proj"), tensor.shape
            for expert in range(experts):
                shapes[f"{prefix}{expert}.down_proj.weight"] = (rows, columns)
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def build_checkpoint(folder: Path, layers: int, dtype: str = "bfloat16") -> dict:
    """Random weights, one shard per decoder layer plus one for the rest, one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    config = qwen3_moe_config(layers, dtype)
    stored = getattr(torch, dtype)
    shapes = per_expert_shapes(config)
    folder.mkdir(parents=True)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        parts = name.split(".")
        key = f"layer-{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    generator = torch.Generator().manual_seed(0)
    weight_map, sizes = {}, {}
    for index, (key, names) in enumerate(sorted(groups.items())):
        file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            values = torch.randn(shapes[name], generator=generator, dtype=torch.float32).mul_(0.02)
            if "norm" in name:
                values.add_(1.0)  # norm weights around one, so activations keep their scale
            tensors[name] = values.to(stored)
            del values
        save_file(tensors, folder / file_name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file_name)
        sizes[key] = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        print(f"  wrote {file_name} ({sizes[key] / GIB:.2f} GiB)", flush=True)
        del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    parameters = sum(torch.Size(shape).numel() for shape in shapes.values())
    return {
        "bytes": sum(sizes.values()),
        "parameters": parameters,
        "layers": layers,
        "largest_layer_bytes": max(size for key, size in sizes.items() if key != "rest"),
        "embeddings_and_head_bytes": sizes["rest"],
    }


# The resident set of a process that has imported what verification imports, and nothing more.
IDLE_RSS = (
    "import converter.convert, converter.layer_parity, pathlib; "
    "print(next(int(line.split()[1]) * 1024 for line in pathlib.Path('/proc/self/status').read_text().splitlines() "
    "if line.startswith('VmRSS:')))"
)


def run_measured(command: list[str], env: dict[str, str]) -> dict:
    """Wall seconds, memory peaks and output of one child process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with MemorySampler(process.pid) as sampler:
        output = process.communicate()[0]
    return {
        "seconds": time.perf_counter() - started,
        "exit_code": process.returncode,
        "peak_rss_bytes": sampler.peak["VmHWM"],
        "peak_rss_anon_bytes": sampler.peak["RssAnon"],
        "output_tail": output[-3000:],
    }


def measure(work: Path, layers: int, source_dtype: str, dtype: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    env.pop("THINKER_VERIFY_MEMORY", None)  # the budget is the machine's own
    source, converted = work / "source", work / "converted"
    print(f"building a {layers}-layer Qwen3-MoE checkpoint ({source_dtype}, per-expert tensors) in {source} ...")
    started = time.perf_counter()
    checkpoint = build_checkpoint(source, layers, source_dtype)
    build_seconds = time.perf_counter() - started
    load_before = load_average()

    print("converting (thinker-convert --no-verify) ...", flush=True)
    convert_command = [sys.executable, "-c", "from converter.cli import convert_command; convert_command()"]
    conversion = run_measured(convert_command + [str(source), str(converted), "--no-verify", "--dtype", dtype], env)
    if conversion["exit_code"]:
        raise SystemExit(f"conversion failed:\n{conversion['output_tail']}")
    print(f"  {conversion['seconds']:.0f} s, peak RSS {conversion['peak_rss_bytes'] / GIB:.2f} GiB", flush=True)

    print("verifying (thinker verify; layer by layer, as the whole models do not fit) ...", flush=True)
    verify_command = [sys.executable, "-c", "from thinker_common.cli import main; main()", "verify"]
    verification = run_measured(verify_command + [str(source), str(converted)], env)
    print(f"  {verification['seconds']:.0f} s, peak RSS {verification['peak_rss_bytes'] / GIB:.2f} GiB", flush=True)
    parity = json.loads((converted / "parity.json").read_text()) if (converted / "parity.json").is_file() else None

    idle = subprocess.run([sys.executable, "-c", IDLE_RSS], env=env, capture_output=True, text=True, check=True)
    idle_rss = int(idle.stdout.split()[-1])
    largest_unit = max(checkpoint["largest_layer_bytes"], checkpoint["embeddings_and_head_bytes"] // 2)
    bound = idle_rss + 4 * largest_unit
    import psutil

    return {
        "command": f"{COMMAND} --layers {layers}"
        + (f" --source-dtype {source_dtype}" if source_dtype != "bfloat16" else "")
        + (f" --dtype {dtype}" if dtype != "bfloat16" else ""),
        "machine": {
            "platform": platform.platform(),
            "cpu": machine_name(),
            "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
        "checkpoint": checkpoint | {"shape": "Qwen3-30B-A3B", "dtype": source_dtype, "build_seconds": build_seconds},
        "converted_dtype": dtype,
        "conversion": conversion,
        "verification": verification
        | {
            "passed": bool(parity and parity["passed"]),
            "mode": parity and parity["mode"],
            "mode_note": parity and parity["mode_note"],
            "results": [
                {
                    "dtype": result["dtype"],
                    "max_abs_diff": result["max_abs_diff"],
                    "tolerance": result["tolerance"],
                    "top1_agreement": result["top1_agreement"],
                    "stages": len(result["layers"]),
                    "largest_stage_max_abs_diff": max(stage["max_abs_diff"] for stage in result["layers"]),
                }
                for result in (parity or {}).get("results", [])
            ],
        },
        "idle_process_rss_bytes": idle_rss,
        "largest_unit_bytes": largest_unit,
        "verification_bound_bytes": bound,
        "verification_within_bound": verification["peak_rss_bytes"] <= bound,
    }


def report(result: dict) -> str:
    checkpoint, conversion, verification = result["checkpoint"], result["conversion"], result["verification"]
    memory = result["machine"]["memory_bytes"]
    rows = [
        (
            "checkpoint",
            f"Qwen3-MoE, {checkpoint['layers']} layers of Qwen3-30B-A3B's shapes (128 experts), {checkpoint['dtype']}, "
            f"per-expert tensors: {checkpoint['bytes'] / GIB:.1f} GiB, {checkpoint['parameters'] / 1e9:.2f} B "
            f"parameters ({checkpoint['bytes'] / memory:.0%} of the machine's {memory / GIB:.1f} GiB); converted to "
            f"{result['converted_dtype']}",
        ),
        ("largest layer on disk", f"{checkpoint['largest_layer_bytes'] / GIB:.2f} GiB"),
        (
            "conversion (`thinker-convert --no-verify`)",
            f"{conversion['seconds']:.0f} s, peak RSS {conversion['peak_rss_bytes'] / GIB:.2f} GiB",
        ),
        (
            "verification (`thinker verify`, layer by layer by itself)",
            f"{verification['seconds']:.0f} s, peak RSS {verification['peak_rss_bytes'] / GIB:.2f} GiB; "
            + ("passed" if verification["passed"] else "**FAILED**"),
        ),
        (
            "bound: idle process + 4 × largest layer",
            f"{result['idle_process_rss_bytes'] / GIB:.2f} + 4 × {result['largest_unit_bytes'] / GIB:.2f} = "
            f"{result['verification_bound_bytes'] / GIB:.2f} GiB: "
            + ("met" if result["verification_within_bound"] else "**not met**"),
        ),
    ]
    for parity in verification["results"]:
        rows.append(
            (
                f"parity, {parity['dtype']}",
                f"max \\|Δlogit\\| {parity['max_abs_diff']:.3g} (tolerance {parity['tolerance']:.2g}), top-1 "
                f"{parity['top1_agreement']:.0%}, {parity['stages']} stages, largest stage max \\|Δ\\| "
                f"{parity['largest_stage_max_abs_diff']:.3g}",
            )
        )
    machine = result["machine"]
    rows.append(
        (
            "load average (2 cores, shared) before / after",
            f"{machine['load_average_before']:.1f} / {machine['load_average_after']:.1f}",
        )
    )
    lines = [f"Command: `{result['command']}`", "", "| | |", "|---|---|"]
    return "\n".join(lines + [f"| {label} | {value} |" for label, value in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (each ~1.25 GB in bfloat16)")
    parser.add_argument("--source-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the conversion")
    parser.add_argument("--work", type=Path, default=Path("/work/thinker-big"), help="scratch folder (deleted)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the converted folder")
    parser.add_argument("--report", action="store_true", help="print the README table from the results file")
    args = parser.parse_args()
    if args.report:
        print(report(json.loads(RESULTS.read_text())))
        return
    free = shutil.disk_usage(args.work.parent).free
    itemsize = {"bfloat16": 2, "float32": 4}
    needed = (1.25 * args.layers + 1.25) / 2 * 1e9 * (itemsize[args.source_dtype] + itemsize[args.dtype])
    if free < needed + 2e9:  # others work on this disk too
        raise SystemExit(f"{args.work.parent}: {free / 1e9:.0f} GB free; this needs ~{needed / 1e9:.0f} GB + a margin")
    shutil.rmtree(args.work, ignore_errors=True)
    try:
        result = measure(args.work, args.layers, args.source_dtype, args.dtype)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS, json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
