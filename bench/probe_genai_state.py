"""What onnxruntime-genai feeds a hybrid decoder: model types, state names and shapes, positions, masks.

Each probe is a decoder-shaped ONNX graph (input_ids, attention_mask, position_ids, KV for layer 1, conv and
recurrent state for layer 0) whose logits are a one-hot of one quantity it was fed, so that greedy generation
prints that quantity step by step: a position stream, a mask slot, the mask's sum, the past length, or the carried
states (each step adds 1 to both). onnxruntime-genai runs in its own environment (bench/peer_envs.py). The
figures in docs/hybrid-export.md come from this script, which prints them and writes them to
bench/results/probe_genai_state.json.

    python bench/probe_genai_state.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from results_io import command_line, result_file, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench modules, when run as a script

from peer_envs import package_versions, python_of  # noqa: E402

VOCAB = 64
CONV_NAMES = {
    "default": ("past_key_values.0.conv_state", "present.0.conv_state"),
    "explicit": ("past.0.conv", "present.0.conv"),
}
RECURRENT_NAMES = {
    "default": ("past_key_values.0.recurrent_state", "present.0.recurrent_state"),
    "explicit": ("past.0.recurrent", "present.0.recurrent"),
}
WORKER = """
import json, sys
import numpy as np
import onnxruntime_genai as og
for case in json.loads(sys.stdin.read()):
    try:
        model = og.Model(case["folder"])
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=12, batch_size=len(case["prompts"]))
        generator = og.Generator(model, params)
        width = max(map(len, case["prompts"]))
        pad = [[0] * (width - len(p)) for p in case["prompts"]]  # pad_token_id 0, on the side the case asks for
        rows = [p + z if case["right"] else z + p for p, z in zip(case["prompts"], pad)]
        generator.append_tokens(np.array(rows, np.int32) if len(rows) > 1 else rows[0])
        while not generator.is_done():
            generator.generate_next_token()
        print(json.dumps([[int(t) for t in generator.get_sequence(i)][width:] for i in range(len(rows))]))
    except Exception as err:
        print(json.dumps(str(err).splitlines()[0][:200]))
