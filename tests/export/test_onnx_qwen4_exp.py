"""Qwen3.8 (``qwen4_exp``) exported whole: hyper-connection streams, the PLE layers' hashed n-gram embeddings and
the QSA indexers of its ``indexed_attention`` layers, with every state they carry (export/qwen4_exp_graph.py), in the
plain graph and the fused one, run by onnxruntime (CPU) against the PyTorch Thinker (whose equality with
transformers' Qwen4ExpForCausalLM tests/test_modeling_qwen4_exp.py proves). The tiny model is export_helpers'
``qwen4_exp`` family; its indexers prune from 12 visible tokens on, so the long prompts here reach their choice.

Tolerance: float32, 1e-4 x max(1, logit scale) (DESIGN.md), as for every family.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from export_helpers import graph_nodes

from export.runtime import DecoderState, OnnxDecoder, position_ids_from_mask
from export.verify import LEFT_PADDING_ONLY, compare_decoders
from thinker.modeling_thinker import lowest_block_wins_ties
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch

FAMILY = "qwen4_exp"
GRAPHS = ["plain", "fused"]
VOCAB = 96
EOS = 2  # export_helpers' eos, where the n-grams restart


def load_thinker(folder):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def bound(figures: dict) -> float:
    return RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"])


def long_left_padded() -> tuple[np.ndarray, np.ndarray]:
    """Rows of 41 and 26 tokens (the second left-padded by 15), each with an eos inside: both indexers prune from
    the prefill on, and the n-gram contexts restart mid-row."""
    rng = np.random.default_rng(3)
    ids = rng.integers(3, VOCAB, size=(2, 41))
    ids[0, 17], ids[1, 30] = EOS, EOS
    mask = np.ones_like(ids)
    ids[1, :15], mask[1, :15] = 0, 0
    return ids, mask


@pytest.fixture(scope="module")
def folder(thinker_variant):
    return thinker_variant(FAMILY)


def export(onnx_variant, graph: str, **options):
    return onnx_variant(FAMILY, graph=graph, head_dim=None, **options)


# --- float32 parity ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", GRAPHS)
def test_float32_parity_on_the_fixed_prompts(folder, graph, onnx_variant):
    decoder = OnnxDecoder(export(onnx_variant, graph), provider="cpu")
    figures = compare_decoders(load_thinker(folder), decoder, *parity_batch(VOCAB), steps=6)
    assert figures["max_abs_diff"] <= bound(figures), figures
    assert figures["top1_agreement"] == 1.0, figures


@pytest.mark.parametrize("graph", GRAPHS)
def test_float32_parity_where_the_indexer_prunes(folder, graph, onnx_variant):
    """A left-padded batch long enough for every indexer to choose (41 and 26 tokens, budget 8), eos inside each
    row, then 8 decode steps: each query's choice of blocks, the n-gram contexts and the PLE conv windows carried."""
    decoder = OnnxDecoder(export(onnx_variant, graph), provider="cpu")
    figures = compare_decoders(load_thinker(folder), decoder, *long_left_padded(), steps=8)
    assert figures["max_abs_diff"] <= bound(figures), figures
    assert figures["top1_agreement"] == 1.0, figures


def test_chunked_prefill_equals_one_prefill(folder, onnx_variant):
    """The plain graph fed a prompt in chunks (the first shorter than the n-gram context) gives the logits of one
    prefill: every state, the index keys and positions included, carries across forwards."""
    decoder = OnnxDecoder(export(onnx_variant, "plain"), provider="cpu")
    ids, mask = long_left_padded()
    whole, _ = decoder.prefill(ids, mask)
    state, parts = DecoderState(mask[:, :0], np.zeros(2, np.int64), decoder.empty_cache(2)), []
    positions = position_ids_from_mask(mask)
    for start, stop in ((0, 1), (1, 20), (20, 41)):
        state.attention_mask = mask[:, :stop]
        parts.append(decoder.forward(ids[:, start:stop], positions[:, start:stop], state))
    chunked = np.concatenate(parts, axis=1)
    kept = mask.astype(bool)
    scale = max(1.0, float(np.abs(whole[kept]).max()))
    np.testing.assert_allclose(chunked[kept], whole[kept], atol=1e-4 * scale, rtol=0)


