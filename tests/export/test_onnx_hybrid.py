"""Hybrid models exported whole (Qwen3.5, Qwen3.5-MoE with its shared expert, Qwen3-Next; export_helpers.FAMILIES):
linear-attention layers carrying their conv and recurrent state, gated full attention, zero-centred norms, partial
and multimodal RoPE, in the plain graph and the fused one, run by onnxruntime (CPU) against the PyTorch Thinker
(whose equality with Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM tests/test_modeling_hybrid.py
proves).

Tolerances, as fractions of max(1, logit scale): float32 1e-4 (DESIGN.md); float16 the export's own float16
tolerance (thinker_common/parity_inputs.py, 5e-2; measured here: see test_float16_parity). Quantized graphs: the
plumbing is checked exactly (the PyTorch model holding onnxruntime's dequantized weights reproduces the graph to 1e-3)
and ``--verify`` passes on top-1 agreement, as for the dense families.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from export_helpers import HYBRID_FAMILIES, graph_nodes, save_thinker
from test_onnx_quantized import attributes, dequantized_weights

from export.dequantize import quantized_weights
from export.linear_attention_graph import FusedGatedDeltaNetGraph, GatedDeltaNetGraph
from export.quantize import QuantizeSpec, WeightQuantizer
from export.runtime import DecoderState, OnnxDecoder, position_ids_from_mask
from export.verify import compare_decoders
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch

GRAPHS = ["plain", "fused"]
VOCAB = 96
INT4_EXACT = QuantizeSpec(bits=4, block_size=16, accuracy_level=1)  # float32 activations: no activation rounding
INT8 = QuantizeSpec(bits=8, block_size=16)


def load_thinker(folder, dtype=torch.float32):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def bound(figures: dict, dtype=torch.float32) -> float:
    return RELATIVE_TOLERANCE[dtype] * max(1.0, figures["logit_scale"])


def hybrid_export(onnx_variant, family: str, graph: str, **options):
    """The (unverified) export of the family's tiny hybrid Thinker, its own head_dim (32) kept."""
    return onnx_variant(family, graph=graph, head_dim=None, **options)


