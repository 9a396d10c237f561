"""Qwen3.8 (qwen4_exp) in ONNX: the export of bench_model.py's Qwen3.8-shaped model (every layer MoE, four residual
streams, the QSA indexer on its attention layers with a budget of 32 tokens in blocks of 4, PLE on two linear-attention
layers), fused and plain, against the PyTorch Thinker it came from.

Parity: max |Δlogit| over prefill and 8 decode steps of a left-padded batch on which the indexers prune (the
``--verify`` prompts of ``thinker_common/parity_inputs.py`` ``indexer_batch``), against 1e-4 x the logit scale:
against the Thinker with exact ties between blocks given to the earlier ones (as ONNX's TopK gives them, and as
``--verify`` compares), and against the Thinker as it is (torch.topk's choice among ties, transformers'). Speed: a
prefill of 1 x PREFILL tokens and one decode step after it, onnxruntime (CPU, ``OnnxDecoder``) and PyTorch taking
turns within each repetition, the same threads; medians, and each runtime's time over PyTorch's. Export: wall time
and the files' size.

    python bench/bench_qwen4_exp_onnx.py --layers 8 --threads 2 --reps 5

Prints a table and writes bench/results/qwen4_exp_onnx.json.
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
import torch
from results_io import command_line, machine_name, positive_int, result_file, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import qwen4_exp_configs  # noqa: E402

from export.exporter import export_model  # noqa: E402
from export.runtime import OnnxDecoder  # noqa: E402
from export.verify import compare_decoders  # noqa: E402
from thinker import ThinkerForCausalLM  # noqa: E402
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, indexer_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GRAPHS = ("fused", "plain")
DECODE_STEPS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads and onnxruntime's intra-op threads")
    parser.add_argument("--reps", type=positive_int, default=5)
    parser.add_argument("--prefill", type=int, default=128, help="prompt length of the timed prefill")
    parser.add_argument("--output", type=result_file, default=RESULTS / "qwen4_exp_onnx.json")
    args = parser.parse_args()
    args.new_tokens, args.attn, args.preset = 0, "sdpa", None  # what qwen4_exp_configs reads besides
    return args


def thinker_folder(args: argparse.Namespace, folder: Path) -> ThinkerForCausalLM:
    """The Thinker of bench_model.py's Qwen3.8 shape, random weights (the PLE convs too, zero at init), saved."""
    _, config = qwen4_exp_configs(args)
    torch.manual_seed(0)
    model = ThinkerForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("ple.conv1d.weight"):
                parameter.normal_(0, 0.2)
    model.save_pretrained(folder)
    return model


def median_seconds(samples: list[float]) -> float:
    return statistics.median(samples)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    report = {
        "command": command_line(),
        "machine": machine_name(),
        "threads": args.threads,
        "layers": args.layers,
        "hidden": args.hidden,
        "prefill": args.prefill,
        "graphs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = thinker_folder(args, Path(tmp) / "thinker")
        report["parameters"] = sum(p.numel() for p in model.parameters())
        decoders = {}
        for graph in GRAPHS:
            started = time.perf_counter()
            export_model(Path(tmp) / "thinker", Path(tmp) / graph, graph=graph, verify=False, progress=False)
            wall = time.perf_counter() - started
            files = sum(f.stat().st_size for f in (Path(tmp) / graph).iterdir())
            decoders[graph] = OnnxDecoder(Path(tmp) / graph, provider="cpu", threads=args.threads)
            batch = indexer_batch(model.config)
            figures = compare_decoders(model, decoders[graph], *batch, steps=DECODE_STEPS)
            torch_ties = compare_decoders(model, decoders[graph], *batch, steps=DECODE_STEPS, torch_ties=True)
            tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"])
            report["graphs"][graph] = {
                "export_seconds": round(wall, 2),
                "files_bytes": files,
                "parity": {key: figures[key] for key in ("max_abs_diff", "logit_scale", "top1_agreement", "positions")}
                | {"tolerance": tolerance, "prompt_lengths": batch[1].sum(1).tolist(), "decode_steps": DECODE_STEPS}
                | {"max_abs_diff_torch_ties": torch_ties["max_abs_diff"]},
            }
        report["speed"] = time_runtimes(args, model, decoders)
    write_result(args.output, json.dumps(report, indent=2) + "\n")
    print_table(report)


def time_runtimes(args: argparse.Namespace, model: ThinkerForCausalLM, decoders: dict) -> dict:
    """Prefill and one decode step per runtime, the runtimes taking turns in each repetition (order rotated)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(2, model.config.vocab_size, size=(1, args.prefill))
    mask = np.ones_like(ids)
    samples = {name: {"prefill": [], "decode": []} for name in (*decoders, "pytorch")}
    names = list(samples)
    for rep in range(args.reps + 1):  # the first round warms every runtime up and is not kept
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            prefill, decode = time_one(name, model, decoders.get(name), ids, mask)
            if rep:
                samples[name]["prefill"].append(prefill)
                samples[name]["decode"].append(decode)
    out = {}
    for name, taken in samples.items():
        out[name] = {task: {"median_s": median_seconds(times), "samples_s": times} for task, times in taken.items()}
    for name in out:
        for task in ("prefill", "decode"):
            out[name][task]["vs_pytorch"] = out[name][task]["median_s"] / out["pytorch"][task]["median_s"]
    return out


@torch.no_grad()
def time_one(name: str, model, decoder, ids: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    if decoder is not None:
        started = time.perf_counter()
        logits, state = decoder.prefill(ids, mask)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        decoder.decode_one_token(logits[:, -1].argmax(-1), state)
        return prefill, time.perf_counter() - started
    tokens = torch.from_numpy(ids)
    started = time.perf_counter()
    out = model(input_ids=tokens, use_cache=True)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return prefill, time.perf_counter() - started


def print_table(report: dict) -> None:
    print(f"Qwen3.8-shaped, {report['layers']} layers, {report['parameters'] / 1e6:.1f} M parameters, fp32, "
          f"{report['threads']} threads; {report['command']}")  # fmt: skip
    print("\n| graph | export (s) | files (MB) | max abs diff | tolerance | top-1 | max abs diff, torch.topk's ties |")
    print("|---|---|---|---|---|---|---|")
    for graph, figures in report["graphs"].items():
        parity = figures["parity"]
        print(
            f"| {graph} | {figures['export_seconds']} | {figures['files_bytes'] / 1e6:.1f} | "
            f"{parity['max_abs_diff']:.2e} | {parity['tolerance']:.2e} | {parity['top1_agreement']:.3f} | "
            f"{parity['max_abs_diff_torch_ties']:.2e} |"
        )
    print(f"\n| runtime | prefill 1 x {report['prefill']} (s) | vs PyTorch | decode step (s) | vs PyTorch |")
    print("|---|---|---|---|---|")
    for name, tasks in report["speed"].items():
        prefill, decode = tasks["prefill"], tasks["decode"]
        print(
            f"| {name} | {prefill['median_s']:.4f} | {prefill['vs_pytorch']:.2f}x | {decode['median_s']:.4f} | "
            f"{decode['vs_pytorch']:.2f}x |"
        )


if __name__ == "__main__":
    main()
