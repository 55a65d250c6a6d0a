"""End to end on generated Synthetic(alpha, beta) data: every method of the pFedKD-WCL paper's
tables runs two rounds through the whole DAG (download = generate, preprocess, the natural
partition, train, evaluate, report with the paper's Table 2 side by side, MLflow), on a data set
without a global test set, with the models chosen per method variant (``method_params.<v>.train``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from helpers import REPO, copy_repo, job_stats, make_env, mlflow_client, snakemake, study_runs, write_params

pytestmark = pytest.mark.slow

STUDY = "pfedkd-ci"
DATASET = "synthetic_0.5_0.5"
# one variant per method, alternating the two models of the paper
VARIANTS = {"fedavg-mlr": ("fedavg", "mlr", {}), "fedprox-mlp": ("fedprox", "mlp", {"mu": 0.01}),
            "perfedavg-mlr": ("perfedavg", "mlr", {}), "pfedme-mlp": ("pfedme", "mlp", {"lam": 30.0}),
            "fedgkd-mlr": ("fedgkd", "mlr", {}), "pfedkdwcl-mlp": ("pfedkdwcl", "mlp", {})}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    snakefile = copy_repo(tmp_path_factory.mktemp("workflow")) / "Snakefile"
    work = tmp_path_factory.mktemp("pfedkd")
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    # 5 clients of 285 to 1,340 samples (generator seed 4), 60 features, 10 classes
    base.update({
        "study": STUDY,
        "data": {"datasets": [DATASET], "synthetic": {DATASET: {"num_clients": 5, "seed": 4}}},
        "partitions": {"natural": {"scheme": "natural", "num_clients": 5, "alpha": None}},
        "methods": list(VARIANTS),
        "method_params": {v: {"algorithm": a, **kw, "train": {"model": m, **({"model_args": {"hidden": 20}}
                                                                              if m == "mlp" else {})}}
                          for v, (a, m, kw) in VARIANTS.items()},
        "seeds": [1],
        "train": {**base["train"], "rounds": 2, "participation": 0.4, "local_epochs": 1, "batch_size": 20,
                  "executor": "sequential", "device": "cpu",
                  "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "lr_decay": 1.0}},
        "eval": {"every": 1, "batch_size": 256},
        "report": {"paper_table": "config/papers/pfedkd-table2.yaml"},
        "mlflow": {"experiment": STUDY},
    })
    write_params(work, base)
    (work / "config" / "papers").mkdir(parents=True)
    (work / "config" / "papers" / "pfedkd-table2.yaml").write_bytes(
        (REPO / "config" / "papers" / "pfedkd-table2.yaml").read_bytes())
    env = make_env(work)
    proc = snakemake(work, env=env, snakefile=snakefile)
    return work, env, proc.stdout


def _run(work, variant):
    return work / "results" / STUDY / "runs" / DATASET / "natural" / variant / "seed1"


def test_every_method_runs_two_rounds_through_the_dag(study):
    work, _, out = study
    n = len(VARIANTS)
    assert job_stats(out) == {"download": 1, "preprocess": 1, "partition": 1, "partition_figure": 1,
                              "mlflow_init": 1, "train": n, "evaluate": n, "report": 1, "all": 1}, out[-3000:]
    for variant, (algo, model, _) in VARIANTS.items():
        job = json.loads((_run(work, variant) / "job.json").read_text())
        assert job["algorithm"] == algo and job["train"]["model"] == model, variant
        m = json.loads((_run(work, variant) / "metrics.json").read_text())
        s = m["summary"]
        assert s["rounds"] == 2 and 0.0 <= s["final_client_acc_mean"] <= 1.0, variant
        # no global test set: the global-test metrics are null and said to be not applicable
        assert s["avg_global_acc"] is None and s["final_global_acc"] is None, variant
        assert m["global_test"] == "not applicable: the data set has no global test set", variant
        recs = pd.read_parquet(_run(work, variant) / "records.parquet")
        assert "global_test" not in set(recs["view"])
        # the paper's evaluation: every client, every round, with the deployed model
        view = "personalized_on_local" if algo in ("perfedavg", "pfedme", "pfedkdwcl") else "global_on_local"
        v = recs[recs["view"] == view]
        assert sorted(v.groupby("round")["client_id"].nunique().tolist()) == [5, 5], variant


def test_report_and_mlflow_show_not_applicable_global_columns(study):
    work, _, _ = study
    report = work / "results" / STUDY / "report"
    md = (report / "table.md").read_text()
    assert "Side by side with the paper: pFedKD-WCL paper, Table 2" in md
    comp = pd.read_csv(report / "paper_comparison.csv")
    assert set(comp["method"]) == set(VARIANTS) and set(comp["block"]) == {"MLR", "MLP"}
    assert comp["ours"].notna().all() and comp["paper"].notna().all()
    js = json.loads((report / "summary.json").read_text())
    for variant in VARIANTS:
        assert js[DATASET]["natural"][variant]["avg_global_acc"] is None  # null, not 0 and not an error
    _, children = study_runs(mlflow_client(work), STUDY)
    assert len(children) == len(VARIANTS)
    for run in children:
        assert run.data.tags["global_test"] == "not applicable: the data set has no global test set"
        assert "final_client_acc_mean" in run.data.metrics and "avg_global_acc" not in run.data.metrics
