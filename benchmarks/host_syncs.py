"""Host synchronisations and kernels (aten ops) per local step of one round, on the CPU.

The round runs on the emulated accelerator (:mod:`medpfl.fl.emulated_device`: every tensor on
the ``emu`` device, values on the CPU), which counts every aten op (a kernel a GPU would
launch, before any fusion) and every host synchronisation a CUDA run would make: values read on
the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``), value-dependent shapes
(``nonzero``, boolean indexing), copies to and from the host. Setting: the FedKPer-paper round's
shape on synthetic 3x28x28 data (4-layer CNN ``cnn4``, K=20 clients, all 20 training, Dirichlet
0.5, 1 local epoch, batch 12), one round of FedAvg and of FedKPer, each executor.

Counted per round in three regions: ``local training`` (the executor's ``train_clients``, from
the download to the uploads: preparation, local steps, finish), its part ``local steps`` (every
phase's steps: the executors' ``_run_phase``/``_run_phase_stacked`` calls; on the stacked
executor there must be none) and ``rest of the round`` (the server side, the divergence guard,
the evaluation and its records); the run's set-up (``run set-up``: the initial model and the
schedule put on the device, once per run) is counted apart. ``ops_per_step``: the ops of
``local training`` divided by the local steps taken (stacked: steps of the stacked loop, every
client at once; sequential: the sum over clients). The counts are deterministic.

    python -m benchmarks.host_syncs                     # writes benchmarks/results/host_syncs_cpu.json
    python -m benchmarks.host_syncs --label before --out /tmp/before.json

``--label`` names the code state in the output (e.g. ``before``/``after`` a change); with
``--merge`` the new entry is added to an existing file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch

import medpfl.fl.stacked as stacked
from medpfl.config import EvalConfig, TrainConfig, partition_config
from medpfl.data.partition import build_partition
from medpfl.data.preprocess import load_processed, preprocess
from medpfl.data.synthetic import write_synthetic_npz
from medpfl.fl.data import FederatedData
from medpfl.fl.emulated_device import EmulatedDevice, register_device
from medpfl.fl.engine import Engine
from medpfl.fl.executors import SequentialExecutor

OUT = Path(__file__).parent / "results" / "host_syncs_cpu.json"


def _data(folder: Path, k: int) -> tuple:
    write_synthetic_npz(folder / "s.npz", num_classes=4, n_channels=3, size=28, counts=(2400, 40, 120), seed=0)
    preprocess(folder / "s.npz", folder / "a.npz", folder / "s.parquet", 4, 3)
    processed = load_processed(folder / "a.npz", folder / "s.parquet")
    pool = processed.samples[processed.samples["split"] == "train"]
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                            partition_config(num_clients=k, alpha=0.5, seed=1, min_samples=20), "t")
    return processed, table


def count_round(processed, table, method: str, executor: str, batch_size: int) -> dict:
    """One evaluated round of ``method`` on ``executor``; the counts per region."""
    from medpfl.algorithms import resolve_method
    from medpfl.fl.functional import make_forward, template_on
    from medpfl.models import build_model

    mode = EmulatedDevice(record_sites=True)
    steps = Counter()
    real_autocast = SequentialExecutor.autocast

    def autocast(self):  # called once per local step by both executors
        steps["n"] += 1
        return real_autocast(self)

    real_train = SequentialExecutor.train_clients
    real_stacked = stacked.StackedExecutor.train_clients

    def region(fn):
        def wrapped(*a, **kw):
            with mode.region("local training"):
                return fn(*a, **kw)
        return wrapped

    def phase(fn):
        def wrapped(*a, **kw):
            with mode.region("local steps"):
                return fn(*a, **kw)
        return wrapped

    def setup(fn):
        def wrapped(*a, **kw):
            with mode.region("run set-up"):
                return fn(*a, **kw)
        return wrapped

    patches = [(SequentialExecutor, "autocast", autocast), (SequentialExecutor, "train_clients", region(real_train)),
               (stacked.StackedExecutor, "train_clients", region(real_stacked)),
               (SequentialExecutor, "_run_phase", phase(SequentialExecutor._run_phase)),
               (stacked.StackedExecutor, "_run_phase_stacked", phase(stacked.StackedExecutor._run_phase_stacked)),
               (Engine, "initial_params", setup(Engine.initial_params)),
               (Engine, "_device_schedule", setup(Engine._device_schedule))]
    saved = [(o, n, o.__dict__[n] if n in o.__dict__ else getattr(o, n)) for o, n, _ in patches]
    for o, n, f in patches:
        setattr(o, n, f)
    try:
        with mode:
            dev = register_device()
            data = FederatedData.build(processed, table, dev)
            cls, cfg = resolve_method(method, {})
            algo = cls(cfg, make_forward(template_on(build_model("cnn4", 3, 4, 28, {}), dev)), 4)
            train = TrainConfig(rounds=1, participation=1.0, local_epochs=1, batch_size=batch_size, checkpoint_every=0,
                                model="cnn4")
            eng = Engine(algo, data, train, EvalConfig(every=1), seed=1, executor_kind=executor, fingerprint="syncs")
            mode.syncs.clear()
            mode.ops.clear()
            mode.sites.clear()
            with mode.region("rest of the round"):  # the server side and the evaluation
                eng.run()
    finally:
        for o, n, f in saved:
            setattr(o, n, f)
    syncs = {}
    for (where, kind), n in sorted(mode.syncs.items()):
        syncs.setdefault(where, {})[kind] = n
    train_syncs = sum(syncs.get("local training", {}).values()) + sum(syncs.get("local steps", {}).values())
    ops_train = mode.ops["local training"] + mode.ops["local steps"]
    return {"method": method, "executor": executor, "local_steps": steps["n"],
            "syncs_local_training": train_syncs, "syncs_in_local_steps": sum(syncs.get("local steps", {}).values()),
            "syncs_rest_of_round": sum(syncs.get("rest of the round", {}).values()),
            "syncs_run_setup": sum(syncs.get("run set-up", {}).values()), "syncs_by_region_and_kind": syncs,
            "ops_local_training": ops_train, "ops_per_step": round(ops_train / max(1, steps["n"]), 1),
            "ops_rest_of_round": mode.ops["rest of the round"],
            "sync_sites": [{"region": r, "kind": k, "site": site, "count": n}
                           for (r, k, site), n in sorted(mode.sites.items())]}


def write_entry(args: argparse.Namespace, key: str, rows: list[dict]) -> None:
    """Write one labelled entry (``args.label``; the commit, torch version, ``args.clients``,
    ``args.batch_size`` and ``rows`` under ``key``) to the JSON file ``args.out``: ``{"entries":
    [...]}``, replacing an entry of the same label when ``args.merge``, else the file's only entry.
    Shared by this benchmark and ``benchmarks/kernel_counts.py``."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    entry = {"label": args.label, "commit": commit, "torch": torch.__version__, "clients": args.clients,
             "batch_size": args.batch_size, key: rows}
    old = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {"entries": []}
    old["entries"] = [e for e in old["entries"] if e["label"] != args.label] + [entry]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedkper"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--merge", action="store_true", help="add to the entries already in --out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        processed, table = _data(Path(tmp), args.clients)
        rows = []
        for method in args.methods:
            for executor in ("sequential", "stacked"):
                r = count_round(processed, table, method, executor, args.batch_size)
                print(f"{args.label:8s} {method:8s} {executor:10s} steps {r['local_steps']:4d}  syncs: training "
                      f"{r['syncs_local_training']:4d} (in local steps {r['syncs_in_local_steps']}), rest of the round "
                      f"{r['syncs_rest_of_round']:4d} (run set-up {r['syncs_run_setup']}); ops/step {r['ops_per_step']}")
                rows.append(r)
    write_entry(args, "rounds", rows)


if __name__ == "__main__":
    main()
