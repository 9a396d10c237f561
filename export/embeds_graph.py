"""``--inputs-embeds``: the decoder cut at its token lookup, for embeddings that come from elsewhere.

The thinker of an omni or vision-language model is fed more than token ids: its audio, image and video towers write
embeddings into the prompt's placeholder slots, and the text decoder takes the whole prompt as ``inputs_embeds``
with (3, B, T) multimodal positions (DESIGN.md's contract, which the PyTorch Thinker keeps). ``model.onnx`` takes
token ids, so the exporter cuts two more graphs from it, over the same ``model.onnx.data`` (the proto alone of each
is written, as ``model.genai.onnx`` is):

  embed.onnx         input_ids [B, T] int64 -> inputs_embeds [B, T, hidden] float32: the token lookup alone, the
                     nodes that ``model.onnx`` runs on its ids (``emit_embeddings``'s /model/embed/tokens/ scope;
                     a quantized tied table's GatherBlockQuantized too), so a prompt's text slots are the very rows
                     the decoder would have looked up.
  model.embeds.onnx  ``model.onnx`` with ``inputs_embeds`` [B, T, hidden] float32 in place of ``input_ids`` and the
                     lookup taken out; every other input, output and state as ``model.onnx``'s. For Qwen3-VL and
                     Qwen3-Omni (``deepstack_layers``) also ``deepstack_embeds`` [layers, B, T, hidden] float32: the
                     vision tower's DeepStack features, row i added to the hidden states after layer i (zeros where
                     no image or video is, and at every decode step), as their text decoders add them.

``inputs_embeds`` is float32 in every dtype, as the logits are: the towers' outputs go in as float32 whatever dtype
they ran in (numpy has no bfloat16; ``OnnxDecoder`` takes torch tensors of any float dtype), and a half graph casts
them to its dtype first thing, the rounding
transformers' own half-precision model applies to them. The token rows survive the round trip exactly (float32 holds
every float16 and bfloat16 value).

Cut after every rewrite of ``model.onnx`` (the accuracy guard's), so both read the final weights file; ``--verify``
then runs ``model.embeds.onnx`` on a prompt of token rows and foreign vectors at multimodal positions against the
PyTorch Thinker fed the same (export/verify.py). Everything else in ``model.onnx`` that reads ``input_ids`` reads
only its shape (the new tokens' count and the batch), which ``inputs_embeds`` has on the same axes; a graph that
reads the ids' values elsewhere (Qwen3.8's n-gram hash) cannot be cut, and ``thinker export`` refuses it first
(``embeds_refusal``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import torch
from onnx import TensorProto, helper

from thinker.configuration_thinker import ThinkerConfig

from .graph_builder import TORCH_TO_ONNX
from .graph_walk import all_nodes, drop_unread_initializers, prune_dead_nodes, save_checked
from .names import DEEPSTACK_EMBEDS, DEEPSTACK_SCOPE, EMBED_FILE, EMBEDS_MODEL_FILE, INPUTS_EMBEDS, TOKENS_SCOPE

LOOKUP_SCOPE = f"/model/embed/{TOKENS_SCOPE}/"
CAST_IN = "/model/embed/inputs_embeds/Cast"  # a half graph's cast of the float32 input to its dtype


def embeds_refusal(config: ThinkerConfig) -> str | None:
    """Why ``--inputs-embeds`` cannot cut this model's graph, or None."""
    if config.qwen4_exp_features:
        return (
            "--inputs-embeds: Qwen3.8's n-gram embeddings hash the token ids themselves (and its hyper-connections "
            "follow them), so its graph cannot take embeddings in their place; export it without --inputs-embeds"
        )
    return None


def embeds_positions_note(config: ThinkerConfig, positions: str) -> str | None:
    """What an ``--inputs-embeds`` export with ``--positions text`` of a multimodal-RoPE model cannot take."""
    if positions != "text" or not (config.rope_parameters or {}).get("mrope_section"):
        return None
    return (
        "model.embeds.onnx takes [batch, seq] text positions (--positions text): it serves prompts whose three "
        "position streams are equal (text, audio), not image or video prompts; export with --positions multimodal "
        "for those"
    )


def write_embeds_graphs(model_path: Path, dtype: torch.dtype, hidden_size: int) -> None:
    """Writes ``embed.onnx`` and ``model.embeds.onnx`` beside ``model_path`` (``model.onnx``, unchanged) and checks
    both; ``dtype``: the graph's."""
    model = onnx.load(str(model_path), load_external_data=False)
    lookup = lookup_output(model.graph)
    batch, seq = (dim.dim_param or dim.dim_value for dim in _input(model.graph, "input_ids").type.tensor_type.shape.dim)
    embeds_type = helper.make_tensor_value_info(INPUTS_EMBEDS, TensorProto.FLOAT, [batch, seq, hidden_size])
    half = dtype != torch.float32

    embed = copy.deepcopy(model)
    graph = embed.graph
    kept = token_lookup(graph, lookup)
    del graph.node[:]
    graph.node.extend(kept)
    if half:
        graph.node.append(helper.make_node("Cast", [lookup], [INPUTS_EMBEDS], "/embed/Cast", to=TensorProto.FLOAT))
    else:
        for node in graph.node:
            node.output[:] = [INPUTS_EMBEDS if name == lookup else name for name in node.output]
    _set_values(graph.input, [_input(graph, "input_ids")])
    _set_values(graph.output, [embeds_type])
    drop_unread_initializers(graph)
    graph.name = "thinker_embed_tokens"

    decoder = copy.deepcopy(model)
    graph = decoder.graph
    body = [node for node in graph.node if not node.name.startswith(LOOKUP_SCOPE)]
    del graph.node[:]
    graph.node.extend(body)
    source = INPUTS_EMBEDS
    if half:
        source = f"{CAST_IN}_output_0"
        graph.node.insert(0, helper.make_node("Cast", [INPUTS_EMBEDS], [source], CAST_IN, to=TORCH_TO_ONNX[dtype]))
    for node in all_nodes(graph):
        if "input_ids" in node.input:
            check_reads_shape_only(node)
        renamed = {lookup: source, "input_ids": INPUTS_EMBEDS}
        node.input[:] = [renamed.get(name, name) for name in node.input]
    inputs = [embeds_type if value.name == "input_ids" else value for value in graph.input]
    layers = add_deepstack(graph, dtype)
    if layers:
        deepstack = [layers, batch, seq, hidden_size]
        inputs.insert(1, helper.make_tensor_value_info(DEEPSTACK_EMBEDS, TensorProto.FLOAT, deepstack))
    _set_values(graph.input, inputs)
    prune_dead_nodes(graph)
    drop_unread_initializers(graph)

    save_checked(decoder, model_path.with_name(EMBEDS_MODEL_FILE))
    save_checked(embed, model_path.with_name(EMBED_FILE))