# --- the graph's interface --------------------------------------------------------------------------------------------
def test_state_inputs_and_outputs(onnx_variant):
    """Each PLE layer (0 and 4) carries its n-gram context (int64) and conv window, each indexed layer (1 and 3) its
    KV and raw index keys, the first one the positions of every slot; every past has its present."""
    model = onnx.load(str(export(onnx_variant, "fused") / "model.onnx"), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    expected = {
        "past_key_values.0.ngram_context": [0, 2],
        "past_key_values.0.ple_conv_state": [0, 96, 6],
        "past_key_values.4.ngram_context": [0, 2],
        "past_key_values.1.index_keys": [0, 1, 0, 12],
        "past_key_values.3.index_keys": [0, 1, 0, 12],
        "past_key_values.1.index_positions": [0, 3, 0],
    }
    for name, dims in expected.items():
        shape = [d.dim_value for d in inputs[name].type.tensor_type.shape.dim]
        assert shape == dims, (name, shape)
        assert name.replace("past_key_values.", "present.") in outputs
    assert "past_key_values.3.index_positions" not in inputs
    assert inputs["past_key_values.0.ngram_context"].type.tensor_type.elem_type == onnx.TensorProto.INT64


def test_no_genai_config_and_the_report_says_why(onnx_variant):
    folder = export(onnx_variant, "fused")
    assert not (folder / "genai_config.json").exists() and not (folder / "model.genai.onnx").exists()
    notes = json.loads((folder / "export_report.json").read_text())["notes"]
    assert any(note.startswith("no genai_config.json: onnxruntime-genai has no model type") for note in notes), notes
    card = (folder / "README.md").read_text()  # the card runs it with onnxruntime, not onnxruntime-genai
    assert "library_name: onnxruntime\n" in card and "onnxruntime_genai" not in card, card
    assert "no `genai_config.json`" in card and "OnnxDecoder(" in card, card


# --- the CLI: export with --verify, generate --------------------------------------------------------------------------
def test_export_verifies_and_generates(folder, tmp_path):
    """`thinker export` with its --verify (the indexers' long prompts included), then `thinker generate`."""
    out = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(folder), str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "export_report.json").read_text())
    assert report["verify"]["passed"] is True, report["verify"]
    assert "on prompts the indexers prune" in result.output  # the verify line, and the card, name the long prompts
    assert "On prompts long enough for the indexers to prune: max" in (out / "README.md").read_text()
    assert any(node.op_type == "GroupQueryAttention" for node in graph_nodes(out / "model.onnx"))
    # thinker generate carries every state: the ONNX folder's greedy text is the PyTorch Thinker's, ties to the
    # earlier blocks in both (the single index head ties often; with torch.topk's ties the first token differs)
    prompt = ["-p", "the cat sat on the mat and the dog ran to the big red house", "-n", "12"]
    onnx_run = CliRunner().invoke(main, ["generate", str(out), *prompt])
    with lowest_block_wins_ties():
        torch_run = CliRunner().invoke(main, ["generate", str(folder), *prompt])
    assert onnx_run.exit_code == 0 and torch_run.exit_code == 0, onnx_run.output + torch_run.output
    assert onnx_run.stdout == torch_run.stdout and onnx_run.stdout.strip(), (onnx_run.stdout, torch_run.stdout)
    # its PLE states carry each row's last slots on: rows padded after their tokens are refused, not run wrong (a
    # QA sweep's pass over rows padded on both sides found them 4.1 off); --verify says why it skips that pass
    assert report["verify"]["padded_around"] == {"not_run": LEFT_PADDING_ONLY}
    with pytest.raises(ThinkerError, match="takes left-padded batches only .* pads after its tokens; pad the rows"):
        OnnxDecoder(out, provider="cpu").prefill(np.array([[5, 6, 7, 0]]), np.array([[1, 1, 1, 0]]))


def test_a_last_logits_export_verifies(folder, tmp_path):
    """``--logits last``: its check's right-padded prefill, which this graph refuses, is not run (it failed every
    such export, a QA run found); the left-padded batch, the long prompts and the decode steps are."""
    out = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--logits", "last"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["verify"]["passed"] is True


@pytest.mark.parametrize("graph", GRAPHS)
def test_ple_without_hyper_connections(thinker_variant, onnx_variant, graph):
    """hc_count 1 (one residual stream) with PLE layers: the PLE addition joins the plain residual before the norm,
    in the layers that fuse the residual add into the norm too."""
    folder = thinker_variant(FAMILY, hc_count=1)
    decoder = OnnxDecoder(onnx_variant(FAMILY, graph=graph, head_dim=None, hc_count=1), provider="cpu")
    figures = compare_decoders(load_thinker(folder), decoder, *long_left_padded(), steps=6)
    assert figures["max_abs_diff"] <= bound(figures), figures


def test_a_ple_conv_of_kernel_1_is_refused(thinker_variant, tmp_path):
    """A kernel of 1 keeps no window, which neither transformers' cache nor the graph's state can carry: one line,
    nothing written."""
    folder = thinker_variant(FAMILY, ple_conv_kernel_size=1)
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "onnx"), "--no-verify"])
    assert result.exit_code == 1 and not (tmp_path / "onnx").exists(), result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"error: {folder / 'config.json'}: ple_conv_kernel_size=1: a PLE conv of kernel 1")


