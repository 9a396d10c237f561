"""``--verify`` on the padding ``model.onnx`` takes beyond the parity batch's: rows padded on both sides, with their
positions given (export/verify.py ``PADDED_AROUND``).

The parity batch is padded on the left, and every pass but onnxruntime-genai's graph's fed ``model.onnx`` left-padded
rows with the positions left to the runtime. A QA sweep planted bugs that are exact there and wrong elsewhere, and
they passed: a plain graph's attention mask keeping each row's last sum(mask) slots (where ``genai_config.json``
names ``model.onnx``, onnxruntime-genai then ran it on right-padded rows, half its tokens wrong), a hybrid's
recurrent state decayed at pads (invisible while the pads come first and the state is still zero), and
``OnnxDecoder`` numbering the decode steps one too far after pads when the caller gives the positions. Each is
planted while exporting a sound model, whose own export passes, and fails now.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from export_helpers import export_planted

import export.decoder_graph as decoder_graph
import export.linear_attention_graph as linear_attention_graph
import export.runtime as runtime
from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate, verify_quantized_export
from export.verify import PADDED_AROUND, padded_around, verify_export

FAILURE = "model.onnx on prompts of 7 and 4 tokens padded on both sides, their positions given, then 6 steps"


def test_rows_padded_around_keep_their_order_and_split_their_pads():
    ids = np.array([[0, 0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 9, 8]])
    mask = (np.arange(7) >= np.array([[3], [0], [5]])).astype(np.int64)
    around_ids, around_mask = padded_around(ids, mask)
    np.testing.assert_array_equal(around_mask, [[0, 1, 1, 1, 1, 0, 0], [1] * 7, [0, 0, 1, 1, 0, 0, 0]])
    for row in range(3):  # the kept tokens in order
        assert around_ids[row][around_mask[row] == 1].tolist() == ids[row][mask[row] == 1].tolist()


def mask_from_the_left_only(monkeypatch) -> None:
    """Keeps each row's last sum(mask) slots: the padding mask for left padding, and nothing else."""

    def planted(self, input_ids, attention_mask):
        b = self.b
        seq = b.op("Squeeze", b.op("Shape", input_ids, start=1, end=2), b.const([0]))
        total = b.op("Squeeze", b.op("Shape", attention_mask, start=1, end=2), b.const([0]))
        query_slot = b.op("Unsqueeze", b.op("Range", b.op("Sub", total, seq), total, b.const(1)), b.const([1]))
        key_slot = b.op("Unsqueeze", b.op("Range", b.const(0), total, b.const(1)), b.const([0]))
        causal = b.op("LessOrEqual", key_slot, query_slot)
        first_kept = b.op(
            "Sub", b.op("Unsqueeze", total, b.const([0])), b.op("ReduceSum", attention_mask, b.const([1]))
        )
        keep = b.op("Unsqueeze", b.op("GreaterOrEqual", key_slot, first_kept), b.const([1, 2, 3]))
        return b.op("And", causal, keep)

    monkeypatch.setattr(decoder_graph.DecoderGraph, "emit_allowed", planted)


def state_decayed_at_pads(monkeypatch) -> None:
    """The linear attention's decay and write applied at pads too: the state is not held there."""
    original = linear_attention_graph.emit_padding_masks

    def planted(b, attention_mask, hidden, dtype, dims, **flags):
        masks = original(b, attention_mask, hidden, dtype, dims, **flags)
        everywhere = b.op(
            "Add", b.op("Mul", masks.keep_float, b.const(0.0, torch.float32)), b.const(1.0, torch.float32)
        )
        return dataclasses.replace(masks, keep_float=everywhere)

    for module in (linear_attention_graph, decoder_graph):
        monkeypatch.setattr(module, "emit_padding_masks", planted)


def positions_one_too_far_after_pads(monkeypatch) -> None:
    """OnnxDecoder's decode steps after given positions numbered one too far in a row that holds pads."""
    original = runtime.next_positions

    def planted(position_ids, attention_mask):
        padded = (attention_mask == 0).any(axis=1).astype(np.int64)
        return original(position_ids, attention_mask) + padded  # (B,), or (3, B) for multimodal positions

    monkeypatch.setattr(runtime, "next_positions", planted)


@pytest.mark.parametrize(
    "family, options, plant, in_the_graph",
    [
        ("qwen3", {"graph": "plain"}, mask_from_the_left_only, True),
        ("qwen3_5", {"graph": "plain", "positions": "text"}, state_decayed_at_pads, True),
        ("qwen3", {"graph": "fused"}, positions_one_too_far_after_pads, False),
    ],
    ids=["left-only-mask", "state-decayed-at-pads", "runtime-positions"],
)
def test_a_graph_right_for_left_padding_only_fails(
    family, options, plant, in_the_graph, thinker_variant, tmp_path, monkeypatch
):
    folder = thinker_variant(family, **({"head_dim": 16} if family == "qwen3" else {}))
    sound = verify_export(folder, export_planted(folder, tmp_path / "sound", monkeypatch, **options), torch.float32)
    assert sound["passed"], sound
    assert sound[PADDED_AROUND]["positions"] == 7 + 4 + 2 * 6, sound[PADDED_AROUND]  # every kept position, each step
    bad = export_planted(folder, tmp_path / "bad", monkeypatch, plant if in_the_graph else None, **options)
    with monkeypatch.context() as patched:
        if not in_the_graph:
            plant(patched)
        result = verify_export(folder, bad, torch.float32)
    assert result["passed"] is False and f"{FAILURE}: max |Δlogit|" in result["failure"], result.get("failure")
    figures = result[PADDED_AROUND]
    assert figures["max_abs_diff"] > 100 * figures["tolerance"], figures
    assert result["max_abs_diff"] <= result["tolerance"]  # the left-padded batch would have passed it


def test_a_quantized_graph_is_checked_padded_around(thinker_variant, tmp_path, monkeypatch):
    folder = thinker_variant("qwen3", head_dim=16)
    options = {"graph": "plain", "quantize": QuantizeSpec(bits=8, block_size=16)}
    # the quality gate open: on random weights every distribution is near-flat, so its cost says nothing
    gate = QualityGate(0.0, 100.0)
    sound = verify_quantized_export(
        folder, export_planted(folder, tmp_path / "sound", monkeypatch, **options), torch.float32, 8, gate
    )
    assert sound["passed"], sound
    assert sound["graph"][PADDED_AROUND]["max_abs_diff"] <= sound["graph"][PADDED_AROUND]["tolerance"]
    bad = export_planted(folder, tmp_path / "bad", monkeypatch, mask_from_the_left_only, **options)
    result = verify_quantized_export(folder, bad, torch.float32, 8, gate)
    assert result["passed"] is False and FAILURE in result["failure"], result.get("failure")
