"""Training seconds per round of the stacked executor with and without keeping each stacked
linear weight in its gradient's memory layout (``medpfl.fl.stacked._like_grad``), on the
pFedKD-WCL MNIST study's data (partition a0.05-n20: 5 of 20 clients per round, 20 true local
epochs, batch 20), in one run, alternating the two settings round block by round block so that
load on the machine hits both alike. Also says whether the two runs' records are identical.

Needs the MNIST study's data stage::

    snakemake data_all --cores all --configfile config/pfedkd-mnist.yaml
    python -m benchmarks.stacked_layout --method fedavg-mlp --rounds 3 --repeats 2
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd
import torch

import medpfl.fl.stacked as stacked
from medpfl.config import load_params, train_job
from medpfl.train import run_training

_LIKE_GRAD = stacked._like_grad


def run(root: Path, method: str, partition: str, rounds: int, relayout: bool) -> tuple[list[float], pd.DataFrame]:
    """(training seconds per round, records) of ``rounds`` rounds of ``method`` on the stacked executor."""
    stacked._like_grad = _LIKE_GRAD if relayout else (lambda stack, grad: None)
    params = load_params(root / "params.yaml", [root / "config" / "pfedkd-mnist.yaml"])
    job = train_job(params, "mnist", partition, method, 1)
    job["train"].update(rounds=rounds, executor="stacked", checkpoint_every=0)
    try:
        with tempfile.TemporaryDirectory() as out:
            run_training(job, root / "data" / "processed" / "mnist.npz", root / "data" / "processed" / "mnist.samples.parquet",
                         root / "data" / "partitions" / "mnist" / partition / "partition.parquet", Path(out))
            return (pd.read_parquet(Path(out) / "rounds.parquet")["train_seconds"].tolist(),
                    pd.read_parquet(Path(out) / "records.parquet"))
    finally:
        stacked._like_grad = _LIKE_GRAD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="fedavg-mlp")
    ap.add_argument("--partition", default="a0.05-n20")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="alternating blocks per setting")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(__file__).resolve().parents[1]
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.method}, {a.partition}, "
          f"{a.repeats} x {a.rounds} rounds per setting")
    secs: dict[bool, list[float]] = {True: [], False: []}
    recs: dict[bool, pd.DataFrame] = {}
    for _ in range(a.repeats):
        for relayout in (False, True):
            s, recs[relayout] = run(root, a.method, a.partition, a.rounds, relayout)
            secs[relayout] += s
            print(f"relayout={relayout!s:5s} train s/round {' '.join(f'{x:.2f}' for x in s)}", flush=True)
    off, on = sum(secs[False]) / len(secs[False]), sum(secs[True]) / len(secs[True])
    print(f"mean train s/round: without {off:.2f}, with {on:.2f}; speed-up {off / on:.2f}x; "
          f"records identical: {recs[True].equals(recs[False])}")


if __name__ == "__main__":
    main()
