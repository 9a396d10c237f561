"""What a layer of routed experts costs on onnxruntime's CPU provider, by QMoE layout: why 8-bit experts go in blocks.

    python bench/bench_qmoe_int8.py [--layers 12] [--experts 64] [--top-k 8] [--hidden 1024] [--inner 128]
                                    [--threads 2] [--reps 15] [--provider cpu|cuda]

A chain of ``--layers`` residual MoE layers (a router MatMul, the experts, an Add), the shapes of bench_hybrid.py's
Qwen3.5-MoE by default (so the experts' weights lie well beyond the caches, as in a model), at one row (a decode
step) and at 128 (a prompt), interleaved, each run after a pause (``--gap``), for each way export/quantize.py can
write the experts: the float MoE op, and QMoE at 8 bits with a scale per row, at 8 bits in blocks of 32 (the kernel
rounds activations to int8 at every accuracy level), the same under ``experts_in_float`` (onnxruntime's float path,
what the quantized verify runs), and at 4 bits in blocks at accuracy levels 1 and 4. The experts are quantized by
the exporter's own code (``WeightQuantizer.quantize_experts``). Each output's error against the float chain is
printed beside its time,
which says which layouts compute with int8 activations. Writes ``bench/results/qmoe_int8.json``.

``--provider cuda`` (a lent GPU: ``python3 bench/gpu_kit.py run qmoe``) asks the same of CUDA's QMoE, in float16
graphs (what float16 exports write), over the layouts CUDA distinguishes (it reads no accuracy level): the float
MoE, 8 bits a scale per row (float16 exports' layout), 8 bits in blocks of 32, 4 bits in blocks of 32. Writes
``qmoe_int8-cuda.json`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper
from results_io import positive_int, writable_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

from layout_timing import report_layouts, time_layouts  # noqa: E402

from export.graph_builder import TORCH_TO_ONNX  # noqa: E402
from export.quantize import QuantizeSpec, WeightQuantizer  # noqa: E402
from export.quantized_verify import experts_in_float  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "qmoe_int8.json"
NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16}
ROWS = (1, 128)
# the experts' weights' standard deviation, per provider. float16 (CUDA) rounds x + MoE(x) to x's scale, so its
# experts are larger, for an MoE term a good part of x (or the error column would measure float16's resolution of x
# alone); but the SwiGLU term grows with x squared and the chain has no norm between layers. At 0.1, as an H200 run
# had it, x left float16's range at the third layer (7e5), reached 1e12 at the fourth and ended in NaN (routing NaN
# logits, so its times measured something else too); 0.04 still grows fourfold over twelve layers; 0.03 keeps x at
# its size (tests/test_bench_qmoe.py). Speed does not depend on the values.
EXPERT_SCALE = {"cpu": 0.02, "cuda": 0.03}
MOE_ATTRIBUTES = dict(
    k=0,
    activation_type="swiglu",
    swiglu_fusion=1,
    activation_alpha=1.0,
    activation_beta=0.0,
    normalize_routing_weights=1,
)


class Tensors:
    """What the quantizer writes (``b.weight``), kept as initializers of the bench's graph."""

    def __init__(self) -> None:
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name


def random_layers(count: int, experts: int, hidden: int, inner: int, scale: float) -> list[dict]:
    """``count`` MoE layers of random weights (seed 0): a router scaled to unit logits, experts of ``scale``."""
    rng = np.random.default_rng(0)
    return [
        {
            "router": (rng.standard_normal((hidden, experts)) / np.sqrt(hidden)).astype(np.float32),
            # fc1: gate and up interleaved
            "fc1": (rng.standard_normal((experts, 2 * inner, hidden)) * scale).astype(np.float32),
            "fc2": (rng.standard_normal((experts, hidden, inner)) * scale).astype(np.float32),
        }
        for _ in range(count)
    ]


