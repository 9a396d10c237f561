"""Activation-aware scales before round-to-nearest (export/awq.py, ``thinker export --quantize int4`` by default).

What must hold: the scaled model computes the float model's function (to float32 rounding) with the groups the
module's table names and no others; a scale folded where it does not cancel is refused before anything is written;
the search lowers a group's rounding error where the activations make it matter; the export carries the scaled
weights through its own checks, records what it did, and ``--no-awq`` gives plain RTN of the folder's weights."""

from __future__ import annotations

import json
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


def test_a_scale_that_does_not_cancel_is_refused_before_anything_is_written(thinker_folder, tmp_path, monkeypatch):
    """Planted: the norms keep their weights, so the inputs of q/k/v and gate/up are not divided back."""
    folder = thinker_folder("qwen3")
    monkeypatch.setattr(awq, "divide_norm", lambda norm, s: None)
    with pytest.raises(ThinkerError, match=r"changed the float model's logits by .* --no-awq") as refused:
        awq.scale_for_rounding(folder, tmp_path / "scaled", bits=4, block_size=16)
    assert not (tmp_path / "scaled").exists()
    # the limit is the float32 export's own: RELATIVE_TOLERANCE x max(1, max |logit|) on the first calibration text
    model = load(folder)
    with torch.no_grad():
        logits = model(awq.calibration_ids(model, folder)[0][None]).logits
    limit = RELATIVE_TOLERANCE[torch.float32] * max(1.0, float(logits.abs().max()))
    assert f"(limit {limit:.3g}) on its calibration text" in str(refused.value), str(refused.value)


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


def test_calibration_is_seeded_and_leaves_the_callers_random_state(thinker_folder):
    from transformers import AutoTokenizer

    folder = thinker_folder("qwen3")
    model = load(folder)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = awq.calibration_ids(model, folder)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)  # the caller's state does not reach the sampling
    second = awq.calibration_ids(model, folder)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # the tiny models' context is 64: the longest prompt is written on to it, never past it, and each text is its
    # prompt's ids and the same number of tokens written after them (no padding)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(prompt)["input_ids"] for prompt in awq.CALIBRATION_PROMPTS]
    written = 64 - max(len(prompt) for prompt in prompts)
    assert [len(ids) for ids in first] == [len(prompt) + written for prompt in prompts]
    assert all(ids[: len(prompt)].tolist() == prompt for ids, prompt in zip(first, prompts, strict=True))


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
    result = run_export(str(folder), str(tmp_path / "awq"), "--quantize", "int4", "--block-size", "16")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "awq" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is True
    scales = report["quantize"]["activation_scales"]
    assert scales["groups"] == 12
    model = load(folder)
    assert scales["calibration_tokens"] == sum(len(ids) for ids in awq.calibration_ids(model, folder))
    assert (
        f"activation-aware scales: 12 groups of projections scaled for rounding on {scales['calibration_tokens']} "
        f"tokens the model wrote (median alpha {scales['alpha_median']}, median output error "
        f"{scales['error_vs_rtn_median']:.0%} of plain rtn's); the float model's logits moved by "
        f"{scales['logit_difference']:.2g}"
    ) in result.output, result.output
    assert report["verify"]["passed"] is True
    assert report["verify"]["graph"]["max_abs_diff"] <= report["verify"]["graph"]["tolerance"]

    result = run_export(str(folder), str(tmp_path / "rtn"), "--quantize", "int4", "--block-size", "16", "--no-awq")
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
    result = run_export(
        str(thinker_folder("qwen3")), str(tmp_path / "out"), "--quantize", "int4", "--block-size", "16", "--no-verify"
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False
    skipped = report["quantize"]["activation_scales"]["skipped"]
    assert skipped.startswith("activation-aware scales (--awq) skipped: they run the float32 model whole ("), skipped
    assert skipped.endswith("the weights are plain round-to-nearest (--no-awq asks for that without this note)")
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
    folder = zero_channel_folder(thinker_folder("qwen3"), tmp_path / "zero")
    args = [str(folder), str(tmp_path / "out"), "--dtype", "float16", "--quantize", "int4", "--block-size", "16"]
    result = CliRunner().invoke(main, ["export", *args, "--awq"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the activation-aware scales take tensor 'model.layers." in result.output, result.output
    assert "beyond float16's ±65504; export with --no-awq" in result.output, result.output
    assert ".partial" not in result.output and not (tmp_path / "out").exists()


def test_the_search_measures_plain_rtn_at_alpha_0_and_never_ends_above_it():
    """alpha 0 is in the grid and is plain RTN: ``plain`` is the squared output error of the weight rounded as it
    stands, and the alpha kept never has more error than that (ALPHAS without 0 gave plain = inf, a gain of 0)."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 32, generator=generator) * torch.linspace(0.5, 2.0, 32)
    weight = torch.randn(24, 32, generator=generator)
    s, alpha, error, plain = awq.best_scale(one_projection_group(inputs, weight), bits=4, block_size=16)
    expected = float(((inputs @ awq.rounded(weight, 4, 16).T - inputs @ weight.T).double() ** 2).sum())
    assert plain == pytest.approx(expected, rel=1e-9)
    assert 0.0 in awq.ALPHAS
    assert error <= plain
    assert s.shape == (32,) and alpha in awq.ALPHAS


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
