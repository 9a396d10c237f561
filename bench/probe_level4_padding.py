"""Why a prompt's logits at accuracy level 4 depend on the batch it is left-padded into ("What the defaults are and
why" in README): where the difference starts, and what makes it grow.

The real SmolLM2-135M, exported three ways (the int4 default at accuracy level 4, the same weights at level 1, the
float32 default); one prompt run alone and left-padded beside a longer one, and alone twice in one batch (same shapes,
a second row). For each graph: max |Δ| of the prompt's logits between the runs. For both int4 graphs, the same
difference traced through the first layers (onnxruntime's own intermediate values, ``OnnxDecoder``'s probes): where it
appears and where it jumps. And the one operator level 4 changes, ``MatMulNBits`` with int8 activations, run on a row
alone and beside rows of any values (random, huge, NaN): whether a row's result depends on the others.

    python bench/probe_level4_padding.py --out bench/results

Writes ``level4_padding.json`` into ``--out`` and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from results_io import command_line, writable_folder, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages

SHORT = "The capital of France is"
LONG = "Once upon a time in a small village by the sea there lived an old fisherman who"
GRAPHS = {  # name -> export options
    "int4, level 4 (default)": {"quantize": ("int4", None)},
    "int4, level 1": {"quantize": ("int4", 1)},
    "float32": {},
}
TRACED_LAYERS = 3  # layers whose values the level-4 trace reports


def export_all(thinker: Path, root: Path) -> dict[str, Path]:
    from export.exporter import export_model
    from export.quantize import QuantizeSpec

    folders = {}
    for index, (name, options) in enumerate(GRAPHS.items()):
        spec = None
        if "quantize" in options:
            bits, level = options["quantize"]
            spec = QuantizeSpec.parse(bits, accuracy_level=level)
        folders[name] = root / f"graph-{index}"
        export_model(thinker, folders[name], quantize=spec, verify=False, progress=False, accuracy_guard=None)
    return folders


def runs(decoder, short: list[int], long: list[int]) -> dict[str, np.ndarray]:
    """The short prompt's logits (T, vocab) alone, left-padded beside the long one, and alone twice in a batch."""
    pad = len(long) - len(short)
    alone, _ = decoder.prefill(np.array([short]), np.ones((1, len(short)), np.int64), 1)
    probed_alone = dict(decoder.probed or {})
    ids = np.array([[0] * pad + short, long])
    mask = np.array([[0] * pad + [1] * len(short), [1] * len(long)])
    padded, _ = decoder.prefill(ids, mask, 1)
    probed_padded = dict(decoder.probed or {})
    twice, _ = decoder.prefill(np.array([short, short]), np.ones((2, len(short)), np.int64), 1)
    return {
        "alone": alone[0],
        "padded": padded[0, pad:],
        "twice": twice[1],
        "probed": (probed_alone, probed_padded, pad),
    }


def traced_values(model_path: Path) -> dict[str, int]:
    """The first layers' attention outputs and MatMulNBits outputs, in graph order, as probes (name -> float)."""
    import onnx

    graph = onnx.load(model_path, load_external_data=False).graph
    wanted = ("GroupQueryAttention", "MatMulNBits")
    names = [node.output[0] for node in graph.node if node.op_type in wanted]
    names = [name for name in names if any(f"/layers.{layer}/" in name for layer in range(TRACED_LAYERS))]
    return dict.fromkeys(names, onnx.TensorProto.FLOAT)


def trace(probes: dict[str, int], probed: tuple[dict, dict, int]) -> list[dict]:
    """Each probed value's largest difference over the prompt's positions, alone against padded, in graph order."""
    alone, padded, pad = probed
    return [
        {"value": name, "max_abs_diff": float(np.abs(alone[name][0] - padded[name][0, pad:]).max())} for name in probes
    ]


def isolated_matmul_nbits(seed: int = 0) -> dict[str, float]:
    """One MatMulNBits (int4, block 32, accuracy level 4), 576 -> 1536 as SmolLM2's gate: one row's result alone and
    beside 16 rows of random, huge (1e30) and NaN values; the largest change of that row's result."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    k, n, block = 576, 1536, 32
    blocks = rng.standard_normal((n, k // block, block)).astype(np.float32)
    scales = np.abs(blocks).max(-1) / 7
    levels = (np.clip(np.round(blocks / scales[..., None]), -8, 7) + 8).astype(np.uint8)
    packed = levels[..., 0::2] | (levels[..., 1::2] << 4)
    node = helper.make_node(
        "MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block, accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "one_matmul_nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "scales")],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    row = rng.standard_normal((1, k)).astype(np.float32)
    alone = session.run(None, {"A": row})[0][0]
    found = {}
    for label, fill in (("random", None), ("huge", 1e30), ("nan", np.nan)):
        others = rng.standard_normal((17, k)).astype(np.float32) * 50 if fill is None else np.full((17, k), fill)
        others = others.astype(np.float32)
        others[9] = row
        found[label] = float(np.abs(session.run(None, {"A": others})[0][9] - alone).max())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=writable_folder, required=True, help="folder for level4_padding.json")
    args = parser.parse_args()

    from models import smollm2
    from transformers import AutoTokenizer

    from export.runtime import OnnxDecoder

    model = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model.thinker)
    short, long = tokenizer(SHORT)["input_ids"], tokenizer(LONG)["input_ids"]
    result = {"command": command_line(), "prompts": {"short": SHORT, "long": LONG}, "graphs": {}}
    with tempfile.TemporaryDirectory(prefix="level4-padding-") as root:
        for name, folder in export_all(model.thinker, Path(root)).items():
            quantized = name.startswith("int4")
            probes = traced_values(folder / "model.onnx") if quantized else None
            found = runs(OnnxDecoder(folder, provider="cpu", threads=1, probes=probes), short, long)
            alone = found["alone"]
            figures = {
                "logit_scale": float(np.abs(alone).max()),
                "alone_vs_padded": float(np.abs(alone - found["padded"]).max()),
                "alone_vs_twice": float(np.abs(alone - found["twice"]).max()),
                "top1_equal_padded": bool((alone.argmax(-1) == found["padded"].argmax(-1)).all()),
            }
            if quantized:
                figures["trace"] = trace(probes, found["probed"])
            result["graphs"][name] = figures
    result["isolated_matmul_nbits_level4"] = isolated_matmul_nbits()

    print(f"SmolLM2-135M, {SHORT!r} alone against left-padded beside {LONG!r} (max |Δlogit| over its positions):")
    for name, figures in result["graphs"].items():
        print(
            f"  {name:24s} padded {figures['alone_vs_padded']:.3g}, twice in a batch {figures['alone_vs_twice']:.3g}"
            f" (logit scale {figures['logit_scale']:.1f}; top-1 equal everywhere: {figures['top1_equal_padded']})"
        )
    print("alone against padded, value by value through the first layers (level 4 | level 1):")
    level4, level1 = (result["graphs"][name]["trace"] for name in ("int4, level 4 (default)", "int4, level 1"))
    for four, one in zip(level4, level1, strict=True):
        print(f"  {four['value']:52s} {four['max_abs_diff']:9.3g} | {one['max_abs_diff']:.3g}")
    print("one MatMulNBits at level 4, a row alone against the same row beside others:")
    print("  " + ", ".join(f"{k} rows: {v:.3g}" for k, v in result["isolated_matmul_nbits_level4"].items()))
    write_result(args.out / "level4_padding.json", json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
