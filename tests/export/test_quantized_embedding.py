"""A tied embedding under ``--quantize``: GatherBlockQuantized over the head's own quantized tensors.

The table is stored once, quantized (no float copy); onnxruntime's GatherBlockQuantized kernel gathers exactly the
rows its MatMulNBits kernel multiplies by (checked kernel against kernel, int4 and int8, symmetric and asymmetric,
a row padded to whole blocks, and the mixed head's two parts: int8 rows, then int4 ones); HQQ (float zero points)
and untied models keep the float embedding; ``--verify`` runs the PyTorch Thinker with the dequantized embedding and
fails an embedding that is not the head's.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from export_helpers import assert_genai_equals_onnxruntime
from onnx import helper, numpy_helper

from export.dequantize import EMBEDDING, quantized_weights
from export.quantize import QuantizeSpec
from export.quantized_verify import QualityGate
from export.verify import STREAMED, WHOLE
from thinker_common.errors import ThinkerError

INT4 = QuantizeSpec(bits=4, block_size=16)
INT4_HEAD8 = QuantizeSpec(bits=4, block_size=16, head_bits=8)  # the CLI's int4 default: an int8 head
INT8 = QuantizeSpec(bits=8, block_size=16)
INT4_ASYM = QuantizeSpec(bits=4, block_size=16, algo="rtn-asym")
INT8_FLOAT_EMBEDDING = QuantizeSpec(bits=8, block_size=16, float_embedding=True)  # --embedding float
INT8_ASYM = QuantizeSpec(bits=8, block_size=16, algo="rtn-asym")
HQQ = QuantizeSpec(bits=4, block_size=16, algo="hqq")
MIXED = QuantizeSpec(bits=4, block_size=16, head_int8_rows=40)  # the int4 default's layout: rows 0-39 int8, 40-95 int4
SPECS = {"int4": INT4, "int4-head8": INT4_HEAD8, "int8": INT8, "int4-asym": INT4_ASYM, "int8-asym": INT8_ASYM}
TIED = dict(tie_word_embeddings=True)
PADDED = dict(tie_word_embeddings=True, hidden_size=40)  # 40 = 2.5 blocks of 16: the packed rows are padded
NO_GATE = QualityGate(min_top1=0.0, max_perplexity_increase=float("inf"))
OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def run_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], output: str):
    """``nodes`` of ``model`` (its initializers with them) as a model of their own, run by onnxruntime on CPU."""
    used = {name for node in nodes for name in node.input}
    initializers = [t for t in model.graph.initializer if t.name in used]
    graph = helper.make_graph(
        nodes,
        "part",
        [
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in inputs.items()
        ],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)],
        initializer=initializers,
    )
    session = ort.InferenceSession(
        helper.make_model(graph, opset_imports=OPSETS, ir_version=10).SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    return session.run(None, inputs)[0]


def embedding_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes from the quantized head's tensors to the embedding's output, in order."""
    nodes = [n for n in model.graph.node if "/embed/" in n.name]
    assert [n.op_type for n in nodes][:2] == ["Reshape", "GatherBlockQuantized"], [n.op_type for n in nodes]
    return nodes


def head_node(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("lm_head."))


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_tied_embedding_is_gathered_from_the_head(spec, onnx_variant):
    folder = onnx_variant("qwen3", graph="plain", quantize=spec, **TIED)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    reshape, gather = embedding_nodes(model)
    head = head_node(model)
    # The head's packed weight (through a Reshape to 2-D), its scales and zero points, and nothing else.
    assert reshape.input[0] == head.input[1] and gather.input[0] == reshape.output[0]
    assert gather.input[1] == "input_ids" and list(gather.input[2:]) == list(head.input[2:])
    assert len(gather.input) == (4 if spec.algo == "rtn-asym" else 3)
    assert attributes(gather) == {
        "bits": attributes(head)["bits"],
        "block_size": 16,
        "gather_axis": 0,
        "quantize_axis": 1,
    }
    # Stored once: no float table, and each tensor once.
    names = [t.name for t in model.graph.initializer]
    assert EMBEDDING not in names and "lm_head.weight" not in names and len(names) == len(set(names))


