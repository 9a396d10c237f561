"""The whole-model gate's own parts (``converter/parity.py``), the config comparison of ``thinker verify`` and the way
back (``converter/config_compare.py``) and the special-id comparison (``converter/special_tokens.py``), each held to
figures computed here from the same runs: the decode steps compared only while both continuations hold the same
tokens, the figures of ``compare`` (tolerance, mean, top-1, greedy agreement, decode steps), a hidden state's
padding never counted, the failing report's path and message, and the memory budget's arithmetic. Each test was
written against a mutation of the check that passed the suite before (a mutation run)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from convert_helpers import build_reference
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, Qwen2VLConfig, Qwen3Config

from converter import parity
from converter.config_compare import config_differences, saved_config_differences
from converter.convert import convert
from converter.parity import (
    Run,
    compare,
    decode_steps_alike,
    first_divergence,
    first_nonfinite,
    load_converted,
    load_reference,
    parity_gate,
    parity_mode,
    refuse_bad_memory_setting,
    run_prompts,
    whole_model_bytes,
)
from converter.parity_report import BY_LAYER, GREEDY_TOKENS, WHOLE_MODEL, ParityFailed
from converter.special_tokens import source_named_ids, special_id_differences
from thinker import ThinkerConfig
from thinker_common.errors import ThinkerError
from thinker_common.parity_inputs import GATE_TOLERANCE, fixed_prompts, gate_prompts

QWEN3 = Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
RELATIVE = GATE_TOLERANCE[torch.float32]
HEAD_AGREES = "the final norm or the head (every layer's output agrees)"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, Path, Path]:
    """(reference, converted, source folder, converted folder): a tiny Qwen3 and its float32 conversion, both loaded
    in float32 as the gate loads them. Tests alter copies, never these."""
    root = tmp_path_factory.mktemp("pair")
    build_reference(QWEN3).save_pretrained(root / "source")
    output = convert(root / "source", root / "out", verify=False, progress=False).output
    reference, converted = load_reference(root / "source", torch.float32), load_converted(output, torch.float32)
    return reference, converted, root / "source", output


def with_head(model: torch.nn.Module, change) -> torch.nn.Module:
    """A copy of ``model`` with its head's weight replaced by ``change(weight)``."""
    altered = copy.deepcopy(model)
    with torch.no_grad():
        altered.lm_head.weight.copy_(change(altered.lm_head.weight))
    return altered


# --- decode steps ------------------------------------------------------------------------------------------------


def test_decode_steps_are_compared_only_while_the_continuations_hold_the_same_tokens():
    """Step j's logits follow tokens 0..j: row 0 parts at token 1 and agrees again at token 2, so only its step 0
    is compared (not step 2, where the models were fed different histories); row 1 agrees throughout."""
    step_logits = torch.tensor([[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]])[:, :, None].expand(2, 3, 5)
    expected = Run(torch.zeros(0), (), [[1, 2, 3, 4], [1, 2, 3, 4]], step_logits)
    actual = Run(torch.zeros(0), (), [[1, 9, 3, 4], [1, 2, 3, 4]], step_logits + 0.5)
    theirs, ours = decode_steps_alike(expected, actual)
    assert theirs[:, 0].tolist() == [0.0, 10.0, 11.0, 12.0]
    assert ours[:, 0].tolist() == [0.5, 10.5, 11.5, 12.5]


def test_run_prompts_decodes_the_steps_asked_with_each_rows_own_history(pair):
    """``steps`` greedy tokens per row, steps - 1 decode logits, each the logits of the row's own prompt and tokens
    run whole without padding (the cache, positions and mask carried right)."""
    _, converted, _, _ = pair
    prompts = fixed_prompts(QWEN3.vocab_size)
    run = run_prompts(converted, prompts, steps=4)
    assert [len(tokens) for tokens in run.tokens] == [4] * len(prompts)
    assert tuple(run.step_logits.shape) == (len(prompts), 3, QWEN3.vocab_size)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            for step in range(3):
                ids = torch.tensor([prompt + run.tokens[row][: step + 1]])
                whole = converted(input_ids=ids).logits[0, -1]
                torch.testing.assert_close(run.step_logits[row, step], whole, atol=1e-4, rtol=1e-4)
                assert run.tokens[row][step + 1] == whole.argmax().item()


# --- compare's figures -------------------------------------------------------------------------------------------


