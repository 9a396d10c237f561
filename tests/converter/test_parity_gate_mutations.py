"""Mutations of the whole-model gate (``converter/parity.py``) and its probes of what the prompts never reach
(``converter/unreached.py``) that passed the suite before (a mutation run, helper-252): a half-precision run's decode
steps left out of its verdict, and a NaN difference taken as "not above the tolerance"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from convert_helpers import build_reference
from transformers import Qwen3Config

import thinker.modeling_thinker as modeling
from converter import parity
from converter.convert import convert
from converter.parity import compare, load_converted, load_reference
from converter.unreached import stage
from thinker_common.parity_inputs import fixed_prompts

QWEN3 = Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(source, converted): a tiny Qwen3 and its float32 conversion."""
    root = tmp_path_factory.mktemp("pair")
    build_reference(QWEN3).save_pretrained(root / "source")
    return root / "source", convert(root / "source", root / "out", verify=False, progress=False).output


def decode_attention_scaled(monkeypatch, factor: float) -> None:
    """The Thinker's attention output times ``factor`` at decode steps only (one query over a cache)."""
    eager = modeling.eager_attention_forward

    def patched(module, query, key, value, *args, **kwargs):
        out, weights = eager(module, query, key, value, *args, **kwargs)
        return (out * factor if query.shape[2] == 1 and key.shape[2] > 1 else out), weights

    monkeypatch.setattr(modeling, "eager_attention_forward", patched)


@pytest.mark.parametrize("factor", [3.0, float("nan")], ids=["apart", "nan"])
def test_a_half_precision_run_fails_on_its_decode_steps(folders, monkeypatch, factor):
    """bfloat16, the decode steps alone wrong: the prompts' logits and top-1 agree, and no greedy token is held in
    half precision, so only the decode steps' logits fail it; NaN ones too (mutations leaving ``decode_agrees`` out
    of the half-precision verdict, or comparing ``not max > tolerance``, passed every test)."""
    source, converted = folders
    reference, model = load_reference(source, torch.bfloat16), load_converted(converted, torch.bfloat16)
    prompts = fixed_prompts(QWEN3.vocab_size)
    assert compare(reference, model, prompts).passed
    decode_attention_scaled(monkeypatch, factor)
    result = compare(reference, model, prompts)
    assert result.dtype == "bfloat16" and result.max_abs_diff <= result.tolerance and result.top1_agreement == 1.0
    assert not result.decode_max_abs_diff <= result.decode_tolerance  # NaN, or beyond it
    assert not result.passed


def test_a_nan_logit_of_the_converted_model_fails_float32(folders, monkeypatch):
    """One converted logit NaN at a position no greedy token is taken from: the greedy tokens and the decode steps
    agree, and the NaN difference must fail, not pass as "not above the tolerance"."""
    source, converted = folders
    reference, model = load_reference(source, torch.float32), load_converted(converted, torch.float32)
    real_run = parity.run_prompts

    def one_nan(run_model, prompts, *args, **kwargs):
        run = real_run(run_model, prompts, *args, **kwargs)
        if run_model is model:
            logits = run.logits.clone()
            logits[0, 0] = float("nan")  # the first row's first real position
            run = run._replace(logits=logits)
        return run

    monkeypatch.setattr(parity, "run_prompts", one_nan)
    result = compare(reference, model, fixed_prompts(QWEN3.vocab_size))
    assert result.greedy_identical == result.greedy_prompts
    assert not result.passed


def test_an_unreached_stage_apart_by_nan_fails():
    """An expert (or a row) no prompt reaches, its probe NaN on the converted side: the stage's max |Δ| is NaN,
    which fails (a mutation comparing ``not max > tolerance`` passed every test)."""
    expected = torch.zeros(4, 8)
    actual = expected.clone()
    actual[3, 7] = float("nan")
    found = stage("layer 0: every expert", expected, actual, torch.float32)
    assert found.max_abs_diff != found.max_abs_diff and not found.passed
    assert stage("same", expected, expected.clone(), torch.float32).passed


def test_padding_is_never_compared(folders):
    """Whatever the converted model computes at the batch's left padding (NaN logits, hidden states far off) is no
    difference, for the verdict or for the divergence named: only real positions count (mutations keeping the whole
    batch's logits, or comparing the hidden states at every slot, passed every test, the tiny models computing the
    same at padding)."""
    source, converted = folders
    reference, model = load_reference(source, torch.float32), load_converted(converted, torch.float32)
    prompts = fixed_prompts(QWEN3.vocab_size)
    assert len(set(map(len, prompts))) > 1  # some rows padded

    def padding_garbage(_module, _args, kwargs, output):
        mask = kwargs.get("attention_mask")
        if mask is not None and output.logits.shape[1] == mask.shape[1]:
            output.logits[~mask.bool()] = float("nan")
            for hidden in output.hidden_states or ():
                hidden[~mask.bool()] = 1e3
        return output

    hook = model.register_forward_hook(padding_garbage, with_kwargs=True)
    try:
        result = compare(reference, model, prompts)
        assert result.passed and result.max_abs_diff <= result.tolerance, result
        with torch.no_grad():  # the head apart: named by the real positions' hidden states, every one agreeing
            model.lm_head.weight.mul_(1.01)
        failed = compare(reference, model, prompts)
    finally:
        hook.remove()
    assert not failed.passed and failed.first_divergence == "the final norm or the head (every layer's output agrees)"


def test_a_greedy_token_parting_after_the_first_fails_float32(folders, monkeypatch):
    """float32 holds every greedy token, not only the first: the converted run's fourth token of row 0 changed (the
    logits untouched) fails as a near tie (a mutation counting a row identical by its first token passed)."""
    source, converted = folders
    reference, model = load_reference(source, torch.float32), load_converted(converted, torch.float32)
    real_run = parity.run_prompts

    def parted(run_model, prompts, *args, **kwargs):
        run = real_run(run_model, prompts, *args, **kwargs)
        if run_model is model:
            run.tokens[0][3] = (run.tokens[0][3] + 1) % QWEN3.vocab_size
        return run

    monkeypatch.setattr(parity, "run_prompts", parted)
    result = compare(reference, model, fixed_prompts(QWEN3.vocab_size))
    assert result.greedy_identical == result.greedy_prompts - 1
    assert not result.passed and result.first_divergence == parity.NEAR_TIE


def test_a_last_state_reported_before_the_final_norm_agrees_as_is():
    """A reference class reporting its last hidden state before the final norm (as the converted model does): the
    last state compared as is agrees, whatever the final norm makes of it (a mutation comparing it only after the
    norm named the last layer)."""
    from converter.parity import first_divergence

    generator = torch.Generator().manual_seed(0)
    hidden = tuple(torch.randn(2, 3, 4, generator=generator) for _ in range(3))
    real = torch.ones(2, 3, dtype=torch.bool)
    named = first_divergence(hidden, tuple(h.clone() for h in hidden), real, torch.float32, lambda h: 2 * h)
    assert named == "the final norm or the head (every layer's output agrees)"


def test_a_list_of_expert_modules_is_probed_expert_by_expert():
    """Experts as one module each (``mlp.experts`` an ``nn.ModuleList``): every one is run, the last too."""
    from converter.unreached import EXPERT_ROWS, every_expert

    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    probe = every_expert(layer, 4)
    assert tuple(probe.shape) == (3 * EXPERT_ROWS, 4)
    with torch.no_grad():
        layer.mlp.experts[2].weight[0, 0] += 1.0
    assert not stage("layer 0: every expert", probe, every_expert(layer, 4), torch.float32).passed
