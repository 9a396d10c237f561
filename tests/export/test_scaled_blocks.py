"""int4's default blocks: 64 for the projections the activation-aware scales cover, 32 for every other weight.

What must hold: only ``--quantize int4`` with the scales on and no ``--block-size`` takes the coarser block; the
scales are searched at the block each projection is then rounded in (64 only where its group's inputs are whole
blocks of 64); the graph stores exactly that (a packed q/k/v at 64 when its three parts are); the head, routed
experts, and every weight of a model the scales skip stay at 32; and the export's layout check holds a graph to
it, failing one whose scaled projections came out in blocks of 32."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from export import awq
from export.quantize import HEAD, SCALED_INT4_BLOCK_SIZE, QuantizeSpec, WeightQuantizer
from export.quantized_layout import Layout, layout_failures
from thinker_common.cli import main
from thinker_common.errors import ThinkerError

# the quality gate open: a tiny random model's near-ties make its top-1 agreement a coin toss
OPEN_GATE = ("--min-top1", "0", "--max-perplexity-increase", "1000")
# hidden 64 (q/k/v and gate/up read whole blocks of 64), 4 heads of 12 (o_proj reads 48) and an MLP of 96 (down_proj
# reads 96): one model with groups on both sides of the rule
WIDTHS = {"hidden_size": 64, "intermediate_size": 96}
COARSE = {"qkv_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


def run_export(*args: str):
    return CliRunner().invoke(main, ["export", *args], catch_exceptions=False)


def stored_blocks(folder: Path) -> dict[str, int]:
    """Each MatMulNBits' block size, by the module its weight belongs to (``qkv_proj``, ``down_proj``, ``lm_head``)."""
    blocks: dict[str, set[int]] = {}
    for node in onnx.load(folder / "model.onnx", load_external_data=False).graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            weight = node.input[1]
            module = "lm_head" if weight.startswith("lm_head") else weight.rsplit(".", 2)[-2]
            blocks.setdefault(module, set()).add(attributes["block_size"])
    assert all(len(sizes) == 1 for sizes in blocks.values()), blocks  # one block per module across the layers
    return {module: sizes.pop() for module, sizes in blocks.items()}


@pytest.mark.parametrize(
    "words, expected",
    [
        ({}, (32, SCALED_INT4_BLOCK_SIZE)),
        ({"block_size": 32}, (32, None)),  # given: every weight takes it
        ({"block_size": 64}, (64, None)),
        ({"awq": False}, (32, None)),  # plain rounding keeps blocks of 32
        ({"dtype": "float16"}, (32, None)),  # no scales by default in a half graph
        ({"algo": "hqq"}, (32, None)),
        ({"quantize": "int8"}, (32, None)),
    ],
    ids=["default", "given-32", "given-64", "no-awq", "float16", "hqq", "int8"],
)
def test_only_int4_scales_without_a_given_block_take_the_coarser_block(words, expected):
    words = {"quantize": "int4"} | words
    spec = QuantizeSpec.parse(words.pop("quantize"), **words)
    assert (spec.block_size, spec.scaled_block_size) == expected


def test_the_covered_weights_and_a_packed_qkv_of_covered_parts_take_the_coarser_block():
    attention = "model.layers.0.self_attn"
    covered = {f"{attention}.{p}_proj.weight" for p in "qkv"} | {"model.layers.1.self_attn.q_proj.weight"}
    spec = QuantizeSpec.parse("int4").covering(frozenset(covered))
    assert spec.block_for(f"{attention}.qkv_proj.weight") == 64
    assert spec.for_weight(f"{attention}.q_proj.weight").block_size == 64
    assert spec.block_for("model.layers.1.self_attn.q_proj.weight") == 64
    assert spec.block_for("model.layers.1.self_attn.qkv_proj.weight") == 32  # k and v not covered
    assert spec.block_for(f"{attention}.o_proj.weight") == 32
    assert spec.block_for(HEAD) == spec.for_weight(HEAD).block_size == 32
    assert spec.describe()["scaled_block_size"] == 64
    assert "block 64 where the scales cover, 32 elsewhere" in spec.label()


def test_a_given_block_is_every_weights_whatever_the_scales_cover():
    name = "model.layers.0.self_attn.q_proj.weight"
    spec = QuantizeSpec.parse("int4", block_size=32).covering(frozenset({name}))
    assert spec.block_for(name) == spec.for_weight(name).block_size == 32


