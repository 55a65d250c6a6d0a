"""Keep a long study's finished runs in git, so that a later session on a fresh machine continues
the study instead of re-running it.

A study such as ``config/pfedkd-mnist.yaml`` takes tens of core-hours on a CPU; Snakemake's
caching lets several sessions finish it only while the run directories survive. On a machine
whose disk does not outlive the session, and without a DVC remote, git is what survives. This
script copies what the rest of the pipeline needs of each finished training run (the train
rule's outputs ``records.parquet``, ``rounds.parquet``, ``job.json``, and Snakemake's metadata
records of them, which hold the job's params and code hash) into ``results/<study>/archive/``
(git-tracked, about 0.3 to 2 MB a run), and puts them back in a fresh clone:

    python scripts/study_archive.py save pfedkd-mnist            # after runs finish; then git add
    python scripts/study_archive.py restore pfedkd-mnist --configfile config/pfedkd-mnist.yaml
    python scripts/study_archive.py list pfedkd-mnist            # wall time of each archived run

``restore`` first builds each archived run's inputs (data set, partition, MLflow parent run)
with Snakemake, then copies the archived files into ``results/<study>/runs/`` (so they are newer
than their inputs) and their metadata into ``.snakemake/metadata/``, and finally asks Snakemake
(a dry run with every rerun trigger) whether it regards each restored run as current. A run
whose params or code changed since it was archived is reported and left to re-run: the archive
never hides a change. ``final_model.pt`` (up to 20 MB a run) is not kept; no stage reads it.

The MLflow store does not survive either, so ``restore`` also logs each restored run that has no
run in the study's store (also runs restored earlier) again as a child of the study's parent
run, from the archived files: the job as params, the same tags as training (plus
``medpfl.restored_from_archive``), the per-round curves (step = round, dated back from the
job's end by the rounds' wall time), the original start and end time, and ``job.json``. The
run's ``mlflow_run.json`` points to it, so the evaluate stage adds the summary metrics and plots
as for any run. ``--no-mlflow`` skips this.

A run still training when the session ends keeps its progress too: ``save`` also archives the
``checkpoint.pt`` of each unfinished run, gzipped (up to ``--max-checkpoint-mb``, default 2,
which holds the FedAvg-style runs, the longest ones; the engine's checkpoint carries the rounds so far and a
fingerprint of the job and data, so a changed job starts over rather than resuming wrongly), and
drops it from the archive once the run has finished. ``restore`` puts it back, and the study's
next ``snakemake`` resumes the run from it.

The metadata records use Snakemake's file persistence layout (``.snakemake/metadata/<urlsafe
base64 of the output path>``, Snakemake 9, as pinned in requirements.lock); the final dry run
shows it if a future version reads them differently.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

from medpfl.io import atomic_path

# The train rule's declared outputs (workflow/rules/train.smk): a run is restorable from these.
RUN_FILES = ("records.parquet", "rounds.parquet", "job.json")
METADATA_FILE = "snakemake_metadata.json"
CHECKPOINT = "checkpoint.pt"
ARCHIVED_CHECKPOINT = "checkpoint.pt.gz"  # gzip: the pickled records so far shrink about 3x
METADATA_DIR = Path(".snakemake") / "metadata"


def metadata_path(output: str, root: Path = METADATA_DIR) -> Path:
    """Where Snakemake 9's file persistence keeps the record of ``output`` (a path relative to the
    working directory): the urlsafe base64 of the path, split into 254-character parts."""
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i:i + 254] for i in range(0, len(b64), 254)]
    return root.joinpath(*["@" + p for p in parts[:-1]], parts[-1])


def snakemake_cmd(args, cores: int, snakefile: Path | None, configfiles: list[str]) -> list[str]:
    """The Snakemake command line for ``args`` (targets and flags) of the study given by
    ``configfiles``: the flags before ``--configfile``, which takes every value after it."""
    cmd = [sys.executable, "-m", "snakemake", *args, "--cores", str(cores)]
    cmd += ["--snakefile", str(snakefile)] if snakefile else []
    return cmd + (["--configfile", *configfiles] if configfiles else [])


def _copy_atomic(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _write_atomic(data: str | bytes, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def finished_runs(runs: Path) -> list[Path]:
    """Run directories under ``runs`` whose train job finished: every declared output exists and
    Snakemake's record of it says the job completed (``incomplete`` false)."""
    done = []
    for records in sorted(runs.rglob("records.parquet")):
        run = records.parent
        if not all((run / f).is_file() for f in RUN_FILES):
            continue
        meta = metadata_path((run / RUN_FILES[0]).as_posix())
        if not meta.is_file() or json.loads(meta.read_text()).get("incomplete", True):
            continue
        done.append(run)
    return done