def left_padded(lengths: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids (never the pad id 0), rows left-padded to the longest."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = rng.integers(3, VOCAB, size=length)
        mask[row, width - length :] = 1
    return ids, mask


# --- float32 parity: prefill + 6 decode steps on a left-padded batch of 2 -------------------------------------------
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_float32_parity(family, graph, thinker_variant, onnx_variant):
    model = load_thinker(thinker_variant(family))
    decoder = OnnxDecoder(hybrid_export(onnx_variant, family, graph), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(VOCAB), steps=6)
    assert figures["max_abs_diff"] <= bound(figures), figures
    assert figures["top1_agreement"] == 1.0 and len(figures["max_abs_diff_per_step"]) == 7, figures


@pytest.mark.parametrize("graph", GRAPHS)
def test_the_presents_are_the_pytorch_thinkers_cache(graph, thinker_variant, onnx_variant):
    """Each full-attention layer's present key and value are the keys and values the PyTorch Thinker caches, with
    partial rotary (8 of 32 channels rotated) in their layout: the rotated channels first. The rotated part written
    after the passing one gives the same scores, so the same logits, in every pass that keeps its own cache (a
    mutation run): a cache handed to another runtime, or the other graph, would not be this one."""
    model = load_thinker(thinker_variant("qwen3_5"))
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph), provider="cpu")
    ids = np.array([[5, 9, 13, 7, 21, 3, 11]])
    _, state = decoder.prefill(ids, np.ones_like(ids))
    with torch.no_grad():
        cache = model(torch.from_numpy(ids), use_cache=True).past_key_values
    attention = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert attention and model.config.rope_parameters["partial_rotary_factor"] < 1
    for i in attention:
        for ours, theirs in (("key", cache.layers[i].keys), ("value", cache.layers[i].values)):
            np.testing.assert_allclose(
                np.asarray(state.cache[f"past_key_values.{i}.{ours}"]), theirs.numpy(), atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_long_left_padded_prefill_gives_each_row_its_own_result(family, graph, thinker_variant, onnx_variant):
    """A 70-token row (past transformers' 64-token chunk of the delta rule) beside a 13-token one padded by 57:
    the batch equals PyTorch, and each row of the batch equals that row run alone through the same graph, prefill
    and decode (the pads leave both states at zero)."""
    model = load_thinker(thinker_variant(family))
    decoder = OnnxDecoder(hybrid_export(onnx_variant, family, graph), provider="cpu")
    input_ids, attention_mask = left_padded((70, 13))
    figures = compare_decoders(model, decoder, input_ids, attention_mask, steps=6)
    assert figures["max_abs_diff"] <= bound(figures), figures

    batch_logits, batch_state = decoder.prefill(input_ids, attention_mask)
    kept = attention_mask.astype(bool)
    rows = [decoder.prefill(input_ids[r : r + 1, kept[r]], np.ones((1, kept[r].sum()), np.int64)) for r in range(2)]
    scale = max(1.0, float(np.abs(batch_logits[kept]).max()))
    for r, (row_logits, _) in enumerate(rows):
        np.testing.assert_allclose(batch_logits[r, kept[r]], row_logits[0], atol=1e-4 * scale, rtol=0)
    token = batch_logits[:, -1].argmax(-1)
    for _ in range(6):
        step = decoder.decode_one_token(token, batch_state)
        for r, (_, row_state) in enumerate(rows):
            np.testing.assert_allclose(
                step[r], decoder.decode_one_token(token[r : r + 1], row_state)[0], atol=1e-4 * scale, rtol=0
            )
        token = step.argmax(-1)


# --- padding anywhere: right-padded rows (onnxruntime-genai's batches) and masked steps ------------------------------
# Each row's real tokens: (leading pads, real tokens) of a 9-column prompt, the rest trailing pads. Row 1 is
# onnxruntime-genai's short row; row 2 is one real token between pads (fewer than the conv's k - 1 = 3 columns, so its
# carried conv window reaches back into the empty past).
PADDED_ROWS = ((0, 9), (0, 4), (2, 1))
PADDED_WIDTH = 9
DECODE_TOKENS = 5
MASKED_STEP = 2  # row 1's token at this decode step is masked (attention mask 0): its states must not move
LINEAR_STATES = ("conv_state", "recurrent_state")


def padded_batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """ids, mask and positions of the PADDED_ROWS prompt, and DECODE_TOKENS tokens per row to feed after it.
    Positions count each row's real tokens from 0; a pad's position is its column (any row of the tables)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(PADDED_ROWS), PADDED_WIDTH), np.int64)
    mask = np.zeros_like(ids)
    positions = np.tile(np.arange(PADDED_WIDTH), (len(PADDED_ROWS), 1))
    for row, (start, length) in enumerate(PADDED_ROWS):
        ids[row, start : start + length] = rng.integers(3, VOCAB, size=length)
        mask[row, start : start + length] = 1
        positions[row, start : start + length] = np.arange(length)
    return ids, mask, positions, rng.integers(3, VOCAB, size=(len(PADDED_ROWS), DECODE_TOKENS))


def row_alone(decoder: OnnxDecoder, ids: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One row without padding: its prompt's logits (T, V) and each following token's logits (V,)."""
    logits, state = decoder.prefill(ids[None], np.ones((1, len(ids)), np.int64))
    return logits[0], [decoder.decode_one_token(np.array([token]), state)[0] for token in tokens]


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_right_padded_rows_and_masked_steps_give_each_row_its_own_result(family, graph, onnx_variant):
    """A batch padded as onnxruntime-genai pads (trailing pads; positions counting real tokens from 0, the new tokens
    after the pad slots), one row padded on both sides, then decode steps, one of which masks row 1's token: every
    row's logits equal that row run alone through the same graph, prefill and decode, within 1e-5 of the logit
    scale; and the masked step hands row 1's linear-attention states back bit for bit. Trailing pads that decayed
    the recurrent state, wrote into it or shifted the conv window would each fail this."""
    decoder = OnnxDecoder(hybrid_export(onnx_variant, family, graph), provider="cpu")
    ids, mask, positions, tokens = padded_batch()
    state = DecoderState(mask, None, decoder.empty_cache(len(PADDED_ROWS)))
    prompt_logits = decoder.forward(ids, positions, state)
    next_position = np.array([length for _, length in PADDED_ROWS])
    step_logits = []  # per step: (B, V)
    for step in range(DECODE_TOKENS):
        keep = np.ones(len(PADDED_ROWS), np.int64)
        if step == MASKED_STEP:
            keep[1] = 0
        state.attention_mask = np.concatenate([state.attention_mask, keep[:, None]], axis=1)
        past = dict(state.cache)
        step_logits.append(decoder.forward(tokens[:, step : step + 1], next_position[:, None], state)[:, 0])
        next_position += keep
        if step == MASKED_STEP:
            linear = [n for n in decoder.past_names if n.endswith(LINEAR_STATES)]
            for name in linear:
                np.testing.assert_array_equal(state.cache[name][1], past[name][1], err_msg=name)
            assert all(not np.array_equal(state.cache[n][0], past[n][0]) for n in linear)  # row 0 did move

    kept = mask.astype(bool)
    scale = max(1.0, float(np.abs(prompt_logits[kept]).max()))
    for row, (start, length) in enumerate(PADDED_ROWS):
        steps = [s for s in range(DECODE_TOKENS) if not (row == 1 and s == MASKED_STEP)]
        alone_prompt, alone_steps = row_alone(decoder, ids[row, start : start + length], list(tokens[row, steps]))
        np.testing.assert_allclose(prompt_logits[row, kept[row]], alone_prompt, atol=1e-5 * scale, rtol=0)
        for s, expected in zip(steps, alone_steps, strict=True):
            np.testing.assert_allclose(step_logits[s][row], expected, atol=1e-5 * scale, rtol=0, err_msg=f"step {s}")


@pytest.mark.parametrize("graph", GRAPHS)
def test_a_pad_between_a_rows_tokens_is_refused(graph, onnx_variant, onnx_folder):
    """A 0 between a row's kept slots: the graph and transformers' layers carry the linear-attention states through
    it differently (several logits apart, found by a QA run), so OnnxDecoder refuses it by row, in a prompt and in
    a chunk after one; an attention-only model takes it (its mask hides the slot exactly), and so does a row padded
    on both sides."""
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph), provider="cpu")
    ids = np.array([[9, 5, 6, 7, 8, 10], [11, 11, 11, 12, 13, 14]])
    hole = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1]])
    with pytest.raises(ThinkerError, match=re.escape("row 1 of attention_mask masks a slot between its new tokens")):
        decoder.prefill(ids, hole)
    _, state = decoder.prefill(ids[:1, :3], np.ones((1, 3), np.int64))
    state.attention_mask = np.concatenate([state.attention_mask, np.array([[1, 0, 1]])], axis=1)
    with pytest.raises(ThinkerError, match="masks a slot between its new tokens"):
        decoder.forward(ids[:1, 3:], np.array([[3, 4, 4]]), state)
    decoder.prefill(ids, np.array([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]]))  # pads on both sides: taken
    OnnxDecoder(onnx_folder("qwen3"), provider="cpu").prefill(ids, hole)


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("masked", [3, 70])
def test_a_masked_chunk_leaves_the_linear_states_untouched(masked, graph, onnx_variant):
    """New tokens, all masked, after a prompt (batch 1, as a chunked step needs in the fused graph): the conv and
    recurrent states come back bit for bit, through the Scan and LinearAttention's multi-token path (3 tokens) and
    the plain graph's chunks (70)."""
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_next", graph), provider="cpu")
    ids, _ = left_padded((6,), seed=4)
    _, state = decoder.prefill(ids, np.ones_like(ids))
    past = dict(state.cache)
    state.attention_mask = np.concatenate([state.attention_mask, np.zeros((1, masked), np.int64)], axis=1)
    new_ids, _ = left_padded((masked,), seed=5)
    decoder.forward(new_ids, np.arange(6, 6 + masked)[None], state)
    for name in (n for n in decoder.past_names if n.endswith(LINEAR_STATES)):
        np.testing.assert_array_equal(state.cache[name], past[name], err_msg=name)