@pytest.mark.parametrize("block", [0, 48])
def test_a_block_size_onnxruntime_does_not_take_is_refused(block):
    with pytest.raises(ThinkerError, match=f"--block-size {block}: expected one of 16, 32, 64, 128, 256"):
        QuantizeSpec.parse("int4", block_size=block)


def test_scales_that_cover_nothing_leave_every_weight_at_the_block_size():
    spec = QuantizeSpec.parse("int4").covering(frozenset())
    assert spec.scaled_block_size is None
    assert "scaled_block_size" not in spec.describe() and "block 32, mixed head" in spec.label()


def test_a_scaled_block_without_the_scales_is_refused():
    with pytest.raises(ThinkerError, match="scaled_block_size is the block of the projections --awq's scales cover"):
        QuantizeSpec(bits=4, awq=False, scaled_block_size=64)


def test_the_layout_check_fails_a_covered_projection_stored_in_blocks_of_32():
    """The verify's own check (export/quantized_layout.py) reads the block per weight from the spec."""
    name = "model.layers.0.self_attn.q_proj.weight"
    spec = QuantizeSpec.parse("int4").covering(frozenset({name}))
    stored = {name: Layout("MatMulNBits", ((0, 64, 4, 32),), False, (4,))}
    (failure,) = layout_failures(stored, spec)
    assert "blocks of 32" in failure and "int4, blocks of 64, symmetric" in failure, failure
    assert layout_failures({name: Layout("MatMulNBits", ((0, 64, 4, 64),), False, (4,))}, spec) == []


def test_the_scales_are_searched_at_the_block_each_group_is_rounded_in(thinker_variant, tmp_path, monkeypatch):
    searched, search = {}, awq.best_scale

    def recorded(group, bits, block_size):
        searched[group.name.rpartition(".")[2]] = block_size
        return search(group, bits, block_size)

    monkeypatch.setattr(awq, "best_scale", recorded)
    folder = thinker_variant("qwen3", **WIDTHS)
    scaled = awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=32, coarse_block_size=64)
    assert searched == {"q_proj|k_proj|v_proj": 64, "o_proj": 32, "gate_proj|up_proj": 64, "down_proj": 32}
    layers = range(3)
    assert scaled.coarse == {
        f"model.layers.{i}.{module}.{p}_proj.weight"
        for i in layers
        for module, projections in (("self_attn", "qkv"), ("mlp", ("gate", "up")))
        for p in projections
    }


@pytest.mark.parametrize(
    "graph, widths, coarse",
    [
        ("fused", WIDTHS, COARSE),
        ("plain", WIDTHS, COARSE),
        # 4 heads of 16 and an MLP of 128: o_proj (its scale shared by the query heads of a key-value head) and
        # down_proj read whole blocks of 64 too
        ("fused", {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}, COARSE | {"o_proj", "down_proj"}),
    ],
    ids=["fused", "plain", "every-group-64"],
)
def test_the_default_int4_export_stores_the_scales_blocks_and_passes_its_checks(
    thinker_variant, tmp_path, graph, widths, coarse
):
    folder = thinker_variant("qwen3", **widths)
    out = tmp_path / "int4"
    result = run_export(str(folder), str(out), "--graph", graph, "--quantize", "int4", *OPEN_GATE)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "export_report.json").read_text())
    assert report["quantize"]["block_size"] == 32 and report["quantize"]["scaled_block_size"] == 64
    assert report["verify"]["passed"] is True
    card = (out / "README.md").read_text()
    assert "weights int4 in blocks of 64 where the scales cover, 32 elsewhere" in card
    blocks = stored_blocks(out)
    assert blocks == {module: 64 if module in coarse else 32 for module in blocks}
    assert {"down_proj", "o_proj", "lm_head"} <= blocks.keys() and blocks.keys() & coarse


def test_plain_rounding_and_a_given_block_keep_one_block_throughout(thinker_variant, tmp_path):
    folder = thinker_variant("qwen3", **WIDTHS)
    for name, options in (("rtn", ["--no-awq"]), ("given", ["--block-size", "32"])):
        out = tmp_path / name
        result = run_export(str(folder), str(out), "--quantize", "int4", "--no-verify", *options)
        assert result.exit_code == 0, result.output
        assert set(stored_blocks(out).values()) == {32}
        assert "scaled_block_size" not in json.loads((out / "export_report.json").read_text())["quantize"]
        assert "weights int4 in blocks of 32 (" in (out / "README.md").read_text()


