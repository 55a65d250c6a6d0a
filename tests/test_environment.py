"""The environment fingerprint: what it records, where it goes (job.json, metrics.json, MLflow
env.* tags, the report's Environment table), the determinism settings of ``train.deterministic``,
and that none of it changes a job description."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from medpfl.compose import validate_params
from medpfl.config import TrainConfig, train_job
from medpfl.environment import (CUBLAS_WORKSPACE, NUMERIC_KEYS, capture, configure_determinism, cpu_model,
                                fingerprint_id, mlflow_tags)
from medpfl.fl.engine import fingerprint
from medpfl.tracking import round_significant
from tests.conftest import prepare_train_job

PAPER_SUMMARY = ("avg_global_acc", "avg_global_bwt", "global_consistency", "avg_local_acc", "avg_worst_client_acc",
                 "local_consistency", "balance")


# ----- capture and settings ----------------------------------------------------------------
def test_capture_on_cpu_records_the_fingerprint():
    env = capture(torch.device("cpu"), "fp32", True)
    assert set(NUMERIC_KEYS) <= set(env)
    assert env["cpu_model"] and env["cpu_model"] == cpu_model()
    assert env["torch_threads"] == torch.get_num_threads()
    assert env["torch_version"] == torch.__version__
    assert env["device"] == "cpu" and env["gpu_name"] is None
    assert env["precision"] == "fp32" and env["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert env["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert env["train_deterministic"] is True
    assert env["python"].split()[-1].count(".") == 2 and env["platform"]
    assert json.loads(json.dumps(env)) == env  # JSON-ready
    assert len(env["id"]) == 12 and env["id"] == fingerprint_id(env)


def test_id_covers_the_keys_that_change_numbers_only():
    env = capture(torch.device("cpu"), "fp32", True)
    assert fingerprint_id({**env, "platform": "elsewhere", "cpu_count": 64, "python": "CPython 3.99"}) == env["id"]
    assert fingerprint_id({**env, "torch_threads": env["torch_threads"] + 1}) != env["id"]
    assert fingerprint_id({**env, "cpu_model": "another CPU"}) != env["id"]
    assert fingerprint_id({**env, "precision": "bf16"}) != env["id"]


def test_mlflow_tags_are_prefixed_strings():
    tags = mlflow_tags({"id": "abc", "gpu_name": None, "torch_threads": 2})
    assert tags == {"env.id": "abc", "env.gpu_name": "none", "env.torch_threads": "2"}


@pytest.fixture()
def restore_torch_flags(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def test_determinism_is_applied_on_cuda_only(restore_torch_flags):
    # a CPU job changes nothing, whatever the setting
    configure_determinism(True, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    # deterministic: false on CUDA keeps torch's defaults
    configure_determinism(False, torch.device("cuda"))
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    # the flags are process settings: they can be set (and checked) without a GPU
    torch.backends.cudnn.benchmark = True
    configure_determinism(True, torch.device("cuda"))
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    env = capture(torch.device("cpu"), "fp32", True)
    assert env["deterministic_algorithms"] and env["cudnn_deterministic"] and not env["cudnn_benchmark"]
    assert env["cublas_workspace_config"] == CUBLAS_WORKSPACE


def test_a_user_cublas_setting_is_kept(restore_torch_flags, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    configure_determinism(True, torch.device("cuda"))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


# ----- train.deterministic in the params ---------------------------------------------------
def test_deterministic_default_is_not_dumped():
    """Existing job descriptions (Snakemake params, checkpoint fingerprints) stay as they were."""
    assert TrainConfig().deterministic is True
    assert "deterministic" not in TrainConfig().model_dump()
    assert "deterministic" not in TrainConfig(deterministic=True).model_dump(mode="json")
    assert TrainConfig(deterministic=False).model_dump()["deterministic"] is False
    # a dump validates back to the same config
    for cfg in (TrainConfig(), TrainConfig(deterministic=False)):
        assert TrainConfig.model_validate(cfg.model_dump()) == cfg


def test_deterministic_in_params_and_method_overrides():
    base = {"methods": ["fedavg", "fedavg-fast"],
            "method_params": {"fedavg-fast": {"algorithm": "fedavg", "train": {"deterministic": False}}}}
    p = validate_params(base)
    assert "deterministic" not in train_job(p, "bloodmnist", "dir0.1", "fedavg", 1)["train"]
    assert train_job(p, "bloodmnist", "dir0.1", "fedavg-fast", 1)["train"]["deterministic"] is False
    # the default job description is the one from before the key existed
    old = {**TrainConfig().model_dump()}
    assert train_job(validate_params({}), "bloodmnist", "dir0.1", "fedavg", 1)["train"] == old
    with pytest.raises(Exception, match="deterministic"):
        validate_params({"train": {"deterministic": "maybe"}})


# ----- a training job end to end -----------------------------------------------------------
@pytest.fixture()
def job_dir(tmp_path):
    """Arrays, partition table, MLflow parent and a 2-round job description in tmp_path."""
    job, uri = prepare_train_job(tmp_path, method="fedavg", study="envs",
                                 train={"rounds": 2, "local_epochs": 1, "batch_size": 16, "checkpoint_every": 1})
    return tmp_path, job, uri


def _train(d: Path, job: dict, out: Path):
    from medpfl.train import run_training

    run_training(job, d / "arrays.npz", d / "samples.parquet", d / "partition.parquet", out,
                 parent_file=d / "parent.json")


def test_job_json_mlflow_and_metrics_carry_the_environment(job_dir):
    from mlflow.tracking import MlflowClient

    from medpfl.evaluate import evaluate_run

    d, job, uri = job_dir
    before = fingerprint(job)
    out = d / "run"
    _train(d, job, out)
    assert fingerprint(job) == before  # the job description given is untouched
    written = json.loads((out / "job.json").read_text())
    env = written.pop("environment")
    size = written.pop("model_size")  # and the model's parameter counts (cnn4: every parameter trains)
    assert size["frozen"] == 0 and size["trainable"] == size["total"] > 0
    assert written == json.loads(json.dumps(job))  # job.json = the job description + the environment
    assert env["device"] == "cpu" and env["torch_threads"] == torch.get_num_threads() and len(env["id"]) == 12

    client = MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    tags = run.data.tags
    assert tags["env.id"] == env["id"] and tags["env.cpu_model"] == env["cpu_model"]
    assert tags["env.torch_version"] == torch.__version__ and tags["env.deterministic_algorithms"] == "False"
    # run names and tags group by study, dataset, partition, method and seed
    assert run.info.run_name == "synth/p/fedavg/seed1"  # the evaluate stage names it method first (below)
    assert {k: tags[k] for k in ("study", "dataset", "partition", "method", "seed", "medpfl.role")} == {
        "study": "envs", "dataset": "synth", "partition": "p", "method": "fedavg", "seed": "1",
        "medpfl.role": "training"}
    assert not any(k.startswith("env") for k in run.data.params)  # the environment is no parameter

    evaluate_run(out)
    m = json.loads((out / "metrics.json").read_text())
    assert m["environment"] == env
    # the FedKPer-paper summary metrics are on the child run
    metrics = client.get_run(run_id).data.metrics
    assert client.get_run(run_id).info.run_name == "fedavg s1 synth/p"  # method first: the UI cuts from the right
    assert set(PAPER_SUMMARY) <= set(metrics)
    assert metrics["avg_global_acc"] == round_significant(m["summary"]["avg_global_acc"])  # 4 significant digits


def test_round_scalars_computed_once_per_round_feed_mlflow_and_the_bar(job_dir, monkeypatch):
    """One ``round_scalars`` call per round; MLflow and the progress bar get the same numbers,
    the upload compression ratio among them (FedAvg: exactly 1)."""
    from mlflow.tracking import MlflowClient

    import medpfl.train as train_mod

    d, job, uri = job_dir
    real, calls, shown = train_mod.round_scalars, [], []

    def counted(records, row):
        calls.append(row["round"])
        return real(records, row)

    real_update = train_mod.RoundProgress.update

    def update(self, rnd, scalars, seconds):
        shown.append(dict(scalars))
        return real_update(self, rnd, scalars, seconds)

    monkeypatch.setattr(train_mod, "round_scalars", counted)
    monkeypatch.setattr(train_mod.RoundProgress, "update", update)
    out = d / "run"
    _train(d, job, out)
    assert calls == [0, 1] and len(shown) == 2
    client = MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    history = client.get_metric_history(run_id, "upload_compression_ratio")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 1.0)]
    for step, s in enumerate(shown):
        assert s["upload_compression_ratio"] == 1.0
        acc = [m for m in client.get_metric_history(run_id, "local_acc_mean") if m.step == step]
        assert [m.value for m in acc] == [round_significant(s["local_acc_mean"])]


def test_resuming_in_another_environment_is_recorded(job_dir, monkeypatch):
    from mlflow.tracking import MlflowClient

    import medpfl.train as train_mod

    d, job, uri = job_dir
    out = d / "run"
    real = train_mod.round_scalars

    def boom(records, row):
        if row["round"] == 1:
            raise RuntimeError("injected fault in round 1")
        return real(records, row)

    monkeypatch.setattr(train_mod, "round_scalars", boom)
    with pytest.raises(RuntimeError, match="injected fault"):
        _train(d, job, out)
    assert (out / "checkpoint.pt").exists()
    # pretend the first session ran on another machine
    first = json.loads((out / "job.json").read_text())
    other = {**first["environment"], "cpu_model": "Another CPU", "id": "0123456789ab"}
    (out / "job.json").write_text(json.dumps({**first, "environment": other}))
    monkeypatch.setattr(train_mod, "round_scalars", real)
    _train(d, job, out)
    done = json.loads((out / "job.json").read_text())
    assert done["environment"]["id"] == first["environment"]["id"]
    assert [e["id"] for e in done["earlier_environments"]] == ["0123456789ab"]
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).data.tags["env.earlier_ids"] == "0123456789ab"
    # a fresh run in the same folder (no checkpoint) has one environment again
    _train(d, job, out)
    assert "earlier_environments" not in json.loads((out / "job.json").read_text())


# ----- the report ---------------------------------------------------------------------------
def _write_run(root: Path, method: str, seed: int, env: dict | None) -> Path:
    d = root / "runs" / method / f"seed{seed}"
    d.mkdir(parents=True)
    meta = {"study": "s", "dataset": "bloodmnist", "partition": "dir0.1", "method": method, "algorithm": method,
            "seed": seed, "mlflow_run_id": None, "summary": {"avg_global_acc": 0.5, "rounds": 2}}
    if env is not None:
        meta["environment"] = env
    (d / "metrics.json").write_text(json.dumps(meta))
    pd.DataFrame({"round": [0, 1], "global_test_acc": [0.4, 0.5], "local_bal_acc_mean": [0.3, 0.4]}).to_csv(
        d / "round_metrics.csv", index=False)
    return d


def test_report_lists_distinct_environments_and_their_runs(tmp_path):
    from medpfl.report import build_report

    a = capture(torch.device("cpu"), "fp32", True)
    b = {**a, "torch_threads": a["torch_threads"] + 1}
    b["id"] = fingerprint_id(b)
    runs = [_write_run(tmp_path, "fedavg", 1, a), _write_run(tmp_path, "fedavg", 2, b),
            _write_run(tmp_path, "local", 1, a), _write_run(tmp_path, "local", 2, None)]
    paths = build_report(runs, tmp_path / "report")
    md = paths["table_md"].read_text()
    section = md.split("## Environment", 1)[1].split("## Accuracy per round", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 3  # two fingerprints and the runs that have none
    assert a["id"] in rows[0] and "bloodmnist/dir0.1/fedavg/seed1" in rows[0] and "bloodmnist/dir0.1/local/seed1" in rows[0]
    assert b["id"] in rows[1] and "fedavg/seed2" in rows[1] and f"{b['torch_threads']} of" in rows[1]
    assert rows[2].startswith("| unknown") and "local/seed2" in rows[2]
    html = paths["table_html"].read_text()
    assert "<h2>Environment</h2>" in html and a["id"] in html
    df = pd.read_csv(paths["summary_csv"])
    assert list(df["environment_id"].fillna("")) == [a["id"], b["id"], a["id"], ""]


def test_report_with_one_environment_says_all_runs(tmp_path):
    from medpfl.report.tables import environment_table, load_runs

    a = capture(torch.device("cpu"), "fp32", True)
    runs = load_runs([_write_run(tmp_path, "fedavg", s, a) for s in (1, 2, 3)])
    t = environment_table(runs)
    assert len(t) == 1 and t.loc[0, "Runs"] == "all 3 runs" and t.loc[0, "Fingerprint"] == a["id"]