def _next_round(checkpoint: bytes) -> int | None:
    """The round a checkpoint (its bytes) resumes at (the engine's ``next_round``), None if
    unreadable."""
    import io

    import torch

    try:
        return int(torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=False)["next_round"])
    except Exception:  # noqa: BLE001 - a partial or foreign file: still worth keeping as is
        return None


def save_checkpoints(runs: Path, archive: Path, finished: list[Path], max_mb: float) -> int:
    """Archive the ``checkpoint.pt`` of each unfinished run of ``runs`` gzipped, where that is at
    most ``max_mb`` MB, and drop the archived checkpoint of each finished run; returns how many
    checkpoints were copied."""
    copied = 0
    for run in finished:
        (archive / run.relative_to(runs) / ARCHIVED_CHECKPOINT).unlink(missing_ok=True)
    for ckpt in sorted(runs.rglob(CHECKPOINT)):
        run = ckpt.parent
        if run in finished:
            continue
        dest = archive / run.relative_to(runs) / ARCHIVED_CHECKPOINT
        raw = ckpt.read_bytes()  # the engine replaces the file atomically: a whole checkpoint
        packed = gzip.compress(raw, compresslevel=6, mtime=0)  # same bytes for the same checkpoint
        size = len(packed) / 2**20
        if size > max_mb:
            print(f"checkpoint of {run.relative_to(runs)} not kept: {size:.1f} MB gzipped > {max_mb} MB")
            continue
        if dest.is_file() and dest.read_bytes() == packed:
            continue
        _write_atomic(packed, dest)
        copied += 1
        print(f"checkpoint of {run.relative_to(runs)} (resumes at round {_next_round(raw)}, {size:.1f} MB gzipped)")
    return copied


def save(study: str, results: Path, max_checkpoint_mb: float = 2.0) -> int:
    """Copy each finished run of ``study`` into its archive, and the checkpoints of its unfinished
    runs (``save_checkpoints``); returns how many runs were new or changed."""
    runs, archive = results / study / "runs", results / study / "archive"
    if not runs.is_dir():
        sys.exit(f"study_archive: no runs of study '{study}' in {runs}")
    changed = 0
    finished = finished_runs(runs)
    save_checkpoints(runs, archive, finished, max_checkpoint_mb)
    for run in finished:
        dest = archive / run.relative_to(runs)
        meta = {f: json.loads(metadata_path((run / f).as_posix()).read_text()) for f in RUN_FILES
                if metadata_path((run / f).as_posix()).is_file()}
        new = any(not (dest / f).is_file() or (dest / f).read_bytes() != (run / f).read_bytes()
                  for f in RUN_FILES)
        if not new:
            continue
        for f in RUN_FILES:
            _copy_atomic(run / f, dest / f)
        _write_atomic(json.dumps(meta, indent=1, sort_keys=True) + "\n", dest / METADATA_FILE)
        changed += 1
        print(f"archived {run.relative_to(runs)}")
    print(f"study_archive: {changed} run(s) archived in {archive}")
    return changed


