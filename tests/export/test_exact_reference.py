"""A float32 export's check refused on logits runs again against the reference in float64, whose verdict stands
(export/exact_reference.py): a sound export the float32 reference's own rounding refused passes, and a planted bug
fails both runs."""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from export_helpers import qa_build, scale_graph_weight

from export import verify
from export.exact_reference import FLOAT32_REFUSAL, FLOAT64_REFUSAL, REFUSED_BY_BOTH
from thinker_common.cli import main

# A QA run's build whose sound float32 export the float32 reference refused on the continuation pass (1.74e-3
# against 7.51e-4, fused; the graph lies 3.4e-4 from the model run in float64): Qwen3.5-MoE of hidden 48, five
# experts, top 1 (tests/references/hybrid.py HALF_QA_BUILDS), seed 1. (On an AVX-512 CPU; another CPU's roundings
# may land elsewhere.)
BUILD, SEED = "qwen3_5_moe-b", 1


@pytest.fixture(scope="module")
def refused_build(tmp_path_factory):
    return qa_build(tmp_path_factory.mktemp("exact"), BUILD, SEED)


@pytest.mark.parametrize("graph", ["fused", "plain"])
def test_a_sound_export_the_float32_reference_refused_passes_against_float64(refused_build, graph, tmp_path):
    """The export passes; the report and the command line say the float32 run refused it, on which pass, and that
    the figures are float64's; every pass lies within the tolerance it had."""
    output = tmp_path / "onnx"
    result = CliRunner().invoke(main, ["export", str(refused_build), str(output), "--graph", graph, "--threads", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads((output / "export_report.json").read_text())["verify"]
    assert report["passed"] and report["reference"].startswith("PyTorch ThinkerForCausalLM, float64, CPU"), report
    refusal = report[FLOAT32_REFUSAL]
    assert refusal.startswith("model.onnx on a prompt of 10 tokens continued by 70 in one step"), refusal
    assert report["continuation"]["max_abs_diff"] <= report["continuation"]["tolerance"]
    assert f"verify note: against PyTorch's float32 run, {refusal}; the figures above are against" in result.output


def test_a_bug_fails_against_float64_too(refused_build, tmp_path):
    """The last full-attention layer's output projection 1 % off, in model.onnx, then in model.genai.onnx alone:
    both runs refuse it, each failure naming the planted graph's passes alone; the float32 run's failure is the
    check's, said so, the float64 run's beside it in the report."""
    from export.exporter import export_model

    sound = tmp_path / "onnx"
    export_model(refused_build, sound, verify=False, progress=False, threads=1)
    for graph in ("model.genai.onnx", "model.onnx"):
        planted = shutil.copytree(sound, tmp_path / graph)
        scale_graph_weight(planted / graph, "model.layers.3.self_attn.o_proj.weight", 1.01)
        result = verify.verify_export(refused_build, planted / "model.onnx", torch.float32, threads=1)
        assert result["passed"] is False and FLOAT32_REFUSAL not in result, result.get("failure")
        assert result["reference"] == "PyTorch ThinkerForCausalLM, float32, CPU"
        assert result["failure"].endswith(f" ({REFUSED_BY_BOTH})"), result["failure"]
        alone, _ = verify.checked_against(
            verify.REFERENCE_DTYPE, refused_build, planted / "model.onnx", torch.float32, 1, False, verify.WHOLE, None
        )
        # the float32 run's figures, on the passes both runs refuse: the planted graph's (the float32 run also
        # refuses model.onnx's continuation, as it refuses the sound export's)
        planted_passes = [failure for failure in alone["failure"].split("; ") if failure.startswith(f"{graph} ")]
        assert result["failure"] == f"{'; '.join(planted_passes)} ({REFUSED_BY_BOTH})"
        for failure in result[FLOAT64_REFUSAL].split("; "):
            assert failure.startswith(f"{graph} "), result[FLOAT64_REFUSAL]


def test_only_a_float32_refusal_on_logits_is_judged_again(thinker_folder, tmp_path, monkeypatch):
    """A float32 check refused by what the graph ships (its RoPE tables, windows, genai_config.json), or a float16
    one, runs once: float64 cannot change either verdict."""
    from export.exporter import export_model

    references = []
    checked_against = verify.checked_against

    def counted(reference, *args):
        references.append(reference)
        return checked_against(reference, *args)

    monkeypatch.setattr(verify, "checked_against", counted)
    folder = thinker_folder("qwen3")
    for dtype in ("float32", "float16"):
        export_model(folder, tmp_path / dtype, dtype=dtype, verify=False, progress=False, threads=1)
    monkeypatch.setattr(verify, "unprompted_checks", lambda *args: ({}, ["genai_config.json: planted"]))
    result = verify.verify_export(folder, tmp_path / "float32" / "model.onnx", torch.float32, threads=1)
    assert result["failure"] == "genai_config.json: planted" and references == [torch.float32]
    assert FLOAT32_REFUSAL not in result

    scale_graph_weight(tmp_path / "float16" / "model.onnx", "model.layers.1.self_attn.o_proj.weight", 1.5)
    references.clear()
    result = verify.verify_export(folder, tmp_path / "float16" / "model.onnx", torch.float16, threads=1)
    assert result["passed"] is False and references == [torch.float32]


def test_the_second_opinion_streamed_layer_by_layer_gives_the_whole_models_figures(refused_build, tmp_path):
    """Where the check streams the PyTorch model one layer at a time (verify_plan's STREAMED), each layer is cast to
    float64 as it is read and runs: the same verdict and the same figures as the model held whole."""
    from export.exporter import export_model

    export_model(refused_build, tmp_path / "onnx", verify=False, progress=False, threads=1)
    results = {
        plan: verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, 1, plan=plan)
        for plan in (verify.WHOLE, verify.STREAMED)
    }
    whole, streamed = results[verify.WHOLE], results[verify.STREAMED]
    assert whole["passed"] and streamed["passed"] and FLOAT32_REFUSAL in streamed
    assert streamed["reference"] == whole["reference"] + ", read layer by layer as it runs"
    for key in ("continuation", "long_prompts", "deep_cache", "genai_graph_continuation"):
        assert streamed[key]["max_abs_diff"] == pytest.approx(whole[key]["max_abs_diff"], rel=1e-6), key


def test_where_the_float64_run_does_not_fit_the_float32_refusal_stands_and_says_why(
    refused_build, tmp_path, monkeypatch
):
    """The float64 run casts each layer as it runs, the largest twice its float32 bytes beside what the check holds,
    and holds the float32 run's deep-cache slots in a float64 cache: where the memory the plan leaves is smaller, it
    does not run, and the failure says why rather than the kernel killing the check."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.exporter import export_model

    export_model(refused_build, tmp_path / "onnx", verify=False, progress=False, threads=1)
    whole, _, _ = verify.held_bytes(refused_build, torch.float32)
    _, largest = verify.model_bytes(refused_build, torch.float64)
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(whole + largest // 2))
    assert verify.verify_plan(refused_build, torch.float32) == verify.WHOLE
    result = verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, threads=1)
    assert result["passed"] is False and FLOAT32_REFUSAL not in result
    assert result["reference"] == "PyTorch ThinkerForCausalLM, float32, CPU"
    assert result["failure"].endswith(
        "(not judged again against the model run in float64: its largest layer in float64, "
        f"{verify.human_size(largest, round_up=True)}, does not fit in the {verify.human_size(largest // 2)} the "
        "check leaves)"
    ), result["failure"]
    # room for the layer, not for the float32 run's deep-cache slots in a float64 cache: the two runs' deep-cache
    # passes would differ, so the float64 one does not run
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(whole + largest))
    slots = {
        dtype: verify.deep_slots(refused_build, torch.float32, verify.WHOLE, reference=dtype)
        for dtype in (torch.float32, torch.float64)
    }
    assert slots[torch.float64] < slots[torch.float32], slots
    result = verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, threads=1)
    assert result["passed"] is False and result["deep_cache"]["random_slots"] == slots[torch.float32]
    assert result["failure"].endswith(
        f"(not judged again against the model run in float64: its deep-cache pass's {slots[torch.float32]} slots in "
        f"a float64 cache do not fit in the {verify.human_size(largest)} the check leaves)"
    ), result["failure"]
    monkeypatch.delenv(MEMORY_BUDGET_ENV)
    assert verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, threads=1)["passed"]


@pytest.mark.parametrize(
    ("float64_refusals", "standing"),
    [
        (["B: w", "C: v"], "B: y"),  # the passes both refuse, at the float32 run's figures
        (["C: v"], "A: x; B: y"),  # none refused by both: every float32 refusal stands
    ],
)
def test_refused_by_both_the_float32_runs_figures_stand_on_the_passes_both_refuse(
    float64_refusals, standing, monkeypatch, tmp_path
):
    """A pass the float64 run passes lies within the tolerance of the exact model's stand-in, and is dropped from the
    failure; the passes both refuse keep the float32 run's figures (the check's; the float64 run's can be 5x them
    where the graph's own rounding parts), said so, and what the graph ships alone (its RoPE tables) stays."""
    runs = {
        verify.REFERENCE_DTYPE: ({"passed": False, "failure": "A: x; B: y; rope: z"}, ["A: x", "B: y"]),
        torch.float64: ({"passed": False, "failure": "; ".join(float64_refusals)}, float64_refusals),
    }
    monkeypatch.setattr(verify, "checked_against", lambda reference, *args, **options: runs[reference])
    monkeypatch.setattr(verify, "float64_room", lambda *args: None)
    result = verify.verify_export(tmp_path, tmp_path / "model.onnx", torch.float32)
    assert result["failure"] == f"{standing}; rope: z ({REFUSED_BY_BOTH})"
    assert result[FLOAT64_REFUSAL] == "; ".join(float64_refusals) and FLOAT32_REFUSAL not in result


def test_the_embeds_graphs_pass_runs_in_float64_too(refused_build, tmp_path):
    """model.embeds.onnx's pass gives the model float32 input embeddings, which the float64 run widens (left as they
    were, its first layer refused them: float against double, a mutation run)."""
    from export.exporter import export_model

    export_model(refused_build, tmp_path / "onnx", verify=False, progress=False, threads=1, inputs_embeds=True)
    result = verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, threads=1)
    assert result["passed"] and FLOAT32_REFUSAL in result and "embeds_graph" in result
    assert result["reference"].startswith("PyTorch ThinkerForCausalLM, float64")


