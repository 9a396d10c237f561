"""``--inputs-embeds``: ``model.embeds.onnx`` takes ``inputs_embeds`` in place of token ids and ``embed.onnx`` looks the
tokens up, so the embeddings of audio, image and video towers reach the ONNX decoder at their multimodal positions.

Held to: the PyTorch Thinker fed the same embeddings and positions (a block of foreign vectors over an image grid's
(3, B, T) positions, each row then resuming past the block's largest position, as transformers' ``rope_deltas`` do);
``model.onnx`` itself, bit for bit, on token prompts; the export's verify, which fails on a planted bug in either
graph or in the runtime's next position; and the refusals, each by name."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest
import torch
from cli_helpers import thinker
from onnx import helper
from references import qwen2_vl, qwen3_asr, qwen3_omni, qwen3_vl

from export import runtime
from export.exporter import export_model
from export.names import EMBED_FILE, EMBEDS_MODEL_FILE, GENAI_MODEL_FILE, INPUTS_EMBEDS
from export.quantize import QuantizeSpec
from export.runtime import OnnxDecoder
from export.verify import STREAMED, WHOLE, verify_export
from thinker import ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, foreign_block_prompt, parity_batch

CASES = [
    ("qwen3", "float32", "fused"),
    ("qwen3", "float32", "plain"),
    ("qwen3_moe", "float32", "fused"),
    ("gpt2", "float32", "fused"),  # learned positions (added in the decoder, after the cut), a tied head
    ("qwen3_5", "float32", "fused"),  # hybrid, interleaved multimodal RoPE: (3, B, T) positions
    ("qwen3_5_moe", "float32", "plain"),
    ("qwen3", "float16", "fused"),
]


@pytest.fixture(scope="module")
def embeds_export(tmp_path_factory, thinker_folder):
    """``embeds_export(family, dtype, graph, quantize=None)`` -> (Thinker folder, verified ONNX folder with
    ``--inputs-embeds``), made once per module."""
    root = tmp_path_factory.mktemp("inputs-embeds")
    cache = {}

    def get(family, dtype="float32", graph="fused", quantize=None):
        key = (family, dtype, graph, quantize)
        if key not in cache:
            output = root / f"{family}-{dtype}-{graph}-{len(cache)}"
            source = thinker_folder(family)
            export_model(
                source, output, dtype=dtype, graph=graph, quantize=quantize, inputs_embeds=True, progress=False
            )
            cache[key] = source, output
        return cache[key]

    return get


@pytest.mark.parametrize(("family", "dtype", "graph"), CASES)
def test_verify_holds_the_embeds_graph_to_pytorch_on_foreign_embeddings(family, dtype, graph, embeds_export):
    _, folder = embeds_export(family, dtype, graph)
    report = json.loads((folder / "export_report.json").read_text())
    assert report["inputs_embeds"] == {"model": EMBEDS_MODEL_FILE, "embed": EMBED_FILE}
    verify = report["verify"]
    figures = verify["embeds_graph"]
    assert verify["passed"] and figures["positions"] == 11 + 2 * 6  # two rows' kept prompt slots, six steps each
    assert figures.get("max_abs_diff_beyond_spread", figures["max_abs_diff"]) <= verify["tolerance"]
    # model.onnx and onnxruntime-genai's graph stay as they were: token ids
    for name in ("model.onnx", GENAI_MODEL_FILE):
        if (folder / name).is_file():
            inputs = [value.name for value in onnx.load(folder / name, load_external_data=False).graph.input]
            assert "input_ids" in inputs and INPUTS_EMBEDS not in inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_check_reads_the_model_layer_by_layer_alike(dtype, embeds_export):
    """The embeds graph's check with the PyTorch model streamed layer by layer (a model larger than the memory)
    gives the figures of the whole model's."""
    source, folder = embeds_export("qwen3_5", dtype=str(dtype).removeprefix("torch."))
    whole, streamed = (
        verify_export(source, folder / "model.onnx", dtype, plan=plan)["embeds_graph"] for plan in (WHOLE, STREAMED)
    )
    assert streamed["positions"] == whole["positions"] == 23
    assert streamed["max_abs_diff"] == pytest.approx(whole["max_abs_diff"], abs=1e-6)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt2"])
def test_token_prompts_give_model_onnx_bit_for_bit(family, embeds_export):
    source, folder = embeds_export(family)
    ids_decoder = OnnxDecoder(folder, provider="cpu")
    embeds_decoder = OnnxDecoder(folder / EMBEDS_MODEL_FILE, provider="cpu")
    ids, mask = parity_batch(96)
    np.testing.assert_array_equal(embeds_decoder.prefill(ids, mask)[0], ids_decoder.prefill(ids, mask)[0])
    by_embeddings = embeds_decoder.generate(None, mask, max_new_tokens=6, inputs_embeds=embeds_decoder.embed(ids))
    np.testing.assert_array_equal(by_embeddings, ids_decoder.generate(ids, mask, max_new_tokens=6)[:, ids.shape[1] :])
    # embed.onnx holds the model's own table: the rows PyTorch looks up, exactly
    model = ThinkerForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        rows = model.get_input_embeddings()(torch.from_numpy(ids)).numpy()
    np.testing.assert_array_equal(embeds_decoder.embed(ids), rows)
    # and nothing else: its weights are the lookup's alone, none of the decoder's it was cut from
    embed = onnx.load(folder / EMBED_FILE, load_external_data=False).graph
    read = {name for node in embed.node for name in node.input}
    assert {tensor.name for tensor in embed.initializer} <= read


