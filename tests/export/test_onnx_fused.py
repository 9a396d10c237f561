"""The fused graph (``thinker export --graph fused``): onnxruntime's contrib operators, the same IO contract, the
same parity checks as the plain graph (prefill + 6 decode steps on a left-padded batch of two), onnxruntime-genai.

The tiny families get head_dim 16 here (``FUSED_HEAD_DIM``), so that GroupQueryAttention applies RoPE itself;
head_dim 8 (RotaryEmbedding op + GroupQueryAttention) and 12 (plain attention) are the fallbacks, tested apart.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_helpers import record_parity

from export.contrib_schemas import register_onnxruntime_schemas
from export.exporter import count_ops
from export.runtime import OnnxDecoder
from export.verify import RIGHT, compare_decoders
from thinker_common.parity_inputs import parity_batch

FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gpt2", "uomni"]
GENAI_SCRIPT = Path(__file__).with_name("genai_greedy.py")


def load_thinker(folder, dtype=torch.float32):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def ops(folder: Path) -> Counter:
    return count_ops(onnx.load(folder / "model.onnx", load_external_data=False).graph)


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_parity(family, thinker_variant, onnx_variant):
    """The same bound as the plain graph: max |Δlogit| <= 1e-3, top-1 equal, at every kept position."""
    model = load_thinker(thinker_variant(family, head_dim=16))
    decoder = OnnxDecoder(onnx_variant(family), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)

    assert figures["positions"] == 7 + 4 + 6 * 2
    assert figures["max_abs_diff"] <= 1e-3, figures
    assert figures["top1_agreement"] == 1.0, figures


@pytest.mark.parametrize("family", FAMILIES)
def test_contrib_ops_replace_the_standard_ones(family, onnx_variant):
    counts = ops(onnx_variant(family))
    layers = 3
    assert counts["GroupQueryAttention"] == layers
    assert counts["Softmax"] == 0 and counts["Transpose"] == 0  # attention is all inside the op
    # RoPE inside GroupQueryAttention (head_dim 16), at positions the graph computes once (ArgMax over the mask).
    assert counts["RotaryEmbedding"] == 0 and counts["ArgMax"] == (0 if family == "gpt2" else 1)
    if family == "gpt2":
        assert counts["SkipLayerNormalization"] == 2 * layers
    else:
        # Every residual add feeds a norm (2 per layer); the first norm has no residual before it.
        assert counts["SkipSimplifiedLayerNormalization"] == 2 * layers
        assert counts["SimplifiedLayerNormalization"] == 1 + (2 * layers if family in ("qwen3", "qwen3_moe") else 0)
        assert counts["ReduceMean"] == 0 and counts["Sqrt"] == 0
    sparse = {"qwen3_moe": 2, "qwen2_moe": 1}.get(family, 0)  # sparse layers of the tiny MoE configs
    assert counts["MoE"] == sparse and counts["Loop"] == 0


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_gated_mlp_is_two_matmuls_without_a_split(family, onnx_variant):
    """Gate and up (of the dense MLP and of a shared expert) as two MatMuls over the same input, as the plain graph
    writes them: one packed MatMul and a Split of its output decoded slower under onnxruntime-genai (the Split is a
    copy and a kernel call per layer; export/fused_graph.py)."""
    graph = onnx.load(onnx_variant(family) / "model.onnx", load_external_data=False).graph
    mlp_nodes = [n for n in graph.node if "/mlp/" in n.name]
    assert mlp_nodes and not [n.name for n in mlp_nodes if n.op_type == "Split"]
    projections = {n.input[1].rsplit(".", 2)[-2] for n in mlp_nodes if n.op_type == "MatMul"}
    assert {"gate_proj", "up_proj", "down_proj"} <= projections


def test_io_contract_is_the_plain_graphs(onnx_folder, onnx_variant):
    """Same input and output names, element types and symbolic shapes as the plain graph."""

    def io(folder):
        graph = onnx.load(folder / "model.onnx", load_external_data=False).graph

        def describe(values):
            return [
                (
                    v.name,
                    v.type.tensor_type.elem_type,
                    [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
                )
                for v in values
            ]  # noqa: E501

        return describe(graph.input), describe(graph.output)

    assert io(onnx_variant("qwen3", head_dim=None)) == io(onnx_folder("qwen3"))


def test_checker_passes_with_the_onnxruntime_schemas(onnx_variant):
    """SimplifiedLayerNormalization is onnxruntime's (default domain, no onnx schema): export registers its schema
    so that the checker validates the graph, shapes included, rather than refusing it."""
    register_onnxruntime_schemas()
    onnx.checker.check_model(str(onnx_variant("qwen3_moe") / "model.onnx"), full_check=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_head_dim_8_rotates_with_the_rotary_embedding_op(family, thinker_variant, onnx_variant):
    """head_dim 8: GroupQueryAttention without RoPE, RotaryEmbedding ops (which read position_ids) before it;
    qk-norm comes first (Qwen3: norm, then RoPE)."""
    counts = ops(onnx_variant(family, head_dim=8))
    assert counts["GroupQueryAttention"] == 3 and counts["RotaryEmbedding"] == 6
    model = load_thinker(thinker_variant(family, head_dim=8))
    figures = compare_decoders(model, OnnxDecoder(onnx_variant(family, head_dim=8), provider="cpu"), *parity_batch(96))
    assert figures["max_abs_diff"] <= 1e-3 and figures["top1_agreement"] == 1.0, figures


def test_head_dim_12_keeps_the_plain_attention(thinker_folder, onnx_variant):
    """GroupQueryAttention needs head_dim % 8 == 0: the tiny Qwen3 (12) keeps the standard attention, the norms
    are still fused."""
    folder = onnx_variant("qwen3", head_dim=None)
    counts = ops(folder)
    assert counts["GroupQueryAttention"] == 0 and counts["Softmax"] == 3
    assert counts["SkipSimplifiedLayerNormalization"] == 6
    model = load_thinker(thinker_folder("qwen3"))
    figures = compare_decoders(model, OnnxDecoder(folder, provider="cpu"), *parity_batch(96))
    assert figures["max_abs_diff"] <= 1e-3 and figures["top1_agreement"] == 1.0, figures


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt2"])
def test_left_padded_rows_equal_rows_alone(family, onnx_variant):
    """GroupQueryAttention rotates by cache slot; a left-padded row is shifted by its pad count, which RoPE (and the
    learned positions, read from position_ids) cancel: each row gives the logits it gives alone."""
    decoder = OnnxDecoder(onnx_variant(family), provider="cpu")
    input_ids, attention_mask = parity_batch(96)
    batch_logits, state = decoder.prefill(input_ids, attention_mask)
    batch_steps = [decoder.decode_one_token(np.array([11, 12]), state)]
    batch_steps.append(decoder.decode_one_token(np.array([13, 14]), state))
    for row, tokens in enumerate([(11, 13), (12, 14)]):
        kept = attention_mask[row].astype(bool)
        alone, alone_state = decoder.prefill(input_ids[row : row + 1, kept], attention_mask[row : row + 1, kept])
        np.testing.assert_allclose(batch_logits[row, kept], alone[0], atol=1e-4)
        for step, token in zip(batch_steps, tokens, strict=True):
            np.testing.assert_allclose(
                step[row], decoder.decode_one_token(np.array([token]), alone_state)[0], atol=1e-4
            )


def test_a_left_padded_first_row(onnx_variant):
    """GroupQueryAttention rotates a prompt's tokens by the first element of position_ids, row 0's, for every row
    (parity_batch pads its second row): with the first row left-padded, its pads must still be given their slots
    (0 at slot 0), or every row's prompt is rotated a pad count past the positions its decode steps are rotated by."""
    decoder = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    input_ids, attention_mask = (np.ascontiguousarray(a[::-1]) for a in parity_batch(96))  # the padded row first
    assert not attention_mask[0, 0]
    batch_logits, state = decoder.prefill(input_ids, attention_mask)
    batch_step = decoder.decode_one_token(np.array([11, 12]), state)
    for row, token in enumerate([11, 12]):
        kept = attention_mask[row].astype(bool)
        alone, alone_state = decoder.prefill(input_ids[row : row + 1, kept], attention_mask[row : row + 1, kept])
        np.testing.assert_allclose(batch_logits[row, kept], alone[0], atol=1e-4)
        np.testing.assert_allclose(
            batch_step[row], decoder.decode_one_token(np.array([token]), alone_state)[0], atol=1e-4
        )