"""


def probe_model(
    folder: Path,
    report: str,
    model_type: str = "qwen3_5_text",
    positions: str = "3d",
    names: str = "default",
    conv_length: int = 3,
) -> Path:
    """A probe folder. ``report``: "pos0".."pos2" (a position stream), "mask_sum", "mask_first" (the first mask
    slot), "past" (past KV length), "conv" / "recurrent" (the carried state's first element). ``positions``:
    "3d" (3, B, T), "2d" (B, T) or "any" (rank not declared)."""
    folder.mkdir(parents=True, exist_ok=True)
    (conv_in, conv_out), (rec_in, rec_out) = CONV_NAMES[names], RECURRENT_NAMES[names]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    position_shape = {"3d": [3, "batch_size", "sequence_length"], "2d": ["batch_size", "sequence_length"], "any": None}
    kv = ["batch_size", 1, "past_sequence_length", 2]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", i64, position_shape[positions]),
        helper.make_tensor_value_info("past_key_values.1.key", f32, kv),
        helper.make_tensor_value_info("past_key_values.1.value", f32, kv),
        helper.make_tensor_value_info(conv_in, f32, ["batch_size", 4, conv_length]),
        helper.make_tensor_value_info(rec_in, f32, ["batch_size", 2, 3, 3]),
    ]
    present_kv = ["batch_size", 1, "total_sequence_length", 2]
    outputs = [
        helper.make_tensor_value_info("logits", f32, ["batch_size", "sequence_length", VOCAB]),
        helper.make_tensor_value_info("present.1.key", f32, present_kv),
        helper.make_tensor_value_info("present.1.value", f32, present_kv),
        helper.make_tensor_value_info(conv_out, f32, ["batch_size", 4, conv_length]),
        helper.make_tensor_value_info(rec_out, f32, ["batch_size", 2, 3, 3]),
    ]
    consts = {
        "one": np.float32(1),
        "vocab": np.array(VOCAB, np.int64),
        "off_on": np.array([0, 1], np.float32),
        "kv_tail": np.array([1, 2], np.int64),
        "kv_order": np.array([0, 2, 1, 3], np.int64),
        "axis_1": np.array([1], np.int64),
        "column_0": np.array([[0, 0]], np.int64),
        "first": np.array([0, 0, 0], np.int64),
        "first_end": np.array([1, 1, 1], np.int64),
        "state_axes": np.array([1, 2, 3], np.int64),
        "row": np.array([-1, 1], np.int64),
        "stream": np.array(int(report[3:]) if report.startswith("pos") else 0, np.int64),
    }
    node = helper.make_node
    nodes = [
        node("Add", [conv_in, "one"], [conv_out]),
        node("Add", [rec_in, "one"], [rec_out]),
        node("Shape", ["input_ids"], ["bt"]),  # (B, T)
        node("Concat", ["bt", "kv_tail"], ["bt12"], axis=0),
        node("Gather", ["bt12", "kv_order"], ["b1t2"], axis=0),
        node("ConstantOfShape", ["b1t2"], ["kv_new"]),  # the new tokens' keys and values: zeros
        node("Concat", ["past_key_values.1.key", "kv_new"], ["present.1.key"], axis=2),
        node("Concat", ["past_key_values.1.value", "kv_new"], ["present.1.value"], axis=2),
    ]
    if report.startswith("pos"):  # (B, T)
        nodes.append(
            node("Gather", ["position_ids", "stream"], ["value"], axis=0)
            if positions == "3d"
            else node("Identity", ["position_ids"], ["value"])
        )
    elif report == "mask_sum":
        nodes += [node("ReduceSum", ["attention_mask", "axis_1"], ["sum"]), node("Expand", ["sum", "bt"], ["value"])]
    elif report == "mask_first":
        nodes += [node("Slice", ["attention_mask", "first", "first_end", "axis_1"], ["m0"])]
        nodes += [node("Expand", ["m0", "bt"], ["value"])]
        consts.update(first=np.array([0], np.int64), first_end=np.array([1], np.int64))
    elif report == "past":
        nodes += [node("Shape", ["past_key_values.1.key"], ["p"], start=2, end=3)]
        nodes += [node("Reshape", ["p", "row"], ["p2"]), node("Expand", ["p2", "bt"], ["value"])]
    else:  # the carried state's first element
        state, rank = (conv_in, 3) if report == "conv" else (rec_in, 4)
        consts.update(first=np.zeros(rank - 1, np.int64), first_end=np.ones(rank - 1, np.int64))
        consts["state_axes"] = np.arange(1, rank, dtype=np.int64)
        nodes += [node("Slice", [state, "first", "first_end", "state_axes"], ["s0"])]
        nodes += [node("Reshape", ["s0", "row"], ["s1"]), node("Cast", ["s1"], ["s2"], to=i64)]
        nodes += [node("Expand", ["s2", "bt"], ["value"])]
    nodes += [node("Mod", ["value", "vocab"], ["index"]), node("OneHot", ["index", "vocab", "off_on"], ["logits"])]
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "probe", inputs, outputs, initializer=initializers)
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), folder / "model.onnx"
    )

    decoder_inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"}
    decoder_inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    decoder_outputs = {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    if names == "explicit":
        decoder_inputs |= {"past_conv_names": "past.%d.conv", "past_recurrent_names": "past.%d.recurrent"}
        decoder_outputs |= {"present_conv_names": "present.%d.conv", "present_recurrent_names": "present.%d.recurrent"}
    config = {
        "model": {
            "type": model_type,
            "bos_token_id": 1,
            "eos_token_id": VOCAB - 1,
            "pad_token_id": 0,
            # Tokens the 3-D position path treats as vision markers: out of the probe prompts' way.
            "image_token_id": 60,
            "video_token_id": 61,
            "vision_start_token_id": 62,
            "context_length": VOCAB,
            "vocab_size": VOCAB,
            "decoder": {
                "filename": "model.onnx",
                "head_size": 2,
                "hidden_size": 2,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "session_options": {"log_id": "probe", "provider_options": []},
                "inputs": decoder_inputs,
                "outputs": decoder_outputs,
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": VOCAB, "past_present_share_buffer": False},
    }
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    return folder


CASES = [
    # (label, probe_model arguments, prompts)
    ("qwen3_5_text: conv state carried (default names)", dict(report="conv"), [[5, 6, 7, 8, 9]]),
    ("qwen3_5_text: recurrent state carried", dict(report="recurrent"), [[5, 6, 7, 8, 9]]),
    ("qwen3_5_text: explicit past.%d.conv names", dict(report="conv", names="explicit"), [[5, 6, 7, 8, 9]]),
    ("qwen3_5_text: conv state of k columns", dict(report="conv", conv_length=4), [[5, 6, 7, 8, 9]]),
    ("qwen3_5_moe_text: conv state carried", dict(report="conv", model_type="qwen3_5_moe_text"), [[5, 6, 7]]),
    ("qwen3_next", dict(report="conv", model_type="qwen3_next"), [[5, 6, 7]]),
    ("qwen3, 3-D position_ids", dict(report="conv", model_type="qwen3"), [[5, 6, 7]]),
    (
        "qwen3, 2-D position_ids: conv state carried",
        dict(report="conv", model_type="qwen3", positions="2d"),
        [[5, 6, 7]],
    ),
    ("qwen3_5 (the vision-language type) on a decoder folder", dict(report="conv", model_type="qwen3_5"), [[5, 6, 7]]),
    ("3-D: temporal positions, left-padded batch", dict(report="pos0"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("3-D: height positions, left-padded batch", dict(report="pos1"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("3-D: mask sum", dict(report="mask_sum"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("3-D: first mask slot (a pad in row 1)", dict(report="mask_first"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("3-D: past KV length", dict(report="past"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("3-D: conv state, batch", dict(report="conv"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("2-D: positions, left-padded batch", dict(report="pos0", positions="2d"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("2-D: first mask slot (a pad in row 1)", dict(report="mask_first", positions="2d"), [[5, 6, 7, 8, 9], [7, 8, 9]]),
    ("rank not declared: positions", dict(report="pos1", positions="any"), [[5, 6, 7, 8, 9]]),
]
# Batches padded on the right, as onnxruntime-genai pads them itself (its Tokenizer.encode_batch).
RIGHT_PADDED = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]]
RIGHT_PADDED_CASES = [
    ("3-D, right-padded: temporal positions", dict(report="pos0"), RIGHT_PADDED),
    ("3-D, right-padded: mask sum", dict(report="mask_sum"), RIGHT_PADDED),
    ("2-D, right-padded: mask sum", dict(report="mask_sum", positions="2d"), RIGHT_PADDED),
    ("rank not declared, right-padded: mask sum", dict(report="mask_sum", positions="any"), RIGHT_PADDED),
]


RESULTS = Path(__file__).with_name("results") / "probe_genai_state.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=result_file, default=RESULTS, help="the JSON file the figures are written to")
    args = parser.parse_args()
    python = python_of("genai")
    versions = package_versions("genai")
    print(f"onnxruntime-genai {versions.get('onnxruntime-genai')}, onnxruntime {versions.get('onnxruntime')}")
    print("each line: the value the probe saw at the last prompt token, then at each generated step")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for index, (_, arguments, prompts) in enumerate(CASES + RIGHT_PADDED_CASES):
            folder = str(probe_model(Path(tmp) / str(index), **arguments))
            jobs.append({"folder": folder, "prompts": prompts, "right": index >= len(CASES)})
        done = subprocess.run([str(python), "-c", WORKER], input=json.dumps(jobs), capture_output=True, text=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if len(results) != len(CASES) + len(RIGHT_PADDED_CASES):
        raise SystemExit(f"the onnxruntime-genai worker failed:\n{done.stderr[-2000:]}")
    for (label, _, _), result in zip(CASES + RIGHT_PADDED_CASES, results, strict=True):
        print(f"{label:<58} {result if isinstance(result, str) else '  '.join(map(str, result))}")
    labels = [label for label, _, _ in CASES + RIGHT_PADDED_CASES]
    record = {"command": command_line(), "versions": versions, "probes": dict(zip(labels, results, strict=True))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, json.dumps(record, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
