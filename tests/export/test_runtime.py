"""export/runtime.py: greedy generation against transformers, session options, and error messages."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnx
import pytest
import torch

import export.onnx_folder
import export.runtime
from export.names import GENAI_MODEL_FILE, MODEL_FILE
from export.providers import physical_cores
from export.runtime import DecoderState, OnnxDecoder, generation_graph
from thinker_common.errors import ThinkerError


def transformers_greedy(folder, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """transformers' greedy ``generate`` on the Thinker folder, every row running all ``new_tokens``."""
    from thinker import ThinkerForCausalLM

    model = ThinkerForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model.generate(
            torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attention_mask),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        ).numpy()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt2"])
def test_generate_equals_transformers_greedy(family, thinker_folder, onnx_folder):
    """A left-padded batch of two, 8 new tokens: the same tokens as transformers' generate (eos never stops it
    early here: the ids come from an untrained model, so the test uses an eos outside the vocabulary)."""
    input_ids = np.array([[0, 0, 5, 9, 17], [4, 8, 15, 16, 23]], dtype=np.int64)
    attention_mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=np.int64)
    expected = transformers_greedy(thinker_folder(family), input_ids, attention_mask, 8)
    decoder = OnnxDecoder(onnx_folder(family), provider="cpu")
    tokens = decoder.generate(input_ids, attention_mask, max_new_tokens=8)
    np.testing.assert_array_equal(tokens, expected)


def test_a_model_past_ten_layers_pairs_each_present_with_its_past(thinker_variant, onnx_variant):
    """Ten layers or more: ``present.10.key`` sorts between ``present.1.key`` and ``present.2.key``, so a present
    paired with its past by sorted name, not by layer, would feed layer 10's cache back to layer 2 (a QA run's
    mutation, which every test model of up to 10 layers let pass: the prefill exact, every decode step off)."""
    input_ids, attention_mask = np.array([[0, 5, 9, 17], [4, 8, 15, 16]]), np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    expected = transformers_greedy(thinker_variant("qwen3", num_hidden_layers=12), input_ids, attention_mask, 6)
    for graph in ("plain", "fused"):
        decoder = OnnxDecoder(onnx_variant("qwen3", graph=graph, head_dim=None, num_hidden_layers=12), provider="cpu")
        tokens = decoder.generate(input_ids, attention_mask, max_new_tokens=6, eos_token_id=[])
        np.testing.assert_array_equal(tokens, expected, err_msg=graph)


@pytest.mark.parametrize(("family", "graph"), [("qwen3", "plain"), ("qwen3", "fused"), ("qwen3_5", "fused")])
def test_generate_gives_each_row_its_own_tokens_however_padded(family, graph, onnx_folder, onnx_variant):
    """``model.onnx`` takes any padding, so a batch padded on either side continues each row as that row alone:
    a right-padded row's first new token comes from its last real token's logits, not from its pads'."""
    folder = onnx_folder(family) if graph == "plain" else onnx_variant(family, head_dim=None)
    decoder = OnnxDecoder(folder, provider="cpu")
    rows = [[5, 6, 40, 41], [7, 8, 9, 10, 11, 12, 13]]
    # eos_token_id=[]: every row runs its 6 tokens, so rows compare whole whichever stops first
    alone = [
        decoder.generate(np.array([row]), max_new_tokens=6, eos_token_id=[])[0, len(row) :].tolist() for row in rows
    ]
    width = max(map(len, rows))
    for side in ("left", "right"):
        pads = [[0] * (width - len(row)) for row in rows]
        ids = np.array([pad + row if side == "left" else row + pad for row, pad in zip(rows, pads, strict=True)])
        mask = (np.arange(width) < np.array([[len(row)] for row in rows])).astype(np.int64)
        mask = mask[:, ::-1] if side == "left" else mask
        assert decoder.generate(ids, mask, max_new_tokens=6, eos_token_id=[])[:, width:].tolist() == alone, side
        # the prompt's own positions, as transformers numbers a padded batch (pads at 1), three rows for a
        # multimodal-RoPE model: each row goes on from its last real token's position, not its last slot's
        positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
        if family == "qwen3_5":
            positions = np.broadcast_to(positions, (3, *positions.shape)).copy()
        given = decoder.generate(ids, mask, max_new_tokens=6, eos_token_id=[], position_ids=positions)
        assert given[:, width:].tolist() == alone, f"{side}, positions given"