@pytest.mark.parametrize("spec", [HQQ, None, INT8_FLOAT_EMBEDDING], ids=["hqq", "untied", "asked-for"])
def test_float_embedding_where_it_cannot_be_shared(spec, onnx_variant):
    """HQQ's float zero points are not a type GatherBlockQuantized takes; an untied embedding is its own weight;
    ``--embedding float`` asks for the float table beside a quantized head."""
    overrides = TIED if spec else {}
    folder = onnx_variant("qwen3", graph="plain", quantize=spec or INT4, **overrides)
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert [n.input[0] for n in gathers] == [EMBEDDING]
    assert head_node(model).op_type == "MatMulNBits"


def test_float_embedding_of_an_untied_model_is_refused(thinker_variant, tmp_path):
    """An untied embedding stays float whatever --embedding says: given and unused, the option was silently ignored
    (QA)."""
    from export.exporter import export_model

    folder = thinker_variant("qwen3", tie_word_embeddings=False)
    with pytest.raises(ThinkerError, match=re.escape("is not tied to its head (tie_word_embeddings false)")):
        export_model(folder, tmp_path / "out", quantize=INT8_FLOAT_EMBEDDING, verify=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides", [TIED, PADDED], ids=["whole-blocks", "padded"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_gathered_rows_are_what_the_head_multiplies_by(spec, overrides, onnx_variant):
    """Kernel against kernel: every row onnxruntime's GatherBlockQuantized gathers equals the column of the weight
    its MatMulNBits multiplies by (run on an identity matrix with float activations), bit for bit; and
    export/dequantize.py reads the same table back."""
    folder = onnx_variant("qwen3", graph="plain", quantize=spec, **overrides)
    model = onnx.load(folder / "model.onnx")
    vocab, hidden = 96, overrides.get("hidden_size", 32)
    nodes = embedding_nodes(model)
    table = run_nodes(model, nodes, {"input_ids": np.arange(vocab)[None]}, nodes[-1].output[0])[0]
    head = head_node(model)
    matmul = helper.make_node("MatMulNBits", ["x", *head.input[1:]], ["y"], domain="com.microsoft")
    matmul.attribute.extend(helper.make_attribute(k, v) for k, v in {**attributes(head), "accuracy_level": 0}.items())
    weight = run_nodes(model, [matmul], {"x": np.eye(hidden, dtype=np.float32)}, "y")  # (C, V)
    assert table.shape == (vocab, hidden)
    np.testing.assert_array_equal(table, weight.T)
    ours = quantized_weights(folder / "model.onnx")
    assert ours[EMBEDDING].op_type == "GatherBlockQuantized" and ours[EMBEDDING].bits == attributes(head)["bits"]
    np.testing.assert_array_equal(ours[EMBEDDING].weight[:, :hidden], table)


def test_sizes_and_parameter_count_stay_true(thinker_variant, tmp_path):
    """The report's sizes are the files', the parameter count PyTorch's (each weight once, however the graph stores
    it); no float (V, C) table is left in the graph."""
    from export.exporter import export_model
    from thinker import ThinkerForCausalLM

    folder = thinker_variant("qwen3", head_dim=16, **PADDED)
    report = export_model(folder, tmp_path / "out", graph="plain", quantize=INT4_HEAD8, verify=False, progress=False)
    files = {p.name: p.stat().st_size for p in (tmp_path / "out").iterdir() if p.name != "export_report.json"}
    assert report["sizes"] == files
    model = ThinkerForCausalLM.from_pretrained(folder)
    assert report["parameters"] == sum(p.numel() for p in model.parameters())
    graph = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).graph
    assert not [t.name for t in graph.initializer if list(t.dims) in ([96, 40], [40, 96])]
    hqq = export_model(folder, tmp_path / "hqq", graph="plain", quantize=HQQ, verify=False, progress=False)
    assert hqq["parameters"] == report["parameters"]