@torch.no_grad()
def assert_pytorch_logits(model, logits, embeds, mask, positions) -> None:
    """``logits`` at the kept positions are the PyTorch Thinker's on the same prompt, within the float32 tolerance."""
    reference = model(
        inputs_embeds=torch.from_numpy(embeds),
        attention_mask=torch.from_numpy(mask),
        position_ids=torch.from_numpy(positions),
    ).logits.numpy()
    kept = mask.astype(bool)
    tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(np.abs(reference).max()))
    assert np.abs(logits[kept] - reference[kept]).max() <= tolerance


def torch_greedy(model, embeds, mask, positions, steps):
    """Greedy tokens from the PyTorch Thinker prompted with ``inputs_embeds`` at ``positions`` (3, B, T) of a
    left-padded batch, each stream resuming one past its last slot's position (transformers' ``generate``)."""
    mask = torch.from_numpy(mask)
    positions = torch.from_numpy(positions)
    with torch.no_grad():
        out = model(inputs_embeds=torch.from_numpy(embeds), attention_mask=mask, position_ids=positions, use_cache=True)
        following = positions[..., -1:] + 1
        tokens = [out.logits[:, -1].argmax(-1)]
        for _ in range(steps - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=mask,
                position_ids=following,
                use_cache=True,
                **{CACHE_ARG: getattr(out, CACHE_ARG)},
            )
            following = following + 1
            tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1).numpy()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_generate_from_an_image_prompt_is_pytorchs(family, embeds_export):
    """An image block's grid numbers fewer positions than its tokens: generation resumes after the text that follows
    it, one past its positions, not after the token count (which would rotate every later token wrongly)."""
    source, folder = embeds_export(family, graph="plain" if family == "qwen3_5_moe" else "fused")
    decoder = OnnxDecoder(folder / EMBEDS_MODEL_FILE, provider="cpu")
    model = ThinkerForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids, mask = parity_batch(96)
    embeds, positions, _ = foreign_block_prompt(decoder.embed(ids), mask, multimodal=True)
    assert positions[:, 0].max() + 1 < mask[0].sum()  # the long row's 2 x 2 grid numbers 2 positions for 4 tokens
    got = decoder.generate(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, max_new_tokens=8)
    assert got.shape == (2, 8)  # the new tokens only, as transformers' generate returns them for inputs_embeds
    np.testing.assert_array_equal(got, torch_greedy(model, embeds, mask, positions, 8))
    # and the logits of the prompt, held to the float32 tolerance
    logits, state = decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=positions)
    np.testing.assert_array_equal(state.next_position, positions[..., -1] + 1)
    assert_pytorch_logits(model, logits, embeds, mask, positions)


@torch.no_grad()
def test_an_audio_prompt_gives_the_qwen3_omni_thinkers_own_generation(tmp_path):
    """The deployment an omni user has: the thinker of a tiny Qwen3-Omni checkpoint (transformers' classes) exported
    from the checkpoint itself; its audio tower's output written into the prompt's audio placeholders of
    ``embed.onnx``'s embeddings, at the thinker's own ``get_rope_index`` positions (float32 there, whole numbers).
    ``model.embeds.onnx`` gives the logits and the greedy continuation of
    ``Qwen3OmniMoeThinkerForConditionalGeneration`` run on the ids and the mel features."""
    source = qwen3_omni.save(tmp_path / "source")
    report = export_model(source, tmp_path / "onnx", inputs_embeds=True, progress=False)
    assert report["verify"]["passed"] and report["converted"]
    thinker_class = qwen3_omni.load_reference_thinker(source)
    thinker_class.config.audio_token_id = AUDIO = 120  # a placeholder id inside the tiny vocabulary
    text = torch.randint(0, 100, (1, 14), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text[:, :4], torch.full((1, 17), AUDIO), text[:, 4:]], dim=1)  # 130 frames: 17 audio tokens
    features = torch.randn(1, 16, 130, generator=torch.Generator().manual_seed(5))
    audio = {"input_features": features, "feature_attention_mask": torch.ones(1, 130, dtype=torch.long)}
    expected = thinker_class(input_ids=ids, attention_mask=torch.ones_like(ids), **audio).logits.numpy()
    thinker_class.rope_deltas = None  # each call stands alone
    continuation = thinker_class.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **audio)

    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    embeds = decoder.embed(ids.numpy())
    tower = thinker_class.get_audio_features(**audio).last_hidden_state
    embeds[ids.numpy() == AUDIO] = tower.numpy()
    positions, _ = thinker_class.get_rope_index(
        ids, attention_mask=torch.ones_like(ids), audio_seqlens=torch.tensor([130])
    )
    mask = np.ones(ids.shape, np.int64)
    logits, _ = decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=positions.numpy())
    tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(np.abs(expected).max()))
    assert np.abs(logits - expected).max() <= tolerance
    tokens = decoder.generate(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions.numpy(), max_new_tokens=8
    )
    np.testing.assert_array_equal(tokens, continuation[:, ids.shape[1] :].numpy())