def test_generate_stops_rows_at_eos(onnx_folder):
    decoder = OnnxDecoder(onnx_folder("qwen2"), provider="cpu")
    prompt = np.array([[5, 9, 17]], dtype=np.int64)
    free = decoder.generate(prompt, max_new_tokens=6)
    eos = int(free[0, 4])  # the second new token: generation must stop right after it
    stopped = decoder.generate(prompt, max_new_tokens=6, eos_token_id=[eos])
    first = int(np.argmax(free[0, 3:] == eos))  # eos may already appear as the first new token
    np.testing.assert_array_equal(stopped[0], free[0, : 3 + first + 1])


def test_generate_stops_at_the_folders_own_eos_by_default(onnx_folder, tmp_path):
    """As transformers' ``generate`` takes its model's generation config: without ``eos_token_id``, the folder's
    (generation_config.json's) eos and pad ids; ``eos_token_id=[]`` stops at none."""
    folder = tmp_path / "onnx"
    shutil.copytree(onnx_folder("qwen2"), folder)
    prompt = np.array([[5, 9, 17]], dtype=np.int64)
    free = OnnxDecoder(folder, provider="cpu").generate(prompt, max_new_tokens=6, eos_token_id=[])
    eos = int(free[0, 4])
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"], config["pad_token_id"] = eos, 3
    (folder / "generation_config.json").write_text(json.dumps(config))
    decoder = OnnxDecoder(folder, provider="cpu")
    first = int(np.argmax(free[0, 3:] == eos))
    np.testing.assert_array_equal(decoder.generate(prompt, max_new_tokens=6), free[:, : 3 + first + 1])
    np.testing.assert_array_equal(decoder.generate(prompt, max_new_tokens=6, eos_token_id=[]), free)
    batch = decoder.generate(np.array([[5, 9, 17], [6, 9, 17]]), max_new_tokens=6)
    row = batch[0, 3:].tolist()
    assert row[: first + 1] == free[0, 3 : 3 + first + 1].tolist() and set(row[first + 1 :]) <= {3}  # padded
    # an eos given keeps the folder's pad, as transformers' generate keeps its generation config's
    explicit = decoder.generate(np.array([[5, 9, 17], [6, 9, 17]]), max_new_tokens=6, eos_token_id=eos)
    np.testing.assert_array_equal(explicit, batch)
    # a list stops at any of its ids, the first named or not (Qwen3's [151645, 151643]; a QA run's mutation kept
    # the first alone)
    unused = next(token for token in range(100) if token not in free[0].tolist())
    config["eos_token_id"] = [unused, eos]
    (folder / "generation_config.json").write_text(json.dumps(config))
    np.testing.assert_array_equal(decoder.generate(prompt, max_new_tokens=6), free[:, : 3 + first + 1])
    # no pad named: rows that stop are padded with the first eos id, as transformers pads (not the smallest)
    config.pop("pad_token_id")
    config["eos_token_id"] = [eos, eos - 1 if eos else eos + 1]
    (folder / "generation_config.json").write_text(json.dumps(config))
    unpadded = decoder.generate(np.array([[5, 9, 17], [6, 9, 17]]), max_new_tokens=6)
    assert set(unpadded[0, 3 + first + 1 :].tolist()) <= {eos}
    # generation_config.json is taken whole: its null eos stops nowhere, whatever config.json names
    config["eos_token_id"] = None
    (folder / "generation_config.json").write_text(json.dumps(config))
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, "eos_token_id": eos}))
    np.testing.assert_array_equal(decoder.generate(prompt, max_new_tokens=6), free)
    config["eos_token_id"] = [eos, -1]
    (folder / "generation_config.json").write_text(json.dumps(config))
    with pytest.raises(ThinkerError, match=r"generation_config.json: eos_token_id=\[\d+, -1\]; expected"):
        decoder.generate(prompt, max_new_tokens=6)


