"""The README's plot: batch-1 decode tokens/s against context length, one line per runtime (from fast.json)."""

from __future__ import annotations

from pathlib import Path


def plot_decode_vs_context(results: dict, path: Path) -> bool:
    """Draws every model's sweep into ``path`` (one panel per model that has one); False when none has."""
    sweeps = {name: m["decode_vs_context"] for name, m in results["models"].items() if m.get("decode_vs_context")}
    if not sweeps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(sweeps), figsize=(7 * len(sweeps), 5), squeeze=False)
    for axis, (name, sweep) in zip(axes[0], sweeps.items(), strict=True):
        for label, points in sorted(sweep.items()):
            contexts = sorted(int(c) for c in points)
            style = "-" if label.startswith("ours") else "--"
            axis.plot(
                contexts,
                [points[c] if c in points else points[str(c)] for c in contexts],
                style,
                marker="o",
                label=label,
            )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("context length (tokens)")
        axis.set_ylabel("decode tokens/s (batch 1)")
        axis.set_title(f"{name}, {results['machine']['threads']} CPU threads")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
