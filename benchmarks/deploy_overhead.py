"""Seconds per round of a deployed run (Flower, real processes on loopback) against the simulator
on the same job, and whether their records agree.

A SuperLink and K SuperNodes (one client each) run on this machine over TLS with SuperNode
authentication (:class:`medpfl.deploy.processes.LocalFederation`); the same job then runs in the
simulator (``medpfl.train``, sequential executor). Both write ``rounds.parquet``; the script
prints the median round, train and evaluation seconds of each, their ratio, the round's messages
and the largest record difference. Run from the repository root:

    python -m benchmarks.deploy_overhead --method fedavg --rounds 4 --clients 3

The synthetic data set of the tests (28 px, 4 classes) keeps local compute small, so the ratio
shows Flower's per-message cost (a ClientApp process per message, replies pulled every 0.25 s)
rather than training; with real models the compute dominates and the ratio falls toward 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="fedavg")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--insecure", action="store_true", help="plain HTTP, no node authentication")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)

    from medpfl.deploy.processes import LocalFederation
    from medpfl.train import run_training
    from tests.conftest import prepare_train_jobs

    d = Path(tempfile.mkdtemp(prefix="medpfl-deploy-bench-"))
    jobs, _ = prepare_train_jobs(d, methods=(a.method,), num_clients=a.clients, counts=(100 * a.clients, 20, 30 * a.clients),
                                 mlflow=False, train={"rounds": a.rounds, "local_epochs": 1, "participation": 1.0,
                                                      "batch_size": 16, "checkpoint_every": 1})
    job = jobs[0]
    (d / "job.json").write_text(json.dumps(job))
    files = {"arrays": str(d / "arrays.npz"), "samples": str(d / "samples.parquet"),
             "partition-table": str(d / "partition.parquet")}
    sites = [{**files, "client-ids": str(c), "state-dir": str(d / f"site{c}")} for c in range(a.clients)]
    t0 = time.perf_counter()
    with LocalFederation(d / "fed", sites, tls=not a.insecure) as fed:
        t_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        fed.run({"job": str(d / "job.json"), **files, "out-dir": str(d / "deployed"), "parent": "", "timeout": 300.0})
        t_dep = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", d / "simulated")
    t_sim = time.perf_counter() - t0
    rd, rs = (pd.read_parquet(d / x / "rounds.parquet") for x in ("deployed", "simulated"))
    key = ["round", "view", "client_id"]
    ed, es = (pd.read_parquet(d / x / "records.parquet").sort_values(key).reset_index(drop=True)
              for x in ("deployed", "simulated"))
    res = {
        "method": a.method, "rounds": a.rounds, "clients": a.clients, "tls": not a.insecure,
        "machine": platform.processor() or platform.machine(),
        "federation_start_s": round(t_start, 2), "deployed_wall_s": round(t_dep, 2), "simulated_wall_s": round(t_sim, 2),
        "deployed_round_s_median": round(float(rd["round_seconds"].median()), 3),
        "simulated_round_s_median": round(float(rs["round_seconds"].median()), 3),
        "deployed_train_s_median": round(float(rd["train_seconds"].median()), 3),
        "deployed_eval_s_median": round(float(rd["eval_seconds"].median()), 3),
        "round_ratio": round(float(rd["round_seconds"].median() / rs["round_seconds"].median()), 1),
        "same_correct_counts": bool((ed[key + ["correct"]].values == es[key + ["correct"]].values).all()),
        "max_loss_diff": float(np.abs(ed["loss"].values - es["loss"].values).max()),
    }
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
