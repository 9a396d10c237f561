"""What an exported ONNX folder holds, read before a session opens: the positions its graph can take (its
position table's rows against config.json and genai_config.json), and whether every external weights file the graph
names is there, whole, and the one it was written with.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from thinker_common.errors import ThinkerError
from thinker_common.side_files import read_json
from thinker_common.source_files import ONNX_FILES, regular_file

from .names import GENAI_CONFIG_FILE, MODEL_FILE, POSITION_TABLE, ROPE_TABLE, export_context
from .weights_stamp import check_weights_stamp


def folder_context(folder: Path) -> tuple[int | None, str]:
    """The positions a model folder's graph holds, and the key that says so: config.json's max_position_embeddings,
    else genai_config.json's context_length (an ONNX folder without config.json); never more than the rows of
    model.onnx's own position table (RoPE's, or a learned one), which also stand in where neither file gives a whole
    number above 0 (a config edited to a longer context would otherwise let a prompt run off the table inside
    onnxruntime). None where nothing says."""
    config = read_json(folder / "config.json")
    key = "max_position_embeddings"
    context = config.get(key) if isinstance(config, dict) else None
    if _whole(context):  # a RoPE scaling may stretch it (YaRN)
        context, key = export_context(context, config.get("rope_parameters"))
    if context is None:
        genai = read_json(folder / GENAI_CONFIG_FILE)
        model = genai.get("model") if isinstance(genai, dict) else None
        context = model.get("context_length") if isinstance(model, dict) else None
        key = f"context_length in {GENAI_CONFIG_FILE}"
    rows, table = graph_context(folder / MODEL_FILE) if (folder / MODEL_FILE).is_file() else (None, "")
    if rows is not None and not (_whole(context) and 0 < context <= rows):
        context, key = rows, f"the {table} rows of {MODEL_FILE}"
    return (context if _whole(context) and context > 0 else None), key


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The tables a graph holds one row per position in, by initializer name, and what a message calls them.
POSITION_TABLES = {ROPE_TABLE: "RoPE table", POSITION_TABLE: "position table"}


def graph_context(model_path: Path) -> tuple[int | None, str]:
    """The rows of an export's position table (both graphs store RoPE's ``rotary_emb.cos_cache``, a learned-position
    model its ``model.embed_positions.weight``), one row per position, and what the table is; read from the graph
    alone: its weights stay on disk. (None, "") where the graph holds neither."""
    try:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    except Exception:  # a damaged file: whoever loads it says so
        return None, ""
    return table_rows(graph)


def table_rows(graph: onnx.GraphProto) -> tuple[int | None, str]:
    """``graph_context`` of a loaded graph."""
    for tensor in graph.initializer:
        if tensor.name in POSITION_TABLES and tensor.dims:
            return int(tensor.dims[0]), POSITION_TABLES[tensor.name]
    return None, ""


def check_external_data(model_path: Path) -> onnx.ModelProto:
    """Every external weights file the graph names must lie beside it; a partial copy of an export is a common
    mistake, and onnxruntime's own error for it does not say which file is missing. Returns the graph, without its
    weights."""
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as err:  # protobuf's DecodeError and friends, for a truncated or foreign file
        raise ThinkerError(f"{model_path}: not a readable ONNX model ({type(err).__name__}); export it again") from None
    if not model.graph.node:  # an empty file parses as an empty model
        empty = "the file is empty" if model_path.stat().st_size == 0 else "it holds no graph"
        raise ThinkerError(f"{model_path}: not a readable ONNX model ({empty}); export it again")
    ends: dict[str, int] = {}  # external file -> the end of the last byte range the graph reads from it
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entry = {item.key: item.value for item in tensor.external_data}
            location = entry.get("location", "")
            try:
                if not isinstance(location, str):  # protobuf hands back bytes that are not UTF-8 as bytes
                    raise ValueError(location)
                end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
            except ValueError:
                raise ThinkerError(f"{model_path}: tensor {tensor.name!r} has malformed external data") from None
            ends[location] = max(ends.get(location, 0), end)
    outside = sorted(name for name in ends if Path(name).is_absolute() or ".." in Path(name).parts)
    if outside:
        raise ThinkerError(f"{model_path}: names weights outside its folder ({outside[0]}); refusing to read them")
    missing = sorted(name for name in ends if not os.path.lexists(model_path.parent / name))
    if missing:
        raise ThinkerError(
            f"{model_path.parent}: {', '.join(missing)} missing beside {model_path.name}; the ONNX folder is "
            "incomplete: copy the whole folder, or export it again"
        )
    for name, end in ends.items():
        regular_file(model_path.parent / name, ONNX_FILES)  # a pipe or a device in its place: says what it is
        check_weights_stamp(model, model_path, model_path.parent / name)
        size = (model_path.parent / name).stat().st_size
        if size < end:
            raise ThinkerError(
                f"{model_path.parent / name}: {size} bytes, but {model_path.name} reads up to byte {end}; the file "
                "is truncated: copy the whole folder again, or export it again"
            )
    return model
