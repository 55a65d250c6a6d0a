"""How noisy a run's final-round score is: per finished run under a study's results folder, the
paper's per-round metric (every client's accuracy on its own test split, unweighted mean over
clients, with the model the method deploys) at the final round, its last-10-round mean, and its
mean, std (ddof=1), min and max over the last ``--last`` rounds, in %.

The deployed model's view is ``personalized_on_local`` where the run recorded one and
``global_on_local`` otherwise, the rule ``medpfl evaluate`` applies for ``deployed_acc_mean`` and
``final_client_acc_mean``. Reads only ``records.parquet`` (so it also reads runs not yet
evaluated); ``docs/studies.md`` (pFedKD-WCL) quotes its output::

    python scripts/round_spread.py results/pfedkd-mnist --last 50
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from medpfl.report.paper import round_spread

def spread(records: pd.DataFrame, last: int) -> dict[str, float]:
    """Final, last-10 mean and last-``last`` mean/std/min/max of the per-round mean client accuracy (%)
    of the deployed model's view."""
    view = "personalized_on_local" if (records["view"] == "personalized_on_local").any() else "global_on_local"
    per = (100 * records[records["view"] == view].groupby("round")["accuracy"].mean()).rename("acc").reset_index()
    tail = round_spread([per], "acc", last)  # the report's side-by-side spread, on one run
    return {"final": round_spread([per], "acc", 1).mean, "last10": round_spread([per], "acc", 10).mean,
            f"last{last} mean": tail.mean, f"last{last} std": tail.std, f"last{last} min": tail.low,
            f"last{last} max": tail.high}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a study's results folder, e.g. results/pfedkd-mnist")
    ap.add_argument("--last", type=int, default=50)
    a = ap.parse_args()
    rows = []
    for f in sorted(a.results.glob("runs/*/*/*/seed*/records.parquet")):
        dataset, partition, method, seed = f.parts[-5:-1]
        s = spread(pd.read_parquet(f), a.last)
        rows.append({"dataset": dataset, "partition": partition, "method": method, "seed": seed, **s})
    if not rows:
        raise SystemExit(f"{a.results}: no runs/*/*/*/seed*/records.parquet")
    print(pd.DataFrame(rows).round(2).to_string(index=False))


if __name__ == "__main__":
    main()
