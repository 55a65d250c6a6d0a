"""Other readings of the FedKPer Table 1 columns, from a study's stored records, without training.

The FedKPer paper publishes no script for its Table 1 summaries; ``../shared/docs/fedkper-protocol.md``
Section 4.2 infers each column's definition, and the report follows it (``medpfl.metrics``). Where a
cell of ours is far from the paper's, this script says whether another plausible reading of the
same column, computed from the same runs, would close the gap. Each reading is named by what it
changes against the report's (the ``spec`` reading, which equals the report's value):

Avg Local Acc and Avg Worst Client Acc (per round: mean / min over the round's sampled clients)
    ``spec``        balanced accuracy of each sampled client's model right after local training
                    (view ``local_after_training``; protocol 4.2 item 5);
    ``plain``       its plain accuracy (the paper's word "accuracy"; protocol 4.2 item 5 rejects it);
    ``deployed``    the sampled clients' personalized model at the end of the round (view
                    ``personalized_on_local``, after aggregation and any personalization step);
                    personalized methods only;
    ``global``      the aggregated global model on the sampled clients' local test splits (view
                    ``global_on_local``; protocol 4.2 item 6 rejects it for FedAvg);
    ``all_clients`` balanced accuracy of the model each client deploys at the end of the round,
                    over **every** client, not only the sampled ones (view ``personalized_on_local``
                    for a personalized method, else ``global_on_local``): PFLlib's evaluation
                    covers all clients every round (``serverbase.evaluate``), here without its
                    test-sample weighting.
Avg Local Consistency (C = 1 - AIPFR, FedKPer eq. 7-9)
    ``spec``        on the per-round mean of the ``spec`` local accuracy;
    ``rows``        on the sampled clients' values in the order the authors' code logs them, one row
                    per sampled client per round (``local_results.xlsx``, protocol 4.1);
    ``plain``       on the per-round mean plain accuracy;
    ``tail``        ``spec`` with the trailing interval that never recovers counted (protocol 4.2
                    item 5 of the algorithm: an assumption);
    ``worst``       on the per-round minimum instead of the mean.
Avg Global Consistency
    ``spec``        on the global model's plain accuracy on the global test set, every round;
    ``tail``        with the unrecovered trailing interval counted.

For the two local-accuracy columns, one more reading mixes two of these by where the paper's rows
come from (protocol Section 6): ``framework`` is ``spec`` for the methods the authors ran in their
own framework, whose logger records the balanced ("classwise") accuracy (FedAvg, FedProx, MOON,
FedNTD, FedCurv from ``zfowler3/fl-repo``; FedKPer), and ``plain`` for the personalized baselines
found in no public code of theirs and most likely ported from PFLlib, which scores plain accuracy
(``../shared/docs/peers.md`` Section 1, "Metrics").

Per method, the mean over the seeds found. Reads only ``records.parquet``, so it works on a study's
``runs/`` or on its git archive (``scripts/study_archive.py``). With ``--paper-table``, each reading
is also compared with the paper's column: ours − paper per method, and per reading the mean
|ours − paper|, how many methods lie within 0.05 and the Spearman rank correlation over the
methods both have (``medpfl.report.paper``'s conventions)::

    python scripts/fedkper_readings.py results/fedkper-table1-cpu/archive \
        --paper-table config/papers/fedkper-table1.yaml --out readings.csv

Raises SystemExit when no ``*/*/*/seed*/records.parquet`` is found under the folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from medpfl.metrics import consistency

LOCAL_READINGS = ("spec", "plain", "deployed", "global", "all_clients")
# The rows the FedKPer authors ran in their own framework (protocol Section 6); the others' local
# accuracy is read as PFLlib's plain accuracy in the ``framework`` reading.
AUTHORS_FRAMEWORK = frozenset({"fedavg", "fedprox", "moon", "fedntd", "fedcurv", "fedkper"})
COLUMNS = ("avg_local_acc", "avg_worst_client_acc", "local_consistency", "global_consistency")
LOCAL_CONSISTENCY_READINGS = ("spec", "rows", "plain", "tail", "worst")
GLOBAL_CONSISTENCY_READINGS = ("spec", "tail")


def _sampled_view(records: pd.DataFrame, view: str) -> pd.DataFrame:
    """Rows of ``view`` restricted to each round's sampled clients (those with a
    ``local_after_training`` row in that round)."""
    sampled = records.loc[records["view"] == "local_after_training", ["round", "client_id"]].drop_duplicates()
    rows = records[records["view"] == view]
    return rows.merge(sampled, on=["round", "client_id"], how="inner")


def readings(records: pd.DataFrame) -> dict[str, float]:
    """Every reading of one run (module docstring), as ``{"<column>:<reading>": value}``.

    records: a run's :class:`medpfl.data.schemas.EvalRecords` table (columns ``round``, ``view``,
    ``client_id``, ``accuracy``, ``balanced_accuracy``), accuracies as fractions in [0, 1]. The
    ``local_after_training`` rows must be in the order the clients trained within a round (the
    engine writes them so). A reading whose view the run did not record is NaN.
    """
    out: dict[str, float] = {}
    la = records[records["view"] == "local_after_training"]
    per_round = {
        "spec": la.groupby("round")["balanced_accuracy"],
        "plain": la.groupby("round")["accuracy"],
    }
    for name, view in (("deployed", "personalized_on_local"), ("global", "global_on_local")):
        rows = _sampled_view(records, view)
        per_round[name] = rows.groupby("round")["balanced_accuracy"] if len(rows) else None
    deployed = records[records["view"] == "personalized_on_local"]
    if deployed.empty:
        deployed = records[records["view"] == "global_on_local"]
    per_round["all_clients"] = deployed.groupby("round")["balanced_accuracy"] if len(deployed) else None
    for name in LOCAL_READINGS:
        g = per_round[name]
        out[f"avg_local_acc:{name}"] = float(g.mean().mean()) if g is not None else float("nan")
        out[f"avg_worst_client_acc:{name}"] = float(g.min().mean()) if g is not None else float("nan")

    mean_bal = per_round["spec"].mean().to_numpy()
    out["local_consistency:spec"] = consistency(mean_bal)
    out["local_consistency:rows"] = consistency(la["balanced_accuracy"].to_numpy())
    out["local_consistency:plain"] = consistency(per_round["plain"].mean().to_numpy())
    out["local_consistency:tail"] = consistency(mean_bal, include_unrecovered_tail=True)
    out["local_consistency:worst"] = consistency(per_round["spec"].min().to_numpy())

    g = records[records["view"] == "global_test"].sort_values("round")["accuracy"].to_numpy()
    out["global_consistency:spec"] = consistency(g) if len(g) else float("nan")
    out["global_consistency:tail"] = consistency(g, include_unrecovered_tail=True) if len(g) else float("nan")
    return out


def study_readings(folder: Path) -> pd.DataFrame:
    """One row per run under ``folder`` (``<dataset>/<partition>/<method>/seed<s>/records.parquet``):
    the run's keys and :func:`readings`. Raises SystemExit when there is none."""
    rows = []
    for f in sorted(folder.glob("*/*/*/seed*/records.parquet")):
        dataset, partition, method, seed = f.parts[-5:-1]
        rows.append({"dataset": dataset, "partition": partition, "method": method,
                     "seed": int(seed.removeprefix("seed")), **readings(pd.read_parquet(f))})
    if not rows:
        raise SystemExit(f"{folder}: no */*/*/seed*/records.parquet")
    return pd.DataFrame(rows)


