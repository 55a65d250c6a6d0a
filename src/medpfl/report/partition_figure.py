"""The label distribution of a partition as a heat map (clients x classes)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from medpfl.io import atomic_path  # noqa: E402


def partition_heatmap(counts: dict, num_classes: int, out: Path, title: str = "") -> None:
    """Write a PNG heat map of samples per (client, class), local train + test, annotated.

    counts: ``{client_id: {"train": [C], "test": [C]}}`` (:func:`client_class_counts`).
    """
    clients = sorted(counts, key=int)
    mat = np.array([np.add(counts[c]["train"], counts[c]["test"]) for c in clients])
    k = len(clients)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * num_classes + 2.5), max(3.0, 0.28 * k + 1.5)))
    im = ax.imshow(mat, aspect="auto", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_xticks(range(num_classes))
    if k <= 60:
        ax.set_yticks(range(k))
        ax.set_yticklabels([str(c) for c in clients], fontsize=7)
        if k * num_classes <= 800:
            thr = mat.max() / 2 if mat.size else 0
            for i in range(k):
                for j in range(num_classes):
                    if mat[i, j]:
                        ax.text(j, i, str(mat[i, j]), ha="center", va="center", fontsize=6,
                                color="black" if mat[i, j] > thr else "white")
    ax.set_title(title or "samples per class and client", fontsize=9)
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
