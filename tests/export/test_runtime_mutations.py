"""export/runtime.py: the checks of ``forward`` a mutation run (helper-257) found the other tests let pass, each of
which let a bad call reach onnxruntime's own error (a kernel's message and a traceback) instead of a ThinkerError."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from export.runtime import DecoderState, OnnxDecoder
from thinker_common.errors import ThinkerError


def test_a_step_at_the_position_one_past_the_context_is_refused(onnx_folder):
    """A caller stepping with ``decode_one_token`` after a prompt that fills the context: the next position is the
    context's own length, one past the last row of the plain graph's RoPE table (the fused one refuses its slot
    first), refused by name, and the step undone."""
    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    context = decoder.context_length
    _, state = decoder.prefill(np.full((1, context), 3))
    with pytest.raises(ThinkerError, match=f"position {context} is past this model's context of {context}"):
        decoder.decode_one_token(np.array([4]), state)
    assert state.attention_mask.shape == (1, context) and state.cached == context


def test_a_hand_built_states_mask_shorter_than_the_new_tokens_is_refused(onnx_folder):
    """``forward`` on a DecoderState a caller built (``cached`` left None, as the dataclass defaults) whose mask has
    fewer columns than the new tokens: refused by its shape, not run into a broadcast error inside the graph."""
    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    state = DecoderState(np.ones((1, 2), np.int64), np.array([3]), decoder.empty_cache(1))
    expected = "attention_mask of shape (1, 2) for input_ids of shape (1, 3); expected (batch, past + seq)"
    with pytest.raises(ThinkerError, match=re.escape(expected)):
        decoder.forward(np.array([[3, 4, 5]]), np.arange(3)[None], state)


def test_a_hand_built_states_mask_longer_than_its_cache_is_refused(onnx_folder):
    """A DecoderState a caller built over an empty cache (``cached`` left None) with a mask of more columns than the
    new tokens: the cache's own KV says how many slots it holds, and the mask that does not cover exactly those and
    the new tokens is refused by name, not run into a broadcast error inside the graph (helper-257). A shared KV
    buffer (the fused graph's) holds unused slots, so there the mask alone says, as ``DecoderState`` documents."""
    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    state = DecoderState(np.ones((1, 5), np.int64), np.array([3]), decoder.empty_cache(1))
    with pytest.raises(ThinkerError, match=re.escape("attention_mask covers 5 slots, but the cache holds 0 and 3")):
        decoder.forward(np.array([[3, 4, 5]]), np.arange(3)[None], state)
    state.attention_mask = np.ones((1, 3), np.int64)  # the same state with the mask it needs runs
    assert decoder.forward(np.array([[3, 4, 5]]), np.arange(3)[None], state).shape[:2] == (1, 3)


def test_a_float16_graphs_input_at_65520_is_refused_and_just_below_taken():
    """A float16 graph casts its float32 inputs: 65520 is the least float32 that casts to inf (ties round to even,
    away from 65504), so it is refused; the float32 just below it rounds down to 65504 and is taken."""
    half = SimpleNamespace(input_overflow=65520.0, dtype="float16")  # what __init__ sets from a float16 graph
    with pytest.raises(ThinkerError, match=re.escape("inputs_embeds hold 65520.0 at (0, 1), beyond the float16")):
        OnnxDecoder.checked_floats(half, np.array([[1.0, 65520.0]], np.float32), "inputs_embeds")
    below = np.nextafter(np.float32(65520.0), np.float32(0))
    with np.errstate(over="ignore"):  # the cast the graph makes
        assert np.isfinite(np.float16(below)) and not np.isfinite(np.float16(np.float32(65520.0)))
    taken = OnnxDecoder.checked_floats(half, np.array([[1.0, below]], np.float32), "inputs_embeds")
    assert taken[0, 1] == below


def test_a_cuda_kv_is_shared_only_where_every_cache_can_be(tmp_path):
    """``cuda_shares_kv`` asks that every key and value cache be float16 or float32: one bfloat16 cache among them
    (which a shared buffer cannot grow through the host) keeps the whole graph off the shared form; other states'
    types do not count."""
    from onnx import TensorProto, helper

    from export.runtime import cuda_shares_kv

    def graph_with(*types: tuple[str, int]):
        inputs = [helper.make_tensor_value_info(name, kind, None) for name, kind in types]
        path = tmp_path / f"graph{len(list(tmp_path.iterdir()))}.onnx"
        onnx.save(helper.make_model(helper.make_graph([], "g", inputs, [])), path)
        return path

    half, bf16 = TensorProto.FLOAT16, TensorProto.BFLOAT16
    assert cuda_shares_kv(graph_with(("past_key_values.0.key", half), ("past_key_values.0.value", half)))
    assert cuda_shares_kv(graph_with(("past_key_values.0.key", half), ("past_key_values.1.recurrent_state", bf16)))
    assert not cuda_shares_kv(graph_with(("past_key_values.0.key", half), ("past_key_values.1.value", bf16)))
