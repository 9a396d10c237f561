"""The hybrid family's graph pieces, each exported alone and run by onnxruntime (CPU) against transformers' own
modules: Gated DeltaNet (plain and fused forms) with its carried state through prefill and decode on a left-padded
batch, interleaved mRoPE tables, and the gated full attention of Qwen3.5 and Qwen3-Next."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from seeded_weights import randomize_parameters
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

from export.decoder_graph import make_model
from export.graph_builder import GraphBuilder, WeightFile, value_info
from export.hybrid_attention_graph import (
    emit_mrotary_embedding,
    emit_output_gate,
    emit_partial_rotary,
    emit_query_and_gate,
    emit_rotary_cos_sin,
    emit_zero_centered_rms_norm,
    mrope_stream_selector,
    zero_centered_scale,
)
from export.layer_models import PAST_STATES, PRESENT_STATES, write_gated_deltanet_model
from export.linear_attention_graph import FusedGatedDeltaNetGraph, GatedDeltaNetDims, GatedDeltaNetGraph

# max |Δ| allowed, relative to the reference's largest magnitude, in float32
RELATIVE_TOLERANCE = 1e-5
FLOAT16_TOLERANCE = 2e-2
FORMS = {"plain": GatedDeltaNetGraph, "fused": FusedGatedDeltaNetGraph}
DECODE_STEPS = 6


# --- building and running one exported piece ------------------------------------------------------------------
def cpu_session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def save_and_load(b: GraphBuilder, weights: WeightFile, folder: Path, inputs, outputs, contrib_ops: bool):
    """The builder's graph as ``folder/piece.onnx`` (checked by onnx where it uses standard operators only) in an
    onnxruntime CPU session."""
    weights.close()
    path = folder / "piece.onnx"
    onnx.save(make_model(b.make_graph("piece", inputs, outputs), {}, contrib_ops=contrib_ops), str(path))
    if not contrib_ops:
        onnx.checker.check_model(str(path), full_check=True)
    return cpu_session(path)


def new_builder(folder: Path) -> tuple[GraphBuilder, WeightFile]:
    weights = WeightFile(folder / "piece.onnx.data")
    return GraphBuilder(weights), weights


def relative_error(reference: torch.Tensor | np.ndarray, candidate: np.ndarray) -> float:
    reference = np.asarray(reference, dtype=np.float64)
    return float(np.abs(reference - candidate).max() / max(np.abs(reference).max(), 1e-30))


# --- Gated DeltaNet -------------------------------------------------------------------------------------------
def linear_config(**overrides) -> Qwen3_5TextConfig:
    """Two key heads serving four value heads, key head dim != value head dim, kernel 4."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    return Qwen3_5TextConfig(**{**fields, **overrides})


def gated_deltanet(config: Qwen3_5TextConfig, seed: int = 0) -> Qwen3_5GatedDeltaNet:
    """The transformers module with seeded weights; decay rates spread from slow (the state carries over the whole
    150-token prompt) to fast, and dt_bias of both signs, so that a wrong gate cannot hide."""
    module = randomize_parameters(Qwen3_5GatedDeltaNet(config, layer_idx=0), seed).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        heads = config.linear_num_value_heads
        module.A_log.copy_(torch.linspace(-4.0, 1.0, heads)[torch.randperm(heads, generator=generator)])
        module.dt_bias.copy_(torch.randn(heads, generator=generator))
    return module


def export_gated_deltanet(module: Qwen3_5GatedDeltaNet, config, graph_class, folder: Path) -> ort.InferenceSession:
    """One layer as a model: hidden_states, attention_mask and the two states in; output and new states out."""
    dims = GatedDeltaNetDims.from_config(config)
    path = write_gated_deltanet_model(folder, dims, dict(module.named_parameters()), graph_class=graph_class)
    if not graph_class.contrib_ops:
        onnx.checker.check_model(str(path), full_check=True)
    return cpu_session(path)