def moe_chain(
    layers: list[dict], top_k: int, spec: QuantizeSpec | None, in_blocks: bool, dtype: torch.dtype = torch.float32
) -> onnx.ModelProto:
    """``x + MoE(x)`` per layer, in ``dtype``; the experts float (``spec`` None) or QMoE as the exporter writes
    them."""
    tensors, nodes = Tensors(), []
    hidden = layers[0]["router"].shape[0]
    quantizer = WeightQuantizer(spec, dtype) if spec else None
    numpy_type, onnx_type = NUMPY_TYPES[dtype], TORCH_TO_ONNX[dtype]
    for i, layer in enumerate(layers):
        x, logits, y = f"x{i}", f"logits{i}", f"y{i}"
        router = tensors.weight(f"router{i}", layer["router"].astype(numpy_type))
        nodes.append(helper.make_node("MatMul", [x, router], [logits]))
        attributes = {**MOE_ATTRIBUTES, "k": top_k}
        if quantizer is None:
            fc1, fc2 = (tensors.weight(f"fc{j}_{i}", layer[f"fc{j}"].astype(numpy_type)) for j in (1, 2))
            fc = [fc1, "", fc2]
            nodes.append(helper.make_node("MoE", [x, logits, *fc], [y], domain="com.microsoft", **attributes))
        else:
            fc1, fc2 = (
                quantizer.quantize_experts(tensors, f"fc{j}_{i}", torch.from_numpy(layer[f"fc{j}"]), in_blocks)
                for j in (1, 2)
            )
            attributes.update(expert_weight_bits=spec.bits, weights_prepacked=0)
            if fc1.block_size:
                attributes.update(block_size=fc1.block_size, accuracy_level=fc1.accuracy_level)
            inputs = [x, logits, *fc1.inputs, "", *fc2.inputs]
            nodes.append(helper.make_node("QMoE", inputs, [y], domain="com.microsoft", **attributes))
        nodes.append(helper.make_node("Add", [x, y], [f"x{i + 1}"]))
    graph = helper.make_graph(
        nodes,
        "moe_chain",
        [helper.make_tensor_value_info("x0", onnx_type, ["rows", hidden])],
        [helper.make_tensor_value_info(f"x{len(layers)}", onnx_type, ["rows", hidden])],
        tensors.initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=positive_int, default=15)
    parser.add_argument(
        "--gap",
        type=float,
        default=0.15,
        help="seconds before each timed run (bench_graph_ab.py: a session's threads "
        "keep spinning after its run, slowing the next session's)",
    )
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=writable_folder, default=RESULTS.parent, help="the folder the results go to")
    args = parser.parse_args()
    layers = random_layers(args.layers, args.experts, args.hidden, args.inner, EXPERT_SCALE[args.provider])
    if args.provider == "cuda":
        cuda_layouts(args, layers)
        return
    int8, int4 = QuantizeSpec(bits=8, accuracy_level=4), QuantizeSpec(bits=4, accuracy_level=4)
    layouts = {  # name -> (model, made under experts_in_float)
        "float MoE": (moe_chain(layers, args.top_k, None, False), False),
        "QMoE 8-bit, a scale per row": (moe_chain(layers, args.top_k, int8, in_blocks=False), False),
        "QMoE 8-bit, blocks of 32": (moe_chain(layers, args.top_k, int8, in_blocks=True), False),
        "QMoE 8-bit, blocks of 32, experts_in_float": (moe_chain(layers, args.top_k, int8, in_blocks=True), True),
        "QMoE 4-bit, blocks of 32, level 1": (
            moe_chain(layers, args.top_k, QuantizeSpec(bits=4, accuracy_level=1), in_blocks=True),
            False,
        ),
        "QMoE 4-bit, blocks of 32, level 4": (moe_chain(layers, args.top_k, int4, in_blocks=True), False),
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    sessions = {}
    for name, (model, in_float) in layouts.items():
        with experts_in_float() if in_float else nullcontext():
            sessions[name] = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
    time_and_report(args, sessions, f"{args.threads} threads", args.out / RESULTS.name)


def cuda_layouts(args: argparse.Namespace, layers: list[dict]) -> None:
    """The float16 chains on CUDA: float MoE, 8 bits per row and in blocks, 4 bits in blocks (CUDA's QMoE reads no
    accuracy level; its widths must be multiples of 64, export/quantize.py ``CUDA_QMOE_WIDTH``)."""
    half = torch.float16
    layouts = {
        "float MoE": moe_chain(layers, args.top_k, None, False, half),
        "QMoE 8-bit, a scale per row": moe_chain(layers, args.top_k, QuantizeSpec(bits=8), False, half),
        "QMoE 8-bit, blocks of 32": moe_chain(layers, args.top_k, QuantizeSpec(bits=8), True, half),
        "QMoE 4-bit, blocks of 32": moe_chain(layers, args.top_k, QuantizeSpec(bits=4), True, half),
    }
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sessions = {
        name: ort.InferenceSession(model.SerializeToString(), providers=providers) for name, model in layouts.items()
    }
    for name, session in sessions.items():
        if session.get_providers()[0] != providers[0]:
            raise SystemExit(f"{name}: onnxruntime started no CUDA session here ({session.get_providers()})")
    time_and_report(args, sessions, "CUDA, float16", args.out / RESULTS.name.replace(".json", "-cuda.json"), np.float16)


def time_and_report(args: argparse.Namespace, sessions: dict, where: str, path: Path, dtype: type = np.float32) -> None:
    """Times the chains' sessions (layout_timing.py; the error on each chain's MoE terms, without the residual),
    prints the table against the row-wise 8-bit layout and writes it with the settings to ``path``."""
    results = time_layouts(sessions, ROWS, args.hidden, args.reps, args.gap, lambda out, x: out - x, dtype=dtype)
    per_layer = f"{args.experts} experts of {args.hidden} x {args.inner} (SwiGLU), top {args.top_k}"
    title = f"{args.layers} MoE layers of {per_layer}, {where}, median of {args.reps} interleaved runs"
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report_layouts(results, "QMoE 8-bit, a scale per row", title, path, settings)


if __name__ == "__main__":
    main()
