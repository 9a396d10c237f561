"""CPU time of one Gated DeltaNet layer: our plain graph (standard operators, the recurrence a Scan over tokens)
against our fused graph (onnxruntime's CausalConvWithState, LinearAttentionGate, LinearAttention, GatedRMSNorm),
with transformers' own module (its torch fallbacks: chunked prefill, recurrent decode) for context.

The layer has Qwen3.5-0.8B's shape by default (hidden 1024; 16 key and 16 value heads of 128; conv kernel 4: the
text config of Qwen/Qwen3.5-0.8B), random weights, batch 1. Per repetition each runtime runs a prefill of
``--prompt`` tokens from an empty state, then ``--decode`` one-token steps on the state it left; the runtimes take
turns repetition by repetition so that drift on shared cores hits them alike. Reported: medians, and the ratios
to the fused graph (report only: nothing is asserted).

    python bench/bench_linear_attention.py                  # 0.8B layer, prompt 128, 2 threads
    python bench/bench_linear_attention.py --value-heads 32 # Qwen3.5-9B's grouping (two value heads per key head)
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
import onnxruntime as ort
import torch
from results_io import command_line, positive_int, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from transformers import DynamicCache, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402

from export.layer_models import PAST_STATES, PRESENT_STATES, write_gated_deltanet_model  # noqa: E402
from export.linear_attention_graph import (  # noqa: E402
    FusedGatedDeltaNetGraph,
    GatedDeltaNetDims,
    GatedDeltaNetGraph,
)
from export.providers import physical_cores  # noqa: E402

FORMS = {"plain": GatedDeltaNetGraph, "fused": FusedGatedDeltaNetGraph}


def layer_config(args: argparse.Namespace) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=args.hidden,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )


class OnnxRunner:
    def __init__(self, path: Path, dims: GatedDeltaNetDims, threads: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.dims = dims

    def prefill(self, hidden: np.ndarray) -> float:
        batch, seq = hidden.shape[:2]
        self.mask = np.ones((batch, seq), np.int64)
        states = [np.zeros(self.dims.conv_state_shape(batch), np.float32)]
        states.append(np.zeros(self.dims.recurrent_state_shape(batch), np.float32))
        return self._run(hidden, states)

    def decode(self, hidden: np.ndarray) -> float:
        self.mask = np.concatenate([self.mask, np.ones((hidden.shape[0], 1), np.int64)], axis=1)
        return self._run(hidden, self.states)

    def _run(self, hidden: np.ndarray, states: list[np.ndarray]) -> float:
        feeds = {"hidden_states": hidden, "attention_mask": self.mask, **dict(zip(PAST_STATES, states, strict=True))}
        started = time.perf_counter()
        _, *self.states = self.session.run(["output", *PRESENT_STATES], feeds)
        return time.perf_counter() - started


class TorchRunner:
    def __init__(self, module: Qwen3_5GatedDeltaNet, config: Qwen3_5TextConfig) -> None:
        self.module, self.config = module, config

    @torch.no_grad()
    def prefill(self, hidden: np.ndarray) -> float:
        self.cache = DynamicCache(config=self.config)
        return self._run(hidden)

    @torch.no_grad()
    def decode(self, hidden: np.ndarray) -> float:
        return self._run(hidden)

    def _run(self, hidden: np.ndarray) -> float:
        x = torch.from_numpy(hidden)
        started = time.perf_counter()
        self.module(x, self.cache)  # the cache's keyword changed name in transformers 5.24
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16, help="one-token steps per repetition")
    parser.add_argument("--reps", type=positive_int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)

    config = layer_config(args)
    dims = GatedDeltaNetDims.from_config(config)
    torch.manual_seed(0)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    params = dict(module.named_parameters())
    weight_bytes = sum(p.numel() * 4 for p in params.values())

    with tempfile.TemporaryDirectory() as tmp:
        runners = {
            form: OnnxRunner(write_gated_deltanet_model(Path(tmp) / form, dims, params, graph_class=cls), dims, threads)
            for form, cls in FORMS.items()
        }
        runners["transformers"] = TorchRunner(module, config)
        rng = np.random.default_rng(0)
        prompt = rng.standard_normal((1, args.prompt, dims.hidden_size), dtype=np.float32)
        tokens = [rng.standard_normal((1, 1, dims.hidden_size), dtype=np.float32) for _ in range(args.decode)]
        times = {name: {"prefill": [], "decode": []} for name in runners}
        for runner in runners.values():  # warm-up: first-run allocations out of the figures
            runner.prefill(prompt)
            runner.decode(tokens[0])
        for _ in range(args.reps):
            for name, runner in runners.items():
                times[name]["prefill"].append(runner.prefill(prompt))
                times[name]["decode"].extend(runner.decode(token) for token in tokens)

    medians = {name: {k: statistics.median(v) * 1e3 for k, v in t.items()} for name, t in times.items()}
    print(
        f"Gated DeltaNet layer: hidden {dims.hidden_size}, {dims.num_key_heads} key / {dims.num_value_heads} value "
        f"heads of {args.head_dim}, conv {dims.conv_kernel}; {weight_bytes / 2**20:.1f} MiB of float32 weights; "
        f"batch 1, {threads} threads, onnxruntime {ort.__version__}, torch {torch.__version__}"
    )
    prefill_title = f"prefill {args.prompt} (ms)"
    print(f"{'runtime':<14}{prefill_title:>18}{'x fused':>9}{'decode 1 (ms)':>16}{'x fused':>9}")
    for name, m in medians.items():
        fused = medians["fused"]
        print(
            f"{name:<14}{m['prefill']:>18.2f}{m['prefill'] / fused['prefill']:>9.2f}"
            f"{m['decode']:>16.3f}{m['decode'] / fused['decode']:>9.2f}"
        )
    if args.json:
        settings = vars(args) | {"json": str(args.json)}
        write_result(args.json, json.dumps({"command": command_line(), "args": settings, "medians_ms": medians}))


if __name__ == "__main__":
    main()