# --- planted bugs: --verify catches each ------------------------------------------------------------------------------
def planted_bugs():
    import export.qwen4_exp_graph as wiring

    select, inject = wiring.emit_indexer_selection, wiring.emit_inject

    def never_prunes(*args):
        """The indexer's keys carried, its choice ignored: every visible slot kept (right within its budget)."""
        select(*args)
        return args[9]  # visible

    def half_weighted(b, streams, output, weights):
        """The 2 of 2·sigmoid dropped: each stream given the sub-layer's output at half its learned weight."""
        return inject(b, streams, output, b.op("Mul", weights, b.const(0.5, torch.float32)))

    return {"emit_indexer_selection": never_prunes, "emit_inject": half_weighted}


@pytest.mark.parametrize(
    ("planted", "failure"),
    [("emit_indexer_selection", "on prompts long enough for the indexers to choose"), ("emit_inject", "max |Δlogit|")],
    ids=["indexer-never-prunes", "hyper-connections-half-weighted"],
)
def test_verify_fails_on_a_planted_bug(thinker_variant, tmp_path, monkeypatch, planted, failure):
    """With a budget of 16 slots the fixed prompts (7 tokens and 6 steps) never reach an indexer's choice: an indexer
    that keeps every slot passes them and fails on the longer prompts alone (the indexers', every model's, and the
    continuation's).
    Hyper-connections that inject at half weight fail at once. Nothing is written either way."""
    import export.qwen4_exp_graph

    monkeypatch.setattr(export.qwen4_exp_graph, planted, planted_bugs()[planted])
    folder = thinker_variant(FAMILY, indexer_budget=16)
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "onnx")])
    assert result.exit_code == 1 and not (tmp_path / "onnx").exists(), result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("error: onnxruntime disagrees with PyTorch") and failure in message, message
    if planted == "emit_indexer_selection":  # the fixed prompts passed: only the long ones, the indexers' and all's,
        # and the continuation (80 tokens, past the budget)
        assert message.count("max |Δlogit|") == 3 and "model.onnx on prompts of 7 and 4" not in message, message
        assert "model.onnx on prompts of" in message and "continued by 70 in one step" in message, message


def test_quantized_verify_runs_the_long_prompts_too(thinker_variant, tmp_path, monkeypatch):
    """Under --quantize the graph is held to the Thinker with its dequantized weights on the long prompts as well:
    an indexer that never prunes fails there."""
    import export.qwen4_exp_graph

    monkeypatch.setattr(export.qwen4_exp_graph, "emit_indexer_selection", planted_bugs()["emit_indexer_selection"])
    folder = thinker_variant(FAMILY, indexer_budget=16)
    gate = ["--min-top1", "0", "--max-perplexity-increase", "100"]
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "onnx"), "--quantize", "int8", *gate])
    assert result.exit_code == 1 and not (tmp_path / "onnx").exists(), result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("error: the quantized export fails its check") and "indexers to choose" in message


# --- other dtypes and --quantize --------------------------------------------------------------------------------------
def test_float16_export_reports_the_long_prompts_unjudged(folder, tmp_path):
    """float16: the fixed prompts held to float16's tolerance; the long prompts' figures reported but not judged
    (a half network's rounding flips an indexer's near-ties: export/verify.py ``indexer_failures``)."""
    out = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--dtype", "float16", "--graph", "plain"])
    assert result.exit_code == 0, result.output
    verify = json.loads((out / "export_report.json").read_text())["verify"]
    assert verify["passed"] and verify["max_abs_diff"] <= verify["tolerance"], verify
    assert verify["indexer_prompts"]["judged"] is False and "near-tie" in verify["indexer_prompts"]["why"]


def test_int4_keeps_the_indexer_and_hyper_connections_float(folder, tmp_path):
    """--quantize int4 passes its own verify (the graph against the Thinker holding the same dequantized weights; the
    cost gate opened: a tiny random model's int4 top-1 says nothing); the projections are MatMulNBits, the indexers'
    and the hyper-connections' small matrices plain MatMuls (a rounded indexer would move whole blocks)."""
    out = tmp_path / "onnx"
    gate = ["--min-top1", "0", "--max-perplexity-increase", "100"]
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--quantize", "int4", *gate])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["verify"]["passed"] is True
    nodes = list(graph_nodes(out / "model.onnx"))
    quantized = [n.name for n in nodes if n.op_type == "MatMulNBits"]
    assert quantized and not any("indexer" in n or "hyper_connection" in n for n in quantized), quantized
    floats = [n.name for n in nodes if n.op_type == "MatMul"]
    assert any("/indexer/" in n for n in floats) and any("hyper_connection" in n for n in floats), floats
