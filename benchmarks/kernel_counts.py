"""Kernels (aten ops) per local step of the stacked executor, forward+backward vs optimizer, on the CPU.

One training round of the FedKPer-paper round's shape on synthetic 3x28x28 data (4-layer CNN
``cnn4``, K=20 clients, all 20 training, Dirichlet 0.5, 1 local epoch, batch 12) on the stacked
executor, on plain CPU tensors, under a ``TorchDispatchMode`` that counts every aten op (what a
GPU would launch as a kernel, before any fusion; under ``vmap`` and autograd the mode sees the
batched ops). Four runs:

- ``fedavg-sgd``: FedAvg, SGD with momentum 0.9 and weight decay 5e-4;
- ``fedkper-sgd``: FedKPer (KD from the downloaded teacher), the same SGD, no clip
  (``clip_grad_norm: null``, the authors' code);
- ``fedkper-sgd-clip``: FedKPer with ``clip_grad_norm: 5`` (the paper's and the default: a
  per-client global-norm clip before the SGD step);
- ``fedavg-adam``: FedAvg, Adam (lr 1e-3, betas 0.9/0.999, weight decay 5e-4).

Regions: ``optimizer`` is every ``medpfl.fl.optim.Chain.step_`` call; ``forward+backward`` is
the rest of the phases' step loops (``StackedExecutor._run_phase_stacked``: batch gather,
forward, backward, layout moves, the step counter). Counted per step of the stacked loop
(every client at once): ``ops`` (all aten ops) and ``kernels`` (ops less views and
allocations, which launch nothing on a GPU: ops whose schema is a view, ``detach``, ``alias``,
``_unsafe_view``, ``empty*``). The counts are deterministic.

    python -m benchmarks.kernel_counts --label before          # writes benchmarks/results/kernel_counts_cpu.json
    python -m benchmarks.kernel_counts --label after --merge   # adds an entry beside it
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import medpfl.fl.optim as optim
import medpfl.fl.stacked as stacked
from benchmarks.host_syncs import _data, write_entry
from medpfl.config import EvalConfig, OptimizerConfig, TrainConfig
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor

OUT = Path(__file__).parent / "results" / "kernel_counts_cpu.json"

#: (name, method, method config, optimizer config)
RUNS = [
    ("fedavg-sgd", "fedavg", {}, {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
    ("fedkper-sgd", "fedkper", {"clip_grad_norm": None}, {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
    ("fedkper-sgd-clip", "fedkper", {"clip_grad_norm": 5.0},
     {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}),
    ("fedavg-adam", "fedavg", {}, {"name": "adam", "lr": 1e-3, "momentum": None, "weight_decay": 5e-4}),
]

_NO_KERNEL = {"detach", "alias", "_unsafe_view", "empty", "empty_strided", "empty_like", "lift_fresh"}


def _launches(func) -> bool:
    """Whether the aten op launches a kernel on a GPU (not a view or an allocation)."""
    return not (func.is_view or func._schema.name.split("::")[-1] in _NO_KERNEL)


class OpCounter(TorchDispatchMode):
    """Counts aten ops per region (``ops``, ``kernels``: Counters by region; ``names``: Counter of
    ``(region, op name)`` for the kernels)."""

    def __init__(self):
        super().__init__()
        self.region = "outside"
        self.ops: Counter = Counter()
        self.kernels: Counter = Counter()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.region] += 1
        if _launches(func):
            self.kernels[self.region] += 1
            self.names[(self.region, str(func.overloadpacket.__name__))] += 1
        return func(*args, **(kwargs or {}))


def count_round(processed, table, run: tuple, batch_size: int) -> dict:
    from medpfl.algorithms import resolve_method
    from medpfl.fl.functional import make_forward, template_on
    from medpfl.models import build_model

    name, method, mcfg, ocfg = run
    mode = OpCounter()
    steps = Counter()
    real_autocast, real_phase, real_step = (SequentialExecutor.autocast, stacked.StackedExecutor._run_phase_stacked,
                                            optim.Chain.step_)

    def autocast(self):  # once per step of the stacked loop
        steps["n"] += 1
        return real_autocast(self)

    def in_region(region, fn):  # ops inside fn count to region (the optimizer's step nests in the phase)
        def wrapped(*a, **kw):
            prev, mode.region = mode.region, region
            try:
                return fn(*a, **kw)
            finally:
                mode.region = prev
        return wrapped

    phase, step = in_region("forward+backward", real_phase), in_region("optimizer", real_step)

    patches = [(SequentialExecutor, "autocast", autocast), (stacked.StackedExecutor, "_run_phase_stacked", phase),
               (optim.Chain, "step_", step)]
    saved = [(o, n, o.__dict__[n] if n in o.__dict__ else getattr(o, n)) for o, n, _ in patches]
    for o, n, f in patches:
        setattr(o, n, f)
    try:
        dev = torch.device("cpu")
        data = FederatedData.build(processed, table, dev)
        cls, cfg = resolve_method(method, {method: mcfg})
        model = build_model("cnn4", 3, 4, 28, {})
        algo = cls(cfg, make_forward(template_on(model, dev)), 4)
        train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=batch_size, checkpoint_every=0,
                            model="cnn4", optimizer=OptimizerConfig(**ocfg))
        eng = Engine(algo, data, train, EvalConfig(every=1), seed=1, executor_kind="stacked", fingerprint="kernels")
        with mode:
            eng.run()
    finally:
        for o, n, f in saved:
            setattr(o, n, f)
    n = max(1, steps["n"])
    leaves = sum(1 for p in model.parameters() if p.requires_grad)
    per = lambda c, r: round(c[r] / n, 2)  # noqa: E731
    return {"run": name, "method": method, "method_config": mcfg, "optimizer": ocfg, "stacked_steps": steps["n"],
            "trained_leaves": leaves,
            "ops_per_step": {"forward+backward": per(mode.ops, "forward+backward"), "optimizer": per(mode.ops, "optimizer")},
            "kernels_per_step": {"forward+backward": per(mode.kernels, "forward+backward"),
                                 "optimizer": per(mode.kernels, "optimizer")},
            "optimizer_kernels_by_op": {k: round(v / n, 2) for (r, k), v in sorted(mode.names.items())
                                        if r == "optimizer"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=[r[0] for r in RUNS], choices=[r[0] for r in RUNS])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge", action="store_true", help="add to the entries already in --out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        processed, table = _data(Path(tmp), args.clients)
        for run in RUNS:
            if run[0] not in args.runs:
                continue
            r = count_round(processed, table, run, args.batch_size)
            print(f"{args.label:8s} {r['run']:18s} steps {r['stacked_steps']:3d}  kernels/step: forward+backward "
                  f"{r['kernels_per_step']['forward+backward']:7.2f}, optimizer {r['kernels_per_step']['optimizer']:6.2f}"
                  f"  (ops {r['ops_per_step']['forward+backward']:.2f} / {r['ops_per_step']['optimizer']:.2f})")
            rows.append(r)
    write_entry(args, "runs", rows)


if __name__ == "__main__":
    main()