@torch.no_grad()
def test_an_audio_prompt_gives_qwen3_asrs_own_transcript(tmp_path):
    """A speech model's deployment: the decoder of a tiny Qwen3-ASR checkpoint (transformers' class) exported from the
    checkpoint itself, its audio tower's projected frames written into the prompt's audio placeholders of
    ``embed.onnx``'s embeddings (one-dimensional positions: none passed). ``model.embeds.onnx`` gives the logits and
    the greedy transcript of ``Qwen3ASRForConditionalGeneration`` run on the ids and the mel features."""
    source = qwen3_asr.save(tmp_path / "source")
    report = export_model(source, tmp_path / "onnx", inputs_embeds=True, progress=False)
    assert report["verify"]["passed"] and report["converted"]
    reference = qwen3_asr.load_reference(source)
    ids, audio = qwen3_asr.audio_prompt(reference)
    expected = reference(input_ids=ids, attention_mask=torch.ones_like(ids), **audio).logits.numpy()
    transcript = reference.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **audio)[:, ids.shape[1] :]

    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    embeds = decoder.embed(ids.numpy())
    embeds[ids.numpy() == qwen3_asr.AUDIO_TOKEN] = reference.get_audio_features(**audio).pooler_output.numpy()
    mask = np.ones(ids.shape, np.int64)
    logits, _ = decoder.prefill(inputs_embeds=embeds, attention_mask=mask)  # by keyword, as README shows it
    tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(np.abs(expected).max()))
    assert np.abs(logits - expected).max() <= tolerance
    tokens = decoder.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8)
    np.testing.assert_array_equal(tokens, transcript.numpy())


@pytest.mark.parametrize(("kind", "graph"), [("qwen2_vl", "fused"), ("qwen2_5_vl", "fused"), ("qwen2_5_vl", "plain")])
@torch.no_grad()
def test_an_image_prompt_gives_the_vision_language_models_own_generation(kind, graph, tmp_path):
    """Qwen2-VL / Qwen2.5-VL (multimodal RoPE in contiguous sections: MRotaryEmbedding's layout 0 in the fused graph)
    exported from a tiny checkpoint of transformers' class: the embeddings and (3, B, T) positions its own forward
    hands its text decoder for a left-padded batch of image prompts give, through ``model.embeds.onnx``, its logits
    and the tokens of its own ``generate`` on the pixels."""
    import transformers

    source = qwen2_vl.save(tmp_path / "source", kind)
    report = export_model(source, tmp_path / "onnx", graph=graph, inputs_embeds=True, progress=False)
    assert report["verify"]["passed"]
    model = getattr(transformers, f"{qwen2_vl.CLASSES[kind]}ForConditionalGeneration").from_pretrained(source).eval()
    ids, mask = qwen2_vl.image_batch()
    captured, expected = qwen2_vl.image_prompt(model, ids, mask)
    embeds, positions = captured["inputs_embeds"].numpy(), captured["position_ids"].numpy()
    continuation = model.generate(
        input_ids=ids,
        attention_mask=mask,
        mm_token_type_ids=(ids == qwen2_vl.IMAGE_TOKEN).int(),
        max_new_tokens=8,
        do_sample=False,
        **qwen2_vl.image_inputs(model, len(ids)),
    )[:, ids.shape[1] :]

    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    logits, _ = decoder.prefill(None, mask.numpy(), inputs_embeds=embeds, position_ids=positions)
    kept = mask.numpy().astype(bool)
    tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(expected.abs().max()))
    assert np.abs(logits[kept] - expected.numpy()[kept]).max() <= tolerance
    tokens = decoder.generate(
        inputs_embeds=embeds, attention_mask=mask.numpy(), position_ids=positions, max_new_tokens=8
    )
    np.testing.assert_array_equal(tokens, continuation.numpy())


@torch.no_grad()
def test_a_video_prompt_continues_as_transformers_generate_does(tmp_path):
    """A Qwen2.5-VL video (2 frames of 4 x 6 patches, 2 seconds a grid, 4 positions a second) numbers its frames 8
    apart, past the text after it: each stream then continues from the prompt's last position, not its largest, as
    transformers' ``generate`` does; the tokens are its own from the pixels."""
    import transformers

    source = qwen2_vl.save(tmp_path / "source", "qwen2_5_vl")
    export_model(source, tmp_path / "onnx", inputs_embeds=True, progress=False)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(source).eval()
    ids, video = qwen2_vl.video_prompt(model)
    mask = torch.ones_like(ids)
    captured, _ = qwen2_vl.image_prompt(model, ids, mask, **video)
    embeds, positions = captured["inputs_embeds"].numpy(), captured["position_ids"].numpy()
    assert positions[:, 0, -1].max() < positions.max()  # the last position is not the largest
    continuation = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **video)
    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    tokens = decoder.generate(
        inputs_embeds=embeds, attention_mask=mask.numpy(), position_ids=positions, max_new_tokens=8
    )
    np.testing.assert_array_equal(tokens, continuation[:, ids.shape[1] :].numpy())


