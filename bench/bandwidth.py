"""The memory-bandwidth limit of decoding: measured read bandwidth / bytes of weights read per generated token.

Decoding one token multiplies a few activation rows by every weight matrix once, so on a CPU its speed is bounded
by how fast the weights stream from memory: ``limit tokens/s = read bandwidth / weight bytes read per token``.

``read_bandwidth`` streams a 1 GiB array through numpy (max, a sum over an int64 view, a float32 matrix-vector
product) on 1 and on ``threads`` threads at once (numpy releases the GIL in these loops) and keeps the best rate:
a lower bound of the machine's read bandwidth, since each kernel does a little arithmetic per element. On shared
cores it drifts with the neighbours' load, so the benchmark measures it several times and keeps the best.

``weight_bytes_per_token`` reads an ONNX graph: every initializer a node consumes in full is read once per token
(MatMul, Gemm, MatMulNBits weights and scales, norm scales); tensors that are only gathered from (the embedding
table, RoPE caches read row by row) cost a row, which is left out.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnx

GATHERING_OPS = {"Gather", "GatherBlockQuantized", "GatherElements", "GatherND"}
ROW_READ_INPUTS = {"GroupQueryAttention": {7, 8}, "RotaryEmbedding": {2, 3}}  # cos/sin caches


def read_bandwidth(threads: int = 2, gib: float = 1.0, repeats: int = 5) -> dict:
    """Best read rate in bytes/s over kernels and thread counts, with the per-setting figures."""
    data = np.ones(int(gib * 2**30) // 8, dtype=np.int64)
    vector = np.ones(1024, dtype=np.float32)
    kernels = {
        "max": lambda part: part.max(),
        "sum": lambda part: part.sum(),
        "gemv": lambda part: part.view(np.float32).reshape(-1, 1024) @ vector,
    }
    rates = {}
    for name, kernel in kernels.items():
        for count in sorted({1, threads}):
            parts = np.array_split(data, count)
            best = 0.0
            for _ in range(repeats):
                workers = [threading.Thread(target=kernel, args=(part,)) for part in parts]
                started = time.perf_counter()
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
                best = max(best, data.nbytes / (time.perf_counter() - started))
            rates[f"{name}, {count} thread{'s' if count > 1 else ''}"] = best
    return {"bytes_per_s": max(rates.values()), "by_kernel": rates}


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.raw_data:
        return len(tensor.raw_data)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def weight_bytes_per_token(model_path: Path) -> int:
    """Bytes of initializers read in full by one decode step of the graph at ``model_path`` (top-level nodes and
    control-flow bodies alike)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    sizes = {t.name: tensor_bytes(t) for t in graph.initializer}
    read: set[str] = set()

    def visit(g: onnx.GraphProto) -> None:
        for node in g.node:
            skipped = ROW_READ_INPUTS.get(node.op_type, set())
            for index, name in enumerate(node.input):
                if name in sizes and node.op_type not in GATHERING_OPS and index not in skipped:
                    read.add(name)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g)

    visit(graph)
    return sum(sizes[name] for name in read)
