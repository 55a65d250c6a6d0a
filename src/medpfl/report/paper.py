"""Side by side with a paper's table: our value, the paper's, the difference and both rankings.

A paper table is a YAML file (``config/papers/*.yaml``) holding the paper's numbers as data with
their source::

    title: ...            source: ...
    how_ours: ...         # optional: how our number is computed (the caption says it)
    percent: true         # optional: show values x 100 (the paper prints percentages)
    convention: ...       # optional: a note on the reporting convention (not used in computing)
    metrics:  {<summary key>: {label: ..., higher_is_better: true, per_round: <round column>}, ...}
    last_rounds: 50       # optional: the rounds the per_round spread covers (default 50)
    blocks:   {<name>: [<method>, ...], ...}    # optional: rank within each block
    readings: {<variant>: <method>, ...}         # optional: study variants that run a paper row another way
    values:   {<dataset> or <dataset>/<partition>: {<method>: {<summary key>: [value, ±], ...}, ...}, ...}

Every key is checked when the file is loaded (``load_paper_table``; unknown keys are errors): a
bad file stops the report with one line naming the file and the key (``medpfl report`` exits 2).

A study names it in ``report.paper_table``. For every (dataset, partition) group of the study
that the paper reports (a ``<dataset>/<partition>`` key, else the ``<dataset>`` key: a paper
table whose columns are our partitions names them), and every method both have, the comparison
gives per metric: ours (the mean over seeds, as the study's Table 1, with its 95 % t confidence
interval over seeds where the caller gives one), the paper's value and its ±, ours − paper, our
rank and the paper's rank among the methods compared (1 = best), and per
metric the Spearman rank correlation of the two orderings (``scipy.stats.spearmanr``; needs 3 or
more methods). With ``blocks`` (e.g. one block of rows per model, as a paper that compares
methods per model), ranks and correlations are computed within each block.

With two or more seeds, each row also says whether the gap is within our spread over seeds:
``paper_in_ci`` is true where the paper's value lies inside ours' 95 % Student t confidence
interval over seeds (``ours_ci_low <= paper <= ours_ci_high``, i.e. ``|ours − paper| <=`` the
interval's half-width; the paper's own ± is not used), false where it lies outside (a gap that
seed-to-seed variation of ours does not explain at that level), and empty with one seed or
without a value on either side. The interval covers what the seeds vary: training, and with
``data.synthetic.<name>.seed_per_run`` the generated data set too.

A paper that prints one round's value (the final round's, say) compares it with one draw of a
curve that may swing from round to round (a FedAvg global model on non-IID clients does, by
several points). A metric with ``per_round`` (the ``round_metrics.csv`` column that tracks it per
round, e.g. ``deployed_acc_mean`` for ``final_client_acc_mean``) therefore gains our spread over
the last ``last_rounds`` rounds (:func:`round_spread`): the mean over seeds of each run's mean
over those rounds, and the lowest and highest round over all seeds; and whether the paper's value
lies inside that range. A gap whose paper value lies inside our range is within our own
round-to-round swing.

A *reading* is a method variant of the study that runs one of the paper's rows another way (the
paper's own code rather than its text, say: ``pfedme-code-mlr: pfedme-mlr``). With ``readings``,
each variant the study has is compared with the paper's value of the row it reads: a row
``<variant>`` with ``reading_of`` set to that row, after the paper's rows, in the row's block. It
has ours, the paper's value, the difference, the interval and spread columns, but no ranks, and it
is left out of the rank agreement, which stays among the paper's rows. ``docs/studies.md`` says
why each variant exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, StrictBool, StrictFloat, StrictStr, ValidationError
from scipy import stats

from medpfl.errors import PaperTableError  # noqa: F401  (defined in medpfl.errors; importable here as before)
from medpfl.report.stats import CI_LEVEL, NO_INTERVAL, Interval

NULL = "—"
SPREAD_COLUMNS = ("last_rounds", "last_mean", "last_std", "last_low", "last_high", "paper_in_last_range")


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
    last_rounds: int = 50
    readings: dict[str, str] | None = None

    def group_values(self, dataset: str, partition: str) -> dict[str, dict[str, tuple[float, float | None]]] | None:
        """The paper's values for one of our (dataset, partition) groups, or None."""
        return self.values.get(f"{dataset}/{partition}", self.values.get(dataset))

    def block_of(self, method: str) -> str:
        """The block a method is ranked in ("" without blocks or for a method in none)."""
        for name, ms in (self.blocks or {}).items():
            if method in ms:
                return name
        return ""


