"""SLURM through Snakemake's own executor (snakemake-executor-plugin-slurm), on a real one-node
cluster that the module's fixture starts on this machine (``tests/slurm_local.py``: munged,
slurmctld, slurmd as root, select/cons_tres, no accounting daemon, two fake GPUs as GRES).

One study (2 methods x 1 seed, 4 clients, 8 rounds, a checkpoint every round) runs through
``--executor slurm --workflow-profile profiles/slurm`` with a cluster profile of the kind a user
writes (partition, no account, squeue status), and at the same time locally in another folder.
While the SLURM run trains, its FedAvg training job is cancelled with ``scancel`` after its first
checkpoint: Snakemake resubmits it and it resumes. Both runs' results must be equal (the
cancelled one too), and every cluster job must have gone through sbatch. Also at the same time,
a study with a data set declared with the wrong channel count fails in its preprocess job on the
cluster: tried retries + 1 times, its one error line in Snakemake's output.

Skipped, with the reason, where the cluster cannot start (not root, slurm-wlm or munge missing,
a real /etc/slurm/slurm.conf, a daemon that fails).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from helpers import copy_repo, make_env, mlflow_client, run, study_runs, tiny_params, tool, write_params, \
    write_synthetic
from slurm_local import ETC_CONF, MARKER, LocalSlurm, SlurmUnavailable

pytestmark = pytest.mark.slow

STUDY = "slurm"
METHODS = ("fedavg", "local")
ROUNDS = 8
CANCELLED = "fedavg"  # its training job is cancelled mid-run
SUBMITTED_RE = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/(\S*)/")
RESUME_RE = re.compile(r"resuming from checkpoint \S+ at round (\d+)")
# what the user's own profile holds on a cluster without accounting (docs/cluster.md)
CLUSTER_PROFILE = {
    "slurm-no-account": True,
    "slurm-status-command": "squeue",
    "slurm-init-seconds-before-status-checks": 1,
    "default-resources": ["slurm_partition=debug"],
}
# timings and memory differ between runs; everything else must be equal
TIMING_COLUMNS = ["train_seconds", "eval_seconds", "round_seconds", "peak_memory_bytes"]
TIMING_KEYS = {"wall_seconds", "seconds_per_round", "train_seconds_per_round", "eval_seconds_per_round",
               "peak_memory_mb"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The one-node cluster; after the module, exactly its daemons are stopped and its
    /etc/slurm links removed."""
    c = LocalSlurm(tmp_path_factory.mktemp("slurm"), gpus=2)
    try:
        c.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no local SLURM cluster: {e}")
    yield c
    procs = list(c.procs.values())
    c.stop()
    assert all(p.poll() is not None for p in procs) and not c.linked
    assert not (ETC_CONF.is_symlink() and MARKER in str(ETC_CONF.readlink()))


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """A snapshot of the repository's workflow and profiles, and a user's cluster profile."""
    snap = copy_repo(tmp_path_factory.mktemp("workflow"))
    user = tmp_path_factory.mktemp("cluster-profile")
    (user / "profile.yaml").write_text(yaml.safe_dump(CLUSTER_PROFILE))
    return snap, user


def _env(work: Path) -> dict:
    env = make_env(work)
    env["PYTHONPATH"] = f"{Path(__file__).resolve().parents[1] / 'src'}"  # this checkout's medpfl in the jobs
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _slurm_cmd(snap: Path, user: Path, work: Path, *args: str) -> list[str]:
    return [tool("snakemake"), "-s", str(snap / "Snakefile"), "--directory", str(work),
            "--workflow-profile", str(snap / "profiles" / "slurm"), "--profile", str(user),
            "--set-threads", "train=1", *args]  # 1 CPU each: the 2-CPU node runs both trainings at once


def _squeue(cluster, *fmt: str) -> list[list[str]]:
    """Rows of ``squeue -a -t all`` (finished jobs stay listed for MinJobAge = 300 s)."""
    out = subprocess.run(["squeue", "-h", "-a", "-t", "all", "-o", "|".join(fmt)], capture_output=True, text=True,
                         env=cluster.env(), check=True).stdout
    return [line.split("|") for line in out.splitlines() if line]


def _run_dir(work: Path, method: str) -> Path:
    return work / "results" / STUDY / "runs" / "synth" / "d" / method / "seed1"


