"""The graph variants' helpers held to what their docstrings promise, where the end-to-end checks pass either way:
the half-precision spread's perturbation (export/half_spread.py), the deep-cache pass's random slots in every cache it
edits (export/deep_cache.py), the ``--inputs-embeds`` cut's guard (export/embeds_graph.py), and ``model.genai.onnx``'s
stamps, those of the ``model.onnx`` it is cut from (export/genai_graph.py); then Qwen3.8's perturbed run (its token ids
beside the moved embeddings) and the DeepStack adds in a half-precision graph."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from export.deep_cache import compare_deep, write_random_slots
from export.embeds_graph import check_reads_shape_only, write_embeds_graphs
from export.half_spread import UNIT_ROUNDOFF, HalfShadow, scaled_at_random
from export.names import DTYPE_KEY, EXPORT_ID_KEY, GENAI_MODEL_FILE, PADDING_KEY
from export.runtime import OnnxDecoder
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.eager import EAGER
from thinker_common.parity_inputs import DEEP_DECODE_STEPS, DEEP_PROMPT_LENGTH


# --- half_spread: one rounding's worth of change, either way ----------------------------------------------------
def test_unit_roundoff_is_half_each_dtypes_machine_epsilon():
    """float16 keeps 10 fraction bits (2^-11), bfloat16 7 (2^-8): the largest relative error of one rounding."""
    assert UNIT_ROUNDOFF == {dtype: torch.finfo(dtype).eps / 2 for dtype in (torch.float16, torch.bfloat16)}
    assert UNIT_ROUNDOFF[torch.float16] == 2.0**-11 and UNIT_ROUNDOFF[torch.bfloat16] == 2.0**-8


def test_the_perturbation_scales_each_entry_up_or_down_by_its_own_sign():
    """Each entry moved by 1 + r or 1 - r, the signs drawn from the seed, about half each way: a uniform scale
    (every sign alike) would be what the model's first RMSNorm takes out again, not one rounding of the inputs."""
    embeddings = torch.full((2, 5, 64), 3.0)
    relative = UNIT_ROUNDOFF[torch.float16]
    moved = scaled_at_random(embeddings, relative, seed=7)
    ratio = (moved / embeddings - 1) / relative
    torch.testing.assert_close(ratio.abs(), torch.ones_like(ratio), rtol=1e-3, atol=0)
    up = float((ratio > 0).float().mean())
    assert 0.4 < up < 0.6, up  # 640 entries, each sign a fair coin
    assert not torch.equal(torch.sign(ratio[0, 0]), torch.sign(ratio[0, 1]))  # per entry, not per position
    torch.testing.assert_close(scaled_at_random(embeddings, relative, seed=7), moved, rtol=0, atol=0)
    assert not torch.equal(scaled_at_random(embeddings, relative, seed=8), moved)


