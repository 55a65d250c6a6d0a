"""Training seconds per round of the sequential and the stacked executor on the pFedKD-WCL
Synthetic(0.5, 0.5) study's data (100 clients of 250 to 25,810 samples, 10 per round, 20 true
local epochs, batch 20), for one method variant of ``config/pfedkd-synthetic.yaml``.

It backs that config's choice of the sequential executor for the FedAvg-style methods: a round's
steps are mostly its largest client's, which the stacked executor runs on a stack of one. Both
executors see the same client schedule. Needs the study's data stage::

    snakemake data_all --cores all --configfile config/pfedkd-synthetic.yaml
    python -m benchmarks.synthetic_executors --method fedavg-mlp --rounds 4
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.study_job import run_study_job


def train_seconds(method: str, rounds: int, executor: str) -> list[float]:
    """Per-round training seconds of ``method`` for ``rounds`` rounds with ``executor``."""
    _, log, _ = run_study_job("pfedkd-synthetic", "synthetic_0.5_0.5", "natural", method, rounds, executor=executor)
    return log["train_seconds"].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="fedavg-mlp")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.method}, {a.rounds} rounds")
    for ex in ("sequential", "stacked"):
        s = train_seconds(a.method, a.rounds, ex)
        print(f"{ex:10s} total {sum(s):6.1f} s  per round {' '.join(f'{x:.2f}' for x in s)}", flush=True)


if __name__ == "__main__":
    main()
