"""DVC gates the Snakemake DAG (docs/pipeline.md): ``dvc repro`` in a throw-away git+DVC copy of
the repository, on the tiny synthetic study, with a temporary MLflow store.

Checked: a first ``dvc repro`` builds everything and leaves ``dvc status`` clean; editing
``train.rounds`` re-runs the training jobs but skips the ``data`` stage (the partition keeps its
bytes and its mtime); editing ``partitions.<name>.alpha`` rebuilds the partition (without
re-downloading or re-preprocessing) and retrains on it.
"""

from __future__ import annotations

import json
import os
import subprocess

import pandas as pd
import pytest
import yaml

from helpers import (copy_repo, make_env, md5, read_params, run, snapshot,
                     tiny_params, tool, write_params, write_synthetic)

pytestmark = pytest.mark.slow

STUDY = "ci"
RUNS = f"results/{STUDY}/runs/synth/d"
PARTITION = "data/partitions/synth/d"


def _rounds_of(run_dir) -> int:
    return int(pd.read_parquet(run_dir / "rounds.parquet")["round"].max()) + 1


def _dvc_status_clean(repo, env):
    st = run([tool("dvc"), "status", "--json"], cwd=repo, env=env)
    assert json.loads(st.stdout or "{}") == {}, f"dvc status is not clean:\n{st.stdout}\n{st.stderr}"


@pytest.fixture
def dvc_repo(tmp_path):
    synth = write_synthetic(tmp_path / "synth.npz")
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_repo(repo)
    env = make_env(tmp_path)
    write_params(repo, tiny_params(synth, study=STUDY, methods=("fedavg", "local")))
    run(["git", "init", "-q"], cwd=repo, env=env)
    if not (repo / ".dvc" / "config").exists():
        run([tool("dvc"), "init", "-q"], cwd=repo, env=env)
    run([tool("dvc"), "config", "core.analytics", "false"], cwd=repo, env=env)
    run(["git", "add", "-A"], cwd=repo, env=env)
    run(["git", "commit", "-q", "-m", "tiny synthetic study"], cwd=repo, env=env)
    return repo, env


