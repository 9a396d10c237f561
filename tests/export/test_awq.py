"""Activation-aware scales before round-to-nearest (export/awq.py, ``thinker export --quantize int4`` by default).

What must hold: the scaled model computes the float model's function (to float32 rounding) with the groups the
module's table names and no others; a scale folded where it does not cancel is refused before anything is written;
the search lowers a group's rounding error where the activations make it matter; the export carries the scaled
weights through its own checks, records what it did, and ``--no-awq`` gives plain RTN of the folder's weights."""

from __future__ import annotations

import json
import math
from functools import partial
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from seeded_weights import rewritten_copy

from export import awq
from export.quantize import QuantizeSpec
from thinker_common.cli import main
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import RELATIVE_TOLERANCE
from thinker_common.sizes import human_size

# Each family's groups, by layer, as the module docstring's table gives them: Gated DeltaNet layers keep their
# attention unscaled, routed-expert MLPs theirs, GPT-2 (LayerNorm, ungated MLP) all but o_proj, Qwen3.8 everything
# (indexers, hyper-connections, per-layer embeddings).
ATTENTION = ["self_attn.q_proj|k_proj|v_proj", "self_attn.o_proj"]
MLP = ["mlp.gate_proj|up_proj", "mlp.down_proj"]
EXPECTED_GROUPS = {
    "qwen2": {0: ATTENTION + MLP, 1: ATTENTION + MLP, 2: ATTENTION + MLP},
    "qwen3": {0: ATTENTION + MLP, 1: ATTENTION + MLP, 2: ATTENTION + MLP},
    "qwen3_moe": {0: ATTENTION, 1: ATTENTION + MLP, 2: ATTENTION},
    "gpt2": {0: ATTENTION[1:], 1: ATTENTION[1:], 2: ATTENTION[1:]},
    "qwen3_5": {0: MLP, 1: ATTENTION + MLP, 2: MLP, 3: ATTENTION + MLP},
    "qwen3_5_moe": {1: ATTENTION, 3: ATTENTION},
    "qwen4_exp": {},
}


def load(folder: Path):
    from thinker import ThinkerForCausalLM

    return ThinkerForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(EXPECTED_GROUPS))
