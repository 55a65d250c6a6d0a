"""The train stage: one federated training job, tracked in MLflow, checkpointed, resumable.

Outputs in the run folder (each written atomically): ``job.json`` (the resolved job, plus the
environment fingerprint under ``environment``: :mod:`medpfl.environment`),
``records.parquet`` (every evaluation: round x view x client), ``rounds.parquet`` (schedule,
bytes, timing per round), ``final_model.pt`` (global and/or personalized parameters) and
``mlflow_run.json`` (the child run's id). ``checkpoint.pt`` exists while the job runs and is
kept if it fails; re-running the job resumes from it and continues the same MLflow run.
Progress: a live bar on a terminal, one log line per round otherwise (:mod:`medpfl.progress`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from medpfl.algorithms import resolve_method
from medpfl.config import EvalConfig, ParamsError, TrainConfig, canonical_json
from medpfl.data.partition import PartitionError
from medpfl.data.preprocess import load_processed
from medpfl.data.schemas import SharedPartitionTable, validate
from medpfl.environment import capture, configure_determinism, mlflow_tags
from medpfl.fl.data import FederatedData
from medpfl.fl.engine import Engine, fingerprint, require_server_data, resolve_device
from medpfl.fl.functional import make_forward, template_on
from medpfl.fl.tree import tree_map
from medpfl.io import atomic_path, md5sum, read_json, read_parquet, write_json, write_parquet
from medpfl.models.zoo import build_model_for_data
from medpfl.models.zoo import parameter_counts
from medpfl.progress import RoundProgress

log = logging.getLogger(__name__)


def round_scalars(records: list[dict], row: dict) -> dict[str, float]:
    """The per-round numbers logged live to MLflow (step = round) and shown by the progress bar,
    from the round's row of the round log (``row``: the engine's dict, ``rounds.parquet``
    columns) and its evaluation records (``records``: dicts with ``view``, ``accuracy``,
    ``balanced_accuracy``, ``loss``). ``upload_compression_ratio`` = ``bytes_up /
    bytes_up_dense`` where the row has a positive ``bytes_up_dense`` (optional column), absent
    otherwise; ``dp_epsilon`` (the row's ``epsilon``: ε at δ so far) where the run has ``train.dp``
    (``docs/metrics.md``; the summary's name is ``epsilon``)."""
    out: dict[str, float] = {"lr": row["lr"], "bytes_up": row["bytes_up"], "bytes_down": row["bytes_down"],
                             "round_seconds": row["round_seconds"], "train_seconds": row["train_seconds"]}
    dense = row.get("bytes_up_dense")
    if pd.notna(dense) and dense > 0:  # absent, missing or 0 (nothing sent: Local): not applicable
        out["upload_compression_ratio"] = row["bytes_up"] / dense
    eps = row.get("epsilon")
    if eps is not None and pd.notna(eps):  # DP-FedAvg (train.dp): ε at δ after this round (summary: epsilon)
        out["dp_epsilon"] = eps

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


def _earlier_environments(job_file: Path, env: dict) -> list[dict]:
    """The environments of earlier sessions of a job about to resume (from its ``job.json``),
    when they differ from ``env``; [] when there is none or they are the same."""
    try:
        old = read_json(job_file)
    except (FileNotFoundError, ValueError):
        return []
    earlier = [e for e in (old.get("earlier_environments") or []) + [old.get("environment")]
               if isinstance(e, dict)]
    out: list[dict] = []
    for e in earlier:
        if e.get("id") != env["id"] and all(e.get("id") != o.get("id") for o in out):
            out.append(e)
    return out


def _write_job(out_dir: Path, job: dict, env: dict, earlier: list[dict], model_size: dict | None = None) -> None:
    """``job.json``: the job description as given, plus the environment and the model's parameter
    counts (``model_size``: trainable, frozen, total elements; outputs, not part of the
    description, so they change neither the params nor the checkpoint fingerprint)."""
    write_json(out_dir / "job.json", {**job, "environment": env, **({"model_size": model_size} if model_size else {}),
                                      **({"earlier_environments": earlier} if earlier else {})})


@dataclass
class _Job:
    """One job made ready to train (:func:`_prepare`): its engine, MLflow logger, progress and
    what :func:`_finish` writes."""

    job: dict
    out_dir: Path
    algo: Any
    engine: Engine
    logger: Any
    bar: RoundProgress
    env: dict
    earlier: list[dict]
    counts: dict

    @property
    def ckpt(self) -> Path:
        return self.out_dir / "checkpoint.pt"


def _load_data(job: dict, train: TrainConfig, arrays: Path, samples: Path, partition_table: Path,
               device: torch.device) -> FederatedData:
    """The job's federated data on ``device`` (``train``: the job's validated train section, for its
    input transform). Raises PartitionError when the table's client count differs from
    ``partitions.<name>.num_clients``."""
    data = load_processed(arrays, samples)
    # SharedPartitionTable: clients may share samples (per_client_dirichlet); disjoint schemes are
    # checked for disjointness when the partition stage builds them
    table = validate(SharedPartitionTable, read_parquet(partition_table), str(partition_table))
    k = int(table["client_id"].max()) + 1
    if k != job["num_clients"]:
        raise PartitionError(f"{partition_table}: holds {k} clients, partitions.{job['partition']}.num_clients says "
                             f"{job['num_clients']} (re-run the partition stage)")
    # pool all: every split was partitioned, no global test set; transform: train.transform
    return FederatedData.build(data, table, device, pool=job.get("pool", "train"), transform=train.transform)


def _prepare(job: dict, fdata: FederatedData, arrays: Path, partition_table: Path, out_dir: Path,
             parent_file: Path | None, clients_factory=None, extra_tags: dict[str, str] | None = None,
             bar: bool | None = None, stacked_seeds: bool = False) -> _Job:
    """Everything of one job up to its first round: job.json, the method, the MLflow run, the
    progress and the engine (resuming from ``out_dir/checkpoint.pt`` where it matches).
    ``stacked_seeds``: ``executor: auto`` picks the stacked executor wherever the method and the
    model allow it, on any device (the seeds' local training is merged there)."""
    train = TrainConfig.model_validate(job["train"])
    evalc = EvalConfig.model_validate(job["eval"])
    algo_cls, mcfg = resolve_method(job["method"], {job["method"]: {"algorithm": job["algorithm"], **job["method_params"]}})
    out_dir.mkdir(parents=True, exist_ok=True)
    device = fdata.device
    env = capture(device, train.precision, train.deterministic)
    ckpt = out_dir / "checkpoint.pt"
    earlier = _earlier_environments(out_dir / "job.json", env) if ckpt.exists() else []
    if earlier:
        log.warning("resuming in another environment (%s) than before (%s): the run mixes both", env["id"],
                    ", ".join(e.get("id", "?") for e in earlier))
    k = fdata.num_clients
    try:
        template = build_model_for_data(train.model, fdata, train.model_args)
    except ValueError as e:  # the model does not fit this data set (image side, channels) or its arguments
        raise ParamsError(f"method {job['method']!r} on data set {job['dataset']!r}: {e}") from None
    counts = parameter_counts(template)
    template = template_on(template, device)  # a frozen backbone stays real: one shared copy on the device
    _write_job(out_dir, job, env, earlier, counts)
    algo = algo_cls(mcfg, make_forward(template), fdata.num_classes)
    require_server_data(algo, fdata, job["partition"])  # before MLflow sees the run

    logger = None
    if parent_file is not None:
        from medpfl.tracking import RunLogger

        # the name follows the run folder (dataset/partition/method/seed); the tags let the MLflow
        # UI group and filter by each of them
        name = f"{job['dataset']}/{job['partition']}/{job['method']}/seed{job['seed']}"
        tags = {"method": job["method"], "algorithm": job["algorithm"], "dataset": job["dataset"],
                "partition": job["partition"], "seed": str(job["seed"]), "study": job["study"],
                "device": str(device), "num_clients": str(k), "partition_md5": md5sum(partition_table),
                "medpfl.role": "training", **(extra_tags or {})}
        logger = RunLogger(parent_file, out_dir / "mlflow_run.json", name, tags)
        # tags, not params: a run resumed in another environment updates them
        logger.set_tags({**mlflow_tags(env), **({"env.earlier_ids": ",".join(e.get("id", "?") for e in earlier)}
                                                if earlier else {})})
        logger.log_params(job)

    progress = RoundProgress(train.rounds, f"{job['method']} {job['dataset']}/{job['partition']} seed {job['seed']}",
                             log, bar=bar)

    def on_round(r: int, row: dict, recs: list[dict]) -> None:
        """The round's scalars, computed once: logged to MLflow (step = round), then shown."""
        scalars = round_scalars(recs, row)
        if logger is not None:
            logger.log_metrics(scalars, step=r)
        progress.update(r, scalars, row["round_seconds"])

    fp = fingerprint({"job": job, "partition": md5sum(partition_table), "arrays": md5sum(arrays),
                      **({"clients": "deployed"} if clients_factory is not None else {})})
    clients = clients_factory(fdata, algo, train) if clients_factory is not None else None
    kind = train.executor
    if stacked_seeds and kind == "auto" and algo.stackable and getattr(algo.forward, "not_stackable_because", None) is None:
        kind = "stacked"
    engine = Engine(algo, fdata, train, evalc, job["seed"], kind, checkpoint=ckpt, callbacks=[on_round],
                    fingerprint=fp, clients=clients)
    log.info("%s seed %s: %s executor on %s, %d clients, %d rounds; environment %s (%s, %d torch threads, "
             "deterministic algorithms %s)", job["method"], job["seed"], engine.clients.name, device, k, train.rounds,
             env["id"], env["gpu_name"] or env["cpu_model"], env["torch_threads"], env["deterministic_algorithms"])
    return _Job(job, out_dir, algo, engine, logger, progress, env, earlier, counts)


def _failed(j: _Job, e: BaseException) -> None:
    """Marks the job's MLflow run ended by ``e`` (its checkpoint stays)."""
    if j.logger is not None:
        j.logger.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")


def _finish(j: _Job, result: Any) -> None:
    """The job's outputs from its :class:`~medpfl.fl.engine.RunResult`, each written atomically:
    records, rounds, the final model; the MLflow run finished; the checkpoint removed."""
    job, out_dir, logger, algo, engine = j.job, j.out_dir, j.logger, j.algo, j.engine
    finish = getattr(engine.clients, "finish", None)  # a deployment: the sites keep their personalized models
    if finish is not None and algo.personalized:
        finish(result.server)
    if j.earlier and not result.resumed_from:  # the checkpoint was not used: one environment after all
        j.earlier = []
        _write_job(out_dir, job, j.env, j.earlier, j.counts)
        if logger is not None:
            logger.set_tags({"env.earlier_ids": ""})
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
    j.ckpt.unlink(missing_ok=True)


def run_training(job: dict, arrays: Path, samples: Path, partition_table: Path, out_dir: Path,
                 parent_file: Path | None = None, clients_factory=None, extra_tags: dict[str, str] | None = None) -> None:
    """Run one job end to end. Raises ParamsError/DataError/TableError naming the bad input
    (ParamsError also where ``train.model`` cannot take this data set's samples),
    MissingWeightsError when a pretrained checkpoint is not available offline, and
    DivergenceError when the run diverges.

    clients_factory: None runs every client here (the simulator); else ``fn(data, algo, train)
    -> client side`` (:mod:`medpfl.fl.clients`), e.g. a deployment's sites
    (:mod:`medpfl.deploy.server`); extra_tags: added to the MLflow run's tags."""
    train = TrainConfig.model_validate(job["train"])
    device = resolve_device(train.device)
    configure_determinism(train.deterministic, device)  # before any CUDA work of this job
    fdata = _load_data(job, train, arrays, samples, partition_table, device)
    j = _prepare(job, fdata, arrays, partition_table, out_dir, parent_file, clients_factory, extra_tags)
    try:
        with j.bar:
            result = j.engine.run()
    except BaseException as e:
        _failed(j, e)
        raise
    _finish(j, result)


def same_but_seed(jobs: list[dict]) -> None:
    """Raises ParamsError unless ``jobs`` are one method's jobs differing only in ``seed`` (and
    distinct seeds): what :func:`run_stacked_seeds` may stack."""
    if len({j["seed"] for j in jobs}) != len(jobs):
        raise ParamsError(f"train.stack_seeds: the jobs repeat a seed ({[j['seed'] for j in jobs]})")
    rest = [canonical_json({k: v for k, v in j.items() if k != "seed"}) for j in jobs]
    if len(set(rest)) != 1:
        diff = sorted({k for j in jobs[1:] for k in set(j) | set(jobs[0]) if k != "seed" and j.get(k) != jobs[0].get(k)})
        raise ParamsError(f"train.stack_seeds: the stacked jobs must differ in their seed only; they differ in {diff}")


def run_stacked_seeds(jobs: list[dict], arrays: Path, samples: Path, partition_table: Path, out_dirs: list[Path],
                      parent_file: Path | None = None) -> None:
    """Seeds of one method as one computation (``train.stack_seeds``, :mod:`medpfl.fl.seed_stack`):
    ``jobs`` (one per seed, otherwise equal: :func:`same_but_seed`) share one copy of the data
    on the device, and every round's local training of all seeds runs as one stacked program.
    Each job writes into its own ``out_dirs[i]`` exactly what :func:`run_training` writes (job.json,
    records, rounds, final model, its own MLflow run and checkpoint), so the DAG, the caches and
    the reports cannot tell. A seed that fails (DivergenceError, ...) ends alone: the others
    finish and write their outputs, then the first failure is raised (its checkpoint kept).
    Raises ParamsError when the jobs differ in more than their seed or the counts differ."""
    if len(jobs) != len(out_dirs):
        raise ParamsError(f"train.stack_seeds: {len(jobs)} jobs but {len(out_dirs)} run folders")
    same_but_seed(jobs)
    if len(jobs) == 1:
        return run_training(jobs[0], arrays, samples, partition_table, out_dirs[0], parent_file)
    from medpfl.fl.seed_stack import run_seed_stack

    train = TrainConfig.model_validate(jobs[0]["train"])
    device = resolve_device(train.device)
    configure_determinism(train.deterministic, device)
    fdata = _load_data(jobs[0], train, arrays, samples, partition_table, device)  # one copy for every seed
    prepared = [_prepare(j, fdata, arrays, partition_table, Path(d), parent_file, bar=False, stacked_seeds=True)
                for j, d in zip(jobs, out_dirs)]
    try:
        outcomes = run_seed_stack([p.engine for p in prepared])
    except BaseException as e:  # interrupted: every seed keeps its checkpoint
        for p in prepared:
            _failed(p, e)
        raise
    errors = []
    for p, o in zip(prepared, outcomes):
        if o.error is not None:
            _failed(p, o.error)
            errors.append((p, o.error))
            continue
        _finish(p, o.result)
        log.info("%s seed %s: %d of %d rounds trained stacked with other seeds", p.job["method"], p.job["seed"],
                 o.merged_rounds, p.engine.train.rounds)
    if errors:
        p, e = errors[0]
        log.error("train.stack_seeds: %d of %d seeds failed (%s)", len(errors), len(jobs),
                  ", ".join(f"seed {q.job['seed']}" for q, _ in errors))
        raise e