def test_dvc_repro_gates_stages(dvc_repo):
    repo, env = dvc_repo
    dvc = tool("dvc")

    # 1. first repro: every stage runs, everything exists, dvc.lock written, status clean.
    out = run([dvc, "repro"], cwd=repo, env=env, merge=True).stdout
    for stage in ("data", "train", "report"):
        assert f"Running stage '{stage}'" in out, out[-4000:]
    for method in ("fedavg", "local"):
        assert (repo / RUNS / method / "seed1" / "metrics.json").is_file()
        assert _rounds_of(repo / RUNS / method / "seed1") == 2
    for f in ("table.md", "table.html", "curves.png", "summary.csv", "summary.json"):
        assert (repo / "results" / STUDY / "report" / f).is_file(), f
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"data", "train", "report"}
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"]["rounds"] == 2
    _dvc_status_clean(repo, env)
    # the partition figure is no DVC out: rendered differently elsewhere (fonts, PNG encoder),
    # it does not make `dvc status` report the data stage as changed (docs/pipeline.md)
    fig = repo / "data" / "figures" / "synth" / "d" / "heatmap.png"
    assert fig.read_bytes().startswith(b"\x89PNG") and not (repo / PARTITION / "heatmap.png").exists()
    saved, st = fig.read_bytes(), fig.stat()
    fig.write_bytes(saved + b"rendered on another machine")
    _dvc_status_clean(repo, env)
    fig.write_bytes(saved)
    os.utime(fig, ns=(st.st_atime_ns, st.st_mtime_ns))
    run(["git", "add", "-A"], cwd=repo, env=env)
    run(["git", "commit", "-q", "-m", "repro 1"], cwd=repo, env=env)
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    assert not any(t.startswith(("data/raw/", "data/processed/", "data/partitions/", "data/figures/",
                                 f"results/{STUDY}/runs/"))
                   for t in tracked), "DVC outs or figures were committed to git (their .gitignore entries are missing)"

    # 2. nothing changed: DVC does not even start Snakemake.
    out = run([dvc, "repro"], cwd=repo, env=env, merge=True).stdout
    assert "Running stage" not in out, out[-4000:]

    # 3. edit train.rounds: the data stage is skipped, the training jobs re-run.
    data_before = snapshot(repo, "data/**/*")
    assert any(k.endswith("partition.parquet") for k in data_before)
    runs_before = snapshot(repo / RUNS)
    params = read_params(repo)
    params["train"]["rounds"] = 3
    write_params(repo, params)
    out = run([dvc, "repro"], cwd=repo, env=env, merge=True).stdout
    assert "Stage 'data' didn't change, skipping" in out, out[-4000:]
    assert "Running stage 'data'" not in out
    assert "Running stage 'train'" in out, out[-4000:]
    assert snapshot(repo, "data/**/*") == data_before, "the data stage rebuilt files although only train.rounds changed"
    retrained = all(_rounds_of(repo / RUNS / m / "seed1") == 3 for m in ("fedavg", "local"))
    assert retrained, f"the training jobs did not re-run with rounds=3:\n{out[-4000:]}"
    runs_after = snapshot(repo / RUNS)
    for m in ("fedavg", "local"):
        rel = f"{m}/seed1/records.parquet"
        assert runs_after[rel] != runs_before[rel], f"{rel} was not rewritten"
        metrics = json.loads((repo / RUNS / m / "seed1" / "metrics.json").read_text())
        assert metrics["summary"]["rounds"] == 3
    assert "Running stage 'report'" in out
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["train"]["params"]["params.yaml"]["train"]["rounds"] == 3
    _dvc_status_clean(repo, env)

    # 4. edit partitions.d.alpha: the partition is rebuilt (raw and processed data are kept,
    #    thanks to persist: true) and the training jobs use the new partition.
    raw_before = snapshot(repo, "data/raw/*") | snapshot(repo, "data/processed/*")
    part_md5 = md5(repo / PARTITION / "partition.parquet")
    records_before = snapshot(repo / RUNS, "*/seed1/records.parquet")
    params = read_params(repo)
    params["partitions"]["d"]["alpha"] = 5.0
    write_params(repo, params)
    out = run([dvc, "repro"], cwd=repo, env=env, merge=True).stdout
    assert "Running stage 'data'" in out, out[-4000:]
    stats = json.loads((repo / PARTITION / "client_stats.json").read_text())
    assert stats["config"]["alpha"] == 5.0
    assert md5(repo / PARTITION / "partition.parquet") != part_md5, "the partition was not rebuilt"
    assert snapshot(repo, "data/raw/*") | snapshot(repo, "data/processed/*") == raw_before, \
        "raw/processed data were rebuilt although only the partition changed"
    records_after = snapshot(repo / RUNS, "*/seed1/records.parquet")
    assert all(records_after[k] != records_before[k] for k in records_before), \
        "the training jobs did not re-run on the new partition"
    _dvc_status_clean(repo, env)


