"""bench/report.py's ratio figures: the median of per-repetition ratios, its bootstrap interval, and the verdict of a
goal whose interval spans its bound. No timing is asserted; the figures are made up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import report  # noqa: E402


def test_ratio_interval_pairs_repetitions_and_brackets_the_median():
    # Repetition i of both runtimes ran side by side: a slow minute slows both, and the pairs cancel it.
    ours = [90.0, 45.0, 93.0, 60.0, 88.0]
    builder = [100.0, 50.0, 100.0, 64.0, 92.0]
    value, low, high = report.ratio_interval(ours, builder)
    assert value == pytest.approx(0.93)  # the median of 0.9, 0.9, 0.93, 0.9375, 0.9565
    assert low <= value <= high and high < 1.0  # every pair below 1: no resample reaches it
    assert report.ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == (1.0, 1.0, 1.0)
    assert report.ratio_interval([1.0], [2.0]) is None  # one pair: no interval


def test_compared_falls_back_to_the_ratio_of_medians_without_repetitions():
    ours, peer = {"decode_tokens_per_s": 9.0}, {"decode_tokens_per_s": 10.0}
    assert report.compared(ours, peer, "decode_tokens_per_s") == (0.9, 0.9, 0.9)
    assert report.ratio_cell((0.9, 0.9, 0.9)) == "0.90x"
    assert report.ratio_cell((0.93, 0.82, 1.03)) == "0.93x (0.82–1.03)"
    assert report.compared(None, peer, "decode_tokens_per_s") is None


def runtime(label: str, decode: list[float]) -> dict:
    per_repetition = [{"decode_tokens_per_s": d, "prefill_ms": 100.0, "batch_tokens_per_s": d} for d in decode]
    batch = {"decode_tokens_per_s": sorted(decode)[len(decode) // 2], "prefill_ms": 100.0, "batch_tokens_per_s": 1.0}
    return {"label": label, "batch1": {**batch, "per_repetition": per_repetition}}


def goal_rows(ours: list[float], builder: list[float]) -> list[str]:
    model = {
        "runtimes": [runtime("ours-fused on onnxruntime", ours), runtime("builder-fp32 on onnxruntime", builder)],
        "exports": {},
        "model_bytes": 1,
    }
    table = report.goals_table({"models": {"m": model}})
    return [line for line in table.splitlines() if "fp32 decode >= 1.0x builder-fp32 (onnxruntime, batch1)" in line]


def test_a_goal_is_decided_only_where_the_interval_is_on_one_side():
    (clear,) = goal_rows([80.0, 81.0, 79.0, 80.5, 80.2], [100.0, 100.5, 99.0, 100.2, 100.1])
    assert clear.endswith("| **no** |"), clear
    (noisy,) = goal_rows([95.0, 104.0, 90.0, 101.0, 97.0], [100.0, 100.0, 100.0, 100.0, 100.0])
    assert "**no** (within noise" in noisy, noisy
    (met,) = goal_rows([110.0, 111.0, 109.0, 112.0, 110.5], [100.0, 100.0, 100.0, 100.0, 100.0])
    assert met.endswith("| yes |"), met


def test_a_rotation_cycle_cancels_the_load_order():
    """bench_graph_ab: the folder loaded last runs ~5 % faster whichever it is, so per-process ratios come in two
    clusters; the geometric mean over each rotation cycle (one process in each order) recovers the true ratio."""
    import bench_graph_ab

    true, order_effect = 0.99, 1.05
    reps = []
    for rep in range(8):  # two folders: B is loaded last in even repetitions, first in odd ones
        b_last = rep % 2 == 0
        a_step = 0.030 * (1.0 if b_last else 1 / order_effect)
        b_step = 0.030 / true * (1 / order_effect if b_last else 1.0)
        reps.append({"step_s": {"A": a_step, "B": b_step}})
    per_process = [r["step_s"]["A"] / r["step_s"]["B"] for r in reps]
    assert max(per_process) / min(per_process) > 1.09  # the two clusters
    cycles = bench_graph_ab.cycle_ratios(reps, "A", "B", 2)
    assert len(cycles) == 4 and cycles == pytest.approx([true] * 4)
    value, low, high = report.median_interval(cycles)
    assert value == pytest.approx(true) and low == pytest.approx(true) and high == pytest.approx(true)
    rows = bench_graph_ab.summary(reps, ["A", "B"])
    assert rows[1]["speed_vs_first_by_cycle"][0] == pytest.approx(true, abs=1e-4)


def test_graph_ab_report_prints_without_writing(tmp_path, capsys):
    """``bench_graph_ab.py --report`` recomputes its table from the repetitions and leaves the results file as
    its run wrote it (a file from before the by-cycle column gains nothing on disk)."""
    import json

    import bench_graph_ab

    reps = [{"step_s": {"A": 0.030, "B": 0.031}}, {"step_s": {"A": 0.029, "B": 0.030}}]
    path = tmp_path / "graph_ab_old.json"
    path.write_text(json.dumps({"settings": {"folders": ["A", "B"]}, "reps": reps}))
    before = path.read_bytes()
    bench_graph_ab.report("old", results=tmp_path)
    assert path.read_bytes() == before
    assert "B" in capsys.readouterr().out


def test_bench_hybrid_keeps_the_models_a_run_did_not_measure(tmp_path):
    """``bench_hybrid.py --models moe`` replaces the MoE's entry of its results file and keeps the dense model's,
    which carries the settings of the run that measured it (older files hold them at the top level only)."""
    import json

    import bench_hybrid

    old_settings = {
        "command": "python bench/bench_hybrid.py --reps 7",
        "threads": 2,
        "prompt": 128,
        "new": 33,
        "reps": 7,
    }
    path = tmp_path / "hybrid.json"
    path.write_text(json.dumps(old_settings | {"models": [{"name": "dense", "x": 1}, {"name": "moe", "x": 2}]}))
    fresh = {"name": "moe", "x": 3, "command": "python bench/bench_hybrid.py --models moe", "reps": 3}
    merged = bench_hybrid.merged_models(path, [fresh])
    assert [model["name"] for model in merged] == ["dense", "moe"]
    assert merged[0] == old_settings | {"name": "dense", "x": 1}
    assert merged[1] == fresh
    assert bench_hybrid.merged_models(tmp_path / "none.json", [fresh]) == [fresh]


def test_pooled_top1_weighs_each_text_by_its_predictions():
    """bench_quant_texts: the pooled figure is agreement over all predictions, not the mean of the texts' figures."""
    import bench_quant_texts

    texts = {"short": {"tokens": 11, "top1_agreement": 0.5}, "long": {"tokens": 31, "top1_agreement": 0.9}}
    pooled = bench_quant_texts.pooled_top1(texts)
    assert pooled["pooled_predictions"] == 40
    assert pooled["pooled_top1_agreement"] == pytest.approx((5 + 27) / 40)  # not (0.5 + 0.9) / 2


