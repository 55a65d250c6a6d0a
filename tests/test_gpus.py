"""One GPU per training job (medpfl.gpus): lock semantics between processes, the kept
CUDA_VISIBLE_DEVICES of a scheduler, bad settings, ``medpfl train`` recording its GPU, and a
real ``snakemake --resources gpu=2`` run whose jobs record what they were given. GPUs are faked
with ``MEDPFL_GPUS`` (lock files only: no CUDA is touched), so everything runs on a CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from medpfl.errors import GpuError
from medpfl.gpus import claim_for_device, claim_gpu, gpu_ids, gpu_locks, lock_dir
from tests.helpers import REPO, make_env, snakemake

CLAIM = textwrap.dedent("""
    import json, os, sys, time
    from medpfl.gpus import claim_gpu
    c = claim_gpu()
    print(json.dumps({"gpu": c.gpu, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "waited": c.waited_s}), flush=True)
    time.sleep(float(sys.argv[1]))
""")


def _env(tmp_path: Path, gpus: str = "0,1", **extra: str) -> dict[str, str]:
    env = make_env(tmp_path)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update({"MEDPFL_GPUS": gpus, "MEDPFL_GPU_LOCK_DIR": str(tmp_path / "locks"),
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]), **extra})
    return env


def _holder(env: dict, hold_s: float) -> tuple[subprocess.Popen, dict]:
    """A process that claims a GPU, reports it (one JSON line) and holds it ``hold_s`` seconds."""
    p = subprocess.Popen([sys.executable, "-c", CLAIM, str(hold_s)], env=env, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, f"the claiming process wrote nothing (exit {p.wait()})"
    return p, json.loads(line)


@pytest.fixture()
def gpu_env(tmp_path, monkeypatch):
    """This process's environment for in-process calls that take no lock: fake GPUs 0,1."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("MEDPFL_GPUS", "0,1")
    monkeypatch.setenv("MEDPFL_GPU_LOCK_DIR", str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_processes_get_distinct_gpus_and_a_killed_holder_frees_its_gpu(tmp_path, gpu_env):
    env = _env(tmp_path)
    a, got_a = _holder(env, 60)
    b, got_b = _holder(env, 60)
    try:
        assert {got_a["gpu"], got_b["gpu"]} == {"0", "1"}
        assert got_a["cvd"] == got_a["gpu"] and got_b["cvd"] == got_b["gpu"]
        # both held: a third job waits, then fails naming the lock folder and the holders
        with pytest.raises(GpuError, match=f"locked in {re.escape(str(gpu_env))}.*MEDPFL_GPU_LOCK_DIR.*pid {a.pid}"):
            claim_gpu(wait_s=0.3, poll_s=0.1)
        a.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock with the process
        a.wait()
        c, got_c = _holder(env, 0)
        assert got_c["gpu"] == got_a["gpu"] and got_c["waited"] < 1
        c.wait()
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_doctor_shows_who_holds_each_gpu_and_takes_none(tmp_path, gpu_env):
    """``gpu_locks`` / ``medpfl doctor``'s "gpu locks" line: a held GPU names its job's pid, a
    free one is free, all held is a warning; looking creates no lock folder and holds nothing."""
    from medpfl.doctor import check_gpu_locks

    assert gpu_locks() == [("0", None), ("1", None)] and not gpu_env.exists()  # nothing created
    assert check_gpu_locks().status == "ok"
    env = _env(tmp_path)
    a, got_a = _holder(env, 60)
    try:
        locks = dict(gpu_locks())
        assert locks[got_a["gpu"]].startswith(f"pid {a.pid} on ") and list(locks.values()).count(None) == 1
        c = check_gpu_locks()
        assert c.status == "ok" and f"GPU {got_a['gpu']} held by pid {a.pid}" in c.detail
        b, got_b = _holder(env, 60)  # looking did not take the free GPU: the next job gets it
        try:
            assert {got_a["gpu"], got_b["gpu"]} == {"0", "1"}
            c = check_gpu_locks()
            assert c.status == "warn" and "free none" in c.detail and "every GPU is held" in c.detail
        finally:
            b.kill()
            b.wait()
    finally:
        a.kill()
        a.wait()
    assert gpu_locks() == [("0", None), ("1", None)]  # the kernel dropped both locks with their processes


def test_a_job_waits_for_a_gpu_freed_by_a_job_that_ends(tmp_path):
    env = _env(tmp_path, gpus="0")
    first, got = _holder(env, 1.5)
    second, got2 = _holder(env, 0)
    assert got["gpu"] == got2["gpu"] == "0" and got2["waited"] > 0.5
    assert first.wait() == 0 and second.wait() == 0


def test_a_scheduler_cuda_visible_devices_is_kept(gpu_env, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    claim = claim_gpu()
    assert claim.gpu is None and claim.lock_file is None and "already set" in claim.reason
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and not gpu_env.exists()  # no lock taken


def test_bad_settings_name_their_variable(gpu_env, monkeypatch):
    for bad in ("0,,1", "0,0", "", "0;1"):
        monkeypatch.setenv("MEDPFL_GPUS", bad)
        with pytest.raises(GpuError, match="^MEDPFL_GPUS="):
            claim_gpu()
    monkeypatch.setenv("MEDPFL_GPUS", "0")
    monkeypatch.setenv("MEDPFL_GPU_WAIT", "soon")
    with pytest.raises(GpuError, match="^MEDPFL_GPU_WAIT='soon'"):
        claim_gpu()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_gpus_come_from_nvidia_smi_without_medpfl_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("MEDPFL_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert gpu_ids() == []  # no nvidia-smi: no GPU, nothing assigned
    assert claim_gpu().gpu is None and "CUDA_VISIBLE_DEVICES" not in os.environ
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaa)'\n"
                   "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbb)'\n")
    smi.chmod(0o755)
    assert gpu_ids() == ["0", "1"]


def test_which_jobs_claim_a_gpu(gpu_env, monkeypatch):
    assert claim_for_device("cuda:1") is None  # names its own GPU
    monkeypatch.delenv("MEDPFL_GPUS")
    assert claim_for_device("cpu") is None and claim_for_device("mps") is None
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and not gpu_env.exists()
    assert lock_dir() == gpu_env
    monkeypatch.delenv("MEDPFL_GPU_LOCK_DIR")
    assert lock_dir().name == f"medpfl-gpus-{os.getuid()}"


@pytest.mark.slow
def test_medpfl_train_records_its_gpu(tmp_path):
    """``medpfl train`` claims a (fake) GPU before torch starts and records it: log line,
    job.json's environment, the MLflow child's env.cuda_visible_devices tag."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import prepare_train_job

    job, uri = prepare_train_job(tmp_path, method="fedavg", study="gpus", train={"rounds": 1, "local_epochs": 1,
                                                                                  "batch_size": 32})
    env = _env(tmp_path, gpus="0,1", MLFLOW_TRACKING_URI=uri)
    a, held = _holder(env, 120)  # GPU 0 is taken: the job must get GPU 1
    try:
        out = tmp_path / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "medpfl.cli", "train", "--job", json.dumps(job), "--arrays",
             str(tmp_path / "arrays.npz"), "--samples", str(tmp_path / "samples.parquet"), "--partition-table",
             str(tmp_path / "partition.parquet"), "--parent", str(tmp_path / "parent.json"), "--out-dir", str(out)],
            env=env, capture_output=True, text=True, timeout=600)
    finally:
        a.kill()
        a.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert held["gpu"] == "0" and "GPU: CUDA_VISIBLE_DEVICES=1: GPU 1 of 0,1" in proc.stderr
    environment = json.loads((out / "job.json").read_text())["environment"]
    assert environment["cuda_visible_devices"] == "1"
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).data.tags["env.cuda_visible_devices"] == "1"


JOB_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from medpfl.gpus import claim_for_device
    claim = claim_for_device("auto")  # what medpfl train calls; MEDPFL_GPU_WAIT=0: a job never waits
    start = time.time()
    time.sleep(1.0)
    end = time.time()
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": claim.gpu, "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": end}, f)
""")