def test_a_model_the_scales_skip_keeps_blocks_of_32(thinker_variant, tmp_path, monkeypatch):
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1KB")  # too little memory for the scales: plain rounding
    out = tmp_path / "out"
    result = run_export(str(thinker_variant("qwen3", **WIDTHS)), str(out), "--quantize", "int4", "--no-verify")
    assert result.exit_code == 0, result.output
    quantize = json.loads((out / "export_report.json").read_text())["quantize"]
    assert quantize["awq"] is False and "scaled_block_size" not in quantize
    assert set(stored_blocks(out).values()) == {32}


def test_routed_experts_keep_blocks_of_32_beside_coarser_attention(thinker_variant, tmp_path):
    from export.dequantize import quantized_weights

    folder = thinker_variant("qwen3_moe", hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    out = tmp_path / "moe"
    result = run_export(str(folder), str(out), "--quantize", "int4", *OPEN_GATE)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["verify"]["passed"] is True
    blocks = stored_blocks(out)  # the dense layer's MLP is scaled, its down_proj reading 64 here
    assert blocks["q_proj"] == blocks["gate_proj"] == blocks["down_proj"] == 64 and blocks["lm_head"] == 32, blocks
    experts = {name: w.block_size for name, w in quantized_weights(out / "model.onnx").items() if ".experts." in name}
    assert experts and set(experts.values()) == {32}, experts


def test_gated_deltanet_projections_keep_blocks_of_32_beside_coarser_attention(thinker_variant, tmp_path):
    """Qwen3.5: the scales skip the linear-attention layers, whose projections stay at 32, and cover the full
    attention (its q_proj twice as wide for the output gate, its input still the hidden size) and every MLP."""
    out = tmp_path / "hybrid"
    result = run_export(str(thinker_variant("qwen3_5", **WIDTHS)), str(out), "--quantize", "int4", *OPEN_GATE)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "export_report.json").read_text())["verify"]["passed"] is True
    blocks = stored_blocks(out)
    assert blocks["in_proj_qkv"] == blocks["in_proj_z"] == blocks["out_proj"] == 32, blocks
    assert blocks["qkv_proj"] == blocks["gate_proj"] == blocks["up_proj"] == 64, blocks


