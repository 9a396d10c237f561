"""The gated delta rule over a prompt in chunks, in standard ONNX operators (the plain graph's prefill).

Per token the rule reads and rewrites each head's whole (dk x dv) state: a ``Scan`` over a 128-token prompt runs
seven nodes per token per layer over 16 such states, which made the plain Qwen3.5 graph's prefill 1.33x the
builder's (README, "Hybrid models: speed"). transformers' ``torch_chunk_gated_delta_rule`` computes the same outputs
and state in chunks of C = 64 tokens: within a chunk, matrix products (C x C per head); across chunks, one state
update each. Per chunk and value head, with q scaled by dk^-0.5, k_beta = beta k, v_beta = beta v and the log decay
g summed within the chunk (cum):

  decay[i, j]  exp(cum_i - cum_j) for j <= i, else 0
  N            I + strictly_lower((k_beta k^T) * decay): the delta rule's writes within the chunk as one system
  u, w         N^-1 v_beta, N^-1 (k_beta exp(cum))   (transformers: solve_triangular, unit lower triangular)
  per chunk    v' = u - w S;  out = (q exp(cum)) S + ((q k^T) * decay) v';  S = exp(cum_C) S + (k exp(cum_C - cum))^T v'

ONNX has no triangular solve. N^-1 is built by recursive 2 x 2 blocks: a unit lower triangular matrix
[[A, 0], [-L21, D]] has the inverse [[A^-1, 0], [D^-1 L21 A^-1, D^-1]], so log2(C) levels of batched products
double the inverted diagonal blocks from 2 x 2 to C x C. Its intermediates are sub-inverses of N, never powers of
its lower part (a Neumann product would square entries up to binomial sizes when keys align): in float32 it matches
torch's solve_triangular to 2e-7 even for keys at cosine 0.999 (docs/hybrid-export.md 7).

Padding needs nothing more: a masked position's beta and g are zero (the caller's rule), so its row of N is the
identity's, its v' is zero and the state passes it unchanged; the prompt is padded at its end to a multiple of C
with such positions, whose outputs are cut off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from onnx import TensorProto

from .graph_builder import GraphBuilder, value_info

CHUNK = 64  # transformers' chunk_size


class DeltaRuleInputs(NamedTuple):
    """The values the gated delta rule reads, by name: query, key and value rows, the log decay g and beta."""

    query: str
    key: str
    value: str
    log_decay: str
    beta: str


def emit_chunked_delta_rule(
    b: GraphBuilder, dims: tuple[int, int, int], rule: DeltaRuleInputs, past: str, present: str
) -> str:
    """The rule over (B, Hv, T, d) float32 rows (q already scaled) and gates (B, Hv, T), ``dims`` (Hv, dk, dv);
    returns (B, Hv, T, dv) and writes ``present`` (B, Hv, dk, dv) from ``past``."""
    heads, key_dim, value_dim = dims
    query, key, value, log_decay, beta = rule
    length = b.op("Gather", b.op("Shape", query), b.const(2), axis=0)
    pad = b.op("Mod", b.op("Sub", b.const(CHUNK), b.op("Mod", length, b.const(CHUNK))), b.const(CHUNK))
    row_pads = b.op("Concat", b.const([0, 0, 0, 0, 0, 0]), b.op("Unsqueeze", pad, b.const([0])), b.const([0]), axis=0)
    gate_pads = b.op("Concat", b.const([0, 0, 0, 0, 0]), b.op("Unsqueeze", pad, b.const([0])), axis=0)

    def chunked_rows(x: str, width: int) -> str:  # (B, Hv, T, d) -> (B, Hv, n, C, d), zeros after the prompt
        return b.op("Reshape", b.op("Pad", x, row_pads), b.const([0, 0, -1, CHUNK, width]))

    def chunked_gate(x: str) -> str:  # (B, Hv, T) -> (B, Hv, n, C)
        return b.op("Reshape", b.op("Pad", x, gate_pads), b.const([0, 0, -1, CHUNK]))

    q, k, v = chunked_rows(query, key_dim), chunked_rows(key, key_dim), chunked_rows(value, value_dim)
    beta = b.op("Unsqueeze", chunked_gate(beta), b.const([-1]))  # (B, Hv, n, C, 1)
    cum = b.op("CumSum", chunked_gate(log_decay), b.const(-1))  # (B, Hv, n, C)
    upper = b.const(torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1).tolist(), torch.bool)
    pairwise = b.op("Sub", b.op("Unsqueeze", cum, b.const([-1])), b.op("Unsqueeze", cum, b.const([-2])))
    decay = b.op("Exp", b.op("Where", upper, b.const(float("-inf"), torch.float32), pairwise))  # (.., C, C)
    k_beta, v_beta = b.op("Mul", k, beta), b.op("Mul", v, beta)
    k_t = b.op("Transpose", k, perm=[0, 1, 2, 4, 3])  # (B, Hv, n, dk, C)
    inverse = emit_unit_lower_inverse(b, k_beta, k, cum, key_dim)
    exp_cum = b.op("Exp", b.op("Unsqueeze", cum, b.const([-1])))  # (B, Hv, n, C, 1)
    new_values = b.op("MatMul", inverse, v_beta)
    read_keys = b.op("MatMul", inverse, b.op("Mul", k_beta, exp_cum))
    intra = b.op("Mul", b.op("MatMul", q, k_t), decay)
    decayed_q = b.op("Mul", q, exp_cum)
    last = b.op("Slice", cum, b.const([-1]), b.const([CHUNK]), b.const([-1]))  # (B, Hv, n, 1)
    write_keys = b.op("Mul", k, b.op("Exp", b.op("Unsqueeze", b.op("Sub", last, cum), b.const([-1]))))
    write_keys = b.op("Transpose", write_keys, perm=[0, 1, 2, 4, 3])  # (B, Hv, n, dk, C)
    chunk_decay = b.op("Exp", b.op("Unsqueeze", last, b.const([-1])))  # (B, Hv, n, 1, 1)

    body = b.subgraph()
    with body.scope("chunk"):
        names = {n: body.fresh(n) for n in ("state", "u", "w", "q", "attn", "kw", "decay")}
        state, u, w = names["state"], names["u"], names["w"]
        v_new = body.op("Sub", u, body.op("MatMul", w, state))
        out = body.op("Add", body.op("MatMul", names["q"], state), body.op("MatMul", names["attn"], v_new))
        state_out = body.fresh("state_out")
        body.op_to("Add", [body.op("Mul", state, names["decay"]), body.op("MatMul", names["kw"], v_new)], [state_out])
    float32 = TensorProto.FLOAT
    shapes = {
        "state": [key_dim, value_dim], "u": [CHUNK, value_dim], "w": [CHUNK, key_dim], "q": [CHUNK, key_dim],
        "attn": [CHUNK, CHUNK], "kw": [key_dim, CHUNK], "decay": [1, 1],
    }  # fmt: skip
    graph = body.make_graph(
        "gated_delta_chunk",
        [value_info(names[n], float32, [None, heads, *shape]) for n, shape in shapes.items()],
        [
            value_info(state_out, float32, [None, heads, key_dim, value_dim]),
            value_info(out, float32, [None, heads, CHUNK, value_dim]),
        ],
    )
    outputs = b.fresh("outputs")
    scanned = [new_values, read_keys, decayed_q, intra, write_keys, chunk_decay]
    b.op_to(
        "Scan", [past, *scanned], [present, outputs], body=graph, num_scan_inputs=len(scanned),
        scan_input_axes=[2] * len(scanned), scan_output_axes=[2],
    )  # fmt: skip
    out = b.op("Reshape", outputs, b.const([0, 0, -1, value_dim]))  # (B, Hv, n * C, dv)
    return b.op("Slice", out, b.const([0]), b.op("Unsqueeze", length, b.const([0])), b.const([2]))


def emit_unit_lower_inverse(b: GraphBuilder, k_beta: str, k: str, cum: str, key_dim: int) -> str:
    """N^-1 for each chunk's N = I + strictly_lower((k_beta k^T) * decay), (B, Hv, n, C, C), by recursive 2 x 2
    blocks: the inverse's diagonal blocks of size m, (.., C / m, m, m), paired into blocks of 2m, log2(C) times. A
    pair's lower-left block of N is -L21 = (k_beta of the second half) (k of the first)^T * exp(cum_i - cum_j),
    computed as such (every i after every j: no mask, no overflow) rather than cut out of a C x C matrix."""

    def halves(x: str, size: int, width: int) -> tuple[str, str]:  # (.., C, width) -> each 2m-block's two halves
        pairs = b.op("Reshape", x, b.const([0, 0, 0, CHUNK // (2 * size), 2, size, width]))
        return b.op("Gather", pairs, b.const(0), axis=-3), b.op("Gather", pairs, b.const(1), axis=-3)

    last_two = [0, 1, 2, 3, 5, 4]
    inverse = b.op(
        "Expand", b.const([[1.0]], torch.float32), b.op("Concat", b.op("Shape", cum), b.const([1, 1]), axis=0)
    )
    cum = b.op("Unsqueeze", cum, b.const([-1]))  # (.., C, 1)
    size = 1
    while size < CHUNK:
        _, second_keys = halves(k_beta, size, key_dim)
        first_keys, _ = halves(k, size, key_dim)
        first_cum, second_cum = halves(cum, size, 1)
        decay = b.op("Exp", b.op("Sub", second_cum, b.op("Transpose", first_cum, perm=last_two)))
        below = b.op("Mul", b.op("MatMul", second_keys, b.op("Transpose", first_keys, perm=last_two)), decay)
        first, second = halves(inverse, size, size)  # A^-1, D^-1: (.., C / 2m, m, m)
        corner = b.op("Neg", b.op("MatMul", b.op("MatMul", second, below), first))  # D^-1 L21 A^-1, L21 = -below
        zeros = b.op("Expand", b.const(torch.zeros(size, size).tolist(), torch.float32), b.op("Shape", first))
        top = b.op("Concat", first, zeros, axis=-1)
        bottom = b.op("Concat", corner, second, axis=-1)
        inverse = b.op("Concat", top, bottom, axis=-2)  # (.., C / 2m, 2m, 2m)
        size *= 2
    return b.op("Reshape", inverse, b.const([0, 0, 0, CHUNK, CHUNK]))
