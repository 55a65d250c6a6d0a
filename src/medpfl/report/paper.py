"""Side by side with a paper's table: our value, the paper's, the difference and both rankings.

A paper table is a YAML file (``config/papers/*.yaml``) holding the paper's numbers as data with
their source::

    title: ...            source: ...
    how_ours: ...         # optional: how our number is computed (the caption says it)
    percent: true         # optional: show values x 100 (the paper prints percentages)
    metrics:  {<summary key>: {label: ..., higher_is_better: true}, ...}
    blocks:   {<name>: [<method>, ...], ...}    # optional: rank within each block
    values:   {<dataset> or <dataset>/<partition>: {<method>: {<summary key>: [value, ±], ...}, ...}, ...}

A study names it in ``report.paper_table``. For every (dataset, partition) group of the study
that the paper reports (a ``<dataset>/<partition>`` key, else the ``<dataset>`` key: a paper
table whose columns are our partitions names them), and every method both have, the comparison
gives per metric: ours (the mean over seeds, as the study's Table 1, with its 95 % t confidence
interval over seeds where the caller gives one), the paper's value and its ±, ours − paper, our
rank and the paper's rank among the methods compared (1 = best), and per
metric the Spearman rank correlation of the two orderings (``scipy.stats.spearmanr``; needs 3 or
more methods). With ``blocks`` (e.g. one block of rows per model, as a paper that compares
methods per model), ranks and correlations are computed within each block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from scipy import stats

from medpfl.report.stats import CI_LEVEL, NO_INTERVAL

NULL = "—"


@dataclass
class PaperTable:
    """A paper's table: ``values[dataset][method][metric] = (value, pm or None)``."""

    title: str
    source: str
    metrics: dict[str, dict[str, Any]]
    values: dict[str, dict[str, dict[str, tuple[float, float | None]]]]
    path: Path
    how_ours: str = ""
    blocks: dict[str, list[str]] | None = None
    percent: bool = False

    def group_values(self, dataset: str, partition: str) -> dict[str, dict[str, tuple[float, float | None]]] | None:
        """The paper's values for one of our (dataset, partition) groups, or None."""
        return self.values.get(f"{dataset}/{partition}", self.values.get(dataset))

    def block_of(self, method: str) -> str:
        """The block a method is ranked in ("" without blocks or for a method in none)."""
        for name, ms in (self.blocks or {}).items():
            if method in ms:
                return name
        return ""


