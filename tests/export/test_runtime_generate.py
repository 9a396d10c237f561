"""export/runtime.py's ``generate`` loop and ``thinker generate``: what a row that stops is padded with, the pads a
fused graph refuses, and the refusals of the command's options (cases a mutation run found the other tests let
pass)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from cli_helpers import assert_usage_error, thinker

from export.runtime import OnnxDecoder
from thinker_common.errors import ThinkerError


def without_pad(folder, tmp_path):
    """A copy of ONNX ``folder`` whose generation_config.json and config.json name no pad_token_id."""
    copy = shutil.copytree(folder, tmp_path / "no-pad")
    for name in ("generation_config.json", "config.json"):
        config = json.loads((copy / name).read_text())
        config.pop("pad_token_id", None)
        (copy / name).write_text(json.dumps(config))
    return copy


def test_a_stopped_row_is_padded_with_the_first_eos_id_given(onnx_folder, tmp_path):
    """No pad named anywhere: a row that stops is padded with the first of the eos ids, as transformers' generate
    pads, not the smallest of them (a mutation run padded with ``min(eos)`` and every test passed: the folder's own
    test ends where no row is padded). Row 0 stops at its first new token while row 1 runs on."""
    decoder = OnnxDecoder(without_pad(onnx_folder("qwen2"), tmp_path), provider="cpu")
    prompt = np.array([[5, 9, 17], [6, 9, 17]], dtype=np.int64)
    free = decoder.generate(prompt, max_new_tokens=6, eos_token_id=[])[:, 3:]
    first = int(free[0, 0])  # row 0 stops right there
    assert first > 0 and free[1, 0] != first, free
    smaller = next(token for token in range(first) if token not in free.tolist()[0] + free.tolist()[1])
    stopped = decoder.generate(prompt, max_new_tokens=6, eos_token_id=[first, smaller])[:, 3:]
    assert stopped.shape[1] >= 2, stopped  # row 1 ran on, so row 0 holds pads
    assert stopped[0].tolist() == [first] + [first] * (stopped.shape[1] - 1)
    np.testing.assert_array_equal(stopped[1], free[1, : stopped.shape[1]])


def test_a_pad_right_after_a_rows_first_token_is_refused_by_the_fused_graph(onnx_variant):
    """The fused graph's GroupQueryAttention numbers a prompt's tokens by slot, so a pad between a row's tokens is
    refused by row (``refuse_pads_between_tokens``); a pad after the row's first kept token is such a pad too (a
    mutation that counted only pads after two kept tokens passed every test, and this mask ran silently)."""
    fused = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    tokens = np.array([[3, 14, 15, 92, 65], [3, 14, 15, 92, 65]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], dtype=np.int64)  # row 1: pad, token, pad, tokens
    message = "row 1 of attention_mask masks a slot between its new tokens, and this graph's GroupQueryAttention"
    with pytest.raises(ThinkerError, match=message):
        fused.prefill(tokens, mask)
    with pytest.raises(ThinkerError, match=message):
        fused.generate(tokens, mask, max_new_tokens=2)


def test_generate_refuses_zero_new_tokens(onnx_folder):
    """``--max-new-tokens 0`` is a usage error naming the option (a run that generates nothing and reports
    "0 tokens" is no continuation): a mutation that took 0 passed every test."""
    result = thinker("generate", onnx_folder("qwen3"), "-p", "the cat", "--max-new-tokens", "0")
    assert_usage_error(result, "'--max-new-tokens'", "0 is not in the range x>=1")


def test_generate_runs_onnxruntime_with_the_threads_asked_for(onnx_folder, monkeypatch):
    """``--threads`` reaches the onnxruntime session of an ONNX folder (its intra-op threads), and without it the
    session takes its default: a mutation that dropped the option on the way to OnnxDecoder passed every test."""
    import export.runtime

    opened = []

    class Spy(OnnxDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(self.session.get_session_options().intra_op_num_threads)

    monkeypatch.setattr(export.runtime, "OnnxDecoder", Spy)
    folder = onnx_folder("qwen3")
    for threads in ("1", "2"):
        result = thinker("generate", folder, "-p", "the cat", "-n", "2", "--provider", "cpu", "--threads", threads)
        assert result.exit_code == 0, result.output
    assert opened == [1, 2]


def test_generate_prints_the_continuation_alone(onnx_folder):
    """stdout is the new tokens' text as the tokenizer decodes it (special tokens skipped), without the prompt
    before it, and stderr counts those tokens: what OnnxDecoder.generate continues the prompt with."""
    from transformers import AutoTokenizer

    folder = onnx_folder("qwen3")
    prompt = "the cat sat on"
    result = thinker("generate", folder, "-p", prompt, "-n", "5", "--provider", "cpu")
    assert result.exit_code == 0, result.output
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="np").input_ids
    tokens = OnnxDecoder(folder, provider="cpu").generate(ids, max_new_tokens=5)
    new = tokens[0, ids.shape[1] :]
    text = AutoTokenizer.from_pretrained(folder).decode(new, skip_special_tokens=True)
    assert result.stdout.strip() == text.strip(), (result.stdout, text)
    assert f"{len(new)} tokens in" in result.stderr, result.stderr


def test_a_hybrid_fused_graph_carries_its_linear_attention_states_through_bound_steps(onnx_variant):
    """On the CPU a fused graph runs through IO binding (its KV one buffer per layer), and a hybrid model's conv and
    recurrent states are not shared: each step's presents must be carried to the next. The fused graph's decode
    steps give the plain graph's logits (which runs without binding) to float32 rounding, and the same greedy
    tokens (a mutation that dropped the bound path's unshared presents passed test_runtime.py, whose fused-graph
    checks compare the fused graph with itself)."""
    fused = OnnxDecoder(onnx_variant("qwen3_5", head_dim=None), provider="cpu")
    plain = OnnxDecoder(onnx_variant("qwen3_5", graph="plain", head_dim=None), provider="cpu")
    assert fused.shared_kv and any(name.endswith(".recurrent_state") for name in fused.past_names)
    prompt = np.array([[5, 9, 17, 33], [8, 7, 6, 5]], dtype=np.int64)
    (expected, expected_state), (actual, actual_state) = (d.prefill(prompt) for d in (plain, fused))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)
    token = expected[:, -1].argmax(-1)
    for step in range(4):
        expected = plain.decode_one_token(token, expected_state)
        actual = fused.decode_one_token(token, actual_state)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4, err_msg=f"step {step}")
        token = expected.argmax(-1)
    np.testing.assert_array_equal(
        fused.generate(prompt, max_new_tokens=6, eos_token_id=[]),
        plain.generate(prompt, max_new_tokens=6, eos_token_id=[]),
    )
