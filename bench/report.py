"""Markdown tables from bench_fast.py's results (printed, and pasted into README via README-figures.md)."""

from __future__ import annotations

import statistics

import numpy as np

GIB = 2**30
CONFIDENCE = 0.9  # of the ratio intervals
RESAMPLES = 4000


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def ratio(value: float | None, reference: float | None) -> str:
    return "—" if value is None or not reference else f"{value / reference:.2f}x"


def ratio_interval(values: list[float], references: list[float]) -> tuple[float, float, float] | None:
    """The median of the per-repetition ratios values[i] / references[i] and a bootstrap percentile interval of that
    median (CONFIDENCE). Repetition i of both runtimes ran side by side, each in its own fresh process, so a ratio
    pairs two draws of the same minutes: what a process happens to get (memory placement, which core, a
    neighbour's load) moves single figures by 5-15 % here, and the interval says how far the median can be trusted.
    None without at least two pairs."""
    return median_interval([v / r for v, r in zip(values, references, strict=False) if v and r])


def median_interval(values: list[float]) -> tuple[float, float, float] | None:
    """The median of ``values`` and a bootstrap percentile interval of it (CONFIDENCE); None for fewer than two."""
    if len(values) < 2:
        return None
    draws = np.random.default_rng(0).choice(values, size=(RESAMPLES, len(values)))
    low, high = np.quantile(np.median(draws, axis=1), [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return statistics.median(values), float(low), float(high)


def compared(ours: dict | None, peer: dict | None, key: str) -> tuple[float, float, float] | None:
    """``key``'s ratio of two summaries (bench/workers.py ``summary``): from their repetitions where both have them,
    else the ratio of the medians with no interval (results written before repetitions were kept)."""
    if not ours or not peer or not peer.get(key):
        return None
    reps, peer_reps = ours.get("per_repetition"), peer.get("per_repetition")
    if reps and peer_reps and (interval := ratio_interval([r[key] for r in reps], [r[key] for r in peer_reps])):
        return interval
    value = ours[key] / peer[key]
    return value, value, value


def ratio_cell(figures: tuple[float, float, float] | None) -> str:
    if figures is None:
        return "—"
    value, low, high = figures
    return f"{value:.2f}x" if low == high else f"{value:.2f}x ({low:.2f}–{high:.2f})"


def speed_table(model: dict) -> str:
    """One row per runtime: batch 1 and batch 8 prefill and decode, against the builder's graph of the same
    precision in the same runtime, and batch 1 decode as a share of the memory-bandwidth limit."""
    rows = []
    rows_by_label = {r["label"]: r for r in model["runtimes"]}
    for runtime in model["runtimes"]:
        peer = rows_by_label.get(runtime.get("builder_peer") or "")
        one, eight = runtime.get("batch1"), runtime.get("batch8")
        peer_one, peer_eight = (peer or {}).get("batch1") or {}, (peer or {}).get("batch8") or {}
        rows.append(
            [
                runtime["label"],
                fmt(one and one["prefill_ms"], 0),
                ratio_cell(compared(one, peer_one, "prefill_ms")),
                fmt(one and one["decode_tokens_per_s"]),
                ratio_cell(compared(one, peer_one, "decode_tokens_per_s")),
                fmt(runtime.get("fraction_of_limit") and 100 * runtime["fraction_of_limit"], 0, " %"),
                fmt(eight and eight["prefill_ms"], 0),
                ratio_cell(compared(eight, peer_eight, "prefill_ms")),
                fmt(eight and eight["batch_tokens_per_s"]),
                ratio_cell(compared(eight, peer_eight, "batch_tokens_per_s")),
                runtime.get("greedy_check", "—"),
            ]
        )
    header = [
        "runtime",
        "prefill b1 (ms)",
        "vs builder",
        "decode b1 (tok/s)",
        "vs builder",
        "of BW limit",
        "prefill b8 (ms)",
        "vs builder",
        "decode b8 (tok/s, all rows)",
        "vs builder",
        "greedy = ours-fused",
    ]
    return table(header, rows)


def limit_table(results: dict) -> str:
    rows = []
    bandwidth = results["bandwidth"]["bytes_per_s"]
    for name, model in results["models"].items():
        for graph, size in sorted(model["bytes_per_token"].items()):
            rows.append([name, graph, f"{size / GIB:.3f}", f"{bandwidth / size:.1f}"])
    header = ["model", "graph", "weights read per token (GiB)", "limit (tok/s)"]
    return (
        f"Read bandwidth: {bandwidth / 1e9:.1f} GB/s (numpy streaming read, best of kernels and threads)\n\n"
        + table(header, rows)
    )


def export_table(model: dict) -> str:
    rows = []
    exports = model["exports"]
    model_bytes = model["model_bytes"]
    peers = {"ours-plain": "builder-fp32", "ours-fused": "builder-fp32", "ours-int4": "builder-int4"}
    for name, figures in exports.items():
        if figures.get("error"):
            rows.append([name, "failed: " + figures["error"][:80], "", "", "", ""])
            continue
        peer = exports.get(peers.get(name, ""), {})
        rows.append(
            [
                name,
                fmt(figures["seconds"]),
                ratio(figures["seconds"], peer.get("seconds")),
                fmt(figures["peak_rss"] and figures["peak_rss"] / GIB, 2),
                fmt(figures["peak_rss"] and figures["peak_rss"] / model_bytes, 2, "x"),
                ratio(figures["peak_rss"], peer.get("peak_rss")),
            ]
        )
    header = ["export", "wall (s)", "vs builder", "peak RSS (GiB)", "RSS / float32 model bytes", "vs builder"]
    return table(header, rows)


def fidelity_table(fidelity: dict) -> str:
    rows = [
        [
            name,
            f"{100 * f['top1_agreement']:.1f} %",
            f"{f['perplexity']:.2f}",
            f"{100 * f['perplexity_change']:+.1f} %",
        ]
        for name, f in fidelity["graphs"].items()
    ]
    intro = (
        f"{fidelity['tokens']} tokens of English (export/fidelity.py), teacher-forced; reference: our fused float32 "
        f"graph, perplexity {fidelity['perplexity_reference']:.2f}.\n\n"
    )
    return intro + table(["graph", "top-1 agreement", "perplexity", "change"], rows)


def goals_table(results: dict) -> str:
    """The issue's goals, each checked against this run's figures (ratios within one run)."""
    rows = []

    def runtime(model: dict, label: str) -> dict:
        return next((r for r in model["runtimes"] if r["label"] == label), {})

    def check(
        goal: str, model_name: str, value: float | None, bound: float, above: bool, shown: str, interval=None
    ) -> None:
        """``interval`` (low, high): the goal is decided only where the whole interval is on one side of the bound."""
        if value is None:
            rows.append([goal, model_name, "—", "**no**"])
            return

        def meets(x: float) -> bool:
            return x >= bound if above else x <= bound

        verdict = "yes" if meets(value) else "**no**"
        if interval and meets(interval[0]) != meets(interval[1]):
            verdict += " (within noise: the interval spans the goal)"
        rows.append([goal, model_name, shown, verdict])

    for name, model in results["models"].items():
        for runtime_name in ("onnxruntime", "onnxruntime-genai"):
            for batch in ("batch1", "batch8"):
                # (what is compared, ours, the builder's graph, the measure, the goal's direction: True = at least)
                for what, ours_graph, peer_graph, key, above in (
                    ("fp32 decode", "ours-fused", "builder-fp32", "decode_tokens_per_s", True),
                    ("fp32 prefill", "ours-fused", "builder-fp32", "prefill_ms", False),
                    ("int4 decode", "ours-int4", "builder-int4", "decode_tokens_per_s", True),
                ):
                    ours = runtime(model, f"{ours_graph} on {runtime_name}").get(batch)
                    peer = runtime(model, f"{peer_graph} on {runtime_name}").get(batch)
                    if figures := compared(ours, peer, key):
                        goal = f"{what} {'>=' if above else '<='} 1.0x {peer_graph} ({runtime_name}, {batch})"
                        check(goal, name, figures[0], 1.0, above, ratio_cell(figures), figures[1:])
            fraction = runtime(model, f"ours-fused on {runtime_name}").get("fraction_of_limit")
            check(
                f"fp32 decode >= 90 % of the bandwidth limit ({runtime_name}, batch1)",
                name,
                fraction,
                0.9,
                True,
                f"{100 * (fraction or 0):.0f} %",
            )
        fidelity = (model.get("fidelity") or {}).get("graphs", {})
        if "ours-int4" in fidelity and "builder-int4" in fidelity:
            ours, peer = fidelity["ours-int4"]["top1_agreement"], fidelity["builder-int4"]["top1_agreement"]
            check(
                "int4 top-1 agreement >= builder int4's + 10 points",
                name,
                ours - peer,
                0.1,
                True,
                f"{100 * ours:.1f} % vs {100 * peer:.1f} %",
            )
        exports = model["exports"]
        for ours_name, peer_name in (("ours-fused", "builder-fp32"), ("ours-int4", "builder-int4")):
            ours, peer = exports.get(ours_name, {}), exports.get(peer_name, {})
            if ours.get("seconds") and peer.get("seconds"):
                wall = ours["seconds"] / peer["seconds"]
                check(f"export wall <= 2x builder ({ours_name})", name, wall, 2.0, False, f"{wall:.2f}x")
            if ours.get("peak_rss"):
                rss = ours["peak_rss"] / model["model_bytes"]
                check(f"export peak RSS <= 1.6x model bytes ({ours_name})", name, rss, 1.6, False, f"{rss:.2f}x")
    rows.append(["GPU float16: >= 1.0x builder CUDA, >= 3x eager", "—", "not measured (no GPU lent)", "**no**"])
    return table(["goal", "model", "measured", "met"], rows)
