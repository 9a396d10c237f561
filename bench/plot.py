"""The README's plot: batch-1 decode tokens/s against context length, one line per runtime (from fast.json).

One panel per precision (float32, int4) and model; colour says whose graph, line style which runtime runs it.
"""

from __future__ import annotations

from pathlib import Path

COLOURS = {
    "ours-fused": "tab:blue",
    "ours-plain": "tab:cyan",
    "ours-int4": "tab:blue",
    "ours-int4-h8": "tab:purple",
    "ours-int4-h4": "tab:cyan",
    "builder-fp32": "tab:red",
    "builder-int4": "tab:red",
    "optimum-fp32": "tab:green",
    "hf": "tab:gray",
}
STYLES = {"onnxruntime": "-", "onnxruntime-genai": "--"}


def panels(results: dict) -> list[tuple[str, dict]]:
    """(title, {label: {context: tokens/s}}) per model and precision that has a sweep."""
    out = []
    for name, model in results["models"].items():
        sweep = model.get("decode_vs_context") or {}
        for precision, test in (("float32", lambda g: "int" not in g), ("int4", lambda g: "int4" in g)):
            lines = {label: points for label, points in sweep.items() if test(label.split(" on ")[0])}
            if lines:
                out.append((f"{name}, {precision}", lines))
    return out


def plot_decode_vs_context(results: dict, path: Path) -> bool:
    """Draws the sweeps into ``path``; False when there is none."""
    found = panels(results)
    if not found:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(found), figsize=(6 * len(found), 4.5), squeeze=False)
    for axis, (title, lines) in zip(axes[0], found, strict=True):
        for label, points in sorted(lines.items()):
            graph, _, runtime = label.partition(" on ")
            contexts = sorted(int(c) for c in points)
            speeds = [points.get(c, points.get(str(c))) for c in contexts]
            colour = COLOURS.get(graph, "tab:gray")
            style = STYLES.get(runtime, ":")
            axis.plot(contexts, speeds, style, color=colour, marker="o", markersize=3, label=label)
        axis.set_xscale("log", base=2)
        axis.set_ylim(bottom=0)
        axis.set_xlabel("context length (tokens)")
        axis.set_ylabel("decode tokens/s, batch 1")
        axis.set_title(f"{title}, {results['machine']['threads']} CPU threads")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
