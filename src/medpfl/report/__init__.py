"""Report stage: tables, figures and the DVC metrics file from finished runs.

:func:`build_report` is the entry point; :mod:`medpfl.report.tables` builds the tables and
:mod:`medpfl.report.figures` the accuracy-per-round figure.
"""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path

from medpfl.io import InputFileError, atomic_path, write_json
from medpfl.report.figures import plot_curves
from medpfl.report.paper import (PaperTableError, compare, comparison_tables, load_paper_table, paper_caption,
                                 rank_agreement, round_spread)
from medpfl.report.stats import resolve_reference
from medpfl.report.tables import (groups, load_runs, paired, render_html, render_markdown, seed_interval, seed_mean,
                                  summary_frame, summary_metrics)

__all__ = ["build_report"]


def _embed(path: Path) -> tuple[str, str, str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return path.name, mime, base64.b64encode(path.read_bytes()).decode("ascii")


def _write_utf8(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def build_report(run_dirs: list[Path], out_dir: Path, partition_figures: list[Path] = (),
                 title: str = "", paper_table: Path | None = None, reference: str | None = None) -> dict:
    """Summarise finished runs into tables, a figure and the DVC metrics file.

    Reads ``metrics.json`` and ``round_metrics.csv`` from every folder in ``run_dirs`` (one
    per dataset × partition × method × seed) and writes, each atomically, into ``out_dir``:

    * ``summary.csv``: one row per run (identity columns and every per-run summary key);
    * ``table.md`` and ``table.html``: for each (dataset, partition), one row per method in the
      order methods first appear in ``run_dirs``, with the number of seeds and rounds behind it;
      every number is the mean over seeds ``±`` the half-width of its 95 % Student t confidence
      interval over seeds (ddof=1; ``value (1 seed: no interval)`` where one seed has a value;
      :mod:`medpfl.report.stats`):

      - "Table 1 (FedKPer paper convention; ...)", the columns of Table 1 of Fowler & AlRegib,
        "FedKPer" (ICIP 2026); the paper's own ``±`` on Avg Global Acc, Avg Global BwT and Avg Local
        Acc (the mean over seeds of each run's **std over rounds**, ``../shared/docs/fedkper-protocol.md``
        §4.2) is a separate column beside each, labelled "std over rounds (paper's ±)";
      - "Plain summary (...)": final accuracies, MB and seconds per round;
      - "Paired comparison vs <reference>": per method and metric, the mean over shared seeds of
        (method − reference) with its 95 % t interval and whether it excludes 0;

      then, for the whole report, "Wall time" (:func:`~medpfl.report.tables.wall_table`: runs and
      the sum of their wall hours per dataset × partition and in all) and "Environment".

      A null value renders as "—". ``table.html`` is a self-contained page (inline CSS) that
      embeds ``curves.png`` and every file in ``partition_figures`` as base64 data URIs;
    * ``paired.csv``: the paired comparisons, one row per group, method (other than the
      reference) and metric (:data:`medpfl.report.stats.PAIRED_COLUMNS`). ``reference`` is
      ``report.reference``: a method of the runs; None: ``fedavg`` when present, else the first
      method (per group; a group without the given reference falls back the same way);
    * ``curves.png``: global test accuracy and sampled clients' balanced accuracy after local
      training per round, one row per (dataset, partition), mean over seeds with a min–max band;
    * ``summary.json``: ``{dataset: {partition: {method: {metric: mean over seeds}}}}`` (null
      stays null), the DVC metrics file;
    * with ``paper_table`` (a paper's table as data, :mod:`medpfl.report.paper`):
      ``paper_comparison.csv`` (one row per group, method and metric: ours, the paper's value and
      ±, the difference, both ranks) and ``paper_agreement.csv`` (Spearman rho of the rankings and
      mean |difference| per metric); the side-by-side tables are added to table.md/html. A paper
      metric with ``per_round`` also gets our spread over the last ``last_rounds`` rounds and
      whether the paper's value lies inside it (:func:`medpfl.report.paper.round_spread`).

    Raises :class:`~medpfl.io.InputFileError` (a ``ValueError``) ``"report: no runs given"`` for
    an empty ``run_dirs``, ``ParamsError`` naming ``report.reference`` when ``reference`` is not a
    method of the runs, :class:`~medpfl.report.paper.PaperTableError` for a bad paper table (or a
    ``per_round`` column no run's ``round_metrics.csv`` has), and
    ``FileNotFoundError`` / ``InputFileError`` naming the file when an input is missing or
    unreadable (``medpfl report`` prints each in one line and exits 2). Returns
    ``{"summary_csv", "table_md", "table_html", "curves_png", "summary_json", "paired_csv"}``
    (and the paper files) mapped to the paths written.
    """
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise InputFileError("report: no runs given")
    runs = load_runs(run_dirs)
    figures = [_embed(p) for p in partition_figures]  # fail on a missing figure before writing anything
    paper = load_paper_table(paper_table) if paper_table else None  # likewise for a bad paper table
    if paper is not None:  # likewise for a per_round column that no run has (a misspelt name)
        columns = set().union(*(r.rounds.columns for r in runs))
        for k, meta in paper.metrics.items():
            if meta.get("per_round") and meta["per_round"] not in columns:
                raise PaperTableError(f"report.paper_table: {paper.path}: metrics.{k}.per_round: "
                                      f"{meta['per_round']!r} is not a column of the runs' round_metrics.csv "
                                      f"({', '.join(c for c in runs[0].rounds.columns if c != 'round')})")
    if reference is not None:  # likewise for a reference that is not a method of the runs
        resolve_reference(list(dict.fromkeys(r.meta["method"] for r in runs)), reference)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "summary_csv": out_dir / "summary.csv",
        "table_md": out_dir / "table.md",
        "table_html": out_dir / "table.html",
        "curves_png": out_dir / "curves.png",
        "summary_json": out_dir / "summary.json",
        "paired_csv": out_dir / "paired.csv",
    }

    section = None
    if paper is not None:
        ours, seeds, rounds = {}, {}, {}
        for (ds, part), methods in groups(runs).items():
            g = f"{ds} / {part}"
            ours[g] = {"dataset": ds, "partition": part, "methods": {m: {k: seed_mean(rs, k) for k in paper.metrics}
                                                  for m, rs in methods.items()},
                     "intervals": {m: {k: seed_interval(rs, k) for k in paper.metrics} for m, rs in methods.items()},
                     "spread": {m: {k: round_spread([r.rounds for r in rs], meta["per_round"], paper.last_rounds)
                                    for k, meta in paper.metrics.items() if meta.get("per_round")}
                                for m, rs in methods.items()}}
            seeds.update({f"{g}/{m}": len(rs) for m, rs in methods.items()})
            rounds.update({f"{g}/{m}": rs[0].summary.get("rounds") for m, rs in methods.items()})
        df = compare(ours, paper)
        agreement = rank_agreement(df)
        paths["paper_comparison_csv"] = out_dir / "paper_comparison.csv"
        paths["paper_agreement_csv"] = out_dir / "paper_agreement.csv"
        with atomic_path(paths["paper_comparison_csv"]) as tmp:
            df.to_csv(tmp, index=False)
        with atomic_path(paths["paper_agreement_csv"]) as tmp:
            agreement.to_csv(tmp, index=False)
        section = (f"Side by side with the paper: {paper.title}", paper_caption(paper, seeds, rounds),
                   comparison_tables(df, agreement, paper.percent))
    with atomic_path(paths["summary_csv"]) as tmp:
        summary_frame(runs).to_csv(tmp, index=False)
    write_json(paths["summary_json"], summary_metrics(runs))
    with atomic_path(paths["paired_csv"]) as tmp:
        paired(runs, reference)[0].to_csv(tmp, index=False)
    plot_curves(runs, paths["curves_png"])
    _write_utf8(paths["table_md"], render_markdown(runs, title, curves_name=paths["curves_png"].name, paper=section,
                                                    reference=reference))
    curves = ("Accuracy per round (line: mean over seeds; band: min–max over seeds)", "image/png",
              base64.b64encode(paths["curves_png"].read_bytes()).decode("ascii"))
    _write_utf8(paths["table_html"], render_html(runs, title, [curves, *figures], paper=section, reference=reference))
    return paths
