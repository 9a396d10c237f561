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
def test_the_scaled_model_computes_the_float_function(thinker_folder, tmp_path, family):
    """Biases (Qwen2's v_proj), zero-centred norms and the output gate (Qwen3.5), grouped query heads: each fold
    cancels its scale, and the weights did change (a search that kept alpha 0 everywhere would pass trivially)."""
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
    assert scaled.report["groups"] == len(awq.scale_groups(original))
    assert scaled.report["logit_difference"] <= RELATIVE_TOLERANCE[torch.float32] * scale
    # every file but the weights comes along: the tokenizer the export copies, the generation config
    assert {path.name for path in folder.iterdir()} <= {path.name for path in scaled.folder.iterdir()}


def test_a_scale_that_does_not_cancel_is_refused_before_anything_is_written(thinker_folder, tmp_path, monkeypatch):
    """Planted: the norms keep their weights, so the inputs of q/k/v and gate/up are not divided back."""
    monkeypatch.setattr(awq, "divide_norm", lambda norm, s: None)
    with pytest.raises(ThinkerError, match=r"changed the float model's logits by .* --no-awq"):
        awq.scale_for_rounding(thinker_folder("qwen3"), tmp_path / "scaled", bits=4, block_size=16)
    assert not (tmp_path / "scaled").exists()


def test_the_search_finds_the_channel_the_activations_make_matter():
    """A channel 30x larger in the input than the rest, its weights 30x smaller (the same products): plain RTN
    rounds those weights against their blocks' larger ones and loses most of them, and the search scales them up."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 32, generator=generator)
    inputs[:, 5] *= 30
    weight = torch.randn(24, 32, generator=generator)
    weight[:, 5] /= 30
    projection = torch.nn.Linear(32, 24, bias=False)
    with torch.no_grad():
        projection.weight.copy_(weight)
    group = awq.ScaleGroup("g", [projection], fold=lambda s: None)
    group.record(inputs)
    s, alpha, error, plain = awq.best_scale(group, bits=4, block_size=16)
    assert alpha > 0
    assert error < 0.5 * plain
    assert s[5] == s.max()


def test_calibration_is_seeded_and_leaves_the_callers_random_state(thinker_folder):
    folder = thinker_folder("qwen3")
    model = load(folder)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = awq.calibration_ids(model, folder)
    assert torch.equal(torch.get_rng_state(), state)
    second = awq.calibration_ids(model, folder)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # the tiny models' context is 64: the prompts are written on to it, never past it
    assert max(len(ids) for ids in first) == 64
    assert len(first) == len(awq.CALIBRATION_PROMPTS)


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
    assert "activation-aware scales: 12 groups" in result.output
    report = json.loads((tmp_path / "awq" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is True
    assert report["quantize"]["activation_scales"]["groups"] == 12
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
    assert "activation-aware scales (--awq) skipped" in result.output
    report = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False
    assert "skipped" in report["quantize"]["activation_scales"]


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
    assert "no projection of this model reads an input whose scale folds away" in result.output
    report = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert report["quantize"]["awq"] is False


def edited_copy(folder: Path, out: Path, edit) -> Path:
    """A copy of the Thinker ``folder`` whose weights ``edit`` changed in place (a dict of tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    edit(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_folder_with_an_infinite_weight_is_refused_by_name_before_calibration(thinker_folder, tmp_path):
    """The calibration samples from the model, which an Inf weight makes fail inside torch (a review: a traceback
    from torch.multinomial); the folder's values are checked first, as the export checks them without the scales."""

    def plant(weights):
        weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")

    folder = edited_copy(thinker_folder("qwen3"), tmp_path / "inf", plant)
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

    return edited_copy(folder, out, plant)


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
