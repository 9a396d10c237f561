"""The layer-by-layer gate's own figures (``converter/layer_parity.py``, ``converter/parity_report.py``), each held
to what transformers' class and the Thinker compute whole on the same left-padded batch: every stage's scale and
tolerance from the reference's activations alone (never the converted model's), the end-to-end logits' max |Δ|,
top-1 agreement and decode tolerance, each stage's mean at most its max, the table naming the worst stage and the
decode steps' rows, a layer count that differs named as such, and a layer gone NaN named as that layer. Each test
was written against a mutation of the check that passed the suite before (a mutation run)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from convert_helpers import build_reference
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

import thinker.modeling_thinker as modeling
from converter.convert import convert
from converter.layer_parity import HEAD as HEAD_STAGE
from converter.layer_parity import _Stage
from converter.parity import check_parity, run_prompts
from converter.parity_report import BY_LAYER, GREEDY_ONLY, LAYER_DECODE_STEPS
from converter.unreached import stage as unreached_stage
from thinker import ThinkerForCausalLM
from thinker.modeling_thinker import CACHE_ARG
from thinker_common.parity_inputs import GATE_TOLERANCE, gate_prompts, left_padded

# untied, so that the head can be altered alone; embeddings of a randomized tiny model stay well under 1 (their
# tolerance is then 1e-4 × 1, not 1e-4 × their scale)
QWEN3 = Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
RELATIVE = GATE_TOLERANCE[torch.float32]
ALTERED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(source, converted): the tiny reference and its float32 conversion, unchecked (each test runs its own)."""
    root = tmp_path_factory.mktemp("gate")
    build_reference(QWEN3).save_pretrained(root / "source")
    output = convert(root / "source", root / "out", verify=False, progress=False).output
    return root / "source", output


