"""Fine-grained FP8 checkpoints (Qwen's ``-FP8`` releases): converted as the float model transformers dequantizes
them to, held to that model by the parity gate in both modes, and refused by name where they cannot be read.

The checkpoints are tiny transformers models of each family, their projections quantized here to FP8 with a scale
per block, laid out as Qwen's releases are (``X.weight`` in float8_e4m3fn beside ``X.weight_scale_inv``, and
``quantization_config`` in config.json); the reference is ``from_pretrained`` of that folder, which on a CPU
dequantizes through transformers' own FP8 code.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_error, assert_nothing_written, thinker
from convert_helpers import build_reference, save_unfused_experts
from references.hybrid import qwen3_5_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from converter.convert import convert, verify
from converter.parity_report import ParityFailed
from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.fp8_source import DequantizedFP8Source
from thinker_common.sources import open_source
from thinker_common.values import ValueScan

BLOCK = [32, 32]
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
QWEN3 = Qwen3Config(**SIZES, tie_word_embeddings=False)
QWEN3_MOE = Qwen3MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN3_5_SIZES = dict(hidden_size=64, intermediate_size=96, linear_key_head_dim=16)


def quantize_block(
    weight: torch.Tensor, block: list[int], powers_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and per-block scales (the block's largest magnitude over FP8's largest; ``powers_of_two``: rounded
    up to one, as E8M0 scales are), partial blocks included."""
    rows, columns = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    scales = torch.empty(grid)
    values = torch.empty_like(weight)
    for i in range(grid[0]):
        for j in range(grid[1]):
            cut = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scale = weight[cut].abs().max().clamp(min=1e-12) / FP8_MAX
            scales[i, j] = scale.log2().ceil().exp2() if powers_of_two else scale
            values[cut] = weight[cut] / scales[i, j]
    return values.to(torch.float8_e4m3fn), scales


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors Qwen's FP8 releases quantize: the projections (and experts stored as one 3-D tensor)."""
    return (
        tensor.dim() == 2
        and name.endswith("proj.weight")
        or ".in_proj_" in name
        or name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    )


