"""Cost of one local SGD step in the engine against a bare PyTorch loop, on the pFedKD-WCL MNIST
setting (MLR and MLP 784-128-10, batch 20, SGD lr 0.01 without momentum).

The engine side runs FedAvg for a few rounds of 20 true epochs through ``medpfl.train`` with
the sequential executor and divides the rounds' training seconds by the number of SGD steps the
sampled clients took (ceil(n_train / 20) * 20 per client). The bare side times
``loss.backward(); opt.step()`` on ``torch.nn`` modules of the same shape for as many steps.
Prints ms per step for both and their ratio. Needs the data stage of the MNIST study::

    snakemake data_all --cores all --configfile config/pfedkd-mnist.yaml
    python -m benchmarks.step_overhead --rounds 2
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from benchmarks.study_job import run_study_job
from medpfl.data.schemas import SharedPartitionTable, validate
from medpfl.io import read_parquet
from medpfl.models import build_model


def bare_ms_per_step(model: str, steps: int, batch: int = 20) -> float:
    """ms per SGD step of a plain ``nn.Module`` of the zoo's ``model`` on random 28x28 inputs."""
    torch.manual_seed(0)
    net = build_model(model, 1, 10, 28, {"hidden": 128} if model == "mlp" else {})
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(2000, 1, 28, 28), torch.randint(0, 10, (2000,))
    t0 = time.perf_counter()
    for i in range(steps):
        j = (i * batch) % (2000 - batch)
        loss = torch.nn.functional.cross_entropy(net(x[j:j + batch]), y[j:j + batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return 1e3 * (time.perf_counter() - t0) / steps


def engine_ms_per_step(model: str, partition: str, rounds: int, root: Path) -> tuple[float, int]:
    """ms per SGD step of FedAvg-<model> in the engine; returns (ms, steps timed)."""
    job, log, _ = run_study_job("pfedkd-mnist", "mnist", partition, f"fedavg-{model}", rounds, root,
                                executor="sequential")
    table_path = root / "data" / "partitions" / "mnist" / partition / "partition.parquet"
    table = validate(SharedPartitionTable, read_parquet(table_path), str(table_path))
    n_train = table[table["local_split"] == "train"].groupby("client_id").size()
    bs, epochs = job["train"]["batch_size"], job["train"]["local_epochs"]
    log = log.iloc[1:] if len(log) > 1 else log  # the first round warms up
    steps = sum(math.ceil(n_train[int(c)] / bs) * epochs for s in log["sampled_clients"] for c in s.split())
    return 1e3 * log["train_seconds"].sum() / steps, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="FedAvg rounds per model (the first is a warm-up)")
    ap.add_argument("--partition", default="a0.05-n20")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    root = Path(__file__).resolve().parents[1]
    print(f"torch {torch.__version__}, {a.threads} thread(s), partition {a.partition}")
    print("model  engine ms/step  bare ms/step  ratio  (steps timed)")
    for model in ("mlr", "mlp"):
        eng, steps = engine_ms_per_step(model, a.partition, a.rounds, root)
        bare = bare_ms_per_step(model, min(steps, 5000))
        print(f"{model:5s}  {eng:14.3f}  {bare:11.3f}  {eng / bare:5.2f}  ({steps})")


if __name__ == "__main__":
    main()
