"""A measurement-only copy of an export whose head reads a transposed copy of its weight, as the builder lays it out.

Ours reads a tied head from the embedding table itself, ``FusedMatMul(transB=1)`` over (vocab, hidden); the builder
stores the head as (hidden, vocab) for a plain ``MatMul`` and gathers the embedding from a ``Transpose`` of it. This
writes OUT with the graph onnxruntime-genai runs (genai_config.json's filename) rewritten to a ``MatMul`` over a
transposed copy (the file grows by the head's bytes), every other file copied, for bench/bench_graph_ab.py to time
against the original:

    python bench/variant_transposed_head.py OURS OUT
    python bench/bench_graph_ab.py BUILDER OURS OUT --runtime genai --reps 6 --tag smollm2-genai-head-transposed-b1
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="an export of `thinker export` with a tied head")
    parser.add_argument("out", type=Path, help="a new folder")
    args = parser.parse_args()
    graph_file = json.loads((args.source / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    model = onnx.load(args.source / graph_file, load_external_data=False)
    onnx.load_external_data_for_model(model, str(args.source))
    graph = model.graph
    head = next((n for n in graph.node if n.name.startswith("/lm_head/") and n.op_type == "FusedMatMul"), None)
    if head is None:
        raise SystemExit(f"{args.source / graph_file}: no FusedMatMul head (not a tied head?)")
    table = next(t for t in graph.initializer if t.name == head.input[1])
    transposed = np.ascontiguousarray(numpy_helper.to_array(table).T)
    graph.initializer.append(numpy_helper.from_array(transposed, "lm_head.weight.transposed"))
    inputs = [head.input[0], "lm_head.weight.transposed"]
    matmul = helper.make_node("MatMul", inputs, list(head.output), name="/lm_head/MatMul")
    position = list(graph.node).index(head)
    graph.node.remove(head)
    graph.node.insert(position, matmul)
    args.out.mkdir(parents=True)
    for path in args.source.iterdir():
        if path.is_file() and not path.name.startswith("model."):
            shutil.copy2(path, args.out / path.name)
    onnx.save_model(model, args.out / graph_file, save_as_external_data=True, location="model.onnx.data")
    print(f"wrote {args.out} ({graph_file}: the head a MatMul over a transposed copy of {table.name})")


if __name__ == "__main__":
    main()
