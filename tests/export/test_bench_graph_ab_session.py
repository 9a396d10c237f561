"""bench_graph_ab.py ``--runtime session``: a bare onnxruntime session per folder, prefill then decode steps that feed
each folder its own KV cache back. Two exports of one function must keep equal greedy tokens step after step (or the
run stops), and two different functions must be caught, or its ratios would compare unlike work."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_graph_ab  # noqa: E402


@pytest.fixture(autouse=True)
def small_vocabulary(monkeypatch):
    monkeypatch.setattr(bench_graph_ab, "PROMPT_IDS", (3, 90))  # the test models' 96 ids


def settings(**overrides) -> argparse.Namespace:
    fields = dict(batch=2, prompt=5, runtime="session", prefill=False, threads=1, steps=4, gap=0.0, restart=3)
    return argparse.Namespace(**(fields | {"own_tokens": False} | overrides))


def test_one_function_keeps_equal_tokens_through_decode_and_prefill(onnx_variant):
    folders = [onnx_variant("qwen2", graph="fused"), onnx_variant("qwen2", graph="plain")]
    for args in (settings(), settings(prefill=True)):
        steps = bench_graph_ab.repetition(folders, args)
        assert set(steps) == {str(folder) for folder in folders}
        assert all(seconds > 0 for seconds in steps.values())


def test_two_functions_are_refused_unless_each_follows_its_own_tokens(onnx_variant):
    folders = [onnx_variant("qwen2"), onnx_variant("qwen2", hidden_size=48)]  # other random weights
    with pytest.raises(SystemExit, match="greedy tokens differ"):
        bench_graph_ab.repetition(folders, settings())
    assert len(bench_graph_ab.repetition(folders, settings(own_tokens=True))) == 2


def test_decode_steps_hand_the_cache_back_as_the_runtime_does(onnx_variant, monkeypatch):
    """The session path's greedy tokens, step by step, are OnnxDecoder's (the parity-tested runtime): a step that
    dropped or mis-fed the returned KV cache would pick other tokens."""
    from export.runtime import OnnxDecoder

    folder = onnx_variant("qwen2")
    args = settings(steps=6)

    def recorded(folders, args, start, step, tokens):
        start()
        picks = []
        for _ in range(args.steps):
            picks.append(tokens(0))
            step(0, picks[-1])
        return picks

    monkeypatch.setattr(bench_graph_ab, "decode_rounds", recorded)
    picks = bench_graph_ab.repetition([folder], args)

    ids = np.random.default_rng(0).integers(*bench_graph_ab.PROMPT_IDS, size=(args.batch, args.prompt))
    decoder = OnnxDecoder(folder, provider="cpu")
    logits, state = decoder.prefill(ids, np.ones_like(ids))
    expected = [logits[:, -1].argmax(-1)]
    for _ in range(args.steps - 1):
        expected.append(decoder.decode_one_token(expected[-1], state).argmax(-1))
    assert len({tuple(t) for t in expected}) > 1  # the tokens move: a stale cache would show
    np.testing.assert_array_equal(np.stack(picks), np.stack(expected))