def test_generate_feeds_a_streamer_as_each_token_is_chosen(onnx_folder):
    """transformers' streamer protocol, which `thinker generate` prints through (TextStreamer): the prompt, then each
    step's tokens before the next step runs, then end()."""
    calls: list = []

    class Recorder:
        def put(self, value):
            calls.append(np.asarray(value).tolist())

        def end(self):
            calls.append("end")

    decoder = OnnxDecoder(onnx_folder("qwen2"), provider="cpu")
    decode_one_token = decoder.decode_one_token
    decoder.decode_one_token = lambda *args: calls.append("step") or decode_one_token(*args)
    prompt = np.array([[5, 9, 17]], dtype=np.int64)
    tokens = decoder.generate(prompt, max_new_tokens=3, streamer=Recorder())
    new = tokens[0, 3:].tolist()
    assert calls == [prompt.tolist(), [new[0]], "step", [new[1]], "step", [new[2]], "end"]


def test_only_kv_that_attention_alone_reads_is_shared():
    """shared_kv_names: a past that GroupQueryAttention reads and writes back as its own present, and nothing else
    reads; a past another node also reads (here a Shape, in an If branch: it would see the buffer's unused slots)
    or one written to a differently named present keeps the copying form."""
    from onnx import helper

    from export.runtime import shared_kv_names

    def attention(layer: int, present_key: str) -> onnx.NodeProto:
        pasts = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        outputs = [f"attention.{layer}", present_key, f"present.{layer}.value"]
        return helper.make_node("GroupQueryAttention", ["q", "", "", *pasts, "seqlens", "total"], outputs)

    shape = helper.make_node("Shape", ["past_key_values.1.key"], ["past_length"])
    branch = helper.make_graph([shape], "branch", [], [])
    reads_in_a_branch = helper.make_node("If", ["condition"], ["x"], then_branch=branch, else_branch=branch)
    nodes = [attention(0, "present.0.key"), attention(1, "present.1.key"), attention(2, "other"), reads_in_a_branch]
    graph = helper.make_graph(nodes, "g", [], [])
    assert shared_kv_names(graph) == {
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.value",
        "past_key_values.2.value",
    }


def test_threads_and_provider(onnx_folder):
    decoder = OnnxDecoder(onnx_folder("qwen2"), provider="cpu", threads=1)
    assert decoder.session.get_session_options().intra_op_num_threads == 1
    assert decoder.device == "cpu"
    default = OnnxDecoder(onnx_folder("qwen2"), provider="cpu")
    assert default.session.get_session_options().intra_op_num_threads == physical_cores()


@pytest.mark.skipif(export.runtime.cuda_usable(), reason="CUDA is here")
def test_cuda_asked_for_where_none_is_said_in_the_api_terms(onnx_folder):
    with pytest.raises(ThinkerError, match=re.escape("provider='cuda': CUDA asked for where none is")) as caught:
        OnnxDecoder(onnx_folder("qwen2"), provider="cuda")
    assert "--provider" not in str(caught.value)


