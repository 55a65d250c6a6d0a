"""Training seconds per round of the stacked executor with and without keeping each stacked
linear weight in its gradient's memory layout (``medpfl.fl.stacked._like_grad``), on the
pFedKD-WCL MNIST study's data (partition a0.05-n20: 5 of 20 clients per round, 20 true local
epochs, batch 20), in one run, alternating the two settings block by block so that load on the
machine hits both alike. Also says whether the two runs' records are identical, and first times
the SGD add that motivates it: a stack of 5 784x128 weights plus a gradient in the same layout,
and plus one laid out as vmap returns it (transposed).

Needs the MNIST study's data stage::

    snakemake data_all --cores all --configfile config/pfedkd-mnist.yaml
    python -m benchmarks.stacked_layout --method fedavg-mlp --rounds 3 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

import medpfl.fl.stacked as stacked
from benchmarks.study_job import run_study_job

_LIKE_GRAD = stacked._like_grad


def add_ms(transposed: bool, clients: int = 5, out: int = 128, inp: int = 784, reps: int = 300) -> float:
    """ms per in-place ``w.add_(g, alpha=-lr)`` on a [clients, out, inp] stack, ``g`` row-major
    or with each matrix transposed in memory (the strides vmap gives a linear weight's gradient)."""
    w = torch.randn(clients, out, inp)
    g = torch.randn(clients, inp, out).transpose(1, 2) if transposed else torch.randn(clients, out, inp)
    w.add_(g, alpha=-0.01)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        w.add_(g, alpha=-0.01)
    return 1e3 * (time.perf_counter() - t0) / reps


def run(method: str, partition: str, rounds: int, relayout: bool) -> tuple[list[float], pd.DataFrame]:
    """(training seconds per round, records) of ``rounds`` rounds of ``method`` on the stacked executor."""
    stacked._like_grad = _LIKE_GRAD if relayout else (lambda stack, grad: None)
    try:
        _, log, records = run_study_job("pfedkd-mnist", "mnist", partition, method, rounds, executor="stacked")
        return log["train_seconds"].tolist(), records
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
    print(f"torch {torch.__version__}, {a.threads} thread(s)")
    same, trans = add_ms(False), add_ms(True)
    print(f"SGD add on 5 x 784x128: gradient in the weight's layout {same:.3f} ms, transposed {trans:.3f} ms "
          f"({trans / same:.1f}x)")
    print(f"{a.method}, {a.partition}, {a.repeats} x {a.rounds} rounds per setting")
    run(a.method, a.partition, 1, True)  # warm-up, not timed: the process's first round pays one-time costs
    secs: dict[bool, list[float]] = {True: [], False: []}
    recs: dict[bool, pd.DataFrame] = {}
    for _ in range(a.repeats):
        for relayout in (False, True):
            s, recs[relayout] = run(a.method, a.partition, a.rounds, relayout)
            secs[relayout] += s
            print(f"relayout={relayout!s:5s} train s/round {' '.join(f'{x:.2f}' for x in s)}", flush=True)
    off, on = sum(secs[False]) / len(secs[False]), sum(secs[True]) / len(secs[True])
    print(f"mean train s/round: without {off:.2f}, with {on:.2f}; speed-up {off / on:.2f}x; "
          f"records identical: {recs[True].equals(recs[False])}")


if __name__ == "__main__":
    main()