def test_the_export_check_fails_a_graph_whose_covered_projections_came_out_at_32(
    thinker_variant, tmp_path, monkeypatch
):
    """A planted wiring bug: the quantizer handed the spec from before the scales (nothing covered, so every
    projection at 32) while the check holds the graph to the spec after them."""
    real_init = WeightQuantizer.__init__

    def stale(self, spec, dtype):
        real_init(self, spec.covering(frozenset()), dtype)

    monkeypatch.setattr(WeightQuantizer, "__init__", stale)
    out = tmp_path / "stale"
    result = run_export(str(thinker_variant("qwen3", **WIDTHS)), str(out), "--quantize", "int4", *OPEN_GATE)
    assert result.exit_code != 0
    assert "is stored int4, blocks of 32" in result.output and "asks for int4, blocks of 64" in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "family, widths",
    [
        ("qwen3", WIDTHS),
        ("qwen3", {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}),
        ("qwen3_moe", {"hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 64}),
        ("qwen2_moe", {"hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 64}),
        ("qwen3_5", WIDTHS),
        ("qwen3_next", WIDTHS),
    ],
    ids=["some-groups", "every-group", "moe", "shared-expert-moe", "hybrid", "next"],
)
def test_the_weights_the_scales_will_cover_are_known_from_the_structure(thinker_variant, tmp_path, family, widths):
    """What the memory plan counts at the coarser block before the scales run is what they then cover."""
    from thinker import ThinkerConfig

    folder = thinker_variant(family, **widths)
    predicted = awq.coarse_weights(ThinkerConfig.from_pretrained(folder), SCALED_INT4_BLOCK_SIZE)
    scaled = awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=32, coarse_block_size=64)
    assert predicted and predicted == scaled.coarse


def test_a_streamed_check_that_fits_the_scales_blocks_is_not_refused_before_them(
    thinker_variant, tmp_path, monkeypatch
):
    """The plan made before the scales counts the graph at the blocks they will give it: a budget that holds the
    streamed check of that graph, and not of the same graph in blocks of 32 throughout, exports and checks it."""
    import torch

    from export.quantized_size import expected_graph_bytes
    from export.verify import held_bytes
    from thinker import ThinkerConfig

    folder = thinker_variant("qwen3", **WIDTHS)
    config = ThinkerConfig.from_pretrained(folder)
    spec = QuantizeSpec.parse("int4").for_vocab(config.vocab_size)
    layout = spec.covering(awq.coarse_weights(config, SCALED_INT4_BLOCK_SIZE))
    graph = expected_graph_bytes(folder, config, torch.float32, layout)
    assert expected_graph_bytes(folder, config, torch.float32, spec) > graph  # blocks of 32 throughout: more
    _, streamed, _ = held_bytes(folder, torch.float32, quantized=True, graph_bytes=graph)
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", str(streamed))
    out = tmp_path / "int4"
    result = run_export(str(folder), str(out), "--quantize", "int4", "--verify", *OPEN_GATE)
    assert result.exit_code == 0, result.output
    verify = json.loads((out / "export_report.json").read_text())["verify"]
    assert verify["passed"] is True and "layer by layer" in verify["reference"], verify["reference"]


def test_the_memory_plan_and_the_scales_take_one_decision_on_memory(thinker_variant, tmp_path, monkeypatch):
    """Whether the scales fit in memory is asked once: the plan made before them and the scales themselves cannot
    part (free memory read twice, a plan counting blocks of 64 for a graph written at 32)."""
    from export import exporter

    asked = []

    def beyond_memory(model_dir):
        asked.append(model_dir)
        return "activation-aware scales (--awq) skipped: planted"

    monkeypatch.setattr(exporter, "scales_beyond_memory", beyond_memory)
    out = tmp_path / "int4"
    result = run_export(str(thinker_variant("qwen3", **WIDTHS)), str(out), "--quantize", "int4", *OPEN_GATE)
    assert result.exit_code == 0, result.output
    assert len(asked) == 1
    report = json.loads((out / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False and "skipped: planted" in " ".join(report["notes"])
    assert set(stored_blocks(out).values()) == {32}


def test_the_prediction_builds_on_the_meta_device_and_leaves_the_config_as_it_was(thinker_variant, monkeypatch):
    """No weight allocated (a model of billions of parameters would be, in float32), and the caller's config, which
    the export goes on to use, untouched by the model's init."""
    from thinker import ThinkerConfig

    devices, groups_of = [], awq.scale_groups

    def recorded(model):
        devices.append({parameter.device.type for parameter in model.parameters()})
        return groups_of(model)

    monkeypatch.setattr(awq, "scale_groups", recorded)
    config = ThinkerConfig.from_pretrained(thinker_variant("qwen3", **WIDTHS))
    before = dict(vars(config))
    awq.coarse_weights(config, SCALED_INT4_BLOCK_SIZE)
    assert devices == [{"meta"}]
    assert dict(vars(config)) == before


def test_a_refusal_where_the_scales_do_not_fit_names_the_graph_in_blocks_of_32(thinker_variant, tmp_path, monkeypatch):
    """The scales skipped for memory, the graph is plain rounding in blocks of 32 throughout: the plan counts (and
    its refusal names) that graph, not the smaller one the scales would have given."""
    import torch

    from export.quantized_size import expected_graph_bytes
    from export.verify import held_bytes
    from thinker import ThinkerConfig
    from thinker_common.sizes import human_size

    folder = thinker_variant("qwen3", **WIDTHS)
    config = ThinkerConfig.from_pretrained(folder)
    spec = QuantizeSpec.parse("int4").for_vocab(config.vocab_size)
    graph = expected_graph_bytes(folder, config, torch.float32, spec)
    _, streamed, _ = held_bytes(folder, torch.float32, quantized=True, graph_bytes=graph)
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1KB")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(folder), str(out), "--quantize", "int4", "--verify"])
    assert result.exit_code == 1 and not out.exists(), result.output
    assert f"{human_size(streamed, round_up=True)} with the graph in float32" in result.output, result.output