@pytest.mark.parametrize(("family", "graph"), [("qwen3", "fused"), ("gpt2", "fused"), ("gpt2", "plain")])
def test_every_norm_takes_the_configs_epsilon(family, graph, thinker_variant, onnx_variant):
    """rms_norm_eps 0.5, far from the ops' defaults (1e-5 for LayerNormalization, gpt2's own; 1e-12 for the contrib
    norms): (Skip)SimplifiedLayerNormalization, SkipLayerNormalization and LayerNormalization each read it."""
    model = load_thinker(thinker_variant(family, head_dim=16, rms_norm_eps=0.5))
    decoder = OnnxDecoder(onnx_variant(family, graph=graph, rms_norm_eps=0.5), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=1)
    assert figures["max_abs_diff"] <= 1e-3, figures


def test_gated_experts_of_another_activation_keep_the_loop(thinker_variant, onnx_variant):
    """onnxruntime's MoE op applies SwiGLU (SiLU) only: gated experts with another hidden_act (tanh GELU here) take
    the plain graph's Loop, and match PyTorch."""
    model = load_thinker(thinker_variant("qwen3_moe", head_dim=16, hidden_act="gelu_pytorch_tanh"))
    folder = onnx_variant("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    assert ops(folder)["MoE"] == 0 and ops(folder)["Loop"] == 2
    figures = compare_decoders(model, OnnxDecoder(folder, provider="cpu"), *parity_batch(96), steps=2)
    assert figures["max_abs_diff"] <= 1e-3 and figures["top1_agreement"] == 1.0, figures


def test_a_pad_between_a_prompts_tokens(onnx_variant):
    """A mask with a pad between a row's tokens: the plain graph (positions from the mask) gives the row without the
    pad; the fused graph's GroupQueryAttention numbers a prompt's tokens by slot, so every token after the pad was
    rotated a position too far, silently (2.5 apart on SmolLM2; a QA run). OnnxDecoder refuses it by row, with or
    without positions given, and still takes a pad after the tokens."""
    from thinker_common.errors import ThinkerError

    tokens = np.array([[3, 14, 15, 92, 65, 35]], dtype=np.int64)
    holed = np.array([[1, 1, 0, 1, 1, 1]], dtype=np.int64)
    plain = OnnxDecoder(onnx_variant("qwen3", graph="plain"), provider="cpu")
    alone, _ = plain.prefill(tokens[:, holed[0] == 1], np.ones((1, 5), np.int64))
    with_pad, _ = plain.prefill(tokens, holed)
    np.testing.assert_allclose(with_pad[0, holed[0] == 1], alone[0], atol=1e-4)

    fused = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    message = "row 0 of attention_mask masks a slot between its new tokens, and this graph's GroupQueryAttention"
    with pytest.raises(ThinkerError, match=message):
        fused.prefill(tokens, holed)
    with pytest.raises(ThinkerError, match=message):
        fused.prefill(tokens, holed, position_ids=np.maximum(np.cumsum(holed, axis=1) - 1, 0))
    right, _ = fused.prefill(tokens, np.array([[1, 1, 1, 1, 1, 0]]))
    np.testing.assert_allclose(right[0, :5], fused.prefill(tokens[:, :5], np.ones((1, 5), np.int64))[0][0], atol=1e-4)


def test_several_new_tokens_after_a_cache_need_batch_1(onnx_variant):
    """Chunked prefill: batch 1 equals the one-shot prefill; at batch 2 onnxruntime's kernel refuses (a limit the
    plain graph does not have; OnnxDecoder's prefill and decode steps and onnxruntime-genai never ask for it), and
    OnnxDecoder.forward says so by name before the kernel does."""
    from thinker_common.errors import ThinkerError

    decoder = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    tokens = np.array([[3, 14, 15, 92, 65, 35, 89, 79]], dtype=np.int64)
    full, _ = decoder.prefill(tokens, np.ones_like(tokens))
    _, state = decoder.prefill(tokens[:, :3], np.ones((1, 3), np.int64))
    state.attention_mask = np.ones((1, 8), np.int64)
    chunk = decoder.forward(tokens[:, 3:], np.arange(3, 8)[None], state)
    np.testing.assert_allclose(chunk[0], full[0, 3:], atol=1e-4)

    batch = np.repeat(tokens, 2, axis=0)
    positions = np.repeat(np.arange(3, 8)[None], 2, axis=0)
    _, state = decoder.prefill(batch[:, :3], np.ones((2, 3), np.int64))
    state.attention_mask = np.ones((2, 8), np.int64)
    with pytest.raises(ThinkerError, match="5 new tokens after a non-empty cache at batch 2.*--graph plain"):
        decoder.forward(batch[:, 3:], positions, state)
    feeds = {"input_ids": batch[:, 3:], "attention_mask": state.attention_mask, "position_ids": positions}
    with pytest.raises(Exception, match="batch_size must be 1"):  # the kernel's own limit, which the refusal names
        decoder.session.run(None, {**feeds, **state.cache})


def test_one_kv_buffer_bound_as_past_and_present(onnx_variant):
    """The in-place mode genai_config.json turns on, which OnnxDecoder runs on the CPU: each GroupQueryAttention's
    past and present bound to one buffer, updated at the mask's slots. On the left-padded batch it gives the copying
    form's logits (the cache concatenated into a new present every step) through a buffer that grows (prefill sized
    for the prompt alone) and one sized up front (generate); a step with room writes the same array in place."""
    folder = onnx_variant("qwen3_moe")
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is True
    shared, copying = OnnxDecoder(folder, provider="cpu"), OnnxDecoder(folder, provider="cpu", share_kv=False)
    assert shared.shared_kv == set(shared.past_names) and not copying.shared_kv
    input_ids, attention_mask = parity_batch(96)
    logits, state = shared.prefill(input_ids, attention_mask)
    expected, reference = copying.prefill(input_ids, attention_mask)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-6)
    key = shared.past_names[0]
    assert state.cache[key].shape[2] == input_ids.shape[1]  # no room yet: the first step doubles it
    sized_logits, sized = shared.prefill(input_ids, attention_mask, new_tokens=5)  # as generate sizes it
    assert all(sized.cache[name].shape[2] == input_ids.shape[1] + 5 for name in shared.shared_kv)
    held = dict(sized.cache)
    shared.decode_one_token(sized_logits[:, -1].argmax(-1), sized)  # a step with room: written in place
    assert all(sized.cache[name] is held[name] for name in shared.shared_kv)
    token = expected[:, -1].argmax(-1)
    for step in range(3):
        before = state.cache[key]
        logits = shared.decode_one_token(token, state)
        expected = copying.decode_one_token(token, reference)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-6, err_msg=f"step {step}")
        assert state.cache[key].shape[2] == 2 * input_ids.shape[1]
        assert (state.cache[key] is before) == (step > 0)  # grown once, then written in place
        token = expected.argmax(-1)
    np.testing.assert_array_equal(
        shared.generate(input_ids, attention_mask, max_new_tokens=5),
        copying.generate(input_ids, attention_mask, max_new_tokens=5),
    )