def test_a_widened_bfloat16_check_refused_on_logits_runs_once(refused_build, tmp_path, monkeypatch):
    """A bfloat16 export checked widened to float32 where no CUDA runs is held to one bfloat16 ulp, not to float32's
    rounding: it is judged once."""
    from export.exporter import export_model

    references = []
    checked_against = verify.checked_against
    monkeypatch.setattr(verify, "checked_against", lambda ref, *a: references.append(ref) or checked_against(ref, *a))
    monkeypatch.setattr(verify, "padded_around_failures", lambda result: ["model.onnx planted: on logits"])
    monkeypatch.setattr(verify, "cuda_usable", lambda: False)
    export_model(refused_build, tmp_path / "bf16", dtype="bfloat16", verify=False, progress=False, threads=1)
    result = verify.verify_export(refused_build, tmp_path / "bf16" / "model.onnx", torch.bfloat16, threads=1)
    assert result["passed"] is False and references == [torch.float32] and FLOAT32_REFUSAL not in result


def test_the_float64_runs_deep_cache_is_counted_in_float64(refused_build, monkeypatch):
    """A budget holding the check's models and 300 slots of the float64 run's deep cache holds 450 of the float32
    run's, whose cache is half as wide (a float32 copy more for the layer being written, and the graph's two, are
    counted in both): ``float64_room`` then refuses the float64 run, which would need the float32 run's 450."""
    from converter.parity import MEMORY_BUDGET_ENV
    from export.deep_cache import deep_slot_bytes, slots_within

    config = verify.ThinkerConfig.from_pretrained(refused_build)
    each = deep_slot_bytes(config, torch.float32, torch.float64)
    assert slots_within(100 * each, config, torch.float32, torch.float64) == 100
    whole = verify.held_bytes(refused_build, torch.float32)[0]
    monkeypatch.setenv(MEMORY_BUDGET_ENV, str(whole + 300 * each))
    slots = {
        dtype: verify.deep_slots(refused_build, torch.float32, verify.WHOLE, reference=dtype)
        for dtype in (torch.float32, torch.float64)
    }
    assert slots == {torch.float32: 450, torch.float64: 300}
    assert verify.float64_room(refused_build, torch.float32, verify.WHOLE, 300) is None
    assert "deep-cache pass's 450 slots" in verify.float64_room(refused_build, torch.float32, verify.WHOLE, 450)


def test_the_model_stays_held_in_float32_while_it_runs_in_float64(refused_build, tmp_path, monkeypatch):
    """The float64 run casts each layer as it runs: the model as held (what verify_plan counted) stays float32."""
    from export.exporter import export_model

    held = []
    running_exactly = verify.running_exactly

    @contextlib.contextmanager
    def recorded(model):
        held.append({parameter.dtype for parameter in model.parameters()})
        with running_exactly(model):
            yield

    monkeypatch.setattr(verify, "running_exactly", recorded)
    export_model(refused_build, tmp_path / "onnx", verify=False, progress=False, threads=1)
    result = verify.verify_export(refused_build, tmp_path / "onnx" / "model.onnx", torch.float32, threads=1)
    assert FLOAT32_REFUSAL in result and held == [{torch.float32}]
