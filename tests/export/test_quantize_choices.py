"""The choices export/quantize.py makes one weight at a time, held directly (a mutation run planted each of these
and every other test passed): which weights are quantized and how (the head under HQQ, a projection of exactly
MIN_OUTPUTS outputs, per-row int8 experts' accuracy level, an all-zero expert row), what the user is told (the
narrow-projection advice, the spec's label) and what is refused (a mixed head of no int8 rows); and a tokenizer
folder transformers cannot read giving no prefix (export/leading_tokens.py) rather than a traceback, and any
attention window but -1 named as a fault (export/beyond_prompts.py)."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
import torch
from export_helpers import make_tokenizer
from onnx import TensorProto, helper

from export.beyond_prompts import attention_window_check
from export.graph_builder import GraphBuilder, WeightFile
from export.leading_tokens import leading_special_ids
from export.quantize import (
    HEAD,
    MIN_OUTPUTS,
    QuantizeSpec,
    WeightQuantizer,
    column_wise_int8,
    cuda_experts_note,
)
from thinker_common.errors import ThinkerError


def builder(tmp_path, name: str = "model.onnx.data") -> GraphBuilder:
    return GraphBuilder(WeightFile(tmp_path / name))


def seeded(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_a_mixed_head_of_no_int8_rows_is_refused():
    """``--head-int8-rows 0`` would be an int4 head labelled mixed: refused, naming the option."""
    with pytest.raises(ThinkerError) as refused:
        QuantizeSpec.parse("int4", head_int8_rows=0)
    assert str(refused.value) == "--head-int8-rows 0: a mixed head needs at least one int8 row"
    assert QuantizeSpec.parse("int4", head_int8_rows=1).head_int8_rows == 1


def test_an_int8_head_under_hqq_is_symmetric_rtn(tmp_path):
    """HQQ quantizes to int4 only (its float zero points: onnxruntime's CPU reads them for 2 and 4 bits): an int8 head
    under an HQQ body is rtn, a scale a block and no zero point, while the body keeps HQQ's float zero points."""
    quantizer = WeightQuantizer(QuantizeSpec(bits=4, block_size=16, algo="hqq", head_bits=8), torch.float32)
    b = builder(tmp_path)
    head = quantizer.quantize(b, HEAD, seeded(32, 48))
    assert head.attributes["bits"] == 8 and head.attributes["block_size"] == 16
    assert [name for name in head.inputs if name] == ["lm_head.weight_Q8", "lm_head.weight_scales"]
    assert head.float_zero_points is False
    body = quantizer.quantize(b, "model.layers.0.mlp.down_proj.weight", seeded(32, 48))
    assert body.attributes["bits"] == 4 and body.float_zero_points is True


@pytest.mark.parametrize(
    ("shape", "quantized"),
    [((32, MIN_OUTPUTS), True), ((32, MIN_OUTPUTS - 1), False), ((31, MIN_OUTPUTS), False), ((32, 64), True)],
    ids=["16-outputs", "15-outputs", "narrower-than-a-block", "wide"],
)
def test_a_projection_of_min_outputs_outputs_is_quantized(shape, quantized):
    """(in, out): quantized from MIN_OUTPUTS outputs and one whole block of inputs (blocks of 32) on."""
    assert WeightQuantizer(QuantizeSpec(block_size=32), torch.float32).applies_to_shape(shape) is quantized


@pytest.mark.parametrize(
    ("width", "block", "advice"), [(48, 64, 32), (32, 64, 32), (16, 32, 16), (100, 128, 64)], ids=str
)
def test_the_narrow_note_advises_a_block_size_that_fits(width, block, advice):
    """The advice is the largest block size no wider than the narrowest input left float: with it, they quantize."""
    quantizer = WeightQuantizer(QuantizeSpec(block_size=block), torch.float32)
    assert not quantizer.applies(torch.zeros(width, 64), "model.layers.0.mlp.down_proj.weight")
    note = quantizer.narrow_note()
    assert note == (
        f"1 projection(s) stay float: their input width ({width}) is under --block-size {block} "
        f"(model.layers.0.mlp.down_proj.weight); export with --block-size {advice} or less to quantize them"
    )
    assert WeightQuantizer(QuantizeSpec(block_size=advice), torch.float32).applies(torch.zeros(width, 64))


def test_an_all_zero_expert_row_stays_zero():
    """A row of zeros (a pruned expert's) has no largest weight to scale by: its scale is 1 and its weights the zero
    point, 128, so it dequantizes to zeros, not NaN."""
    stack = seeded(2, 4, 32) * 0.05
    stack[1, 2] = 0
    packed, scales = column_wise_int8(stack, np.float32)
    assert np.isfinite(scales).all() and scales[1, 2] == 1.0
    assert (packed[1, 2] == 128).all()
    assert ((packed.astype(np.float32) - 128) * scales[..., None])[1, 2].tolist() == [0.0] * 32


@pytest.mark.parametrize(
    ("in_blocks", "block_size", "level"), [(False, 0, 0), (True, 16, 4)], ids=["per-row", "blocks"]
)
def test_int8_experts_run_at_level_4_only_in_blocks(in_blocks, block_size, level, tmp_path):
    """QMoE's accuracy level is the spec's (4) where the 8-bit experts go in blocks; with a scale per row the kernel
    computes in float, and the node says level 0."""
    quantizer = WeightQuantizer(QuantizeSpec(bits=8, block_size=16, accuracy_level=4), torch.float32)
    experts = quantizer.quantize_experts(
        builder(tmp_path), "model.layers.0.mlp.experts.down_proj", seeded(2, 16, 32), in_blocks
    )
    assert (experts.bits, experts.block_size, experts.accuracy_level) == (8, block_size, level)


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        (QuantizeSpec(), "int4 rtn, block 32"),
        (QuantizeSpec(head_bits=8), "int4 rtn, block 32, int8 head"),
        (QuantizeSpec(bits=8, block_size=64, head_bits=4), "int8 rtn, block 64, int4 head"),
        (QuantizeSpec(head_int8_rows=8192), "int4 rtn, block 32, mixed head (int8 for its first 8192 rows)"),
        (QuantizeSpec(block_size=16, algo="rtn-asym"), "int4 rtn-asym, block 16"),
    ],
)
def test_the_label_names_the_heads_precision(spec, label):
    """What a refused verify and the layout check name as the layout asked for."""
    assert spec.label() == label