def restore(study: str, results: Path, configfiles: list[str], cores: int,
            snakefile: Path | None = None, mlflow: bool = True) -> bool:
    """Put the archived runs of ``study`` back where Snakemake expects them; returns whether
    Snakemake then regards every restored run as current (if not, its dry run, with the reason
    for each job, is printed and those runs will re-run).

    With ``mlflow``, each restored run without a run in the study's MLflow store is logged there
    again (:func:`log_missing_mlflow`), also when there was nothing to restore. Raises SystemExit
    if there is no archive, a Snakemake call fails or the MLflow store cannot be written."""
    archive, runs = results / study / "archive", results / study / "runs"
    if not archive.is_dir():
        sys.exit(f"study_archive: no archive for study '{study}' ({archive})")
    for ckpt in sorted(archive.rglob(ARCHIVED_CHECKPOINT)):
        dest = runs / ckpt.parent.relative_to(archive)
        if not (dest / CHECKPOINT).exists() and not (dest / RUN_FILES[0]).exists():
            raw = gzip.decompress(ckpt.read_bytes())
            _write_atomic(raw, dest / CHECKPOINT)
            print(f"checkpoint of {ckpt.parent.relative_to(archive)} restored (the study's next run "
                  f"resumes it at round {_next_round(raw)})")
    todo = [d for d in sorted(p.parent for p in archive.rglob(METADATA_FILE))
            if not (runs / d.relative_to(archive) / RUN_FILES[0]).exists()]
    if not todo:
        print("study_archive: nothing to restore")
        if mlflow:
            log_missing_mlflow(archive, runs, results / study / "mlflow_parent.json")
        return True

    def snake(*args: str) -> list[str]:
        return snakemake_cmd(args, cores, snakefile, configfiles)

    inputs = sorted({i for d in todo
                     for i in json.loads((d / METADATA_FILE).read_text())[RUN_FILES[0]]["input"]})
    # The inputs first, in their own invocation, so that the restored outputs are newer than them
    # and no train job is 'updated by another job'.
    subprocess.run(snake(*inputs), check=True)
    targets = []
    for d in todo:
        dest = runs / d.relative_to(archive)
        meta = json.loads((d / METADATA_FILE).read_text())
        for f in RUN_FILES:
            _copy_atomic(d / f, dest / f)
            if f in meta:
                _write_atomic(json.dumps(meta[f]), metadata_path((dest / f).as_posix()))
        targets.append((dest / RUN_FILES[0]).as_posix())
        print(f"restored {d.relative_to(archive)}")
    if mlflow:  # the parent is an input of every train job, built above
        log_missing_mlflow(archive, runs, results / study / "mlflow_parent.json")
    dry = subprocess.run(snake("--dry-run", *targets), capture_output=True, text=True)
    if dry.returncode != 0:
        sys.exit(f"study_archive: Snakemake's dry run over the restored runs failed:\n{dry.stderr}")
    current = "Nothing to be done" in dry.stdout + dry.stderr
    if not current:
        print(dry.stdout + dry.stderr)
        print("study_archive: Snakemake would re-run some restored runs (their params or code "
              "changed since they were archived; reasons above). A study trained from a worktree pinned at "
              "an older commit is such a case: to evaluate and report the archived runs as they were "
              "trained, without training again, add `--rerun-triggers mtime input` to snakemake "
              "(docs/studies.md, \"Archived runs of an older commit\")", file=sys.stderr)
    print(f"study_archive: {len(targets)} run(s) restored into {runs}")
    return current


def has_mlflow_run(run: Path, parent: dict, client) -> bool:
    """Whether ``run``'s ``mlflow_run.json`` names a run that exists in the store of ``parent``
    (the study's ``mlflow_parent.json`` record; ``client``: an ``MlflowClient`` of that store)."""
    run_file = run / "mlflow_run.json"
    if not run_file.is_file():
        return False
    info = json.loads(run_file.read_text())
    if info.get("tracking_uri") != parent["tracking_uri"]:
        return False
    try:
        client.get_run(info["run_id"])
    except Exception:  # noqa: BLE001 - MlflowException (no such run), a malformed record
        return False
    return True