@pytest.mark.parametrize("step", [5, 70])
def test_multi_token_step_after_a_prompt(step, thinker_variant, onnx_variant):
    """Prefill of any length and decode are one graph: a 5-token step after a 9-token prompt (both states and the
    KV carried) equals PyTorch's full forward over the 14 tokens (batch 1, as onnxruntime's GroupQueryAttention
    needs for a chunked step); a 70-token step, which the plain graph's delta rule takes in chunks (from
    CHUNKED_FROM tokens), starts from the prompt's state as well."""
    model = load_thinker(thinker_variant("qwen3_5"))
    total = 9 + step
    ids, _ = left_padded((total,), seed=3)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    for graph in GRAPHS:
        decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph), provider="cpu")
        first, state = decoder.prefill(ids[:, :9], np.ones((1, 9), np.int64))
        state.attention_mask = np.ones((1, total), np.int64)
        second = decoder.forward(ids[:, 9:], np.arange(9, total)[None], state)
        logits = np.concatenate([first, second], axis=1)
        np.testing.assert_allclose(logits, expected, atol=1e-4 * max(1.0, np.abs(expected).max()), rtol=0)


# --- the IO contract ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_state_inputs_and_outputs(family, graph, thinker_variant, onnx_variant):
    """KV on the full-attention layers (1, 3), conv and recurrent state on the linear ones (0, 2), static but for
    the batch; (3, B, T) positions where RoPE is multimodal; genai_config names the states."""
    folder = hybrid_export(onnx_variant, family, graph)
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: (i.shape, i.type) for i in session.get_inputs()}
    outputs = {o.name: (o.shape, o.type) for o in session.get_outputs()}
    conv_dim = 2 * 2 * 12 + 4 * 8  # [q | k | v] channels
    for i in (0, 2):
        assert inputs[f"past_key_values.{i}.conv_state"] == (["batch_size", conv_dim, 3], "tensor(float)")
        assert inputs[f"past_key_values.{i}.recurrent_state"] == (["batch_size", 4, 12, 8], "tensor(float)")
        assert outputs[f"present.{i}.conv_state"] == inputs[f"past_key_values.{i}.conv_state"]
        assert outputs[f"present.{i}.recurrent_state"] == inputs[f"past_key_values.{i}.recurrent_state"]
        assert f"past_key_values.{i}.key" not in inputs and f"present.{i}.value" not in outputs
    for i in (1, 3):
        assert inputs[f"past_key_values.{i}.key"][0] == ["batch_size", 2, "past_sequence_length", 32]
        assert f"past_key_values.{i}.conv_state" not in inputs
    multimodal = family != "qwen3_next"
    positions = [3, "batch_size", "sequence_length"] if multimodal else ["batch_size", "sequence_length"]
    assert inputs["position_ids"][0] == positions
    assert len(inputs) == 3 + 8 and len(outputs) == 1 + 8

    # onnxruntime-genai's graph takes (B, T) positions whatever model.onnx takes, under its generic decoder type
    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    assert genai["type"] == "qwen3" and genai["decoder"]["num_hidden_layers"] == 4
    genai_session = ort.InferenceSession(str(folder / genai["decoder"]["filename"]), providers=["CPUExecutionProvider"])
    genai_inputs = {i.name: i.shape for i in genai_session.get_inputs()}
    assert genai_inputs["position_ids"] == ["batch_size", "sequence_length"]
    assert genai["decoder"]["inputs"]["past_recurrent_names"] == "past_key_values.%d.recurrent_state"
    assert genai["decoder"]["outputs"]["present_conv_names"] == "present.%d.conv_state"
    assert "image_token_id" not in genai and "vision_start_token_id" not in genai
    share = json.loads((folder / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
    assert share is (graph == "fused")


def test_fused_graph_uses_the_contrib_operators(onnx_variant):
    ops = {n.op_type for n in graph_nodes(hybrid_export(onnx_variant, "qwen3_5_moe", "fused") / "model.onnx")}
    assert {"CausalConvWithState", "LinearAttentionGate", "LinearAttention", "GatedRMSNorm", "MRotaryEmbedding"} <= ops
    assert {"GroupQueryAttention", "MoE", "SkipSimplifiedLayerNormalization"} <= ops and "Scan" not in ops
    next_ops = {n.op_type for n in graph_nodes(hybrid_export(onnx_variant, "qwen3_next", "fused") / "model.onnx")}
    assert "RotaryEmbedding" in next_ops and "MRotaryEmbedding" not in next_ops


def test_hybrid_models_export_the_fused_graph_by_default(thinker_variant, tmp_path):
    """Without --graph a hybrid model gets the fused graph, as every model does (the faster one, docs/hybrid-export.md
    section 6); the report and the command's line say which."""
    hybrid = CliRunner().invoke(main, ["export", str(thinker_variant("qwen3_5")), str(tmp_path / "h"), "--no-verify"])
    assert hybrid.exit_code == 0 and "(fused graph)" in hybrid.stdout, hybrid.output
    assert json.loads((tmp_path / "h" / "export_report.json").read_text())["graph"] == "fused"
    nodes = onnx.load(tmp_path / "h" / "model.onnx", load_external_data=False).graph.node
    assert "LinearAttention" in {n.op_type for n in nodes}


def test_fused_states_take_one_buffer_as_past_and_present(onnx_variant):
    """What genai_config's past_present_share_buffer turns on for the fused graph: one buffer per state bound as
    both past and present (KV of the whole context; conv and recurrent state updated in place) gives the logits of
    the caller that keeps them apart, on the left-padded batch."""
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5_moe", "fused"), provider="cpu")
    input_ids, attention_mask = parity_batch(VOCAB)
    expected, state = decoder.prefill(input_ids, attention_mask)
    steps = 4
    buffers = {}
    for name, (shape, _, numpy_type) in decoder.state_specs.items():
        shape = [2, *shape]
        if name.endswith((".key", ".value")):
            shape[2] = input_ids.shape[1] + steps
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, numpy_type))

    def run(ids, mask, positions):
        binding = decoder.session.io_binding()
        for name, value in (
            ("input_ids", ids),
            ("attention_mask", mask),
            ("position_ids", decoder.graph_positions(positions)),
        ):
            binding.bind_cpu_input(name, np.ascontiguousarray(value, dtype=np.int64))
        binding.bind_output("logits")
        for past, present in zip(decoder.past_names, decoder.present_names, strict=True):
            binding.bind_ortvalue_input(past, buffers[past])
            binding.bind_ortvalue_output(present, buffers[past])
        decoder.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    mask = attention_mask
    kept = mask.astype(bool)
    np.testing.assert_allclose(run(input_ids, mask, position_ids_from_mask(mask))[kept], expected[kept], atol=1e-4)
    token = expected[:, -1].argmax(-1)
    for _ in range(steps):
        expected_step = decoder.decode_one_token(token, state)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        np.testing.assert_allclose(
            run(token[:, None], mask, position_ids_from_mask(mask)[:, -1:])[:, -1], expected_step, atol=1e-4
        )
        token = expected_step.argmax(-1)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_unpadded_branch_is_the_padding_rule_bit_for_bit(family, dtype, onnx_variant, tmp_path):
    """The fused linear layers branch on whether the mask keeps every new position: the unpadded branch (the conv
    op's own carry, unmasked gates) must give every logit and state bit the padded branch (gathered state, masked
    gates) gives on the same unpadded prompt and decode steps. The padded-only graph is the export with each If
    fed a false that onnxruntime cannot fold (a constant condition would have the branch inlined, and float16 cast
    pairs then fused across what was the branch's edge, which changes the rounding, not the rule)."""
    folder = hybrid_export(onnx_variant, family, "fused", dtype=dtype)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    branches = [n for n in model.graph.node if n.op_type == "If"]
    layer_types = json.loads((folder / "config.json").read_text())["layer_types"]
    assert len(branches) == layer_types.count("linear_attention")
    for node in branches:
        then_ops = {n.op_type for n in next(a.g for a in node.attribute if a.name == "then_branch").node}
        else_ops = {n.op_type for n in next(a.g for a in node.attribute if a.name == "else_branch").node}
        assert "GatherElements" in else_ops and not then_ops & {"GatherElements", "Concat", "Mul"}, then_ops
        node.input[0] = "always_padded"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), "one"))
    highest = onnx.helper.make_node("ReduceMax", ["attention_mask"], ["highest"], keepdims=0)
    model.graph.node.insert(0, onnx.helper.make_node("Greater", ["highest", "one"], ["always_padded"]))
    model.graph.node.insert(0, highest)
    (tmp_path / "model.onnx.data").write_bytes((folder / "model.onnx.data").read_bytes())
    onnx.save(model, str(tmp_path / "model.onnx"))
    branching, padded_only = (OnnxDecoder(path, provider="cpu") for path in (folder, tmp_path / "model.onnx"))

    ids = np.random.default_rng(3).integers(3, VOCAB, size=(2, 9))
    states = [DecoderState(np.ones_like(ids), None, d.empty_cache(2)) for d in (branching, padded_only)]
    step_ids, positions = ids, position_ids_from_mask(np.ones_like(ids))
    for step in range(5):
        decoders = zip((branching, padded_only), states, strict=True)
        logits = [d.forward(step_ids, positions, state) for d, state in decoders]
        np.testing.assert_array_equal(logits[0], logits[1], f"step {step}")
        for name in branching.past_names:
            np.testing.assert_array_equal(states[0].cache[name], states[1].cache[name], f"{name}, step {step}")
        step_ids, positions = logits[0][:, -1:].argmax(-1), positions[:, -1:] + 1
        for state in states:
            state.attention_mask = np.concatenate([state.attention_mask, np.ones((2, 1), np.int64)], axis=1)


