"""GPU speed of our float16 and int4 exports against onnxruntime-genai's builder and transformers eager (issue 13).

A CUDA machine runs this, driven by bench/gpu_session.sh on a lent one (docs/gpu-session.md); ``--provider cpu``
rehearses the same pipeline on a CPU (float32 in place of float16), which is how it is tested without a GPU.

Model: Qwen3-0.6B's shapes with random weights (bench/models.py), all 28 layers unless --layers. Exports
(bench/exports.py, each timed):
  ours-fp16          thinker export --dtype float16 (the default fused graph)
  ours-int4-fp16     ... --quantize int4 (int4 weights, float16 activations: MatMulNBits on CUDA)
  ours-int4-fp16-h4  ... --quantize-head int4 (the builder's head: all int4, no int8 rows)
  builder-fp16-cuda  onnxruntime-genai 0.18's builder -p fp16 -e cuda
  builder-int4-cuda  ... -p int4 -e cuda
Runtimes, each a fresh process per repetition, interleaved (bench/workers.py), batch 1 and 8, a --prompt token
prompt and --new greedy tokens:
  onnxruntime-genai on CUDA       every export; ours-fp16 and the builder's again with CUDA graph capture (batch 1:
                                  GroupQueryAttention refuses a batch of prompts over the shared past buffer that
                                  capture needs, on both graphs)
  onnxruntime on CUDA             ours-fp16 through export.runtime.OnnxDecoder: IO binding keeps the cache on the
                                  device, the logits come back each step (what ``thinker generate`` runs: its
                                  model.genai.onnx, no padding bias), one KV buffer per layer written in place;
                                  again with share_kv=False (the copying form, which runs model.onnx:
                                  ``generation_graph``), and over model.onnx with the shared buffer (the bias)
  transformers eager on CUDA      the source family's own class (Qwen3ForCausalLM), float16
Roofline: the weight bytes one decode step reads (bench/bandwidth.py) against the device's bandwidth, measured
here by a device-to-device copy of 1 GiB (bytes read + written per second, the best of 10): batch-1 decode as a
share of ``bandwidth / bytes per token``.

    python bench/bench_gpu.py                                   # on a CUDA machine: about 10 minutes on an H100
    python bench/bench_gpu.py --provider cpu --layers 2 --reps 1 --new 8 --batches 1   # the CPU rehearsal

Writes bench/results/gpu.json and bench/results/README-gpu.md (``--provider cpu``: gpu-rehearsal-cpu.json and
README-gpu-rehearsal-cpu.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from results_io import command_line, machine_name, positive_int, writable_folder, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import exports as exp  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402
from bandwidth import read_bandwidth, weight_bytes_per_token  # noqa: E402
from peer_envs import package_versions  # noqa: E402
from workers import Runtime, interleave_fresh, runtime_entry  # noqa: E402

RESULTS = Path(__file__).with_name("results")
GIB = 2**30

# provider -> (float export, its builder peer, int4 export, its builder peer, the int4 export with the builder's
# all-int4 head). (A --logits last export is not among them: under onnxruntime-genai it runs the same
# model.genai.onnx as the default one, which selects the last position itself.)
EXPORTS = {
    "cuda": ("ours-fp16", "builder-fp16-cuda", "ours-int4-fp16", "builder-int4-cuda", "ours-int4-fp16-h4"),
    "cpu": ("ours-fused", "builder-fp32", "ours-int4", "builder-int4", "ours-int4-h4"),
}
# onnxruntime-genai's CUDA graph runs batch 1 only here: at batch 8 GroupQueryAttention stops the prompt of both
# graphs ("batch_size must be 1 when sequence_length > 1 and past context is given", the first H200 session).
CUDA_GRAPH_BATCHES = (1,)


def runtimes_for(provider: str, cuda_graph: bool) -> list[list[Runtime]]:
    """Groups loaded side by side; each runtime names the row it is compared with."""
    ours, builder, ours_int4, builder_int4, ours_int4_h4 = EXPORTS[provider]
    device = ("--provider", provider)
    genai = f"onnxruntime-genai ({provider})"

    def row(graph: str, backend: str, runtime: str, peer: str | None, options=()) -> Runtime:
        label = f"{'Qwen3ForCausalLM' if graph == 'hf' else graph} on {runtime}"
        return Runtime(label, graph, backend, builder_peer=peer, worker_options=(*device, *options))

    float_group = [
        row(ours, "genai", genai, f"{builder} on {genai}"),
        row(builder, "genai", genai, None),
        row(ours, "thinker", f"onnxruntime ({provider})", f"{builder} on {genai}"),
    ]
    if provider == "cuda":  # the copying form beside the default shared buffer (on the CPU: bench_shared_cache.py)
        copying = f"onnxruntime ({provider}, copying KV)"
        float_group.append(row(ours, "thinker", copying, f"{builder} on {genai}", ("--copy-kv",)))
        # model.onnx, with the padding bias, beside model.genai.onnx, which OnnxDecoder runs on CUDA for these prompts
        any_padding = f"onnxruntime ({provider}, model.onnx)"
        float_group.append(row(ours, "thinker", any_padding, f"{builder} on {genai}", ("--any-padding",)))
    float_group.append(row("hf", "torch", f"transformers eager ({provider})", None))
    int4_group = [
        row(ours_int4, "genai", genai, f"{builder_int4} on {genai}"),
        row(ours_int4_h4, "genai", genai, f"{builder_int4} on {genai}"),
        row(builder_int4, "genai", genai, None),
    ]
    groups = [float_group, int4_group]
    if cuda_graph:
        graphed = f"onnxruntime-genai ({provider}, CUDA graph)"
        options = ("--cuda-graph",)
        groups.append(
            [
                row(ours, "genai", graphed, f"{builder} on {graphed}", options),
                row(builder, "genai", graphed, None, options),
            ]
        )
    return groups


def device_bandwidth(provider: str, threads: int) -> dict:
    """Bytes per second the device moves: a 1 GiB device-to-device copy counted as read + write on CUDA (the best
    of 10, timed by CUDA events); on the CPU bench/bandwidth.py's read rate."""
    if provider == "cpu":
        figures = read_bandwidth(threads)
        return {"bytes_per_s": figures["bytes_per_s"], "how": "numpy streaming read (bench/bandwidth.py)"}
    import torch

    source = torch.empty(GIB // 2, dtype=torch.float16, device="cuda")
    target = torch.empty_like(source)
    best = 0.0
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * source.nbytes / (start.elapsed_time(end) / 1e3))
    return {"bytes_per_s": best, "how": "1 GiB device-to-device copy, read + write, best of 12 (torch)"}