def add_deepstack(graph: onnx.GraphProto, dtype: torch.dtype) -> int:
    """Turns the DeepStack marks of ``graph`` (model.onnx's Identity after each of its first ``deepstack_layers``
    layers, export/decoder_graph.py) into the adds of ``deepstack_embeds`` [layers, B, T, hidden]'s rows, in the
    graph's dtype (transformers casts the features to the hidden states' dtype); returns the number of layers."""
    marks = [node for node in graph.node if node.name.startswith(f"/model/{DEEPSTACK_SCOPE}.")]
    if not marks:
        return 0
    features = DEEPSTACK_EMBEDS
    added = []
    if dtype != torch.float32:
        features = f"/model/{DEEPSTACK_SCOPE}/Cast_output_0"
        added.append(
            helper.make_node(
                "Cast", [DEEPSTACK_EMBEDS], [features], f"/model/{DEEPSTACK_SCOPE}/Cast", to=TORCH_TO_ONNX[dtype]
            )
        )
    for index, mark in enumerate(marks):
        if mark.name != f"/model/{DEEPSTACK_SCOPE}.{index}/Identity" or mark.op_type != "Identity":
            raise RuntimeError(f"DeepStack mark {mark.name} ({mark.op_type}) out of order (a bug in the exporter)")
        scope = mark.name.rsplit("/", 1)[0]
        row = f"{scope}/row"
        graph.initializer.append(helper.make_tensor(f"{scope}/index", TensorProto.INT64, [], [index]))
        added.append(helper.make_node("Gather", [features, f"{scope}/index"], [row], f"{scope}/Gather", axis=0))
        mark.op_type, mark.name = "Add", f"{scope}/Add"
        mark.input.append(row)
    for position, node in enumerate(added):  # first: they read only an input and constants
        graph.node.insert(position, node)
    return len(marks)


def lookup_output(graph: onnx.GraphProto) -> str:
    """The one value the token lookup's nodes hand to the rest of the graph: the (B, T, hidden) embeddings."""
    inside = [node for node in graph.node if node.name.startswith(LOOKUP_SCOPE)]
    made = {name for node in inside for name in node.output}
    read_outside = {
        name for node in all_nodes(graph) if not node.name.startswith(LOOKUP_SCOPE) for name in node.input
    } | {value.name for value in graph.output}
    handed = sorted(made & read_outside)
    if len(handed) != 1:
        raise RuntimeError(
            f"the token lookup ({LOOKUP_SCOPE}) hands {handed or 'nothing'} to the graph, not one value of embeddings "
            "(a bug in the exporter)"
        )
    return handed[0]


def token_lookup(graph: onnx.GraphProto, lookup: str) -> list[onnx.NodeProto]:
    """The nodes ``lookup`` is computed by, in graph order, from ``input_ids`` and initializers only."""
    producer = {name: node for node in graph.node for name in node.output}
    given = {tensor.name for tensor in graph.initializer} | {""}
    needed, wanted = set(), [lookup]
    while wanted:
        name = wanted.pop()
        if name in given or name == "input_ids":
            continue
        node = producer.get(name)
        if node is None:
            raise RuntimeError(f"the token lookup reads {name!r}, which is neither input_ids nor a weight (a bug)")
        if id(node) not in needed:
            needed.add(id(node))
            wanted.extend(node.input)
    return [copy.deepcopy(node) for node in graph.node if id(node) in needed]


def check_reads_shape_only(node: onnx.NodeProto) -> None:
    """A node of the cut decoder reading ``input_ids`` must read only its batch and sequence axes, which
    ``inputs_embeds`` has in the same places."""
    attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
    end = attributes.get("end")
    if node.op_type != "Shape" or end is None or not 0 < end <= 2 or attributes.get("start", 0) < 0:
        raise RuntimeError(
            f"node {node.name} ({node.op_type}) reads the token ids themselves, which --inputs-embeds takes away "
            "(a bug in the exporter: embeds_refusal should have refused this model)"
        )


def _input(graph: onnx.GraphProto, name: str) -> onnx.ValueInfoProto:
    return next(value for value in graph.input if value.name == name)


def _set_values(field, values: list[onnx.ValueInfoProto]) -> None:
    values = [copy.deepcopy(value) for value in values]
    del field[:]
    field.extend(values)
