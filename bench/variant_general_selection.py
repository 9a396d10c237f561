"""A measurement-only copy of an export whose ``model.genai.onnx`` picks the last position by the general rule.

A fused export's ``model.genai.onnx`` takes right padding alone, and picks each row's last kept position as the count
of the step's kept new slots less one (``export/decoder_graph.py`` ``emit_last_position(right_padded=True)``).
``--logits last``'s ``model.onnx`` takes left padding too, and picks by the general rule (``export/decoder_graph.py``
``emit_last_position``: ArgMax in a float32 graph, the kept slots numbered and the largest taken in a half one). This
writes OUT with ``model.genai.onnx`` selecting by the general rule, every other file copied, for
bench/bench_graph_ab.py to time the two rules against each other:

    python bench/variant_general_selection.py OURS OUT
    python bench/bench_graph_ab.py OUT OURS --runtime genai --reps 8 --steps 40 \
        --tag smollm2-genai-selection-reducesum-b1
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import onnx

from export import genai_graph
from export.contrib_schemas import register_onnxruntime_schemas
from export.decoder_graph import emit_last_position
from export.graph_builder import TORCH_TO_ONNX
from export.names import GENAI_MODEL_FILE, MODEL_FILE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a fused export of `thinker export`")
    parser.add_argument("out", type=Path, help="a new folder")
    args = parser.parse_args()
    if not (args.source / GENAI_MODEL_FILE).is_file():
        raise SystemExit(f"{args.source}: no {GENAI_MODEL_FILE} (a plain graph's export?)")
    args.out.mkdir(parents=True)
    for path in args.source.iterdir():
        if path.is_file() and path.name != GENAI_MODEL_FILE:  # copied: onnx's checker refuses hard-linked data
            shutil.copy2(path, args.out / path.name)
    inputs = onnx.load(args.out / MODEL_FILE, load_external_data=False).graph.input
    cache = next(i for i in inputs if i.name.startswith("past_key_values."))  # in the graph's dtype (logits: float32)
    dtype = next(t for t, e in TORCH_TO_ONNX.items() if e == cache.type.tensor_type.elem_type)
    register_onnxruntime_schemas()  # the checker reads the contrib operators' schemas
    genai_graph.emit_last_position = lambda *args, right_padded: emit_last_position(*args)  # the general rule always
    genai_graph.write_genai_graph(args.out / MODEL_FILE, dtype)
    print(f"wrote {args.out} ({GENAI_MODEL_FILE} selecting by the general rule, {dtype})")


if __name__ == "__main__":
    main()
