"""Hybrid models: our export (plain and fused graphs) against onnxruntime-genai 0.18's model builder and
mobius-onnx 0.1.0 on the same Qwen3.5 checkpoint, run by onnxruntime-genai with the same threads.

    python bench/bench_hybrid.py                       # both models, 3 repetitions, 2 threads
    python bench/bench_hybrid.py --models dense --reps 5 --prompt 128 --new 33

Checkpoints (random weights from transformers' own initialisation, seed 0; cached under
~/.cache/thinker-bench/hybrid, THINKER_BENCH_CACHE moves it):

  qwen3_5-0.8b   Qwen3.5-0.8B's text shape: hidden 1024, 24 layers ([3 linear, 1 full] x 6), 8 query / 2 KV heads of
                 256 with the output gate, partial rotary 0.25 with interleaved mRoPE [11, 11, 10], linear attention
                 16 key / 16 value heads of 128, conv kernel 4, MLP 3584, vocabulary 248320 (distinct from every
                 projection width: the builder takes any vocabulary-wide Linear for the head), tied embeddings;
                 context 4096 (only the RoPE tables depend on it)
  qwen3_5-moe    Qwen3.5-MoE scaled down: the same attention and linear-attention layers x 12, every MLP sparse with
                 64 experts of 128, top-8 renormalised, and a gated shared expert of 512

Each is written three times with the same tensors: as ``Qwen3_5(Moe)ForConditionalGeneration`` with a one-block
vision tower (the only Qwen3.5 class onnxruntime-genai's builder takes), as ``Qwen3_5(Moe)ForCausalLM`` (what
mobius exports as a decoder-only model: from the vision-language checkpoint it writes an embedding + decoder
package, which onnxruntime-genai 0.18 refuses on CPU, "Decoder-only CPU embedding requires the dynamic-batching
Engine", and ``--text-only`` refuses qwen3_5), and as a Thinker folder (thinker-convert where this branch has the
family, else the language model's tensors renamed into the Thinker's names).

Exports, each timed in its own process tree (wall, peak RSS):
  ours-plain / ours-fused   thinker export --no-verify --graph plain|fused
  ours-text                 the fused graph with --positions text: (B, T) position_ids, genai's generic decoder type
  builder-fp32              onnxruntime-genai 0.18's builder (``models/builder.py`` of the wheel, copied out of the
                            genai environment and run with this environment's torch and transformers, as
                            docs/hybrid-export.md did), -p fp32 -e cpu, on the vision-language checkpoint
  mobius-fp32               mobius build --ep cpu --optimize --runtime ort-genai (its CPU rewrites), on the causal-LM
                            checkpoint (dense); on the vision-language one for the MoE (there mobius writes a
                            decoder-only model, and its text class is unknown to it: "Unknown model_type
                            'qwen3_5_moe_text'"); its MoE runs every expert for every token (a dense fallback)

Runs: batch 1, a prompt of random ids, greedy new tokens; each (runtime, repetition) in a fresh process warmed by
two tokens of the timed request itself (after ``os.sync()``: the exports' writeback done), repetitions interleaved
runtime by runtime so that the load other jobs put on the shared cores lands on every runtime alike. Medians, each
repetition's figures, and ratios to the builder (the median of the per-repetition ratios, with its 90 % bootstrap
interval: bench/report.py ``ratio_interval``) are reported:
  onnxruntime-genai   (default) the genai environment (onnxruntime-genai 0.18, its onnxruntime 1.32), intra-op threads
                      set by a config overlay
  onnxruntime         (--runtimes genai,ort-states) one driver for every graph (decode_worker.py ``ort-states``:
                      states fed back as numpy arrays, a package's decoder fed its own embedding model's output), this
                      environment's onnxruntime
Results: bench/results/hybrid.json, and the markdown printed at the end (README "Hybrid models").

``--precision int4`` or ``int8`` compares quantized exports instead (ours ``--quantize`` at that precision, with and
without the accuracy guard, the builder's ``-p`` at it; bench/results/hybrid-<precision>.json): the same runs, the
same tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from results_io import command_line, names_from, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

import report  # noqa: E402
from exports import REPO, folder_bytes, timed  # noqa: E402
from models import CACHE  # noqa: E402
from peer_envs import package_versions, python_of  # noqa: E402
from workers import Runtime, Worker, summary  # noqa: E402

RESULTS = Path(__file__).with_name("results")
ROOT = CACHE / "hybrid"
GIB = 2**30

TEXT = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated to the layer count
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)
MOE = dict(
    num_hidden_layers=12, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128,
    shared_expert_intermediate_size=512,
)  # fmt: skip
VISION = dict(
    depth=1, hidden_size=64, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, num_position_embeddings=64,
)  # fmt: skip
MODELS = {"dense": ("qwen3_5-0.8b", {}), "moe": ("qwen3_5-moe", MOE)}
# --smoke: the same pipeline on a few-megabyte shape, to check the plumbing (results are not written)
SMOKE = dict(
    vocab_size=50000, hidden_size=64, intermediate_size=96, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    rope_parameters={**TEXT["rope_parameters"], "mrope_section": [2, 1, 1]},
)  # fmt: skip
SMOKE_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
# --precision: the exports compared. int4: ours (routed experts as QMoE in the fused graph, int8-held and dequantized
# in the plain graph's Loop) against the builder's int4 (its QMoE for the experts); mobius is left out.
GRAPHS = {
    "fp32": ["ours-fused", "ours-text", "ours-plain", "builder-fp32", "mobius-fp32"],
    "int4": ["ours-fused-int4", "ours-fused-int4-noguard", "ours-plain-int4", "builder-int4"],
    "int8": ["ours-fused-int8", "ours-fused-int8-noguard", "ours-plain-int8", "builder-int8"],
}
# thinker export's options for each of our graphs (and --no-verify --threads). The accuracy guard judges level 4 by
# top-1 agreement with float activations, which on random weights (near ties everywhere) moves most layers to level
# 1; "-noguard" keeps every unit at level 4, as the builder's graph is.
OURS = {
    "ours-fused": ["--graph", "fused"],
    "ours-text": ["--graph", "fused", "--positions", "text"],
    "ours-plain": ["--graph", "plain"],
    "ours-fused-int4": ["--graph", "fused", "--quantize", "int4"],
    "ours-fused-int4-noguard": ["--graph", "fused", "--quantize", "int4", "--accuracy-guard", "0"],
    "ours-plain-int4": ["--graph", "plain", "--quantize", "int4"],
    "ours-fused-int8": ["--graph", "fused", "--quantize", "int8"],
    "ours-fused-int8-noguard": ["--graph", "fused", "--quantize", "int8", "--accuracy-guard", "0"],
    "ours-plain-int8": ["--graph", "plain", "--quantize", "int8"],
}
RUNTIMES = {"genai": "onnxruntime-genai", "ort-states": "onnxruntime"}


# --- checkpoints ------------------------------------------------------------------------------------------------
def text_config(overrides: dict) -> dict:
    fields = {**TEXT, **overrides}
    fields["layer_types"] = (TEXT["layer_types"] * fields["num_hidden_layers"])[: fields["num_hidden_layers"]]
    # special ids at the top of the vocabulary, as Qwen's are (the prompts draw ids below 49152)
    fields.update(eos_token_id=fields["vocab_size"] - 1, pad_token_id=fields["vocab_size"] - 2)
    return fields


def build_checkpoints(name: str, overrides: dict) -> dict[str, Path]:
    """The three folders of one model (made once): ``vl`` (builder), ``causal`` (mobius), ``thinker`` (ours)."""
    folders = {kind: ROOT / f"{name}-{kind}" for kind in ("vl", "causal", "thinker")}
    if all((f / "config.json").is_file() for f in folders.values()):
        return folders
    import torch
    import transformers

    moe = "num_experts" in overrides
    text = text_config(overrides)
    vl_class = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    causal_class = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    special = dict(
        image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054
    )
    config = config_class(
        text_config=text,
        vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
        tie_word_embeddings=text["tie_word_embeddings"],
        **special,
    )
    print(f"[{name}] building the checkpoint", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    vl = vl_class(config).eval()
    vl.save_pretrained(folders["vl"])
    language_model = {
        key.replace("model.language_model.", "model."): tensor
        for key, tensor in vl.state_dict().items()
        if not key.startswith("model.visual.")
    }
    del vl
    causal = causal_class(config.text_config)
    causal.load_state_dict(language_model, strict=True)
    causal.save_pretrained(folders["causal"])
    del causal
    write_thinker(folders, language_model, config.text_config)
    return folders


def write_thinker(folders: dict[str, Path], language_model: dict, text_config) -> None:
    """The Thinker folder: by thinker-convert when the converter has the Qwen3.5 families, else the same tensors
    under the Thinker's names (identical for the language model: Qwen3.5's layout is the Thinker's)."""
    from converter.families import FAMILIES

    if any("qwen3_5" in family.model_types for family in FAMILIES):
        from converter.convert import convert

        convert(str(folders["vl"]), folders["thinker"], dtype="float32", verify=False, progress=False)
        return
    from thinker import ThinkerConfig, ThinkerForCausalLM

    fields = {
        key: getattr(text_config, key)
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "hidden_act",
            "attention_bias", "tie_word_embeddings", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "eos_token_id",
            "pad_token_id", "bos_token_id",
        )
        if hasattr(text_config, key)
    }  # fmt: skip
    if fields.get("num_experts"):
        fields["norm_topk_prob"] = True  # Qwen3.5-MoE's router always renormalises its top-k
    config = ThinkerConfig(
        **fields,
        rope_parameters=dict(text_config.rope_parameters),
        qk_norm=True,
        attention_output_gate=True,
        norm_zero_centered=True,
    )
    model = ThinkerForCausalLM(config)
    missing, unexpected = model.load_state_dict(language_model, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"Thinker names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.save_pretrained(folders["thinker"])


# --- exports ----------------------------------------------------------------------------------------------------
def builder_copy() -> Path:
    """onnxruntime-genai 0.18's builder package (``onnxruntime_genai/models``), copied out of the genai
    environment, whose onnxruntime must not meet this one's; it imports its modules by their own names."""
    target = ROOT / "genai-builder"
    if not (target / "builder.py").is_file():
        site = next((python_of("genai").parent.parent / "lib").glob("python*/site-packages"))
        shutil.copytree(site / "onnxruntime_genai" / "models", target)
    return target


def export_command(graph: str, folders: dict[str, Path], out: Path, threads: int, moe: bool) -> tuple[list[str], Path]:
    if graph in OURS:
        command = [
            sys.executable,
            "-m",
            "thinker_common.cli",
            "export",
            str(folders["thinker"]),
            str(out),
            "--no-verify",
        ]
        return [*command, "--threads", str(threads), *OURS[graph]], REPO
    if graph.startswith("builder-"):
        builder = builder_copy()
        cache = ROOT / "builder-cache"
        precision = graph.removeprefix("builder-")
        command = [sys.executable, "builder.py", "-i", str(folders["vl"]), "-o", str(out), "-p", precision, "-e", "cpu"]
        return [*command, "-c", str(cache)], builder
    if graph == "mobius-fp32":
        mobius = python_of("mobius").parent / "mobius"
        source = folders["vl" if moe else "causal"]
        command = [str(mobius), "build", "--config", str(source), "--runtime", "ort-genai", "--ep", "cpu"]
        return [*command, "--optimize", "--", str(out)], ROOT
    raise ValueError(graph)


def export_all(
    name: str, folders: dict[str, Path], threads: int, moe: bool, fresh: bool, graphs: list[str]
) -> dict[str, dict]:
    exports = {}
    for graph in graphs:
        out = ROOT / "exports" / name / graph
        record_file = out.with_name(graph + ".json")
        if out.exists() and record_file.is_file() and not fresh:
            exports[graph] = json.loads(record_file.read_text())
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] exporting {graph}", file=sys.stderr, flush=True)
        command, cwd = export_command(graph, folders, out, threads, moe)
        figures = timed(command, cwd=cwd)
        record = {"folder": str(out), "command": command[1:] if command[0] == sys.executable else command}
        if figures["returncode"] != 0:
            record["error"] = figures["stderr"].strip().splitlines()[-1][:500]
            print(f"  failed: {record['error']}", file=sys.stderr)
        else:
            graph_files = [out] + [p for p in out.iterdir() if p.is_dir()]
            record.update(
                seconds=figures["seconds"],
                peak_rss=figures["peak_rss"],
                model_bytes=sum(folder_bytes(f) for f in graph_files),
            )
        record_file.write_text(json.dumps(record, indent=2))
        exports[graph] = record
    return exports