def test_cuda_sessions_keep_full_float32(monkeypatch, onnx_folder):
    """onnxruntime's CUDA provider runs float32 matmuls in TF32 unless use_tf32 is 0 (PyTorch's keep float32): a
    float32 graph on CUDA was 0.5 off the reference (Qwen3.8 on an H200) and could not meet float32's tolerance. The
    session is asked for with it off; spied on here (CI has no GPU), while tests/export/test_onnx_gpu.py holds
    float32 graphs on CUDA to float32's tolerance."""
    asked = []
    real_session = export.runtime.ort.InferenceSession

    def spy(source, options, providers):
        asked.append(providers)
        return real_session(source, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(export.runtime, "cuda_usable", lambda: True)
    monkeypatch.setattr(export.runtime.ort, "InferenceSession", spy)
    OnnxDecoder(onnx_folder("qwen3"), provider="auto")
    assert asked == [[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]]


def test_missing_model_is_a_thinker_error(tmp_path):
    with pytest.raises(ThinkerError, match="no such ONNX model"):
        OnnxDecoder(tmp_path)
    # a folder in the model file's place, given as the folder or as the file (it read .../model.onnx/model.onnx)
    (tmp_path / MODEL_FILE).mkdir()
    for given in (tmp_path, tmp_path / MODEL_FILE):
        with pytest.raises(ThinkerError, match=re.escape(f"{tmp_path / MODEL_FILE}: a folder where the ONNX model")):
            OnnxDecoder(given)


@pytest.mark.parametrize(
    ("provider", "cuda_runs", "expected"),
    [
        ("cpu", True, MODEL_FILE),
        ("cuda", False, GENAI_MODEL_FILE),
        ("auto", True, GENAI_MODEL_FILE),
        ("auto", False, MODEL_FILE),
    ],
)
def test_generation_graph_is_the_genai_one_on_cuda(
    provider, cuda_runs, expected, onnx_variant, onnx_folder, monkeypatch
):
    """For prompts without padding ``thinker generate`` runs model.genai.onnx on CUDA (no padding bias) and
    model.onnx on the CPU; a folder without the genai graph (the plain graph's) gives model.onnx everywhere."""
    monkeypatch.setattr(export.runtime, "cuda_usable", lambda: cuda_runs)
    fused = onnx_variant("qwen3")
    assert generation_graph(fused, provider) == fused / expected
    plain = onnx_folder("qwen3")
    assert not (plain / GENAI_MODEL_FILE).exists()
    assert generation_graph(plain, provider) == plain / MODEL_FILE


def test_generation_graph_on_cuda_needs_the_shared_kv(onnx_variant):
    """The genai graph only with its KV written in place: over the copying form (``share_kv=False``, or a bfloat16
    cache, which CUDA keeps copying) an H100 decoded it 15x slower than model.onnx (``generation_graph``)."""
    fused = onnx_variant("qwen3")
    assert generation_graph(fused, "cuda", share_kv=True) == fused / GENAI_MODEL_FILE
    assert generation_graph(fused, "cuda", share_kv=False) == fused / MODEL_FILE
    half = onnx_variant("qwen3", dtype="bfloat16")
    assert (half / GENAI_MODEL_FILE).is_file()
    assert generation_graph(half, "cuda") == half / MODEL_FILE
    assert generation_graph(onnx_variant("qwen3", dtype="float16"), "cuda").name == GENAI_MODEL_FILE


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_genai_graph_equals_the_padded_one_on_a_prompt_without_pads(family, onnx_variant):
    """What ``generation_graph`` relies on: for a prompt without pads the genai graph gives model.onnx's logits (to
    float32 rounding) at the prefill's last position (the one it puts through the head) and at each decode step,
    and the same greedy tokens."""
    folder = onnx_variant(family, head_dim=None if family == "qwen3_5" else 16)  # a hybrid keeps its own
    prompt = np.array([[5, 9, 17, 33, 4, 21], [8, 7, 6, 5, 4, 3]], dtype=np.int64)
    padded, genai = OnnxDecoder(folder, provider="cpu"), OnnxDecoder(folder / GENAI_MODEL_FILE, provider="cpu")
    (expected, expected_state), (actual, actual_state) = (
        d.prefill(prompt, np.ones_like(prompt)) for d in (padded, genai)
    )
    assert actual.shape == (2, 1, expected.shape[-1])
    np.testing.assert_allclose(actual[:, 0], expected[:, -1], atol=1e-4, rtol=0)
    token = expected[:, -1].argmax(-1)
    for _ in range(4):
        expected = padded.decode_one_token(token, expected_state)
        np.testing.assert_allclose(genai.decode_one_token(token, actual_state), expected, atol=1e-4, rtol=0)
        token = expected.argmax(-1)
    np.testing.assert_array_equal(genai.generate(prompt, max_new_tokens=8), padded.generate(prompt, max_new_tokens=8))


def test_one_row_of_positions_stands_for_every_row(onnx_folder):
    """``forward`` with (1, T) positions for a batch of 2 (a position_ids transformers broadcasts): each row's logits
    as with the positions repeated per row."""
    from export.runtime import DecoderState, OnnxDecoder

    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    ids, mask = np.array([[3, 4, 5], [6, 7, 8]]), np.ones((2, 3), np.int64)
    logits = {}
    for rows in (1, 2):
        state = DecoderState(mask, np.full(2, 3), decoder.empty_cache(2))
        logits[rows] = decoder.forward(ids, np.tile(np.arange(3), (rows, 1)), state)
    np.testing.assert_array_equal(logits[1], logits[2])


def test_bad_inputs_are_refused_by_name(onnx_folder):
    """What onnxruntime would fail on deep inside the graph (a Gather out of range, mismatched shapes), or compute
    without a word (a negative id reads the table's last row, a mask of 0.5 casts to 0), is a ThinkerError saying
    what is wrong; lists are taken as arrays, as ``generate`` takes them."""
    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    vocab, context = decoder.vocab_size, decoder.context_length
    assert vocab and context
    logits, state = decoder.prefill([[3, 4, 5]], [[1, 1, 1]])  # lists
    assert logits.shape[:2] == (1, 3)
    cases = {
        "outside this model's vocabulary": ([[3, vocab]], [[1, 1]]),
        "outside this model's vocabulary [0,": ([[3, -1]], [[1, 1]]),
        "token ids are integers": ([[3.0, 4.0]], [[1, 1]]),
        "expected (batch, seq)": ([3, 4], [1, 1]),
        "at least one token": (np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)),
        "(1, 3) for input_ids of shape (1, 2); a prompt's mask has one column per position": ([[3, 4]], [[1, 1, 1]]),
        "values other than 0 and 1": ([[3, 4]], [[0.5, 1]]),
        "row 1 of attention_mask keeps no token": ([[3, 4], [5, 6]], [[1, 1], [0, 0]]),
        "past this model's context": (np.full((1, context + 1), 3), np.ones((1, context + 1), np.int64)),
    }
    for fragment, (ids, mask) in cases.items():
        with pytest.raises(ThinkerError, match=re.escape(fragment)):
            decoder.prefill(ids, mask)
    with pytest.raises(ThinkerError, match="one token per row"):
        decoder.decode_one_token(np.array([1, 2]), state)
    # generate: the same checks before any token (floats were truncated to ids), and its own arguments
    with pytest.raises(ThinkerError, match="token ids are integers"):
        decoder.generate([[5.7, 6.2]], max_new_tokens=2)
    with pytest.raises(ThinkerError, match=re.escape("max_new_tokens=-3; expected a whole number, 0 or more")):
        decoder.generate([[5, 6]], max_new_tokens=-3)
    # from a QA sweep: each of these ended in numpy's or Python's own exception, or (eos as a string) generated past
    # the eos without a word, since no token equals "2"
    misuse = {
        "input_ids: not a (batch, seq) array of token ids; pad rows of unequal length": lambda: decoder.generate(
            [[5, 6], [7]], max_new_tokens=2
        ),
        "eos_token_id='2'; expected a token id or a list of them": lambda: decoder.generate(
            [[5, 6]], max_new_tokens=2, eos_token_id="2"
        ),
        "eos_token_id=[[2]]; expected": lambda: decoder.generate([[5, 6]], max_new_tokens=2, eos_token_id=[[2]]),
        "pad_token_id=[0, 1]; expected a token id (": lambda: decoder.generate([[5, 6]], pad_token_id=[0, 1]),
        # refused before the first token: it failed when a row first stopped, naming no pad, a streamer mid-text
        "pad_token_id=500 is outside this model's vocabulary [0, 96)": lambda: decoder.generate(
            [[5, 6]], max_new_tokens=2, pad_token_id=500
        ),
        "new_tokens=-5; expected a whole number": lambda: decoder.prefill([[5, 6]], None, new_tokens=-5),
        "new_tokens=2.5; expected a whole number": lambda: decoder.prefill([[5, 6]], None, new_tokens=2.5),
        "state=None; expected the DecoderState this decoder's prefill returned": lambda: decoder.decode_one_token(
            np.array([1]), None
        ),
        "state: its cache lacks past_key_values.0.key: a state from another model's decoder": lambda: (
            decoder.decode_one_token(np.array([1]), DecoderState(np.ones((1, 3), np.int64), np.array([3])))
        ),
        "attention_mask holds values other than 0 and 1": lambda: decoder.forward(
            np.array([[1]]), np.array([[3]]), DecoderState(np.array([[1, 0.5]]), np.array([3]), dict(state.cache))
        ),
    }
    for fragment, call in misuse.items():
        with pytest.raises(ThinkerError, match=re.escape(fragment)):
            call()
    # numpy's integers are whole numbers, and eos ids may come as numpy or torch values
    as_given = decoder.generate([[5, 6]], max_new_tokens=np.int64(2), eos_token_id=torch.tensor([2]))
    assert np.array_equal(as_given, decoder.generate([[5, 6]], max_new_tokens=2, eos_token_id=2))
    streamed = []
    streamer = type("Streamer", (), {"put": lambda self, value: streamed.append(value), "end": lambda self: None})()
    with pytest.raises(ThinkerError, match=f"need {context + 1} positions, past this model's context of {context}"):
        decoder.generate(np.full((1, context - 8), 3), max_new_tokens=10, streamer=streamer)
    with pytest.raises(ThinkerError, match=f"need {context + 1} positions"):
        decoder.generate(np.full((1, context + 1), 3), max_new_tokens=0, streamer=streamer)
    assert streamed == []  # refused before the prompt was streamed or a token chosen
    for threads in (2.5, 0, True):
        with pytest.raises(ThinkerError, match=re.escape(f"threads={threads!r}; expected a whole number")):
            OnnxDecoder(onnx_folder("qwen3"), provider="cpu", threads=threads)
    with pytest.raises(ThinkerError, match=r"position_ids of shape \(1, 2\) for input_ids of shape \(1, 1\)"):
        decoder.forward(np.array([[1]]), np.array([[3, 4]]), state)
    # positions the graph's RoPE table cannot take as PyTorch does: refused, not truncated or read from its end
    with pytest.raises(ThinkerError, match=re.escape("position_ids hold -1; positions count from 0")):
        decoder.forward(np.array([[1]]), np.array([[-1]]), state)
    with pytest.raises(ThinkerError, match=re.escape("position_ids hold 3.5; the graph's RoPE tables hold whole")):
        decoder.forward(np.array([[1]]), np.array([[3.5]]), state)
    for bad in (np.nan, np.inf):  # neither whole nor a position
        with pytest.raises(ThinkerError, match=f"position_ids hold {bad}"):
            decoder.forward(np.array([[1]]), np.array([[bad]]), state)
    with pytest.raises(ThinkerError, match=re.escape("position_ids of dtype <U1; positions are whole numbers")):
        decoder.forward(np.array([[1]]), np.array([["3"]]), state)
    # a mask that does not cover the cache and the new tokens: refused, not run over the wrong slots
    with pytest.raises(ThinkerError, match=re.escape("attention_mask covers 2 slots, but the cache holds 3")):
        decoder.forward(
            np.array([[1]]), np.array([[3]]), DecoderState(state.attention_mask[:, :2], None, state.cache, 3)
        )
    longer = decoder.decode_one_token(np.array([4]), state)  # the state itself still steps on
    assert longer.shape == (1, vocab) and state.cached == 4