# --- multimodal positions from a real image prompt ----------------------------------------------------------------
IMAGE_TOKEN, VISION_START, VISION_END = 90, 88, 89


def image_prompt_positions() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A left-padded batch of two prompts, each with one image of 4 x 6 patches (6 tokens after the 2 x 2 merge)
    among text, and its (3, B, T) positions from the reference's own ``Qwen3_5Model.get_rope_index``."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    config = Qwen3_5Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, layer_types=["full_attention"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )  # fmt: skip
    image = [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END]
    rows = [[5, 9, 17, 33, 4, *image, 21, 8, 7, 44, 12, 60, 31], [11, 12, *image, 13, 14, 15]]
    width = max(map(len, rows))
    ids = np.array([[0] * (width - len(r)) + r for r in rows], np.int64)
    mask = (np.arange(width)[None] >= (width - np.array([len(r) for r in rows]))[:, None]).astype(np.int64)
    positions, _ = Qwen3_5Model(config).get_rope_index(
        torch.from_numpy(ids),
        mm_token_type_ids=torch.from_numpy((ids == IMAGE_TOKEN).astype(np.int32)),
        image_grid_thw=torch.tensor([[1, 4, 6], [1, 4, 6]]),
        attention_mask=torch.from_numpy(mask),
    )
    return ids, mask, positions.numpy()


