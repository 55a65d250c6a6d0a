"""scripts/study_archive.py: a study's finished runs survive a fresh machine through git.

One tiny study (FedAvg, 4 clients, 2 rounds) trains; its runs, and the checkpoints of unfinished
runs up to a size, are archived; everything but the archive is deleted (a fresh clone);
``restore`` rebuilds the inputs and puts the runs and checkpoints back, after which Snakemake has
nothing to do, and logs each restored run to the new MLflow store with the curves training logged. After a params edit the restored run is reported stale and
re-runs: the restored Snakemake metadata is what Snakemake reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from helpers import REPO, TINY_TRAIN, copy_repo, job_stats, make_env, read_params, snakemake, tiny_params, \
    write_params, write_synthetic

pytestmark = pytest.mark.slow

STUDY = "archive-ci"
SCRIPT = REPO / "scripts" / "study_archive.py"
RUN = ("results", STUDY, "runs", "synth", "d", "fedavg", "seed1")


def _script(work, env, *args, check=True):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"study_archive {args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


_CHILD_RUN = """
import json, sys
from mlflow.tracking import MlflowClient
parent = json.load(open(sys.argv[1]))
client = MlflowClient(parent["tracking_uri"])
runs = client.search_runs([parent["experiment_id"]], f"tags.mlflow.parentRunId = '{parent['parent_run_id']}'")
print(json.dumps([{"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status, "tags": r.data.tags,
                   "start": r.info.start_time, "end": r.info.end_time,
                   "params": r.data.params,
                   "curves": {k: sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, k))
                              for k in r.data.metrics}} for r in runs]))
"""


def _child_runs(work, env):
    """The study's MLflow child runs in ``work``'s store, as dicts (id, name, status, tags, params,
    curves = {metric: [[step, value], ...]}). Read in a subprocess: MLflow keeps one SQLite
    engine per URI in a process, which would go on reading a deleted store."""
    out = subprocess.run([sys.executable, "-c", _CHILD_RUN, str(work / "results" / STUDY / "mlflow_parent.json")],
                         env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out.splitlines()[-1])


def _child_run(work, env):
    """The study's one MLflow child run (``_child_runs``)."""
    runs = _child_runs(work, env)
    assert len(runs) == 1, [r["name"] for r in runs]
    return runs[0]


