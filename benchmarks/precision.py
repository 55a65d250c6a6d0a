"""Accuracy effect of bf16 mixed precision (autocast of the local forward/backward) against
fp32, on the default study's setting: BloodMNIST, K=20, Dirichlet 0.1, 10 % participation,
5 local epochs, FedKPer and FedAvg, same seed and schedule.

    python benchmarks/precision.py --rounds 10
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.executors import load_blood
from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig, partition_config
from medpfl.data.partition import build_partition
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine, resolve_device
from medpfl.fl.functional import make_forward
from medpfl.metrics import summarize_run
from medpfl.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedkper"])
    a = ap.parse_args()
    dev = resolve_device(a.device)
    blood = load_blood()
    pool = blood.samples[blood.samples["split"] == "train"]
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), partition_config(), "dir0.1")
    data = FederatedData.build(blood, table, dev)
    print(f"device {dev}, {a.rounds} rounds")
    print(f"{'method':<8} {'precision':<9} {'avg global':>10} {'final global':>12} {'avg local':>9} {'train s/round':>13}")
    for method in a.methods:
        for precision in ("fp32", "bf16"):
            cls, cfg = resolve_method(method, {})
            algo = cls(cfg, make_forward(build_model("cnn4", 3, 8, 28).to("meta")), 8)
            train = TrainConfig(rounds=a.rounds, precision=precision, checkpoint_every=0)
            t = time.perf_counter()
            res = Engine(algo, data, train, EvalConfig(), seed=1).run()
            _, s = summarize_run(res.records, res.rounds, 20, True, False)
            print(f"{method:<8} {precision:<9} {s['avg_global_acc']:>10.3f} {s['final_global_acc']:>12.3f} "
                  f"{s['avg_local_acc']:>9.3f} {s['train_seconds_per_round']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