@pytest.mark.parametrize("plan", [WHOLE, STREAMED])
@pytest.mark.parametrize("spec", [INT4, INT4_HEAD8, INT8, INT4_ASYM], ids=["int4", "int4-head8", "int8", "int4-asym"])
def test_verify_runs_the_dequantized_embedding(spec, plan, thinker_variant, onnx_variant, monkeypatch):
    """The export passes, its embedding exactly the head's table; the same check with the PyTorch model left holding
    its float embedding fails the graph check: the tolerance sees the embedding's rounding, so feeding it matters.
    Whole, and streamed layer by layer (the tied head and embedding then loaded as two units)."""
    import export.quantized_verify as quantized_verify

    model_dir = thinker_variant("qwen3", head_dim=16, **TIED)
    path = onnx_variant("qwen3", graph="fused", quantize=spec, **TIED) / "model.onnx"
    sound = quantized_verify.verify_quantized_export(model_dir, path, torch.float32, spec.bits, NO_GATE, plan=plan)
    assert sound["passed"] is True, sound
    assert sound["weights"]["embedding"] == "GatherBlockQuantized", sound["weights"]
    assert sound["weights"]["tied_embedding_max_abs_diff_from_head"] == 0.0, sound["weights"]
    assert sound["graph"]["max_abs_diff"] <= 1e-4, sound["graph"]
    # Every pass within the logit scale's tolerance: the rounding sensitivity, which could only widen it, is not
    # measured (two prefills of the reference for each prompt), and the tolerance is the float graphs'.
    graph = sound["graph"]
    assert graph["tolerance"] == 1e-4 * max(1.0, graph["logit_scale"]), graph
    assert not any("rounding_sensitivity" in figures for figures in (graph, graph["long_prompts"])), graph

    as_parameters = quantized_verify.as_thinker_parameters

    def without_embedding(weights, model):
        return {name: w for name, w in as_parameters(weights, model).items() if name != EMBEDDING}

    monkeypatch.setattr(quantized_verify, "as_thinker_parameters", without_embedding)
    float_embedding = quantized_verify.verify_quantized_export(
        model_dir, path, torch.float32, spec.bits, NO_GATE, plan=plan
    )
    assert float_embedding["passed"] is False, float_embedding
    assert "against the model with the same dequantized weights" in float_embedding["failure"], float_embedding
    # beyond the scale's tolerance, the sensitivity is measured, and its allowance does not excuse the embedding
    planted = float_embedding["graph"]
    assert planted["max_abs_diff"] > planted["tolerance"] >= 8 * planted["rounding_sensitivity"], planted


def scale_embedding(model: onnx.ModelProto) -> None:
    """The embedding's Gather reads its own scales, 10 % off the head's (one copy too many, and wrong)."""
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    scales = next(t for t in model.graph.initializer if t.name == gather.input[2])
    model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(scales) * 1.1, "embed_scales"))
    gather.input[2] = "embed_scales"


def drop_embedding_zero_points(model: onnx.ModelProto) -> None:
    """The asymmetric embedding read without its zero points (the op's default zero point instead)."""
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    del gather.input[3]


def shift_tokens(model: onnx.ModelProto) -> None:
    """The embedding gathers each token's neighbour row (an indexing bug, the table itself sound)."""
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "one")
    model.graph.initializer.append(one)
    model.graph.node.insert(0, helper.make_node("Add", ["input_ids", "one"], ["shifted_ids"], name="shift"))
    gather.input[1] = "shifted_ids"


@pytest.mark.parametrize(
    ("spec", "bug", "message"),
    [
        (INT4, scale_embedding, "the tied embedding dequantizes to a table"),
        (INT8, scale_embedding, "the tied embedding dequantizes to a table"),
        (INT4_ASYM, drop_embedding_zero_points, "the tied embedding dequantizes to a table"),
        (INT4_HEAD8, shift_tokens, "against the model with the same dequantized weights"),
    ],
    ids=["int4-scales", "int8-scales", "int4-asym-zero-points", "int4-head8-indices"],
)
def test_verify_fails_a_wrong_embedding(spec, bug, message, thinker_variant, onnx_variant, tmp_path):
    """Planted bugs in the embedding op. (A wrong block size never gets this far: onnxruntime's shape inference
    refuses a GatherBlockQuantized whose scales do not match its data and block size when the session loads.)"""
    from export.quantized_verify import verify_quantized_export

    model_dir = thinker_variant("qwen3", head_dim=16, **TIED)
    model = onnx.load(onnx_variant("qwen3", graph="fused", quantize=spec, **TIED) / "model.onnx")
    bug(model)
    (tmp_path / "broken").mkdir()
    onnx.save_model(model, tmp_path / "broken" / "model.onnx")
    broken = verify_quantized_export(model_dir, tmp_path / "broken" / "model.onnx", torch.float32, spec.bits, NO_GATE)
    assert broken["passed"] is False and message in broken["failure"], broken