# --- deep_cache: the random slots, in every full-attention layer, at its own scale --------------------------------
def reference_cache(folder, length: int = DEEP_PROMPT_LENGTH):
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32, **EAGER).eval()
    ids = torch.arange(3, 3 + length)[None]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return model, getattr(out, CACHE_ARG)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_random_slots_go_before_every_full_attention_layers_cache_at_its_scale(family, thinker_variant):
    """The same block before the prompt's slots in the reference's cache and in the graph's (its dtype), in every
    full-attention layer (a linear-attention layer holds no slots), drawn at that layer's own key and value scale."""
    model, cache = reference_cache(thinker_variant(family))
    slots = 200
    attention = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert attention
    prompt = {i: (cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in attention}
    graph_cache = {
        f"past_key_values.{i}.{kind}": tensor.numpy().astype(np.float16)
        for i, (keys, values) in prompt.items()
        for kind, tensor in (("key", keys), ("value", values))
    }
    written = write_random_slots(cache, graph_cache, SimpleNamespace(device="cpu"), slots, keep=True)
    assert sorted(written) == attention
    for i, held in prompt.items():
        for kind, before, after, block in zip(
            ("key", "value"), held, (cache.layers[i].keys, cache.layers[i].values), written[i], strict=True
        ):
            assert after.shape[2] == DEEP_PROMPT_LENGTH + slots, (i, kind)
            torch.testing.assert_close(after[:, :, slots:], before, rtol=0, atol=0)  # the prompt's, after the block
            torch.testing.assert_close(after[:, :, :slots], block, rtol=0, atol=0)
            graph = graph_cache[f"past_key_values.{i}.{kind}"]
            assert graph.dtype == np.float16 and graph.shape == tuple(after.shape)
            np.testing.assert_array_equal(graph[:, :, :slots], block.numpy().astype(np.float16))
            ratio = float(block.std()) / float(before.std())
            assert 0.8 < ratio < 1.25, (i, kind, ratio)  # the layer's own scale, not a fixed one


def test_random_slots_keep_a_shared_buffers_room_for_the_steps(thinker_variant):
    """A shared KV buffer holds the prompt's slots and then room for the steps that follow (zeros): the slots go
    before the prompt's and the room stays after them, so the first step writes in place rather than growing (and
    copying) the whole deep cache."""
    model, cache = reference_cache(thinker_variant("qwen3"))
    slots, room = 50, 6
    graph_cache = {}
    for i, layer in enumerate(cache.layers):
        for kind, tensor in (("key", layer.keys), ("value", layer.values)):
            buffer = np.zeros((*tensor.shape[:2], DEEP_PROMPT_LENGTH + room, tensor.shape[3]), np.float32)
            buffer[:, :, :DEEP_PROMPT_LENGTH] = tensor.numpy()
            graph_cache[f"past_key_values.{i}.{kind}"] = buffer
    prompt = {name: buffer[:, :, :DEEP_PROMPT_LENGTH].copy() for name, buffer in graph_cache.items()}
    write_random_slots(cache, graph_cache, SimpleNamespace(device="cpu"), slots)
    for name, buffer in graph_cache.items():
        i, kind = int(name.split(".")[1]), name.rpartition(".")[2]
        reference = getattr(cache.layers[i], f"{kind}s").numpy()
        assert buffer.shape[2] == slots + DEEP_PROMPT_LENGTH + room, name
        np.testing.assert_array_equal(buffer[:, :, : slots + DEEP_PROMPT_LENGTH], reference)
        np.testing.assert_array_equal(buffer[:, :, slots : slots + DEEP_PROMPT_LENGTH], prompt[name])
        assert not buffer[:, :, slots + DEEP_PROMPT_LENGTH :].any(), name


def test_the_deep_pass_never_grows_a_shared_kv_buffer(thinker_variant, onnx_variant, monkeypatch):
    """The fused graph's KV buffers, shared by each step's past and present, are sized once by the prefill and
    keep that room past the random slots: no step of the pass copies the deep cache into a larger buffer."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", head_dim=16) / "model.onnx", provider="cpu")
    assert decoder.shared_kv
    grown = []
    reserve = OnnxDecoder._reserve_kv

    def recording(self, state):
        before = {name: state.cache[name] for name in self.shared_kv}
        reserve(self, state)
        grown.extend(name for name in self.shared_kv if state.cache[name] is not before[name])

    monkeypatch.setattr(OnnxDecoder, "_reserve_kv", recording)
    steps = []
    figures = compare_deep(model.eval(), decoder, lambda *step: steps.append(step), most_slots=40)
    assert figures["random_slots"] == 40 and len(steps) == DEEP_DECODE_STEPS
    assert grown == []
    for reference, candidate, _ in steps:
        assert float(np.abs(reference - candidate).max()) <= 1e-4 * max(1.0, float(np.abs(reference).max()))


def test_the_deep_pass_writes_its_slots_into_the_half_shadows_caches(thinker_variant, onnx_variant):
    """A float16 check's shadow runs its half and its perturbed steps behind the same random slots as the reference:
    both its caches hold the deep cache and the steps, so its spreads there are those of the same attention."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen3", head_dim=16), dtype=torch.float32, **EAGER)
    decoder = OnnxDecoder(onnx_variant("qwen3", dtype="float16") / "model.onnx", provider="cpu")
    shadow = HalfShadow(model.eval(), torch.float16)
    steps = []
    figures = compare_deep(model, decoder, lambda *step: steps.append(step), shadow=shadow, most_slots=40)
    assert figures["random_slots"] == 40 and figures["cache_slots"] == 40 + DEEP_PROMPT_LENGTH
    assert len(steps) == DEEP_DECODE_STEPS
    for past in (shadow.past, shadow.perturbed_past):
        assert past.get_seq_length() == figures["cache_slots"] + DEEP_DECODE_STEPS
    for reference, candidate, spread in steps:
        # the half run against the float32 one over the same 40 slots: rounding apart, well inside the tolerance
        assert spread.shape == (1,) and 0 < float(spread[0]) < 0.05 * max(1.0, float(np.abs(reference).max()))
        assert float(np.abs(reference - candidate).max()) <= 0.05 * max(1.0, float(np.abs(reference).max()))