# --- runs -------------------------------------------------------------------------------------------------------
def measure(name: str, exports: dict[str, dict], args) -> list[dict]:
    """Every (graph, runtime) pair ``args.reps`` times, interleaved, each repetition a fresh process."""
    builder = f"builder-{args.precision}"
    runtimes = [
        Runtime(f"{graph} on {RUNTIMES[backend]}", graph, backend, builder_peer=f"{builder} on {RUNTIMES[backend]}")
        for backend in args.runtimes
        for graph in GRAPHS[args.precision]
        if "error" not in exports[graph]
    ]
    request = {"op": "generate", "batch": 1, "prompt": args.prompt, "new": args.new}
    errors = {}
    for rep in range(args.reps):
        for runtime in runtimes:
            if runtime.label in errors:
                continue
            print(f"[{name}] rep {rep + 1}/{args.reps} {runtime.label}", file=sys.stderr, flush=True)
            try:
                worker = Worker(runtime, Path(exports[runtime.graph]["folder"]), args.threads)
            except RuntimeError as err:
                errors[runtime.label] = str(err).strip().splitlines()[-1][:300]
                print(f"  failed: {errors[runtime.label]}", file=sys.stderr)
                continue
            try:
                # The warm-up is the timed request itself, two tokens of it (workers.interleave_fresh says why): a
                # shorter prompt left the plain graph's chunked prompt branch (64 tokens and more) and the experts
                # it never routed to (their pages read in from the weights file on first touch) to the timed run.
                worker.request(**request, steps=2)
                reply = worker.request(**request)
                runtime.results.setdefault(json.dumps(request, sort_keys=True), []).append(reply)
            finally:
                worker.process.kill()
                worker.process.wait()
    rows = []
    for runtime in runtimes:
        row = {"label": runtime.label, "graph": runtime.graph, "builder_peer": runtime.builder_peer}
        row.update(summary(runtime, request) or {"error": errors.get(runtime.label)})
        row["per_repetition"] = [
            {"prefill_ms": 1e3 * r["prefill_s"], "decode_tokens_per_s": (args.new - 1) / r["decode_s"]}
            for r in runtime.results.get(json.dumps(request, sort_keys=True), [])
        ]
        rows.append(row)
    by_label = {row["label"]: row for row in rows}
    for row in rows:
        reference = by_label.get(row["label"].replace(row["graph"], reference_graph(args.precision)), {})
        if row.get("tokens") and reference.get("tokens"):
            row["greedy_equals_ours_fused"] = row["tokens"] == reference["tokens"]
    return rows