def test_the_export_helps_fidelity_figures_are_the_benchmarks():
    """`thinker export --help` quotes SmolLM2's pooled top-1 agreement for --awq and --quantize-head; they are
    bench/results/quant_texts.json's (`python bench/bench_quant_texts.py`), rounded: a rerun that moves them fails
    here until the help says what the file says (the help said 97% at int8 where the file said 96.4%); the head's
    perplexity costs and bytes likewise, from quant_texts.json and quantize.json (`python bench/bench_quantize.py`)."""
    import json

    from export.cli import export_command

    results = json.loads((Path(report.__file__).parent / "results" / "quant_texts.json").read_text())
    pooled = {name: round(100 * graph["pooled_top1_agreement"]) for name, graph in results["graphs"].items()}
    helps = {param.name: param.help for param in export_command.params}
    assert (
        f"from {pooled['int4-rtn']}% to {pooled['int4-b32']}% at int4 in blocks of 32 ({pooled['int4']}% in the "
        f"default's blocks of 64" in helps["awq"]
    )
    assert f"from {pooled['int8-rtn']}% to {pooled['int8']}% at int8" in helps["awq"]
    assert f"({pooled['int4']}% against {pooled['int4-h4']}% for int4" in helps["quantize_head"]
    cost = {
        name: [f"+{round(100 * text['perplexity_change'])}%" for text in graph["texts"].values()]
        for name, graph in results["graphs"].items()
    }
    assert (
        f"({' and '.join(cost['int4-h8'])} on the two texts, against mixed's {' and '.join(cost['int4'])})"
        in (helps["quantize_head"])
    )
    sizes = json.loads((Path(report.__file__).parent / "results" / "quantize.json").read_text())["exports"]
    more = round(100 * (sizes["int4-h8"]["model_bytes"] / sizes["int4"]["model_bytes"] - 1))
    assert f"reads {more}% more bytes per token" in helps["quantize_head"]
    paragraph = {
        name: 100 * graph["texts"]["paragraph"]["perplexity_change"] for name, graph in results["graphs"].items()
    }
    megabytes = {name: round(export["model_bytes"] / 1e6) for name, export in sizes.items()}
    assert (
        f"(perplexity +{paragraph['int8-femb-rtn']:.1f}% against +{paragraph['int8-rtn']:.1f}%, "
        f"{megabytes['int8-femb-rtn']} against {megabytes['int8-rtn']} MB)" in helps["embedding"]
    )