def test_a_sound_conversions_figures(pair):
    """Every row's 8 greedy tokens alike (agreement 1.0, a share, not a count), one decode row per prompt and step
    after the first token, and the tolerances the reference's scales make them."""
    reference, converted, _, _ = pair
    prompts = fixed_prompts(QWEN3.vocab_size)
    result = compare(reference, converted, prompts)
    theirs = run_prompts(reference, prompts)
    scale = theirs.logits.abs().max().item()
    decode_scale = theirs.step_logits.abs().max().item()
    assert result.passed and result.max_abs_diff <= result.tolerance
    assert result.greedy_identical == len(prompts) and result.greedy_token_agreement == 1.0
    assert result.decode_steps == len(prompts) * (GREEDY_TOKENS - 1)
    assert result.tolerance == pytest.approx(RELATIVE * max(1.0, scale), rel=1e-6)
    assert result.decode_tolerance == pytest.approx(RELATIVE * max(1.0, scale, decode_scale), rel=1e-6)


def test_the_decode_tolerance_takes_the_decode_steps_own_scale_where_it_is_larger(pair):
    """One-token prompts: their decode steps' logits (4.2 at most) outgrow the prompts' (2.6), and the decode
    tolerance follows them."""
    reference, converted, _, _ = pair
    prompts = [[5], [1]]
    result = compare(reference, converted, prompts)
    theirs = run_prompts(reference, prompts)
    scale, decode_scale = theirs.logits.abs().max().item(), theirs.step_logits.abs().max().item()
    assert decode_scale > scale > 1
    assert result.decode_tolerance == pytest.approx(RELATIVE * decode_scale, rel=1e-6)
    assert result.passed and result.decode_steps == 2 * (GREEDY_TOKENS - 1)


def test_a_head_apart_by_five_times_the_tolerance_fails_with_its_own_figures(pair):
    """The converted head scaled by 1 + 5e-4: every logit 5e-4 of itself apart, five times float32's 1e-4 of the
    scale; the max, the mean and the top-1 agreement are the ones measured here, and every layer's output agrees."""
    reference, converted, _, _ = pair
    prompts = fixed_prompts(QWEN3.vocab_size)
    altered = with_head(converted, lambda weight: weight * (1 + 5e-4))
    result = compare(reference, altered, prompts)
    theirs, ours = run_prompts(reference, prompts), run_prompts(altered, prompts)
    diff = (theirs.logits - ours.logits).abs()
    scale = theirs.logits.abs().max().item()
    assert result.tolerance == pytest.approx(RELATIVE * max(1.0, scale), rel=1e-6)
    assert result.max_abs_diff == pytest.approx(diff.max().item(), rel=1e-4)
    assert result.max_abs_diff > 4 * result.tolerance
    assert result.mean_abs_diff == pytest.approx(diff.mean().item(), rel=1e-4)
    assert result.mean_abs_diff < result.max_abs_diff
    assert not result.passed and result.first_divergence == HEAD_AGREES


def test_top1_agreement_is_the_share_of_positions_whose_argmax_agrees(pair):
    """A head with noise on it: the top-1 agreement is the one counted here, below 1."""
    reference, converted, _, _ = pair
    prompts = fixed_prompts(QWEN3.vocab_size)
    generator = torch.Generator().manual_seed(3)
    altered = with_head(converted, lambda weight: weight + 0.3 * torch.randn(weight.shape, generator=generator))
    result = compare(reference, altered, prompts)
    theirs, ours = run_prompts(reference, prompts), run_prompts(altered, prompts)
    top1 = (theirs.logits.argmax(-1) == ours.logits.argmax(-1)).float().mean().item()
    assert top1 < 1 and result.top1_agreement == pytest.approx(top1, abs=1e-6)
    rows = zip(theirs.tokens, ours.tokens, strict=True)
    agreement = sum(a == b for ref, conv in rows for a, b in zip(ref, conv, strict=True))
    assert result.greedy_token_agreement == pytest.approx(agreement / (len(prompts) * GREEDY_TOKENS))
    assert not result.passed


def test_a_reference_computing_inf_is_named_at_its_head(pair):
    reference, converted, _, _ = pair
    broken = with_head(reference, lambda weight: torch.full_like(weight, float("inf")))
    with pytest.raises(ThinkerError) as raised:
        compare(broken, converted, fixed_prompts(QWEN3.vocab_size))
    assert "computes inf or NaN in float32 on the parity prompts (from the head on)" in str(raised.value)


