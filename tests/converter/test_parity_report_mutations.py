"""What a parity report says (``converter/parity_report.py``: the table printed, ``parity.json``, the verdict, the
refusals and their advice) and the generation-config pieces of ``converter/output.py``, held to figures planted
here. Each test was written against a mutation that passed the suite before (a mutation run): the reports are built
by hand with distinct figures, so that a column, a count or a word taken from the wrong field shows."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from converter.model_card import parity_criteria
from converter.output import tokens_past_vocabulary_note
from converter.parity_report import (
    BY_LAYER,
    GREEDY_TOKENS,
    IDENTICAL,
    NO_VERIFY,
    DtypeParity,
    LayerParity,
    NoReference,
    ParityReport,
    reference_fails,
    reference_overflows,
    refuse_short_context,
    refuse_unknown_model_type,
)
from thinker import ThinkerConfig


def whole_model_row(**changes) -> DtypeParity:
    """A whole-model row whose every figure differs from the others."""
    figures = dict(
        dtype="float32",
        max_abs_diff=3e-5,
        mean_abs_diff=1e-6,
        logit_scale=10.0,
        tolerance=1e-3,
        top1_agreement=0.95,
        greedy_identical=3,
        greedy_prompts=4,
        greedy_token_agreement=0.9,
        passed=True,
        decode_max_abs_diff=2e-4,
        decode_tolerance=5e-3,
        decode_steps=20,
    )
    return DtypeParity(**(figures | changes))


def stage(name: str, max_abs_diff: float, tolerance: float, passed: bool = True) -> LayerParity:
    return LayerParity(name, max_abs_diff, max_abs_diff / 10, 1.0, tolerance, passed)


def layer_report(layers: list[LayerParity], unreached: list[LayerParity] = ()) -> ParityReport:
    row = whole_model_row(
        greedy_identical=None,
        greedy_prompts=None,
        greedy_token_agreement=None,
        decode_steps=4,
        layers=layers,
        unreached=list(unreached),
    )
    return ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [row], mode=BY_LAYER)


def line_starting(table: str, start: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(start))


# --- the table's rows ----------------------------------------------------------------------------------------------


def test_the_decode_line_gives_its_difference_then_its_tolerance_and_the_steps_taken():
    """The whole-model decode line: the difference, then the tolerance, over the steps compared out of the prompts
    × the GREEDY_TOKENS - 1 decode steps each continuation takes (the first greedy token comes from the prompt)."""
    report = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [whole_model_row()])
    line = line_starting(report.table(), "float32: decode steps:")
    assert line == (
        "float32: decode steps: max|Δlogit| 0.0002 (tolerance 0.005) over the 20 steps both models took on the same "
        f"tokens (of 4 × {GREEDY_TOKENS - 1})"
    ), line


def test_the_worst_stage_is_the_largest_against_its_own_tolerance():
    """Layer 0 has the larger difference, layer 1 the larger one against its tolerance: layer 1 is named. The count
    is of every stage compared."""
    layers = [stage("embeddings", 0.0, 1e-4), stage("layer 0", 5e-3, 1e-2), stage("layer 1", 2e-4, 1e-4, False)]
    line = line_starting(layer_report(layers).table(), "float32: 3 stages")
    assert line == (
        "float32: 3 stages compared on the reference's inputs; largest max|Δ| against its tolerance at layer 1: "
        "0.0002 (tolerance 0.0001)"
    ), line


def test_stages_within_tolerance_but_apart_are_not_called_identical():
    """'every stage identical' is for a difference of 0 everywhere, not for one within its tolerance."""
    layers = [stage("embeddings", 0.0, 1e-4), stage("layer 0", 5e-5, 1e-4)]
    table = layer_report(layers).table()
    assert "every stage identical" not in table, table
    assert (
        "float32: 2 stages compared on the reference's inputs; largest max|Δ| against its tolerance at layer 0: "
        in (table)
    ), table
    identical = layer_report([stage("embeddings", 0.0, 1e-4), stage("layer 0", 0.0, 1e-4)]).table()
    assert "float32: 2 stages compared on the reference's inputs; every stage identical (max|Δ| 0)" in identical


def test_each_figure_of_a_row_is_in_its_own_column():
    """max |Δlogit| before mean |Δlogit| and the tolerance (not the logits' scale) as the header says, top-1 as a
    percentage, the greedy continuations that agree out of those run, and a row that fails says so with its first
    divergence even where its largest difference is within the tolerance (top-1 or the decode steps fail it)."""
    row = whole_model_row(passed=False, first_divergence="the decode steps")
    table = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [row]).table()
    lines = table.splitlines()
    assert lines[:2] == [
        "parity (whole-model): ThinkerForCausalLM vs Qwen3ForCausalLM",
        "dtype     max|Δlogit| mean|Δlogit| tolerance  top-1  greedy  result",
    ], table
    assert lines[2] == (
        "float32         3e-05        1e-06     0.001  95.0%   3/4    FAIL (first divergence: the decode steps)"
    ), table


def test_the_weights_line_says_identical_too():
    """``thinker verify``'s exact check is shown whatever its result: identical weights are a finding too."""
    report = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [whole_model_row()], weights=IDENTICAL)
    assert f"weights: {IDENTICAL}" in report.table().splitlines() and report.passed
    edited = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [whole_model_row()], weights="row 3")
    assert "weights: row 3" in edited.table().splitlines() and not edited.passed


