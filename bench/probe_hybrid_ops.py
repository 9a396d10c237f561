"""Which of onnxruntime's linear-attention operators run here, and whether they compute what transformers does.

Each operator gets a one-node graph with small random inputs, run on the chosen execution provider; where it runs,
its outputs are compared with transformers' torch fallbacks for Qwen3.5 / Qwen3-Next (modeling_qwen3_5.py):
``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule`` (150 tokens: three 64-token chunks),
``causal_conv1d_fn`` / ``causal_conv1d_update``, ``Qwen3_5RMSNormGated``, ``Qwen3_5TextRotaryEmbedding``. The figures
in docs/hybrid-export.md come from this script.

    python bench/probe_hybrid_ops.py                  # CPU
    python bench/probe_hybrid_ops.py --provider cuda  # on a machine with a GPU

Opset-27 (ai.onnx) models load only with ALLOW_RELEASED_ONNX_OPSET_ONLY=0 in the environment (onnxruntime 1.31
refuses unreleased opsets by default); the script says so when they are refused.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
    causal_conv1d_fn,
    causal_conv1d_update,
    l2norm,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def run_node(node, feeds: dict[str, np.ndarray], provider: str, default_opset: int = 21) -> list[np.ndarray]:
    types = {np.dtype(np.float32): FLOAT, np.dtype(np.int64): INT64, np.dtype(np.int32): INT32}
    # Static input shapes: onnxruntime expands the opset-27 operators as functions, which need them.
    inputs = [helper.make_tensor_value_info(n, types[v.dtype], list(v.shape)) for n, v in feeds.items()]
    outputs = [helper.make_tensor_value_info(n, FLOAT, None) for n in node.output]
    graph = helper.make_graph([node], "probe", inputs, outputs)
    opsets = [helper.make_opsetid("", default_opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10 if default_opset <= 21 else 11)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[PROVIDERS[provider]])
    if PROVIDERS[provider] not in session.get_providers():
        raise RuntimeError(f"{provider} execution provider did not start")
    return session.run(None, feeds)


def relative(reference: torch.Tensor, candidate: np.ndarray) -> str:
    reference = reference.detach().float().numpy()
    return f"max |Δ| / max |ref| = {np.abs(reference - candidate).max() / np.abs(reference).max():.1e}"


def delta_rule_cases(generator: torch.Generator):
    """q, k at 2 key heads, v at 4 value heads (two per key head), dk 16 != dv 8, 150 tokens, a non-zero state."""
    b, t, hk, hv, dk, dv = 2, 150, 2, 4, 16, 8
    q, k = torch.randn(b, t, hk, dk, generator=generator), torch.randn(b, t, hk, dk, generator=generator)
    v = torch.randn(b, t, hv, dv, generator=generator)
    g = -2 * torch.rand(b, t, hv, generator=generator)
    beta = torch.rand(b, t, hv, generator=generator)
    state = 0.3 * torch.randn(b, hv, dk, dv, generator=generator)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    recurrent = torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    chunked = torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    feeds = {
        "query": l2norm(q).reshape(b, t, -1).numpy(),
        "key": l2norm(k).reshape(b, t, -1).numpy(),
        "value": v.reshape(b, t, -1).numpy(),
        "past_state": state.numpy(),
        "decay": g.numpy(),
        "beta": beta.numpy(),
    }
    return (hk, hv, dk), feeds, recurrent, chunked


def probe_linear_attention(provider: str, generator: torch.Generator) -> None:
    (hk, hv, dk), feeds, recurrent, chunked = delta_rule_cases(generator)
    b, t = feeds["query"].shape[:2]

    def at_value_heads(x: np.ndarray) -> np.ndarray:  # each key head repeated for its value heads
        return np.repeat(x.reshape(b, t, hk, dk), hv // hk, axis=2).reshape(b, t, hv * dk)

    repeated = {**feeds, "query": at_value_heads(feeds["query"]), "key": at_value_heads(feeds["key"])}
    cases = [
        ("com.microsoft", 21, hk, feeds, "q and k at the key heads"),
        ("com.microsoft", 21, hv, repeated, "q and k repeated to the value heads"),
        ("", 27, hk, feeds, "q and k at the key heads"),
        ("", 27, hv, repeated, "q and k repeated to the value heads"),
    ]
    for domain, opset, q_heads, case_feeds, layout in cases:
        node = helper.make_node(
            "LinearAttention",
            list(case_feeds),
            ["output", "present_state"],
            domain=domain,
            q_num_heads=q_heads,
            kv_num_heads=hv,
            update_rule="gated_delta",
            scale=dk**-0.5,
        )
        label = f"LinearAttention ({domain or 'ai.onnx opset 27'}), {layout}"
        try:
            out, state = run_node(node, case_feeds, provider, opset)
        except Exception as err:
            print(f"{label}: does not run: {str(err).splitlines()[0][:300]}")
            continue
        out = out.reshape(recurrent[0].shape)
        print(f"{label}: runs; output vs recurrent {relative(recurrent[0], out)}")
        print(f"    vs chunked {relative(chunked[0], out)}; final state vs recurrent {relative(recurrent[1], state)}")


def probe_gated_delta_net(provider: str, generator: torch.Generator) -> None:
    (hk, hv, dk), feeds, recurrent, _ = delta_rule_cases(generator)
    b, t = feeds["query"].shape[:2]
    packed = {
        "query": feeds["query"].reshape(b * t, hk, dk),
        "key": feeds["key"].reshape(b * t, hk, dk),
        "value": feeds["value"].reshape(b * t, hv, -1),
        "decay": feeds["decay"].reshape(b * t, hv),
        "beta": feeds["beta"].reshape(b * t, hv),
        "initial_state": np.ascontiguousarray(feeds["past_state"].transpose(0, 1, 3, 2)),  # value-major
    }
    node = helper.make_node(
        "GatedDeltaNet",
        ["query", "key", "value", "", "decay", "beta", "initial_state"],
        ["output", "final_state"],
        domain="com.microsoft",
    )
    try:
        out, state = run_node(node, packed, provider)
    except Exception as err:
        print(f"GatedDeltaNet (com.microsoft): does not run: {str(err).splitlines()[0][:300]}")
        return
    out = out.reshape(recurrent[0].shape)
    print(f"GatedDeltaNet (com.microsoft): runs; output vs recurrent {relative(recurrent[0], out)}")


def probe_causal_conv(provider: str, generator: torch.Generator) -> None:
    b, channels, kernel = 2, 24, 4
    weight = torch.randn(channels, kernel, generator=generator)
    for domain, opset in (("com.microsoft", 21), ("", 27)):
        label = f"CausalConvWithState ({domain or 'ai.onnx opset 27'})"
        node = helper.make_node(
            "CausalConvWithState", ["x", "w", "", "s"], ["y", "state"], domain=domain, activation="silu"
        )
        for seq in (1, 3, 150):
            x = torch.randn(b, channels, seq, generator=generator)
            past = torch.randn(b, channels, kernel, generator=generator)  # transformers' cache: k columns
            window = torch.cat([past, x], dim=-1)
            reference = causal_conv1d_fn(window, weight, None, activation="silu")[..., -seq:]
            feeds = {"x": x.numpy(), "w": weight[:, None].numpy(), "s": past[..., 1:].numpy()}
            try:
                y, state = run_node(node, feeds, provider, opset)
            except Exception as err:
                print(f"{label}: does not run: {str(err).splitlines()[0][:300]}")
                break
            line = f"{label}, T={seq}: runs; vs causal_conv1d_fn {relative(reference, y)}"
            line += f"; state == last k - 1 inputs: {np.array_equal(state, window[..., -(kernel - 1) :].numpy())}"
            if seq == 1:
                updated = causal_conv1d_update(x.clone(), past.clone(), weight, None, "silu")
                line += f"; vs causal_conv1d_update {relative(updated, y)}"
            print(line)


def probe_gates_and_norm(provider: str, generator: torch.Generator) -> None:
    b, t, heads, dv = 2, 7, 4, 8
    a, write = 5 * torch.randn(b, t, heads, generator=generator), torch.randn(b, t, heads, generator=generator)
    dt_bias, a_log = torch.randn(heads, generator=generator), torch.randn(heads, generator=generator)
    node = helper.make_node(
        "LinearAttentionGate", ["a", "dt_bias", "scale", "b"], ["decay", "beta"], domain="com.microsoft"
    )
    feeds = {"a": a.numpy(), "dt_bias": dt_bias.numpy(), "scale": (-a_log.exp()).numpy(), "b": write.numpy()}
    try:
        decay, beta = run_node(node, feeds, provider)
        reference = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        print(f"LinearAttentionGate: runs; decay {relative(reference, decay)}, beta {relative(write.sigmoid(), beta)}")
    except Exception as err:
        print(f"LinearAttentionGate: does not run: {str(err).splitlines()[0][:300]}")

    x, z = torch.randn(b, t, heads * dv, generator=generator), torch.randn(b, t, heads * dv, generator=generator)
    norm = Qwen3_5RMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dv, generator=generator))
    reference = norm(x.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, t, -1)
    node = helper.make_node("GatedRMSNorm", ["x", "w", "z"], ["y"], domain="com.microsoft", activation="silu")
    node.attribute.append(helper.make_attribute("epsilon", 1e-6))
    try:
        (y,) = run_node(node, {"x": x.numpy(), "w": norm.weight.detach().numpy(), "z": z.numpy()}, provider)
        print(f"GatedRMSNorm: runs; vs Qwen3_5RMSNormGated {relative(reference, y)}")
    except Exception as err:
        print(f"GatedRMSNorm: does not run: {str(err).splitlines()[0][:300]}")


def probe_mrope(provider: str, generator: torch.Generator) -> None:
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}
    config = Qwen3_5TextConfig(head_dim=32, num_attention_heads=2, max_position_embeddings=64, rope_parameters=rope)
    rotary = Qwen3_5TextRotaryEmbedding(config)
    b, heads, t, hd = 2, 2, 9, 32
    positions = torch.randint(0, 64, (3, b, t), generator=generator)
    x = torch.randn(b, heads, t, hd, generator=generator)
    cos, sin = rotary(x, positions)
    reference, _ = apply_rotary_pos_emb(x, x, cos, sin)
    freqs = torch.arange(64).float()[:, None] * rotary.inv_freq[None]
    node = helper.make_node(
        "MRotaryEmbedding",
        ["x", "positions", "cos", "sin"],
        ["y"],
        domain="com.microsoft",
        mrope_section=[2, 1, 1],
        mrope_layout=1,
        num_heads=heads,
        rotary_embedding_dim=8,
    )
    feeds = {
        "x": x.transpose(1, 2).reshape(b, t, -1).numpy(),
        "positions": positions.numpy(),
        "cos": freqs.cos().numpy(),
        "sin": freqs.sin().numpy(),
    }
    try:
        (y,) = run_node(node, feeds, provider)
        y = y.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
        print(f"MRotaryEmbedding (interleaved, partial): runs; vs apply_rotary_pos_emb {relative(reference, y)}")
    except Exception as err:
        print(f"MRotaryEmbedding: does not run: {str(err).splitlines()[0][:300]}")


def gqa_output_gate() -> None:
    """GroupQueryAttention's schema, searched for anything that gates the output."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    schema = next(s for s in ort_c.get_all_operator_schema() if s.name == "GroupQueryAttention")
    names = [i.name for i in schema.inputs] + list(schema.attributes)
    gates = [n for n in names if "gate" in n.lower()]
    print(f"GroupQueryAttention (com.microsoft): inputs and attributes naming a gate: {gates or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=list(PROVIDERS), default="cpu")
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__} ({args.provider}); ALLOW_RELEASED_ONNX_OPSET_ONLY=", end="")
    print(os.environ.get("ALLOW_RELEASED_ONNX_OPSET_ONLY", "unset"))
    generator = torch.Generator().manual_seed(0)
    probe_linear_attention(args.provider, generator)
    probe_gated_delta_net(args.provider, generator)
    probe_causal_conv(args.provider, generator)
    probe_gates_and_norm(args.provider, generator)
    probe_mrope(args.provider, generator)
    gqa_output_gate()


if __name__ == "__main__":
    main()