def test_a_reference_overflowing_only_in_a_decode_step_is_named_so(pair, monkeypatch):
    """The prompts' logits finite, one decode step's not: the reference overflows there, which is no difference
    the conversion made (a mutation run: without the check the gate failed the conversion on its decode steps)."""
    reference, converted, _, _ = pair
    real_run = parity.reference_run

    def overflowing(model, prompts):
        run = real_run(model, prompts)
        steps = run.step_logits.clone()
        steps[0, 1, 0] = float("inf")
        return run._replace(step_logits=steps)

    monkeypatch.setattr(parity, "reference_run", overflowing)
    with pytest.raises(ThinkerError) as raised:
        compare(reference, converted, fixed_prompts(QWEN3.vocab_size))
    assert "computes inf or NaN in float32 on the parity prompts (from a decode step on)" in str(raised.value)


# --- where it diverges ---------------------------------------------------------------------------------------------


def states(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 4, generator=generator) * 0.5 for _ in range(count)]


REAL = torch.tensor([[False, True, True], [True, True, True]])  # row 0 left-padded by one


def test_first_nonfinite_names_the_hidden_state_at_real_positions_only():
    hidden = states(4)
    assert first_nonfinite(tuple(hidden), REAL) == "the head"
    hidden[1][0, 0, 2] = float("nan")  # a padding slot: nothing the gate compares
    assert first_nonfinite(tuple(hidden), REAL) == "the head"
    hidden[2][1, 2, 0] = float("inf")
    assert first_nonfinite(tuple(hidden), REAL) == "layer 1's output"
    hidden[0][0, 1, 1] = float("nan")
    assert first_nonfinite(tuple(hidden), REAL) == "the embeddings"


def test_first_divergence_names_the_first_state_apart_at_real_positions():
    """Embeddings, layer 0, layer 1 (the last: compared as is and after the final norm); a padding slot apart
    counts for nothing."""
    expected = states(4)
    identity = lambda hidden: hidden  # noqa: E731

    def named(changes: dict[tuple[int, int, int], float], final_norm=identity) -> str:
        actual = [state.clone() for state in expected]
        for (index, row, position), delta in changes.items():
            actual[index][row, position] += delta
        return first_divergence(tuple(expected), tuple(actual), REAL, torch.float32, final_norm)

    assert named({}) == HEAD_AGREES
    assert named({(1, 0, 0): 5.0}) == HEAD_AGREES  # row 0's pad
    assert named({(0, 1, 0): 1e-2}) == "embeddings"
    assert named({(1, 0, 1): 1e-2}) == "layer 0"
    assert named({(2, 1, 2): 1e-2}) == "layer 1"
    assert named({(3, 1, 2): 1e-2}) == "layer 2"
    # the converted model's last state before its final norm: the norm applied to it agrees
    assert named({(3, 1, 2): 1.0}, final_norm=lambda hidden: expected[3]) == HEAD_AGREES
    assert first_divergence(tuple(expected), tuple(expected[:3]), REAL, torch.float32, identity) == (
        "hidden-state count (4 reference, 3 converted): the layer counts differ"
    )


# --- the gate's verdict and report ---------------------------------------------------------------------------------