@torch.no_grad()
def test_an_image_prompt_with_deepstack_gives_qwen3_vls_own_generation(tmp_path):
    """Qwen3-VL adds its vision tower's DeepStack features to the hidden states after its first layer(s):
    ``model.embeds.onnx`` takes them as ``deepstack_embeds`` (``OnnxDecoder`` builds it from transformers' form) and
    gives the model's logits and the tokens of its own ``generate`` from the pixels; without them, other logits."""
    import transformers
    from references.hybrid import capture_language_model_inputs

    source = qwen3_vl.save(tmp_path / "source")
    report = export_model(source, tmp_path / "onnx", inputs_embeds=True, progress=False)
    assert report["verify"]["passed"]
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(source).eval()
    for key, value in (("image_token_id", 120), ("vision_start_token_id", 121), ("vision_end_token_id", 122)):
        setattr(model.config, key, value)  # placeholder ids inside the tiny vocabulary
    ids = torch.tensor([[5, 9, 17, 33, 4, 121, *[120] * 6, 122, 21, 8, 7, 44]])
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(24, patch, generator=torch.Generator().manual_seed(6))
    image = {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, 4, 6]]),
        "mm_token_type_ids": (ids == 120).int(),
    }
    captured = capture_language_model_inputs(model)
    expected = model(input_ids=ids, attention_mask=torch.ones_like(ids), **image).logits.numpy()
    prompt = dict(captured)
    continuation = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **image)[:, ids.shape[1] :]

    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    assert decoder.deepstack_layers == 1
    mask = np.ones(ids.shape, np.int64)
    given = dict(inputs_embeds=prompt["inputs_embeds"], position_ids=prompt["position_ids"].numpy())
    deepstack = {key: prompt[key] for key in ("visual_pos_masks", "deepstack_visual_embeds")}
    logits, _ = decoder.prefill(None, mask, **given, **deepstack)
    tolerance = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(np.abs(expected).max()))
    assert np.abs(logits - expected).max() <= tolerance
    assert np.abs(decoder.prefill(None, mask, **given)[0] - expected).max() > 10 * tolerance
    tokens = decoder.generate(attention_mask=mask, max_new_tokens=6, **given, **deepstack)
    np.testing.assert_array_equal(tokens, continuation.numpy())


def _deepstack_row_of_the_next_layer(graph):
    """Layer 0's DeepStack add reads layer 1's features."""
    index = next(tensor for tensor in graph.initializer if tensor.name == "/model/deepstack.0/index")
    index.CopyFrom(helper.make_tensor(index.name, onnx.TensorProto.INT64, [], [1]))


def _deepstack_dropped(graph):
    """The DeepStack features never added: each add back to the Identity model.onnx has."""
    for node in graph.node:
        if node.name.startswith("/model/deepstack.") and node.op_type == "Add":
            node.op_type = "Identity"
            del node.input[1:]


@pytest.mark.parametrize("planted", [_deepstack_row_of_the_next_layer, _deepstack_dropped])
def test_verify_fails_on_a_planted_deepstack_bug(planted, tmp_path):
    from export_helpers import save_thinker

    source = save_thinker(tmp_path / "thinker", "qwen3_5", deepstack_layers=2)
    export_model(source, tmp_path / "onnx", inputs_embeds=True, verify=False, progress=False)
    assert "`visual_pos_masks=` and `deepstack_visual_embeds=`" in (tmp_path / "onnx" / "README.md").read_text()
    sound = verify_export(source, tmp_path / "onnx" / "model.onnx", torch.float32)
    assert sound["passed"] and sound["embeds_graph"]["max_abs_diff"] <= sound["tolerance"]
    _rewrite(tmp_path / "onnx" / EMBEDS_MODEL_FILE, planted)
    result = verify_export(source, tmp_path / "onnx" / "model.onnx", torch.float32)
    assert result["passed"] is False and f"{EMBEDS_MODEL_FILE} with {EMBED_FILE}" in result["failure"]
    assert result["embeds_graph"]["max_abs_diff"] > 10 * result["tolerance"]


def test_a_quantized_export_checks_its_embeds_graph_against_the_dequantized_model(embeds_export):
    spec = QuantizeSpec.parse("int4", 16, "rtn", None, None, None, "float32", "quantized")
    _, folder = embeds_export("gpt2", quantize=spec)  # tied: embed.onnx gathers the quantized head's own rows
    graph = json.loads((folder / "export_report.json").read_text())["verify"]["graph"]
    assert graph["embeds_graph"]["max_abs_diff"] <= graph["tolerance"]
    ops = {node.op_type for node in onnx.load(folder / EMBED_FILE, load_external_data=False).graph.node}
    assert "GatherBlockQuantized" in ops


def _rewrite(path, edit):
    model = onnx.load(path, load_external_data=False)
    edit(model.graph)
    onnx.save_model(model, path)


def _scale_the_input(graph):
    """Every reader of inputs_embeds reads it 1 % larger."""
    for node in graph.node:
        node.input[:] = ["/planted/scaled" if name == INPUTS_EMBEDS else name for name in node.input]
    scale = helper.make_tensor("/planted/scale", onnx.TensorProto.FLOAT, [], [1.01])
    graph.initializer.append(scale)
    graph.node.insert(0, helper.make_node("Mul", [INPUTS_EMBEDS, "/planted/scale"], ["/planted/scaled"], "/planted"))