def device_name(provider: str) -> str:
    if provider == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return machine_name()


def export_all(model: models.BenchModel, names: list[str], threads: int, fresh: bool) -> dict[str, exp.Export]:
    """The exports ``names``; a fresh one's timings are kept beside it, so that a later ``--reuse-exports`` run
    (the device's second call, when one call cannot hold exports and runs) still reports them."""
    done = {}
    for name in names:
        print(f"[{model.name}] exporting {name}", file=sys.stderr, flush=True)
        export = exp.run_export(name, model, threads, fresh=fresh)
        record = export.folder.with_name(name + ".json")
        if export.seconds is not None or export.error:
            record.write_text(json.dumps({"seconds": export.seconds, "peak_rss": export.peak_rss}))
        elif record.is_file():
            export = exp.Export(name, export.folder, **json.loads(record.read_text()))
        if export.error:
            print(f"  failed: {export.error}", file=sys.stderr)
        done[name] = export
    return done


def measure(groups: list[list[Runtime]], folders: dict[str, Path], args, done) -> list[dict]:
    """Each group's runtimes, interleaved; ``done`` sees the entries so far after each group (a device call cut off
    at its time limit still leaves the groups it finished)."""
    entries = []
    for runtimes in groups:
        runnable = [r for r in runtimes if r.graph in folders]
        graphed = all("--cuda-graph" in r.worker_options for r in runnable)
        batches = [b for b in args.batches if b in CUDA_GRAPH_BATCHES] if graphed else args.batches
        requests = [{"op": "generate", "batch": b, "prompt": args.prompt, "new": args.new} for b in batches]
        started = time.perf_counter()
        try:
            interleave_fresh(runnable, folders, args.threads, requests, args.reps)
        except RuntimeError as err:  # a runtime that fails here is a finding, not the end of the run
            print(f"  group failed: {err}", file=sys.stderr)  # the requests it answered before keep their figures
            entries += [runtime_entry(r, requests) | {"error": str(err)[-1500:]} for r in runnable]
        else:
            entries += [runtime_entry(runtime, requests) for runtime in runnable]
        # what a device call must leave for each group (a fifth session's call ended inside one)
        print(f"  group of {len(runnable)} runtimes: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        done(entries)
    return entries


def add_limits(results: dict) -> None:
    """Batch-1 decode as a share of the bandwidth limit (eager's against the float16 weights ours reads)."""
    per_token, bandwidth = results["bytes_per_token"], results["bandwidth"]["bytes_per_s"]
    ours = EXPORTS[results["provider"]][0]
    for runtime in results["runtimes"]:
        one = runtime.get("batch1")
        graph = ours if runtime["graph"] == "hf" else runtime["graph"]  # eager reads the same float16 weights
        if one and graph in per_token:
            runtime["fraction_of_limit"] = one["decode_tokens_per_s"] / (bandwidth / per_token[graph])


def speed_table(results: dict) -> str:
    runtimes = {r["label"]: r for r in results["runtimes"]}
    eager = next((r for r in results["runtimes"] if r["graph"] == "hf" and "error" not in r), None)
    rows = []
    for runtime in results["runtimes"]:
        failed = "failed: " + runtime["error"].splitlines()[-1][:120] if "error" in runtime else None
        peer = runtimes.get(runtime.get("builder_peer") or "")  # the first run's failed rows have none
        row = [runtime["label"]]
        for batch in results["batches"]:
            figures, key = runtime.get(f"batch{batch}"), f"batch{batch}"
            if figures is None and failed:
                row += [failed, "—", "—"]
                continue
            row.append(report.fmt(figures and figures["decode_tokens_per_s"]))
            row.append(report.ratio_cell(report.compared(figures, peer and peer.get(key), "decode_tokens_per_s")))
            row.append(report.ratio_cell(report.compared(figures, eager and eager.get(key), "decode_tokens_per_s")))
        one = runtime.get("batch1")
        row.append(report.fmt(one and one["prefill_ms"]))
        row.append(report.fmt(runtime.get("fraction_of_limit"), 2))
        rows.append(row)
    header = ["runtime"]
    for batch in results["batches"]:
        header += [f"decode b{batch} (tokens/s per sequence)", "vs builder", "vs eager"]
    header += [f"prefill b1, {results['prompt']} tokens (ms)", "b1 share of the bandwidth limit"]
    return report.table(header, rows)


def export_table(results: dict) -> str:
    rows = [
        [
            name,
            report.fmt(e["seconds"]),
            report.fmt(e["peak_rss"] and e["peak_rss"] / 2**20, 0),
            report.fmt(results["bytes_per_token"].get(name, 0) / GIB, 3),
            e["error"] or "",
        ]
        for name, e in results["exports"].items()
    ]
    return report.table(["export", "wall (s)", "peak RSS (MB)", "weights read per token (GiB)", "error"], rows)


def markdown(results: dict) -> str:
    bandwidth = results["bandwidth"]
    return "\n\n".join(
        [
            f"Command: `{results['command']}`; device: {results['device']}; bandwidth "
            f"{bandwidth['bytes_per_s'] / 1e9:.0f} GB/s ({bandwidth['how']}); {results['layers']} layers, random "
            f"weights; {results['reps']} repetitions in fresh processes, medians, ratios as median per-repetition "
            "ratios with 90 % bootstrap intervals (bench/report.py).",
            speed_table(results),
            export_table(results),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["cuda", "cpu"], default="cuda", help="cpu: the rehearsal")
    parser.add_argument("--layers", type=int, help="Qwen3-0.6B has 28; fewer for a shorter run")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of CPU work")
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    parser.add_argument("--reuse-exports", action="store_true", help="keep cached exports (and their timings)")
    parser.add_argument("--exports-only", action="store_true", help="export, then stop (a later --reuse-exports)")
    parser.add_argument("--out", type=writable_folder, default=RESULTS, help="where the results go (the device's $OUT)")
    parser.add_argument(
        "--exports", help="comma-separated: only these exports, and the runtimes that run them (a short device call)"
    )
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    names = list(EXPORTS[args.provider])
    if args.exports:
        names = args.exports.split(",")
        if unknown := sorted(set(names) - set(EXPORTS[args.provider])):
            parser.error(f"--exports: {', '.join(unknown)} not among {', '.join(EXPORTS[args.provider])}")
    if args.provider == "cuda":
        from export.providers import cuda_absence, cuda_usable

        if not cuda_usable():
            parser.exit(2, f"bench_gpu.py: no CUDA here ({cuda_absence()}); --provider cpu rehearses on the CPU\n")

    started = time.perf_counter()
    model = models.qwen3_shaped(args.layers)
    exports = export_all(model, names, args.threads, fresh=not args.reuse_exports)
    if args.exports_only:
        return
    folders = {name: e.folder for name, e in exports.items() if not e.error}
    folders["hf"] = model.hf
    results = {
        "command": command_line(),
        "provider": args.provider,
        "device": device_name(args.provider),
        "layers": model.layers,
        "reps": args.reps,
        "prompt": args.prompt,
        "new": args.new,
        "batches": args.batches,
        "bandwidth": device_bandwidth(args.provider, args.threads),
        "exports": {n: {"seconds": e.seconds, "peak_rss": e.peak_rss, "error": e.error} for n, e in exports.items()},
        "bytes_per_token": {n: weight_bytes_per_token(f / "model.onnx") for n, f in folders.items() if n != "hf"},
        "runtimes": [],
        "versions": package_versions("genai"),
    }
    tag = "gpu" if args.provider == "cuda" else "gpu-rehearsal-cpu"

    def save(entries: list[dict]) -> None:
        results["runtimes"] = entries
        add_limits(results)
        results["seconds"] = round(time.perf_counter() - started, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        write_result((args.out / f"{tag}.json"), json.dumps(results, indent=2) + "\n")
        write_result((args.out / f"README-{tag}.md"), markdown(results) + "\n")

    measure(runtimes_for(args.provider, args.cuda_graph and args.provider == "cuda"), folders, args, save)
    print(markdown(results))


if __name__ == "__main__":
    main()