@pytest.mark.parametrize("graph", GRAPHS)
def test_image_prompt_positions_give_pytorch_logits(graph, thinker_variant, onnx_variant):
    """(3, B, T) positions where the three streams differ (the image's height and width), then decode steps at
    each row's next position, through the graph and through the PyTorch Thinker: the same logits. The same prompt
    with plain text positions gives other logits, so the streams are really read."""
    ids, mask, positions = image_prompt_positions()
    assert not np.array_equal(positions[1], positions[2]) and not np.array_equal(positions[0], positions[1])
    model = load_thinker(thinker_variant("qwen3_5"))
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph), provider="cpu")
    kept = mask.astype(bool)

    next_position = positions.max(axis=(0, 2)) + 1  # (B,): after the image, text continues from the largest
    state = DecoderState(mask, next_position, decoder.empty_cache(2))
    ours = decoder.forward(ids, positions, state)
    with torch.no_grad():
        out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(positions), use_cache=True)  # fmt: skip
    reference = out.logits.numpy()
    scale = max(1.0, float(np.abs(reference[kept]).max()))
    np.testing.assert_allclose(ours[kept], reference[kept], atol=1e-4 * scale, rtol=0)

    torch_mask, cache, token = torch.from_numpy(mask), getattr(out, CACHE_ARG), reference[:, -1].argmax(-1)
    for _ in range(4):
        step = decoder.decode_one_token(token, state)
        torch_mask = torch.cat([torch_mask, torch.ones_like(torch_mask[:, :1])], dim=1)
        position = torch.from_numpy(state.next_position - 1)[:, None]
        with torch.no_grad():
            out = model(torch.from_numpy(token[:, None]), attention_mask=torch_mask, position_ids=position,
                        use_cache=True, **{CACHE_ARG: cache})  # fmt: skip
        np.testing.assert_allclose(step, out.logits[:, -1].numpy(), atol=1e-4 * scale, rtol=0)
        cache, token = getattr(out, CACHE_ARG), out.logits[:, -1].numpy().argmax(-1)

    text_logits, _ = decoder.prefill(ids, mask)  # the same tokens numbered as text
    assert np.abs(text_logits[kept] - reference[kept]).max() > 100 * 1e-4 * scale


def test_four_row_positions_are_the_three_streams_and_other_forms_are_refused(onnx_variant):
    """(4, B, T) positions, a text row before the three streams (a form the Thinker and Qwen3.5's classes take),
    give the three streams' logits; a leading axis of another size is refused by name before onnxruntime runs."""
    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", "fused"), provider="cpu")
    ids, mask, positions = image_prompt_positions()
    text = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)[None]
    three = decoder.forward(ids, positions, DecoderState(mask, None, decoder.empty_cache(2)))
    four = decoder.forward(ids, np.concatenate([text, positions]), DecoderState(mask, None, decoder.empty_cache(2)))
    np.testing.assert_array_equal(four, three)
    with pytest.raises(ThinkerError, match=r"position_ids of shape \(5, 2, \d+\); multimodal positions are"):
        decoder.forward(ids, np.concatenate([text, text, positions]), DecoderState(mask, None, decoder.empty_cache(2)))
    # the batch axis left out: the caller's (3, T) quoted, not the (3, 3, T) it was broadcast to for the graph
    with pytest.raises(ThinkerError, match=rf"position_ids of shape \(3, {ids.shape[1]}\) for input_ids of shape"):
        decoder.forward(ids, positions[:, 0], DecoderState(mask, None, decoder.empty_cache(2)))


HOSTILE_EDITS = {
    "conv kernel": ("qwen3_5", {"linear_conv_kernel_dim": 3}, "linear_conv_kernel_dim=3 gives"),
    "value head size": ("qwen3_5", {"linear_value_head_dim": 12}, "linear_value_head_dim=12"),
    "key heads": ("qwen3_5", {"linear_num_key_heads": 1}, "linear_num_key_heads=1"),
    "experts": ("qwen3_5_moe", {"num_experts": 3}, "num_experts=3 gives"),
    "kernel as text": ("qwen3_5", {"linear_conv_kernel_dim": "4"}, "linear_conv_kernel_dim='4' must be a whole number"),
    "negative experts": ("qwen3_5_moe", {"num_experts": -1}, "num_experts=-1 must be 0 (every layer dense) or more"),
    "top-k zero": ("qwen3_5_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must lie in 1..4"),
}


@pytest.mark.parametrize("edit", HOSTILE_EDITS)
def test_a_hybrid_config_that_does_not_describe_the_weights_is_named_by_key(edit, thinker_variant, tmp_path):
    """A linear-attention or expert size edited in config.json: one line naming config.json and the key."""
    family, changes, fragment = HOSTILE_EDITS[edit]
    folder = tmp_path / "thinker"
    shutil.copytree(thinker_variant(family), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "onnx"), "--no-verify"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (line,) = result.stderr.strip().splitlines()
    assert str(folder / "config.json") in line and fragment in line, line
    assert not (tmp_path / "onnx").exists()


def test_what_the_graph_or_the_pytorch_thinker_cannot_run_is_refused_in_one_line(thinker_variant, tmp_path):
    """A conv kernel of 1 leaves no conv state to carry: refused by key. With no full-attention layer transformers'
    caches cannot decode, so --verify and generate with transformers are refused naming layer_types (the graph itself
    runs such a model: --no-verify exports it)."""
    kernel_one = thinker_variant("qwen3_5", linear_conv_kernel_dim=1)
    result = CliRunner().invoke(main, ["export", str(kernel_one), str(tmp_path / "k1"), "--no-verify"])
    assert result.exit_code == 1 and "linear_conv_kernel_dim=1" in result.stderr, result.output
    assert "Traceback" not in result.output and not (tmp_path / "k1").exists()

    layers = json.loads((thinker_variant("qwen3_5") / "config.json").read_text())["num_hidden_layers"]
    linear_only = save_thinker(tmp_path / "linear-only", "qwen3_5", layer_types=["linear_attention"] * layers)
    for command, fragment in (
        (["export", str(linear_only), str(tmp_path / "verified")], "export with --no-verify"),
        (["generate", str(linear_only), "-p", "the cat"], "generate from the ONNX folder"),
    ):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        (line,) = result.stderr.strip().splitlines()
        assert "layer_types has no full_attention layer" in line and fragment in line, line
    assert not (tmp_path / "verified").exists()
    exported = CliRunner().invoke(main, ["export", str(linear_only), str(tmp_path / "onnx"), "--no-verify"])
    assert exported.exit_code == 0, exported.output