@pytest.fixture(scope="module")
def failing(cluster, workflow, tmp_path_factory):
    """A study whose custom data set is declared with 1 channel (the file has 3), started through
    SLURM at once (``_finish`` waits for it): the params pass the DAG-time check, which does not
    read the file, and the preprocess job on the cluster stops with one line."""
    snap, user = workflow
    work = tmp_path_factory.mktemp("failing")
    synth = write_synthetic(work / "synth.npz")
    params = tiny_params({**synth, "n_channels": 1}, study="bad", methods=("fedavg",))
    write_params(work, params)
    env = _env(work)
    out = open(work / "snakemake.out", "w")
    proc = subprocess.Popen(_slurm_cmd(snap, user, work), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    yield {"work": work, "env": env, "params": params, "proc": proc}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _finish(proc: subprocess.Popen, out_file: Path, timeout: float = 500) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out_file.read_text()


@pytest.fixture(scope="module")
def study(cluster, workflow, failing, tmp_path_factory):
    """The study through SLURM, with the FedAvg training cancelled once after its first
    checkpoint, and meanwhile the same study locally, in another folder. Returns a dict: both
    folders, the SLURM run's output, the cancelled job's id and the rounds its checkpoint held."""
    snap, user = workflow
    data = tmp_path_factory.mktemp("data")
    params = tiny_params(write_synthetic(data / "synth.npz"), study=STUDY, methods=METHODS, rounds=ROUNDS,
                         checkpoint_every=1)
    work, local = tmp_path_factory.mktemp("slurm-study"), tmp_path_factory.mktemp("local-study")
    for w in (work, local):
        write_params(w, params)

    out_file = work / "snakemake.out"
    with open(out_file, "w") as out:
        proc = subprocess.Popen(_slurm_cmd(snap, user, work), cwd=work, env=_env(work), stdout=out,
                                stderr=subprocess.STDOUT)
    # the same study locally, 1 thread per training job as on the cluster (results depend on it)
    with open(local / "snakemake.out", "w") as out:
        ref = subprocess.Popen([tool("snakemake"), "-s", str(snap / "Snakefile"), "--directory", str(local),
                                "--cores", "2", "--set-threads", "train=1"], cwd=local, env=_env(local), stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        ckpt = _run_dir(work, CANCELLED) / "checkpoint.pt"
        deadline = time.monotonic() + 400
        held = 0
        while held < 1:  # the first checkpoint: round 1 of 8 done, the job inside round 2
            assert proc.poll() is None, f"snakemake exited before the checkpoint:\n{out_file.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint in {ckpt}:\n{out_file.read_text()[-4000:]}"
            time.sleep(0.05)
            try:
                held = torch.load(ckpt, weights_only=False)["next_round"]
            except (FileNotFoundError, EOFError, RuntimeError):
                held = 0
        comment = f"rule_train_wildcards_{STUDY}_synth_d_{CANCELLED}_1"
        running = [jid for jid, state, c in _squeue(cluster, "%i", "%T", "%k") if c == comment and state == "RUNNING"]
        assert len(running) == 1, _squeue(cluster, "%i", "%T", "%k")
        subprocess.run(["scancel", running[0]], env=cluster.env(), check=True)
        finished_before_cancel = (_run_dir(work, CANCELLED) / "records.parquet").exists()
    finally:
        text = _finish(proc, out_file)
        ref_text = _finish(ref, local / "snakemake.out")
    assert ref.returncode == 0, ref_text[-6000:]
    assert proc.returncode == 0, text[-6000:]
    return {"work": work, "local": local, "out": text, "cancelled_job": running[0], "held": held,
            "finished_before_cancel": finished_before_cancel}


def _submissions(out: str) -> list[tuple[str, str, str]]:
    """``[(slurm job id, rule, job's log folder name)]`` of every sbatch Snakemake made."""
    return SUBMITTED_RE.findall(out)


def test_every_cluster_job_went_through_sbatch(study, cluster):
    subs = _submissions(study["out"])
    rules = sorted(r for _, r, _ in subs)
    # the data stages, 2 trainings (FedAvg twice: cancelled, then resubmitted), 2 evaluations, 1 report
    assert rules == ["evaluate", "evaluate", "partition", "partition_figure", "preprocess", "report", "train", "train",
                     "train"], study["out"][-4000:]
    states = {jid: state for jid, state in _squeue(cluster, "%i", "%T")}
    for jid, rule, _ in subs:
        expected = "CANCELLED" if jid == study["cancelled_job"] else "COMPLETED"
        assert states.get(jid) == expected, (jid, rule, states)
    # the training jobs asked for a GPU (the profile's gpu: 1 -> --gpus=1) and SLURM gave each one
    # (fake GRES) through CUDA_VISIBLE_DEVICES, which medpfl kept and recorded (the tests' env has none)
    for m in METHODS:
        env = json.loads((_run_dir(study["work"], m) / "job.json").read_text())["environment"]
        assert env["cuda_visible_devices"] in ("0", "1"), env
    # the login-node rules stayed local: no download or mlflow_init job was submitted
    assert not {"download", "mlflow_init"} & set(rules)


def test_slurm_results_equal_the_local_run(study):
    work, local = study["work"], study["local"]
    for m in METHODS:
        a, b = _run_dir(local, m), _run_dir(work, m)
        pd.testing.assert_frame_equal(pd.read_parquet(a / "records.parquet"), pd.read_parquet(b / "records.parquet"))
        ra, rb = (pd.read_parquet(d / "rounds.parquet").drop(columns=TIMING_COLUMNS) for d in (a, b))
        pd.testing.assert_frame_equal(ra, rb)
        sa, sb = (json.loads((d / "metrics.json").read_text())["summary"] for d in (a, b))
        assert {k: v for k, v in sa.items() if k not in TIMING_KEYS} == \
            {k: v for k, v in sb.items() if k not in TIMING_KEYS}, m
        assert sb["rounds"] == ROUNDS
    report = work / "results" / STUDY / "report"
    assert (report / "table.md").is_file() and all(m in (report / "table.md").read_text() for m in METHODS)
    # MLflow (the local SQLite store, written from the cluster's jobs): a FINISHED child per run of
    # the SLURM run, under the study's one parent, with the full curve
    client = mlflow_client(work)
    parents, children = study_runs(client)
    assert len(parents) == 1
    for m in METHODS:
        rid = json.loads((_run_dir(work, m) / "mlflow_run.json").read_text())["run_id"]
        child = client.get_run(rid)
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert [x.step for x in client.get_metric_history(rid, "local_bal_acc_mean")] == list(range(ROUNDS))


def test_a_cancelled_training_job_is_resubmitted_and_resumes(study):
    work, out = study["work"], study["out"]
    assert not study["finished_before_cancel"] and 1 <= study["held"] < ROUNDS
    trains = [jid for jid, rule, name in _submissions(out) if rule == "train" and name.endswith(f"_{CANCELLED}_1")]
    assert len(trains) == 2 and trains[0] == study["cancelled_job"], trains  # cancelled, then resubmitted
    assert "Trying to restart job" in out
    # the second attempt resumed from the checkpoint (train.log is rewritten by each attempt)
    log = (_run_dir(work, CANCELLED) / "train.log").read_text()
    resumed = [int(r) for r in RESUME_RE.findall(log)]
    assert len(resumed) == 1 and study["held"] <= resumed[0] < ROUNDS, log[-3000:]
    assert f"round {resumed[0] + 1}/{ROUNDS}" in log and f"round 1/{ROUNDS} " not in log  # no round trained twice
    assert not (_run_dir(work, CANCELLED) / "checkpoint.pt").exists()
    # one MLflow run continued across both attempts
    client = mlflow_client(work)
    rid = json.loads((_run_dir(work, CANCELLED) / "mlflow_run.json").read_text())["run_id"]
    assert client.get_run(rid).data.metrics["resumed_from_round"] == resumed[0]
    print(f"cancelled SLURM job {study['cancelled_job']} with {study['held']} rounds checkpointed; "
          f"resubmitted as {trains[1]}, resumed at round {resumed[0]}")


def test_a_job_time_error_is_tried_retries_plus_one_times_and_its_line_shown(cluster, workflow, failing):
    """The failing study (fixture ``failing``): its preprocess job is tried retries + 1 times,
    each stopping with the same line, then Snakemake stops and shows it."""
    snap, user = workflow
    retries = yaml.safe_load((snap / "profiles" / "slurm" / "profile.yaml").read_text())["retries"]
    work, env, params = failing["work"], failing["env"], failing["params"]
    out = _finish(failing["proc"], work / "snakemake.out")
    assert failing["proc"].returncode != 0
    line = "train_images has 3 channels; the data set's metadata says 1"
    assert line in out, out[-4000:]  # the job's one error line, shown by Snakemake (show-failed-logs)
    subs = _submissions(out)
    assert [r for _, r, _ in subs] == ["preprocess"] * (retries + 1), subs

    # a params error Snakemake's DAG-time check sees stops before any submission
    before = {jid for (jid,) in _squeue(cluster, "%i")}
    params["train"]["roundz"] = 3
    write_params(work, params)
    proc = run(_slurm_cmd(snap, user, work), cwd=work, env=env, check=False, merge=True, timeout=300)
    assert proc.returncode != 0 and "roundz" in proc.stdout and not _submissions(proc.stdout), proc.stdout[-3000:]
    assert {jid for (jid,) in _squeue(cluster, "%i")} == before