def _fresh_clone(work):
    """Delete what a new machine would not have: data, runs, MLflow store, Snakemake metadata."""
    for p in ("data/raw", "data/processed", "data/partitions", ".snakemake", "mlruns.db",
              f"results/{STUDY}/runs", f"results/{STUDY}/mlflow_parent.json"):
        target = work / p
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def test_archive_restores_a_finished_run_and_reruns_a_changed_one(tmp_path):
    snakefile = copy_repo(tmp_path / "workflow") / "Snakefile"
    work = tmp_path / "work"
    work.mkdir()
    synth = write_synthetic(work / "synth.npz")
    write_params(work, tiny_params(synth, study=STUDY, methods=("fedavg",)))
    env = make_env(work)
    snakemake(work, "train_all", env=env, snakefile=snakefile)
    run = work.joinpath(*RUN)
    trained = {f: (run / f).read_bytes() for f in ("records.parquet", "rounds.parquet", "job.json")}
    assert (run / "final_model.pt").is_file()  # written, though not a declared output
    trained_run = _child_run(work, env)
    assert len(trained_run["curves"]["local_acc_mean"]) == TINY_TRAIN["rounds"]

    # unfinished runs: a small checkpoint is kept, a big one is not; the checkpoint archived while
    # the fedavg run was still training is dropped now that it has finished
    archived = work / "results" / STUDY / "archive" / "synth" / "d" / "fedavg" / "seed1"
    archived.mkdir(parents=True)
    torch.save({"next_round": 1}, archived / "checkpoint.pt.gz")  # any bytes: dropped unread
    small, big = run.parent.parent / "local" / "seed1", run.parent.parent / "moon" / "seed1"
    for folder, pad in ((small, 10), (big, 40_000)):
        folder.mkdir(parents=True)
        torch.save({"next_round": 7, "pad": torch.randn(pad // 4)}, folder / "checkpoint.pt")  # ~incompressible
    saved = _script(work, env, "save", STUDY, "--max-checkpoint-mb", "0.02")
    assert "1 run(s) archived" in saved.stdout
    assert "checkpoint of synth/d/local/seed1 (resumes at round 7" in saved.stdout, saved.stdout
    assert "checkpoint of synth/d/moon/seed1 not kept" in saved.stdout, saved.stdout
    assert {p.name for p in archived.iterdir()} == {*trained, "snakemake_metadata.json"}
    small_bytes = (small / "checkpoint.pt").read_bytes()
    assert "0 run(s) archived" in _script(work, env, "save", STUDY, "--max-checkpoint-mb", "0.02").stdout  # unchanged
    listed = _script(work, env, "list", STUDY).stdout.splitlines()
    assert len(listed) == 3 and "| fedavg " in listed[2], listed  # header, rule, one run
    assert int(listed[2].split("|")[4]) == TINY_TRAIN["rounds"], listed

    _fresh_clone(work)
    before_restore_ms = time.time() * 1000
    restored = _script(work, env, "restore", STUDY, "--snakefile", str(snakefile),
                       "--configfile", "params.yaml")  # as a study's overlay is given
    assert "1 run(s) restored" in restored.stdout
    assert (small / "checkpoint.pt").read_bytes() == small_bytes and not big.exists()
    assert {f: (run / f).read_bytes() for f in trained} == trained
    assert not (run / "final_model.pt").exists()
    # the store did not survive: restore logged the run again, with the curves training logged
    restored_run = _child_run(work, env)
    assert restored_run["id"] != trained_run["id"]
    assert restored_run["tags"]["medpfl.restored_from_archive"] == "true"
    assert restored_run["name"] == trained_run["name"] and restored_run["status"] == "FINISHED"
    # dated as trained (Snakemake's record of the job, within the job's start-up of MLflow's)
    assert restored_run["start"] <= restored_run["end"] < before_restore_ms
    assert abs(restored_run["end"] - trained_run["end"]) < 30_000
    assert abs(restored_run["start"] - trained_run["start"]) < 30_000, (restored_run["start"], trained_run["start"])
    for key in ("method", "algorithm", "partition", "seed", "partition_md5", "env.cpu_model"):
        assert restored_run["tags"][key] == trained_run["tags"][key], key
    assert restored_run["params"] == trained_run["params"]
    for key, curve in trained_run["curves"].items():
        if key != "resumed_from_round":  # training's last metric, not a curve
            assert restored_run["curves"][key] == curve, key
    again = snakemake(work, "train_all", env=env, snakefile=snakefile)
    assert "Nothing to be done" in again.stdout and "train" not in job_stats(again.stdout), again.stdout[-2000:]
    evaluated = snakemake(work, "eval_all", env=env, snakefile=snakefile)
    assert job_stats(evaluated.stdout) == {"evaluate": 1, "eval_all": 1}, evaluated.stdout[-2000:]
    evaluated_run = _child_run(work, env)  # the evaluate stage added the summary to the restored run
    assert json.loads((run / "metrics.json").read_text())["mlflow_run_id"] == evaluated_run["id"] == restored_run["id"]
    assert "avg_local_acc" in evaluated_run["curves"]
    # the partial report of the study: its finished runs only, not a run whose outputs exist but
    # whose job Snakemake did not record as complete (here a copy), nor the checkpoint-only runs
    for f in trained:
        shutil.copyfile(run / f, small / f)
    partial = subprocess.run([sys.executable, str(REPO / "scripts" / "partial_report.py"), STUDY, "--snakefile",
                              str(snakefile), "--configfile", "params.yaml"], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
    assert partial.returncode == 0, partial.stdout + partial.stderr
    report = work / "results" / STUDY / "report-partial"
    assert "the 1 finished runs" in (report / "table.md").read_text()
    assert set(pd.read_csv(report / "summary.csv")["method"]) == {"fedavg"}
    # restoring again logs nothing twice; a restored run without a run in the store (restored
    # before the store existed, or by an older version of the script) is logged
    again = _script(work, env, "restore", STUDY, "--snakefile", str(snakefile), "--configfile", "params.yaml")
    assert "nothing to restore" in again.stdout and "logged" not in again.stdout, again.stdout
    (run / "mlflow_run.json").unlink()
    again = _script(work, env, "restore", STUDY, "--snakefile", str(snakefile), "--configfile", "params.yaml")
    assert "logged synth/d/fedavg/seed1 to MLflow" in again.stdout, again.stdout
    assert len(_child_runs(work, env)) == 2

    # a changed hyper-parameter: the restored record holds the old params, so the run re-runs
    _fresh_clone(work)
    params = read_params(work)
    params["train"]["optimizer"]["lr"] = params["train"]["optimizer"]["lr"] / 2
    write_params(work, params)
    stale = _script(work, env, "restore", STUDY, "--snakefile", str(snakefile),
                    "--configfile", "params.yaml", check=False)
    assert stale.returncode == 1 and "would re-run" in stale.stderr, stale.stdout + stale.stderr
    assert "Params have changed" in stale.stdout, stale.stdout
    rerun = snakemake(work, "train_all", env=env, snakefile=snakefile)
    assert job_stats(rerun.stdout).get("train") == 1, rerun.stdout[-2000:]


def _fake_run(folder):
    """A finished run's archived files, two rounds of two clients, written by hand."""
    folder.mkdir(parents=True)
    rows = [{"round": r, "view": "global_on_local", "client_id": c, "n_samples": 10, "correct": 5 + r + c,
             "accuracy": (5 + r + c) / 10, "balanced_accuracy": 0.5, "loss": 1.0} for r in (0, 1) for c in (0, 1)]
    pd.DataFrame(rows).to_parquet(folder / "records.parquet")
    pd.DataFrame({"round": [0, 1], "lr": [0.01, 0.01], "bytes_up": [8, 8], "bytes_down": [8, 8],
                  "train_seconds": [2.0, 3.0], "eval_seconds": [0.5, 0.5], "round_seconds": [2.5, 3.5]}
                 ).to_parquet(folder / "rounds.parquet")
    job = {"study": "s", "dataset": "d", "partition": "p", "method": "fedavg", "algorithm": "fedavg", "seed": 1,
           "num_clients": 2, "train": {"rounds": 2}, "environment": {"device": "cpu", "cpu_model": "X"}}
    (folder / "job.json").write_text(json.dumps(job))
    return {"starttime": 1_000_000.0, "endtime": 1_000_010.0, "input": []}


def test_relog_dates_the_run_and_marks_a_failed_logging_for_the_next_restore(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import study_archive

    import medpfl.tracking as tracking
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    tracking.init_study("s", "s", tmp_path / "parent.json", uri=uri, artifact_root=tmp_path / "art")
    meta = _fake_run(tmp_path / "run")
    run_id = study_archive.relog_mlflow(tmp_path / "run", tmp_path / "parent.json", meta)
    c = MlflowClient(uri)
    run = c.get_run(run_id)
    assert (run.info.status, run.info.start_time, run.info.end_time) == ("FINISHED", 1_000_000_000, 1_000_010_000)
    # round 1 ends at the job's end; round 0 one round (3.5 s) earlier
    hist = sorted((m.step, m.timestamp, m.value) for m in c.get_metric_history(run_id, "global_on_local_mean"))
    assert [(step, ts) for step, ts, _ in hist] == [(0, 1_000_006_500), (1, 1_000_010_000)]
    assert [v for _, _, v in hist] == pytest.approx([0.55, 0.65])  # (0.5 + 0.6) / 2, (0.6 + 0.7) / 2

    real = tracking.retry

    def fail_on_metrics(fn, *args, **kwargs):
        if kwargs.get("metrics"):
            raise OSError("disk full")
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(tracking, "retry", fail_on_metrics)
    with pytest.raises(OSError, match="disk full"):
        study_archive.relog_mlflow(tmp_path / "run", tmp_path / "parent.json", meta)
    assert not (tmp_path / "run" / "mlflow_run.json").exists()  # the next restore logs it again
    failed = [r for r in c.search_runs([run.info.experiment_id]) if r.info.run_id != run_id
              and r.data.tags.get("medpfl.restored_from_archive")]
    assert [r.info.status for r in failed] == ["FAILED"]