def altered_folder(output: Path, folder: Path, factor: float) -> Path:
    shutil.copytree(output, folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_failing_gate_writes_its_failed_path_and_names_the_first_failing_run(pair, tmp_path):
    """A head apart: the report goes to ``failed_path`` (the passing one's path untouched), the message names the
    divergence and the exact check's verdict."""
    _, _, source, output = pair
    folder = altered_folder(output, tmp_path / "altered", 1.01)
    report_path, failed_path = tmp_path / "parity.json", tmp_path / "parity.failed.json"
    with pytest.raises(ParityFailed) as raised:
        parity_gate(source, folder, None, report_path, "no match", failed_path=failed_path, weights="a tensor edited")
    assert str(raised.value) == f"no match; first divergence: {HEAD_AGREES}; a tensor edited"
    assert not report_path.exists()
    recorded = json.loads(failed_path.read_text())
    assert recorded["passed"] is False and recorded["weights"] == "a tensor edited"


# --- the memory budget ---------------------------------------------------------------------------------------------


THINKER = ThinkerConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip


def test_whole_model_bytes_counts_both_models_the_encoders_the_hidden_states_and_three_logit_blocks():
    prompts = gate_prompts(64, 64, GREEDY_TOKENS)
    slots = len(prompts) * max(map(len, prompts))
    hidden = 2 * 3 * slots * 32 * 4  # embeddings and two layers, both models, float32
    assert whole_model_bytes(1000, THINKER, reference_only=100) == 8 * 1000 + 4 * 100 + hidden + 3 * slots * 64 * 4


def test_parity_mode_takes_the_whole_model_at_exactly_its_budget_and_says_why_not():
    needed = whole_model_bytes(1000, THINKER)
    assert parity_mode(1000, THINKER, budget=needed) == (WHOLE_MODEL, "")
    mode, note = parity_mode(1000, THINKER, budget=needed - 1)
    assert mode == BY_LAYER and note.endswith("budget (as given)"), note


def test_parity_mode_names_the_share_of_memory_it_budgets(monkeypatch):
    monkeypatch.delenv(parity.MEMORY_BUDGET_ENV, raising=False)
    mode, note = parity_mode(10**15, THINKER)
    assert mode == BY_LAYER and note.endswith("budget (50% of the memory available)"), note


def test_a_mistyped_memory_setting_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv(parity.MEMORY_BUDGET_ENV, "lots")
    with pytest.raises(ThinkerError, match="^THINKER_VERIFY_MEMORY='lots': "):
        refuse_bad_memory_setting()
    monkeypatch.setenv(parity.MEMORY_BUDGET_ENV, "3MB")
    refuse_bad_memory_setting()


# --- config_compare ------------------------------------------------------------------------------------------------


def test_config_differences_names_every_model_field_and_leaves_the_runtime_switches_out():
    other = ThinkerConfig(**{**THINKER.to_dict(), "max_position_embeddings": 128, "use_cache": False})
    other.rope_parameters = {"rope_theta": 5e5, "rope_type": "default"}
    other.output_router_logits = True
    assert config_differences(THINKER, other) == [
        "max_position_embeddings (64 -> 128)",
        "rope_parameters ({'rope_theta': 10000.0, 'rope_type': 'default'} -> "
        "{'rope_theta': 500000.0, 'rope_type': 'default'})",
    ]


def test_saved_config_differences_names_the_auto_classes_and_keys_by_hand_not_how_it_was_written():
    other = ThinkerConfig(**THINKER.to_dict())
    other.architectures = ["LlamaForCausalLM"]
    other.auto_map = {"AutoModelForCausalLM": "elsewhere.Model"}
    other.by_hand = 1
    other.transformers_version, other._name_or_path, other.dtype = "0.0.1", "/somewhere", "bfloat16"
    assert saved_config_differences(THINKER, other) == [
        "architectures (None -> ['LlamaForCausalLM'])",
        "auto_map (None -> {'AutoModelForCausalLM': 'elsewhere.Model'})",
        "by_hand (None -> 1)",
    ]


# --- special_tokens ------------------------------------------------------------------------------------------------


def ids(**values) -> PretrainedConfig:
    return PretrainedConfig(**values)


def test_special_id_differences_compares_what_the_reference_names():
    assert special_id_differences(ids(eos_token_id=2), ids(eos_token_id=3), set()) == ["eos_token_id ([2] -> [3])"]
    assert special_id_differences(ids(pad_token_id=0), ids(pad_token_id=5), set()) == ["pad_token_id (0 -> 5)"]
    assert special_id_differences(ids(bos_token_id=None), ids(bos_token_id=5), set()) == []
    # the converted model drops an id: a difference where the source's files name it, else the class's default
    assert special_id_differences(ids(pad_token_id=0), ids(), {"pad_token_id"}) == ["pad_token_id (0 -> None)"]
    assert special_id_differences(ids(pad_token_id=0), ids(), set()) == []
    assert special_id_differences(None, ids(eos_token_id=3), set()) == []


def test_a_vision_language_configs_ids_come_from_its_text_config(tmp_path):
    reference = Qwen2VLConfig(text_config={"eos_token_id": 7, "bos_token_id": 6, "vocab_size": 64})
    converted = ThinkerConfig(**{**THINKER.to_dict(), "eos_token_id": 8, "bos_token_id": 6})
    assert special_id_differences(reference, converted, set()) == ["eos_token_id ([7] -> [8])"]
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7, "pad_token_id": None}}))
    assert source_named_ids(tmp_path) == {"eos_token_id"}
    assert source_named_ids(tmp_path / "model.safetensors") == {"eos_token_id"}
    (tmp_path / "config.json").write_text("not json")
    assert source_named_ids(tmp_path) == set()
