"""Accuracy-per-round figure of the report (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from medpfl.io import atomic_path  # noqa: E402
from medpfl.report.tables import Run, groups  # noqa: E402

#: (column of round_metrics.csv, subplot title, y label)
PANELS = (
    ("global_test_acc", "Global model on global test set", "accuracy"),
    ("local_bal_acc_mean", "Sampled clients after local training (balanced acc)", "balanced accuracy"),
    ("deployed_acc_mean", "Deployed model, all clients' local tests (mean)", "accuracy"),
)


def seed_curve(runs: list[Run], column: str) -> pd.DataFrame:
    """Per round: mean, min, max and count over seeds of ``column``, NaN rows dropped first.

    Dropping NaN rows before aggregating makes runs evaluated every N rounds draw a line
    through their evaluated rounds. Empty frame when the column is all NaN in every run.
    """
    parts = [r.rounds[["round", column]].dropna() for r in runs if column in r.rounds]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["mean", "min", "max", "count"])
    df = pd.concat(parts, ignore_index=True)
    return df.groupby("round")[column].agg(["mean", "min", "max", "count"]).sort_index()


def plot_curves(runs: list[Run], path: str | Path, dpi: int = 120) -> Path:
    """Write ``curves.png`` atomically: one row per (dataset, partition), one column per panel.

    Each method is a line of the mean over seeds with a shaded min–max band when it has more
    than one seed; a method whose column is all NaN (e.g. ``local`` on the global panel) is
    skipped. Colours follow the order in which methods first appear, the same in every panel.
    """
    path = Path(path)
    grouped = groups(runs)
    order: list[str] = []
    for methods in grouped.values():
        order += [m for m in methods if m not in order]
    cmap = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
    color = {m: cmap(i % cmap.N) for i, m in enumerate(order)}

    nrows = len(grouped)
    fig, axes = plt.subplots(nrows, len(PANELS), figsize=(6.5 * len(PANELS), 3.8 * nrows), squeeze=False)
    try:
        for row, ((ds, part), methods) in enumerate(grouped.items()):
            for col, (column, panel_title, ylabel) in enumerate(PANELS):
                ax = axes[row][col]
                drawn = 0
                for method, rs in methods.items():
                    c = seed_curve(rs, column)
                    if c.empty:
                        continue
                    x = c.index.to_numpy(dtype=float)
                    ax.plot(x, c["mean"].to_numpy(), color=color[method], lw=1.5,
                            marker="o" if len(x) == 1 else None, ms=4, label=f"{method} (n={len(rs)})")
                    if len(rs) > 1:
                        ax.fill_between(x, c["min"].to_numpy(), c["max"].to_numpy(), color=color[method],
                                        alpha=0.2, lw=0)
                    drawn += 1
                ax.set_title(f"{ds} / {part}: {panel_title}", fontsize=10)
                ax.set_xlabel("round")
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.set_ylabel(ylabel)
                ax.set_ylim(0.0, 1.0)
                ax.grid(True, alpha=0.3)
                if drawn:
                    ax.legend(fontsize=8, loc="lower right")
                else:
                    ax.text(0.5, 0.5, "not applicable / no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        fig.suptitle("Accuracy per round (line: mean over seeds; band: min–max over seeds)", fontsize=11)
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return path