class _Metric(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    label: StrictStr | None = None
    higher_is_better: StrictBool = True
    per_round: StrictStr | None = Field(None, description="the round_metrics.csv column tracking the metric per round")


class _PaperFile(BaseModel):
    """The schema of a paper table file (the module docstring); unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    title: StrictStr
    source: StrictStr
    how_ours: StrictStr = ""
    percent: StrictBool = False
    convention: StrictStr | None = Field(None, description="the reporting convention our numbers follow (a note)")
    metrics: dict[str, _Metric]
    blocks: dict[str, list[StrictStr]] | None = None
    last_rounds: PositiveInt = 50
    readings: dict[StrictStr, StrictStr] | None = Field(
        None, description="{variant: paper row}: a study variant compared with the paper's value of the row it "
                          "reads another way (not ranked)")
    values: dict[str, dict[str, dict[str, tuple[StrictFloat, StrictFloat | None]]]]


_REQUIRED = ("title", "source", "metrics", "values")


def _dotted(loc: tuple) -> str:
    """A pydantic error location as a dotted key (``values.bloodmnist.fedavg.avg_global_acc``;
    an error about a mapping's key itself ends in `` (key)``)."""
    return ".".join(str(x) for x in loc if x != "[key]") + (" (key)" if "[key]" in loc else "")


def load_paper_table(path: str | Path) -> PaperTable:
    """Read and check a paper table file (schema: the module docstring; ``_PaperFile``).

    Raises :class:`PaperTableError` (a ValueError) with a one-line message that names
    ``report.paper_table``, the file and, for a schema error, the offending key (e.g.
    ``values.bloodmnist.fedavg.avg_global_acc``): a missing file, text that is not YAML (with its
    line and column), a missing or unknown key, a value of the wrong type, a cell that is not
    ``[value, ± or null]``, or a metric in ``values`` not declared under ``metrics``."""
    path = Path(path)
    where = f"report.paper_table: {path}"
    if not path.is_file():
        raise PaperTableError(f"{where}: file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PaperTableError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise PaperTableError(f"{where}: not valid YAML{at}: {problem}") from None
    if not isinstance(data, dict):
        raise PaperTableError(f"{where}: expected a mapping with the keys {', '.join(_REQUIRED)}, "
                              f"got {type(data).__name__}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise PaperTableError(f"{where}: needs the keys {', '.join(_REQUIRED)} (missing: {', '.join(missing)})")
    try:
        table = _PaperFile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"]
        if loc[:1] == ("values",) and len(loc) >= 4:  # a cell: say what a cell looks like
            try:
                cell = data["values"][loc[1]][loc[2]][loc[3]]
            except (KeyError, TypeError, IndexError):  # the error is about a key, not a cell
                cell = None
            else:
                raise PaperTableError(f"{where}: {_dotted(loc[:4])}: expected [value, ± or null] (numbers), "
                                      f"got {cell!r}") from None
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise PaperTableError(f"{where}: {_dotted(loc)}: {msg}") from None
    values: dict = {}
    for ds, methods in table.values.items():
        for method, cells in methods.items():
            for metric, (value, pm) in cells.items():
                if metric not in table.metrics:
                    raise PaperTableError(f"{where}: values.{ds}.{method}.{metric}: not declared under metrics "
                                          f"({', '.join(table.metrics)})")
                values.setdefault(ds, {}).setdefault(method, {})[metric] = (float(value),
                                                                             None if pm is None else float(pm))
    rows = {m for methods in values.values() for m in methods}
    for variant, row in (table.readings or {}).items():
        if variant in rows:
            raise PaperTableError(f"{where}: readings.{variant}: is a row of the paper's table itself, not a variant")
        if row not in rows:
            raise PaperTableError(f"{where}: readings.{variant}: {row!r} is not a row of values "
                                  f"({', '.join(sorted(rows))})")
    metrics = {k: m.model_dump(exclude_none=True) for k, m in table.metrics.items()}
    blocks = {k: list(v) for k, v in table.blocks.items()} if table.blocks is not None else None
    readings = dict(table.readings) if table.readings is not None else None
    return PaperTable(table.title, table.source, metrics, values, path, table.how_ours, blocks, table.percent,
                      table.last_rounds, readings)


@dataclass(frozen=True)
class Spread:
    """Our value of a metric over the last rounds of the runs of one method (all seeds).

    mean: the mean over seeds of each run's mean over its last ``rounds`` rounds; std: the mean over
    seeds of each run's std over those rounds (ddof=1; NaN for one round); low / high: the lowest
    and the highest of those rounds over all seeds; rounds: how many rounds per run were available
    (fewer than asked where a run is shorter); seeds: runs with a value."""

    mean: float
    std: float
    low: float
    high: float
    rounds: int
    seeds: int


def round_spread(per_run_rounds: list[pd.DataFrame], column: str, last: int) -> Spread | None:
    """The spread of ``column`` over the last ``last`` rounds of each run (:class:`Spread`).

    per_run_rounds: each run's ``round_metrics.csv`` as a DataFrame with a ``round`` column (any
    order; rows whose ``column`` is null or infinite are skipped, as a method that has no value in
    some rounds). ``last`` counts rounds with a finite value. Returns None where no run has the
    column or a finite value in it. Raises ValueError for ``last < 1``."""
    if last < 1:
        raise ValueError(f"round_spread: last must be >= 1, got {last}")
    means, stds, lows, highs, counts = [], [], [], [], []
    for df in per_run_rounds:
        if column not in df.columns:
            continue
        v = pd.to_numeric(df.sort_values("round")[column], errors="coerce")
        v = v[v.abs() < math.inf].iloc[-last:]  # finite values only (NaN compares False)
        if v.empty:
            continue
        means.append(float(v.mean()))
        stds.append(float(v.std(ddof=1)) if len(v) > 1 else float("nan"))
        lows.append(float(v.min()))
        highs.append(float(v.max()))
        counts.append(len(v))
    if not means:
        return None
    return Spread(mean=sum(means) / len(means), std=sum(stds) / len(stds), low=min(lows), high=max(highs),
                  rounds=min(counts), seeds=len(means))


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
    ``intervals``, :class:`medpfl.report.stats.Interval` over seeds, may be absent; so may
    ``"spread": {method: {metric: Spread}}``, :func:`round_spread`). Returns one
    row per (group, method, metric) with columns group, dataset, block, method, metric, label,
    ours, paper, paper_pm, diff, rank_ours, rank_paper (ranks among the methods of the block with
    both values), ours_seeds, ours_ci_low, ours_ci_high (our seeds with a value and the 95 % CI of
    our mean; empty without ``intervals`` or with one seed), last_rounds, last_mean, last_std,
    last_low, last_high (our :class:`Spread`; empty without one) and paper_in_last_range (whether
    last_low <= paper <= last_high; empty without a spread or a paper value), then paper_in_ci
    (whether ours_ci_low <= paper <= ours_ci_high: the paper's value inside ours' 95 % t interval
    over seeds; empty with fewer than 2 seeds or without a paper value), then reading_of (empty for
    a paper row; for a variant of ``paper.readings`` the study has, the paper row it reads: its
    paper value and block, no ranks), in the paper's row order, each metric's readings after its
    paper rows.
    """
    rows = []
    for group, g in ours.items():
        ds = g["dataset"]
        pvals = paper.group_values(ds, g.get("partition", ""))
        if pvals is None:
            continue
        methods = [m for m in pvals if m in g["methods"]]  # the paper's order
        readings = {v: row for v, row in (paper.readings or {}).items() if v in g["methods"] and row in pvals}
        for metric, meta in paper.metrics.items():
            hib = bool(meta.get("higher_is_better", True))
            o = {m: g["methods"][m].get(metric) for m in methods}
            p = {m: pvals[m].get(metric, (None, None))[0] for m in methods}
            ro, rp = {}, {}
            for block in dict.fromkeys(paper.block_of(m) for m in methods):
                both = [m for m in methods if paper.block_of(m) == block and o[m] is not None and p[m] is not None]
                ro.update(_rank({m: o[m] for m in both}, hib))
                rp.update(_rank({m: p[m] for m in both}, hib))
            o.update({v: g["methods"][v].get(metric) for v in readings})
            for m in [*methods, *readings]:
                row = readings.get(m, m)  # the paper row whose value m is compared with
                pv, ppm = pvals[row].get(metric, (None, None))
                iv = (g.get("intervals") or {}).get(m, {}).get(metric)
                sp = (g.get("spread") or {}).get(m, {}).get(metric)
                rows.append({"group": group, "dataset": ds, "block": paper.block_of(row), "method": m,
                             "metric": metric, "label": meta.get("label", metric), "ours": o[m], "paper": pv,
                             "paper_pm": ppm, "diff": (o[m] - pv) if (o[m] is not None and pv is not None) else None,
                             "rank_ours": ro.get(m), "rank_paper": rp.get(m),
                             "ours_seeds": iv.n if iv is not None else None,
                             "ours_ci_low": iv.low if iv is not None else None,
                             "ours_ci_high": iv.high if iv is not None else None,
                             "last_rounds": sp.rounds if sp is not None else None,
                             "last_mean": sp.mean if sp is not None else None,
                             "last_std": sp.std if sp is not None else None,
                             "last_low": sp.low if sp is not None else None,
                             "last_high": sp.high if sp is not None else None,
                             "paper_in_last_range": (sp.low <= pv <= sp.high) if sp is not None and pv is not None
                             else None,
                             "paper_in_ci": paper_in_interval(iv, pv),
                             "reading_of": readings.get(m)})
    return pd.DataFrame(rows, columns=["group", "dataset", "block", "method", "metric", "label", "ours", "paper",
                                       "paper_pm", "diff", "rank_ours", "rank_paper", "ours_seeds", "ours_ci_low",
                                       "ours_ci_high", *SPREAD_COLUMNS, "paper_in_ci", "reading_of"]
                        ).astype({"rank_ours": "Int64", "rank_paper": "Int64"})  # whole ranks; <NA> where unranked


def paper_in_interval(interval: Interval | None, paper: float | None) -> bool | None:
    """Whether the paper's value lies inside ours' confidence interval over seeds (ends included):
    ``interval.low <= paper <= interval.high``, the same as ``|ours − paper| <= half-width``. None
    without an interval (no value, or one seed: :class:`~medpfl.report.stats.Interval` with
    ``low = None``) or without a paper value."""
    if interval is None or interval.low is None or paper is None or not math.isfinite(paper):
        return None
    return bool(interval.low <= paper <= interval.high)


def rank_agreement(df: pd.DataFrame) -> pd.DataFrame:
    """Per (group, block, metric): methods compared, Spearman rho of our vs the paper's values (NaN
    below 3 methods), the mean absolute difference, and ``in_ci`` / ``with_ci``: of the methods
    with an interval over seeds and a paper value (``paper_in_ci`` not empty, :func:`compare`), how
    many have the paper's value inside it, and how many there are (0 and 0 with one seed). Rows
    with a ``reading_of`` (variants, :func:`compare`) are left out: the agreement is among the
    paper's own rows."""
    rows = []
    if "reading_of" in df.columns:
        df = df[df["reading_of"].isna()]
    if "block" not in df.columns:
        df = df.assign(block="")
    if "paper_in_ci" not in df.columns:
        df = df.assign(paper_in_ci=None)
    for (group, block, metric), d in df.groupby(["group", "block", "metric"], sort=False):
        both = d.dropna(subset=["ours", "paper"])
        rho = float(stats.spearmanr(both["ours"], both["paper"]).statistic) if len(both) >= 3 else float("nan")
        flags = [bool(v) for v in d["paper_in_ci"] if v is not None and not pd.isna(v)]
        rows.append({"group": group, "block": block, "metric": metric, "label": d["label"].iloc[0],
                     "methods": len(both), "spearman_rho": rho,
                     "mean_abs_diff": float(both["diff"].abs().mean()) if len(both) else float("nan"),
                     "in_ci": sum(flags), "with_ci": len(flags)})
    return pd.DataFrame(rows, columns=["group", "block", "metric", "label", "methods", "spearman_rho", "mean_abs_diff",
                                       "in_ci", "with_ci"])


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
    "1 seed: no interval" with one seed), the paper's (± as printed), ours − paper, where some row
    has an interval over seeds "paper in ours' 95 % CI" (yes / no; — with one seed: ``paper_in_ci``,
    :func:`compare`), and both ranks; then a 'Rank agreement' table (with intervals: "paper in
    ours' CI", k of n). Where the metric has a round spread (``df``'s last_* columns,
    :func:`compare`), two more columns after ours − paper: "ours, last N rounds: mean [min, max]"
    and "paper in that range" (yes / no). ``percent``: values, ± and differences shown × 100 with 2
    decimals (accuracy points, as a paper that prints percentages), else as fractions with 3. A
    reading (``reading_of`` set) shows as "<variant> (reading of <row>)", unranked."""
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
            reads = d["reading_of"] if "reading_of" in d.columns else pd.Series(None, index=d.index)
            t = pd.DataFrame({
                "Method": [m if pd.isna(r) else f"{m} (reading of {r})" for m, r in zip(d["method"], reads)],
                "ours": [_ours(r) for _, r in d.iterrows()],
                "paper": [_f(v) + (f" ± {_f(pm)}" if pm is not None and not (isinstance(pm, float) and math.isnan(pm)) else "")
                          if v is not None else NULL for v, pm in zip(d["paper"], d["paper_pm"])],
                "ours − paper": [_f(v, signed=True) for v in d["diff"]],
            })
            if "paper_in_ci" in d.columns and d["paper_in_ci"].notna().any():
                t[f"paper in ours' {CI_LEVEL} CI"] = [NULL if v is None or pd.isna(v) else ("yes" if bool(v) else "no")
                                                      for v in d["paper_in_ci"]]
            if "last_mean" in d.columns and d["last_mean"].notna().any():
                n = int(d["last_rounds"].dropna().max())
                t[f"ours, last {n} rounds: mean [min, max]"] = [
                    NULL if pd.isna(r["last_mean"]) else f"{_f(r['last_mean'])} [{_f(r['last_low'])}, {_f(r['last_high'])}]"
                    for _, r in d.iterrows()]
                t["paper in that range"] = [NULL if v is None or pd.isna(v) else ("yes" if bool(v) else "no")
                                            for v in d["paper_in_last_range"]]
            t["rank ours"] = [NULL if pd.isna(r) else str(int(r)) for r in d["rank_ours"]]
            t["rank paper"] = [NULL if pd.isna(r) else str(int(r)) for r in d["rank_paper"]]
            tables.append((str(d["label"].iloc[0]), t.reset_index(drop=True)))
        a = agreement[agreement["group"] == group]
        agree = {"Metric": a["label"]}
        if (a["block"] != "").any():
            agree["Block"] = a["block"]
        cols = {**agree, "methods": a["methods"].astype(str),
                "Spearman ρ (ours vs paper)": [_fmt(v, 2) for v in a["spearman_rho"]],
                "mean |ours − paper|": [_f(v) for v in a["mean_abs_diff"]]}
        if "with_ci" in a.columns and (a["with_ci"] > 0).any():
            cols["paper in ours' CI"] = [f"{int(k)} of {int(n)}" if n > 0 else NULL
                                         for k, n in zip(a["in_ci"], a["with_ci"])]
        tables.append(("Rank agreement", pd.DataFrame(cols).reset_index(drop=True)))
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
            + (f"“Paper in ours' {CI_LEVEL} CI”: whether the paper's value lies inside that interval over seeds "
               f"(|ours − paper| <= its half-width): “no” marks a gap beyond what our seeds vary, “yes” one within it. "
               if max(nseeds, default=1) >= 2 else "")
            + f"Ranks are among the methods{within} with "
            f"both values (1 = best; higher is better for every column, BwT included). {NULL} = not applicable "
            f"(e.g. a method without a single global model has no global columns)."
            + (f" Ours, last {paper.last_rounds} rounds: the mean over seeds of each run's mean over its last "
               f"{paper.last_rounds} rounds of the metric's per-round value, [the lowest, the highest] of those rounds "
               f"over all seeds; “paper in that range”: whether the paper's value lies inside it, i.e. within our "
               f"round-to-round swing." if any(m.get("per_round") for m in paper.metrics.values()) else "")
            + (" A row “<variant> (reading of <row>)” is a variant of the study that runs the paper's row another "
               "way (docs/studies.md says how), compared with that row's paper value; it is not ranked and not in "
               "the rank agreement." if paper.readings else ""))
