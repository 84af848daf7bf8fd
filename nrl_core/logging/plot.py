"""The end-of-run picture: reward and loss against step, from metrics.jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PANELS = (("train/reward", "val/accuracy"), ("train/loss",))


def plot_metrics(jsonl: Path, png: Path, panels: Sequence[Sequence[str]] = DEFAULT_PANELS) -> Path | None:
    """Write ``png`` with one panel per group of metric names; None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    panels = [[name for name in group if any(isinstance(r.get(name), (int, float)) for r in rows)] for group in panels]
    panels = [group for group in panels if group]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3 * len(panels)), sharex=True, squeeze=False)
    for ax, group in zip(axes[:, 0], panels):
        for name in group:
            points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
        ax.legend(loc="best")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
