"""The train stage: one federated training job, tracked in MLflow, checkpointed, resumable.

Outputs in the run folder (each written atomically): ``job.json`` (the resolved job),
``records.parquet`` (every evaluation: round x view x client), ``rounds.parquet`` (schedule,
bytes, timing per round), ``final_model.pt`` (global and/or personalized parameters) and
``mlflow_run.json`` (the child run's id). ``checkpoint.pt`` exists while the job runs and is
kept if it fails; re-running the job resumes from it and continues the same MLflow run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, TrainConfig
from medpfl.data.partition import PartitionError
from medpfl.data.preprocess import load_processed
from medpfl.data.schemas import SharedPartitionTable, validate
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine, fingerprint, resolve_device
from medpfl.fl.functional import make_forward
from medpfl.fl.tree import tree_map
from medpfl.io import atomic_path, md5sum, read_parquet, write_json, write_parquet
from medpfl.models import build_model

log = logging.getLogger(__name__)


def round_scalars(records: list[dict], row: dict) -> dict[str, float]:
    """The per-round numbers logged live to MLflow (step = round)."""
    out: dict[str, float] = {"lr": row["lr"], "bytes_up": row["bytes_up"], "bytes_down": row["bytes_down"],
                             "round_seconds": row["round_seconds"], "train_seconds": row["train_seconds"]}

    def pick(view):
        return [r for r in records if r["view"] == view]

    g = pick("global_test")
    if g:
        out["global_test_acc"] = g[0]["accuracy"]
        out["global_test_bal_acc"] = g[0]["balanced_accuracy"]
        out["global_test_loss"] = g[0]["loss"]
    for view, name in (("global_on_local", "global_on_local"), ("personalized_on_local", "personalized_acc")):
        v = pick(view)
        if v:
            out[f"{name}_mean"] = sum(r["accuracy"] for r in v) / len(v)
            out[f"{name}_worst"] = min(r["accuracy"] for r in v)
    la = pick("local_after_training")
    if la:
        out["local_bal_acc_mean"] = sum(r["balanced_accuracy"] for r in la) / len(la)
        out["local_bal_acc_worst"] = min(r["balanced_accuracy"] for r in la)
        out["local_acc_mean"] = sum(r["accuracy"] for r in la) / len(la)
    return out


def run_training(job: dict, arrays: Path, samples: Path, partition_table: Path, out_dir: Path,
                 parent_file: Path | None = None) -> None:
    """Run one job end to end. Raises ParamsError/DataError/TableError naming the bad input."""
    train = TrainConfig.model_validate(job["train"])
    evalc = EvalConfig.model_validate(job["eval"])
    algo_cls, mcfg = resolve_method(job["method"], {job["method"]: {"algorithm": job["algorithm"], **job["method_params"]}})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "job.json", job)

    data = load_processed(arrays, samples)
    # SharedPartitionTable: clients may share samples (per_client_dirichlet); disjoint schemes are
    # checked for disjointness when the partition stage builds them
    table = validate(SharedPartitionTable, read_parquet(partition_table), str(partition_table))
    k = int(table["client_id"].max()) + 1
    if k != job["num_clients"]:
        raise PartitionError(f"{partition_table}: holds {k} clients, partitions.{job['partition']}.num_clients says "
                             f"{job['num_clients']} (re-run the partition stage)")
    device = resolve_device(train.device)
    fdata = FederatedData.build(data, table, device)
    template = build_model(train.model, fdata.in_channels, fdata.num_classes, fdata.image_size,
                           train.model_args).to("meta")
    algo = algo_cls(mcfg, make_forward(template), fdata.num_classes)

    logger = None
    callbacks = []
    if parent_file is not None:
        from medpfl.tracking import RunLogger

        name = f"{job['method']}-{job['dataset']}-{job['partition']}-s{job['seed']}"
        tags = {"method": job["method"], "algorithm": job["algorithm"], "dataset": job["dataset"],
                "partition": job["partition"], "seed": str(job["seed"]), "study": job["study"],
                "device": str(device), "num_clients": str(k), "partition_md5": md5sum(partition_table)}
        logger = RunLogger(parent_file, out_dir / "mlflow_run.json", name, tags)
        logger.log_params(job)
        callbacks.append(lambda r, row, recs: logger.log_metrics(round_scalars(recs, row), step=r))

    def progress(r, row, recs):
        sc = round_scalars(recs, row)
        shown = " ".join(f"{k}={sc[k]:.3f}" for k in ("global_test_acc", "local_bal_acc_mean", "personalized_acc_mean")
                         if k in sc)
        log.info("round %d/%d %s (%.1fs)", r + 1, train.rounds, shown, row["round_seconds"])

    callbacks.append(progress)
    ckpt = out_dir / "checkpoint.pt"
    fp = fingerprint({"job": job, "partition": md5sum(partition_table), "arrays": md5sum(arrays)})
    engine = Engine(algo, fdata, train, evalc, job["seed"], train.executor, checkpoint=ckpt, callbacks=callbacks,
                    fingerprint=fp)
    log.info("%s: %s executor on %s, %d clients, %d rounds", job["method"], engine.executor.name, device, k, train.rounds)
    try:
        result = engine.run()
    except BaseException as e:
        if logger is not None:
            logger.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    write_parquet(out_dir / "records.parquet", result.records)
    write_parquet(out_dir / "rounds.parquet", result.rounds)
    model = {"algorithm": job["algorithm"], "global": result.global_params, "personalized": result.personalized}
    model = {k_: (tree_map(lambda t: t.cpu(), v) if isinstance(v, dict) else v) for k_, v in model.items()}
    with atomic_path(out_dir / "final_model.pt") as tmp:
        torch.save(model, tmp)
    if logger is not None:
        logger.log_metrics({"resumed_from_round": result.resumed_from})
        logger.log_artifact(out_dir / "final_model.pt", "model")
        logger.log_artifact(out_dir / "job.json")
        logger.finish("FINISHED")
    ckpt.unlink(missing_ok=True)