def altered_copy(converted: Path, folder: Path, changes: dict[str, float]) -> Path:
    """A copy of ``converted`` with each named tensor scaled by its factor (NaN: its first element made NaN)."""
    shutil.copytree(converted, folder)
    weights = load_file(folder / "model.safetensors")
    for name, factor in changes.items():
        if factor != factor:
            weights[name].view(-1)[0] = float("nan")
        else:
            weights[name] = weights[name] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def whole_models(source: Path, converted: Path):
    """transformers' class and the Thinker, whole, in float32, and the gate's prompts."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    thinker = ThinkerForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    prompts = gate_prompts(QWEN3.vocab_size, QWEN3.max_position_embeddings, 8)
    return reference, thinker, prompts


@torch.no_grad()
def reference_layer_outputs(reference, prompts) -> list[torch.Tensor]:
    """Each decoder layer's output at the batch's real tokens, taken by a hook (not transformers' hidden_states,
    whose last is after the final norm)."""
    ids, mask, positions = left_padded(prompts)
    outputs = []
    hooks = [
        layer.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for layer in reference.model.layers
    ]
    try:
        embedded = reference.model.embed_tokens(ids)
        reference(input_ids=ids, attention_mask=mask, position_ids=positions)
    finally:
        for hook in hooks:
            hook.remove()
    real = mask.bool()
    return [embedded[real].float(), *(output[real].float() for output in outputs)]


@torch.no_grad()
def forced_steps(thinker, prompts, tokens: list[list[int]]) -> torch.Tensor:
    """The Thinker's logits at LAYER_DECODE_STEPS decode steps after the batch, each row fed the given tokens (the
    reference's greedy ones) through its own cache: (B, steps, vocab)."""
    ids, mask, positions = left_padded(prompts)
    output = thinker(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    fed, steps = torch.tensor(tokens), []
    for step in range(LAYER_DECODE_STEPS):
        token = fed[:, step : step + 1]
        mask, positions = torch.cat([mask, torch.ones_like(token)], dim=1), positions[:, -1:] + 1
        cache = getattr(output, CACHE_ARG)
        output = thinker(input_ids=token, attention_mask=mask, position_ids=positions, **{CACHE_ARG: cache})
        steps.append(output.logits[:, -1].float())
    return torch.stack(steps, dim=1)


def test_every_figure_is_the_references_scale_and_the_whole_models_difference(folders, tmp_path):
    """Layer 1's down projection and the head scaled up in the converted model: its activations grow, the reference's
    do not. Every stage's scale is the reference's own max |output| at real tokens and its tolerance 1e-4 ×
    max(1, that) (the embeddings' under 1); the logits' max |Δ|, scale, tolerance and top-1 agreement are those of
    the two whole models on the same batch; the decode tolerance takes the reference's decode steps' scale; every
    stage's mean |Δ| is at most its max."""
    source, converted = folders
    broken = altered_copy(converted, tmp_path / "broken", {ALTERED: 3.0, "lm_head.weight": 2.0})
    report = check_parity(source, broken, mode=BY_LAYER)
    fp32 = report.results[0]
    assert not report.passed and fp32.first_divergence == "layer 1"

    reference, thinker, prompts = whole_models(source, broken)
    expected_scales = [hidden.abs().max().item() for hidden in reference_layer_outputs(reference, prompts)]
    theirs, ours = run_prompts(reference, prompts, 1 + LAYER_DECODE_STEPS), run_prompts(thinker, prompts, 1)
    logit_scale = theirs.logits.abs().max().item()
    stages = {stage.name: stage for stage in fp32.layers}
    assert list(stages) == ["embeddings", "layer 0", "layer 1", "layer 2", "final norm and head"]
    expected_scales.append(logit_scale)  # the head on the reference's last hidden state: the reference's logits
    assert expected_scales[0] < 1 < logit_scale  # both sides of max(1, scale) are taken
    for stage, scale in zip(stages.values(), expected_scales, strict=True):
        assert stage.scale == pytest.approx(scale, rel=1e-5), stage.name
        assert stage.tolerance == pytest.approx(RELATIVE * max(1.0, scale), rel=1e-5), stage.name
        assert stage.mean_abs_diff <= stage.max_abs_diff, stage.name
    assert not stages["layer 1"].passed and not stages["final norm and head"].passed
    assert stages["layer 0"].passed and stages["layer 2"].passed

    assert fp32.logit_scale == pytest.approx(logit_scale, rel=1e-5)
    assert fp32.tolerance == pytest.approx(RELATIVE * max(1.0, logit_scale), rel=1e-5)
    whole_diff = (theirs.logits - ours.logits).abs()
    assert fp32.max_abs_diff == pytest.approx(whole_diff.max().item(), rel=1e-4)
    assert fp32.mean_abs_diff == pytest.approx(whole_diff.mean().item(), rel=1e-4)
    top1 = (theirs.logits.argmax(-1) == ours.logits.argmax(-1)).float().mean().item()
    assert top1 < 1 and fp32.top1_agreement == pytest.approx(top1, abs=1e-6)
    # the decode steps, both models fed the reference's greedy tokens: the reference's own logits there
    decode_scale = theirs.step_logits.abs().max().item()
    assert fp32.decode_tolerance == pytest.approx(RELATIVE * max(1.0, logit_scale, decode_scale), rel=1e-5)
    decode_diff = (theirs.step_logits - forced_steps(thinker, prompts, theirs.tokens)).abs().max().item()
    assert fp32.decode_max_abs_diff == pytest.approx(decode_diff, rel=1e-4)
    assert fp32.decode_max_abs_diff > fp32.decode_tolerance

    table = report.table()
    worst = max(fp32.layers, key=lambda stage: stage.max_abs_diff / stage.tolerance)
    assert f"largest max|Δ| against its tolerance at {worst.name}: " in table, table
    assert f"{len(prompts)} rows × {LAYER_DECODE_STEPS} steps after the prompts" in table, table
    assert fp32.decode_steps == len(prompts) * LAYER_DECODE_STEPS
    recorded = json.loads(report.to_json())["results"][0]
    assert [stage["scale"] for stage in recorded["layers"]] == [stage.scale for stage in fp32.layers]


def test_a_layer_count_that_differs_is_named(folders, tmp_path):
    """A converted config with a layer fewer than the reference (its weights all there): named as the layer counts,
    not as logits that add up across layers."""
    source, converted = folders
    short = shutil.copytree(converted, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    config["num_hidden_layers"] = QWEN3.num_hidden_layers - 1
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:-1]
    (short / "config.json").write_text(json.dumps(config))
    report = check_parity(source, short, mode=BY_LAYER)
    fp32 = report.results[0]
    assert not report.passed
    assert fp32.first_divergence == "layer count (3 reference, 2 converted): the layer counts differ", report.table()


@torch.no_grad()
def test_float32_needs_the_top1_token_at_every_position(tmp_path):
    """float32: two head rows equal in the reference (an exact tie, taken by the lower id) and the higher one 1e-6
    larger in the Thinker (a near tie taken the other way, every logit within the tolerance) at the few positions
    where that token is the best: top-1 above half precision's 90 %, and float32 still fails."""
    model = build_reference(QWEN3).eval()
    prompts = gate_prompts(QWEN3.vocab_size, QWEN3.max_position_embeddings, 8)
    ids, mask, positions = left_padded(prompts)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
    best = logits.argmax(-1)
    counts = torch.bincount(best, minlength=QWEN3.vocab_size)
    never = max(token for token in range(QWEN3.vocab_size) if counts[token] == 0)
    rare = min((token for token in range(never) if counts[token]), key=lambda token: counts[token].item())
    assert (logits[best == rare, rare] > 0).all() and counts[rare] < 0.1 * len(best)
    model.lm_head.weight[never] = model.lm_head.weight[rare]
    model.save_pretrained(tmp_path / "source")
    converted = convert(tmp_path / "source", tmp_path / "out", verify=False, progress=False).output
    altered_copy(converted, tmp_path / "near", {})
    weights = load_file(tmp_path / "near" / "model.safetensors")
    weights["lm_head.weight"][never] *= 1 + 1e-6
    save_file(weights, tmp_path / "near" / "model.safetensors", metadata={"format": "pt"})

    fp32 = check_parity(tmp_path / "source", tmp_path / "near", mode=BY_LAYER).results[0]
    assert fp32.max_abs_diff <= fp32.tolerance and all(stage.passed for stage in fp32.layers), fp32.layers
    expected = 1 - counts[rare].item() / len(best)
    assert fp32.top1_agreement == pytest.approx(expected, abs=1e-6) and fp32.top1_agreement > 0.9
    assert not fp32.passed


def test_a_layer_gone_nan_is_named(folders, tmp_path):
    """One NaN weight in layer 1: that stage fails with a NaN difference and is named first, where Python's
    ``max(0.0, nan)`` had kept 0.0 and blamed the logits."""
    source, converted = folders
    broken = altered_copy(converted, tmp_path / "nan", {ALTERED: float("nan")})
    report = check_parity(source, broken, mode=BY_LAYER)
    fp32 = report.results[0]
    stages = {stage.name: stage for stage in fp32.layers}
    assert not fp32.passed
    assert not stages["layer 1"].passed and fp32.first_divergence == "layer 1"
    assert math.isnan(stages["layer 1"].max_abs_diff) and stages["layer 0"].passed
    # the table's worst stage is that one too, not "every stage identical"
    assert "stages compared on the reference's inputs; largest max|Δ| against its tolerance at layer 1: nan" in (
        report.table()
    ), report.table()


def test_an_unreached_stage_is_held_at_its_largest_difference_and_the_references_scale():
    """``converter/unreached.py`` ``stage``: one probe value of 80,000 apart fails (the mean would hide it), and the
    tolerance is 1e-4 × max(1, the reference side's scale), the converted side's larger values widening nothing."""
    expected = torch.zeros(10_000, 8)
    expected[0, 0] = 2.0
    actual = expected.clone()
    actual[-1, -1] = 0.5
    found = unreached_stage("probe", expected, actual, torch.float32)
    assert not found.passed and found.max_abs_diff == 0.5 and found.scale == 2.0
    assert found.tolerance == pytest.approx(RELATIVE * 2.0)
    actual[-1, -1], actual[0, 1] = 0.0, 50.0
    widened = unreached_stage("probe", expected, actual, torch.float32)
    assert not widened.passed and widened.tolerance == pytest.approx(RELATIVE * 2.0)


# --- which stage is named, and a NaN decode (helper-245) ----------------------------------------------------------


def by_layer(source, converted):
    """The layer-by-layer gate's report, its float32 result, and that result's stages by name."""
    report = check_parity(source, converted, mode=BY_LAYER)
    fp32 = report.results[0]
    return report, fp32, {stage.name: stage for stage in fp32.layers}


def test_an_altered_embedding_is_named_embeddings(folders, tmp_path):
    """Untied: the embedding table scaled; every layer and the head run on the reference's hidden states, so only the
    embeddings stage (the Thinker's own input to layer 0) sees it (stages compared on the wrong stream still failed
    the model, naming another stage: helper-245)."""
    source, converted = folders
    report, fp32, stages = by_layer(
        source, altered_copy(converted, tmp_path / "emb", {"model.embed_tokens.weight": 1.5})
    )
    assert not report.passed and fp32.first_divergence == "embeddings", report.table()
    assert stages["embeddings"].max_abs_diff > stages["embeddings"].tolerance
    assert stages["layer 0"].passed and stages[HEAD_STAGE].passed


def test_the_head_stage_runs_on_the_references_last_hidden_state(folders, tmp_path):
    """Layer 1 alone altered: the Thinker's own stream is off from layer 1 on, the head stage (on the reference's last
    hidden state) is not."""
    source, converted = folders
    report, fp32, stages = by_layer(source, altered_copy(converted, tmp_path / "l1", {ALTERED: 3.0}))
    assert not report.passed and fp32.first_divergence == "layer 1"
    head = stages[HEAD_STAGE]
    assert head.passed and head.max_abs_diff <= head.tolerance, head
    assert fp32.max_abs_diff > fp32.tolerance  # the end-to-end logits do differ


def attention_patched(monkeypatch, change):
    """The Thinker's eager attention with ``change`` applied to its query, key, value and mask, and its output
    multiplied by the factor ``change`` returns."""
    eager = modeling.eager_attention_forward

    def patched(module, query, key, value, attention_mask, *args, **kwargs):
        query, key, value, attention_mask, scale_out = change(query, key, value, attention_mask)
        out, weights = eager(module, query, key, value, attention_mask, *args, **kwargs)
        return out * scale_out, weights

    monkeypatch.setattr(modeling, "eager_attention_forward", patched)


def test_a_decode_step_gone_nan_fails(folders, monkeypatch):
    """The Thinker's attention NaN at decode steps only (one query over a cache): the prompts agree exactly, the
    decode steps' max |Δ| is NaN, which must fail, not pass as "not above the tolerance" (a mutation comparing so
    passed every test: helper-245)."""
    source, converted = folders
    attention_patched(
        monkeypatch,
        lambda q, k, v, m: (q, k, v, m, float("nan") if q.shape[2] == 1 and k.shape[2] > 1 else 1.0),
    )
    report, fp32, stages = by_layer(source, converted)
    assert all(stage.passed for stage in stages.values())
    assert math.isnan(fp32.decode_max_abs_diff)
    assert not report.passed and fp32.first_divergence == GREEDY_ONLY


def test_a_mask_that_lets_each_token_see_the_next_is_named_at_layer_0(folders, monkeypatch):
    """The Thinker's causal mask one slot too wide on the prompts (token i sees i + 1): every real position but each
    row's last differs, so layer 0 fails on the reference's own hidden states."""
    source, converted = folders

    def leak(q, k, v, mask):
        if mask is not None and q.shape[2] == k.shape[2] > 1:
            mask = mask.clone()
            slots = torch.arange(q.shape[2] - 1)
            mask[..., slots, slots + 1] = 0
        return q, k, v, mask, 1.0

    attention_patched(monkeypatch, leak)
    report, fp32, stages = by_layer(source, converted)
    assert not report.passed and fp32.first_divergence == "layer 0", report.table()
    assert not stages["layer 0"].passed


def test_a_stages_stream_figure_is_its_largest_over_every_batch():
    """A reference fed one prompt at a time adds each stage once a batch: the largest stream difference is kept."""
    stage = _Stage("layer 0")
    expected, real = torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool)
    stage.add(expected, expected, real, torch.full((1, 3, 4), 2.0))
    stage.add(expected, expected, real, torch.full((1, 3, 4), 0.5))
    assert stage.stream_max_abs_diff == 2.0
    stage.add(expected, None, real)  # the converted model produced nothing comparable: infinitely off
    assert stage.max_abs_diff == math.inf and not stage.result(1e-4).passed