def per_method(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds per (dataset, partition, method), with the number of seeds."""
    keys = ["dataset", "partition", "method"]
    values = [c for c in runs.columns if ":" in c]
    out = runs.groupby(keys)[values].mean()
    out.insert(0, "seeds", runs.groupby(keys)["seed"].nunique())
    return out.reset_index()


def add_framework_reading(table: pd.DataFrame) -> pd.DataFrame:
    """``<column>:framework`` for the two local-accuracy columns: ``spec`` for the methods in
    :data:`AUTHORS_FRAMEWORK`, ``plain`` for the others (module docstring). Returns a copy."""
    out = table.copy()
    own = out["method"].isin(AUTHORS_FRAMEWORK)
    for column in ("avg_local_acc", "avg_worst_client_acc"):
        out[f"{column}:framework"] = out[f"{column}:spec"].where(own, out[f"{column}:plain"])
    return out


def against_paper(table: pd.DataFrame, paper_table: Path, dataset: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each reading of :func:`per_method`'s table against the paper's value.

    Returns ``(diffs, agreement)``: ``diffs`` one row per (column, reading, method) with ``ours``,
    ``paper`` and ``diff`` (ours − paper); ``agreement`` one row per (column, reading) with
    ``methods``, ``mean_abs_diff``, ``within_0.05`` and ``spearman_rho`` (NaN below 3 methods).
    Methods the paper has no row for (``fedbabu-pervisit``) are left out. Raises
    :class:`medpfl.report.paper.PaperTableError` for a bad paper table file and SystemExit when it
    has no values for ``dataset``."""
    from medpfl.report.paper import load_paper_table, rank_agreement

    paper = load_paper_table(paper_table)
    values = paper.values.get(dataset)
    if values is None:
        raise SystemExit(f"{paper_table}: no values for data set {dataset!r} (has {sorted(paper.values)})")
    rows = []
    part = table[table["dataset"] == dataset]
    for col in [c for c in part.columns if ":" in c]:
        column, reading = col.split(":")
        for method, ours in zip(part["method"], part[col]):
            cell = values.get(method, {}).get(column)
            if cell is None or pd.isna(ours):
                continue
            rows.append({"column": column, "reading": reading, "method": method, "ours": float(ours),
                         "paper": cell[0], "diff": float(ours) - cell[0]})
    diffs = pd.DataFrame(rows, columns=["column", "reading", "method", "ours", "paper", "diff"])
    # the report's own agreement (medpfl.report.paper.rank_agreement), one "block" per reading
    ranked = rank_agreement(diffs.assign(group=diffs["column"], block=diffs["reading"], metric=diffs["column"],
                                         label=diffs["column"]))
    within = (diffs.assign(w=diffs["diff"].abs() <= 0.05).groupby(["column", "reading"], sort=False)["w"].sum())
    agree = pd.DataFrame({"column": ranked["group"], "reading": ranked["block"], "methods": ranked["methods"],
                          "mean_abs_diff": ranked["mean_abs_diff"],
                          "within_0.05": [int(within[(c, r)]) for c, r in zip(ranked["group"], ranked["block"])],
                          "spearman_rho": ranked["spearman_rho"]})
    return diffs, agree


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a study's runs/ or archive/ folder")
    ap.add_argument("--out", type=Path, help="also write the per-method table as CSV")
    ap.add_argument("--paper-table", type=Path, help="compare every reading with this paper table "
                    "(e.g. config/papers/fedkper-table1.yaml)")
    ap.add_argument("--dataset", default="bloodmnist", help="the paper table's data set (default: bloodmnist)")
    a = ap.parse_args(argv)
    table = add_framework_reading(per_method(study_readings(a.folder)))
    if a.out:
        table.to_csv(a.out, index=False)
    for column in COLUMNS:
        cols = [c for c in table.columns if c.startswith(column + ":")]
        part = table[["method", "seeds", *cols]].rename(columns={c: c.split(":")[1] for c in cols})
        print(f"\n{column}\n{part.round(3).to_string(index=False)}")
    if a.paper_table:
        diffs, agree = against_paper(table, a.paper_table, a.dataset)
        for column in COLUMNS:
            d = diffs[diffs["column"] == column].pivot(index="method", columns="reading", values="diff")
            d.insert(0, "paper", diffs[diffs["column"] == column].groupby("method")["paper"].first())
            print(f"\n{column}: ours - paper\n{d.round(3).to_string()}")
        print(f"\nagreement with the paper per reading\n{agree.round(3).to_string(index=False)}")


if __name__ == "__main__":
    main()