def test_plain_graph_keeps_distinct_past_and_present(onnx_folder):
    genai = json.loads((onnx_folder("qwen3") / "genai_config.json").read_text())
    assert genai["search"]["past_present_share_buffer"] is False  # Concat: present is a new tensor


def test_moe_op_runs_only_the_routed_experts(tmp_path):
    """As for the plain graph's Loop: an expert full of NaN poisons exactly the tokens routed to it (a dense pass
    over every expert would poison every token: 0 x NaN = NaN). The exporter refuses NaN weights, so the NaN goes
    into the exported weights file and into the PyTorch model in memory."""
    from export_helpers import save_thinker

    from export.exporter import export_model

    folder = save_thinker(
        tmp_path / "moe", "qwen3_moe", tokenizer=False, num_hidden_layers=1, mlp_only_layers=[], head_dim=16
    )
    export_model(folder, tmp_path / "onnx", verify=False, graph="fused")
    name, expert = "model.layers.0.mlp.experts.down_proj", 3
    poison_expert(tmp_path / "onnx", name, expert)
    model = load_thinker(folder)
    with torch.no_grad():
        model.get_parameter(name)[expert] = float("nan")

    tokens = np.arange(40, dtype=np.int64)[:, None]
    logits, _ = OnnxDecoder(tmp_path / "onnx", provider="cpu").prefill(tokens, np.ones_like(tokens))
    with torch.no_grad():
        reference = model(torch.from_numpy(tokens)).logits.numpy()
    poisoned = np.isnan(reference[:, 0]).any(-1)
    assert 0 < poisoned.sum() < len(tokens)
    np.testing.assert_array_equal(np.isnan(logits[:, 0]).any(-1), poisoned)
    np.testing.assert_allclose(logits[~poisoned], reference[~poisoned], atol=1e-4)


