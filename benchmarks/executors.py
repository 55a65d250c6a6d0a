"""Throughput of the sequential and stacked executors on the FedKPer-paper round configuration.

Part 1: BloodMNIST, the 4-layer CNN, K = 20 clients (Dirichlet 0.1, the authors' partition),
5 local epochs, batch 12, FedKPer; participation 10 % and 100 %; both executors, in one
process. Part 2: full participation with K = 20, 100, 500 clients (Dirichlet 0.5), to see how
time per round grows with the number of participating clients.

Reported per configuration: training samples/s (sum over participating clients of local
train size x epochs, divided by training seconds), seconds per round for training and for
evaluation separately (median over the measured rounds; the first round is a warm-up and is
excluded), peak GPU memory and mean GPU utilisation (CUDA only), and the ratio stacked /
sequential. Results go to stdout and to ``benchmarks/results/<host-device>.json``.

    python benchmarks/executors.py                      # both parts, auto device
    python benchmarks/executors.py --part 1 --rounds 3
    python benchmarks/executors.py --precision bf16     # mixed precision (autocast) for training
    python benchmarks/executors.py --part 1 --executors stacked stacked-fixed   # fixed-shape steps' cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import torch

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig, partition_config
from medpfl.data.partition import build_partition
from medpfl.data.preprocess import ProcessedData, load_official_npz
from medpfl.data.sources import default_mirrors, fetch
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine, resolve_device
from medpfl.fl.functional import make_forward
from medpfl.models import build_model

HERE = Path(__file__).resolve().parent


def load_blood() -> ProcessedData:
    import pandas as pd

    raw = HERE.parent / "data" / "raw" / "bloodmnist.npz"
    if not raw.exists():
        fetch("bloodmnist", raw, mirrors=default_mirrors(HERE.parent))
    parts = load_official_npz(raw, 8, 3)
    images = np.concatenate([parts[s][0] for s in ("train", "val", "test")])
    labels = np.concatenate([parts[s][1] for s in ("train", "val", "test")])
    splits = np.concatenate([[s] * len(parts[s][1]) for s in ("train", "val", "test")])
    samples = pd.DataFrame({"sample_id": np.arange(len(labels)), "split": splits,
                            "index_in_split": np.concatenate([np.arange(len(parts[s][1])) for s in ("train", "val", "test")]),
                            "label": labels})
    return ProcessedData(images=images, labels=labels, samples=samples, num_classes=8)


class GpuSampler:
    """Mean GPU utilisation from ``nvidia-smi`` sampled every 0.2 s (CUDA only)."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"
        self.samples: list[float] = []
        self._stop = threading.Event()

    def __enter__(self):
        if self.on:
            self._t = threading.Thread(target=self._loop, daemon=True)
            self._t.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout.split()
                self.samples.append(float(out[0]))
            except Exception:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc):
        self._stop.set()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def run_one(data: FederatedData, executor: str, participation: float, rounds: int, epochs: int, precision: str) -> dict:
    cls, cfg = resolve_method("fedkper", {})
    algo = cls(cfg, make_forward(build_model("cnn4", 3, 8, 28).to("meta")), 8)
    kind = "stacked" if executor == "stacked-fixed" else executor
    train = TrainConfig(rounds=rounds, participation=participation, local_epochs=epochs, batch_size=12,
                        executor=kind, precision=precision, checkpoint_every=0)
    dev = data.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with GpuSampler(dev) as gpu:
        eng = Engine(algo, data, train, EvalConfig(every=1, batch_size=4096), seed=1, executor_kind=kind)
        if executor == "stacked-fixed":  # fixed-shape masked steps, eager (train.cuda_graphs's step shape)
            eng.clients.executor._fixed_shape_steps = True
        res = eng.run()
    rd = res.rounds.iloc[1:] if len(res.rounds) > 1 else res.rounds
    sizes = np.array([len(t) for t in data.client_train])
    samples = [sizes[[int(c) for c in s.split()]].sum() * epochs for s in rd["sampled_clients"]]
    train_s = rd["train_seconds"].to_numpy()
    g = res.records[res.records["view"] == "global_test"]
    return {
        "executor": executor, "participation": participation, "clients": data.num_clients,
        "clients_per_round": int(res.rounds["num_sampled"].iloc[0]), "rounds_measured": len(rd),
        "samples_per_s": float(np.sum(samples) / np.sum(train_s)),
        "train_s_per_round": float(np.median(train_s)), "eval_s_per_round": float(np.median(rd["eval_seconds"])),
        "gpu_mem_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "gpu_util_pct": gpu.mean, "final_global_acc": float(g["accuracy"].iloc[-1]),
    }


