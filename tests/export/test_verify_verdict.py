"""The verdict of ``--verify`` and of a quantized export's cost, on figures worked out by hand (export/verify.py,
export/fidelity.py): what Agreement counts over the compared positions, the tolerances the passes are held to, how
``judge`` and the passes' failures read, and the fidelity figures' arithmetic. A mutation run found each of these
changed with every other test still passing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from export.fidelity import fidelity_token_ids, log_softmax, mean_kl, prefill_logits
from export.routing import ROUTER_TOLERANCE
from export.verify import (
    ADD_CHUNK,
    DECODE_STEPS,
    SENSITIVITY_CAP,
    SENSITIVITY_MARGIN,
    WIDENED_BFLOAT16,
    Agreement,
    at_last_kept,
    batch_failure,
    beyond_scale,
    deep_cache_failures,
    float_export_tolerance,
    graph_tolerance,
    held_bytes,
    indexer_failures,
    judge,
    long_prompt_failures,
    scale_tolerance,
    side_graph_failures,
)
from thinker_common.parity_inputs import PROMPT_LENGTHS


def test_agreement_counts_every_position_of_every_chunk_at_the_scale_of_the_largest_logit():
    """A prefill of more positions than ADD_CHUNK (its largest difference on the first chunk's last position) and a
    decode step: the largest difference per step, the mean over the vocabulary per position, the logit scale the
    largest |logit| (here a negative one), top-1 counted per position."""
    positions = ADD_CHUNK + 4
    reference = np.zeros((positions, 4), dtype=np.float32)
    reference[:, 0] = -50.0  # the scale: |-50|
    reference[:, 1] = 1.0  # the top-1 everywhere
    candidate = reference.copy()
    candidate[ADD_CHUNK - 1, 2] = 5.0  # the largest difference, the only top-1 that differs
    candidate[ADD_CHUNK + 1, 3] = 0.5  # the second chunk's
    agreement = Agreement()
    agreement.add(reference, candidate)
    step = np.array([[0.0, 1.0, 0.0, 0.0]] * 2, dtype=np.float32)
    agreement.add(step, step + np.array([0.0, 0.0, 0.0, 0.25], dtype=np.float32))
    figures = agreement.figures()
    assert figures["positions"] == positions + 2
    assert figures["max_abs_diff"] == 5.0
    assert figures["max_abs_diff_per_step"] == [5.0, 0.25]
    assert figures["logit_scale"] == 50.0
    assert figures["top1_agreement"] == pytest.approx((positions + 1) / (positions + 2), abs=1e-12)
    mean = (5.0 / 4 + 0.5 / 4 + 2 * 0.25 / 4) / (positions + 2)
    assert figures["mean_abs_diff"] == pytest.approx(mean, rel=1e-12)
    assert judge(figures, 4.9) == "max |Δlogit| 5 > tolerance 4.9"


def test_a_position_holding_inf_leaves_the_other_positions_figures_finite():
    """The position whose candidate holds inf is counted apart; the figures the report shows are the other
    positions' (an inf or NaN mean would hide them)."""
    reference = np.zeros((3, 4), dtype=np.float32)
    candidate = reference.copy()
    candidate[0, 0] = 0.5
    candidate[1, 2] = np.inf
    candidate[2, 3] = np.nan
    agreement = Agreement()
    agreement.add(reference, candidate)
    figures = agreement.figures()
    assert figures["nonfinite_positions"] == 2
    assert figures["max_abs_diff"] == 0.5 and figures["max_abs_diff_per_step"] == [0.5]
    assert figures["mean_abs_diff"] == pytest.approx(0.5 / 4 / 3, rel=1e-12)
    assert judge(figures, 1.0) == (
        "onnxruntime's logits hold inf or NaN at 2 of 3 positions: the graph overflows (export float32, or bfloat16 "
        "on CUDA, for a model whose activations float16 cannot hold)"
    )


def test_a_difference_at_the_tolerance_passes_and_one_beyond_it_fails():
    assert judge({"max_abs_diff": 1.0, "positions": 1}, 1.0) is None
    assert judge({"max_abs_diff": 1.0 + 1e-9, "positions": 1}, 1.0, " on X") == "max |Δlogit| 1 on X > tolerance 1"


def test_a_failure_names_the_largest_difference_it_did_not_excuse():
    """The excused position's larger difference (5, within twice its spread) is not the one the failure names."""
    reference = np.zeros((20, 4), dtype=np.float32)
    candidate = reference.copy()
    candidate[:, 0] = [5.0, 3.0, *[0.5] * 18]
    agreement = Agreement()
    agreement.add(reference, candidate, np.array([2.5, *[0.0] * 19]))
    figures = agreement.figures()
    assert figures["max_abs_diff"] == 5.0 and figures["max_abs_diff_beyond_spread"] == 3.0
    assert judge(figures, 1.0) == (
        "max |Δlogit| 3 (leaving out positions within twice the reference's own half-precision rounding) > tolerance 1"
    )


def test_routers_beyond_their_tolerance_fail_whatever_the_logits():
    figures = {"max_abs_diff": 0.0, "positions": 1, "router_max_abs_diff": ROUTER_TOLERANCE * 1.25}
    failure = judge(figures, 1.0)
    assert figures["router_tolerance"] == ROUTER_TOLERANCE
    cause = "(a router computing other logits: its weight or its layer, or its input, moved by a bug in that layer or "
    assert failure == (
        f"the graph's MoE routers' probabilities lie {ROUTER_TOLERANCE * 1.25:.3g} from the reference's > tolerance "
        f"{ROUTER_TOLERANCE:.3g} {cause}before it)"
    )
    figures |= {"router_first_layer_beyond": 2}  # the first router beyond, whose input a bug before it may move
    assert f"> tolerance {ROUTER_TOLERANCE:.3g}, first at layer 2's router {cause}" in judge(figures, 1.0)
    figures = {"max_abs_diff": 0.0, "positions": 1, "router_max_abs_diff": ROUTER_TOLERANCE}
    assert judge(figures, 1.0) is None
    # tokens whose routers the reference's own half-precision run moves as far are left out (export/routing.py)
    figures |= {"router_max_abs_diff": 0.4, "router_max_abs_diff_beyond_spread": 0.1, "routers_excused": 1}
    assert judge(figures, 1.0) is None
    figures["router_max_abs_diff_beyond_spread"] = ROUTER_TOLERANCE * 1.25
    assert judge(figures, 1.0).startswith(
        f"the graph's MoE routers' probabilities lie {ROUTER_TOLERANCE * 1.25:.3g} from the reference's (leaving out "
        f"tokens within twice the reference's own half-precision rounding) > tolerance {ROUTER_TOLERANCE:.3g} "
    )


def test_the_last_kept_position_of_a_row_that_keeps_none_is_its_last_slot():
    logits = np.arange(2 * 3, dtype=np.float32).reshape(2, 3, 1)
    mask = np.array([[0, 1, 0], [0, 0, 0]])
    assert at_last_kept(logits, mask)[:, 0].tolist() == [1.0, 5.0]


def test_the_tolerances_scale_widen_by_the_sensitivity_and_stop_at_the_cap():
    """float32 at 1e-4 x max(1, the logit scale); 8x the rounding sensitivity where larger; a float export's check
    at most 2x the scale's; bfloat16 widened to float32 at one bfloat16 ulp (2^-8)."""
    assert SENSITIVITY_MARGIN == 8.0 and SENSITIVITY_CAP == 2.0
    assert scale_tolerance({"logit_scale": 0.5}, torch.float32) == pytest.approx(1e-4, rel=1e-12)
    figures = {"logit_scale": 30.0}
    assert scale_tolerance(figures, torch.float32) == pytest.approx(3e-3, rel=1e-12)
    assert graph_tolerance(figures, torch.float32) == pytest.approx(3e-3, rel=1e-12)
    assert float_export_tolerance(figures, torch.float32) == pytest.approx(3e-3, rel=1e-12)
    sensitive = {"logit_scale": 30.0, "rounding_sensitivity": 5e-4}  # 8 x 5e-4 = 4e-3: between 1x and 2x the scale's
    assert graph_tolerance(sensitive, torch.float32) == pytest.approx(4e-3, rel=1e-12)
    assert float_export_tolerance(sensitive, torch.float32) == pytest.approx(4e-3, rel=1e-12)
    sensitive["rounding_sensitivity"] = 1e-3  # 8e-3 beyond the cap of 6e-3
    assert graph_tolerance(sensitive, torch.float32) == pytest.approx(8e-3, rel=1e-12)
    assert float_export_tolerance(sensitive, torch.float32) == pytest.approx(6e-3, rel=1e-12)
    assert scale_tolerance({"logit_scale": 2.0}, WIDENED_BFLOAT16) == 2.0**-7
    assert scale_tolerance({"logit_scale": 2.0}, torch.bfloat16) == pytest.approx(0.1, rel=1e-12)


def test_the_sensitivity_is_measured_only_for_passes_beyond_the_scales_tolerance():
    within = {"max_abs_diff": 2.9e-3, "logit_scale": 30.0}
    beyond = {"max_abs_diff": 3.1e-3, "logit_scale": 30.0}
    assert not beyond_scale(torch.float32, None, {"not_run": "why"}, within)
    assert beyond_scale(torch.float32, None, within, beyond)


def test_the_quantized_check_measures_each_sensitivity_only_where_it_can_change_the_verdict():
    """The graph check of a quantized export measures the batch's and the long prompts' rounding sensitivity (two
    reference prefills each) only where a pass judged at it parts beyond the logit scale's tolerance; a side graph
    is judged at the batch's tolerance, so beyond the batch's scale it needs the batch's measure, whatever its own."""
    from export.quantized_verify import ON_BATCH, ON_LONG_PROMPTS, sensitivities_needed

    within = {"max_abs_diff": 1e-3, "logit_scale": 30.0}  # the float32 scale's tolerance: 1e-4 x 30 = 3e-3
    beyond = {"max_abs_diff": 5e-3, "logit_scale": 30.0}
    sound = {**within, "long_prompts": within, "deep_cache": {"not_run": "no memory left"}, "padded_around": within}
    assert sensitivities_needed(sound, torch.float32) == (False, False)
    assert sensitivities_needed({**sound, **beyond}, torch.float32) == (True, False)  # the batch itself
    for key in ON_BATCH:
        assert sensitivities_needed({**sound, key: beyond}, torch.float32) == (True, False), key
    for key in ON_LONG_PROMPTS:
        assert sensitivities_needed({**sound, key: beyond}, torch.float32) == (False, True), key
    assert sensitivities_needed({**sound, "deep_cache": {"not_run": "indexed", **beyond}}, torch.float32) == (
        False,
        False,
    )
    side = {"max_abs_diff": 5e-3, "logit_scale": 80.0}  # within its own scale's 8e-3, beyond the batch's 3e-3
    for key in ("genai_graph", "embeds_graph"):
        assert sensitivities_needed({**sound, key: side}, torch.float32) == (True, False), key
        assert sensitivities_needed({**sound, key: {**side, "max_abs_diff": 2e-3}}, torch.float32) == (False, False)


@pytest.mark.parametrize("parting", ["compare_long", "padded_around_pass"])
def test_the_quantized_check_measures_the_sensitivity_of_the_prompts_a_parting_pass_ran(
    parting, thinker_variant, onnx_variant, monkeypatch
):
    """In the whole check: where only a long-prompt pass parts beyond the scale's tolerance, the long prompts' rounding
    sensitivity alone is measured and widens their passes' tolerance; where only a pass on the batch's prompts does,
    the batch's alone, for the batch's passes (a review swapped the two and every other test passed)."""
    import export.quantized_verify as quantized_verify
    from export.quantize import QuantizeSpec

    folder = thinker_variant("qwen3", head_dim=16)
    path = onnx_variant("qwen3", quantize=QuantizeSpec(bits=4, block_size=16)) / "model.onnx"
    original, measured = getattr(quantized_verify, parting), []

    def parts(*args, **kwargs):
        figures = original(*args, **kwargs)
        return figures | {"max_abs_diff": 10 * 1e-4 * max(1.0, figures["logit_scale"])}

    def sensitivity(model, ids, mask, last_only=False):
        measured.append(ids.shape[1])
        return 1.0

    monkeypatch.setattr(quantized_verify, parting, parts)
    monkeypatch.setattr(quantized_verify, "rounding_sensitivity", sensitivity)
    gate = quantized_verify.QualityGate(min_top1=0.0, max_perplexity_increase=1e9)
    graph = quantized_verify.verify_quantized_export(folder, path, torch.float32, 4, gate)["graph"]
    long_prompts = parting == "compare_long"
    assert len(measured) == 1 and (measured[0] > 20) == long_prompts, measured  # the long batch: 141 slots
    measured_on, left = ("long_prompts", "padded_around") if long_prompts else ("padded_around", "long_prompts")
    assert graph[measured_on]["rounding_sensitivity"] == 1.0 and graph[measured_on]["tolerance"] == 8.0
    assert "rounding_sensitivity" not in graph[left] and graph[left]["tolerance"] < 1.0
    assert ("rounding_sensitivity" in graph) == (not long_prompts)


def test_a_half_precision_long_pass_is_judged_unless_indexers_choose_on_it():
    """Only Qwen3.8's indexers excuse a half-precision pass on the long prompts from the verdict."""

    def result():
        figures = {"max_abs_diff": 1.0, "positions": 4, "tolerance": 0.1, "prompt_lengths": [40, 70]}
        return {"long_prompts": figures | {"decode_steps": 3}}

    plain = SimpleNamespace(has_indexed_attention=False)
    assert long_prompt_failures(result(), plain, torch.float16) == [
        "model.onnx on prompts of 40 and 70 tokens, then 3 steps: max |Δlogit| 1 > tolerance 0.1"
    ]
    indexed, held = SimpleNamespace(has_indexed_attention=True), result()
    assert long_prompt_failures(held, indexed, torch.float16) == []
    assert held["long_prompts"]["judged"] is False
    assert len(long_prompt_failures(result(), indexed, torch.float32)) == 1


def test_each_side_graph_is_held_to_its_own_tolerance():
    figures = {"max_abs_diff": 0.5, "positions": 2}
    result = {"genai_graph": dict(figures), "embeds_graph": dict(figures)}
    failures = side_graph_failures(result, {"genai_graph": 1.0, "embeds_graph": 0.1})
    assert failures == [
        "model.embeds.onnx with embed.onnx (a prompt with foreign embeddings): max |Δlogit| 0.5 > tolerance 0.1"
    ]


def test_failures_name_the_pass_that_ran():
    lengths = " and ".join(map(str, PROMPT_LENGTHS))
    assert batch_failure("X") == f"model.onnx on prompts of {lengths} tokens, then {DECODE_STEPS} steps: X"
    deep = {"max_abs_diff": 1.0, "positions": 1, "tolerance": 0.1, "cache_slots": 100, "step_positions": [100, 105]}
    assert deep_cache_failures({"deep_cache": deep}) == [
        "model.onnx after a cache of 100 slots, at positions 100 to 105: max |Δlogit| 1 > tolerance 0.1"
    ]


def test_indexer_prompts_are_judged_in_float32_only():
    def figures():
        return {"max_abs_diff": 1.0, "logit_scale": 10.0, "positions": 3}

    half = figures()
    assert indexer_failures(half, torch.float16) == [] and half["judged"] is False
    full = figures()
    assert indexer_failures(full, torch.float32) == [
        "on prompts long enough for the indexers to choose: max |Δlogit| 1 > tolerance 0.001"
    ]
    assert full["tolerance"] == pytest.approx(1e-3, rel=1e-12)


def test_a_quantized_check_holds_two_sessions_of_its_graph(thinker_variant):
    folder = thinker_variant("qwen3")
    whole, streamed, _ = held_bytes(folder, torch.float32, quantized=True, graph_bytes=10**6)
    without_graph = held_bytes(folder, torch.float32, quantized=True, graph_bytes=0)
    assert (whole - without_graph[0], streamed - without_graph[1]) == (2 * 10**6, 2 * 10**6)


def test_log_softmax_holds_large_logits():
    assert log_softmax(np.array([[1000.0, 0.0]])).tolist() == [[0.0, -1000.0]]


def test_mean_kl_is_the_reference_against_the_candidate_over_every_position():
    """KL(p || q) averaged over the positions, whatever ``rows`` splits them into."""
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    kl = float((p * np.log(p / q)).sum())
    assert kl != pytest.approx(float((q * np.log(q / p)).sum()))  # the direction shows
    reference = np.log(np.stack([p, p, q]))
    candidate = np.log(np.stack([q, p, q]))
    for rows in (1, 2, 16):
        assert mean_kl(reference, candidate, rows=rows) == pytest.approx(kl / 3, rel=1e-9), rows


def test_mean_kl_of_float32_logits_is_taken_in_float64():
    """Graphs give float32 logits; KL between two close distributions over a large vocabulary is a small difference
    of large sums, which float32 carries to 1e-3 of itself here (a mutation leaving the logits in their own type
    passed every test)."""
    rng = np.random.default_rng(0)
    reference = (rng.standard_normal((4, 49152)) * 5).astype(np.float32)
    candidate = reference + (rng.standard_normal(reference.shape) * 1e-2).astype(np.float32)
    exact = mean_kl(reference.astype(np.float64), candidate.astype(np.float64))
    assert mean_kl(reference, candidate) == pytest.approx(exact, rel=1e-9)


def test_prefill_logits_refuses_a_graph_that_gives_the_last_position_only():
    decoder = SimpleNamespace(last_logits_only=True, model_path="out/model.onnx")
    with pytest.raises(ValueError, match="gives the last position's logits only; open it with all_positions"):
        prefill_logits(decoder, np.array([1, 2]))


def test_the_fidelity_text_is_cut_to_the_context(thinker_variant):
    folder = thinker_variant("qwen3")
    ids, _ = fidelity_token_ids(folder, 10**6, 4096)
    assert len(ids) > 5
    cut, source = fidelity_token_ids(folder, 10**6, 5)
    assert cut.tolist() == ids[:5].tolist() and source == "export/fidelity.py FIDELITY_TEXT"
    assert math.isfinite(float(cut.sum()))
