"""onnxruntime-genai's graph, ``model.genai.onnx`` (export/genai_graph.py): the fused graph with GroupQueryAttention
rewired for right-padded batches (seqlens_k from the mask, no padding bias, RoPE by slot), over model.onnx's data
file; for a model with multimodal RoPE, either graph taking (B, T) positions. It is exact for the rows
onnxruntime-genai gives it, refused for left-padded ones, checked by --verify, and a planted bug in it fails the
export. The end-to-end runs under onnxruntime-genai (rows of unequal length through its shared buffer) are in
test_onnx_fused.py, test_onnx_genai.py and test_onnx_last_logits.py, which now run it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from export_helpers import HYBRID_FAMILIES

from export import genai_graph
from export.runtime import OnnxDecoder
from export.verify import RIGHT, compare_decoders
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE, parity_batch

GENAI = "model.genai.onnx"


def load_thinker(folder: Path):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == "GroupQueryAttention"]


def test_the_genai_graph_is_the_fused_one_without_the_padding_inputs(onnx_variant):
    folder = onnx_variant("qwen3")
    fused = onnx.load(folder / "model.onnx", load_external_data=False)
    genai = onnx.load(folder / GENAI, load_external_data=False)
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    assert config["filename"] == GENAI and "position_ids" not in config["inputs"]
    assert "position_ids" in [i.name for i in fused.graph.input]
    assert "position_ids" not in [i.name for i in genai.graph.input]  # RoPE inside the kernel, by slot
    assert {p.key: p.value for p in genai.metadata_props}["thinker.padding"] == "right"

    seqlens = {node.input[genai_graph.SEQLENS_K] for node in attention_nodes(genai)}
    assert len(seqlens) == 1 and len(attention_nodes(genai)) == len(attention_nodes(fused)) > 1
    producers = {out: node for node in genai.graph.node for out in node.output}
    cast = producers[seqlens.pop()]
    assert (cast.op_type, producers[producers[cast.input[0]].input[0]].op_type) == ("Cast", "ReduceSum")
    assert all(len(node.input) <= genai_graph.POSITION_IDS for node in attention_nodes(genai))
    assert all(len(node.input) > genai_graph.ATTENTION_BIAS for node in attention_nodes(fused))
    # the same weights, read from the same file at the same offsets; the proto alone is new. The padding bias's
    # constants are gone with it: every initializer left is read (onnxruntime warns at load about each one that is
    # not); the only new ones are the last-position selection's constants
    read = {name for node in genai.graph.node for name in node.input}
    fused_tensors = {t.name: list(t.external_data) for t in fused.graph.initializer}
    kept = {t.name: list(t.external_data) for t in genai.graph.initializer if t.name in fused_tensors}
    assert kept == {name: data for name, data in fused_tensors.items() if name in read}
    added = [t.name for t in genai.graph.initializer if t.name not in fused_tensors]
    assert added and all(name.startswith(genai_graph.LAST_CONSTS) and name in read for name in added), added
    assert any(name not in read for name in fused_tensors)  # the bias's constants, dropped
    assert (folder / GENAI).stat().st_size < 2 * (folder / "model.onnx").stat().st_size
    # the head on each row's last kept position alone: (B, 1, V) logits, as onnxruntime-genai reads them
    (logits,) = (value for value in genai.graph.output if value.name == "logits")
    assert [d.dim_value for d in logits.type.tensor_type.shape.dim][1] == 1
    selection_scope = f"{genai_graph.HEAD_SCOPE}last_position/"
    selection = [node for node in genai.graph.node if node.name.startswith(selection_scope)]
    (pick,) = (node for node in selection if node.op_type == "GatherND")
    head = [n for n in genai.graph.node if n.name.startswith(genai_graph.HEAD_SCOPE) and n not in selection]
    read_by_head = {name for node in head for name in node.input}
    assert read_by_head & {name for node in selection for name in node.output}  # the picked rows
    assert pick.input[0] not in read_by_head  # every position's hidden state: read by the selection alone


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", *HYBRID_FAMILIES])
def test_the_genai_graph_gives_each_right_padded_row_its_own_result(family, thinker_variant, onnx_variant):
    """The parity batch's rows padded on the right, as onnxruntime-genai pads them, through prefill and 6 decode
    steps (each appending a slot to every row: 1 1 1 0 0 1), against PyTorch on the rows left-padded (each row's
    own result); and on an unpadded batch the same logits as model.onnx."""
    head_dim = None if family in HYBRID_FAMILIES else 16
    model = load_thinker(thinker_variant(family, **({"head_dim": head_dim} if head_dim else {})))
    folder = onnx_variant(family, head_dim=head_dim)
    genai = OnnxDecoder(folder / GENAI, provider="cpu")
    figures = compare_decoders(model, genai, *parity_batch(96), candidate_padding=RIGHT)
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"]), figures
    assert figures["top1_agreement"] == 1.0

    ids, _ = parity_batch(96)
    whole = np.ones_like(ids)
    fused = OnnxDecoder(folder, provider="cpu")
    np.testing.assert_allclose(
        genai.prefill(ids, whole)[0][:, 0], fused.prefill(ids, whole)[0][:, -1], atol=1e-5, rtol=0
    )


def position_rank(path: Path) -> int:
    (positions,) = (i for i in onnx.load(path, load_external_data=False).graph.input if i.name == "position_ids")
    return len(positions.type.tensor_type.shape.dim)


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_a_multimodal_rope_model_gets_a_genai_graph_with_text_positions(graph, thinker_variant, onnx_variant):
    """Qwen3.5's model.onnx takes (3, B, T) positions; its onnxruntime-genai graph, from either graph, takes (B, T)
    ones (genai's generic decoder type feeds those and keeps a right-padded row's pads masked) and gives each
    right-padded row its own result, and on an unpadded batch model.onnx's logits at each row's last position."""
    folder = onnx_variant("qwen3_5", graph=graph, head_dim=None)
    assert (position_rank(folder / "model.onnx"), position_rank(folder / GENAI)) == (3, 2)
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    assert (config["type"], config["decoder"]["filename"]) == ("qwen3", GENAI)

    genai = OnnxDecoder(folder / GENAI, provider="cpu")
    model = load_thinker(thinker_variant("qwen3_5"))
    figures = compare_decoders(model, genai, *parity_batch(96), candidate_padding=RIGHT)
    assert figures["max_abs_diff"] <= RELATIVE_TOLERANCE[torch.float32] * max(1.0, figures["logit_scale"]), figures
    ids, _ = parity_batch(96)
    whole = np.ones_like(ids)
    np.testing.assert_array_equal(
        genai.prefill(ids, whole)[0][:, 0], OnnxDecoder(folder, provider="cpu").prefill(ids, whole)[0][:, -1]
    )


TAKE_TEXT_POSITIONS = genai_graph.take_text_positions


def zero_positions(graph: onnx.GraphProto) -> None:
    """A planted bug: the text positions taken, then every position read as 0 (the rows' RoPE gone)."""
    TAKE_TEXT_POSITIONS(graph)
    streams = f"{genai_graph.TEXT_POSITIONS_SCOPE}/Expand_output_0"
    for node in graph.node:
        node.input[:] = ["planted/zeros" if name == streams else name for name in node.input]
    graph.node.insert(4, onnx.helper.make_node("Sub", [streams, streams], ["planted/zeros"]))


def test_verify_fails_a_genai_graph_that_loses_the_positions(thinker_variant, tmp_path, monkeypatch):
    monkeypatch.setattr(genai_graph, "take_text_positions", zero_positions)
    output = tmp_path / "bad"
    bad = CliRunner().invoke(main, ["export", str(thinker_variant("qwen3_5")), str(output), "--graph", "plain"])
    assert bad.exit_code == 1, bad.output
    line = bad.stderr.strip().splitlines()[-1]
    assert "model.genai.onnx (onnxruntime-genai's graph, rows padded on the right)" in line, line
    assert not output.exists()


def test_onnx_decoder_refuses_a_left_padded_batch_on_the_genai_graph(onnx_variant):
    genai = OnnxDecoder(onnx_variant("qwen3") / GENAI, provider="cpu")
    ids, mask = parity_batch(96)  # left-padded
    with pytest.raises(ThinkerError, match=r"model.genai.onnx: onnxruntime-genai's graph takes right-padded batches"):
        genai.prefill(ids, mask)


def test_no_genai_graph_where_nothing_pads_by_bias(onnx_variant, onnx_folder):
    """The plain graph, and a fused one with plain attention (head_dim 12: no GroupQueryAttention), are written
    as they were: model.onnx is onnxruntime-genai's graph too."""
    for folder in (onnx_folder("qwen3"), onnx_variant("qwen3", head_dim=12)):
        assert not (folder / GENAI).exists()
        assert json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"


def per_batch_seqlens(graph: onnx.GraphProto) -> str:
    """A planted bug: seqlens_k = S - 1 for every row (the fused graph's, made for its bias), so a short row's keys
    run into its pads once the bias is gone."""
    names = {step: f"planted/{step}" for step in ("shape", "total", "one", "last", "batch", "rows", "seqlens")}
    make = onnx.helper.make_node
    nodes = [
        make("Shape", ["attention_mask"], [names["total"]], start=1, end=2),
        make("Constant", [], [names["one"]], value=onnx.helper.make_tensor("", onnx.TensorProto.INT64, [1], [1])),
        make("Sub", [names["total"], names["one"]], [names["last"]]),
        make("Shape", ["attention_mask"], [names["batch"]], start=0, end=1),
        make("Expand", [names["last"], names["batch"]], [names["rows"]]),
        make("Cast", [names["rows"]], [names["seqlens"]], to=onnx.TensorProto.INT32),
    ]
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    return names["seqlens"]


@pytest.mark.parametrize("options", [[], ["--quantize", "int8", "--block-size", "16"]], ids=["float32", "int8"])
def test_verify_fails_a_genai_graph_that_ignores_right_padding(options, thinker_variant, tmp_path, monkeypatch):
    """With seqlens_k = S - 1 for every row in model.genai.onnx (model.onnx untouched and right), ``thinker export
    --verify`` refuses the export, naming that graph; the float check and the quantized one alike."""
    folder = thinker_variant("qwen3", head_dim=16)
    good = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "good"), *options])
    assert good.exit_code == 0, good.output
    report = json.loads((tmp_path / "good" / "export_report.json").read_text())["verify"]
    assert (report.get("graph") or report)["genai_graph"]["max_abs_diff"] < 1e-3

    monkeypatch.setattr(genai_graph, "emit_seqlens", per_batch_seqlens)
    output = tmp_path / "bad"
    bad = CliRunner().invoke(main, ["export", str(folder), str(output), *options])
    assert bad.exit_code == 1, bad.output
    line = bad.stderr.strip().splitlines()[-1]
    assert "model.genai.onnx (onnxruntime-genai's graph, rows padded on the right)" in line, line
    assert "the export was not written" in line and not output.exists()
