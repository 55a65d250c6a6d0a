"""Fault injection: killed training jobs resume to identical numbers, killed stages leave no
file a later stage trusts, tracking faults are caught, and nothing but the declared uploads
crosses from clients to the server."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from medpfl.config import EvalConfig, TrainConfig
from medpfl.fl.engine import Engine, UploadSpecError, check_upload
from medpfl.io import TMP_PREFIX, atomic_path, md5sum
from medpfl.tracking import RunLogger, TrackingError, init_study, round_significant
from tests.conftest import SHARED_BLOOD, initial_params, make_algo, prepare_train_job

MEDPFL = [sys.executable, "-m", "medpfl.cli"]


# ----- a prepared training job on synthetic data -------------------------------------------
@pytest.fixture()
def job_dir(tmp_path):
    """Arrays, partition table, MLflow parent and a 6-round job description in tmp_path."""
    job, uri = prepare_train_job(tmp_path, method="fedkper", seed=3, counts=(600, 20, 120), min_samples=20,
                                 study="faults", train={"rounds": 6, "local_epochs": 2, "batch_size": 16,
                                                        "checkpoint_every": 1})
    return tmp_path, job, uri


def _train_cmd(d: Path, job: dict, out: str, parent: str = "parent.json") -> list[str]:
    return MEDPFL + ["train", "--job", json.dumps(job), "--arrays", str(d / "arrays.npz"), "--samples",
                     str(d / "samples.parquet"), "--partition-table", str(d / "partition.parquet"),
                     "--parent", str(d / parent), "--out-dir", str(d / out), "--threads", "1"]


def _env(uri: str) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _records(run: Path) -> pd.DataFrame:
    return pd.read_parquet(run / "records.parquet")


def _wait_until(condition, proc: subprocess.Popen | None, what: str, timeout: float = 300) -> None:
    """Poll ``condition()`` (a file-system state) until it holds; fail when ``proc`` exits first or
    after ``timeout`` seconds (a bound against a hang, not a guess at how long a step takes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            assert condition(), f"the process exited (status {proc.returncode}) before {what}"
            return
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


class _CheckpointWatch:
    """``rounds()``: the rounds the checkpoint at ``path`` holds (its ``next_round``; 0 while none
    exists), read again only when the file was replaced (it is written atomically)."""

    def __init__(self, path: Path):
        self.path, self._stamp, self._rounds = path, None, 0

    def rounds(self) -> int:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return 0
        if (st.st_ino, st.st_mtime_ns) != self._stamp:
            self._stamp = (st.st_ino, st.st_mtime_ns)
            self._rounds = torch.load(self.path, weights_only=False)["next_round"]
        return self._rounds


def test_sigkill_mid_round_resumes_to_identical_metrics(job_dir):
    d, job, uri = job_dir
    env = _env(uri)
    subprocess.run(_train_cmd(d, job, "clean"), env=env, check=True, capture_output=True)

    log = open(d / "killed.log", "w")
    proc = subprocess.Popen(_train_cmd(d, job, "killed"), env=env, stdout=log, stderr=subprocess.STDOUT)
    killed = d / "killed"
    # kill as soon as the checkpoint holds 3 rounds: the job is then inside round 4 of 6 (a
    # checkpoint is written at the end of a round, after its log line)
    watch = _CheckpointWatch(killed / "checkpoint.pt")
    _wait_until(lambda: watch.rounds() >= 3, proc, "checkpoint of round 3")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, (d / "killed.log").read_text()
    assert (killed / "checkpoint.pt").exists() and not (killed / "records.parquet").exists()
    ckpt = torch.load(killed / "checkpoint.pt", weights_only=False)
    assert 3 <= ckpt["next_round"] < 6
    run_id = json.loads((killed / "mlflow_run.json").read_text())["run_id"]

    r = subprocess.run(_train_cmd(d, job, "killed"), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from checkpoint" in r.stderr
    pd.testing.assert_frame_equal(_records(d / "clean"), _records(killed))  # exact: losses too
    a = torch.load(d / "clean" / "final_model.pt")["global"]
    b = torch.load(killed / "final_model.pt")["global"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (killed / "checkpoint.pt").exists()
    # the same MLflow child run continued: one child per job directory, FINISHED, full history
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    assert json.loads((killed / "mlflow_run.json").read_text())["run_id"] == run_id
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = {m.step for m in c.get_metric_history(run_id, "global_test_acc")}
    assert steps == set(range(6))
    children = c.search_runs([run.info.experiment_id], "tags.method = 'fedkper'")
    assert len(children) == 2  # the clean job and the killed-then-resumed one, not three


def test_exception_marks_run_failed_and_keeps_checkpoint(job_dir, monkeypatch):
    d, job, uri = job_dir
    import medpfl.train as train_mod
    from mlflow.tracking import MlflowClient

    real = train_mod.round_scalars

    def boom(records, row):
        if row["round"] == 2:
            raise RuntimeError("injected fault in round 2")
        return real(records, row)

    monkeypatch.setattr(train_mod, "round_scalars", boom)
    out = d / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        train_mod.run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", out,
                               parent_file=d / "parent.json")
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"
    assert (out / "checkpoint.pt").exists()  # rounds 0-1 kept
    assert torch.load(out / "checkpoint.pt", weights_only=False)["next_round"] == 2
    monkeypatch.setattr(train_mod, "round_scalars", real)
    train_mod.run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", out,
                           parent_file=d / "parent.json")
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert MlflowClient(uri).get_metric_history(run_id, "resumed_from_round")[-1].value == 2


def test_resume_from_a_checkpoint_of_an_older_engine_without_newer_round_columns(fed_data, tmp_path):
    """A checkpoint written before the round log had ``bytes_up_dense`` and ``peak_memory_bytes``
    (older engines) resumes and finishes: those rounds hold nulls in the round log, the later
    ones values, and the records equal an uninterrupted run's."""
    from medpfl.metrics import summarize_run

    def engine(rounds, ckpt):
        train = TrainConfig(rounds=rounds, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1)
        return Engine(make_algo("fedavg"), fed_data, train, EvalConfig(every=1), seed=1,
                      executor_kind="sequential", checkpoint=ckpt, fingerprint="old-ckpt")

    def stop_in_round_3(r, row, recs):  # callbacks run before the round's checkpoint is written
        if r == 2:
            raise KeyboardInterrupt

    ckpt = tmp_path / "checkpoint.pt"
    e = engine(4, ckpt)
    e.callbacks.append(stop_in_round_3)
    with pytest.raises(KeyboardInterrupt):  # as a killed job: the checkpoint holds rounds 0 and 1
        e.run()
    blob = torch.load(ckpt, weights_only=False)
    assert blob["next_round"] == 2
    for row in blob["rounds"]:
        del row["bytes_up_dense"], row["peak_memory_bytes"]
    torch.save(blob, ckpt)

    res = engine(4, ckpt).run()
    assert res.resumed_from == 2
    rounds = res.rounds
    assert str(rounds["peak_memory_bytes"].dtype) == "Int64" and str(rounds["bytes_up_dense"].dtype) == "Int64"
    assert rounds["peak_memory_bytes"].isna().tolist() == [True, True, False, False]
    assert rounds["bytes_up_dense"].isna().tolist() == [True, True, False, False]
    assert (rounds["peak_memory_bytes"].iloc[2:] > 0).all()
    full = engine(4, None).run()
    assert full.records.drop(columns=["loss"]).equals(res.records.drop(columns=["loss"]))
    _, s = summarize_run(res.records, rounds, fed_data.num_clients, has_global_model=True, personalized=False)
    assert s["peak_memory_mb"] == float(rounds["peak_memory_bytes"].max()) / 1e6


def test_an_unreadable_checkpoint_is_set_aside_and_the_run_starts_over(fed_data, tmp_path, caplog, monkeypatch):
    """A checkpoint cut short (a disk that filled, a copy between file systems that stopped
    half-way) is moved to ``checkpoint.corrupt`` with a warning naming it, and the run starts
    from round 0 to the numbers of a run that never had one; a killed checkpoint write leaves
    the previous checkpoint whole (``atomic_path``), so a resubmitted job resumes from it."""
    def engine(ckpt):
        train = TrainConfig(rounds=3, participation=0.6, local_epochs=1, batch_size=16, checkpoint_every=1)
        return Engine(make_algo("fedavg"), fed_data, train, EvalConfig(every=1), seed=1,
                      executor_kind="sequential", checkpoint=ckpt, fingerprint="corrupt-ckpt")

    ckpt = tmp_path / "checkpoint.pt"
    first = engine(ckpt).run()
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level("WARNING"):
        res = engine(ckpt).run()
    assert res.resumed_from == 0
    assert (tmp_path / "checkpoint.corrupt").read_bytes() == whole[: len(whole) // 2]
    assert any("checkpoint.pt unreadable" in r.getMessage() for r in caplog.records)
    assert res.records.drop(columns=["loss"]).equals(first.records.drop(columns=["loss"]))

    ckpt.write_bytes(whole)  # the finished run's checkpoint: next_round 3
    e = engine(ckpt)

    def killed_mid_write(obj, f):
        Path(f).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        e._save_checkpoint(None, [], [], [], 1)
    monkeypatch.undo()
    assert ckpt.read_bytes() == whole and [p.name for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_unreachable_tracking_server_fails_before_training(job_dir):
    d, job, uri = job_dir
    bad = json.loads((d / "parent.json").read_text())
    bad["tracking_uri"] = "http://127.0.0.1:9"  # discard port: nothing listens
    (d / "bad_parent.json").write_text(json.dumps(bad))
    # fails fast: no waiting out MLflow's HTTP retries (minutes); the timeout raises if it hangs
    r = subprocess.run(_train_cmd(d, job, "unreach", parent="bad_parent.json"), env=_env(uri), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "http://127.0.0.1:9" in r.stderr and "unreachable" in r.stderr
    assert "Traceback" not in r.stderr
    assert "round 1/" not in r.stderr  # no round trained
    assert not (d / "unreach" / "checkpoint.pt").exists() and not (d / "unreach" / "records.parquet").exists()
    with pytest.raises(TrackingError, match="unreachable"):
        init_study("x", "x", d / "p2.json", uri="http://127.0.0.1:9")


def _writer(uri: str, parent: str, out: str, idx: int, rounds: int, keys: int) -> None:
    os.environ["MLFLOW_TRACKING_URI"] = uri
    lg = RunLogger(Path(parent), Path(out) / f"run{idx}.json", f"writer{idx}", {"writer": str(idx)})
    for r in range(rounds):
        lg.log_metrics({f"m{k}": idx * 1000 + r + k / 10 for k in range(keys)}, step=r)
    lg.finish()


def test_eight_parallel_writers_lose_no_metric(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    init_study("par", "par", tmp_path / "parent.json", uri=uri, artifact_root=tmp_path / "art")
    ctx = mp.get_context("spawn")
    rounds, keys = 40, 6
    procs = [ctx.Process(target=_writer, args=(uri, str(tmp_path / "parent.json"), str(tmp_path), i, rounds, keys))
             for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    from mlflow.tracking import MlflowClient

    c = MlflowClient(uri)
    for i in range(8):
        run_id = json.loads((tmp_path / f"run{i}.json").read_text())["run_id"]
        for k in range(keys):
            hist = c.get_metric_history(run_id, f"m{k}")
            assert sorted((m.step, m.value) for m in hist) == [(r, round_significant(i * 1000 + r + k / 10))
                                                               for r in range(rounds)]


def test_interrupted_atomic_write_leaves_nothing(tmp_path):
    target = tmp_path / "out.parquet"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"PAR1 half a file")
            raise KeyboardInterrupt
    assert not target.exists() and list(tmp_path.iterdir()) == []
    target.write_text("old")
    with pytest.raises(ValueError):
        with atomic_path(target) as tmp:
            tmp.write_text("new but broken")
            raise ValueError
    assert target.read_text() == "old"  # the previous complete output survives


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_BLOOD.exists(), reason="needs the BloodMNIST mirror (a write that takes a while)")
def test_preprocess_killed_mid_write_never_leaves_a_partial_output(tmp_path):
    """Kill `medpfl preprocess` on real BloodMNIST at several moments, each recognised on the file
    system (not guessed from a clock): at once, while the arrays' temporary file is being written,
    once the arrays are in place, while the sample table's temporary is being written, and after
    it finished. The output is either absent or complete, and a re-run gives the same bytes as a
    clean run. (A write faster than the 10 ms poll is killed at the next moment instead.)"""
    clean_a, clean_s = tmp_path / "clean.npz", tmp_path / "clean.samples.parquet"
    cmd = MEDPFL + ["preprocess", "--dataset", "bloodmnist", "--raw", str(SHARED_BLOOD)]
    subprocess.run(cmd + ["--out", str(clean_a), "--samples", str(clean_s)], check=True, capture_output=True)

    def writing(out: Path) -> bool:  # atomic_path's temporary for ``out`` (or ``out`` itself) exists
        return out.exists() or any(tmp_path.glob(f"{TMP_PREFIX}{out.stem}-*"))

    outcomes = []
    for i, moment in enumerate(["at once", "arrays being written", "arrays in place", "samples being written",
                                "finished"]):
        a, s = tmp_path / f"k{i}.npz", tmp_path / f"k{i}.samples.parquet"
        reached = {"at once": lambda: True, "arrays being written": lambda: writing(a), "arrays in place": a.exists,
                   "samples being written": lambda: writing(s)}
        p = subprocess.Popen(cmd + ["--out", str(a), "--samples", str(s)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        if moment == "finished":
            assert p.wait(timeout=600) == 0
        else:
            _wait_until(reached[moment], p, moment, timeout=600)
        p.kill()
        p.wait()
        for out, ref in ((a, clean_a), (s, clean_s)):
            if out.exists():
                assert md5sum(out) == md5sum(ref), f"{out} exists but differs from a clean run's output"
        outcomes.append((a.exists(), s.exists()))
        # a later stage either finds no input or a complete one; a re-run completes it identically
        subprocess.run(cmd + ["--out", str(a), "--samples", str(s)], check=True, capture_output=True)
        assert md5sum(a) == md5sum(clean_a) and md5sum(s) == md5sum(clean_s)
    # leftover temporaries carry the recognisable prefix that .dvcignore excludes
    assert all(f.name.startswith(".medpfl-tmp-") for f in tmp_path.iterdir() if f.name.startswith("."))
    assert any(not x for x, _ in outcomes), "no kill landed before the arrays were written"


# ----- the upload check (declared keys and shapes) -----------------------------------------
def test_upload_check_rejects_undeclared_or_per_sample_uploads():
    algo = make_algo("fedavg")
    spec = algo.upload_spec()
    shapes = {k: v.shape for k, v in initial_params().items()}
    good = {"model": {k: torch.zeros(2, *s) for k, s in shapes.items()}, "num_samples": torch.ones(2)}
    check_upload(algo.name, spec, good, 2)
    with pytest.raises(UploadSpecError, match="declared"):
        check_upload(algo.name, spec, {**good, "images": torch.zeros(2, 10, 3, 28, 28)}, 2)
    with pytest.raises(UploadSpecError, match="num_samples"):
        check_upload(algo.name, spec, {**good, "num_samples": torch.zeros(2, 37)}, 2)  # per-sample labels
    bad = {**good, "model": {**good["model"], "fc.weight": torch.zeros(2, 10, 3, 28, 28)}}
    with pytest.raises(UploadSpecError, match="fc.weight"):
        check_upload(algo.name, spec, bad, 2)
    extra = {**good, "model": {**good["model"], "label_hist": torch.zeros(2, 4)}}
    with pytest.raises(UploadSpecError, match="declared tensors"):
        check_upload(algo.name, spec, extra, 2)


def test_a_method_that_uploads_data_is_stopped(fed_data):
    """A (buggy or malicious) method that sends its labels: the engine refuses before aggregation."""
    algo = make_algo("fedavg")
    real = algo.finish

    def leaky(trees, ctx, state, info, rnd):
        up, st, model = real(trees, ctx, state, info, rnd)
        return {**up, "label_hist": info["label_hist"]}, st, model

    algo.finish = leaky
    with pytest.raises(UploadSpecError, match="label_hist"):
        Engine(algo, fed_data, TrainConfig(rounds=1, participation=0.6, local_epochs=1), EvalConfig(), seed=0,
               executor_kind="sequential").run()