def _next_row(graph):
    """The lookup reads each token's next row."""
    gather = next(node for node in graph.node if node.op_type == "Gather")
    one = helper.make_tensor("/planted/one", onnx.TensorProto.INT64, [], [1])
    graph.initializer.append(one)
    graph.node.insert(0, helper.make_node("Add", ["input_ids", "/planted/one"], ["/planted/next"], "/planted"))
    gather.input[1] = "/planted/next"


def _next_row_in_prompts(graph):
    """The lookup reads each token's next row when it looks up more than one token (a prompt), the right one for a
    decode step's single token: only a prompt built from embed.onnx's rows shows it."""
    gather = next(node for node in graph.node if node.op_type == "Gather")
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["/planted/length"], "/planted/shape", start=1, end=2),
        helper.make_node("Greater", ["/planted/length", "/planted/one"], ["/planted/many"], "/planted/greater"),
        helper.make_node("Cast", ["/planted/many"], ["/planted/shift"], "/planted/cast", to=onnx.TensorProto.INT64),
        helper.make_node("Add", ["input_ids", "/planted/shift"], ["/planted/next"], "/planted/add"),
    ]
    graph.initializer.append(helper.make_tensor("/planted/one", onnx.TensorProto.INT64, [1], [1]))
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    gather.input[1] = "/planted/next"


def _positions_by_count(monkeypatch):
    """The runtime resumes after the prompt's token count, not its largest position."""
    monkeypatch.setattr(runtime, "next_positions", lambda positions, mask: mask.sum(axis=1))


@pytest.mark.parametrize(
    ("planted", "file"),
    [
        (_scale_the_input, EMBEDS_MODEL_FILE),
        (_next_row, EMBED_FILE),
        (_next_row_in_prompts, EMBED_FILE),
        (_positions_by_count, None),
    ],
)
def test_verify_fails_on_a_planted_bug(planted, file, embeds_export, tmp_path, monkeypatch):
    source, folder = embeds_export("qwen3_5")
    copy = shutil.copytree(folder, tmp_path / "onnx")
    if file is None:
        planted(monkeypatch)
    else:
        _rewrite(copy / file, planted)
    result = verify_export(source, copy / "model.onnx", torch.float32)
    assert result["passed"] is False
    assert (
        f"{EMBEDS_MODEL_FILE} with {EMBED_FILE} (a prompt with foreign embeddings): max |Δlogit|" in result["failure"]
    )
    assert result["max_abs_diff"] <= result["tolerance"]  # model.onnx itself is sound
    assert result["embeds_graph"]["max_abs_diff"] > 10 * result["tolerance"]


def test_the_quantized_verify_fails_a_planted_bug_in_the_embeds_graph(thinker_folder, tmp_path):
    """The quantized check judges the embeds graph as the float check does: its inputs_embeds read 1 % larger fails
    it, model.onnx sound (a mutation leaving the side graphs' failures out of the quantized verdict passed every
    test: only the embeds graph's own comparison sees this)."""
    from export.quantized_verify import QualityGate, verify_quantized_export

    source, folder = thinker_folder("gpt2"), tmp_path / "onnx"
    spec = QuantizeSpec(bits=4, block_size=16)  # no activation-aware scales: the graph holds the source's weights
    export_model(source, folder, quantize=spec, inputs_embeds=True, verify=False, progress=False)
    _rewrite(folder / EMBEDS_MODEL_FILE, _scale_the_input)
    result = verify_quantized_export(source, folder / "model.onnx", torch.float32, 4, QualityGate(0.0, float("inf")))
    graph = result["graph"]
    assert graph["max_abs_diff"] <= graph["tolerance"] < graph["embeds_graph"]["max_abs_diff"], graph
    assert result["passed"] is False, result
    assert f"{EMBEDS_MODEL_FILE} with {EMBED_FILE} (a prompt with foreign embeddings): " in result["failure"], result