def log_missing_mlflow(archive: Path, runs: Path, parent_file: Path) -> int:
    """Log (:func:`relog_mlflow`) each archived run whose run folder under ``runs`` holds the
    archived records but no run in the study's MLflow store: the runs just restored, and runs
    restored before the store existed or by an older version of this script. Returns how many
    were logged; raises SystemExit if the store cannot be written."""
    from mlflow.tracking import MlflowClient

    from medpfl.tracking import TrackingError

    if not parent_file.is_file():
        return 0
    parent = json.loads(parent_file.read_text())
    client = MlflowClient(parent["tracking_uri"])
    logged = 0
    for d in sorted(p.parent for p in archive.rglob(METADATA_FILE)):
        dest = runs / d.relative_to(archive)
        records = dest / RUN_FILES[0]
        if not records.is_file() or records.read_bytes() != (d / RUN_FILES[0]).read_bytes():
            continue  # not restored, or trained again here (training logs its own run)
        if has_mlflow_run(dest, parent, client):
            continue
        try:
            run_id = relog_mlflow(dest, parent_file, json.loads((d / METADATA_FILE).read_text())[RUN_FILES[0]])
        except TrackingError as e:
            sys.exit(f"study_archive: {dest}: cannot log the restored run to MLflow ({e}); "
                     "re-run with --no-mlflow to restore without it")
        logged += 1
        print(f"logged {d.relative_to(archive)} to MLflow (run {run_id})")
    return logged


def relog_mlflow(run: Path, parent_file: Path, meta: dict) -> str:
    """Log the archived run in ``run`` (its ``records.parquet``, ``rounds.parquet``, ``job.json``)
    as a new MLflow child run of the parent in ``parent_file`` (``mlflow_parent.json``), as the
    train stage would have: the job as params, the train stage's tags, the per-round scalars of
    :func:`medpfl.train.round_scalars` (step = round; timestamps counted back from Snakemake's
    ``endtime`` in ``meta`` by the rounds' ``round_seconds``), ``job.json`` as an artifact, status
    FINISHED with the original end time and the start time Snakemake recorded (for a job resumed
    across sessions, which Snakemake dates from its last start: the end minus the rounds' wall
    time). Writes ``run / mlflow_run.json`` and returns the run id; if logging fails, the run is
    marked FAILED and ``mlflow_run.json`` removed, so the next ``restore`` logs it again.

    Raises :class:`medpfl.tracking.TrackingError` if the store cannot be reached."""
    import pandas as pd
    from mlflow.entities import Metric

    from medpfl.environment import mlflow_tags
    from medpfl.io import md5sum
    from medpfl.tracking import RunLogger, logged_value, retry
    from medpfl.train import round_scalars

    full = json.loads((run / "job.json").read_text())
    env = full.get("environment") or {}
    job = {k: v for k, v in full.items() if k not in ("environment", "model_size", "earlier_environments")}
    records = pd.read_parquet(run / "records.parquet")
    rounds = pd.read_parquet(run / "rounds.parquet").sort_values("round")
    table_file = next((Path(i) for i in meta.get("input", []) if i.endswith("partition.parquet")), None)
    name = f"{job['dataset']}/{job['partition']}/{job['method']}/seed{job['seed']}"  # as training names it (the
    # evaluate and report stages then name it method first, tracking.run_name)
    tags = {"method": job["method"], "algorithm": job["algorithm"], "dataset": job["dataset"],
            "partition": job["partition"], "seed": str(job["seed"]), "study": job["study"],
            "device": str(env.get("device")), "num_clients": str(job["num_clients"]),
            "medpfl.role": "training", "medpfl.restored_from_archive": "true", **mlflow_tags(env)}
    if table_file is not None and table_file.is_file():
        tags["partition_md5"] = md5sum(table_file)
    if full.get("earlier_environments"):
        tags["env.earlier_ids"] = ",".join(e.get("id", "?") for e in full["earlier_environments"])
    run_file = run / "mlflow_run.json"
    run_file.unlink(missing_ok=True)  # a run id of a store that is gone
    # Snakemake records a resumed job's last start only: the run starts at that or, if earlier,
    # at its end minus the rounds' wall time, and round r is logged at the end minus the wall time
    # of the rounds after it (exact for the last session's rounds, never past the end)
    end_ms = int(meta["endtime"] * 1000)
    total = float(rounds["round_seconds"].sum())
    start_ms = min(int(meta["starttime"] * 1000), end_ms - int(total * 1000))
    by_round = {r: g.to_dict("records") for r, g in records.groupby("round")}
    metrics = []
    for (_, row), t in zip(rounds.iterrows(), rounds["round_seconds"].cumsum()):
        r = int(row["round"])
        ts = end_ms - int((total - t) * 1000)
        metrics += [Metric(k, logged_value(float(v)), ts, r)  # as RunLogger.log_metrics logs it (4 significant digits)
                    for k, v in round_scalars(by_round.get(r, []), row.to_dict()).items() if v is not None and v == v]
    logger = RunLogger(parent_file, run_file, name, tags, resume=False, start_time=start_ms)
    try:
        logger.log_params(job)
        for i in range(0, len(metrics), 1000):  # MLflow's log_batch limit
            retry(logger.client.log_batch, logger.run_id, metrics=metrics[i:i + 1000])
        logger.log_artifact(run / "job.json")
    except BaseException:
        run_file.unlink(missing_ok=True)
        logger.finish("FAILED")
        raise
    retry(logger.client.set_terminated, logger.run_id, "FINISHED", end_ms)
    return logger.run_id