# --- text positions (--positions text) ------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", GRAPHS)
def test_text_positions_are_the_multimodal_graph_fed_three_equal_streams(graph, onnx_variant):
    """--positions text: position_ids (B, T), and every logit and state bit for bit what the default graph gives for
    the same positions on its three streams, over the right-padded batch and decode steps above (one masked)."""
    text = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph, positions="text"), provider="cpu")
    multimodal = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", graph), provider="cpu")
    assert text.position_rank == 2 and multimodal.position_rank == 3
    ids, mask, positions, tokens = padded_batch()
    text_state, multimodal_state = (
        DecoderState(mask, None, d.empty_cache(len(PADDED_ROWS))) for d in (text, multimodal)
    )
    feeds = [(ids, positions)]
    next_position = np.array([length for _, length in PADDED_ROWS])
    for step in range(DECODE_TOKENS):
        feeds.append((tokens[:, step : step + 1], next_position[:, None].copy()))
        next_position += 1
    for step, (step_ids, step_positions) in enumerate(feeds):
        if step:
            keep = np.ones((len(PADDED_ROWS), 1), np.int64)
            keep[1] = 0 if step == MASKED_STEP + 1 else 1
            for state in (text_state, multimodal_state):
                state.attention_mask = np.concatenate([state.attention_mask, keep], axis=1)
        ours = text.forward(step_ids, step_positions, text_state)
        three = np.broadcast_to(step_positions, (3, *step_positions.shape))
        np.testing.assert_array_equal(ours, multimodal.forward(step_ids, three, multimodal_state), f"step {step}")
        for name in text.past_names:
            np.testing.assert_array_equal(text_state.cache[name], multimodal_state.cache[name], f"{name}, {step}")


def test_text_positions_take_equal_streams_and_refuse_distinct_ones(onnx_variant):
    """A text-positions graph takes (3, B, T) positions whose streams are equal (text numbered the multimodal way)
    and refuses an image prompt's, whose height and width streams it cannot read, naming the option that can."""
    from thinker_common.errors import ThinkerError

    decoder = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5", "fused", positions="text"), provider="cpu")
    ids, mask, positions = image_prompt_positions()
    text = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    two_d = decoder.forward(ids, text, DecoderState(mask, None, decoder.empty_cache(2)))
    three = np.broadcast_to(text, (3, *text.shape))
    np.testing.assert_array_equal(decoder.forward(ids, three, DecoderState(mask, None, decoder.empty_cache(2))), two_d)
    with pytest.raises(ThinkerError, match="--positions multimodal"):
        decoder.forward(ids, positions, DecoderState(mask, None, decoder.empty_cache(2)))


def test_positions_option_in_the_report_genai_config_and_errors(thinker_variant, tmp_path):
    """The report names model.onnx's form; onnxruntime-genai's graph takes (B, T) positions under the generic
    decoder's type either way (genai's Qwen3.5 types, which feed (3, B, T), get its batches wrong), so neither export
    prints a note about it; a model without multimodal RoPE refuses --positions multimodal in one line, writing
    nothing."""
    runs = {}
    for positions in ("multimodal", "text"):
        out = tmp_path / positions
        args = ["export", str(thinker_variant("qwen3_5")), str(out), "--no-verify", "--positions", positions]
        runs[positions] = CliRunner().invoke(main, args)
        assert runs[positions].exit_code == 0, runs[positions].output
        assert json.loads((out / "export_report.json").read_text())["positions"] == positions
    genai = {p: json.loads((tmp_path / p / "genai_config.json").read_text())["model"] for p in runs}
    for positions in runs:
        assert genai[positions]["type"] == "qwen3" and "image_token_id" not in genai[positions], genai[positions]
        assert "--positions text" not in runs[positions].output
        graphs = {
            name: {i.name: i for i in onnx.load(tmp_path / positions / name, load_external_data=False).graph.input}
            for name in ("model.onnx", genai[positions]["decoder"]["filename"])
        }
        ranks = {name: len(inputs["position_ids"].type.tensor_type.shape.dim) for name, inputs in graphs.items()}
        assert ranks == {"model.onnx": 3 if positions == "multimodal" else 2, "model.genai.onnx": 2}, ranks

    dense = tmp_path / "dense"
    refused = CliRunner().invoke(
        main, ["export", str(thinker_variant("qwen3")), str(dense), "--no-verify", "--positions", "multimodal"]
    )
    assert refused.exit_code != 0 and "no multimodal RoPE" in refused.output and not dense.exists(), refused.output
    assert "Traceback" not in refused.output


def test_a_plain_graphs_genai_model_takes_left_padding(onnx_variant):
    """README: OnnxDecoder refuses a left-padded batch on a fused graph's model.genai.onnx (no padding bias), but a
    plain graph's, rewired only to take text positions, numbers them by the mask: each row's last logits are
    model.onnx's (a QA run read README's refusal as covering every model.genai.onnx)."""
    folder = hybrid_export(onnx_variant, "qwen3_5", "plain")
    genai, whole = OnnxDecoder(folder / "model.genai.onnx", provider="cpu"), OnnxDecoder(folder, provider="cpu")
    assert not genai.right_padding_only
    ids, mask = left_padded((7, 3))
    last, _ = genai.prefill(ids, mask)
    every, _ = whole.prefill(ids, mask)
    np.testing.assert_allclose(last[:, -1], every[:, -1], rtol=0, atol=1e-5)


# --- half precision -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_float16_parity(family, graph, thinker_variant, onnx_variant):
    """The float16 graph (conv state and projections float16; gates, recurrence and recurrent state float32)
    against the float16 PyTorch model, within the export's float16 tolerance; measured well inside it."""
    model = load_thinker(thinker_variant(family), torch.float16)
    decoder = OnnxDecoder(hybrid_export(onnx_variant, family, graph, dtype="float16"), provider="cpu")
    recurrent = [i for i in decoder.session.get_inputs() if i.name.endswith("recurrent_state")]
    assert {i.type for i in recurrent} == {"tensor(float)"}
    figures = compare_decoders(model, decoder, *parity_batch(VOCAB), steps=6)
    assert figures["max_abs_diff"] <= bound(figures, torch.float16), figures
    assert figures["top1_agreement"] >= 0.9, figures


