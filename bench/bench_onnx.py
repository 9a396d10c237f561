"""The exported decoder against PyTorch: export time, prefill latency and greedy decode speed.

A preset shaped like a real release (default: Qwen3-0.6B) gets random weights, is saved as a Thinker folder and
exported with ``thinker export``'s code path (``--graph``, by default ``thinker export``'s: fused); then a prompt of
PREFILL tokens is prefilled and NEW tokens decoded greedily, by onnxruntime (``export.runtime.OnnxDecoder``) and by
transformers' ``generate`` on the same weights.
Medians over --reps are reported, with the decode speed as tokens/s.

    python bench/bench_onnx.py --layers 4 --threads 2                 # a quick CPU run of Qwen3-0.6B's shapes
    python bench/bench_onnx.py --preset qwen3-30b-a3b --layers 2 --experts 16   # MoE: the MoE op
    python bench/bench_onnx.py --graph plain --preset qwen3-30b-a3b --layers 2 --experts 16   # the routing Loop
    python bench/bench_onnx.py --dtype float16 --provider cuda        # on a GPU

Prints a table and writes JSON to bench/results/onnx.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from results_io import command_line, machine_name, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script


from export.exporter import export_model  # noqa: E402
from export.names import DEFAULT_GRAPH, GRAPHS  # noqa: E402
from export.providers import physical_cores  # noqa: E402
from export.runtime import OnnxDecoder  # noqa: E402
from thinker import ThinkerForCausalLM  # noqa: E402
from thinker.presets import load_preset  # noqa: E402


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers (a quicker, shallower run)")
    parser.add_argument("--experts", type=int, help="override num_experts (MoE presets)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--graph", choices=list(GRAPHS), default=DEFAULT_GRAPH)
    parser.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers comparison")
    args = parser.parse_args()

    overrides = {"max_position_embeddings": max(512, args.prefill + args.new)}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.experts:
        overrides["num_experts"] = args.experts
        overrides["num_experts_per_tok"] = min(load_preset(args.preset).num_experts_per_tok, args.experts)
    config = load_preset(args.preset, **overrides)
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = ThinkerForCausalLM(config).to(getattr(torch, args.dtype)).eval()
        model.save_pretrained(Path(tmp) / "thinker")
        started = time.perf_counter()
        report = export_model(
            Path(tmp) / "thinker", Path(tmp) / "onnx", dtype=args.dtype, verify=False, threads=threads, graph=args.graph
        )
        export_seconds = time.perf_counter() - started
        decoder = OnnxDecoder(Path(tmp) / "onnx", provider=args.provider, threads=threads)

        prompt = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, args.prefill), dtype=np.int64)
        mask = np.ones_like(prompt)
        decoder.generate(prompt, mask, max_new_tokens=2)  # warm-up
        prefill = median_time(lambda: decoder.prefill(prompt, mask), args.reps)
        # eos_token_id=[]: every run decodes all args.new tokens, as min_new_tokens makes transformers' below do
        total = median_time(lambda: decoder.generate(prompt, mask, max_new_tokens=args.new, eos_token_id=[]), args.reps)
        results = {
            "command": command_line(),
            "preset": args.preset,
            "overrides": overrides,
            "dtype": args.dtype,
            "graph": report["graph"],
            "device": decoder.device,
            "threads": threads,
            "parameters": report["parameters"],
            "export_seconds": round(export_seconds, 2),
            "onnx_prefill_ms": round(prefill * 1e3, 2),
            "onnx_decode_tokens_per_s": round((args.new - 1) / max(total - prefill, 1e-9), 1),
        }
        if not args.no_torch:
            ids = torch.from_numpy(prompt)
            with torch.no_grad():
                kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
                model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
                torch_prefill = median_time(lambda: model(ids), args.reps)
                torch_total = median_time(lambda: model.generate(ids, **kwargs), args.reps)
            results["torch_prefill_ms"] = round(torch_prefill * 1e3, 2)
            results["torch_decode_tokens_per_s"] = round((args.new - 1) / max(torch_total - torch_prefill, 1e-9), 1)

    results["versions"] = {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__}
    results["machine"] = machine_name()
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    out = Path(__file__).with_name("results")
    out.mkdir(exist_ok=True)
    write_result((out / "onnx.json"), json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
