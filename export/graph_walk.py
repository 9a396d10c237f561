"""Every node of an ONNX graph, the bodies of its control-flow nodes (If branches, Loop and Scan bodies) included."""

from __future__ import annotations

from collections.abc import Iterator

import onnx


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` in order, each followed by the nodes of its subgraphs (depth first)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from all_nodes(subgraph)
