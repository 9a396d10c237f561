"""onnxruntime-genai's own graph (``model.genai.onnx``): the fused graph rewired for right-padded batches only.

The fused graph is exact for any attention mask (export/fused_graph.py): every GroupQueryAttention takes
``seqlens_k = S - 1`` for every row, the padding as an additive ``attention_bias``, and the positions it rotates by
(``position_ids`` shifted by each row's first kept slot). That costs nothing measurable on the CPU (the two graphs
decode within 1 % of each other there, README) but much on CUDA, where the bias takes the kernel off its fastest
path: on an H200 under onnxruntime-genai a Qwen3-0.6B-shaped step at batch 8 spent 2.4 ms in GroupQueryAttention
against 0.86 ms without the bias, 0.75 ms without the positions too, and the builder's 0.75 ms (README, "Where the
goals of the speed issue stand").

onnxruntime-genai never left-pads: a prompt batch is padded on the right, and each decode step appends one slot to
every row (a short row's mask reads 1 1 1 0 0 1). For such batches GroupQueryAttention's own contract is exact with
nothing added: each row's keys compact in the slots [0, seqlens_k], ``seqlens_k`` = the row's kept slots - 1, the
new tokens written at the row's own next slot (in onnxruntime-genai's shared buffer or in a concatenated present
alike), and RoPE at the slot, which is then the row's position. So this graph is the fused one with, in every
GroupQueryAttention, ``seqlens_k`` from the mask's row sums, no ``attention_bias``, and no ``position_ids`` where
the kernel rotates (the nodes that fed them pruned, the input dropped where nothing else reads it). It is wrong for
a left-padded batch, which only the fused ``model.onnx`` takes; ``genai_config.json`` names this one, and
``--verify`` checks it on the right-padded rows of its batch (export/verify.py).

onnxruntime-genai samples from each row's last kept position and reads no other logits (a static 1 on the logits'
position axis tells it so, from 0.12.2 on), so this graph also puts only that position through the head, as
``--logits last`` does (by the cheaper rule of right padding where the graph takes no other padding:
``emit_last_position(..., right_padded=True)``): ``model.onnx`` keeps every position, the contract for scoring a
text. A prompt's head then costs one row instead of its length, and its logits are (B, 1, V) rather than (B, T, V)
(a 4096-token Qwen3 prompt's float32 logits are 2.5 GB).

A model with interleaved multimodal RoPE (Qwen3.5) gets this graph from either of its graphs, fused or plain, taking
(B, T) positions where ``model.onnx`` takes (3, B, T), repeated on the three streams first thing (as
``--positions text`` builds its graphs: logits and states bit for bit those of three equal streams). onnxruntime-genai
0.18 feeds (3, B, T) positions only under its Qwen3.5 model types, whose position code unmasks a right-padded row's
pads from the first decode step (docs/hybrid-export.md 5.2), and (B, T) ones under its generic decoder, which keeps
them masked. This graph takes token ids (prompts with images or audio go through ``--inputs-embeds``'
``model.embeds.onnx``, export/embeds_graph.py), so the positions it is ever fed are text positions: the (B, T) graph
loses nothing, and genai_config.json names the generic type. Batches of unequal prompt lengths are then right under
onnxruntime-genai whatever ``--positions`` says.

It shares ``model.onnx.data`` with ``model.onnx``: the same initializers, so the proto alone is written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper

from .decoder_graph import emit_last_position
from .graph_builder import GraphBuilder
from .graph_walk import all_nodes, drop_unread_initializers, names_read, prune_dead_nodes, rotates, save_checked
from .names import GENAI_MODEL_FILE, LAST_POSITION_SCOPE, PADDING_KEY

# GroupQueryAttention's inputs by position (onnxruntime's contrib schema, com.microsoft).
SEQLENS_K, POSITION_IDS, ATTENTION_BIAS = 5, 9, 10
SCOPE = "/genai_seqlens"
TEXT_POSITIONS_SCOPE = "/genai_text_positions"
HEAD_SCOPE = "/lm_head/"  # the head's nodes (export/decoder_graph.py ``build``)
LAST_CONSTS = "/genai_last/const/"  # the selection's constants, named apart from the fused graph's
INT64 = TensorProto.INT64


@dataclass(frozen=True)
class GenaiGraph:
    path: Path
    positions: bool  # whether it still takes position_ids (a RotaryEmbedding before the attention reads them)


def write_genai_graph(model_path: Path, dtype: torch.dtype) -> GenaiGraph | None:
    """Writes ``model.genai.onnx`` beside ``model_path`` (whose data file it shares) and checks it; None, and nothing
    written, where the graph has neither a padding bias to take out nor (3, B, T) positions to take as (B, T).
    ``dtype``: the graph's, whose form of the general selection (``emit_last_position``) follows it."""
    model = onnx.load(model_path, load_external_data=False)
    genai = right_padded_graph(model)
    right_padded = genai is not None  # rewired for right padding alone; else (a plain graph's) it takes either side
    if takes_stream_positions(genai or model):
        genai = genai or copy.deepcopy(model)
        take_text_positions(genai.graph)
    if genai is None:
        return None
    select_last_position(genai.graph, dtype, right_padded)
    path = model_path.with_name(GENAI_MODEL_FILE)
    save_checked(genai, path)
    return GenaiGraph(path, takes_positions(genai))