def test_the_foreign_block_fits_rows_of_any_length():
    """A row too short for a block keeps its tokens (one or two kept slots), a longer one gets up to FOREIGN_BLOCK."""
    mask = np.array([[0, 0, 0, 0, 1], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    tokens = np.ones((4, 5, 8), np.float32)
    embeds, positions, foreign = foreign_block_prompt(tokens, mask, multimodal=True)
    assert foreign.sum(axis=1).tolist() == [0, 0, 2, 2]
    assert (embeds[~foreign] == 1).all() and positions.shape == (3, 4, 5)


def test_refusals_name_what_is_wrong(embeds_export, thinker_folder, tmp_path):
    _, folder = embeds_export("qwen3")
    ids_decoder = OnnxDecoder(folder, provider="cpu")
    decoder = OnnxDecoder(folder / EMBEDS_MODEL_FILE, provider="cpu")
    ids, mask = parity_batch(96)
    embeds = decoder.embed(ids)
    with pytest.raises(ThinkerError, match="takes token ids; for inputs_embeds export with --inputs-embeds"):
        ids_decoder.prefill(None, mask, inputs_embeds=embeds)
    with pytest.raises(ThinkerError, match="embed\\(\\) is for a graph exported with --inputs-embeds"):
        ids_decoder.embed(ids)
    with pytest.raises(ThinkerError, match="pass either input_ids or inputs_embeds, not both"):
        decoder.prefill(ids, mask, inputs_embeds=embeds)
    with pytest.raises(ThinkerError, match=re.escape("pass either input_ids or inputs_embeds, not both (nor neither)")):
        decoder.generate(max_new_tokens=2)
    # a tower's torch output in bfloat16 (no numpy dtype): taken as float32, as the same values in numpy
    rounded = torch.from_numpy(embeds).bfloat16()
    np.testing.assert_array_equal(
        decoder.prefill(None, mask, inputs_embeds=rounded)[0],
        decoder.prefill(None, mask, inputs_embeds=rounded.float().numpy())[0],
    )
    with pytest.raises(ThinkerError, match=r"inputs_embeds of shape \(2, 7, 5\); expected \(batch, seq, 32\)"):
        decoder.prefill(None, mask, inputs_embeds=embeds[..., :5])
    with pytest.raises(ThinkerError, match="inputs_embeds hold inf or NaN"):
        decoder.prefill(None, mask, inputs_embeds=np.where(mask[..., None] == 1, embeds, np.nan))
    with pytest.raises(ThinkerError, match=r"attention_mask of shape \(2, 6\) for inputs_embeds of shape \(2, 7, 32\)"):
        decoder.prefill(None, mask[:, 1:], inputs_embeds=embeds)
    with pytest.raises(ThinkerError, match=r"position_ids of shape \(2, 6\) for inputs_embeds of shape \(2, 7, 32\)"):
        decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=np.zeros((2, 6), np.int64))
    # an embed.onnx from another export of the same model (the same weights file's size): refused by the export's id
    other = embeds_export("qwen3", graph="plain")[1]
    mixed = shutil.copytree(folder, tmp_path / "mixed")
    shutil.copy(other / EMBED_FILE, mixed / EMBED_FILE)
    with pytest.raises(ThinkerError, match=f"{EMBED_FILE}: from another export than {EMBEDS_MODEL_FILE} beside it"):
        OnnxDecoder(mixed / EMBEDS_MODEL_FILE, provider="cpu")
    # a folder copied without embed.onnx
    partial = shutil.copytree(folder, tmp_path / "partial")
    (partial / EMBED_FILE).unlink()
    with pytest.raises(ThinkerError, match=f"{EMBED_FILE} missing beside {EMBEDS_MODEL_FILE}, which takes"):
        OnnxDecoder(partial / EMBEDS_MODEL_FILE, provider="cpu")
    # --positions text on a multimodal-RoPE model: the export says what its embeds graph cannot take
    text = thinker("export", thinker_folder("qwen3_5"), tmp_path / "text", "--inputs-embeds", "--positions", "text")
    assert text.exit_code == 0 and "not image or video prompts; export with --positions multimodal" in text.output
    # Qwen3.8's n-gram hash reads the token ids themselves: refused before anything is written
    output = tmp_path / "qwen4"
    result = thinker("export", thinker_folder("qwen4_exp"), output, "--inputs-embeds", "--no-verify")
    assert result.exit_code == 1 and "Qwen3.8's n-gram embeddings hash the token ids" in result.output
    assert not output.exists()


def test_hostile_values_are_refused_by_name(embeds_export, tmp_path):
    """Values the graph would turn to NaN logits without a word, and torch tensors in any dtype, in every argument
    that takes numbers: refused by the argument's name, or taken as their numpy equals."""
    from export_helpers import save_thinker

    source = save_thinker(tmp_path / "thinker", "qwen3_5", deepstack_layers=1)
    export_model(source, tmp_path / "onnx", inputs_embeds=True, verify=False, progress=False)
    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    ids, mask = parity_batch(96)
    embeds = decoder.embed(ids)
    visual = np.zeros(mask.shape, bool)
    visual[:, -3:] = True
    features = np.ones((int(visual.sum()), decoder.hidden_size), np.float32)
    deepstack = {"visual_pos_masks": visual, "deepstack_visual_embeds": [features]}
    positions = runtime.position_ids_from_mask(mask)

    def refused(message, **arguments):
        with pytest.raises(ThinkerError, match=message):
            decoder.prefill(None, **{"attention_mask": mask, "inputs_embeds": embeds, **arguments})

    refused(
        r"deepstack_visual_embeds\[0\] hold inf or NaN",
        visual_pos_masks=visual,
        deepstack_visual_embeds=[features * np.nan],
    )
    refused(
        "deepstack_visual_embeds of type float; expected a list", visual_pos_masks=visual, deepstack_visual_embeds=1.0
    )
    refused(
        r"deepstack_visual_embeds\[0\] of dtype <U1; expected floats",
        visual_pos_masks=visual,
        deepstack_visual_embeds=[["x"]],
    )
    refused(
        "visual_pos_masks holds values other than 0 and 1",
        visual_pos_masks=visual * 0.5,
        deepstack_visual_embeds=[features],
    )
    huge = embeds.astype(np.float64)
    huge[0, 0, 0] = 1e39  # float64 past float32's range: inf once cast
    refused(r"inputs_embeds hold 1e\+39 at \(0, 0, 0\), beyond float32's range", inputs_embeds=huge)
    refused(r"inputs_embeds hold 1e\+39 at \(0, 0, 0\), beyond float32's range", inputs_embeds=torch.from_numpy(huge))
    state = decoder.prefill(None, mask, inputs_embeds=embeds)[1]
    with pytest.raises(ThinkerError, match="deepstack_embeds hold inf or NaN"):
        step = np.full((1, 2, 1, decoder.hidden_size), np.inf, np.float32)
        decoder.forward(None, positions[:, -1:] + 1, state, embeds[:, -1:], deepstack_embeds=step)

    # torch tensors in any dtype, with grad or not: the same logits as their numpy values
    expected = decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=positions, **deepstack)[0]
    as_torch = dict(
        attention_mask=torch.from_numpy(mask).bfloat16(),
        inputs_embeds=torch.from_numpy(embeds).requires_grad_(),
        position_ids=torch.from_numpy(positions).float().requires_grad_(),
        visual_pos_masks=torch.from_numpy(visual),
        deepstack_visual_embeds=[torch.from_numpy(features).requires_grad_()],
    )
    np.testing.assert_array_equal(decoder.prefill(None, **as_torch)[0], expected)
    # the DeepStack features stacked (layers, visual positions, hidden), and embeddings in ml_dtypes' bfloat16 (what
    # JAX and onnxruntime hand back): taken as the list and as float32
    import ml_dtypes

    stacked = {**deepstack, "deepstack_visual_embeds": np.stack(deepstack["deepstack_visual_embeds"])}
    as_ml_bfloat16 = embeds.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=positions, **stacked)[0], expected
    )
    np.testing.assert_array_equal(
        decoder.prefill(None, mask, inputs_embeds=as_ml_bfloat16)[0],
        decoder.prefill(None, mask, inputs_embeds=as_ml_bfloat16.astype(np.float32))[0],
    )

    # a float16 graph casts its float32 input: a value past 65504, even in a masked pad, would be inf there and NaN
    # everywhere its row attends
    half = OnnxDecoder(embeds_export("qwen3", "float16")[1] / EMBEDS_MODEL_FILE, provider="cpu")
    padded = half.embed(ids)
    row, slot = np.argwhere(mask == 0)[0]
    padded[row, slot, 0] = 1e5
    beyond = rf"inputs_embeds hold 100000.0 at \({row}, {slot}, 0\), beyond the float16 graph's range \(largest 65504\)"
    with pytest.raises(ThinkerError, match=beyond):
        half.prefill(None, mask, inputs_embeds=padded)
    padded[row, slot, 0] = 65510.0  # rounds down to float16's 65504: a finite value, taken
    assert np.isfinite(half.prefill(None, mask, inputs_embeds=padded)[0]).all()


