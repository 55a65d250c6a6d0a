"""How noisy a run's final-round score is: per finished run under a study's results folder, the
paper's per-round metric (every client's accuracy on its own test split, unweighted mean over
clients, with the model the method deploys) at the final round, its last-10-round mean, and its
mean, std (ddof=1), min and max over the last ``--last`` rounds, in %.

The deployed model's view is ``personalized_on_local`` where the run recorded one and
``global_on_local`` otherwise, the rule ``medpfl evaluate`` applies for ``deployed_acc_mean`` and
``final_client_acc_mean``. Reads only ``records.parquet`` (so it also reads runs not yet
evaluated); ``docs/studies.md`` (pFedKD-WCL) quotes its output::

    python scripts/round_spread.py results/pfedkd-mnist --last 50

It reads the study's ``runs/`` and its git archive (``archive/``, ``scripts/study_archive.py``), so a
fresh clone reads the archived runs without restoring them; a run in both is read from ``runs/``.
With ``--seeds`` it also prints, per method, the final-round value of each seed and their mean
with the report's 95 % t interval (``medpfl.report.stats.t_interval``); with ``--paper-table``
(a paper table file, ``final_client_acc_mean``) the paper's value and whether it lies in that
interval, as the report's "paper in ours' 95 % CI" column. That is the seeds' view of a study
whose ``report_all`` still waits for runs::

    python scripts/round_spread.py results/pfedkd-synthetic --seeds --paper-table config/papers/pfedkd-table2.yaml

The paper table's ``readings`` (``{variant: row}``, :mod:`medpfl.report.paper`) set each stored
variant beside the paper's value of the row it reads another way, as the report does;
``--compare VARIANT=ROW`` adds (or overrides) one such pair.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from medpfl.report.paper import NULL, PaperTable, load_paper_table, paper_in_interval, round_spread
from medpfl.report.stats import t_interval

PAPER_METRIC = "final_client_acc_mean"

def spread(records: pd.DataFrame, last: int) -> dict[str, float]:
    """Final, last-10 mean and last-``last`` mean/std/min/max of the per-round mean client accuracy (%)
    of the deployed model's view."""
    view = "personalized_on_local" if (records["view"] == "personalized_on_local").any() else "global_on_local"
    per = (100 * records[records["view"] == view].groupby("round")["accuracy"].mean()).rename("acc").reset_index()
    tail = round_spread([per], "acc", last)  # the report's side-by-side spread, on one run
    return {"final": round_spread([per], "acc", 1).mean, "last10": round_spread([per], "acc", 10).mean,
            f"last{last} mean": tail.mean, f"last{last} std": tail.std, f"last{last} min": tail.low,
            f"last{last} max": tail.high}


def run_records(results: Path) -> dict[tuple[str, str, str, str], Path]:
    """``records.parquet`` of every run under ``results/runs`` and ``results/archive``
    (``<dataset>/<partition>/<method>/seed<s>/``), keyed by (dataset, partition, method, seed);
    ``runs/`` wins over ``archive/``. An archived run without records (a checkpoint only) is left
    out."""
    found = {}
    for part in ("archive", "runs"):
        for f in sorted((results / part).glob("*/*/*/seed*/records.parquet")):
            found[tuple(f.parts[-5:-1])] = f
    return found


def seed_summary(runs: pd.DataFrame, paper: PaperTable | None = None,
                 readings: dict[str, str] | None = None) -> pd.DataFrame:
    """Per (dataset, partition, method): the seeds, each seed's final-round value, their mean and
    95 % t interval (``low``, ``high``; NaN with one seed), and with ``paper`` the paper's
    ``final_client_acc_mean`` for that (dataset, partition) (:meth:`PaperTable.group_values`, the
    report's lookup; × 100 for a ``percent`` table), ours − paper and ``paper_in_ci`` (the
    report's rule: yes / no, or "—" without an interval). A method of ``readings`` (``{variant:
    paper row}``) is compared with its row's value. ``runs``: :func:`main`'s per-run table
    (``final`` in %, ``seed`` as ``seed<s>``)."""
    rows = []
    for (dataset, partition, method), g in runs.groupby(["dataset", "partition", "method"], sort=True):
        g = g.sort_values("seed", key=lambda s: s.str.removeprefix("seed").astype(int))
        iv = t_interval(g["final"])
        row = {"dataset": dataset, "partition": partition, "method": method, "seeds": len(g),
               "finals": " ".join(f"{v:.2f}" for v in g["final"]), "mean": iv.mean,
               "low": iv.low if iv.low is not None else float("nan"),
               "high": iv.high if iv.high is not None else float("nan")}
        if paper is not None:
            cells = (paper.group_values(dataset, partition) or {}).get((readings or {}).get(method, method), {})
            value = (100.0 if paper.percent else 1.0) * cells[PAPER_METRIC][0] if PAPER_METRIC in cells else None
            inside = paper_in_interval(iv, value)
            row.update(paper=value if value is not None else float("nan"),
                       diff=iv.mean - value if value is not None else float("nan"),
                       paper_in_ci=NULL if inside is None else ("yes" if inside else "no"))
        rows.append(row)
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a study's results folder, e.g. results/pfedkd-mnist")
    ap.add_argument("--last", type=int, default=50)
    ap.add_argument("--seeds", action="store_true", help="also the per-method summary over seeds")
    ap.add_argument("--paper-table", type=Path, help=f"compare the seeds' interval with this paper table's {PAPER_METRIC}")
    ap.add_argument("--compare", action="append", default=[], metavar="VARIANT=ROW",
                    help="with --paper-table: compare a variant with the paper's value of ROW (repeatable; adds to the table's readings)")
    a = ap.parse_args()
    pairs = [c.split("=", 1) for c in a.compare]
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise SystemExit(f"--compare wants VARIANT=ROW, got {a.compare}")
    if pairs and not a.paper_table:
        raise SystemExit("--compare needs --paper-table (it compares a variant with a paper row's value)")
    rows = []
    for (dataset, partition, method, seed), f in run_records(a.results).items():
        s = spread(pd.read_parquet(f), a.last)
        rows.append({"dataset": dataset, "partition": partition, "method": method, "seed": seed, **s})
    if not rows:
        raise SystemExit(f"{a.results}: no runs/*/*/*/seed*/records.parquet or archive/*/*/*/seed*/records.parquet")
    runs = pd.DataFrame(rows)
    print(runs.round(2).to_string(index=False))
    if a.seeds or a.paper_table:
        paper, readings = None, None
        if a.paper_table:
            paper = load_paper_table(a.paper_table)
            with_metric = {m for methods in paper.values.values() for m, v in methods.items() if PAPER_METRIC in v}
            for variant, row in pairs:
                if row not in with_metric:
                    raise SystemExit(f"--compare {variant}={row}: {a.paper_table} has no {PAPER_METRIC} for {row!r}")
            readings = {**(paper.readings or {}), **dict(pairs)}
        print("\nfinal round over seeds (mean and 95 % t interval, %)")
        print(seed_summary(runs, paper, readings).round(2).to_string(index=False))


if __name__ == "__main__":
    main()