def right_padded_graph(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The graph of this module's docstring, from the fused ``model`` (left as it is); None where no
    GroupQueryAttention takes a padding bias (the plain graph, or a fused one with plain attention)."""
    if not any(padded_attention(node) for node in model.graph.node):
        return None
    genai = copy.deepcopy(model)
    graph = genai.graph
    seqlens = emit_seqlens(graph)
    for node in filter(padded_attention, graph.node):
        node.input[SEQLENS_K] = seqlens
        node.input[ATTENTION_BIAS] = ""
        if rotates(node):
            node.input[POSITION_IDS] = ""
        while node.input and not node.input[-1]:
            node.input.pop()
    prune_dead_nodes(graph)
    drop_unread_initializers(graph)  # the bias's own constants: onnxruntime would warn about each at every load
    if "position_ids" not in names_read(graph):
        kept = [value for value in graph.input if value.name != "position_ids"]
        del graph.input[:]
        graph.input.extend(kept)
    helper.set_model_props(genai, {p.key: p.value for p in model.metadata_props} | {PADDING_KEY: "right"})
    return genai


def padded_attention(node: onnx.NodeProto) -> bool:
    """A GroupQueryAttention that takes the padding as an attention bias."""
    bias = node.input[ATTENTION_BIAS] if len(node.input) > ATTENTION_BIAS else ""
    return node.op_type == "GroupQueryAttention" and bool(bias)


def takes_positions(model: onnx.ModelProto) -> bool:
    return any(value.name == "position_ids" for value in model.graph.input)


def takes_stream_positions(model: onnx.ModelProto) -> bool:
    """Whether the graph's position_ids are (3, B, T): one stream each for time, height and width."""
    return any(
        value.name == "position_ids" and len(value.type.tensor_type.shape.dim) == 3 for value in model.graph.input
    )


def take_text_positions(graph: onnx.GraphProto) -> None:
    """position_ids become a (B, T) input, repeated on the three streams before any node reads them (the module
    docstring): every reader, in subgraphs too, reads the repeated streams instead."""
    streams = f"{TEXT_POSITIONS_SCOPE}/Expand_output_0"
    for node in all_nodes(graph):
        node.input[:] = [streams if name == "position_ids" else name for name in node.input]
    axes = helper.make_tensor("axes", INT64, [1], [0])
    shape = helper.make_tensor("shape", INT64, [3], [3, 1, 1])
    unsqueezed = f"{TEXT_POSITIONS_SCOPE}/Unsqueeze_output_0"
    nodes = [
        helper.make_node("Constant", [], [f"{TEXT_POSITIONS_SCOPE}/axes"], f"{TEXT_POSITIONS_SCOPE}/axes", value=axes),
        helper.make_node(
            "Constant", [], [f"{TEXT_POSITIONS_SCOPE}/shape"], f"{TEXT_POSITIONS_SCOPE}/shape", value=shape
        ),
        helper.make_node(
            "Unsqueeze",
            ["position_ids", f"{TEXT_POSITIONS_SCOPE}/axes"],
            [unsqueezed],
            f"{TEXT_POSITIONS_SCOPE}/Unsqueeze",
        ),
        helper.make_node(
            "Expand", [unsqueezed, f"{TEXT_POSITIONS_SCOPE}/shape"], [streams], f"{TEXT_POSITIONS_SCOPE}/Expand"
        ),
    ]
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    (value,) = (value for value in graph.input if value.name == "position_ids")
    del value.type.tensor_type.shape.dim[0]  # (3, B, T) -> (B, T)


def emit_seqlens(graph: onnx.GraphProto) -> str:
    """(B,) int32: each row's kept slots - 1, computed first in the graph (from the attention_mask input alone)."""
    names = {step: f"{SCOPE}/{step}_output_0" for step in ("axes", "one", "kept", "last", "seqlens")}
    axes, one = helper.make_tensor("axes", INT64, [1], [1]), helper.make_tensor("one", INT64, [], [1])
    nodes = [
        helper.make_node("Constant", [], [names["axes"]], f"{SCOPE}/axes", value=axes),
        helper.make_node("Constant", [], [names["one"]], f"{SCOPE}/one", value=one),
        helper.make_node("ReduceSum", ["attention_mask", names["axes"]], [names["kept"]], f"{SCOPE}/kept", keepdims=0),
        helper.make_node("Sub", [names["kept"], names["one"]], [names["last"]], f"{SCOPE}/last"),
        helper.make_node("Cast", [names["last"]], [names["seqlens"]], f"{SCOPE}/seqlens", to=TensorProto.INT32),
    ]
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    return names["seqlens"]


def select_last_position(graph: onnx.GraphProto, dtype: torch.dtype, right_padded: bool) -> None:
    """Puts each row's last kept position alone through the head (the module docstring), unless the graph does
    already (``--logits last``): the selection's nodes go before the head's, which read the picked (B, 1, C) rows in
    place of the final hidden states, and ``logits`` becomes (B, 1, V). ``right_padded``: the graph takes right
    padding alone (``right_padded_graph``), so the cheaper rule for it picks; else the general one, which a plain
    graph's genai model needs for the left padding it takes (``emit_last_position``)."""
    (logits,) = (value for value in graph.output if value.name == "logits")
    positions = logits.type.tensor_type.shape.dim[1]
    if positions.HasField("dim_value") and positions.dim_value == 1:
        return
    head = [node for node in graph.node if node.name.startswith(HEAD_SCOPE)]
    made_in_head = {name for node in head for name in node.output}
    given = {tensor.name for tensor in graph.initializer} | {value.name for value in graph.input}
    outer = {name for node in head for name in node.input if name and name not in made_in_head | given}
    if len(outer) != 1:
        raise RuntimeError(
            f"the head reads {sorted(outer)} from the graph, not one hidden state (a bug in the exporter)"
        )
    (hidden,) = outer
    b = GraphBuilder(None, consts=LAST_CONSTS)
    with b.scope(HEAD_SCOPE.strip("/")), b.scope(LAST_POSITION_SCOPE):
        picked = emit_last_position(b, hidden, "input_ids", "attention_mask", dtype, right_padded=right_padded)
    for node in head:
        node.input[:] = [picked if name == hidden else name for name in node.input]
    first = next(index for index, node in enumerate(graph.node) if node.name.startswith(HEAD_SCOPE))
    for offset, node in enumerate(b.nodes):
        graph.node.insert(first + offset, node)
    graph.initializer.extend(b.initializers)
    positions.Clear()
    positions.dim_value = 1
