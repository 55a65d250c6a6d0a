"""The MLflow tracking server for many writers (``medpfl tracking-server``, issue 34).

The slow test starts a PostgreSQL-backed server through :mod:`medpfl.tracking_server` (what the
command runs), trains 16 jobs at once as separate ``medpfl train`` + ``medpfl evaluate``
processes logging to it under one study parent, and checks through ``MlflowClient`` that every
run, metric point, parameter, tag and artifact arrived; then the report stage's study step and
``medpfl ui`` on the server; then it stops what it started and checks that nothing is left
listening. Where PostgreSQL cannot run (its programs missing, or it does not start) that test
skips with the reason; it never passes without the server. The fast tests check the errors and
the pieces that need no PostgreSQL.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers import REPO, make_env
from medpfl import tracking_server as ts
from medpfl.cli import main
from medpfl.errors import PostgresUnavailable, TrackingServerError

#: 4 methods x 4 seeds = 16 training processes at once.
METHODS = ("fedavg", "fedprox", "fedper", "local")
SEEDS = (1, 2, 3, 4)
#: the artifacts every run has: from training (model, job) and from evaluation
RUN_ARTIFACTS = {"model/final_model.pt", "job.json", "evaluation/metrics.json", "evaluation/round_metrics.csv",
                 "evaluation/client_accuracy.csv", "evaluation/curves.png"}


def _closed(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) != 0


def _artifact_files(client, run_id: str, path: str | None = None) -> dict[str, int]:
    """``{artifact path: size}`` of every file under ``path`` of the run, listed by the server."""
    out = {}
    for f in client.list_artifacts(run_id, path):
        if f.is_dir:
            out.update(_artifact_files(client, run_id, f.path))
        else:
            out[f.path] = f.file_size
    return out


def _expected_points(run_dir: Path) -> collections.Counter:
    """Every metric point (key, step, value) that training and evaluation logged for the run in
    ``run_dir``, rebuilt from its files as the stages computed them: the per-round scalars of
    ``rounds.parquet`` and ``records.parquet`` (``medpfl.train.round_scalars``), the summary of
    ``metrics.json`` and the per-round columns of ``round_metrics.csv``, each rounded as logged,
    and ``resumed_from_round`` (0: every job here starts afresh)."""
    from medpfl.tracking import logged_value
    from medpfl.train import round_scalars

    def point(key, value, step):
        value = float(value)
        return None if value != value else (key, step, logged_value(value))

    points = []
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    records = pd.read_parquet(run_dir / "records.parquet")
    for row in rounds.to_dict("records"):
        recs = records[records["round"] == row["round"]].to_dict("records")
        points += [point(k, v, int(row["round"])) for k, v in round_scalars(recs, row).items() if v is not None]
    points.append(("resumed_from_round", 0, 0.0))  # logged at the end of training; 0: a fresh run, no checkpoint
    summary = json.loads((run_dir / "metrics.json").read_text())["summary"]
    points += [point(k, v, 0) for k, v in summary.items() if isinstance(v, (int, float))]
    per = pd.read_csv(run_dir / "round_metrics.csv")
    for _, row in per.iterrows():
        points += [point(c, row[c], int(row["round"])) for c in ("bwt", "global_on_local_worst", "local_acc_worst")
                   if pd.notna(row[c])]
    return collections.Counter(p for p in points if p is not None)


def _logged_points(client, run) -> collections.Counter:
    return collections.Counter((m.key, m.step, m.value) for key in run.data.metrics
                               for m in client.get_metric_history(run.info.run_id, key))


@pytest.fixture()
def server_dir():
    """A folder for the server that the ``postgres`` user can enter when we are root (pytest's
    own temporary folders are private to their owner); removed, with the server stopped, after."""
    d = Path(tempfile.mkdtemp(prefix="medpfl-ts-"))
    d.chmod(0o755)
    try:
        yield d / "server"
    finally:
        if (d / "server" / ts.STATE_FILE).is_file():
            try:
                ts.stop(d / "server")
            except TrackingServerError:
                pass
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_sixteen_training_processes_log_to_the_server_and_nothing_is_lost(tmp_path, server_dir, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from medpfl.doctor import check_mlflow
    from medpfl.tracking import flatten, run_name
    from tests.conftest import prepare_train_jobs

    t0 = time.monotonic()
    jobs, _ = prepare_train_jobs(tmp_path, methods=METHODS, seeds=SEEDS, counts=(64, 8, 16), num_clients=2,
                                 min_samples=8, study="many", mlflow=False,
                                 train={"rounds": 2, "local_epochs": 1, "batch_size": 32, "checkpoint_every": 0})
    assert len(jobs) == 16
    port = ts.free_port()
    try:
        rec = ts.start(server_dir, port=port)
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL cannot run here: {e}")
    t_started = time.monotonic()
    uri = rec["tracking_uri"]
    assert uri == f"http://127.0.0.1:{port}" and rec["started"] == ["postgres", "mlflow"]
    assert json.loads((server_dir / "server.json").read_text())["mlflow"]["pid"] == rec["mlflow"]["pid"]
    assert rec["postgres"]["backend_store_uri"].startswith("postgresql://")
    assert ts.status(server_dir)["running"]

    # the pipeline picks the server from MLFLOW_TRACKING_URI: mlflow-init as its rule runs it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results" / "many"
    parent_file = results / "mlflow_parent.json"
    assert main(["mlflow-init", "--study", "many", "--experiment", "medpfl-many", "--out", str(parent_file)]) == 0
    parent = json.loads(parent_file.read_text())
    assert parent["tracking_uri"] == uri

    env = make_env(tmp_path)
    env.update({"MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])})
    medpfl = [sys.executable, "-m", "medpfl.cli"]
    procs = {}
    for job in jobs:
        run_dir = results / "runs" / "synth" / "p" / job["method"] / f"seed{job['seed']}"
        run_dir.mkdir(parents=True)
        (run_dir / "job.in.json").write_text(json.dumps(job))
        train = medpfl + ["train", "--job", f"@{run_dir / 'job.in.json'}", "--arrays", str(tmp_path / "arrays.npz"),
                          "--samples", str(tmp_path / "samples.parquet"), "--partition-table",
                          str(tmp_path / "partition.parquet"), "--parent", str(parent_file), "--out-dir",
                          str(run_dir), "--threads", "1"]
        evaluate = medpfl + ["evaluate", "--run-dir", str(run_dir)]
        log = open(run_dir / "stage.log", "w")
        procs[run_dir] = (subprocess.Popen(f"{shlex.join(train)} && {shlex.join(evaluate)}", shell=True, env=env,
                                           stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path), log)
    deadline = time.monotonic() + 1500
    for run_dir, (p, log) in procs.items():
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        finally:
            log.close()
    failed = {str(d): (d / "stage.log").read_text()[-1500:] for d, (p, _) in procs.items() if p.returncode != 0}
    assert not failed, failed
    t_trained = time.monotonic()

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("medpfl-many")
    assert exp.artifact_location.startswith("mlflow-artifacts:/")  # the server places (and serves) artifacts
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent['parent_run_id']}'",
                                  max_results=100)
    assert len(children) == 16
    by_dir = {}
    for run_dir in procs:
        info = json.loads((run_dir / "mlflow_run.json").read_text())
        assert info["tracking_uri"] == uri and info["parent_run_id"] == parent["parent_run_id"]
        by_dir[run_dir] = info["run_id"]
    assert set(by_dir.values()) == {r.info.run_id for r in children}  # one child per process, no stray run
    runs = {r.info.run_id: r for r in children}
    open_at_once = 0
    points_checked = artifacts_checked = params_checked = 0
    for run_dir, run_id in by_dir.items():
        run = runs[run_id]
        job = json.loads((run_dir / "job.in.json").read_text())
        tags = run.data.tags
        assert run.info.status == "FINISHED"
        assert {k: tags.get(k) for k in ("study", "dataset", "partition", "method", "seed", "medpfl.role")} == {
            "study": "many", "dataset": "synth", "partition": "p", "method": job["method"], "seed": str(job["seed"]),
            "medpfl.role": "training"}
        assert run.info.run_name == run_name(job["method"], job["seed"], "synth", "p")
        assert tags["env.id"] == json.loads((run_dir / "job.json").read_text())["environment"]["id"]
        # every parameter of the job description, as logged
        assert run.data.params == {k: str(v)[:6000] for k, v in flatten(job).items()}
        params_checked += len(run.data.params)
        # every metric point of every round, and the summary: counts and values
        expected, logged = _expected_points(run_dir), _logged_points(client, run)
        assert logged == expected, (run_dir, expected - logged, logged - expected)
        assert {k for k, _, _ in expected} >= {"lr", "local_acc_mean", "avg_local_acc", "local_acc_worst"}
        assert {s for k, s, _ in expected if k == "lr"} == {0, 1}  # 2 rounds
        if job["method"] in ("fedavg", "fedprox"):  # FedPer and Local have no (single) global model
            assert {k for k, _, _ in expected} >= {"global_test_acc", "avg_global_acc", "bwt"}
        points_checked += sum(logged.values())
        # artifacts: listed by the server, stored in the server's folder, byte for byte the run's files
        listed = _artifact_files(client, run_id)
        assert set(listed) == RUN_ARTIFACTS, listed
        stored = server_dir / "artifacts" / exp.artifact_location.split(":/", 1)[1] / run_id / "artifacts"
        local = {"model/final_model.pt": run_dir / "final_model.pt", "job.json": run_dir / "job.json",
                 **{f"evaluation/{n}": run_dir / n for n in ("metrics.json", "round_metrics.csv",
                                                              "client_accuracy.csv", "curves.png")}}
        for path, size in listed.items():
            assert (stored / path).read_bytes() == local[path].read_bytes(), path
            assert size == local[path].stat().st_size
        artifacts_checked += len(listed)
        open_at_once = max(open_at_once, sum(r.info.start_time <= run.info.start_time <= (r.info.end_time or 0)
                                             for r in children))
    assert not (tmp_path / "mlartifacts").exists() and not (tmp_path / "mlruns.db").exists()

    # the study step: the report stage logs the study to the parent run on the server
    assert main(["report", "--runs", *map(str, procs), "--out-dir", str(results / "report"), "--parent",
                 str(parent_file), "--study-params", json.dumps({"study": "many", "seeds": list(SEEDS)})]) == 0
    study = client.get_run(parent["parent_run_id"])
    assert study.data.tags["medpfl.role"] == "study" and study.info.status == "FINISHED"
    note = study.data.tags["mlflow.note.content"]
    assert all(f"| {m} | 4 |" in note for m in METHODS), note  # a row per method, 4 seeds each
    assert study.data.params["study"] == "many"
    report = _artifact_files(client, parent["parent_run_id"])
    assert {"report/table.md", "report/summary.csv", "config/params.json"} <= set(report), report
    assert {r.data.tags["medpfl.role"] for r in client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{parent['parent_run_id']}'")} == {"training"}
    # medpfl ui and medpfl doctor on the server
    capsys.readouterr()
    assert main(["ui", "--study", "many", "--results", str(tmp_path / "results")]) == 0
    ui = capsys.readouterr().out
    assert "16 training runs" in ui and f"server:   the tracking server {uri}" in ui
    assert f"methods:  {uri}/#/experiments/{exp.experiment_id}/runs?" in ui
    assert check_mlflow().status == "ok"
    t_checked = time.monotonic()

    # stop exactly what start started; nothing is left listening
    pg_pid = rec["postgres"]["pid"]
    out = ts.stop(server_dir)
    assert out["stopped"] == ["mlflow", "postgres"]
    assert _closed("127.0.0.1", port)
    assert not ts.process_alive(rec["mlflow"]["pid"], rec["mlflow"]["start_ticks"])
    assert pg_pid and not ts.process_alive(pg_pid)
    assert not (server_dir / "postgres" / "socket" / f".s.PGSQL.{ts.PG_PORT}").exists()
    assert not ts._group_alive(rec["mlflow"]["pgid"])
    assert json.loads((server_dir / "server.json").read_text())["state"] == "stopped"
    st = ts.status(server_dir)
    assert (st["mlflow"], st["postgres"], st["running"]) == (False, False, False)
    print(f"\ntracking server test: data {t_started - t0:.1f} s incl. server start; 16 train+evaluate processes "
          f"{t_trained - t_started:.1f} s; checks + report {t_checked - t_trained:.1f} s; "
          f"{points_checked} metric points, {params_checked} params, {artifacts_checked} artifacts checked; "
          f"at most {open_at_once} runs open at once")
    assert open_at_once >= 8  # the writers overlapped (16 of 16 on 2 loaded cores, 2026-11-26)


def _post(port: int, host_header: str, origin: str) -> int:
    """The HTTP status of the UI's runs search (a POST, as the browser sends it) on the server at
    127.0.0.1:``port``, with the ``Host`` and ``Origin`` headers of a browser elsewhere."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/runs/search", method="POST",
                                 data=json.dumps({"experiment_ids": ["0"], "max_results": 1}).encode(),
                                 headers={"Host": host_header, "Origin": origin, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_a_server_on_every_interface_answers_by_the_machine_name(server_dir):
    """``--host 0.0.0.0``: the tracking URI names the machine, and MLflow 3's security middleware
    accepts that name as the ``Host`` of jobs and as the ``Origin`` of a browser (without it the
    UI's POSTs get 403 and its runs list stays empty); another name is still refused."""
    port = ts.free_port("0.0.0.0")
    try:
        rec = ts.start(server_dir, host="0.0.0.0", port=port)
    except PostgresUnavailable as e:
        pytest.skip(f"PostgreSQL cannot run here: {e}")
    try:
        name = ts.client_host("0.0.0.0")
        assert rec["tracking_uri"] == f"http://{name}:{port}" and rec["local_uri"] == f"http://127.0.0.1:{port}"
        assert _post(port, f"{name}:{port}", f"http://{name}:{port}") == 200
        assert _post(port, f"localhost:{port}", f"http://localhost:{port}") == 200
        assert _post(port, f"{name}:{port}", "http://elsewhere.example") == 403
        assert _post(port, f"elsewhere.example:{port}", f"http://{name}:{port}") == 403
    finally:
        assert ts.stop(server_dir)["stopped"] == ["mlflow", "postgres"]
    assert _closed("127.0.0.1", port)


@pytest.mark.slow
def test_a_server_that_does_not_come_up_in_time_leaves_nothing_running(server_dir):
    """An MLflow server that misses ``/health`` within the timeout: one error naming the URL and
    the log, and what that call started (MLflow's process group, PostgreSQL) is stopped again."""
    port = ts.free_port()
    with pytest.raises(TrackingServerError) as e:
        ts.start(server_dir, port=port, timeout=1.0)
    if isinstance(e.value, PostgresUnavailable):
        pytest.skip(f"PostgreSQL cannot run here: {e.value}")
    assert f"did not answer http://127.0.0.1:{port}/health within 1 s" in str(e.value) and "mlflow.log" in str(e.value)
    assert not (server_dir / ts.STATE_FILE).exists()
    assert not (server_dir / "postgres" / "data" / "postmaster.pid").exists()  # PostgreSQL stopped again
    assert not (server_dir / "postgres" / "socket" / f".s.PGSQL.{ts.PG_PORT}").exists()
    assert _closed("127.0.0.1", port)
    assert (server_dir / "postgres" / "data" / "PG_VERSION").is_file()  # the cluster stays, for the next start


# ----- fast: errors and pieces that need no PostgreSQL -----------------------------------------
def test_a_port_in_use_is_one_line_and_creates_nothing(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["tracking-server", "start", "--dir", str(tmp_path / "srv"), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {port} on 127.0.0.1 is in use" in err[0] and "--port" in err[0], err
    assert not (tmp_path / "srv").exists()


def test_postgres_missing_names_the_debian_package(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MEDPFL_PG_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(ts, "PG_ROOTS", (str(tmp_path / "none" / "*" / "bin"),))
    with pytest.raises(PostgresUnavailable, match="install Debian's `postgresql` package"):
        ts.find_postgres_bin()
    assert main(["tracking-server", "start", "--dir", str(tmp_path / "srv"), "--port", str(ts.free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "initdb" in err[0] and "apt-get install postgresql" in err[0], err
    monkeypatch.setenv("MEDPFL_PG_BIN", str(tmp_path))
    with pytest.raises(PostgresUnavailable, match=f"MEDPFL_PG_BIN={tmp_path}: no initdb"):
        ts.find_postgres_bin()


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(ts, "find_postgres_bin", lambda data=None: tmp_path)
    assert main(["tracking-server", "start", "--dir", str(tmp_path / "file" / "srv"),
                 "--port", str(ts.free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--dir {tmp_path / 'file' / 'srv'}: cannot create it" in err[0], err


def test_stop_and_status_without_a_server_say_so(tmp_path, capsys):
    for action in ("stop", "status"):
        assert main(["tracking-server", action, "--dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "server.json" in err and "no tracking server was started" in err


def test_stop_process_group_stops_every_process_of_the_group(tmp_path):
    p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    time.sleep(0.3)
    assert ts._group_alive(p.pid) and ts.process_alive(p.pid, ts.start_ticks(p.pid))
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # another group: left alone
    try:
        assert ts.stop_process_group(p.pid, timeout=10) is True
        assert not ts._group_alive(p.pid)
        assert ts.stop_process_group(p.pid) is False  # nothing left to stop
        assert other.poll() is None
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()


def test_a_recorded_pid_reused_by_another_process_is_not_taken_for_the_server():
    me = os.getpid()
    assert ts.process_alive(me, ts.start_ticks(me))
    assert not ts.process_alive(me, (ts.start_ticks(me) or 0) + 1)


def test_tracking_uri_and_allowed_hosts_for_a_wildcard_address():
    assert ts.client_host("127.0.0.1") == "127.0.0.1"
    name = ts.client_host("0.0.0.0")
    assert name not in ts.WILDCARD_HOSTS and not name.startswith("localhost")
    assert ts.default_allowed_hosts("127.0.0.1") is None  # MLflow's own default
    allowed = ts.default_allowed_hosts("0.0.0.0")
    assert socket.gethostname() in allowed and f"{socket.gethostname()}:*" in allowed and "localhost:*" in allowed
    assert ts.default_cors_origins("127.0.0.1", 5000) is None
    assert f"http://{socket.gethostname()}:5000" in ts.default_cors_origins("0.0.0.0", 5000)
    assert ts.default_cors_origins("10.1.2.3", 5000)[-1] == "http://10.1.2.3:5000"
    assert ts.backend_uri(Path("/srv/t s/postgres/socket")) == \
        "postgresql://postgres@/mlflow?host=/srv/t%20s/postgres/socket&port=5432"


def test_ui_and_doctor_on_a_server_that_does_not_answer_say_so_at_once(tmp_path, monkeypatch, capsys):
    """A tracking-server URI that answers nothing: ``medpfl ui`` prints the links on the server's
    own address without starting anything, ``medpfl doctor``'s store check fails in one line;
    neither waits for MLflow's client to retry."""
    from medpfl.doctor import check_mlflow

    uri = f"http://127.0.0.1:{ts.free_port()}"
    pf = tmp_path / "results" / "s" / "mlflow_parent.json"
    pf.parent.mkdir(parents=True)
    pf.write_text(json.dumps({"tracking_uri": uri, "experiment_id": "7", "parent_run_id": "abc", "study": "s",
                              "experiment": "e"}))
    t = time.monotonic()
    assert main(["ui", "--study", "s", "--results", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    assert f"server:   the tracking server {uri}" in out and "mlflow ui --backend-store-uri" not in out
    assert f"methods:  {uri}/#/experiments/7/runs?viewStateShareKey=medpfl-s-charts" in out
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    c = check_mlflow()
    assert c.status == "FAIL" and uri in c.detail and "unreachable" in c.detail
    assert time.monotonic() - t < 60


def test_the_command_is_documented():
    readme = (REPO / "README.md").read_text()
    cluster = (REPO / "docs" / "cluster.md").read_text()
    assert "medpfl tracking-server start" in readme and "tracking_server" in readme
    section = cluster[cluster.index("## A tracking server for many writers"):]
    for what in ("medpfl tracking-server start --dir", "MLFLOW_TRACKING_URI", "pg_dump", "medpfl tracking-server stop",
                 "SQLite", "artifacts"):
        assert what in section, what
