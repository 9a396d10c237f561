"""A measurement-only copy of a fused export without what exact padding costs per forward, for bench_graph_ab.py.

The fused graph feeds every GroupQueryAttention an additive ``attention_bias`` built from the attention mask and the
positions it rotates by (``position_ids`` shifted by each row's first unmasked slot): about 24 small nodes per
forward that the builder's graph, which gets left padding wrong, does without (export/fused_graph.py). To learn what
they cost, this writes the same export with those GroupQueryAttention inputs cut (and the nodes that only fed them
pruned); with ``--no-positions`` also without the ``position_ids`` input, so that the kernel rotates by slot as the
builder's does. The copy computes the same function only for batches without padding, which is all
bench_graph_ab.py feeds it: never ship it. (The export now writes the shipped form of the second one for
onnxruntime-genai, right for its right-padded batches too: ``model.genai.onnx``, export/genai_graph.py.)

    python bench/variant_without_padding.py OURS /tmp/ours-nobias
    python bench/variant_without_padding.py OURS /tmp/ours-nobias-nopos --no-positions
    python bench/bench_graph_ab.py BUILDER OURS /tmp/ours-nobias /tmp/ours-nobias-nopos --runtime genai --own-tokens
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script

from export.genai_graph import ATTENTION_BIAS, POSITION_IDS  # noqa: E402
from export.graph_walk import prune_dead_nodes  # noqa: E402


def strip(model: onnx.ModelProto, positions: bool) -> int:
    """Cuts the attention bias (and the positions) from every GroupQueryAttention; returns how many it changed."""
    cut = [ATTENTION_BIAS] + ([] if positions else [POSITION_IDS])
    changed = 0
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        for index in cut:
            if index < len(node.input):
                node.input[index] = ""
        while node.input and not node.input[-1]:
            node.input.pop()
        changed += 1
    prune_dead_nodes(model.graph)
    if not positions:
        readers = [node.name for node in model.graph.node if "position_ids" in node.input]
        if readers:  # a RotaryEmbedding before the attention (partial or multimodal RoPE) still rotates by them
            needs = "--no-positions needs RoPE inside GroupQueryAttention"
            raise SystemExit(f"position_ids still feeds {', '.join(readers[:3])}: {needs}")
        kept = [i for i in model.graph.input if i.name != "position_ids"]
        del model.graph.input[:]
        model.graph.input.extend(kept)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a fused `thinker export` folder")
    parser.add_argument("output", type=Path, help="a new folder (must not exist)")
    parser.add_argument("--no-positions", action="store_true", help="also drop the position_ids input")
    args = parser.parse_args()
    if args.output.exists():
        raise SystemExit(f"{args.output} exists: give a new folder")
    model = onnx.load(args.source / "model.onnx", load_external_data=False)
    if not strip(model, positions=not args.no_positions):
        raise SystemExit(f"{args.source / 'model.onnx'} has no GroupQueryAttention: not a fused export")
    # onnxruntime refuses external data reached through a link out of the folder: the files are copied.
    shutil.copytree(args.source, args.output, ignore=shutil.ignore_patterns("model.onnx", "model.genai.onnx"))
    onnx.save(model, args.output / "model.onnx")
    config_path = args.output / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"]["filename"] = "model.onnx"  # this variant, not the export's model.genai.onnx
    if args.no_positions:
        config["model"]["decoder"]["inputs"].pop("position_ids", None)
    else:
        config["model"]["decoder"]["inputs"]["position_ids"] = "position_ids"
    config_path.write_text(json.dumps(config, indent=4) + "\n")
    print(f"wrote {args.output}: {len(model.graph.node)} nodes")


if __name__ == "__main__":
    main()
