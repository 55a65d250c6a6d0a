"""Kernels (aten ops that launch) per round of local training for S seeds of one method: run
separately (S engines, the stacked executor each) against ``train.stack_seeds`` (one merged
program, :mod:`medpfl.fl.seed_stack`), on the CPU.

The FedKPer paper's round shape on synthetic 3x28x28 data (``cnn4``, K=20 clients, participation
0.1: 2 clients a round, Dirichlet 0.5, batch 12, 1 local epoch to keep it short), 3 seeds, 2
rounds. Every aten op inside ``StackedExecutor.train_clients`` is counted under a
``TorchDispatchMode`` (``benchmarks.kernel_counts.OpCounter``: what a GPU would launch, before
any fusion; views and allocations do not count). Counts are deterministic; the CPU's wall
times are printed beside them but are no GPU figure (on a CPU the batched kernels are
compute-bound, so stacking saves little time there).

    python -m benchmarks.seed_stack_kernels   # writes benchmarks/results/seed_stack_kernels_cpu.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import medpfl.fl.stacked as stacked
from benchmarks.host_syncs import _data, write_entry
from benchmarks.kernel_counts import OpCounter
from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.seed_stack import run_seed_stack

OUT = Path(__file__).parent / "results" / "seed_stack_kernels_cpu.json"


def measure(method: str, seeds: tuple[int, ...], rounds: int, k: int, folder: Path) -> dict:
    """Kernels and calls of local training over ``rounds`` rounds of ``method`` for ``seeds``,
    separate and stacked; wall seconds of each whole run (CPU)."""
    from medpfl.algorithms import resolve_method
    from medpfl.fl.functional import make_forward, template_on
    from medpfl.models import build_model

    processed, table = _data(folder, k)
    data = FederatedData.build(processed, table, torch.device("cpu"))
    train = TrainConfig(rounds=rounds, participation=0.1, local_epochs=1, batch_size=12, checkpoint_every=0,
                        model="cnn4")

    def engine(seed: int) -> Engine:
        cls, cfg = resolve_method(method, {})
        algo = cls(cfg, make_forward(template_on(build_model("cnn4", 3, 4, 28, {}), "cpu")), 4)
        return Engine(algo, data, train, EvalConfig(every=rounds), seed=seed, executor_kind="stacked",
                      fingerprint="seed-stack-kernels")

    mode = OpCounter()
    calls = {"n": 0}
    real = stacked.StackedExecutor.train_clients

    def counted(self, *a, **kw):
        calls["n"] += 1
        prev, mode.region = mode.region, "local training"
        try:
            return real(self, *a, **kw)
        finally:
            mode.region = prev

    out = {}
    stacked.StackedExecutor.train_clients = counted
    try:
        for how in ("separate", "stacked"):
            mode.kernels.clear()
            mode.ops.clear()
            calls["n"] = 0
            t0 = time.perf_counter()
            with mode:
                if how == "separate":
                    for s in seeds:
                        engine(s).run()
                else:
                    outcomes = run_seed_stack([engine(s) for s in seeds])
                    assert all(o.error is None and o.merged_rounds == rounds for o in outcomes)
            out[how] = {"train_clients_calls": calls["n"], "kernels": mode.kernels["local training"],
                        "ops": mode.ops["local training"], "cpu_wall_s": round(time.perf_counter() - t0, 2)}
    finally:
        stacked.StackedExecutor.train_clients = real
    out["kernels_ratio_separate_over_stacked"] = round(out["separate"]["kernels"] / out["stacked"]["kernels"], 2)
    return {"method": method, "seeds": list(seeds), "rounds": rounds, "clients": k, "clients_per_round": 2,
            "model": "cnn4", "batch_size": 12, "local_epochs": 1, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="stack_seeds")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    a.clients, a.batch_size, a.merge = 20, 12, False
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(m, (1, 2, 3), 2, 20, Path(tmp)) for m in ("fedavg", "fedkper")]
    for r in runs:
        print(f"{r['method']}: {r['separate']['kernels']} kernels in {r['separate']['train_clients_calls']} calls "
              f"separate, {r['stacked']['kernels']} in {r['stacked']['train_clients_calls']} stacked "
              f"({r['kernels_ratio_separate_over_stacked']}x); CPU wall {r['separate']['cpu_wall_s']} s vs "
              f"{r['stacked']['cpu_wall_s']} s")
    write_entry(a, "runs", runs)


if __name__ == "__main__":
    main()
