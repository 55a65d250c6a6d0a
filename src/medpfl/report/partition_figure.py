"""The label distribution of a partition as a heat map (clients x classes), with class names.

The figure is drawn from the partition's ``client_stats.json`` by its own Snakemake rule
(``partition_figure``) into ``data/figures/``, outside the DVC-versioned data: a PNG's pixels
depend on the font rasteriser and the PNG encoder of the machine, which the training data must
not. It is still written as reproducibly as matplotlib allows: matplotlib's built-in default
style (so a user's ``matplotlibrc`` or style changes nothing), its bundled DejaVu Sans font, and
no ``Software`` (matplotlib version) entry in the PNG; on one machine and installation the
bytes are the same at every run and in every folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from medpfl.io import atomic_path  # noqa: E402

# On top of matplotlib's own defaults (style "default", which ignores any matplotlibrc).
FIGURE_RC = {"font.family": "DejaVu Sans", "svg.hashsalt": "medpfl", "figure.dpi": 100}
# No "Software: Matplotlib version ..." text chunk: the bytes must not change with matplotlib's
# patch version.
PNG_METADATA = {"Software": None}
MAX_NAME = 24  # longer class names are cut on the axis (client_stats.json keeps them whole)


def class_tick_labels(num_classes: int, class_names: Sequence[str] | None = None) -> list[str]:
    """Axis labels of the classes: ``"<index> <name>"`` (a name over :data:`MAX_NAME` characters
    loses its parenthesis, then is cut with an ellipsis), or the bare index where the data set names no classes or a name is
    the index itself (MNIST's digits)."""
    if class_names is None:
        return [str(c) for c in range(num_classes)]
    if len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
    out = []
    for c, name in enumerate(class_names):
        name = " ".join(str(name).split())
        if name == str(c) or not name:
            out.append(str(c))
            continue
        if len(name) > MAX_NAME and "(" in name:  # "immature granulocytes(myelocytes, ...)"
            name = name.split("(")[0].strip() or name
        if len(name) > MAX_NAME:
            name = name[: MAX_NAME - 1].rstrip() + "\u2026"
        out.append(f"{c} {name}")
    return out


def describe_partition(config: dict) -> str:
    """The partition scheme in words, from ``client_stats.json``'s ``config``: ``"Dirichlet label
    skew, α = 0.1"``, ``"IID"``, ``"pathological, 2 classes per client"``, ``"shards, 2 per
    client"``; another scheme by its name, with its α where it has one."""
    scheme = config.get("scheme", "dirichlet")
    alpha = config.get("alpha")
    if scheme == "dirichlet":
        return f"Dirichlet label skew, α = {alpha:g}"
    if scheme == "iid":
        return "IID"
    if scheme == "pathological" and config.get("classes_per_client"):
        return f"pathological, {config['classes_per_client']} classes per client"
    if scheme == "shards" and config.get("shards_per_client"):
        return f"shards, {config['shards_per_client']} per client"
    words = scheme.replace("_", " ")
    return f"{words}, α = {alpha:g}" if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else words


def client_totals(counts: dict) -> dict[str, int]:
    """Samples per client over every local split (train + test, + val), by client id as in ``counts``."""
    return {c: int(sum(int(np.sum(counts[c][s])) for s in ("train", "test", "val") if s in counts[c]))
            for c in sorted(counts, key=int)}


def partition_title(stats: dict) -> str:
    """The heat map's title from a partition's ``client_stats.json``: data set / partition, the
    scheme in words (:func:`describe_partition`, e.g. "Dirichlet label skew, α = 0.1"), the number
    of clients and their samples in all, least and most."""
    totals = list(client_totals(stats["clients"]).values())
    head = f"{stats['dataset']} / {stats['partition']}"
    scheme = describe_partition(stats.get("config") or {})
    spread = (f"{len(totals)} clients, {sum(totals):,} samples ({min(totals):,}–{max(totals):,} per client)"
              if totals else "no clients")
    return f"{head}: {scheme}\n{spread}\nsamples per class and client (local train + test)"


def heatmap_figure(counts: dict, num_classes: int, class_names: Sequence[str] | None = None, title: str = ""):
    """The heat map as a matplotlib Figure (see :func:`partition_heatmap`); the caller closes it.
    Call it inside :func:`figure_style` for the reproducible look. Up to 60 clients, each row is
    labelled "<client id> (<its samples in all>)"."""
    clients = sorted(counts, key=int)
    # every local split of the client: train + test (+ val, with the ratios rule)
    mat = np.array([np.sum([counts[c][s] for s in ("train", "test", "val") if s in counts[c]], axis=0)
                    for c in clients]).astype(int).reshape(len(clients), num_classes)
    k = len(clients)
    labels = class_tick_labels(num_classes, class_names)
    named = any(not lab.isdigit() for lab in labels)
    longest = max((len(lab) for lab in labels), default=1)
    # room below the axis for rotated names (about 0.065 inch per character at 7 pt)
    extra_h = 0.065 * longest * 0.75 if named else 0.0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * num_classes + 2.5), max(3.0, 0.28 * k + 1.5) + extra_h))
    im = ax.imshow(mat, aspect="auto", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_xticks(range(num_classes))
    if named:
        ax.set_xticklabels(labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
    else:
        ax.set_xticklabels(labels)
    totals = mat.sum(axis=1)
    if k <= 60:  # each client's total beside its id
        ax.set_yticks(range(k))
        ax.set_yticklabels([f"{c} ({t:,})" for c, t in zip(clients, totals)], fontsize=7)
        ax.set_ylabel("client (samples in all)")
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
    return fig


def figure_style():
    """Matplotlib's built-in default style plus :data:`FIGURE_RC`, as a context manager."""
    return plt.style.context(["default", FIGURE_RC])


def partition_heatmap(counts: dict, num_classes: int, out: Path, title: str = "",
                      class_names: Sequence[str] | None = None) -> None:
    """Write a PNG heat map of samples per (client, class), local train + test (+ val), annotated.

    counts: ``{client_id: {"train": [C], "test": [C]}}``, plus ``"val": [C]`` where the
    partition has local val splits (:func:`client_class_counts`; keys
    may be strings, as read back from ``client_stats.json``). class_names: the label names by
    class index (``client_stats.json``'s ``class_names``); None labels the classes by index.
    """
    with figure_style():
        fig = heatmap_figure(counts, num_classes, class_names, title)
        try:
            with atomic_path(out) as tmp:
                fig.savefig(tmp, dpi=110, metadata=PNG_METADATA)
        finally:
            plt.close(fig)