def test_a_tokenizer_transformers_cannot_read_gives_no_prefix(tmp_path):
    """Tokenizer files that make transformers raise (here a JSONDecodeError, no OSError) leave the prefix unknown:
    [] and the export goes on, not a traceback."""
    make_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert leading_special_ids(tmp_path) == []


@pytest.mark.parametrize("window", [0, -2])
def test_any_window_but_none_is_a_fault(window, tmp_path):
    """-1 is GroupQueryAttention's "no window": any other value set (0 included) is a window no Thinker has."""
    node = helper.make_node("GroupQueryAttention", ["q"], ["out"], name="gqa", local_window_size=window)
    graph = helper.make_graph([node], "window", [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    assert attention_window_check(tmp_path / "model.onnx") == (
        f"model.onnx: gqa attends to a window of its last {window} keys, where the model attends to every key before it"
    )


# --- mutquant2: the rest of the mutation run (each test names the change it catches) --------------------------------


def test_a_head_left_float_reports_no_int8_rows():
    """export_report.json's quantize entry of a mixed spec whose graph kept the head float: head "float" and no
    ``head_int8_rows`` (rows of a head that is not quantized)."""
    spec = QuantizeSpec(head_int8_rows=40)
    assert spec.describe(head_quantized=True)["head_int8_rows"] == 40
    described = spec.describe(head_quantized=False)
    assert described["head"] == "float" and "head_int8_rows" not in described


def test_a_projection_exactly_one_block_wide_is_quantized_without_a_note():
    """An input width equal to the block size is one whole block: quantized, and not named in the narrow note."""
    quantizer = WeightQuantizer(QuantizeSpec(block_size=32), torch.float32)
    assert quantizer.applies(torch.zeros(32, 64), "model.layers.0.mlp.down_proj.weight")
    assert quantizer.narrow_note() is None


@pytest.mark.parametrize(("bits", "quantized"), [(8, True), (4, False)])
def test_int8_experts_need_no_whole_blocks(bits, quantized):
    """48 inputs under blocks of 32: 4-bit QMoE reads no padding, so the stack stays float; 8-bit experts go a scale
    per row (``column_wise_int8``) and are quantized."""
    quantizer = WeightQuantizer(QuantizeSpec(bits=bits, block_size=32), torch.float32)
    assert quantizer.applies_to_experts(64, 48) is quantized
    assert quantizer.applies_to_experts(64, 64) is True


@pytest.mark.parametrize(("bits", "noted"), [(4, True), (8, False)])
def test_the_cuda_block_note_is_for_int4_experts_only(bits, noted):
    """Blocks of 16 are outside CUDA's QMoE blocks, but a float16 graph's 8-bit experts go a scale per row: no note
    for them; 4-bit ones are named, with the block size to export with."""
    config = types.SimpleNamespace(hidden_size=64, moe_intermediate_size=64)
    note = cuda_experts_note(config, "float16", QuantizeSpec(bits=bits, block_size=16), {"QMoE": 2})
    if noted:
        assert note == (
            "the routed experts' QMoE runs on the CPU but not on CUDA, whose kernel takes widths that are multiples of "
            "64 and blocks of 32, 64, 128 (--block-size 16): export with --block-size 32 for CUDA"
        )
    else:
        assert note is None


def test_a_head_of_too_few_outputs_is_said_to_stay_float(tmp_path, monkeypatch):
    """A vocabulary under MIN_OUTPUTS keeps the head float whatever --quantize-head asks: the export says so, its
    report and the label a failure names say a float head (they said an int4 one, with nothing on the console: a
    QA run)."""
    import json

    from click.testing import CliRunner
    from export_helpers import save_thinker

    from thinker_common.cli import main

    folder = save_thinker(tmp_path / "tiny", "qwen3", vocab_size=MIN_OUTPUTS - 3, tokenizer=False)
    args = ["export", str(folder), str(tmp_path / "out"), "--quantize", "int4", "--quantize-head", "int4"]
    result = CliRunner().invoke(main, [*args, "--no-verify"])
    assert result.exit_code == 0, result.output
    assert f"the head stays float: its {MIN_OUTPUTS - 3} outputs (vocab_size) are fewer than" in result.output
    assert json.loads((tmp_path / "out" / "export_report.json").read_text())["quantize"]["head"] == "float"
    # a failed check names the layout as written: a float head
    failing = {"passed": False, "failure": "planted"}
    monkeypatch.setattr("export.quantized_verify.verify_quantized_export", lambda *args, **options: failing)
    failed = CliRunner().invoke(main, [*args[:2], str(tmp_path / "again"), *args[3:]])
    assert failed.exit_code == 1 and ", float head); the export was not written" in failed.output, failed.output
    spec = QuantizeSpec.parse("int4", head="int8")
    assert spec.label(head_quantized=False).endswith(", float head") and spec.label().endswith(", int8 head")


@pytest.mark.parametrize(
    ("quantize", "block", "widths", "advice"),
    [
        ("int4", 128, (64, 64), "--block-size 64 quantizes them"),  # the widest that fits, not the first
        ("int4", 32, (16, 16), "--block-size 16 quantizes them"),  # 16 outputs are enough
        ("int4", 64, (128, 40), "--quantize int8 --block-size 32 quantizes them"),  # int8's widest, 40 >= 32
        ("int4", 64, (32, 8), "they are narrower than the smallest block (16)"),  # gate|up's 16 rows: outputs enough
        ("int4", 32, (8, 8), f"an expert gives fewer than {MIN_OUTPUTS} outputs, which no --block-size changes"),
    ],
    ids=str,
)
def test_the_experts_advice_names_the_widest_block_that_quantizes_them(quantize, block, widths, advice):
    spec = QuantizeSpec.parse(quantize, block_size=block)
    assert advice in WeightQuantizer(spec, torch.float32).experts_advice(*widths)


def test_the_few_outputs_note_and_the_float_head_label_at_their_edges():
    assert WeightQuantizer.few_outputs_head_note(types.SimpleNamespace(vocab_size=MIN_OUTPUTS), False) is None
    assert WeightQuantizer.few_outputs_head_note(types.SimpleNamespace(vocab_size=MIN_OUTPUTS - 1), True) is None
    assert QuantizeSpec.parse("int4", head="mixed").label(head_quantized=False).endswith(", float head")
