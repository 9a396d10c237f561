"""One layer as a standalone ONNX model: for layer-by-layer parity where a whole model does not fit, and for
per-layer timing (bench/bench_linear_attention.py).

``write_gated_deltanet_model`` writes a Gated DeltaNet layer with the hybrid IO names of one layer:
  inputs   hidden_states (B, T, C) model dtype, attention_mask (B, P + T) int64,
           past_key_values.0.conv_state (B, conv_dim, k - 1) model dtype,
           past_key_values.0.recurrent_state (B, Hv, dk, dv) float32
  outputs  output (B, T, C), present.0.conv_state, present.0.recurrent_state
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx
import torch
from onnx import TensorProto

from .decoder_graph import make_model
from .graph_builder import TORCH_TO_ONNX, GraphBuilder, WeightFile, value_info
from .linear_attention_graph import GatedDeltaNetDims, GatedDeltaNetGraph, emit_padding_masks

LAYER_PREFIX = "model.layers.0.linear_attn"
PAST_STATES = ("past_key_values.0.conv_state", "past_key_values.0.recurrent_state")
PRESENT_STATES = ("present.0.conv_state", "present.0.recurrent_state")


def write_gated_deltanet_model(
    folder: Path,
    dims: GatedDeltaNetDims,
    params: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    graph_class: type[GatedDeltaNetGraph] = GatedDeltaNetGraph,
) -> Path:
    """``folder/model.onnx`` (+ ``model.onnx.data``) for one layer; ``params`` by the module's own names
    (``in_proj_qkv.weight``, ``A_log``...), cast to ``dtype``. Returns the model path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = WeightFile(folder / "model.onnx.data")
    b = GraphBuilder(weights)

    def weight(name: str) -> torch.Tensor:
        return params[name.removeprefix(LAYER_PREFIX + ".")].detach().to(dtype)

    layer = graph_class(b, dims, dtype, weight)
    with b.scope(LAYER_PREFIX.replace(".", "/")):
        padding = emit_padding_masks(
            b,
            "attention_mask",
            "hidden_states",
            dtype,
            dims,
            branches=graph_class.branches_on_padding,
            chunks=graph_class.chunks_prompts,
        )
        out = layer.emit("hidden_states", LAYER_PREFIX, padding, *PAST_STATES, *PRESENT_STATES)
    b.op_to("Identity", [out], ["output"])
    model_dtype, float32 = TORCH_TO_ONNX[dtype], TensorProto.FLOAT
    inputs = [
        value_info("hidden_states", model_dtype, ["batch_size", "sequence_length", dims.hidden_size]),
        value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        value_info(PAST_STATES[0], model_dtype, dims.conv_state_shape("batch_size")),
        value_info(PAST_STATES[1], float32, dims.recurrent_state_shape("batch_size")),
    ]
    outputs = [
        value_info("output", model_dtype, ["batch_size", "sequence_length", dims.hidden_size]),
        value_info(PRESENT_STATES[0], model_dtype, dims.conv_state_shape("batch_size")),
        value_info(PRESENT_STATES[1], float32, dims.recurrent_state_shape("batch_size")),
    ]
    graph = b.make_graph("gated_deltanet_layer", inputs, outputs)
    weights.close()
    path = folder / "model.onnx"
    onnx.save(make_model(graph, {}, contrib_ops=layer.contrib_ops), str(path))
    return path