def test_generate_from_embeddings_streams_and_checks_the_context_first(embeds_export):
    """A streamer first gets the prompt as no tokens (transformers' generate puts an empty (B, 0) prompt for
    inputs_embeds, and TextStreamer's skip_prompt drops that first put), then each new token; positions that run ahead
    of the prompt's tokens are counted against the context before the first token."""
    _, folder = embeds_export("qwen3_5")
    decoder = OnnxDecoder(folder / EMBEDS_MODEL_FILE, provider="cpu")
    ids, mask = parity_batch(96)
    embeds, positions, _ = foreign_block_prompt(decoder.embed(ids), mask, multimodal=True)
    streamed = []
    streamer = type("Streamer", (), {"put": lambda self, value: streamed.append(value), "end": lambda self: None})()
    tokens = decoder.generate(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions, max_new_tokens=3, streamer=streamer
    )
    assert streamed[0].shape == (2, 0) and np.array_equal(np.stack(streamed[1:], axis=1), tokens)
    streamed.clear()  # embeddings the graph cannot take: refused before the streamer is given anything
    with pytest.raises(ThinkerError, match="inputs_embeds of shape"):
        decoder.generate(inputs_embeds=embeds[..., :5], attention_mask=mask, streamer=streamer)
    assert streamed == []
    context = decoder.context_length
    ahead = positions + (context - 8)  # its largest position context - 4: the next one context - 3
    streamed.clear()
    with pytest.raises(ThinkerError, match=f"up to {context - 4} and 6 new tokens need {context + 2} positions, past"):
        decoder.generate(
            inputs_embeds=embeds, attention_mask=mask, position_ids=ahead, max_new_tokens=6, streamer=streamer
        )
    assert streamed == []