def test_doctor_and_sync_after_a_version_switch(dvc_repo):
    """`git checkout <old rev>` + `dvc checkout` restores the old outputs, which DVC calls up to
    date, but Snakemake's metadata still holds the newer params and wants to re-train
    (docs/pipeline.md). `medpfl doctor` says so; `medpfl sync` reconciles them."""
    repo, env = dvc_repo
    dvc, medpfl, smk = tool("dvc"), tool("medpfl"), tool("snakemake")
    run([dvc, "repro"], cwd=repo, env=env, merge=True)
    doc = run([medpfl, "doctor"], cwd=repo, env=env, check=False, merge=True)
    assert doc.returncode == 0, doc.stdout
    assert "all stages up to date" in doc.stdout and "nothing to be done" in doc.stdout, doc.stdout
    run(["git", "add", "-A"], cwd=repo, env=env)
    run(["git", "commit", "-q", "-m", "rounds 2"], cwd=repo, env=env)
    params = read_params(repo)
    params["train"]["rounds"] = 3
    write_params(repo, params)
    run([dvc, "repro"], cwd=repo, env=env, merge=True)
    run(["git", "add", "-A"], cwd=repo, env=env)
    run(["git", "commit", "-q", "-m", "rounds 3"], cwd=repo, env=env)

    run(["git", "checkout", "-q", "HEAD~1"], cwd=repo, env=env)
    run([dvc, "checkout"], cwd=repo, env=env, merge=True)
    _dvc_status_clean(repo, env)
    assert _rounds_of(repo / RUNS / "fedavg" / "seed1") == 2
    dry = run([smk, "--dry-run", "--cores", "1"], cwd=repo, env=env, merge=True).stdout
    assert "Nothing to be done" not in dry and "train" in dry, dry[-3000:]
    doc = run([medpfl, "doctor"], cwd=repo, env=env, check=False, merge=True)
    assert doc.returncode == 0 and "medpfl sync" in doc.stdout, doc.stdout
    sync = run([medpfl, "sync"], cwd=repo, env=env, check=False, merge=True)
    assert sync.returncode == 0, sync.stdout[-3000:]
    dry = run([smk, "--dry-run", "--cores", "1"], cwd=repo, env=env, merge=True).stdout
    assert "Nothing to be done" in dry, dry[-3000:]
    assert _rounds_of(repo / RUNS / "fedavg" / "seed1") == 2
    _dvc_status_clean(repo, env)


def test_push_to_a_local_remote_and_pull_into_a_fresh_clone(dvc_repo, tmp_path):
    """The documented way to share a study (docs/pipeline.md): commit dvc.lock, `dvc push` to a
    remote (a local folder here, as a team share), then in a fresh clone `dvc pull` restores the
    data, the runs and the report byte for byte, `dvc status` is clean (nothing re-runs), and
    `medpfl sync` makes Snakemake agree."""
    repo, env = dvc_repo
    dvc, medpfl, smk = tool("dvc"), tool("medpfl"), tool("snakemake")
    run([dvc, "repro"], cwd=repo, env=env, merge=True)
    remote = tmp_path / "team-remote"
    run([dvc, "remote", "add", "-d", "team", str(remote)], cwd=repo, env=env)
    run(["git", "add", "-A"], cwd=repo, env=env)
    run(["git", "commit", "-q", "-m", "study results and the team remote"], cwd=repo, env=env)
    run([dvc, "push"], cwd=repo, env=env, merge=True)
    assert any(remote.rglob("*")), "dvc push wrote nothing to the remote"

    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path, env=env)
    assert not (clone / RUNS).exists()  # the outputs are not in git
    pulled = run([dvc, "pull"], cwd=clone, env=env, merge=True).stdout
    assert "error" not in pulled.lower(), pulled
    for pattern in ("data/partitions/**/*.parquet", f"{RUNS}/**/*.parquet", f"results/{STUDY}/report/*"):
        here = {k: v[1] for k, v in snapshot(repo, pattern).items()}
        there = {k: v[1] for k, v in snapshot(clone, pattern).items()}
        assert here and here == there, pattern  # same files, same bytes
    _dvc_status_clean(clone, env)
    repro = run([dvc, "repro"], cwd=clone, env=env, merge=True).stdout
    assert "Running stage" not in repro, repro[-3000:]
    sync = run([medpfl, "sync"], cwd=clone, env=env, check=False, merge=True)
    assert sync.returncode == 0, sync.stdout[-3000:]
    dry = run([smk, "--dry-run", "--cores", "1"], cwd=clone, env=env, merge=True).stdout
    assert "Nothing to be done" in dry, dry[-3000:]