def reference_graph(precision: str) -> str:
    """The export whose greedy tokens every row is compared with: our fused graph at the run's precision."""
    return "ours-fused" if precision == "fp32" else f"ours-fused-{precision}"


def results_file(precision: str) -> Path:
    return RESULTS / ("hybrid.json" if precision == "fp32" else f"hybrid-{precision}.json")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_model(key: str, args) -> dict:
    name, overrides = MODELS[key]
    if args.smoke:
        name = f"smoke-{name}"
        overrides = {**overrides, **SMOKE, **(SMOKE_MOE if key == "moe" else {})}
    folders = build_checkpoints(name, overrides)
    load_before = load_average()
    started = time.perf_counter()
    moe = "num_experts" in overrides
    exports = export_all(name, folders, args.threads, moe, args.fresh_exports, GRAPHS[args.precision])
    # Fresh exports leave gigabytes of dirty pages, which the kernel writes back for minutes after, on the two cores
    # the timed runs use: written back here, before any of them.
    os.sync()
    runs = measure(name, exports, args)
    return {
        "name": name,
        "text_config": text_config(overrides),
        "exports": exports,
        "runtimes": runs,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "minutes": round((time.perf_counter() - started) / 60, 1),
    }


# --- report -----------------------------------------------------------------------------------------------------
def speed_table(model: dict, precision: str) -> str:
    rows_by_label = {r["label"]: r for r in model["runtimes"]}
    rows = []
    for row in model["runtimes"]:
        peer = rows_by_label.get(row["builder_peer"]) or {}
        if "error" in row:
            rows.append([row["label"], "failed: " + str(row["error"])] + ["—"] * 5)
            continue
        equal = row.get("greedy_equals_ours_fused")
        rows.append(
            [
                row["label"],
                report.fmt(row["prefill_ms"], 0),
                report.ratio_cell(report.compared(row, peer, "prefill_ms")),
                report.fmt(row["decode_tokens_per_s"], 2),
                report.ratio_cell(report.compared(row, peer, "decode_tokens_per_s")),
                "—" if equal is None else ("yes" if equal else "no"),
                str(row["repetitions"]),
            ]
        )
    reference = reference_graph(precision)
    header = ["runtime", "prefill (ms)", "vs builder", "decode (tok/s)", "vs builder", f"greedy = {reference}", "reps"]
    return report.table(header, rows)