class OnnxLayer:
    """The exported layer's state carried from step to step, zeros to start."""

    def __init__(self, session: ort.InferenceSession, dims: GatedDeltaNetDims, batch: int, dtype=np.float32) -> None:
        self.session = session
        self.states = [
            np.zeros(dims.conv_state_shape(batch), dtype),  # the model dtype
            np.zeros(dims.recurrent_state_shape(batch), np.float32),  # float32 always
        ]
        self.mask = np.zeros((batch, 0), np.int64)

    def step(self, hidden: torch.Tensor, new_mask: np.ndarray) -> np.ndarray:
        self.mask = np.concatenate([self.mask, new_mask], axis=1)
        feeds = {
            "hidden_states": hidden.numpy().astype(self.states[0].dtype),
            "attention_mask": self.mask,
            **dict(zip(PAST_STATES, self.states, strict=True)),
        }
        out, *self.states = self.session.run(["output", *PRESENT_STATES], feeds)
        return out


class TorchLayer:
    """The transformers module through a transformers cache, fed the 2-D mask as Qwen3_5TextModel feeds it
    (create_recurrent_attention_mask: the new positions' columns, none for a single token)."""

    def __init__(self, module: Qwen3_5GatedDeltaNet, config) -> None:
        self.module = module
        self.cache = DynamicCache(config=config)

    @torch.no_grad()
    def step(self, hidden: torch.Tensor, new_mask: np.ndarray | None = None) -> torch.Tensor:
        mask = None if new_mask is None or hidden.shape[1] == 1 else torch.from_numpy(new_mask)
        return self.module(hidden, self.cache, mask)  # by position: transformers 5.24 renamed cache_params

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv state as ours keeps it (transformers' cache holds one more, never read, column)."""
        return self.cache.get_conv_state(0)[..., 1:], self.cache.get_recurrent_state(0)


def run_left_padded_batch(
    session, module, config, lengths: tuple[int, int], seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """Prefill of a left-padded batch of two, then DECODE_STEPS one-token steps carrying the states, in
    onnxruntime and in transformers (batched, and each row alone without padding), ``module`` and the graph in
    ``dtype``. Returns the relative errors, over kept positions only (padding outputs mean nothing)."""
    dims = GatedDeltaNetDims.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    prompt = torch.randn(2, width, dims.hidden_size, generator=generator).to(dtype)
    mask = np.zeros((2, width), np.int64)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    tokens = [torch.randn(2, 1, dims.hidden_size, generator=generator).to(dtype) for _ in range(DECODE_STEPS)]

    numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
    onnx_layer, batched = OnnxLayer(session, dims, 2, numpy_dtype), TorchLayer(module, config)
    alone = [TorchLayer(module, config) for _ in lengths]
    errors: dict[str, float] = {}

    def compare(name: str, reference, candidate) -> None:
        errors[name] = max(errors.get(name, 0.0), relative_error(reference, candidate))

    ours = onnx_layer.step(prompt, mask)
    reference = batched.step(prompt, mask)
    kept = mask.astype(bool)
    compare("prefill vs batched", reference.float().numpy()[kept], ours[kept])
    for row, length in enumerate(lengths):
        own = alone[row].step(prompt[row : row + 1, width - length :])
        compare("prefill vs row alone", own.float().numpy()[0], ours[row, width - length :])
    for token in tokens:
        ours = onnx_layer.step(token, np.ones((2, 1), np.int64))
        compare("decode vs batched", batched.step(token).float().numpy(), ours)
        for row in range(2):
            own = alone[row].step(token[row : row + 1])
            compare("decode vs row alone", own.float().numpy(), ours[row : row + 1])
    for kind, reference, candidate in zip(
        ("conv state", "recurrent state"), batched.states(), onnx_layer.states, strict=True
    ):
        compare(f"{kind} vs batched", reference.float().numpy(), candidate)
        for row in range(2):
            own = alone[row].states()[kind == "recurrent state"]
            compare(f"{kind} vs row alone", own.float().numpy()[0], candidate[row])
    return errors


@pytest.mark.parametrize("lengths", [(3, 1), (150, 131)], ids=["short", "long"])
@pytest.mark.parametrize("form", list(FORMS))
def test_gated_deltanet_matches_transformers(form, lengths, tmp_path):
    """Prefill shorter than the conv kernel (one row a single token) and longer than one 64-token chunk of
    transformers' chunked delta rule, then decode, left-padded: every output and state within tolerance."""
    config = linear_config()
    module = gated_deltanet(config)
    session = export_gated_deltanet(module, config, FORMS[form], tmp_path)
    errors = run_left_padded_batch(session, module, config, lengths)
    assert max(errors.values()) <= RELATIVE_TOLERANCE, errors


@pytest.mark.parametrize("form", list(FORMS))
def test_gated_deltanet_multi_token_step_after_state(form, tmp_path):
    """A multi-token step on a non-empty state (chunked prefill) and decode after it: the same graph."""
    config = linear_config(linear_num_key_heads=1, linear_num_value_heads=3)  # three value heads on one key head
    module = gated_deltanet(config, seed=3)
    session = export_gated_deltanet(module, config, FORMS[form], tmp_path)
    dims = GatedDeltaNetDims.from_config(config)
    generator = torch.Generator().manual_seed(5)
    onnx_layer, torch_layer = OnnxLayer(session, dims, 1), TorchLayer(module, config)
    for length in (70, 9, 1, 2, 1):
        hidden = torch.randn(1, length, dims.hidden_size, generator=generator)
        ours = onnx_layer.step(hidden, np.ones((1, length), np.int64))
        assert relative_error(torch_layer.step(hidden).numpy(), ours) <= RELATIVE_TOLERANCE
    for reference, candidate in zip(torch_layer.states(), onnx_layer.states, strict=True):
        assert relative_error(reference.numpy(), candidate) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("form", list(FORMS))
def test_gated_deltanet_float16(form, tmp_path):
    """float16 graph (conv state float16, recurrence and its state float32) against the float16 transformers
    module, within the exporter's float16 tolerance (export/verify.py)."""
    config = linear_config()
    module = gated_deltanet(config)
    dims = GatedDeltaNetDims.from_config(config)
    params = dict(module.named_parameters())
    path = write_gated_deltanet_model(tmp_path, dims, params, dtype=torch.float16, graph_class=FORMS[form])
    errors = run_left_padded_batch(cpu_session(path), module.half(), config, (70, 41), dtype=torch.float16)
    assert max(errors.values()) <= FLOAT16_TOLERANCE, errors


class WithoutL2Norm(GatedDeltaNetGraph):
    def emit_l2norm(self, x: str, heads: int, head_dim: int) -> str:
        return x


class WithoutDecay(GatedDeltaNetGraph):
    def emit_gates(self, step: str, write: str, prefix: str) -> tuple[str, str]:
        log_decay, beta = super().emit_gates(step, write, prefix)
        return self.b.op("Mul", log_decay, self.b.const(0.0, torch.float32)), beta


class TiledHeads(GatedDeltaNetGraph):
    """Key head h % Hk for value head h (torch's repeat) instead of h // (Hv / Hk) (repeat_interleave)."""

    def per_value_head(self, x: str) -> str:
        b, d = self.b, self.dims
        x = b.op("Reshape", x, b.const([0, 0, 1, d.num_key_heads, d.key_head_dim]))
        x = b.op("Expand", x, b.const([1, 1, d.value_heads_per_key_head, 1, 1]))
        return b.op("Reshape", x, b.const([0, 0, d.num_value_heads, 1, d.key_head_dim]))


@pytest.mark.parametrize("planted", [WithoutL2Norm, WithoutDecay, TiledHeads], ids=lambda c: c.__name__)
def test_planted_bug_is_caught(planted, tmp_path):
    """The comparison above has teeth: each plausible mistake fails it by orders of magnitude."""
    config = linear_config()
    module = gated_deltanet(config)
    errors = run_left_padded_batch(export_gated_deltanet(module, config, planted, tmp_path), module, config, (9, 6))
    assert max(errors.values()) > 100 * RELATIVE_TOLERANCE, errors


# --- interleaved mRoPE ----------------------------------------------------------------------------------------
def mrope_config(**overrides) -> Qwen3_5TextConfig:
    """head_dim 32 with partial rotary 0.25: 8 rotating channels, 4 frequencies split [2, 1, 1] over t, h, w."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    fields = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    return Qwen3_5TextConfig(**{**fields, **overrides})


def vision_language_positions() -> torch.Tensor:
    """(3, 2, 14) positions as Qwen3.5's get_rope_index lays them out: text, then a 2 x 3 image grid (one
    temporal step, height and width counting from the text position), then text after the grid's largest
    position. Row 1 starts deep into the context (near the end of the tables)."""
    text = torch.arange(5)
    grid_h, grid_w = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    image = torch.stack([torch.full((6,), 5), 5 + grid_h.flatten(), 5 + grid_w.flatten()])
    after = 8 + torch.arange(3)
    row = torch.cat([text.expand(3, -1), image, after.expand(3, -1)], dim=1)  # (3, 14)
    return torch.stack([row, row + 490], dim=1)  # (3, 2, 14)


def rope_tables(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * inv_freq`` for every position, (max_positions, rotary_dim / 2), computed as the
    reference rotary embeddings compute them (float32 product, cos/sin, scaling, then the model dtype)."""
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    return (freqs.cos() * attention_scaling).to(dtype), (freqs.sin() * attention_scaling).to(dtype)


@pytest.mark.parametrize("form", ["plain", "fused"])
def test_mrope_matches_qwen3_5_rotary_embedding(form, tmp_path):
    config = mrope_config()
    rotary = Qwen3_5TextRotaryEmbedding(config)
    positions = vision_language_positions()
    heads, head_dim = config.num_attention_heads, config.head_dim
    rotary_dim = int(head_dim * config.rope_parameters["partial_rotary_factor"])
    x = torch.randn(2, heads, positions.shape[-1], head_dim, generator=torch.Generator().manual_seed(0))

    b, weights = new_builder(tmp_path)
    cos_table, sin_table = rope_tables(rotary.inv_freq, rotary.attention_scaling, 512, torch.float32)
    cos_name, sin_name = b.weight("cos_table", cos_table), b.weight("sin_table", sin_table)
    section = config.rope_parameters["mrope_section"]
    if form == "plain":
        selector = b.weight("mrope_selector", mrope_stream_selector(section, rotary_dim // 2))
        cos, sin = emit_rotary_cos_sin(b, "position_ids", cos_name, sin_name, torch.float32, selector)
        b.op_to("Squeeze", [cos, b.const([1])], ["cos"])
        b.op_to("Squeeze", [sin, b.const([1])], ["sin"])
        b.op_to("Identity", [emit_partial_rotary(b, "x", cos, sin, rotary_dim, head_dim)], ["rotated"])
        out_names = ["cos", "sin", "rotated"]
    else:
        packed = b.op("Reshape", b.op("Transpose", "x", perm=[0, 2, 1, 3]), b.const([0, 0, heads * head_dim]))
        rotated = emit_mrotary_embedding(b, packed, "position_ids", cos_name, sin_name, heads, rotary_dim, section)
        rotated = b.op("Reshape", rotated, b.const([0, 0, heads, head_dim]))
        b.op_to("Transpose", [rotated], ["rotated"], perm=[0, 2, 1, 3])
        out_names = ["rotated"]
    f32 = TensorProto.FLOAT
    inputs = [
        value_info("x", f32, [2, heads, None, head_dim]),
        value_info("position_ids", TensorProto.INT64, [3, 2, None]),
    ]
    outputs = [
        value_info(n, f32, [2, None, rotary_dim] if n in ("cos", "sin") else [2, heads, None, head_dim])
        for n in out_names
    ]
    session = save_and_load(b, weights, tmp_path, inputs, outputs, form == "fused")
    results = session.run(out_names, {"x": x.numpy(), "position_ids": positions.numpy()})
    results = dict(zip(out_names, results, strict=True))

    cos, sin = rotary(x, positions)  # (B, T, rotary_dim)
    reference, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert relative_error(reference, results["rotated"]) <= RELATIVE_TOLERANCE
    if form == "plain":  # the tables are gathered, not recomputed: bit for bit
        np.testing.assert_array_equal(results["cos"], cos.numpy())
        np.testing.assert_array_equal(results["sin"], sin.numpy())


def test_mrope_selector_follows_the_interleaved_layout():
    """Frequency i: height when i % 3 == 1 below 3 * section[1], width when i % 3 == 2 below 3 * section[2]."""
    streams = mrope_stream_selector([11, 11, 10], 32).reshape(3, 32).argmax(0).tolist()
    assert streams[:33] == [0, 1, 2] * 10 + [0, 1]
    with pytest.raises(ValueError, match="summing to"):
        mrope_stream_selector([11, 11, 11], 32)


# --- gated full attention -------------------------------------------------------------------------------------
def causal_attention(b: GraphBuilder, q: str, k: str, v: str, num_heads: int, num_kv_heads: int, head_dim: int):
    """Softmax attention over the prompt for the test graph: (B, H, T, hd) q, (B, Hkv, T, hd) k, v. The cache and
    the padding mask are the decoder graph's business (export/decoder_graph.py), unchanged by these models."""
    groups = num_heads // num_kv_heads
    k = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", k, b.const([2])), b.const([1, 1, groups, 1, 1])),
             b.const([0, num_heads, -1, head_dim]))  # fmt: skip
    v = b.op("Reshape", b.op("Expand", b.op("Unsqueeze", v, b.const([2])), b.const([1, 1, groups, 1, 1])),
             b.const([0, num_heads, -1, head_dim]))  # fmt: skip
    scores = b.op(
        "Mul", b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2])), b.const(head_dim**-0.5, torch.float32)
    )
    seq = b.op("Shape", q, start=2, end=3)
    ones = b.op("ConstantOfShape", b.op("Concat", seq, seq, axis=0), value=onnx.helper.make_tensor("", 1, [1], [1]))
    future = b.op("Sub", ones, b.op("Trilu", ones, upper=0))  # 1 above the diagonal
    scores = b.op("Add", scores, b.op("Mul", future, b.const(torch.finfo(torch.float32).min, torch.float32)))
    out = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)  # (B, H, T, hd)
    return b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3]), b.const([0, 0, num_heads * head_dim]))