def load_paper_table(path: str | Path) -> PaperTable:
    """Read and check a paper table file. Raises ValueError naming the file (and
    ``report.paper_table``) when it is missing or malformed."""
    path = Path(path)
    where = f"report.paper_table: {path}"
    if not path.is_file():
        raise ValueError(f"{where}: file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or not {"title", "source", "metrics", "values"} <= set(data):
        raise ValueError(f"{where}: needs the keys title, source, metrics and values")
    metrics = data["metrics"]
    values: dict = {}
    for ds, methods in data["values"].items():
        for method, cells in methods.items():
            for metric, cell in cells.items():
                if metric not in metrics:
                    raise ValueError(f"{where}: values.{ds}.{method}.{metric}: not declared under metrics")
                if not (isinstance(cell, list) and len(cell) == 2 and isinstance(cell[0], (int, float))):
                    raise ValueError(f"{where}: values.{ds}.{method}.{metric}: expected [value, ± or null], got {cell!r}")
                values.setdefault(ds, {}).setdefault(method, {})[metric] = (float(cell[0]),
                                                                             None if cell[1] is None else float(cell[1]))
    blocks = data.get("blocks")
    if blocks is not None and not (isinstance(blocks, dict) and all(isinstance(v, list) for v in blocks.values())):
        raise ValueError(f"{where}: blocks: expected a mapping of block name to a list of methods")
    return PaperTable(str(data["title"]), str(data["source"]), metrics, values, path,
                      str(data.get("how_ours") or ""), blocks, bool(data.get("percent", False)))


def _rank(values: dict[str, float], higher_is_better: bool) -> dict[str, int]:
    """Competition ranks (1 = best; ties share the better rank) of the non-missing values."""
    ok = {k: v for k, v in values.items() if v is not None and math.isfinite(v)}
    sign = -1.0 if higher_is_better else 1.0
    order = sorted(ok.values(), key=lambda v: sign * v)
    return {k: 1 + order.index(v) for k, v in ok.items()}


def compare(ours: dict[str, dict[str, dict[str, float | None]]], paper: PaperTable) -> pd.DataFrame:
    """The long comparison table.

    ours: ``{dataset/partition label: {"dataset": ds, "partition": part, "methods": {method:
    {metric: mean}}, "intervals": {method: {metric: Interval}}}}`` (``partition`` and
    ``intervals``, :class:`medpfl.report.stats.Interval` over seeds, may be absent). Returns one
    row per (group, method, metric) with columns group, dataset, block, method, metric, label,
    ours, paper, paper_pm, diff, rank_ours, rank_paper (ranks among the methods of the block with
    both values), ours_seeds, ours_ci_low, ours_ci_high (our seeds with a value and the 95 % CI of
    our mean; empty without ``intervals`` or with one seed), in the paper's row order.
    """
    rows = []
    for group, g in ours.items():
        ds = g["dataset"]
        pvals = paper.group_values(ds, g.get("partition", ""))
        if pvals is None:
            continue
        methods = [m for m in pvals if m in g["methods"]]  # the paper's order
        for metric, meta in paper.metrics.items():
            hib = bool(meta.get("higher_is_better", True))
            o = {m: g["methods"][m].get(metric) for m in methods}
            p = {m: pvals[m].get(metric, (None, None))[0] for m in methods}
            ro, rp = {}, {}
            for block in dict.fromkeys(paper.block_of(m) for m in methods):
                both = [m for m in methods if paper.block_of(m) == block and o[m] is not None and p[m] is not None]
                ro.update(_rank({m: o[m] for m in both}, hib))
                rp.update(_rank({m: p[m] for m in both}, hib))
            for m in methods:
                pv, ppm = pvals[m].get(metric, (None, None))
                iv = (g.get("intervals") or {}).get(m, {}).get(metric)
                rows.append({"group": group, "dataset": ds, "block": paper.block_of(m), "method": m, "metric": metric,
                             "label": meta.get("label", metric), "ours": o[m], "paper": pv, "paper_pm": ppm,
                             "diff": (o[m] - pv) if (o[m] is not None and pv is not None) else None,
                             "rank_ours": ro.get(m), "rank_paper": rp.get(m),
                             "ours_seeds": iv.n if iv is not None else None,
                             "ours_ci_low": iv.low if iv is not None else None,
                             "ours_ci_high": iv.high if iv is not None else None})
    return pd.DataFrame(rows, columns=["group", "dataset", "block", "method", "metric", "label", "ours", "paper",
                                       "paper_pm", "diff", "rank_ours", "rank_paper", "ours_seeds", "ours_ci_low",
                                       "ours_ci_high"])


def rank_agreement(df: pd.DataFrame) -> pd.DataFrame:
    """Per (group, block, metric): methods compared, Spearman rho of our vs the paper's values (NaN
    below 3 methods), and the mean absolute difference."""
    rows = []
    if "block" not in df.columns:
        df = df.assign(block="")
    for (group, block, metric), d in df.groupby(["group", "block", "metric"], sort=False):
        both = d.dropna(subset=["ours", "paper"])
        rho = float(stats.spearmanr(both["ours"], both["paper"]).statistic) if len(both) >= 3 else float("nan")
        rows.append({"group": group, "block": block, "metric": metric, "label": d["label"].iloc[0],
                     "methods": len(both), "spearman_rho": rho,
                     "mean_abs_diff": float(both["diff"].abs().mean()) if len(both) else float("nan")})
    return pd.DataFrame(rows, columns=["group", "block", "metric", "label", "methods", "spearman_rho", "mean_abs_diff"])


def _fmt(x, nd: int = 3, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return NULL
    s = f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"
    zero = f"{0:.{nd}f}"
    return s.replace("-" + zero, zero).replace("+" + zero, zero)


def comparison_tables(df: pd.DataFrame, agreement: pd.DataFrame,
                      percent: bool = False) -> dict[str, list[tuple[str, pd.DataFrame]]]:
    """``{group: [(metric label, formatted table), ...]}``: per metric, one row per method in the
    paper's order with ours (± the half-width of its 95 % CI over seeds where ``df`` has one;
    "1 seed: no interval" with one seed), the paper's (± as printed), ours − paper and both ranks;
    then a 'Rank agreement' table. ``percent``: values, ± and differences shown × 100 with 2 decimals
    (accuracy points, as a paper that prints percentages), else as fractions with 3."""
    out: dict[str, list[tuple[str, pd.DataFrame]]] = {}
    scale, nd = (100.0, 2) if percent else (1.0, 3)

    def _f(x, signed: bool = False):
        return _fmt(None if x is None or pd.isna(x) else scale * x, nd, signed)

    def _ours(r) -> str:
        v, n, hi = r.get("ours"), r.get("ours_seeds"), r.get("ours_ci_high")
        if v is None or pd.isna(v) or n is None or pd.isna(n):
            return _f(v)
        if int(n) < 2:
            return f"{_f(v)} ({NO_INTERVAL})"
        return f"{_f(v)} ± {_f(hi - v)}" if hi is not None and not pd.isna(hi) else _f(v)

    for group, g in df.groupby("group", sort=False):
        tables = []
        for metric, d in g.groupby("metric", sort=False):
            t = pd.DataFrame({
                "Method": d["method"],
                "ours": [_ours(r) for _, r in d.iterrows()],
                "paper": [_f(v) + (f" ± {_f(pm)}" if pm is not None and not (isinstance(pm, float) and math.isnan(pm)) else "")
                          if v is not None else NULL for v, pm in zip(d["paper"], d["paper_pm"])],
                "ours − paper": [_f(v, signed=True) for v in d["diff"]],
                "rank ours": [NULL if pd.isna(r) else str(int(r)) for r in d["rank_ours"]],
                "rank paper": [NULL if pd.isna(r) else str(int(r)) for r in d["rank_paper"]],
            })
            tables.append((str(d["label"].iloc[0]), t.reset_index(drop=True)))
        a = agreement[agreement["group"] == group]
        agree = {"Metric": a["label"]}
        if (a["block"] != "").any():
            agree["Block"] = a["block"]
        tables.append(("Rank agreement", pd.DataFrame({
            **agree, "methods": a["methods"].astype(str),
            "Spearman ρ (ours vs paper)": [_fmt(v, 2) for v in a["spearman_rho"]],
            "mean |ours − paper|": [_f(v) for v in a["mean_abs_diff"]]}).reset_index(drop=True)))
        out[str(group)] = tables
    return out


def paper_caption(paper: PaperTable, seeds: dict[str, int], rounds: dict[str, Any]) -> str:
    nseeds = sorted(set(seeds.values()))
    nrounds = sorted({str(r) for r in rounds.values()})
    how = paper.how_ours or "computed as the paper's Table 1 (fedkper-protocol.md §4.2)"
    within = " of the same block (" + ", ".join(paper.blocks) + ")" if paper.blocks else ""
    return (f"Ours: mean over {', '.join(map(str, nseeds))} seed(s) and {', '.join(nrounds)} rounds, {how}, "
            f"± the half-width of its {CI_LEVEL} Student t confidence interval over seeds "
            f"(“{NO_INTERVAL}” with one seed); paper: {paper.source} ({paper.title}), its ± as printed (the paper's own convention). "
            f"Ranks are among the methods{within} with "
            f"both values (1 = best; higher is better for every column, BwT included). {NULL} = not applicable "
            f"(e.g. a method without a single global model has no global columns).")