def to_fp8(
    folder: Path,
    block: list[int] = BLOCK,
    scale_dtype: torch.dtype = torch.bfloat16,
    declared: object = BLOCK,
    e8m0: bool = False,
) -> Path:
    """Rewrite a float checkpoint in place as an FP8 one: each projection quantized (a 3-D one expert by expert),
    the rest in bfloat16. ``declared``: the config's weight_block_size (``...``: the key left out); ``e8m0``: scales
    stored as bytes holding exponents, as MXFP8 releases (``scale_fmt: "ue8m0"``) store them."""
    tensors = load_file(folder / "model.safetensors")
    written = {}
    for name, tensor in tensors.items():
        if not quantized(name, tensor):
            written[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            continue
        pieces = [quantize_block(matrix, block, e8m0) for matrix in tensor.float().reshape(-1, *tensor.shape[-2:])]
        written[name] = torch.stack([values for values, _ in pieces]).reshape(tensor.shape)
        scales = torch.stack([scales for _, scales in pieces]).reshape(*tensor.shape[:-2], *pieces[0][1].shape)
        written[name + "_scale_inv"] = (scales.log2() + 127).to(torch.uint8) if e8m0 else scales.to(scale_dtype)
    save_file(written, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    if declared is not ...:
        config["quantization_config"]["weight_block_size"] = declared
    if e8m0:
        config["quantization_config"]["scale_fmt"] = "ue8m0"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def fp8_checkpoint(tmp_path: Path, family: str, **layout) -> Path:
    """A tiny ``family`` checkpoint as an FP8 release (``layout``: ``to_fp8``'s options)."""
    if family == "qwen3_moe":  # the Hub's per-expert layout, each expert's projections quantized on their own
        folder = save_unfused_experts(build_reference(QWEN3_MOE), tmp_path / family)
    else:
        # Qwen3.5's dimensions whole multiples of the block: transformers refuses a partial one
        config = QWEN3 if family == "qwen3" else qwen3_5_config(**QWEN3_5_SIZES)
        build_reference(config).save_pretrained(tmp_path / family)
        folder = tmp_path / family
    return to_fp8(folder, **layout)


def transformers_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("by_layer", [False, True], ids=["whole-model", "layer-by-layer"])
def test_an_fp8_checkpoint_converts_to_the_model_transformers_dequantizes(tmp_path, family, by_layer):
    source = fp8_checkpoint(tmp_path, family)
    result = convert(source, tmp_path / "out", verify=True, verify_by_layer=by_layer, progress=False)
    assert result.parity is not None and result.parity.passed, result.parity.table()
    assert result.parity.results[0].max_abs_diff == 0  # the same products, rounded once to bfloat16 on both sides
    assert result.dtype == "bfloat16"  # the dtype transformers loads it in: its config's
    assert any("FP8" in note for note in result.notes)
    written = json.loads((result.output / "config.json").read_text())
    assert "quantization_config" not in written  # the folder holds float weights
    assert ThinkerConfig.from_pretrained(result.output).dtype == torch.bfloat16


def test_float32_conversion_keeps_each_product_exact(tmp_path):
    """--dtype float32: the products unrounded, as transformers' float32 load holds them, bit for bit."""
    source = fp8_checkpoint(tmp_path, "qwen3")
    result = convert(source, tmp_path / "out", dtype="float32", verify=True, progress=False)
    assert result.parity.passed and result.parity.results[0].max_abs_diff == 0
    expected = transformers_weights(source, torch.float32)
    written = load_file(result.output / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    assert written[name].dtype == torch.float32 and torch.equal(written[name], expected[name])
    assert not torch.equal(written[name], written[name].to(torch.bfloat16).float())  # not rounded on the way


def test_the_gate_fails_a_wrong_dequantization(tmp_path, monkeypatch):
    """A planted bug: each weight's blocks scaled by the transposed grid (a row block read as a column block). The
    reference dequantizes through transformers' code, so both modes of the gate see it; nothing is installed."""
    source = fp8_checkpoint(tmp_path, "qwen3")
    original = DequantizedFP8Source.dequantized

    def transposed(self, name):
        scale_name = name + "_scale_inv"
        scales = self.inner.load(scale_name).to(torch.float32)
        if scales.shape[0] != scales.shape[1]:
            return original(self, name)
        weight = self.inner.load(name).to(torch.float32)
        spread = scales.mT.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        return weight * spread[: weight.shape[0], : weight.shape[1]]

    monkeypatch.setattr(DequantizedFP8Source, "dequantized", transposed)
    for by_layer in (False, True):
        with pytest.raises(ParityFailed):
            convert(source, tmp_path / f"out{by_layer}", verify=True, verify_by_layer=by_layer, progress=False)
        assert_nothing_written(tmp_path / f"out{by_layer}")


@pytest.mark.parametrize(
    "layout",
    [
        {"block": [128, 128], "declared": ...},  # no weight_block_size: transformers' default, 128x128
        {"declared": None},  # null: each weight's block from its scale grid, as transformers derives it
        {"e8m0": True},  # scales as E8M0 exponent bytes (scale_fmt ue8m0)
        {"scale_dtype": torch.float32},
    ],
    ids=["block-size-absent", "block-size-null", "e8m0-scales", "float32-scales"],
)
def test_every_scale_layout_transformers_reads_converts_exactly(tmp_path, layout):
    """The quantization_config and scale spellings of FP8 releases, each held to transformers' own dequantization
    (a wide Qwen3, so that 128x128 blocks are more than one per weight)."""
    wide = Qwen3Config(**{**SIZES, "hidden_size": 256, "intermediate_size": 384, "head_dim": 64})
    build_reference(wide).save_pretrained(tmp_path / "source")
    source = to_fp8(tmp_path / "source", **layout)
    with safe_open(source / "model.safetensors", "pt") as stored:
        scales = stored.get_tensor("model.layers.0.mlp.up_proj.weight_scale_inv")
    assert scales.numel() > 1 and (scales.dtype == torch.uint8) == bool(layout.get("e8m0"))
    result = convert(source, tmp_path / "out", verify=True, progress=False)
    assert result.parity.passed and result.parity.results[0].max_abs_diff == 0, result.parity.table()


def test_experts_stored_as_one_fp8_tensor_convert_but_are_not_verified_against_transformers(tmp_path):
    """FP8 experts stored as 3-D tensors (``mlp.experts.gate_up_proj`` beside its ``_scale_inv``, as
    ``save_pretrained(save_original_format=False)`` writes them): transformers' dequantizing load leaves them FP8
    values, so it gives no reference; the conversion says so (a check asked for is refused) and writes what the same
    experts stored one by one convert to, which transformers does verify."""
    model = build_reference(QWEN3_MOE)
    model.save_pretrained(tmp_path / "stacked", save_original_format=False)
    stacked = to_fp8(tmp_path / "stacked")
    per_expert = to_fp8(save_unfused_experts(model, tmp_path / "per-expert"))
    with safe_open(stacked / "model.safetensors", "pt") as stored:
        assert stored.get_tensor("model.layers.0.mlp.experts.gate_up_proj").dtype == torch.float8_e4m3fn
    with pytest.raises(ThinkerError, match="leaves FP8 experts stored as 3-D tensors"):
        convert(stacked, tmp_path / "asked", verify=True, progress=False)
    assert_nothing_written(tmp_path / "asked")
    result = convert(stacked, tmp_path / "out", progress=False)
    assert result.parity is None and any("verification skipped" in note for note in result.notes)
    checked = convert(per_expert, tmp_path / "checked", verify=True, progress=False)
    assert checked.parity.passed
    written, expected = load_file(result.output / "model.safetensors"), load_file(checked.output / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    with pytest.raises(ThinkerError, match="gives no reference to verify against"):
        verify(stacked, result.output)


def test_thinker_verify_holds_an_fp8_conversion_bit_for_bit(tmp_path):
    source = fp8_checkpoint(tmp_path, "qwen3")
    converted = convert(source, tmp_path / "out", verify=False, progress=False).output
    assert verify(source, converted).passed
    # An edit too small for the logits' tolerance is still named: the weights are compared to the bit.
    tensors = load_file(converted / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name].view(torch.int16)[3, 5] += 1  # the next bfloat16 value
    save_file(tensors, converted / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ParityFailed, match=name):
        verify(source, converted)


def test_partial_blocks_take_the_scale_of_the_block_they_start(tmp_path):
    """The format's blocks: a dimension not a multiple of the block ends in a partial block with a scale of its own
    (40 rows in blocks of 32: rows 32-39 share one scale), which transformers' grid-derived blocks would not give."""
    weight = torch.randn(40, 72)
    values, scales = quantize_block(weight, BLOCK)
    folder = tmp_path / "partial"
    folder.mkdir()
    save_file({"w.weight": values, "w.weight_scale_inv": scales}, folder / "model.safetensors")
    quantization = {"quant_method": "fp8", "weight_block_size": BLOCK}
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": quantization}))
    source = open_source(folder)
    try:
        assert source.names() == ["w.weight"] and source.dtype("w.weight") == torch.bfloat16
        loaded = source.load("w.weight")
    finally:
        source.close()
    expected = values.float().clone()
    for row in range(40):
        for column in range(72):
            expected[row, column] *= scales[row // 32, column // 32]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, expected)
    torch.testing.assert_close(loaded, weight, rtol=0.07, atol=0)  # FP8's 3 mantissa bits: within 1/16


def test_scales_of_another_grid_are_refused_by_name(tmp_path):
    source = fp8_checkpoint(tmp_path, "qwen3")
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert_error(
        thinker("convert", source, tmp_path / "out"),
        f"{name!r} holds (3, 1) scales for 'model.layers.0.mlp.up_proj.weight' of shape (96, 64)",
        "(3, 2), one per 32x32 block",
    )
    assert_nothing_written(tmp_path / "out")


def test_an_fp8_config_over_float_weights_is_refused(tmp_path):
    build_reference(QWEN3).save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": BLOCK}
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    assert_error(
        thinker("convert", tmp_path / "source", tmp_path / "out"),
        "config.json declares FP8 quantization, but no tensor is stored in FP8",
    )


@pytest.mark.parametrize(("value", "said"), [(float("nan"), "NaN or infinite"), (-0.01, "negative")])
def test_a_corrupt_scale_is_named_not_blamed_on_its_weight(value, said, tmp_path):
    """A NaN or negative scale is refused by name; a zero one (a block of zeros) converts."""
    source = fp8_checkpoint(tmp_path, "qwen3")
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    tensors[name][1, 0] = value
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert_error(thinker("convert", source, tmp_path / "out"), f"{name!r} holds {said} scales")
    assert_nothing_written(tmp_path / "out")
    tensors[name][1, 0] = 0.0
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert thinker("convert", source, tmp_path / "out", "--no-verify").exit_code == 0


def test_an_fp8_weight_without_its_scale_is_refused_by_name(tmp_path):
    source = fp8_checkpoint(tmp_path, "qwen3")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert_error(
        thinker("convert", source, tmp_path / "out"),
        "'model.layers.1.self_attn.o_proj.weight' is stored in FP8 with no",
        "re-download it",
    )


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "compressed-tensors"])
def test_other_quantizations_are_refused_by_method(tmp_path, method):
    """A quantized release this converter cannot read is named by its method, with what to convert instead, not
    reported as tensors no rule maps."""
    build_reference(QWEN3).save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    assert_error(
        thinker("convert", tmp_path / "source", tmp_path / "out"),
        f"config.json: the checkpoint is quantized with {method!r}",
        "convert the model's float (or -FP8) release instead",
    )
    assert_nothing_written(tmp_path / "out")


def test_the_reference_side_reads_the_checkpoint_as_stored(tmp_path):
    """``dequantize=False`` (the layer-by-layer reference, which dequantizes through transformers) sees the FP8
    tensors and their scales; the converter's view sees the float model only."""
    source = fp8_checkpoint(tmp_path, "qwen3")
    stored, floats = open_source(source, dequantize=False), open_source(source)
    try:
        name = "model.layers.0.self_attn.k_proj.weight"
        assert stored.dtype(name) == torch.float8_e4m3fn and name + "_scale_inv" in stored.names()
        assert floats.dtype(name) == torch.bfloat16 and name + "_scale_inv" not in floats.names()
    finally:
        stored.close()
        floats.close()
    for wrong in ("x", [32], [0, 32], [True, 32]):
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"]["weight_block_size"] = wrong
        (source / "config.json").write_text(json.dumps(config))
        with pytest.raises(ThinkerError, match=re.escape(f"weight_block_size is {wrong!r}; the FP8 layout takes two")):
            open_source(source)


def test_activation_scales_of_a_static_scheme_are_left_out(tmp_path):
    """A static activation scheme stores a per-tensor input scale beside each quantized weight (``X.input_scale``,
    ``X.activation_scale``), used only by FP8 matmul kernels: the float model has none, as transformers' dequantizing
    load drops them, so the conversion reads past them rather than stopping at tensors no rule maps."""
    source = fp8_checkpoint(tmp_path, "qwen3")
    tensors = load_file(source / "model.safetensors")
    extra = ["model.layers.0.mlp.up_proj.input_scale", "model.layers.1.self_attn.q_proj.activation_scale"]
    for name in extra:
        tensors[name] = torch.tensor([0.5])
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    floats = open_source(source)
    try:
        assert not set(extra) & set(floats.names())
    finally:
        floats.close()
    result = thinker("convert", source, tmp_path / "out", "--no-verify")
    assert result.exit_code == 0, result.output


@torch.no_grad()
def test_from_pretrained_converts_an_fp8_checkpoint_on_load(tmp_path):
    """``ThinkerForCausalLM.from_pretrained`` of an FP8 folder (``converter.load``) reads it through the same view."""
    import converter.load  # noqa: F401  (registers the family tables with from_pretrained)
    from thinker import ThinkerForCausalLM

    source = fp8_checkpoint(tmp_path, "qwen3")
    ids = torch.tensor([[5, 17, 3, 29, 11]])
    converted = ThinkerForCausalLM.from_pretrained(source)
    reference = AutoModelForCausalLM.from_pretrained(source)
    assert converted.dtype == torch.bfloat16 and getattr(converted.config, "quantization_config", None) is None
    assert torch.equal(converted(ids).logits, reference(ids).logits)


# --- the block layout's edges, one tensor at a time (helper-244) ----------------------------------------


def fp8_folder(folder: Path, tensors: dict, block) -> Path:
    """A folder of ``tensors`` in one safetensors file, its config naming FP8 blocks of ``block`` (None: the
    block read from the grid)."""
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    quantization = {"quant_method": "fp8", "weight_block_size": block}
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": quantization}))
    return folder


def fp8_values(rows, columns, dtype=torch.float8_e4m3fn, seed=0):
    return (torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 8).to(dtype)


def by_element(stored, scales, block):
    """Each stored value times its own block's scale, one element at a time: the definition, not a reshape."""
    rows, columns = stored.shape
    expected = stored.float().clone()
    for r in range(rows):
        for c in range(columns):
            expected[r, c] *= scales[r // block[0], c // block[1]]
    return expected


def distinct_scales(grid):
    return (torch.arange(grid[0] * grid[1], dtype=torch.float32).reshape(grid) + 1) / 8


@pytest.mark.parametrize(
    ("shape", "block"),
    [((64, 96), [16, 32]), ((40, 72), [16, 32]), ((40, 72), [32, 16])],
    ids=["whole", "partial", "partial-tall"],
)
def test_a_block_that_is_not_square_maps_rows_to_rows(tmp_path, shape, block):
    """A block that is not square, whole and partial: rows go with rows and columns with columns, each value times its
    own block's scale (every FP8 fixture had a square block, where a block read as (columns, rows), or a partial
    block's rows repeated by the column block, passed every test: helper-244)."""
    stored = fp8_values(*shape)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    scales = distinct_scales(grid)
    source = open_source(fp8_folder(tmp_path / "f", {"w.weight": stored, "w.weight_scale_inv": scales}, block))
    try:
        loaded = source.load("w.weight")
    finally:
        source.close()
    assert torch.equal(loaded, by_element(stored, scales, block))


def test_a_grid_derived_block_that_is_not_square(tmp_path):
    """No weight_block_size: a 64 x 96 weight over a (4, 3) grid of scales is in blocks of 16 x 32, not 32 x 16."""
    stored, scales = fp8_values(64, 96), distinct_scales((4, 3))
    source = open_source(fp8_folder(tmp_path / "f", {"w.weight": stored, "w.weight_scale_inv": scales}, None))
    try:
        loaded = source.load("w.weight")
    finally:
        source.close()
    assert torch.equal(loaded, by_element(stored, scales, (16, 32)))


def test_e5m2_weights_are_dequantized_too(tmp_path):
    """float8_e5m2 is FP8 too: such a weight beside its scale reads as floats, its scale not a tensor of its own."""
    stored, scales = fp8_values(32, 32, torch.float8_e5m2), torch.tensor([[0.5]])
    source = open_source(fp8_folder(tmp_path / "f", {"w.weight": stored, "w.weight_scale_inv": scales}, [32, 32]))
    try:
        assert source.names() == ["w.weight"] and source.dtype("w.weight") == torch.bfloat16
        assert torch.equal(source.load("w.weight"), stored.float() * 0.5)
    finally:
        source.close()


def test_a_missing_scale_names_the_file_holding_the_weight(tmp_path):
    """A weight in FP8 without its scale is refused naming the file that holds it, not the folder."""
    tensors = {"a.weight": fp8_values(32, 32), "a.weight_scale_inv": torch.ones(1, 1), "b.weight": fp8_values(32, 32)}
    folder = fp8_folder(tmp_path / "f", tensors, [32, 32])
    with pytest.raises(ThinkerError) as err:
        open_source(folder)
    assert str(err.value).startswith(f"{folder / 'model.safetensors'}: tensor 'b.weight' is stored in FP8 with no")


def test_the_values_scan_sees_the_dequantized_fp8_values(tmp_path):
    """The values scan the converter trusts for tensors it only moves (converter/engine.py) sees the dequantized
    values: an FP8 NaN byte is found, not written (a mutation skipping the scan passed every test)."""
    stored = fp8_values(32, 32)
    stored.view(torch.uint8)[3, 4] = 0x7F  # float8_e4m3fn NaN
    source = open_source(
        fp8_folder(tmp_path / "f", {"w.weight": stored, "w.weight_scale_inv": torch.ones(1, 1)}, [32, 32])
    )
    try:
        scan = ValueScan()
        source.load("w.weight", scan=scan)
    finally:
        source.close()
    assert scan.problem(torch.bfloat16) == "holds NaN or Inf values"


def test_a_vector_with_several_scales_is_refused_by_name(tmp_path):
    """A 1-D FP8 tensor takes one scale: two are refused naming the scale, not a reshape's crash."""
    tensors = {"v.weight": fp8_values(1, 64)[0].clone(), "v.weight_scale_inv": torch.ones(2)}
    source = open_source(fp8_folder(tmp_path / "f", tensors, [32, 32]))
    try:
        with pytest.raises(ThinkerError, match=r"'v.weight_scale_inv' holds \(2,\) scales for 'v.weight'"):
            source.load("v.weight")
    finally:
        source.close()