def export_gated_attention(module, config, folder: Path, multimodal: bool, fused_rotary: bool):
    """q_proj -> query and gate -> zero-centred q/k norms -> partial (m)RoPE -> attention -> output gate -> o_proj."""
    b, weights = new_builder(folder)
    params = {name: p.detach() for name, p in module.named_parameters()}
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    rotary_dim = int(hd * config.rope_parameters["partial_rotary_factor"])
    rotary = (Qwen3_5TextRotaryEmbedding if multimodal else Qwen3NextRotaryEmbedding)(config)
    cos_table, sin_table = rope_tables(rotary.inv_freq, rotary.attention_scaling, 512, torch.float32)
    cos_table, sin_table = b.weight("cos_table", cos_table), b.weight("sin_table", sin_table)

    def proj(x: str, name: str) -> str:
        return b.op("MatMul", x, b.weight(f"{name}.weight", params[f"{name}.weight"].T))

    def head_norm(x: str, heads: int, name: str) -> str:
        scale = b.weight(f"{name}.scale", zero_centered_scale(params[f"{name}.weight"]))
        x = b.op("Reshape", x, b.const([0, 0, heads, hd]))
        return emit_zero_centered_rms_norm(b, x, scale, config.rms_norm_eps, torch.float32)  # (B, T, heads, hd)

    query, gate = emit_query_and_gate(b, proj("hidden_states", "q_proj"), nh, hd)
    query = head_norm(query, nh, "q_norm")
    key = head_norm(proj("hidden_states", "k_proj"), nkv, "k_norm")
    value = b.op("Reshape", proj("hidden_states", "v_proj"), b.const([0, 0, nkv, hd]))
    if fused_rotary:
        section = config.rope_parameters["mrope_section"]
        for name, heads in (("query", nh), ("key", nkv)):
            packed = b.op("Reshape", query if name == "query" else key, b.const([0, 0, heads * hd]))
            packed = emit_mrotary_embedding(b, packed, "position_ids", cos_table, sin_table, heads, rotary_dim, section)
            rotated = b.op("Transpose", b.op("Reshape", packed, b.const([0, 0, heads, hd])), perm=[0, 2, 1, 3])
            query, key = (rotated, key) if name == "query" else (query, rotated)
    else:
        selector = None
        if multimodal:
            section = config.rope_parameters["mrope_section"]
            selector = b.weight("mrope_selector", mrope_stream_selector(section, rotary_dim // 2))
        cos, sin = emit_rotary_cos_sin(b, "position_ids", cos_table, sin_table, torch.float32, selector)
        query = emit_partial_rotary(b, b.op("Transpose", query, perm=[0, 2, 1, 3]), cos, sin, rotary_dim, hd)
        key = emit_partial_rotary(b, b.op("Transpose", key, perm=[0, 2, 1, 3]), cos, sin, rotary_dim, hd)
    attention = causal_attention(b, query, key, b.op("Transpose", value, perm=[0, 2, 1, 3]), nh, nkv, hd)
    b.op_to("Identity", [proj(emit_output_gate(b, attention, gate), "o_proj")], ["output"])
    f32 = TensorProto.FLOAT
    positions = [3, "batch", "seq"] if multimodal else ["batch", "seq"]
    inputs = [
        value_info("hidden_states", f32, ["batch", "seq", config.hidden_size]),
        value_info("position_ids", TensorProto.INT64, positions),
    ]
    outputs = [value_info("output", f32, ["batch", "seq", config.hidden_size])]
    return save_and_load(b, weights, folder, inputs, outputs, contrib_ops=fused_rotary)


def reference_attention(module, rotary, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The transformers module, eager attention, with the causal mask as an additive bias."""
    seq = hidden.shape[1]
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        return module(hidden, position_embeddings=rotary(hidden, positions), attention_mask=causal)[0]


def gated_attention_case(kind: str):
    if kind == "qwen3_5":
        config = mrope_config()
        config._attn_implementation = "eager"
        return config, Qwen3_5Attention(config, layer_idx=0), Qwen3_5TextRotaryEmbedding(config)
    config = Qwen3NextConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        partial_rotary_factor=0.25,
    )
    config._attn_implementation = "eager"
    return config, Qwen3NextAttention(config, layer_idx=0), Qwen3NextRotaryEmbedding(config)


@pytest.mark.parametrize(
    "kind, fused_rotary",
    [("qwen3_5", False), ("qwen3_5", True), ("qwen3_next", False)],
    ids=["qwen3_5-plain", "qwen3_5-MRotaryEmbedding", "qwen3_next-text-positions"],
)
def test_gated_attention_matches_transformers(kind, fused_rotary, tmp_path):
    config, module, rotary = gated_attention_case(kind)
    module = randomize_parameters(module, seed=7).eval()
    with torch.no_grad():  # zero-centred norms: offsets around 0, so that a missing "1 +" cannot pass
        module.q_norm.weight.copy_(0.3 * torch.randn(config.head_dim, generator=torch.Generator().manual_seed(1)))
        module.k_norm.weight.copy_(0.3 * torch.randn(config.head_dim, generator=torch.Generator().manual_seed(2)))
    multimodal = kind == "qwen3_5"
    positions = vision_language_positions() if multimodal else torch.stack([torch.arange(14), torch.arange(14) + 490])
    hidden = torch.randn(2, positions.shape[-1], config.hidden_size, generator=torch.Generator().manual_seed(3))
    session = export_gated_attention(module, config, tmp_path, multimodal, fused_rotary)
    ours = session.run(["output"], {"hidden_states": hidden.numpy(), "position_ids": positions.numpy()})[0]
    assert relative_error(reference_attention(module, rotary, hidden, positions), ours) <= RELATIVE_TOLERANCE


def test_a_weight_named_twice_is_written_once_and_must_match(tmp_path):
    """Both branches of a fused layer's If read the conv weight and the gate constants: a second ``weight`` of a name
    refers to the first (one initializer, one copy in the data file); a different dtype or shape is a bug."""
    b, weights = new_builder(tmp_path)
    branch = b.subgraph()
    assert b.weight("w", torch.ones(3, 2)) == branch.weight("w", torch.zeros(3, 2)) == "w"
    assert [t.name for t in b.initializers] == ["w"] and weights.count == 1
    with pytest.raises(ValueError, match="weight w written twice"):
        branch.weight("w", torch.ones(2, 3))
    weights.close()