# --- embeds_graph: the cut decoder may read only input_ids' batch and sequence axes ------------------------------
@pytest.mark.parametrize(
    ("op", "attributes", "allowed"),
    [
        ("Shape", {"start": 0, "end": 1}, True),
        ("Shape", {"start": 1, "end": 2}, True),
        ("Shape", {"end": 2}, True),
        ("Shape", {"start": 0, "end": 3}, False),  # inputs_embeds' third axis is hidden, not in input_ids
        ("Shape", {}, False),  # the whole shape: a rank the embeddings do not share
        ("Shape", {"start": -1, "end": 2}, False),
        ("Gather", {"axis": 0}, False),  # the ids' values
    ],
)
def test_the_cut_refuses_a_node_reading_more_of_the_ids_than_their_batch_and_sequence(op, attributes, allowed):
    node = helper.make_node(op, ["input_ids", *(["w"] if op == "Gather" else [])], ["out"], "/planted", **attributes)
    if allowed:
        check_reads_shape_only(node)
    else:
        with pytest.raises(RuntimeError, match=r"node /planted \(" + op + r"\) reads the token ids themselves"):
            check_reads_shape_only(node)


def test_the_cut_refuses_a_decoder_reading_the_ids_values(tmp_path):
    """write_embeds_graphs runs the guard on every node of the cut decoder that reads input_ids: a graph that reads
    the ids' values outside the token lookup (as Qwen3.8's n-gram hash does) is refused, not cut into a graph that
    reads the embeddings in their place."""
    ids = helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])
    out = helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", 4])
    table = helper.make_tensor("table", onnx.TensorProto.FLOAT, [8, 4], [0.5] * 32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["rows"], "/model/embed/tokens/Gather"),
        helper.make_node("Cast", ["input_ids"], ["id_values"], "/model/hash/Cast", to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["id_values", "last"], ["id_column"], "/model/hash/Unsqueeze"),
        helper.make_node("Add", ["rows", "id_column"], ["logits"], "/model/Add"),
    ]
    last = helper.make_tensor("last", onnx.TensorProto.INT64, [1], [-1])
    graph = helper.make_graph(nodes, "planted", [ids], [out], [table, last])
    onnx.save(helper.make_model(graph), tmp_path / "model.onnx")
    with pytest.raises(RuntimeError, match=r"node /model/hash/Cast \(Cast\) reads the token ids themselves"):
        write_embeds_graphs(tmp_path / "model.onnx", torch.float32, hidden_size=4)


# --- genai_graph: model.onnx's stamps, and the padding it takes -------------------------------------------------
def stamps(path) -> dict[str, str]:
    return {prop.key: prop.value for prop in onnx.load(path, load_external_data=False).metadata_props}


def test_the_genai_graph_keeps_model_onnx_stamps(onnx_variant):
    """Its dtype (which OnnxDecoder reads to refuse float inputs a float16 cast turns to inf), the export id and the
    weights file's stamps are model.onnx's, since it reads the same data file; it adds the padding it takes."""
    folder = onnx_variant("qwen3", dtype="float16")
    fused, genai = stamps(folder / "model.onnx"), stamps(folder / GENAI_MODEL_FILE)
    assert fused[DTYPE_KEY] == "float16" and EXPORT_ID_KEY in fused and PADDING_KEY not in fused
    assert genai == {**fused, PADDING_KEY: "right"}
    decoder = OnnxDecoder(folder / GENAI_MODEL_FILE, provider="cpu")
    assert (decoder.dtype, decoder.input_overflow, decoder.right_padding_only) == ("float16", 65520.0, True)


