"""Walking and pruning an ONNX graph, the bodies of its control-flow nodes (If branches, Loop and Scan bodies)
included: what the graphs cut from ``model.onnx`` share (export/genai_graph.py, export/embeds_graph.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The bodies ``node`` holds (an If's branches, a Loop's or a Scan's body)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` in order, each followed by the nodes of its subgraphs (depth first)."""
    for node in graph.node:
        yield node
        for body in subgraphs(node):
            yield from all_nodes(body)


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and the bodies of its control-flow nodes, depth first."""
    yield graph
    for node in graph.node:
        for body in subgraphs(node):
            yield from all_graphs(body)


def names_read(graph: onnx.GraphProto) -> set[str]:
    """Every name the nodes of ``graph`` read, those of their subgraphs included."""
    return {name for node in all_nodes(graph) for name in node.input}


def prune_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drops nodes none of whose outputs another node (or a subgraph of one: the hybrid graphs' If branches read
    the outer scope) or the graph's outputs read, until none is left."""
    while True:
        read = names_read(graph) | {output.name for output in graph.output}
        dead = [node for node in graph.node if not any(name in read for name in node.output if name)]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Drops the initializers no node reads (onnxruntime warns about each at every load)."""
    read = names_read(graph)
    kept = [tensor for tensor in graph.initializer if tensor.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def rotates(node: onnx.NodeProto) -> bool:
    """A GroupQueryAttention that applies RoPE to q and k itself (``do_rotary``)."""
    return any(attribute.name == "do_rotary" and attribute.i == 1 for attribute in node.attribute)


def save_checked(model: onnx.ModelProto, path: Path) -> None:
    """Writes a graph cut from ``model.onnx`` (its proto alone: the weights stay in the shared data file) and checks
    it, on the path, so that the checker follows the external data."""
    onnx.save_model(model, path)
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as err:
        raise RuntimeError(f"{path.name} is invalid (a bug in the exporter): {err}") from err