@pytest.mark.slow
def test_snakemake_runs_n_jobs_each_on_its_own_gpu(tmp_path):
    """``snakemake --cores 4 --resources gpu=2``, 6 jobs of 1 s, 2 fake GPUs: every job gets one
    of them, no two jobs share one at the same time, at most 2 run at once, a freed GPU is reused."""
    work = tmp_path / "wf"
    work.mkdir()
    (work / "job.py").write_text(JOB_SCRIPT)
    (work / "Snakefile").write_text(textwrap.dedent(f"""
        rule all:
            input: expand("done/{{i}}.json", i=range(6))

        rule job:
            output: "done/{{i}}.json"
            resources: gpu=1
            shell: "{sys.executable} job.py {{output}}"
    """))
    env = _env(tmp_path, gpus="0,1", MEDPFL_GPU_WAIT="0")
    snakemake(work, "--cores", "4", "--resources", "gpu=2", env=env, snakefile=work / "Snakefile", timeout=300)
    jobs = [json.loads(p.read_text()) for p in sorted((work / "done").glob("*.json"))]
    assert len(jobs) == 6
    assert all(j["gpu"] in ("0", "1") and j["cvd"] == j["gpu"] for j in jobs)
    for gpu in ("0", "1"):
        spans = sorted((j["start"], j["end"]) for j in jobs if j["gpu"] == gpu)
        assert len(spans) >= 2, f"GPU {gpu} was not reused: {spans}"  # a freed GPU is taken again
        assert all(nxt[0] >= prev[1] for prev, nxt in zip(spans, spans[1:])), f"two jobs at once on GPU {gpu}"
    events = sorted([(j["start"], 1) for j in jobs] + [(j["end"], -1) for j in jobs], key=lambda e: (e[0], e[1]))
    running, most = 0, 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most == 2  # the two GPUs in use at once, never more


@pytest.mark.slow
def test_gpu_limit_splits_the_cores_over_the_training_jobs(tmp_path):
    """On a machine with GPUs (a fake ``nvidia-smi``), ``--cores 8 --resources gpu=4`` gives each
    training job 8 // 4 = 2 threads, so 4 fit at once; the default profile's gpu=1 keeps 8."""
    from tests.helpers import copy_repo, tiny_params, write_params, write_synthetic

    snakefile = copy_repo(tmp_path / "workflow") / "Snakefile"
    work = tmp_path / "work"
    work.mkdir()
    write_params(work, tiny_params(write_synthetic(work / "synth.npz"), methods=("fedavg", "local"), seeds=(1, 2)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = _env(tmp_path)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"

    def train_threads(*args: str) -> set[str]:
        out = snakemake(work, "train_all", "--dry-run", "--printshellcmds", *args, env=env, snakefile=snakefile).stdout
        threads = re.findall(r"Shell command: medpfl train .* --threads (\d+) ", out)
        assert len(threads) == 4, out[-3000:]
        return set(threads)

    assert train_threads("--cores", "8", "--resources", "gpu=4") == {"2"}
    assert train_threads("--cores", "8") == {"8"}