def test_a_graph_rotating_by_slot_refuses_positions_that_skip(tmp_path):
    """The fused graph of a model without multimodal RoPE, its head a multiple of 16: GroupQueryAttention rotates q
    and k itself, numbering a prompt by its slots. Positions that count up one a token (from any start) give
    PyTorch's logits; others are refused by name rather than rotated wrongly."""
    from export_helpers import save_thinker

    source = save_thinker(tmp_path / "qwen3", "qwen3", head_dim=16)
    export_model(source, tmp_path / "onnx", inputs_embeds=True, verify=False, progress=False)
    decoder = OnnxDecoder(tmp_path / "onnx" / EMBEDS_MODEL_FILE, provider="cpu")
    assert decoder.rotates_by_slot
    model = ThinkerForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids, mask = parity_batch(96)
    embeds = decoder.embed(ids)
    shifted = np.maximum(np.cumsum(mask, axis=1) - 1, 0) + 5
    logits, _ = decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=shifted)
    assert_pytorch_logits(model, logits, embeds, mask, shifted)
    repeated = shifted.copy()
    repeated[0, 3] = repeated[0, 2]
    with pytest.raises(ThinkerError, match="position_ids that do not count up one a token"):
        decoder.prefill(None, mask, inputs_embeds=embeds, position_ids=repeated)


def test_the_command_line_writes_both_graphs(thinker_folder, tmp_path):
    output = tmp_path / "onnx"
    result = thinker("export", thinker_folder("qwen3"), output, "--inputs-embeds")
    assert result.exit_code == 0, result.output
    wrote, verify_line = (line for line in result.output.splitlines() if line.startswith(("wrote", "verify:")))
    assert f"{EMBED_FILE} " in wrote and f"{EMBEDS_MODEL_FILE} " in wrote
    assert f"; {EMBEDS_MODEL_FILE} with foreign embeddings " in verify_line
    card = (output / "README.md").read_text()
    assert "## Prompts with audio, image or video embeddings" in card
    assert "DeepStack" not in card and "--positions text" not in card  # neither is this model's (a QA run)
    assert f"`{EMBEDS_MODEL_FILE}` on a prompt with foreign embeddings: max \\|Δlogit\\|" in card
    assert {EMBEDS_MODEL_FILE, EMBED_FILE} <= {path.name for path in output.iterdir()}
    embed = onnx.load(output / EMBED_FILE, load_external_data=False).graph
    assert [value.name for value in embed.input] == ["input_ids"] and embed.output[0].name == INPUTS_EMBEDS
    assert "--inputs-embeds" in thinker("export", "--help").output


def test_the_card_gives_the_embeds_figure_the_verify_judged():
    """In half precision the embeds graph is held to the tolerance beyond the spread half precision excuses, so the
    card gives that figure beside the tolerance, in both the float and the quantized check's table; the raw max,
    past the tolerance, read as a failed check that had passed (a mutation run)."""
    from export.model_card import verify_section

    embeds = {"embeds_graph": {"max_abs_diff": 0.5, "max_abs_diff_beyond_spread": 0.02}}
    plain = {"max_abs_diff": 0.01, "tolerance": 0.05, "top1_agreement": 1.0, "positions": 40, "provider": "cpu"}
    graph = {"max_abs_diff": 0.01, "tolerance": 0.05, **embeds}
    quantized = {"graph": graph, "weights": {"relative_error": 0.01, "limit": 0.1}, "cost": {"skipped": "--no-cost"}}
    for figures in ({**plain, **embeds}, quantized):
        (line,) = [line for line in verify_section({"verify": figures}).splitlines() if "foreign embeddings" in line]
        assert "max \\|Δlogit\\| 0.02, tolerance 0.05" in line, line


def test_a_text_positions_card_says_which_prompts_it_takes(tmp_path):
    """--positions text with --inputs-embeds: the graph refuses an image prompt's distinct streams, so its card says
    so where it showed image prompts with get_rope_index's positions (found by a QA run)."""
    from export_helpers import save_thinker

    source = save_thinker(tmp_path / "thinker", "qwen3_5")
    export_model(source, tmp_path / "onnx", inputs_embeds=True, positions="text", verify=False, progress=False)
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "This export takes text positions (`--positions text`)" in card and "DeepStack" not in card


def test_a_bfloat16_export_writes_both_graphs_with_float32_embeddings(thinker_folder, tmp_path):
    """bfloat16, like float16, is a half dtype: embed.onnx casts its rows out to float32 and model.embeds.onnx casts
    its float32 input in first thing (a cut that took only float16 for half wrote a bfloat16 lookup under a float32
    output and a float32 input into bfloat16 nodes, which save_checked let through). The CPU runs no bfloat16 MatMul:
    the graphs are read, not run."""
    folder = tmp_path / "onnx"
    export_model(thinker_folder("qwen3"), folder, dtype="bfloat16", inputs_embeds=True, verify=False, progress=False)
    embed = onnx.load(folder / EMBED_FILE, load_external_data=False).graph
    decoder = onnx.load(folder / EMBEDS_MODEL_FILE, load_external_data=False).graph
    assert [(v.name, v.type.tensor_type.elem_type) for v in embed.output] == [(INPUTS_EMBEDS, onnx.TensorProto.FLOAT)]
    assert embed.node[-1].op_type == "Cast" and embed.node[-1].output[0] == INPUTS_EMBEDS
    embeds_input = next(value for value in decoder.input if value.name == INPUTS_EMBEDS)
    assert embeds_input.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    cast = decoder.node[0]
    assert cast.op_type == "Cast" and list(cast.input) == [INPUTS_EMBEDS]
    assert helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.BFLOAT16
