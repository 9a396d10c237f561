"""``--verify`` on what no prefill from an empty cache and no one-token step reaches: several tokens fed after a cache
(export/continuation.py), and a multimodal-RoPE graph's three position streams apart (an image's positions).

A QA sweep planted three bugs that passed every other pass while moving logits by up to their scale: the causal mask
dropped whenever the cache is not empty (exact for every prefill and every one-token step), the plain hybrid graph's
chunked delta rule (64 new tokens or more) starting from zeros instead of the carried state, and Qwen3.5's
interleaved RoPE stream selector built in sections (equal streams, which text positions always are, rotate alike
through either). Each is planted while exporting a sound model, whose own export passes, and fails now.
"""

from __future__ import annotations

import pytest
import torch
from export_helpers import export_planted
from onnx import TensorProto

import export.decoder_graph as decoder_graph
import export.linear_attention_graph as linear_attention_graph
from export.names import GENAI_MODEL_FILE, MODEL_FILE
from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate, verify_quantized_export
from export.verify import CONTINUATION_PASSES, IMAGE_POSITIONS, verify_export
from thinker_common.parity_inputs import CONTINUATION_DECODE_STEPS, CONTINUATION_LENGTHS

CONTEXT = 256


@pytest.fixture(scope="module")
def folders(thinker_variant):
    def get(family: str):
        shape = {"head_dim": 16} if family == "qwen3" else {}  # the fused kernels' smallest head
        return thinker_variant(family, max_position_embeddings=CONTEXT, **shape)

    return get


def mask_without_causality_after_a_cache(monkeypatch) -> None:
    original = decoder_graph.DecoderGraph.emit_allowed

    def planted(self, input_ids, attention_mask):
        allowed, b = original(self, input_ids, attention_mask), self.b
        seq = b.op("Squeeze", b.op("Shape", input_ids, start=1, end=2), b.const([0]))
        total = b.op("Squeeze", b.op("Shape", attention_mask, start=1, end=2), b.const([0]))
        after_a_cache = b.op("Greater", b.op("Sub", total, seq), b.const(0))
        keep = b.op("Unsqueeze", b.op("Cast", attention_mask, to=TensorProto.BOOL), b.const([1, 2, 3]))
        return b.op("Or", allowed, b.op("And", after_a_cache, keep))  # after a cache: the padding mask only

    monkeypatch.setattr(decoder_graph.DecoderGraph, "emit_allowed", planted)


def chunks_from_zeros(monkeypatch) -> None:
    original = linear_attention_graph.GatedDeltaNetGraph.emit_delta_chunks

    def planted(self, rule, past, present):
        return original(self, rule, self.b.op("Mul", past, self.b.const(0.0, torch.float32)), present)

    monkeypatch.setattr(linear_attention_graph.GatedDeltaNetGraph, "emit_delta_chunks", planted)


def sections_for_interleaved(monkeypatch) -> None:
    original = decoder_graph.mrope_stream_selector
    monkeypatch.setattr(
        decoder_graph, "mrope_stream_selector", lambda section, half, interleaved=True: original(section, half, False)
    )


@pytest.mark.parametrize(
    "family, graph, plant, caught_in",
    [
        ("qwen3", "plain", mask_without_causality_after_a_cache, [MODEL_FILE]),
        ("qwen3_5", "plain", chunks_from_zeros, [MODEL_FILE, GENAI_MODEL_FILE]),
    ],
)
def test_several_tokens_after_a_cache_are_checked(family, graph, plant, caught_in, folders, tmp_path, monkeypatch):
    folder = folders(family)
    sound = verify_export(folder, export_planted(folder, tmp_path / "sound", monkeypatch, graph=graph), torch.float32)
    assert sound["passed"], sound
    first, then = CONTINUATION_LENGTHS
    for key in CONTINUATION_PASSES:
        if key in sound:
            assert (sound[key]["prompt_length"], sound[key]["continued_by"]) == (first, then)
            # every continued position (onnxruntime-genai's graph gives the last alone), and each step
            continued = 1 if key.startswith("genai") else then
            assert sound[key]["positions"] == continued + CONTINUATION_DECODE_STEPS
    result = verify_export(
        folder, export_planted(folder, tmp_path / "bad", monkeypatch, plant, graph=graph), torch.float32
    )
    assert result["passed"] is False
    for name in caught_in:
        said = f"{name}{'' if name == MODEL_FILE else ' (onnxruntime-genai' + chr(39) + 's graph)'}"
        assert f"{said} on a prompt of {first} tokens continued by {then} in one step, then" in result["failure"]
    figures = result["continuation"]
    assert figures["max_abs_diff"] > 100 * figures["tolerance"], figures
    # every other pass would have passed it
    assert result["max_abs_diff"] <= result["tolerance"]
    assert result["long_prompts"]["max_abs_diff"] <= result["long_prompts"]["tolerance"]
    assert result["deep_cache"]["max_abs_diff"] <= result["deep_cache"]["tolerance"]


def test_the_fused_graph_is_continued_at_batch_1(folders, tmp_path, monkeypatch):
    folder = folders("qwen3")
    result = verify_export(
        folder, export_planted(folder, tmp_path / "fused", monkeypatch, graph="fused"), torch.float32
    )
    assert result["passed"], result
    assert result["continuation"]["continued_by"] == CONTINUATION_LENGTHS[1] and "genai_graph_continuation" in result


@pytest.mark.parametrize("quantize", [None, QuantizeSpec(bits=8, block_size=16)], ids=["float32", "int8"])
def test_multimodal_positions_whose_streams_differ_are_checked(quantize, folders, tmp_path, monkeypatch):
    folder = folders("qwen3_5")

    def verify(path):
        if quantize is None:
            return verify_export(folder, path, torch.float32)
        # the quality gate open: on random weights every distribution is near-flat, so its cost says nothing
        return verify_quantized_export(folder, path, torch.float32, 8, QualityGate(0.0, 100.0))

    options = {"graph": "plain", "quantize": quantize}
    sound = verify(export_planted(folder, tmp_path / "sound", monkeypatch, **options))
    assert sound["passed"], sound
    assert IMAGE_POSITIONS in (sound if quantize is None else sound["graph"])
    result = verify(export_planted(folder, tmp_path / "bad", monkeypatch, sections_for_interleaved, **options))
    assert result["passed"] is False
    assert (
        "model.onnx on prompts of 7 and 4 tokens at an image's multimodal positions: max |Δlogit|"
        in (result["failure"])
    )
    figures = result if quantize is None else result["graph"]
    assert figures["max_abs_diff"] <= figures["tolerance"]  # the batch at text positions: equal streams