def table(study: str, results: Path) -> "pd.DataFrame":
    """One row per archived run of ``study``: rounds, training wall time (the sum of the rounds'
    ``round_seconds``, minutes, which a resumed run adds up across sessions), seconds per round,
    Snakemake's start and end time of the job (UTC; a resumed job's last start) and the CPU it ran
    on (job.json ``environment.cpu_model``: float results differ slightly between CPU models)."""
    import datetime

    import pandas as pd

    rows = []
    for meta_file in sorted((results / study / "archive").rglob(METADATA_FILE)):
        run = meta_file.parent
        rounds = pd.read_parquet(run / "rounds.parquet", columns=["round", "round_seconds"])
        job = json.loads((run / "job.json").read_text())
        meta = json.loads(meta_file.read_text())[RUN_FILES[0]]
        utc = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
        rows.append({"partition": job["partition"], "run": job["method"], "seed": job["seed"],
                     "rounds": len(rounds), "wall (min)": round(rounds["round_seconds"].sum() / 60, 1),
                     "s / round": round(rounds["round_seconds"].mean(), 2),
                     "started": utc(meta["starttime"]), "ended": utc(meta["endtime"]),
                     "cpu": (job.get("environment") or {}).get("cpu_model")})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="archive the study's finished runs and unfinished runs' checkpoints")
    s.add_argument("study")
    s.add_argument("--max-checkpoint-mb", type=float, default=2.0,
                   help="largest checkpoint of an unfinished run to keep (MB; default 2)")
    r = sub.add_parser("restore", help="put the archived runs back for Snakemake")
    r.add_argument("study")
    r.add_argument("--configfile", nargs="+", default=[],
                   help="the study's config file(s), as given to snakemake (default: params.yaml only)")
    r.add_argument("--snakefile", type=Path, help="default: ./Snakefile")
    r.add_argument("--cores", type=int, default=1)
    r.add_argument("--no-mlflow", action="store_true",
                   help="do not log the restored runs to the study's MLflow store")
    ls = sub.add_parser("list", help="the archived runs with their wall times (a markdown table)")
    ls.add_argument("study")
    for p in (s, r, ls):
        p.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.study, args.results, args.max_checkpoint_mb)
    elif args.command == "list":
        print(table(args.study, args.results).to_markdown(index=False))
    else:
        sys.exit(0 if restore(args.study, args.results, args.configfile, args.cores, args.snakefile,
                                not args.no_mlflow) else 1)


if __name__ == "__main__":
    main()