def poison_expert(folder: Path, name: str, expert: int) -> None:
    """Overwrites expert ``expert`` of the float32 (E, ...) initializer ``name`` with NaN in model.onnx.data."""
    from export.weights_stamp import stamp_weights

    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    (tensor,) = [t for t in graph.initializer if t.name == name]
    where = {entry.key: entry.value for entry in tensor.external_data}
    per_expert = int(np.prod(tensor.dims[1:]))
    data = np.memmap(
        folder / where["location"],
        dtype=np.float32,
        mode="r+",
        offset=int(where["offset"]),
        shape=(tensor.dims[0], per_expert),
    )
    data[expert] = np.nan
    data.flush()
    # a planted change of the weights on purpose: stamped again, as the export stamps what it writes (a graph beside
    # weights that differ from its stamp is refused: export/weights_stamp.py)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    stamp_weights(model, folder / where["location"])
    onnx.save_model(model, folder / "model.onnx")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt2"])
def test_float16_parity_on_cpu(family, thinker_variant, onnx_variant):
    model = load_thinker(thinker_variant(family, head_dim=16), torch.float16)
    decoder = OnnxDecoder(onnx_variant(family, "float16"), provider="cpu")
    figures = compare_decoders(model, decoder, *parity_batch(model.config.vocab_size), steps=6)
    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures
    assert figures["top1_agreement"] >= 0.9, figures


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt2"])
def test_bfloat16_graph_is_the_float32_graph_in_bfloat16(family, onnx_variant):
    """onnxruntime's CPU provider has no bfloat16 kernels (and onnx's reference evaluator no contrib ops), so on CPU
    the bfloat16 graph is checked with shapes and compared node for node with the float32 one; it runs on CUDA
    (test_cuda_bfloat16_fused_parity)."""
    register_onnxruntime_schemas()
    path = onnx_variant(family, "bfloat16") / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    bf16 = onnx.load(path, load_external_data=False).graph
    fp32 = onnx.load(onnx_variant(family) / "model.onnx", load_external_data=False).graph
    # Node for node, but for the casts: a bfloat16 graph computes its GELU and its logits in float32 (the logits
    # cast to the float32 output; a float32 graph writes them directly, by the head or through an Identity
    # onnxruntime folds away).
    bf16_ops = [n.op_type for n in bf16.node if n.op_type != "Cast"]
    fp32_ops = [n.op_type for n in fp32.node if n.op_type not in ("Cast", "Identity")]
    assert bf16.node[-1].op_type == "Cast" and bf16.node[-1].output == ["logits"] and fp32.node[-1].output == ["logits"]
    assert bf16_ops == fp32_ops
    cache = [v for v in bf16.input if v.name.startswith("past_key_values.")]
    assert {v.type.tensor_type.elem_type for v in cache} == {onnx.TensorProto.BFLOAT16}