def export_table(model: dict, precision: str) -> str:
    builder = model["exports"].get(f"builder-{precision}", {})
    rows = []
    for graph, record in model["exports"].items():
        if "error" in record:
            rows.append([graph, "failed: " + record["error"], "—", "—", "—", "—"])
            continue
        rows.append(
            [
                graph,
                report.fmt(record["seconds"], 1),
                report.ratio(record["seconds"], builder.get("seconds")),
                report.fmt(record["peak_rss"] / GIB, 2),
                report.ratio(record["peak_rss"], builder.get("peak_rss")),
                report.fmt(record["model_bytes"] / GIB, 2),
            ]
        )
    return report.table(["export", "wall (s)", "vs builder", "peak RSS (GiB)", "vs builder", "files (GiB)"], rows)


# What each model's entry records of the run that measured it (older files keep them at the top level only).
RUN_SETTINGS = ("command", "threads", "prompt", "new", "reps")


def merged_models(path: Path, models: list[dict]) -> list[dict]:
    """``models`` in place of the same-named entries of the results file at ``path``, the file's other models kept
    (each with the settings of the run that measured it): ``--models moe`` does not throw the dense figures away."""
    if not path.is_file():
        return models
    previous = json.loads(path.read_text())
    fresh = {model["name"]: model for model in models}
    kept = [{key: previous[key] for key in RUN_SETTINGS} | model for model in previous["models"]]
    out = [fresh.pop(model["name"], model) for model in kept]
    return out + list(fresh.values())