def test_genai_runs_the_quantized_embedding(genai_python, onnx_variant):
    """onnxruntime-genai's greedy tokens equal onnxruntime's on tied int4 (int8 head, mixed head) and int4-asym
    graphs."""
    folders = [
        onnx_variant("qwen3", graph="fused", quantize=INT4_HEAD8, **TIED),
        onnx_variant("qwen3", graph="fused", quantize=MIXED, **TIED),
        onnx_variant("qwen3", graph="plain", quantize=INT4_ASYM, **PADDED),
    ]
    assert_genai_equals_onnxruntime(genai_python, folders)


# --- the mixed head: its first rows int8, the rest int4 ----------------------------------------------------------


def mixed_head_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("lm_head.")]


@pytest.mark.parametrize("overrides", [TIED, PADDED], ids=["whole-blocks", "padded"])
def test_mixed_head_is_two_parts_and_the_embedding_gathers_each_id_from_its_own(overrides, onnx_variant):
    """Two MatMulNBits (rows 0-39 at 8 bits, 40-95 at 4) concatenated; the embedding's rows, kernel against kernel,
    are the columns the two multiply by, on both sides of the boundary; export/dequantize.py joins both back."""
    folder = onnx_variant("qwen3", graph="plain", quantize=MIXED, **overrides)
    model = onnx.load(folder / "model.onnx")
    vocab, hidden = 96, overrides.get("hidden_size", 32)
    high, low = mixed_head_nodes(model)
    assert [high.input[1], low.input[1]] == ["lm_head.weight.rows_0_40_Q8", "lm_head.weight.rows_40_96_Q4"]
    assert [(attributes(n)["bits"], attributes(n)["N"]) for n in (high, low)] == [(8, 40), (4, 56)]
    concat = next(n for n in model.graph.node if list(n.input) == [high.output[0], low.output[0]])
    assert concat.op_type == "Concat" and attributes(concat)["axis"] == -1
    embed = [n for n in model.graph.node if "/embed/" in n.name]
    assert sum(n.op_type == "GatherBlockQuantized" for n in embed) == 2
    assert EMBEDDING not in {t.name for t in model.graph.initializer}
    table = run_nodes(model, embed, {"input_ids": np.arange(vocab)[None]}, embed[-1].output[0])[0]
    columns = []
    for node in (high, low):
        matmul = helper.make_node("MatMulNBits", ["x", *node.input[1:]], ["y"], domain="com.microsoft")
        matmul.attribute.extend(
            helper.make_attribute(k, v) for k, v in {**attributes(node), "accuracy_level": 0}.items()
        )
        columns.append(run_nodes(model, [matmul], {"x": np.eye(hidden, dtype=np.float32)}, "y"))
    weight = np.concatenate(columns, axis=1)  # (C, V)
    np.testing.assert_array_equal(table, weight.T)
    ours = quantized_weights(folder / "model.onnx")
    assert (ours["lm_head.weight"].bits, ours[EMBEDDING].bits) == (4, 4)  # the looser bound of the two parts
    np.testing.assert_array_equal(ours["lm_head.weight"].weight, weight)
    np.testing.assert_array_equal(ours[EMBEDDING].weight[:, :hidden], table)


@pytest.mark.parametrize(
    ("plan", "overrides"), [(WHOLE, TIED), (STREAMED, TIED), (WHOLE, {})], ids=["tied", "tied-streamed", "untied"]
)
def test_verify_runs_the_mixed_head(plan, overrides, thinker_variant, onnx_variant):
    """Tied (the embedding gathered from both parts) and untied (a float embedding, the head alone split)."""
    from export.quantized_verify import verify_quantized_export

    model_dir = thinker_variant("qwen3", head_dim=16, **overrides)
    path = onnx_variant("qwen3", graph="fused", quantize=MIXED, **overrides) / "model.onnx"
    sound = verify_quantized_export(model_dir, path, torch.float32, 4, NO_GATE, plan=plan)
    assert sound["passed"] is True, sound
    assert len(mixed_head_nodes(onnx.load(path, load_external_data=False))) == 2
    if overrides:
        assert sound["weights"]["tied_embedding_max_abs_diff_from_head"] == 0.0, sound["weights"]
    assert sound["graph"]["max_abs_diff"] <= 1e-4, sound["graph"]


def unshifted_high_ids(model: onnx.ModelProto) -> None:
    """The int4 part's gather reads id 40 + i at row 40 + i of its own table (the Sub of its first row left out):
    the ids past the boundary gather the wrong rows, or the last one clamped."""
    sub = next(n for n in model.graph.node if n.op_type == "Sub" and "/embed/" in n.name)
    for node in model.graph.node:
        node.input[:] = ["input_ids" if name == sub.output[0] else name for name in node.input]