@pytest.mark.parametrize("graph", GRAPHS)
def test_an_odd_rotary_part_exports_with_its_multimodal_sections(graph, tmp_path):
    """head_dim 20 at partial_rotary_factor 0.25 rotates 5 channels, which transformers' RoPE gives 3 frequencies
    (one per even channel): the config, the converter and the graph count them alike (the config counted 2, so
    the one section it took failed the export with a traceback)."""
    from huggingface_hub.errors import StrictDataclassError

    from export.exporter import export_model
    from thinker import ThinkerConfig

    odd = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_interleaved": True}
    with pytest.raises(StrictDataclassError, match=re.escape("summing to the 3 rotary frequencies of a head")):
        ThinkerConfig(head_dim=20, rope_parameters=odd | {"mrope_section": [1, 1, 0]})
    sections = odd | {"mrope_section": [1, 1, 1]}
    folder = save_thinker(tmp_path / "thinker", "qwen3_5", head_dim=20, rope_parameters=sections)
    report = export_model(folder, tmp_path / "onnx", graph=graph)
    assert report["verify"]["passed"] is True


@pytest.mark.parametrize("graph", GRAPHS)
def test_bfloat16_exports_keep_the_recurrent_state_float32_and_are_verified_widened_on_cpu(
    graph, thinker_variant, tmp_path
):
    """onnxruntime's CPU provider has no bfloat16 kernels: the export is written, the recurrent state stays float32,
    and --verify checks it widened to float32 (tests/export/test_verify_widened.py)."""
    from export.exporter import export_model
    from export.providers import cuda_usable

    if cuda_usable():
        pytest.skip("CUDA is usable here: test_onnx_gpu.py verifies bfloat16")
    report = export_model(thinker_variant("qwen3_5_moe"), tmp_path / "bf16", dtype="bfloat16", graph=graph)
    assert report["verify"]["passed"] is True and "widened to float32" in report["verify"]["widened"]
    graph_inputs = {
        i.name: i.type.tensor_type.elem_type
        for i in onnx.load(tmp_path / "bf16" / "model.onnx", load_external_data=False).graph.input
    }
    assert graph_inputs["past_key_values.0.conv_state"] == onnx.TensorProto.BFLOAT16
    assert graph_inputs["past_key_values.0.recurrent_state"] == onnx.TensorProto.FLOAT
    assert graph_inputs["past_key_values.1.key"] == onnx.TensorProto.BFLOAT16


# --- weight-only quantization ---------------------------------------------------------------------------------------
def test_linear_attention_decay_and_write_projections_stay_float():
    quantizer = WeightQuantizer(QuantizeSpec(bits=4, block_size=16), torch.float32)
    weight = torch.zeros(64, 32)  # big enough to be quantized by size
    assert quantizer.applies(weight, "model.layers.0.linear_attn.in_proj_qkv.weight")
    assert quantizer.applies(weight, "model.layers.0.linear_attn.out_proj.weight")
    assert not quantizer.applies(weight, "model.layers.0.linear_attn.in_proj_a.weight")
    assert not quantizer.applies(weight, "model.layers.0.linear_attn.in_proj_b.weight")


@pytest.mark.parametrize("graph", GRAPHS)
def test_quantized_projections(graph, onnx_variant):
    """16 value heads, so that in_proj_a / in_proj_b (32 -> 16) are as wide as a quantized projection: they stay
    MatMul over float weights; in_proj_qkv, in_proj_z, out_proj, attention, MLPs, shared experts and the head are
    MatMulNBits."""
    folder = hybrid_export(
        onnx_variant, "qwen3_5_moe", graph, quantize=INT8, linear_num_value_heads=16, linear_value_head_dim=2
    )
    nodes = list(graph_nodes(folder / "model.onnx"))
    quantized = {n.input[1].split(".weight")[0] + ".weight" for n in nodes if n.op_type == "MatMulNBits"}
    float_matmuls = {n.input[1] for n in nodes if n.op_type == "MatMul"}
    for i in (0, 2):
        prefix = f"model.layers.{i}.linear_attn"
        assert {f"{prefix}.in_proj_qkv.weight", f"{prefix}.in_proj_z.weight", f"{prefix}.out_proj.weight"} <= quantized
        assert {f"{prefix}.in_proj_a.weight", f"{prefix}.in_proj_b.weight"} <= float_matmuls
    qkv = "qkv_proj" if graph == "fused" else "q_proj"
    assert {
        f"model.layers.1.self_attn.{qkv}.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "lm_head.weight",
    } <= quantized
    assert "model.layers.3.mlp.shared_expert.down_proj.weight" in quantized
    assert {attributes(n)["bits"] for n in nodes if n.op_type == "MatMulNBits"} == {8}


def test_quantized_graph_is_the_model_with_the_dequantized_weights(thinker_variant, onnx_variant):
    """Exact plumbing: every quantized projection's dequantized weight, put into the PyTorch model, reproduces the
    graph (linear layers included)."""
    folder = hybrid_export(onnx_variant, "qwen3_5_moe", "plain", quantize=INT4_EXACT)
    model = load_thinker(thinker_variant("qwen3_5_moe"))
    weights = dequantized_weights(folder)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in weights and "lm_head.weight" in weights
    with torch.no_grad():
        for name, weight in weights.items():
            model.get_parameter(name).copy_(torch.from_numpy(weight.T))
        # the Loop's experts, dequantized by export/dequantize.py (test_quantized_experts.py holds it to the kernel)
        for name, quantized in quantized_weights(folder / "model.onnx").items():
            if quantized.op_type == "DequantizeLinear":
                model.get_parameter(name).copy_(torch.from_numpy(quantized.weight))
    figures = compare_decoders(model, OnnxDecoder(folder, provider="cpu"), *parity_batch(VOCAB), steps=6)
    assert figures["max_abs_diff"] <= 1e-3, figures


def test_fused_quantized_equals_plain_quantized(onnx_variant):
    """int4: packing q/k/v/gate along the output axis quantizes every column as the plain graph does, and the
    routed experts are the same quantized weights in both (QMoE; the Loop's DequantizeLinear and MatMul): equal
    within the float graphs' tolerance, 1e-4 x the logit scale (different kernels sum in different orders)."""
    plain = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5_moe", "plain", quantize=INT4_EXACT), provider="cpu")
    fused = OnnxDecoder(hybrid_export(onnx_variant, "qwen3_5_moe", "fused", quantize=INT4_EXACT), provider="cpu")
    input_ids, attention_mask = parity_batch(VOCAB)
    plain_logits, plain_state = plain.prefill(input_ids, attention_mask)
    fused_logits, fused_state = fused.prefill(input_ids, attention_mask)
    kept = attention_mask.astype(bool)
    tolerance = 1e-4 * max(1.0, float(np.abs(plain_logits[kept]).max()))
    np.testing.assert_allclose(fused_logits[kept], plain_logits[kept], atol=tolerance)
    token = plain_logits[:, -1].argmax(-1)
    for _ in range(3):
        step = plain.decode_one_token(token, plain_state)
        np.testing.assert_allclose(fused.decode_one_token(token, fused_state), step, atol=tolerance)
        token = step.argmax(-1)