def test_qwen3_8s_perturbed_run_hashes_the_ids_its_embeddings_were_looked_up_from(thinker_variant):
    """Qwen3.8's n-gram layers hash the token ids: moved embeddings are no row of the table to read them back from,
    so the perturbed run is given the ids beside them, and its spread is that of the same tokens, not a refusal."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(thinker_variant("qwen4_exp"), dtype=torch.float32, **EAGER).eval()
    assert model.config.ple_layer_ids
    ids = torch.tensor([[3, 5, 7, 11]])
    shadow = HalfShadow(model, torch.float16)
    moved = shadow.perturbed_inputs({"input_ids": ids}, seed=1)
    torch.testing.assert_close(moved["ple_input_ids"], ids, rtol=0, atol=0)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        spread = shadow.spread(reference, input_ids=ids)
        perturbed = model(**moved).logits
    assert spread.shape == (1, 4)
    assert (spread >= (perturbed - reference).abs().amax(-1).numpy() - 1e-6).all()  # the further of the two runs
    assert 0 < float(spread.max()) < 0.05 * float(reference.abs().max())  # one rounding's worth, not a bug's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deepstack_rows_are_added_after_their_layers_in_the_graphs_dtype(dtype):
    """add_deepstack turns each layer's mark into the add of deepstack_embeds' row for that layer (float32 in every
    dtype, as inputs_embeds is), cast to the graph's dtype first, as transformers casts the features to the hidden
    states'."""
    from export.decoder_graph import make_model
    from export.embeds_graph import add_deepstack
    from export.graph_builder import TORCH_TO_ONNX
    from export.names import DEEPSTACK_EMBEDS

    half = TORCH_TO_ONNX[dtype]
    nodes = [helper.make_node("Identity", ["hidden"], ["/model/deepstack.0/out"], "/model/deepstack.0/Identity")]
    nodes.append(helper.make_node("Mul", ["/model/deepstack.0/out", "two"], ["mid"], "/model/layers.1/Mul"))
    nodes.append(helper.make_node("Identity", ["mid"], ["out"], "/model/deepstack.1/Identity"))
    graph = helper.make_graph(
        nodes,
        "deepstack",
        [helper.make_tensor_value_info(name, half, [1, 3, 4]) for name in ("hidden",)]
        + [helper.make_tensor_value_info(DEEPSTACK_EMBEDS, onnx.TensorProto.FLOAT, [2, 1, 3, 4])],
        [helper.make_tensor_value_info("out", half, [1, 3, 4])],
        [helper.make_tensor("two", half, [], [2.0])],
    )
    assert add_deepstack(graph, dtype) == 2
    session = ort.InferenceSession(make_model(graph, {}).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    hidden = rng.normal(size=(1, 3, 4)).astype(np_dtype)
    features = rng.normal(size=(2, 1, 3, 4)).astype(np.float32)
    (out,) = session.run(None, {"hidden": hidden, DEEPSTACK_EMBEDS: features})
    rows = features.astype(np_dtype)
    assert out.dtype == np_dtype
    np.testing.assert_allclose(out, (hidden + rows[0]) * 2 + rows[1], rtol=1e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize(("beyond", "positions", "passes"), [(2, 20, True), (2, 10, False), (1, 10, True)])
def test_at_most_a_tenth_of_the_positions_are_excused(beyond, positions, passes):
    """One position in ten beyond the tolerance may be excused by its spread; two in ten fail the check, saying so."""
    from export.verify import Agreement, judge

    reference = np.zeros((positions, 4), dtype=np.float32)
    candidate = reference.copy()
    candidate[:beyond, 0] = 3.0  # beyond the tolerance 1, within twice the spread of 2
    agreement = Agreement()
    agreement.add(reference, candidate, np.array([2.0] * beyond + [0.0] * (positions - beyond)))
    failure = judge(agreement.figures(), 1.0)
    if passes:
        assert failure is None
    else:
        assert failure.startswith(f"{beyond} of {positions} positions lie beyond the tolerance 1"), failure