def swapped_parts(model: onnx.ModelProto) -> None:
    """The head's logits concatenated int4 part first: every id's logit lands on another id."""
    high, low = mixed_head_nodes(model)
    concat = next(n for n in model.graph.node if list(n.input) == [high.output[0], low.output[0]])
    concat.input[:] = [low.output[0], high.output[0]]


def boundary_one_row_early(model: onnx.ModelProto) -> None:
    """The tied embedding's choice of table made at row 39 instead of 40 (a QA sweep's off-by-one): id 39 is
    gathered from the int4 part's clamped first row, the embedding of id 40; every other id as before, so no random
    prompt holds the one id it breaks."""
    less = next(n for n in model.graph.node if n.op_type == "Less" and "/embed/" in n.name)
    model.graph.initializer.append(
        numpy_helper.from_array(np.array(MIXED.head_int8_rows - 1, np.int64), "planted_boundary")
    )
    less.input[1] = "planted_boundary"


@pytest.mark.parametrize("bug", [unshifted_high_ids, swapped_parts, boundary_one_row_early])
def test_verify_fails_a_wrong_mixed_head(bug, thinker_variant, onnx_variant, tmp_path):
    from export.quantized_verify import verify_quantized_export

    model_dir = thinker_variant("qwen3", head_dim=16, **TIED)
    model = onnx.load(onnx_variant("qwen3", graph="fused", quantize=MIXED, **TIED) / "model.onnx")
    bug(model)
    (tmp_path / "broken").mkdir()
    onnx.save_model(model, tmp_path / "broken" / "model.onnx")
    broken = verify_quantized_export(model_dir, tmp_path / "broken" / "model.onnx", torch.float32, 4, NO_GATE)
    assert broken["passed"] is False, broken
    assert "against the model with the same dequantized weights" in broken["failure"], broken
    if bug is boundary_one_row_early:  # the prompt of the vocabulary's edges holds id 39 (in a 96-token vocabulary
        # random prompts may too; in a real one, 1 id of 8192 rarely is)
        edges = broken["graph"]["vocabulary_edges"]
        assert {39, 40} <= set(edges["ids"]) and "vocabulary's edge ids (0, 1, 39, 40," in broken["failure"], broken
        assert edges["max_abs_diff"] > 100 * edges["tolerance"], edges


@pytest.mark.parametrize("spec", [INT4_ASYM, INT8_ASYM], ids=["int4-asym", "int8-asym"])
def test_a_tied_asymmetric_table_reads_back_asymmetric(spec, onnx_variant):
    """A tied rtn-asym export gathers its embedding over the head's zero points: the table reads back asymmetric,
    or the verify's per-row check would hold it to a symmetric grid's rounding (a mutation reading every gathered
    table symmetric passed every test); the head it shares reads the same."""
    weights = quantized_weights(onnx_variant("qwen3", quantize=spec, **TIED) / "model.onnx")
    assert weights[EMBEDDING].op_type == "GatherBlockQuantized" and weights[EMBEDDING].asymmetric is True
    assert weights["lm_head.weight"].asymmetric is True


@pytest.mark.parametrize("spec", [INT4, INT8_ASYM], ids=["int4", "int8-asym"])
def test_verify_runs_a_padded_tied_embedding(spec, thinker_variant, onnx_variant):
    """A hidden size of 2.5 blocks: the gathered table's rows are padded to whole blocks, which the verify cuts back
    to the model's columns, the first ones (a mutation keeping the last ones passed every test: no check verified a
    padded tied export)."""
    from export.quantized_verify import verify_quantized_export

    model_dir = thinker_variant("qwen3", head_dim=16, **PADDED)
    path = onnx_variant("qwen3", graph="fused", quantize=spec, **PADDED) / "model.onnx"
    sound = verify_quantized_export(model_dir, path, torch.float32, spec.bits, NO_GATE)
    assert sound["passed"] is True, sound.get("failure")
    assert sound["weights"]["embedding"] == "GatherBlockQuantized", sound["weights"]
    assert sound["weights"]["tied_embedding_max_abs_diff_from_head"] == 0.0, sound["weights"]
    assert sound["graph"]["max_abs_diff"] <= 1e-4, sound["graph"]