def test_layer_by_layer_runs_two_decode_steps_as_the_readme_says():
    """README: layer by layer, "2 decode steps run after the prompts"; the table and the card say so."""
    report = layer_report([stage("embeddings", 0.0, 1e-4)])  # 4 (row, step) logits compared
    line = line_starting(report.table(), "float32: decode steps:")
    assert line.endswith("over 2 rows × 2 steps after the prompts, both models fed the reference's greedy token"), line
    assert "2 decode steps, both models fed the reference's greedy token" in parity_criteria(report, "Qwen3")


def test_half_precision_needs_the_90_percent_top1_that_verify_help_states():
    """``thinker verify --help``: a half-precision folder "fails ... below 90 % top-1 agreement"; the card says the
    same floor."""
    from click.testing import CliRunner

    from converter.cli import verify_command

    assert "below 90 % top-1 agreement" in " ".join(CliRunner().invoke(verify_command, ["--help"]).output.split())
    half = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [whole_model_row(dtype="bfloat16")])
    assert "in bfloat16, max |Δlogit| ≤ 0.02 × max(1, the logit scale)" in parity_criteria(half, "Qwen3")
    assert "and top-1 agreement ≥ 90%" in parity_criteria(half, "Qwen3")


# --- what the prompts cannot reach ---------------------------------------------------------------------------------


def test_the_unreached_line_counts_the_layers_and_names_the_first_three_failing():
    """Every embedding row, the experts of 4 layers and the routers of 1, joined with a final 'and'; four stages
    fail and the first three are named."""
    unreached = [stage("every embedding row", 0.0, 1e-4)]
    unreached += [stage(f"layer {i}: every expert", 1.0, 1e-4, passed=i == 3) for i in range(4)]
    unreached += [stage("layer 0: every router row", 1.0, 1e-4, passed=False)]
    line = line_starting(layer_report([], unreached).table(), "float32: every embedding row")
    assert line == (
        "float32: every embedding row, the experts of 4 layers and the routers of 1 layers, beyond the prompts' "
        "reach, on inputs of their own: FAIL at layer 0: every expert, layer 1: every expert, layer 2: every expert"
    ), line


def test_an_unreached_stage_that_fails_fails_the_line():
    line = line_starting(
        layer_report([], [stage("every embedding row", 1.0, 1e-4, passed=False)]).table(), "float32: every"
    )
    assert line == (
        "float32: every embedding row, beyond the prompts' reach, on inputs of their own: FAIL at every embedding row"
    ), line


# --- parity.json ---------------------------------------------------------------------------------------------------


def test_a_layer_by_layer_report_records_no_greedy_tokens():
    """Layer by layer runs no continuation: parity.json says none (whole-model: GREEDY_TOKENS)."""
    assert json.loads(layer_report([stage("embeddings", 0.0, 1e-4)]).to_json())["greedy_tokens"] is None
    whole = ParityReport("Qwen3ForCausalLM", "ThinkerForCausalLM", [[1, 2]], [whole_model_row()])
    assert json.loads(whole.to_json())["greedy_tokens"] == GREEDY_TOKENS