def test_the_groups_scaled_are_the_ones_whose_scales_fold_away(thinker_folder, family):
    groups = awq.scale_groups(load(thinker_folder(family)))
    expected = [f"model.layers.{layer}.{name}" for layer, names in EXPECTED_GROUPS[family].items() for name in names]
    assert [group.name for group in groups] == expected


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_5", "qwen3_moe", "gpt2"])
def test_the_scaled_model_computes_the_float_function(thinker_folder, tmp_path, monkeypatch, family):
    """Biases (Qwen2's v_proj), zero-centred norms and the output gate (Qwen3.5), grouped query heads: each fold
    cancels its scale, and the weights did change (a search that kept alpha 0 everywhere would pass trivially). The
    report's figures are the search's: the median alpha and the median of each group's error over plain RTN's."""
    searched, search = [], awq.best_scale

    def recorded(group, bits, block_size):
        searched.append(search(group, bits, block_size))
        return searched[-1]

    monkeypatch.setattr(awq, "best_scale", recorded)
    folder = thinker_folder(family)
    scaled = awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    original, rescaled = load(folder), load(scaled.folder)
    ids = torch.randint(3, original.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, after = original(ids).logits, rescaled(ids).logits
    scale = max(1.0, float(before.abs().max()))
    assert float((after - before).abs().max()) <= RELATIVE_TOLERANCE[torch.float32] * scale
    changed = [
        name
        for name, parameter in rescaled.named_parameters()
        if not torch.equal(parameter, original.get_parameter(name))
    ]
    assert changed, "no weight was scaled"
    assert scaled.report["groups"] == len(awq.scale_groups(original)) == len(searched)
    alphas = sorted(alpha for _, alpha, _, _ in searched)
    gains = sorted(error / plain for _, _, error, plain in searched)
    assert scaled.report["alpha_median"] == alphas[len(alphas) // 2]
    assert scaled.report["error_vs_rtn_median"] == round(gains[len(gains) // 2], 4)
    assert all(0 < gain <= 1 for gain in gains), gains  # alpha 0 is plain RTN: no group ends with more error
    assert scaled.report["logit_difference"] <= RELATIVE_TOLERANCE[torch.float32] * scale
    # every file but the weights comes along: the tokenizer the export copies, the generation config
    assert {path.name for path in folder.iterdir()} <= {path.name for path in scaled.folder.iterdir()}


def test_a_scale_that_does_not_cancel_is_refused_and_nothing_is_left_behind(thinker_folder, tmp_path, monkeypatch):
    """Planted: the norms keep their weights, so the inputs of q/k/v and gate/up are not divided back."""
    folder = thinker_folder("qwen3")
    monkeypatch.setattr(awq, "divide_norm", lambda norm, s: None)
    with pytest.raises(ThinkerError, match=r"changed the float model's logits by .* --no-awq") as refused:
        awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    assert not (tmp_path / "scaled").exists()  # the staged copy, written as the layers ran, is removed
    # the limit is the float32 export's own, RELATIVE_TOLERANCE x max(1, max |logit|), over the checked positions of
    # the calibration text: CHECKED_POSITIONS of them, the seeded sample
    model = load(folder)
    ids = awq.calibration_ids(folder, model.config)[0]
    with torch.no_grad():
        logits = model(ids).logits.reshape(-1, model.config.vocab_size)
    checked = awq.seeded_rows(ids.numel(), awq.CHECKED_POSITIONS)
    assert ids.numel() > len(checked) == awq.CHECKED_POSITIONS
    limit = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(logits[checked].abs().max()))
    assert f"(limit {limit:.3g}) on its calibration text" in str(refused.value), str(refused.value)


def test_the_checked_positions_are_a_seeded_sample_within_the_search_rows():
    """``seeded_rows``: sorted, distinct, every row where there are no more than asked, and one draw for both
    counts, so the positions the logits are checked at are search rows too."""
    checked, searched = awq.seeded_rows(602, awq.CHECKED_POSITIONS), awq.seeded_rows(602, awq.SEARCH_ROWS)
    assert len(checked) == awq.CHECKED_POSITIONS and len(searched) == awq.SEARCH_ROWS
    assert torch.equal(checked, checked.unique()) and set(checked.tolist()) <= set(searched.tolist())
    assert int(checked.max()) > 602 // 2  # drawn over the whole text, not its first rows
    assert torch.equal(awq.seeded_rows(40, 64), torch.arange(40))


def one_projection_group(inputs: torch.Tensor, weight: torch.Tensor) -> awq.ScaleGroup:
    """A group of one bias-free projection holding ``weight`` (out, in), its calibration ``inputs`` recorded."""
    projection = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        projection.weight.copy_(weight)
    group = awq.ScaleGroup("g", [projection], fold=lambda s: None)
    group.record(inputs)
    return group


def test_the_search_finds_the_channel_the_activations_make_matter():
    """A channel 30x larger in the input than the rest, its weights 30x smaller (the same products): plain RTN
    rounds those weights against their blocks' larger ones and loses most of them, and the search scales them up."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 32, generator=generator)
    inputs[:, 5] *= 30
    weight = torch.randn(24, 32, generator=generator)
    weight[:, 5] /= 30
    s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
    assert alpha > 0
    assert error < 0.5 * plain
    assert s[5] == s.max()


def test_the_calibration_is_the_text_through_the_models_tokenizer_cut_to_its_context(thinker_folder, tmp_path):
    """export/calibration_text.py through the folder's tokenizer, in windows of 64 tokens (the tiny models' context);
    seeded ids, the same every time, where the folder has no tokenizer or one whose ids the model does not have."""
    import shutil

    from transformers import AutoTokenizer

    from export.calibration_text import CALIBRATION_SOURCE, CALIBRATION_TEXT
    from thinker import ThinkerConfig

    folder = thinker_folder("qwen3")
    config = ThinkerConfig.from_pretrained(folder)
    ids, source = awq.calibration_ids(folder, config)
    assert source == CALIBRATION_SOURCE
    expected = AutoTokenizer.from_pretrained(folder)(CALIBRATION_TEXT)["input_ids"]
    assert config.max_position_embeddings == 64
    assert ids.shape == (len(expected) // 64, 64) and ids.flatten().tolist() == expected[: ids.numel()]

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=lambda _, names: [n for n in names if n.startswith(("tokenizer", "vocab"))])
    first, source = awq.calibration_ids(bare, config)
    assert source.startswith("seeded token ids") and first.shape == (awq.UNTOKENIZED_TOKENS // 64, 64)
    assert torch.equal(first, awq.calibration_ids(bare, config)[0])
    config.vocab_size = max(expected)  # the text's largest id one past this model's: it would index past the table
    narrow, source = awq.calibration_ids(folder, config)
    assert source.startswith("seeded token ids") and int(narrow.max()) < config.vocab_size
    config.vocab_size = max(expected) + 1  # every id the model's
    assert awq.calibration_ids(folder, config)[1] == CALIBRATION_SOURCE


def test_the_scales_hold_one_part_of_the_model_at_a_time(thinker_folder, tmp_path, monkeypatch):
    """The calibration runs through the model a unit at a time (converter/streamed.py): whenever a layer's scales
    are applied, no other decoder layer holds weights, and neither do the embeddings or the head, which are read
    again for the logits at the end."""
    from converter.streamed import LazyTensor

    seen, observe = [], awq.Scaling.observe

    def watched(self, unit, args, kwargs, output):
        model = self.streamed.model
        loaded = [name for name, parameter in model.named_parameters() if not parameter.is_meta]
        seen.append((unit.name, sorted({".".join(name.split(".")[:3]) for name in loaded})))
        return observe(self, unit, args, kwargs, output)

    monkeypatch.setattr(awq.Scaling, "observe", watched)
    assert LazyTensor  # the weights are read lazily, unit by unit
    awq.scale_for_rounding(thinker_folder("qwen3"), tmp_path / "scaled", bits=4, block_size=16)
    layers = [(unit, loaded) for unit, loaded in seen if unit.startswith("model.layers.")]
    assert [unit for unit, _ in layers] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert all(loaded == [unit] for unit, loaded in layers), layers


def run_export(*args: str):
    return CliRunner().invoke(main, ["export", *args], catch_exceptions=False)


def graph_weights(folder: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(folder / "model.onnx")
    return {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}


def test_the_export_verifies_the_scaled_weights_and_says_what_it_did(thinker_folder, tmp_path):
    """The default int4 export scales, passes its own checks against the scaled model, records the figures and
    prints them; --no-awq writes plain RTN of the same folder, a different graph of the same ops."""
    folder = thinker_folder("qwen3")
    # the quality gate open: a tiny random model's near-ties make its top-1 agreement a coin toss (scaled, this
    # one's mean KL over the benchmark texts fell from 0.036 to 0.033 as its top-1 fell from 58 % to 43 %)
    gate = ("--min-top1", "0", "--max-perplexity-increase", "100")
    result = run_export(str(folder), str(tmp_path / "awq"), "--quantize", "int4", "--block-size", "16", *gate)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "awq" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is True
    scales = report["quantize"]["activation_scales"]
    assert scales["groups"] == 12
    assert scales["calibration"] == "export/calibration_text.py"
    assert scales["calibration_tokens"] == awq.calibration_ids(folder, load(folder).config)[0].numel()
    assert (
        f"activation-aware scales: 12 groups of projections scaled for rounding on {scales['calibration_tokens']} "
        "tokens of calibration text "
        f"(median alpha {scales['alpha_median']}, median output error "
        f"{scales['error_vs_rtn_median']:.0%} of plain rtn's); the float model's logits moved by "
        f"{scales['logit_difference']:.2g}"
    ) in result.output, result.output
    assert report["verify"]["passed"] is True
    assert report["verify"]["graph"]["max_abs_diff"] <= report["verify"]["graph"]["tolerance"]

    result = run_export(
        str(folder), str(tmp_path / "rtn"), "--quantize", "int4", "--block-size", "16", "--no-awq", *gate
    )
    assert result.exit_code == 0, result.output
    assert "activation-aware" not in result.output
    plain = json.loads((tmp_path / "rtn" / "export_report.json").read_text())
    assert plain["quantize"]["awq"] is False and "activation_scales" not in plain["quantize"]
    assert plain["nodes_by_op"] == report["nodes_by_op"]
    scaled, rtn = graph_weights(tmp_path / "awq"), graph_weights(tmp_path / "rtn")
    assert scaled.keys() == rtn.keys()
    assert any(not np.array_equal(scaled[name], rtn[name]) for name in scaled)


def test_a_model_too_big_for_memory_is_quantized_plain_and_says_so(thinker_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("THINKER_VERIFY_MEMORY", "1KB")
    folder = thinker_folder("qwen3")
    result = run_export(str(folder), str(tmp_path / "out"), "--quantize", "int4", "--block-size", "16", "--no-verify")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False
    skipped = report["quantize"]["activation_scales"]["skipped"]
    assert skipped.startswith(
        "activation-aware scales (--awq) skipped: they read the model a part at a time, and its largest part (a "
        "decoder layer, the embeddings or the head) takes "
    ), skipped
    assert skipped.endswith("the weights are plain round-to-nearest (--no-awq asks for that without this note)")
    assert f"takes {human_size(awq.held_bytes(folder))} in float32, with 1000 B of memory available" in skipped
    assert f"note: {skipped}" in result.output and skipped in report["notes"]
    assert "activation-aware scales: " not in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--quantize", "int4", "--algo", "hqq", "--awq"], "--awq searches scales for symmetric round-to-nearest"),
        (["--awq"], "--awq needs --quantize"),
        (["--no-awq"], "--no-awq needs --quantize"),
    ],
)
def test_awq_where_it_cannot_apply_is_refused_in_one_line(thinker_folder, tmp_path, args, words):
    result = CliRunner().invoke(main, ["export", str(thinker_folder("qwen3")), str(tmp_path / "out"), *args])
    assert result.exit_code == 1
    assert words in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_the_cli_default_is_on_for_rtn_in_float32_graphs():
    """The CLI's default (``parse``); a QuantizeSpec built by hand is the layout as given, plain RTN unless asked."""
    assert QuantizeSpec.parse("int4").awq
    assert QuantizeSpec.parse("int8").awq
    assert not QuantizeSpec.parse("int8", dtype="float16").awq
    assert not QuantizeSpec.parse("int4", dtype="float16").awq
    assert QuantizeSpec.parse("int4", dtype="float16", awq=True).awq
    assert not QuantizeSpec.parse("int4", algo="rtn-asym").awq
    assert not QuantizeSpec.parse("int4", awq=False).awq
    assert QuantizeSpec.parse("int8", dtype="float16", awq=True).awq
    assert not QuantizeSpec(bits=4).awq
    assert QuantizeSpec.parse("int4").describe()["awq"] is True
    assert "activation-aware" in QuantizeSpec.parse("int4").label()


def test_the_outlier_the_guard_moves_under_rtn_is_taken_in_by_the_scales(thinker_variant, tmp_path):
    """test_accuracy_guard.py's planted outlier (one MLP input channel 1000x, the function unchanged): under plain
    RTN int8 activations ruin that layer and the guard moves it to level 1; scaled for rounding, the channel's
    weights are no longer rounded away and its input is divided back, so level 4 agrees with level 1 and nothing
    moves."""
    from test_accuracy_guard import PLANTED_LAYER, with_outlier

    folder = with_outlier(thinker_variant("qwen3", head_dim=16), tmp_path / "outlier", PLANTED_LAYER)
    guards = {}
    for name, extra in (("awq", []), ("rtn", ["--no-awq"])):
        args = [str(folder), str(tmp_path / name), "--graph", "fused", "--quantize", "int4", "--block-size", "16"]
        result = run_export(*args, "--no-verify", *extra)
        assert result.exit_code == 0, result.output
        guards[name] = json.loads((tmp_path / name / "export_report.json").read_text())["accuracy_guard"]
    assert guards["rtn"]["moved_to_level_1"] == [f"layers.{PLANTED_LAYER}"], guards
    assert guards["awq"]["moved_to_level_1"] == [], guards
    assert guards["awq"]["agreement_before"] > guards["rtn"]["agreement_before"], guards


def test_a_model_with_nothing_to_scale_says_so(thinker_folder, tmp_path):
    """Qwen3.8's layers keep plain rounding throughout (EXPECTED_GROUPS): the export says the scales were skipped
    and why, rather than report scales it never applied."""
    args = [str(thinker_folder("qwen4_exp")), str(tmp_path / "out"), "--quantize", "int4", "--block-size", "16"]
    result = run_export(*args, "--no-verify")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False
    skipped = report["quantize"]["activation_scales"]["skipped"]
    assert skipped.startswith(
        "activation-aware scales (--awq) skipped: no projection of this model reads an input whose scale folds away"
    ), skipped
    assert f"note: {skipped}" in result.output and skipped in report["notes"]
    assert "activation-aware scales: " not in result.output


def test_a_folder_with_an_infinite_weight_is_refused_by_name_before_calibration(thinker_folder, tmp_path):
    """The calibration samples from the model, which an Inf weight makes fail inside torch (a review: a traceback
    from torch.multinomial); the folder's values are checked first, as the export checks them without the scales."""

    def plant(weights):
        weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")

    folder = rewritten_copy(thinker_folder("qwen3"), tmp_path / "inf", plant)
    result = CliRunner().invoke(main, ["export", str(folder), str(tmp_path / "out"), "--quantize", "int4"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (
        f"{folder / 'model.safetensors'}: tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or Inf values; "
        "the folder is corrupt"
    ) in result.output
    assert not (tmp_path / "out").exists()


def zero_channel_folder(folder: Path, out: Path) -> Path:
    """An input_layernorm channel of weight 0 in every layer: q/k/v read a channel that is always 0."""

    def plant(weights):
        for layer in range(3):
            weights[f"model.layers.{layer}.input_layernorm.weight"][5] = 0.0

    return rewritten_copy(folder, out, plant)


def test_a_channel_always_zero_leaves_the_other_scales_in_range(thinker_folder, tmp_path):
    """Centred on the log scale, one input channel at 0 pushed every other channel's scale to 1e4-1e5 and the
    q/k/v weights past float16's range (a review); the magnitudes the scales follow span at most MAGNITUDE_RANGE,
    so the float16 export of such a model goes through."""
    folder = zero_channel_folder(thinker_folder("qwen3"), tmp_path / "zero")
    model = load(folder)
    groups = awq.scale_groups(model)
    with torch.no_grad():
        hooks = [g.projections[0].register_forward_pre_hook(lambda m, a, g=g: g.record(a[0])) for g in groups]
        model(torch.arange(3, 43)[None])
        for hook in hooks:
            hook.remove()
    s, alpha, _, _ = awq.best_scale(groups[0], bits=4, block_size=16)
    assert float(s.max() / s.min()) <= awq.MAGNITUDE_RANGE**alpha * (1 + 1e-9)
    args = [str(folder), str(tmp_path / "out"), "--dtype", "float16", "--quantize", "int4", "--block-size", "16"]
    result = run_export(*args, "--awq", "--no-verify")  # the values are checked as the graph is written
    assert result.exit_code == 0, result.output


def test_scales_beyond_float16_are_refused_as_the_scales_doing(thinker_folder, tmp_path, monkeypatch):
    """Planted: no bound on the magnitudes, so the zero channel takes the q/k/v weights past float16's range. The
    refusal names the scales and --no-awq, not the folder's own weights (which are fine) nor a staging file."""
    monkeypatch.setattr(awq, "MAGNITUDE_RANGE", 1e300)
    monkeypatch.setattr(awq, "ALPHAS", (1.0,))  # the search's choice, planted: the scales follow the magnitudes whole
    folder = zero_channel_folder(thinker_folder("qwen3"), tmp_path / "zero")
    args = [str(folder), str(tmp_path / "out"), "--dtype", "float16", "--quantize", "int4", "--block-size", "16"]
    result = CliRunner().invoke(main, ["export", *args, "--awq"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the activation-aware scales take tensor 'model.layers." in result.output, result.output
    assert "beyond float16's ±65504; export with --no-awq" in result.output, result.output
    assert ".partial" not in result.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 5e-3)])
def test_the_search_measures_plain_rtn_at_alpha_0_and_never_ends_above_it(monkeypatch, dtype, tolerance):
    """alpha 0 is in the grid and is plain RTN: ``plain`` is the squared output error of the weight rounded as it
    stands, and the alpha kept never has more error than that (ALPHAS without 0 gave plain = inf, a gain of 0). The
    error is the rounding's, through the inputs, to SEARCH_DTYPE's precision: float32's, or bfloat16's (8 bits of
    mantissa in each factor: 5e-4 of the sum here)."""
    monkeypatch.setattr(awq, "SEARCH_DTYPE", dtype)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 32, generator=generator) * torch.linspace(0.5, 2.0, 32)
    weight = torch.randn(24, 32, generator=generator)
    s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
    exact = inputs.double() @ weight.double().T
    expected = float(((inputs.double() @ awq.rounded(weight, 4, 16).double().T - exact) ** 2).sum())
    assert plain == pytest.approx(expected, rel=tolerance)
    assert 0.0 in awq.ALPHAS
    assert error <= plain
    assert s.shape == (32,) and alpha in awq.ALPHAS and alpha > 0
    # the alpha kept: the inputs divided by its scales, the weight multiplied by them and then rounded
    scaled = (weight * s.float()).double()
    kept = (inputs.double() / s) @ awq.rounded(scaled.float(), 4, 16).double().T
    assert error == pytest.approx(float(((kept - exact) ** 2).sum()), rel=tolerance)


@pytest.mark.parametrize(
    "avx512_bf16, amx, expected",
    [(True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)],
)
def test_the_search_multiplies_in_bfloat16_only_where_the_cpu_has_it(monkeypatch, avx512_bf16, amx, expected):
    """Where the CPU has no bfloat16 products oneDNN emulates them, slower than float32's (AVX-512 without BF16,
    which oneDNN's own ``_is_mkldnn_bf16_supported`` counts as support): float32 there."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert awq.search_dtype() == expected


def test_a_groups_error_is_the_sum_of_its_projections(monkeypatch):
    """q/k/v and gate/up share one input and one alpha: the error the alpha is chosen by is all their outputs'."""
    monkeypatch.setattr(awq, "SEARCH_DTYPE", torch.float32)
    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(64, 32, generator=generator) * torch.linspace(0.5, 2.0, 32)
    first, second = torch.randn(24, 32, generator=generator), torch.randn(16, 32, generator=generator) * 0.01
    group = one_projection_group(inputs, first)
    group.projections.append(torch.nn.Linear(32, 16, bias=False))
    with torch.no_grad():
        group.projections[1].weight.copy_(second)

    def rounding_error(weight: torch.Tensor) -> float:
        return float(((inputs.double() @ (awq.rounded(weight, 4, 16).double() - weight.double()).T) ** 2).sum())

    plain = awq.best_scale(group, bits=4, block_size=16)[3]
    assert plain == pytest.approx(rounding_error(first) + rounding_error(second), rel=1e-5)


def test_the_search_in_bfloat16_keeps_float32s_alphas():
    """bfloat16's products (where the CPU has them, ``search_dtype``) keep the alpha float32's search keeps, on
    groups whose inputs have a few large channels, as AWQ's do (on SmolLM2 every one of 240 groups, int4 and int8),
    each error within 1e-3 of float32's."""
    generator = torch.Generator().manual_seed(3)
    for trial in range(6):
        inputs = torch.randn(256, 128, generator=generator)
        inputs[:, torch.randperm(128, generator=generator)[:4]] *= 20 + 10 * trial
        weight = torch.randn(96, 128, generator=generator) * 0.05
        found = {}
        for dtype in (torch.float32, torch.bfloat16):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(awq, "SEARCH_DTYPE", dtype)
                found[dtype] = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=32)
        (s32, alpha32, error32, plain32), (s16, alpha16, error16, plain16) = found.values()
        assert alpha16 == alpha32 and alpha32 > 0 and torch.equal(s16, s32), trial
        assert error16 == pytest.approx(error32, rel=1e-3) and plain16 == pytest.approx(plain32, rel=1e-3), trial


def test_a_group_keeps_the_search_rows_it_is_told_over_every_call():
    """``keep`` indexes the whole calibration (every sequence, in order): the rows held are exactly those, while the
    mean magnitude counts every row."""
    inputs = torch.randn(3, 40, 8, generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([0, 7, 39, 40, 41, 79, 100, 119])
    group = awq.ScaleGroup("g", [torch.nn.Linear(8, 4)], fold=lambda s: None, keep=keep)
    for sequence in inputs:
        group.record(sequence[None])  # (1, T, C), as the pre-hook sees a sequence
    every = inputs.reshape(-1, 8)
    assert group.seen == 120
    assert torch.equal(torch.cat(group.rows), every[keep])
    torch.testing.assert_close(group.magnitude_sum, every.abs().sum(0, dtype=torch.float64), rtol=1e-12, atol=0)


def test_the_key_value_heads_query_heads_share_one_scale_their_mean(thinker_folder):
    """o_proj's scales are folded into v_proj's rows, one per key-value channel: the query heads that read a
    key-value head get the mean of their scales (tiny qwen3: 4 query heads of 12 channels over 2 key-value heads)."""
    model = load(thinker_folder("qwen3"))
    group = next(group for group in awq.scale_groups(model) if group.name == "model.layers.0.self_attn.o_proj")
    s = torch.arange(48, dtype=torch.float64)
    heads = [s[12 * head : 12 * (head + 1)] for head in range(4)]
    first, second = (heads[0] + heads[1]) / 2, (heads[2] + heads[3]) / 2
    assert torch.equal(group.shared(s), torch.cat([first, first, second, second]))


def grid_errors(inputs: torch.Tensor, weight: torch.Tensor) -> list[float]:
    """Every alpha's squared output error, the whole grid, measured as the search measures one (no shared map), the
    products in float64."""
    magnitude = (inputs.abs().sum(0, dtype=torch.float64) / len(inputs)).clamp_min(1e-30)
    errors = []
    for alpha in awq.ALPHAS:
        s = magnitude**alpha
        scales = (s / (s.max() * s.min()).sqrt()).float()
        rounded = awq.rounded(weight * scales, 4, 16)
        products = (inputs.double() / scales.double()) @ rounded.double().T - inputs.double() @ weight.double().T
        errors.append(float((products**2).sum()))
    return errors


def test_the_coarse_to_fine_search_finds_the_grids_best_alpha_measuring_eight_at_most(monkeypatch):
    """Every other alpha, then the two beside the best of those: where the grid's best is an odd step (one the
    coarse pass skips) on an error that falls to it and rises after, the search still ends there; and it rounds
    the weight for at most 8 of the 11 alphas."""
    found, rounded = 0, awq.rounded

    def counted(calls: list, rounded, *args):
        calls.append(args)
        return rounded(*args)

    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(128, 32, generator=generator) * torch.rand(32, generator=generator).pow(3) * 20
        weight = torch.randn(24, 32, generator=generator)
        errors = grid_errors(inputs, weight)
        best = min(range(len(errors)), key=errors.__getitem__)
        falls, rises = pairwise(errors[: best + 1]), pairwise(errors[best:])
        unimodal = all(a >= b for a, b in falls) and all(a <= b for a, b in rises)
        if best % 2 == 0 or not unimodal:
            continue
        calls = []
        monkeypatch.setattr(awq, "rounded", partial(counted, calls, rounded))
        s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
        monkeypatch.setattr(awq, "rounded", rounded)
        assert alpha == awq.ALPHAS[best], (seed, errors)
        # to the search's precision: bfloat16's products where the CPU has them (search_dtype)
        assert error == pytest.approx(errors[best], rel=5e-3) and plain == pytest.approx(errors[0], rel=5e-3)
        assert len(calls) <= 8
        found += 1
    assert found >= 3, "no seed gave a best alpha the coarse pass skips"


def test_tensors_the_text_never_reaches_are_staged_unchanged(tmp_path):
    """An omni thinker's audio projection and talker head run in no text forward pass, so no unit of the streamed
    calibration loads them: the staged copy still holds every tensor of the folder, those as they were (and a
    folder without a tokenizer calibrates on seeded ids)."""
    from export_helpers import save_thinker
    from safetensors.torch import load_file

    folder = save_thinker(tmp_path / "thinker", "qwen3", tokenizer=False, audio_embed_size=24, talker_head_size=40)
    scaled = awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    assert scaled.report["calibration"].startswith("seeded token ids")
    original, staged = load_file(folder / "model.safetensors"), load_file(scaled.folder / "model.safetensors")
    assert staged.keys() == original.keys()
    unread = [name for name in original if not name.startswith(("model.layers.", "model.embed", "model.norm", "lm_"))]
    assert unread, sorted(original)
    for name in unread:
        assert torch.equal(staged[name], original[name].float()), name


def first_fold_planted(monkeypatch, plant) -> None:
    """``plant(norm, s)`` in place of the first norm fold the scales make (layer 0's q/k/v group), the others real."""
    calls, divide = [], awq.divide_norm

    def planted(norm, s):
        calls.append(norm)
        return plant(norm, s) if len(calls) == 1 else divide(norm, s)

    monkeypatch.setattr(awq, "divide_norm", planted)


@pytest.mark.parametrize(
    ("plant", "words"),
    [
        (lambda norm, s: None, r"changed the float model's logits by \d"),  # layer 0's input norm left undivided
        (lambda norm, s: norm.weight.fill_(float("nan")), "changed the float model's logits by nan"),  # an overflow
    ],
)
def test_a_fold_wrong_in_the_first_layer_alone_is_refused(thinker_folder, tmp_path, monkeypatch, plant, words):
    """The scaled model's own hidden states carry a wrong fold of layer 0 to the logits (fed the float model's at
    each layer instead, only the last layer's fold would count); a NaN there is refused too, not taken for 0."""
    first_fold_planted(monkeypatch, plant)
    with pytest.raises(ThinkerError, match=words):
        awq.scale_for_rounding(thinker_folder("qwen3"), tmp_path / "scaled", bits=4, block_size=16)
    assert not (tmp_path / "scaled").exists()


def test_the_folders_own_weight_beyond_float16_is_not_blamed_on_the_scales(thinker_folder, tmp_path):
    """A k_norm weight of 1e5 in the folder, which no scale touches: the scales go through (the export refuses the
    folder's value itself, --no-awq or not), rather than advise --no-awq for a value that is not theirs."""

    def plant(weights):
        weights["model.layers.0.self_attn.k_norm.weight"][0] = 1e5

    folder = rewritten_copy(thinker_folder("qwen3"), tmp_path / "wide", plant)
    scaled = awq.scale_for_rounding(folder, tmp_path / "scaled", 4, 16, graph_dtype=torch.float16)
    assert scaled is not None and scaled.report["groups"] == 12


def test_the_memory_the_scales_need_is_their_largest_unit_in_float32(thinker_folder, tmp_path, monkeypatch):
    """held_bytes: the largest decoder layer's (or embedding's, or untied head's) tensors at 4 bytes each, counted
    independently here; the export scales where MEMORY_FACTOR times that fits the memory budget, and not below."""
    from safetensors.torch import load_file

    folder = thinker_folder("qwen3")
    tensors = load_file(folder / "model.safetensors")
    layers = [sum(t.numel() for n, t in tensors.items() if n.startswith(f"model.layers.{i}.")) for i in range(3)]
    others = [t.numel() for n, t in tensors.items() if not n.startswith("model.layers.")]
    held = 4 * max(*layers, *others)
    assert awq.held_bytes(folder) == held
    # exactly MEMORY_FACTOR times: fits (held is a multiple of 4, so the budget is the product itself)
    for factor, scaled in (
        (awq.MEMORY_FACTOR * 0.8, False),
        (awq.MEMORY_FACTOR, True),
        (awq.MEMORY_FACTOR * 1.1, True),
    ):
        monkeypatch.setenv("THINKER_VERIFY_MEMORY", str(int(held * factor)))
        out = tmp_path / f"x{factor}"
        result = run_export(str(folder), str(out), "--quantize", "int4", "--block-size", "16", "--no-verify")
        assert result.exit_code == 0, result.output
        assert json.loads((out / "export_report.json").read_text())["quantize"]["awq"] is scaled, factor


def test_the_search_rows_are_the_seeded_sample_of_every_window(thinker_folder, tmp_path, monkeypatch):
    """SEARCH_ROWS rows drawn (seeded) from the whole calibration, the later windows too, not its first rows."""
    kept, search = [], awq.best_scale

    def recorded(group, bits, block_size):
        kept.append(group.keep)
        return search(group, bits, block_size)

    monkeypatch.setattr(awq, "best_scale", recorded)
    folder = thinker_folder("qwen3")
    awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    rows = awq.calibration_ids(folder, load(folder).config)[0].numel()
    expected = torch.randperm(rows, generator=torch.Generator().manual_seed(awq.CALIBRATION_SEED))[: awq.SEARCH_ROWS]
    assert rows > awq.SEARCH_ROWS and int(expected.max()) >= rows - 64  # reaching the last window of 64
    assert all(torch.equal(keep, expected.sort().values) for keep in kept) and len(kept) == 12


def test_alphas_of_equal_error_keep_the_smallest():
    """Every channel of the same mean magnitude: every alpha gives the same scales (1) and error, and the search
    reports alpha 0, plain RTN, not another alpha that changed nothing."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 2, (64, 32), generator=generator).float() * 2 - 1  # every |x| = 1
    weight = torch.randn(24, 32, generator=generator)
    s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
    assert alpha == 0.0 and error == plain and torch.equal(s, torch.ones_like(s))


def test_the_search_rounds_as_the_export_does():
    """``rounded``, the search's rounding, is onnxruntime's symmetric RTN of the weight as the export quantizes it
    (not the asymmetric one, which the scales are refused with), a width the block does not divide cut back."""
    from test_rounding import onnxruntime_dequantized

    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(4))
    for bits in (4, 8):
        assert torch.equal(awq.rounded(weight, bits, 16), onnxruntime_dequantized(weight, bits, 16, "rtn")), bits


def test_indexed_attention_and_per_layer_embeddings_keep_plain_rounding_without_hyper_connections(
    tmp_path, monkeypatch
):
    """Qwen3.8's layers with one stream (no hyper-connections to skip them by): the indexed attention keeps s = 1
    (its indexer reads the attention's input) and so does the dense MLP of a PLE layer; the plain dense MLP is
    scaled. Planted: the indexer taken for a plain child, the q/k/v fold changes what it reads, and the check
    refuses it."""
    from export_helpers import save_thinker

    folder = save_thinker(tmp_path / "thinker", "qwen4_exp", hc_count=1, mlp_only_layers=[0, 1])
    assert [group.name for group in awq.scale_groups(load(folder))] == [f"model.layers.1.{name}" for name in MLP]
    monkeypatch.setattr(awq, "PLAIN_ATTENTION", awq.PLAIN_ATTENTION | {"indexer"})
    with pytest.raises(ThinkerError, match="changed the float model's logits by"):
        awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    assert not (tmp_path / "scaled").exists()


def test_a_context_longer_than_the_text_calibrates_on_the_whole_text_in_one_row(thinker_folder):
    """A real model's context (thousands of tokens) holds the whole calibration text: one row of all of it, not
    whole windows of the context (of which there are none)."""
    from transformers import AutoTokenizer

    from export.calibration_text import CALIBRATION_TEXT
    from thinker import ThinkerConfig

    folder = thinker_folder("qwen3")
    config = ThinkerConfig.from_pretrained(folder)
    config.max_position_embeddings = 32768
    expected = AutoTokenizer.from_pretrained(folder)(CALIBRATION_TEXT)["input_ids"]
    ids, _ = awq.calibration_ids(folder, config)
    assert len(expected) < 32768 and ids.tolist() == [expected]


def test_a_fold_a_fraction_of_a_percent_off_is_refused(thinker_folder, tmp_path, monkeypatch):
    """The check's bar is the float32 export's (1e-4 of the logits' scale), not a looser one: one channel of layer
    0's q/k/v scale folded 0.3 % off moves the logits by about 0.3 % of their scale, 9x the limit, and is refused."""
    divide = awq.divide_norm

    def off(norm, s):
        s = s.clone()
        s[0] *= 1.003
        divide(norm, s)

    first_fold_planted(monkeypatch, off)
    with pytest.raises(ThinkerError, match="changed the float model's logits by"):
        awq.scale_for_rounding(thinker_folder("qwen3"), tmp_path / "scaled", bits=4, block_size=16)


def test_an_alpha_whose_error_is_not_finite_is_never_kept(monkeypatch):
    """``least``: the alpha of least finite error. Planted: plain RTN's error (the first measured) NaN; a NaN
    compares neither below nor above, so kept first it would stay; the search keeps the best finite alpha."""
    calls, rounded = [], awq.rounded

    def nan_first(weight, bits, block_size):
        calls.append(block_size)
        result = rounded(weight, bits, block_size)
        return result.fill_(float("nan")) if len(calls) == 1 else result

    monkeypatch.setattr(awq, "rounded", nan_first)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 32, generator=generator) * torch.linspace(0.5, 4.0, 32)
    weight = torch.randn(24, 32, generator=generator)
    s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
    assert math.isnan(plain) and math.isfinite(error) and alpha > 0