def test_a_refused_step_leaves_the_state_as_it_was(onnx_folder):
    """From a QA sweep: each refused ``decode_one_token`` used to leave a mask column behind, so the next good token
    was refused too ("attention_mask covers 5 slots, but the cache holds 3")."""
    decoder = OnnxDecoder(onnx_folder("qwen3"), provider="cpu")
    _, state = decoder.prefill([[3, 4, 5]], [[1, 1, 1]])
    _, fresh = decoder.prefill([[3, 4, 5]], [[1, 1, 1]])
    for bad in ([decoder.vocab_size], [-1], [2.5]):
        with pytest.raises(ThinkerError):
            decoder.decode_one_token(np.array(bad), state)
        assert state.attention_mask.shape == (1, 3) and state.cached == 3
    np.testing.assert_array_equal(decoder.decode_one_token(np.array([6]), state), decoder.decode_one_token([6], fresh))


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_a_config_claiming_more_context_than_the_position_table(family, onnx_folder, tmp_path):
    """From a QA sweep: a config edited to a longer context than the graph holds let a learned-position model (GPT-2
    layout) generate past its position table, into onnxruntime's Gather error with a traceback; the bound read only
    RoPE's table. Either table's rows bound the context, and the message names the table."""
    folder = shutil.copytree(onnx_folder(family), tmp_path / family)
    config = json.loads((folder / "config.json").read_text())
    rows = config["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 10 * rows}))
    decoder = OnnxDecoder(folder, provider="cpu")
    assert decoder.context_length == rows
    with pytest.raises(ThinkerError, match=f"need {rows + 1} positions, past this model's context of {rows}"):
        decoder.generate(np.full((1, rows - 8), 3), max_new_tokens=10)
    table = "position table" if family == "gpt2" else "RoPE table"
    assert export.onnx_folder.folder_context(folder) == (rows, f"the {table} rows of {MODEL_FILE}")


def test_slots_past_the_fused_graphs_rope_table_are_refused_by_name(onnx_variant, tmp_path):
    """From a QA run: the fused graph's GroupQueryAttention (its RoPE inside) reads its table one row per slot of the
    mask, and its MRotaryEmbedding takes at most the table's rows of new tokens in one run, so a prompt padded past
    the context with every position within it, or an image prompt longer than the table at low positions, stopped
    inside onnxruntime with a RuntimeError (and ``generate`` after printing tokens). Refused by name before any
    token; the plain graph, which reads a row per position, runs both."""
    pads, tokens = 10, 60  # 70 slots, positions 0 .. 59, a context of 64
    ids = np.full((1, pads + tokens), 3)
    mask = np.concatenate([np.zeros((1, pads), np.int64), np.ones((1, tokens), np.int64)], axis=1)
    fused = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    assert fused.rotates_by_slot and fused.context_length == 64
    with pytest.raises(ThinkerError, match="70 slots of attention_mask .* past the 64 rows of this graph's RoPE"):
        fused.prefill(ids, mask)
    short = np.array([[0] * 4 + [1] * 56])  # 6 new tokens after 60 slots need 65 (the last is not fed back)
    with pytest.raises(ThinkerError, match="65 slots"):  # before the first token
        fused.generate(ids[:, :60], short, max_new_tokens=6)
    assert fused.generate(ids[:, :60], short, max_new_tokens=5).shape == (1, 65)
    plain = OnnxDecoder(onnx_variant("qwen3", graph="plain"), provider="cpu")
    assert plain.prefill(ids, mask)[0].shape[:2] == (1, pads + tokens)
    # the table's rows bound the slots, not a context set shorter (a review): 50 slots, positions under 40, of 48
    shorter = shutil.copytree(onnx_variant("qwen3"), tmp_path / "shorter")
    config = json.loads((shorter / "config.json").read_text())
    (shorter / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 48}))
    decoder = OnnxDecoder(shorter, provider="cpu")
    padded = np.array([[0] * 10 + [1] * 40])
    assert decoder.context_length == 48 and decoder.prefill(ids[:, :50], padded)[0].shape[:2] == (1, 50)

    # Qwen3.5's interleaved mRoPE, a context of 128: 130 tokens whose positions stay under 11 (an image's block)
    streams = np.concatenate([np.arange(3), np.full(120, 3), np.arange(4, 11)])
    positions = np.broadcast_to(streams, (3, 1, len(streams)))
    ids = np.full((1, len(streams)), 3)
    fused = OnnxDecoder(onnx_variant("qwen3_5", head_dim=None), provider="cpu")
    assert fused.steps_within_table and fused.context_length == 128
    with pytest.raises(
        ThinkerError, match="130 new tokens in one run, past the 128 rows .* MRotaryEmbedding"
    ) as raised:
        fused.prefill(ids, position_ids=positions)
    assert "padding" not in str(raised.value) and "positions; export with --graph plain" in str(raised.value)
    # pads count as new tokens (a QA run: 6 columns of padding on every row, 128 tokens): the advice says so
    padded = np.concatenate([np.zeros((1, 6), np.int64), np.ones((1, 128), np.int64)], axis=1)
    with pytest.raises(ThinkerError, match="134 new tokens .* pads included: trim the batch's padding, or export"):
        fused.prefill(np.full((1, 134), 3), padded)
    plain = OnnxDecoder(onnx_variant("qwen3_5", graph="plain", head_dim=None), provider="cpu")
    assert plain.prefill(ids, position_ids=positions)[0].shape[:2] == (1, len(streams))


def test_a_bound_runs_failure_is_onnxruntimes_own(onnx_variant):
    """A run through IO binding (the fused graph's shared KV, on either device) fails with a bare RuntimeError where
    ``run`` raises onnxruntime's own types, which the export's check turns into one line naming the export: a graph
    broken there showed a traceback (a mutation run). A cache of the wrong width makes onnxruntime fail it."""
    from export.runtime import ORT_RUN_ERRORS

    decoder = OnnxDecoder(onnx_variant("qwen3"), provider="cpu")
    _, state = decoder.prefill([[3, 4, 5]], [[1, 1, 1]])
    assert decoder.shared_kv  # the bound path
    past = decoder.past_names[0]
    state.cache[past] = np.concatenate([state.cache[past]] * 2, axis=1)  # twice the key-value heads
    with pytest.raises(ORT_RUN_ERRORS, match="Error in execution"):
        decoder.decode_one_token(np.array([6]), state)