GENAI_CASES = [("qwen3", "float32"), ("qwen3_moe", "float32"), ("gpt2", "float32"), ("qwen3", "float16")]


def test_genai_greedy_equals_transformers(genai_python, thinker_variant, onnx_variant):
    """onnxruntime-genai runs the fused folders as written; greedy tokens equal transformers' greedy tokens."""
    prompt, new_tokens = [5, 9, 17, 33, 4, 21], 10
    cases = [
        {"folder": str(onnx_variant(f, d)), "prompt": prompt, "max_new_tokens": new_tokens} for f, d in GENAI_CASES
    ]
    done = subprocess.run(
        [str(genai_python), str(GENAI_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for (family, dtype), sequence in zip(GENAI_CASES, json.loads(done.stdout), strict=True):
        model = load_thinker(thinker_variant(family, head_dim=16), getattr(torch, dtype))
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0].tolist()
        assert sequence == expected, f"{family} {dtype}: genai {sequence} != transformers {expected}"


# Unequal lengths, so that onnxruntime-genai pads the short row (on the right, as it does itself; genai_greedy.py);
# no pad id (0) inside a prompt. An equal-length pair rides along: the shared KV buffer at batch 2 without padding.
BATCH_PROMPTS = [[5, 9, 17, 33, 4, 21, 8, 7], [11, 12, 13]]
EQUAL_PROMPTS = [[5, 9, 17, 33, 4, 21, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18]]
BATCH_CASES = [(f, g) for f in ("qwen2", "qwen3", "qwen3_moe") for g in ("plain", "fused")]


def greedy_alone(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, every id a token (an explicit mask of ones: generate would
    mask pad ids itself), up to and without its eos (where genai stops a row)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
        )
    tokens = out[0, len(prompt) :].tolist()
    eos = model.config.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def test_genai_batch_equals_rows_alone(genai_python, thinker_variant, onnx_variant):
    """Both graphs under onnxruntime-genai at batch 2 (the fused one through its shared KV buffer), rows of unequal
    length padded as genai pads them, on the right: each row gets transformers' greedy tokens for that row alone.
    The fused graph failed this on the short row while GroupQueryAttention rotated by cache slot (genai leaves the
    pad slots between a short row's prompt and its new tokens); it rotates by position_ids now. A left-padded
    batch, which genai does not make, it reads as prompts that begin with pad tokens (mask 1): the last case pins
    that, against transformers on the padded prompt taken as text."""
    new_tokens = 10
    cases = [
        {"folder": str(onnx_variant(f, graph=g)), "prompts": prompts, "max_new_tokens": new_tokens}
        for f, g in BATCH_CASES
        for prompts in (BATCH_PROMPTS, EQUAL_PROMPTS)
    ]
    cases.append({"folder": str(onnx_variant("qwen3")), "prompts": BATCH_PROMPTS, "max_new_tokens": new_tokens})
    cases[-1]["pad"] = "left"
    done = subprocess.run(
        [str(genai_python), str(GENAI_SCRIPT)], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)

    def cut(tokens: list[int], eos: int) -> list[int]:
        return tokens[: tokens.index(eos)] if eos in tokens else tokens

    for index, (family, graph) in enumerate(BATCH_CASES):
        model = load_thinker(thinker_variant(family, head_dim=16))
        for prompts, rows in zip((BATCH_PROMPTS, EQUAL_PROMPTS), results[2 * index : 2 * index + 2], strict=True):
            for prompt, row in zip(prompts, rows, strict=True):
                expected = greedy_alone(model, prompt, new_tokens)
                assert cut(row, model.config.eos_token_id) == expected, f"{family} {graph} {prompt}: {row}"

    model = load_thinker(thinker_variant("qwen3", head_dim=16))
    width = max(map(len, BATCH_PROMPTS))
    for prompt, row in zip(BATCH_PROMPTS, results[-1], strict=True):
        as_text = [model.config.pad_token_id] * (width - len(prompt)) + prompt
        assert cut(row, model.config.eos_token_id) == greedy_alone(model, as_text, new_tokens), prompt


# --- CUDA (skipped unless a CUDA session really runs) ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "gpt2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.gpu
def test_cuda_half_precision_parity(family, dtype, thinker_variant, onnx_variant, record_property):
    """The fused half-precision graph on CUDA (GroupQueryAttention's CUDA kernel, MoE's) against PyTorch in float32,
    on the left-padded batch: top-1 agreement and logits within the half-precision bound."""
    model = load_thinker(thinker_variant(family, head_dim=16))
    decoder = OnnxDecoder(onnx_variant(family, dtype), provider="cuda")
    figures = compare_decoders(model, decoder, *parity_batch(96), steps=6)
    record_parity(record_property, figures)
    bound = {"float16": 2e-2, "bfloat16": 5e-2}[dtype]
    assert figures["top1_agreement"] >= 0.9, figures
    assert figures["max_abs_diff"] <= bound * max(1.0, figures["logit_scale"]), figures


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.gpu
def test_cuda_genai_graph_on_right_padded_rows(family, thinker_variant, onnx_variant, record_property):
    """model.genai.onnx in float16 on CUDA (GroupQueryAttention without the padding bias: the kernel's path that
    onnxruntime-genai runs) on the parity batch's rows padded on the right, against PyTorch in float32 on each row's
    own result."""
    model = load_thinker(thinker_variant(family, head_dim=16))
    decoder = OnnxDecoder(onnx_variant(family, "float16") / "model.genai.onnx", provider="cuda")
    figures = compare_decoders(model, decoder, *parity_batch(96), steps=6, candidate_padding=RIGHT)
    record_parity(record_property, figures)
    assert figures["top1_agreement"] >= 0.9, figures
    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures


@pytest.mark.gpu
def test_cuda_io_binding_keeps_the_fused_cache_on_the_device(onnx_variant):
    import onnxruntime as ort

    cuda = OnnxDecoder(onnx_variant("qwen3", "float16"), provider="cuda")
    cpu = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    input_ids, attention_mask = parity_batch(96)
    _, cuda_state = cuda.prefill(input_ids, attention_mask)
    cpu_logits, cpu_state = cpu.prefill(input_ids, attention_mask)
    token = cpu_logits[:, -1].argmax(-1)
    for _ in range(3):
        assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in cuda_state.cache.values())
        cuda_logits, cpu_logits = cuda.decode_one_token(token, cuda_state), cpu.decode_one_token(token, cpu_state)
        np.testing.assert_allclose(cuda_logits, cpu_logits, atol=5e-2)  # float16 against float32
        token = cpu_logits.argmax(-1)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.gpu
def test_cuda_shared_kv_buffer(family, thinker_variant, onnx_variant, record_property):
    """The shared KV buffer on CUDA (the default there for float16 and float32 caches): one device buffer per layer
    bound as GroupQueryAttention's past and present. On the left-padded batch it holds the float16 bound against
    PyTorch in float32, as the copying form does, and gives the copying form's logits; the buffer grows once through
    the host (a prefill sized for the prompt alone) and is written in place after; a bfloat16 cache keeps the
    copying form by default, and asking it to share is refused by name."""
    import onnxruntime as ort

    from thinker_common.errors import ThinkerError

    model = load_thinker(thinker_variant(family, head_dim=16))
    folder = onnx_variant(family, "float16")
    shared, copying = OnnxDecoder(folder, provider="cuda"), OnnxDecoder(folder, provider="cuda", share_kv=False)
    assert shared.shared_kv == set(shared.past_names) and not copying.shared_kv  # the default: shared on CUDA
    figures = compare_decoders(model, shared, *parity_batch(96), steps=6)
    record_parity(record_property, figures)
    assert figures["top1_agreement"] >= 0.9, figures
    assert figures["max_abs_diff"] <= 2e-2 * max(1.0, figures["logit_scale"]), figures

    input_ids, attention_mask = parity_batch(96)
    logits, state = shared.prefill(input_ids, attention_mask)
    expected, reference = copying.prefill(input_ids, attention_mask)
    np.testing.assert_allclose(logits, expected, atol=2e-2 * max(1.0, np.abs(expected).max()))
    key = shared.past_names[0]
    token = expected[:, -1].argmax(-1)
    for step in range(3):
        before = state.cache[key]
        logits = shared.decode_one_token(token, state)
        expected = copying.decode_one_token(token, reference)
        np.testing.assert_allclose(logits, expected, atol=2e-2 * max(1.0, np.abs(expected).max()), err_msg=f"{step}")
        buffer = state.cache[key]
        assert isinstance(buffer, ort.OrtValue) and buffer.device_name().lower() == "cuda"
        assert buffer.shape()[2] == 2 * input_ids.shape[1] and (buffer is before) == (step > 0)
        token = expected.argmax(-1)
    assert not OnnxDecoder(onnx_variant(family, "bfloat16"), provider="cuda").shared_kv
    with pytest.raises(ThinkerError, match="share_kv=True on CUDA takes a float16 or float32 cache, not bfloat16"):
        OnnxDecoder(onnx_variant(family, "bfloat16"), provider="cuda", share_kv=True)