def markdown(results: dict) -> str:
    parts = []
    for model in results["models"]:
        precision = results.get("precision", "fp32")
        settings = {key: model.get(key, results[key]) for key in RUN_SETTINGS}
        run = f"{precision}, batch 1, {settings['prompt']}-token prompt, {settings['new']} new tokens"
        run += f", {settings['threads']} threads"
        loads = f"load average {model['load_average_before']} before, {model['load_average_after']} after"
        parts.append(f"#### {model['name']} ({run}; {loads})")
        parts.append(speed_table(model, precision))
        parts.append(export_table(model, precision))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", type=names_from(tuple(MODELS)), default="dense,moe", help="comma-separated: dense, moe"
    )
    parser.add_argument(
        "--runtimes", default="genai", help="comma-separated: genai (onnxruntime-genai), ort-states (onnxruntime)"
    )
    parser.add_argument("--reps", type=positive_int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=33, help="new tokens; decode is timed over the last new - 1")
    parser.add_argument("--fresh-exports", action="store_true", help="export again even where cached")
    parser.add_argument(
        "--precision", choices=list(GRAPHS), default="fp32", help="fp32, int4 or int8 (bench/results/hybrid-<it>.json)"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, to check the plumbing; writes nothing")
    parser.add_argument(
        "--report", action="store_true", help="print the tables of the --precision's results file, run nothing"
    )
    args = parser.parse_args()
    if args.report:
        results = json.loads(results_file(args.precision).read_text())
        commands = dict.fromkeys(model.get("command", results["command"]) for model in results["models"])
        print("\n".join(f"`{command}`" for command in commands) + f"\n\n{markdown(results)}")
        return
    args.runtimes = args.runtimes.split(",")
    settings = {
        "command": command_line(),
        "threads": args.threads,
        "prompt": args.prompt,
        "new": args.new,
        "reps": args.reps,
    }
    models = [run_model(key, args) | settings for key in args.models]
    results = settings | {
        "precision": args.precision,
        "cpu_count": os.cpu_count(),
        "versions": {env: package_versions(env) for env in ("genai", "mobius")},
        "models": models if args.smoke else merged_models(results_file(args.precision), models),
    }
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        write_result(results_file(args.precision), json.dumps(results, indent=2) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