@pytest.mark.parametrize("graph", GRAPHS)
def test_cli_quantizes_and_verifies(graph, thinker_variant, tmp_path):
    """int8 through ``thinker export --verify``: the graph against the Thinker holding the same dequantized weights
    at the float tolerance, and the cost against the float model under a gate opened wide. The tiny hybrids are
    far more sensitive to weight noise than the dense ones: the PyTorch model itself, its projections perturbed by
    noise of int8's step, moves its logits by up to 0.9x their scale (dense tiny Qwen3: 0.08x), the gated RMSNorm
    over 8-channel value heads amplifying small outputs; so the cost on them says little (int4 keeps 22-48 % top-1
    on random prompts; dense tiny Qwen3: 43-48 %)."""
    output = tmp_path / "int8"
    args = ["export", str(thinker_variant("qwen3_next")), str(output), "--graph", graph, "--quantize", "int8"]
    result = CliRunner().invoke(
        main, [*args, "--block-size", "16", "--min-top1", "0", "--max-perplexity-increase", "9"]
    )
    assert result.exit_code == 0, result.output
    verify = json.loads((output / "export_report.json").read_text())["verify"]
    assert verify["passed"] is True and verify["graph"]["max_abs_diff"] <= verify["graph"]["tolerance"], verify
    assert verify["graph"]["top1_agreement"] == 1.0 and verify["cost"]["min_top1_agreement"] == 0.0, verify
    assert "MatMulNBits" in json.loads((output / "export_report.json").read_text())["nodes_by_op"]


# --- --verify fails on planted bugs -----------------------------------------------------------------------------------
DELTA_STEP = GatedDeltaNetGraph.emit_delta_step
FUSED_GATES = FusedGatedDeltaNetGraph.emit_gates


def plain_step_without_decay(body, state, q, k, v, decay, beta):
    """The Scan's step with the decay dropped: exp(g) replaced by 1, so S never fades."""
    no_decay = body.op("Add", body.op("Mul", decay, body.const(0.0, torch.float32)), body.const(1.0, torch.float32))
    return DELTA_STEP(body, state, q, k, v, no_decay, beta)


def fused_gates_without_decay(self, step, write, prefix):
    """LinearAttentionGate's log decay replaced by 0: LinearAttention then never fades the state."""
    log_decay, beta = FUSED_GATES(self, step, write, prefix)
    return self.b.op("Mul", log_decay, self.b.const(0.0, torch.float32)), beta


PLANTED = {
    "plain": (GatedDeltaNetGraph, "emit_delta_step", staticmethod(plain_step_without_decay)),
    "fused": (FusedGatedDeltaNetGraph, "emit_gates", fused_gates_without_decay),
}


@pytest.mark.parametrize(
    ("graph", "options"),
    [
        ("plain", []),
        ("fused", []),
        ("plain", ["--dtype", "float16"]),
        ("fused", ["--quantize", "int8", "--block-size", "16"]),
    ],
    ids=["plain", "fused", "plain-float16", "fused-int8"],
)
def test_verify_fails_on_a_recurrence_without_decay(graph, options, thinker_variant, tmp_path, monkeypatch):
    """The recurrence with its decay dropped (each graph form patched where it writes the decay): ``thinker export
    --verify`` refuses to write the folder, whichever check applies (float32, float16, and for int8 the graph against
    the model holding the same dequantized weights)."""
    cls, name, planted = PLANTED[graph]
    monkeypatch.setattr(cls, name, planted)
    output = tmp_path / "onnx"
    args = ["export", str(thinker_variant("qwen3_5")), str(output), "--graph", graph, *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    expected = (
        "against the model with the same dequantized weights" if "--quantize" in options else "disagrees with PyTorch"
    )
    assert expected in result.stderr and "the export was not written" in result.stderr, result.stderr
    assert not output.exists()


# --- the generate command ---------------------------------------------------------------------------------------------
def test_verify_fails_on_an_unpadded_branch_that_forgets_the_conv_state(thinker_variant, tmp_path, monkeypatch):
    """The fused graph's unpadded branch (every decode step takes it) with its conv reading zeros instead of the
    carried state: the prompt still matches, the decode steps do not, and ``thinker export --verify`` refuses."""
    conv = FusedGatedDeltaNetGraph.emit_causal_conv

    def forgetting(self, qkv, weight_name, past, present):
        return conv(self, qkv, weight_name, self.b.op("Sub", past, past), present)  # past - past: zeros

    monkeypatch.setattr(FusedGatedDeltaNetGraph, "emit_unpadded_conv", forgetting)
    output = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(thinker_variant("qwen3_5")), str(output), "--graph", "fused"])
    assert result.exit_code != 0 and "onnxruntime disagrees with PyTorch" in result.output, result.output
    assert not output.exists()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_generate_command_on_a_hybrid_folder(family, thinker_variant, onnx_variant):
    """``thinker generate`` on the ONNX folder (states carried by OnnxDecoder) writes what it writes on the
    Thinker folder (transformers)."""
    runner = CliRunner()
    prompt = ["--prompt", "the cat sat on the mat and ran", "--max-new-tokens", "12"]
    onnx_run = runner.invoke(main, ["generate", str(hybrid_export(onnx_variant, family, "fused")), *prompt])
    torch_run = runner.invoke(main, ["generate", str(thinker_variant(family)), *prompt])
    assert onnx_run.exit_code == 0 and torch_run.exit_code == 0, onnx_run.output + torch_run.output
    assert onnx_run.stdout.strip() and onnx_run.stdout == torch_run.stdout
