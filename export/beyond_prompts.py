"""What an export ships that no prompt of ``--verify`` reaches, checked directly.

The verify's prompts reach a few hundred positions at most; the graphs serve the whole context (40,960 positions for
Qwen3, 262,144 for Qwen3.5). Two things decide what happens past the prompts and are read straight off the export:

- The RoPE tables. A row past the prompts (a scaling applied to the wrong positions, a chunk written at the wrong
  offset) would pass any prompt and turn every long conversation wrong. The shipped bytes of both tables are compared
  with ``rope_tables``, the model's own ``ThinkerRotaryEmbedding`` over the whole context in the graph's dtype
  (tests/export/test_rope_tables.py holds that to the embedding run at once): bit for bit, since both are the same
  computation in the same chunks, and any difference is a fault of what was written.
- GroupQueryAttention's ``local_window_size``. No Thinker attends through a sliding window (the converter refuses
  sliding-window layers), so a window in any graph is a fault: one wider than the long prompts passes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from thinker.configuration_thinker import ThinkerConfig

from .decoder_graph import rope_tables
from .names import ROPE_SIN_TABLE, ROPE_TABLE


def shipped_table(model: onnx.ModelProto, folder: Path, name: str) -> bytes | None:
    """The bytes of initializer ``name`` as stored (beside the graph, or in it), or None where the graph has none."""
    tensor = next((t for t in model.graph.initializer if t.name == name), None)
    if tensor is None:
        return None
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return tensor.raw_data
    entry = {item.key: item.value for item in tensor.external_data}
    with open(folder / entry["location"], "rb") as data:
        data.seek(int(entry.get("offset", 0)))
        return data.read(int(entry["length"]))


def rope_table_check(onnx_path: Path, config: ThinkerConfig, dtype: torch.dtype) -> tuple[dict, str | None]:
    """(figures, failure or None) for the RoPE tables of the graph at ``onnx_path`` (none for learned positions)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    shipped = {name: shipped_table(model, onnx_path.parent, name) for name in (ROPE_TABLE, ROPE_SIN_TABLE)}
    if shipped[ROPE_TABLE] is None:
        return {"rows": 0}, None
    expected = dict(zip((ROPE_TABLE, ROPE_SIN_TABLE), rope_tables(config, dtype), strict=True))
    figures: dict = {"rows": int(expected[ROPE_TABLE].shape[0])}
    failures = []
    for name, table in expected.items():
        want = table.contiguous().view(torch.uint8).numpy().reshape(table.shape[0], -1)  # a view: no copy
        got = shipped[name]
        if got is None or len(got) != want.size:
            failures.append(f"{name} holds {0 if got is None else len(got)} bytes where the model's has {want.size}")
            continue
        differs = (np.frombuffer(got, np.uint8).reshape(want.shape) != want).any(axis=1)
        if differs.any():
            first = int(np.flatnonzero(differs)[0])
            figures[f"{name} first differing position"] = first
            failures.append(f"{name} differs from the model's rotary embedding from position {first} on")
    figures["equal"] = not failures
    return figures, ("; ".join(failures) or None)


def attention_window_check(onnx_path: Path) -> str | None:
    """The failure where a GroupQueryAttention of the graph at ``onnx_path`` attends through a window, or None."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        window = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
        if window != -1:
            return (
                f"{onnx_path.name}: {node.name} attends to a window of its last {window} keys, where the model "
                "attends to every key before it"
            )
    return None