def fmt(r: dict) -> str:
    mem = f"{r['gpu_mem_gb']:.2f}" if r["gpu_mem_gb"] is not None else "-"
    util = f"{r['gpu_util_pct']:.0f}" if r["gpu_util_pct"] is not None else "-"
    return (f"{r['executor']:<10} K={r['clients']:<4} m={r['clients_per_round']:<4} {r['samples_per_s']:>10.0f} "
            f"{r['train_s_per_round']:>9.2f} {r['eval_s_per_round']:>8.2f} {mem:>7} {util:>5}")


HEADER = f"{'executor':<10} {'K':<6} {'m':<6} {'samples/s':>10} {'train s/r':>9} {'eval s/r':>8} {'GPU GB':>7} {'util%':>5}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--part", type=int, choices=[0, 1, 2], default=0, help="0 = both")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per configuration (the first is a warm-up)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--scale", type=int, nargs="+", default=[20, 100, 500])
    ap.add_argument("--scale-rounds", type=int, default=2)
    ap.add_argument("--scale-epochs", type=int, default=0, help="local epochs in part 2 (default: --epochs)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--executors", nargs="+", default=["sequential", "stacked"],
                    help="sequential, stacked, stacked-fixed (the stacked executor's fixed-shape masked steps)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--participation", type=float, nargs="+", default=[0.1, 1.0], help="part 1 participation rates")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = resolve_device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.processor() or 'cpu'} x{torch.get_num_threads()} threads"
    print(f"device: {dev} ({name}); torch {torch.__version__}; precision {a.precision}")
    blood = load_blood()
    pool = blood.samples[blood.samples["split"] == "train"]
    out = {"device": str(dev), "device_name": name, "torch": torch.__version__, "precision": a.precision,
           "epochs": a.epochs, "part1": [], "part2": []}

    if a.part in (0, 1):
        table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                                partition_config(num_clients=20, alpha=0.1, seed=1, local_test={"rule": "fedkper"}), "bench")
        data = FederatedData.build(blood, table, dev)
        print(f"\nPart 1: FedKPer round, BloodMNIST, K=20, {a.epochs} local epochs, batch 12, {a.rounds} rounds "
              f"(first excluded)\n{HEADER}")
        for part in a.participation:
            rows = {}
            for ex in a.executors:
                rows[ex] = run_one(data, ex, part, a.rounds, a.epochs, a.precision)
                out["part1"].append(rows[ex])
                print(fmt(rows[ex]), flush=True)
            if {"sequential", "stacked"} <= set(rows):
                ratio = rows["stacked"]["samples_per_s"] / rows["sequential"]["samples_per_s"]
                print(f"  participation {part:.0%}: stacked / sequential samples/s = {ratio:.2f}x")
                out[f"ratio_participation_{part}"] = ratio

    if a.part in (0, 2):
        ep2 = a.scale_epochs or a.epochs
        print(f"\nPart 2: full participation, K = {a.scale}, Dirichlet 0.5, {ep2} local epochs, {a.scale_rounds} rounds"
              f"\n{HEADER}")
        for k in a.scale:
            table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                                    partition_config(num_clients=k, alpha=0.5, seed=1, min_samples=5), f"bench{k}")
            data = FederatedData.build(blood, table, dev)
            for ex in a.executors:
                try:
                    r = run_one(data, ex, 1.0, a.scale_rounds, ep2, a.precision)
                except torch.OutOfMemoryError as e:
                    print(f"{ex:<10} K={k:<4} out of memory: {e}")
                    continue
                out["part2"].append(r)
                print(fmt(r), flush=True)
    res_dir = HERE / "results"
    res_dir.mkdir(exist_ok=True)
    path = res_dir / f"{platform.node()}-{dev.type}-{a.precision}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