# --- refusals and their advice -------------------------------------------------------------------------------------


def test_a_context_of_exactly_the_greedy_tokens_is_checked_and_one_fewer_refused():
    refuse_short_context(GREEDY_TOKENS)  # a one-id prompt and its greedy tokens fit exactly
    refuse_short_context(None)
    with pytest.raises(NoReference) as raised:
        refuse_short_context(GREEDY_TOKENS - 1)
    assert str(raised.value) == (
        f"a context of {GREEDY_TOKENS - 1} positions (max_position_embeddings) cannot hold the parity check's prompt "
        f"and its {GREEDY_TOKENS} greedy tokens, so there is nothing to verify it on; {NO_VERIFY}"
    )


@pytest.mark.parametrize(
    ("dtype", "advice"),
    [
        (torch.float16, "the model overflows float16; convert with --dtype bfloat16 or float32"),
        (torch.bfloat16, "the model overflows bfloat16; convert with --dtype bfloat16 or float32"),
        (torch.float32, "the model overflows float32; the checkpoint's weights are broken: get it again"),
    ],
)
def test_an_overflowing_reference_is_advised_by_its_dtype(dtype, advice):
    """Half precision overflowing: a wider dtype; float32 overflowing: no wider dtype helps, the weights are broken."""
    message = str(reference_overflows("Qwen3ForCausalLM", dtype, "layer 0"))
    assert message.endswith(advice), message
    assert message.startswith("transformers' own Qwen3ForCausalLM computes inf or NaN in ")


def test_a_failing_reference_is_said_on_one_line_of_bounded_length():
    """transformers' error, however many lines, is one line in the refusal, cut at 300 characters."""
    err = RuntimeError("The size of tensor a (4)\n  must match\tthe size of tensor b (8)" + " x" * 400)
    message = str(reference_fails("Qwen3ForCausalLM", err))
    assert "\n" not in message and "\t" not in message
    assert "(RuntimeError: The size of tensor a (4) must match the size of tensor b (8) x x" in message
    reason = message.split("(RuntimeError: ", 1)[1].split("), so there is no reference", 1)[0]
    assert len(reason) == 300, len(reason)


def test_instead_replaces_the_conversions_advice():
    """``thinker verify``'s words where there is no reference: the folder stays unverified, not 'convert'."""
    err = reference_fails("Qwen3ForCausalLM", RuntimeError("boom")).instead("leave out unverified")
    assert NO_VERIFY not in str(err) and str(err).endswith("leave out unverified if the model is meant as it is")


def test_a_config_that_is_not_an_object_is_left_to_transformers(tmp_path):
    """A config.json holding a list, unreadable or not JSON: left to transformers' own message, no traceback here."""
    for text in ("[1, 2]", "{not json", '"qwen3"'):
        (tmp_path / "config.json").write_text(text)
        assert refuse_unknown_model_type(tmp_path / "config.json") is None, text
    refuse_unknown_model_type(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text('{"model_type": "evil"}')
    with pytest.raises(NoReference, match="model_type 'evil' is not one transformers knows"):
        refuse_unknown_model_type(tmp_path / "config.json")


# --- converter/output.py: the generation config ------------------------------------------------------------------


def test_a_negative_stop_id_is_outside_the_vocabulary():
    note = tokens_past_vocabulary_note(GenerationConfig(eos_token_id=[-1, 2]), ThinkerConfig(vocab_size=64))
    assert note is not None and note.startswith("the source's eos_token_id -1 is outside its vocabulary of 64 ids")


def test_several_stop_ids_outside_the_vocabulary_are_listed_as_several():
    note = tokens_past_vocabulary_note(GenerationConfig(eos_token_id=[2, 64, 65]), ThinkerConfig(vocab_size=64))
    assert note is not None and note.startswith(
        "the source's eos_token_id [64, 65] are outside its vocabulary of 64 ids, where the model never produces them "
    ), note
