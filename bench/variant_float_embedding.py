"""A measurement-only copy of a quantized export whose tied embedding is the float table again, as the builder's int8.

``thinker export --quantize`` gathers a tied embedding from the quantized head's own tensors (GatherBlockQuantized:
the table stored once, quantized); onnxruntime-genai's builder does so at int4 but keeps a float32 embedding beside
its int8 head. The two int8 exports of SmolLM2 otherwise hold the same bytes (every MatMulNBits weight and scale
equal, the same accuracy level and blocks), so this copy asks whether the embedding is where their fidelity differs:
every graph of SOURCE (model.onnx, model.genai.onnx) with its ``/model/embed/`` nodes replaced by one ``Gather`` over
the float table of the Thinker folder it was exported from (its ``export_report.json`` names it), written to OUT.
Same speed by construction (a decode step reads one row per token); 4 bytes a weight more for the table.

    python bench/variant_float_embedding.py OURS-INT8 OUT
    python bench/bench_int8.py          # each writes and judges its own copies: the "float embedding" rows
    python bench/bench_quant_texts.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's packages, when run as a script

from export.genai_graph import names_read, prune_dead_nodes  # noqa: E402

EMBED_SCOPE = "/model/embed/"
WEIGHTS = "model.onnx.data"
TABLE = "model.embed_tokens.weight.float"


def float_table(thinker_folder: Path) -> np.ndarray:
    """The float embedding of a Thinker folder, read alone from its safetensors."""
    from safetensors import safe_open

    for path in sorted(thinker_folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as weights:
            name = next((key for key in weights.keys() if key.endswith("embed_tokens.weight")), None)
            if name is not None:
                return weights.get_tensor(name).astype(np.float32)
    raise SystemExit(f"{thinker_folder}: no embed_tokens.weight in its safetensors")


def with_float_embedding(model: onnx.ModelProto, table: np.ndarray) -> None:
    """Replaces the embedding's nodes by a Gather over ``table``, writing the tensor they wrote."""
    graph = model.graph
    embed = [node for node in graph.node if node.name.startswith(EMBED_SCOPE)]
    produced = {name for node in embed for name in node.output}
    read_outside = {name for node in graph.node if node not in embed for name in node.input}
    (output,) = produced & read_outside
    position = list(graph.node).index(embed[0])
    for node in embed:
        graph.node.remove(node)
    graph.node.insert(position, helper.make_node("Gather", [TABLE, "input_ids"], [output], name=EMBED_SCOPE + "Gather"))
    graph.initializer.append(numpy_helper.from_array(table, TABLE))
    prune_dead_nodes(graph)
    read = names_read(graph)
    unread = [tensor for tensor in graph.initializer if tensor.name not in read]  # the embedding's own constants
    for tensor in unread:
        graph.initializer.remove(tensor)


def inline(tensor: onnx.TensorProto, folder: Path) -> onnx.TensorProto:
    """A tensor of the genai graph's own (its small constants), its bytes in the graph file."""
    if external_data_helper.uses_external_data(tensor):
        external_data_helper.load_external_data_for_tensor(tensor, str(folder))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return tensor


def write_copy(source: Path, out: Path) -> Path:
    """Writes the copy of ``source`` to ``out`` (a new folder, renamed into place when whole); returns the Thinker
    folder whose float table it holds."""
    thinker_folder = Path(json.loads((source / "export_report.json").read_text())["source"])
    table = float_table(thinker_folder)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith("model."):
            shutil.copy2(path, partial / path.name)
    saved: dict[str, onnx.TensorProto] = {}
    for graph_file in ("model.onnx", "model.genai.onnx"):  # the genai graph reads the same weights file
        if not (source / graph_file).exists():
            continue
        model = onnx.load(source / graph_file, load_external_data=False)
        if saved:  # the weights are written: point at them
            with_float_embedding(model, np.zeros((0,), np.float32))
            initializers = [saved.get(tensor.name) or inline(tensor, source) for tensor in model.graph.initializer]
            del model.graph.initializer[:]
            model.graph.initializer.extend(initializers)
            onnx.save_model(model, partial / graph_file)
            continue
        onnx.load_external_data_for_model(model, str(source))
        with_float_embedding(model, table)
        onnx.save_model(model, partial / graph_file, save_as_external_data=True, location=WEIGHTS)
        written = onnx.load(partial / graph_file, load_external_data=False)
        saved = {tensor.name: tensor for tensor in written.graph.initializer}
    partial.rename(out)
    return thinker_folder


def float_embedding_copy(source: Path) -> Path:
    """The copy of an export in the benchmark cache, beside it, written afresh: the benches' own."""
    out = source.with_name(source.name + "-float-embedding")
    shutil.rmtree(out, ignore_errors=True)
    write_copy(source, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="an export of `thinker export --quantize` with a tied embedding")
    parser.add_argument("out", type=Path, help="a new folder")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: give a new folder")
    thinker_folder = write_copy(args.source, args.out)
    print(f"wrote {args.out}: the tied embedding a Gather over the float table of {thinker_folder}")


if __name__ == "__main__":
    main()
