"""End to end with the tiny ViT and the FHBench protocol: EPFL and two of its baselines fine-tune
LoRA adapters for two rounds through the whole DAG (download, preprocess, the pairwise Dirichlet
partition of the pooled official splits with per-client 4:3:3 train/test/validation, train,
evaluate, report), beside full fine-tuning of the same model; the report labels both evaluation
protocols and gives the cost table (trainable parameters, MB up and down, peak memory). Every
method trains the tiny ViT for two rounds on both executors in ``tests/test_vit.py``; here a few,
to keep the DAG test short (each job is a process that imports torch and transformers)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from helpers import REPO, copy_repo, job_stats, make_env, snakemake, write_params, write_synthetic
from medpfl.models.zoo import TINY_VIT

pytestmark = pytest.mark.slow

STUDY = "fhbench-ci"
METHODS = ["fedavg", "scaffold", "epfl", "fedavg-full"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    snakefile = copy_repo(tmp_path_factory.mktemp("workflow")) / "Snakefile"
    work = tmp_path_factory.mktemp("fhbench")
    synth = write_synthetic(work / "synth.npz")  # 3-channel 28-px images in the MedMNIST layout
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    base.update({
        "study": STUDY,
        "data": {"datasets": ["synth"], "custom": {"synth": synth}},
        "partitions": {"pairs": {"scheme": "dirichlet_pairs", "num_clients": 4, "alpha": 0.5, "pool": "all",
                                 "data_fraction": 0.8, "seed": 2025,
                                 "local_test": {"rule": "ratios", "ratios": [0.4, 0.3, 0.3]}}},
        "methods": METHODS,
        "method_params": {"fedavg-full": {"algorithm": "fedavg", "train": {"model": "vit", "model_args": TINY_VIT}}},
        "seeds": [1],
        "train": {**base["train"], "rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 16,
                  "executor": "sequential", "device": "cpu", "model": "vit_lora", "model_args": TINY_VIT,
                  "optimizer": {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "schedule": "cosine"}},
        "eval": {"every": 1, "batch_size": 256},
        "report": {"reference": "fedavg"},
        "mlflow": {"experiment": STUDY},
    })
    write_params(work, base)
    env = make_env(work)
    proc = snakemake(work, env=env, snakefile=snakefile)
    return work, proc.stdout


def _run(work, method):
    return work / "results" / STUDY / "runs" / "synth" / "pairs" / method / "seed1"


def test_every_fhbench_method_runs_two_rounds_on_the_tiny_vit(study):
    work, out = study
    n = len(METHODS)
    assert job_stats(out)["train"] == n and job_stats(out)["evaluate"] == n, out[-3000:]
    table = pd.read_parquet(work / "data" / "partitions" / "synth" / "pairs" / "partition.parquet")
    assert set(table["local_split"]) == {"train", "test", "val"}
    for method in METHODS:
        m = json.loads((_run(work, method) / "metrics.json").read_text())
        s = m["summary"]
        assert 0.0 <= s["best_val_client_acc"] <= 1.0 and 0.0 <= s["final_client_acc_mean"] <= 1.0, method
        # pooled official splits: no global test set, said so
        assert s["final_global_acc"] is None, method
        recs = pd.read_parquet(_run(work, method) / "records.parquet")
        assert {"local_after_training", "local_after_training_val"} <= set(recs["view"]), method
        job = json.loads((_run(work, method) / "job.json").read_text())
        size = job["model_size"]
        if method == "fedavg-full":
            assert size["frozen"] == 0
        else:  # the adapters and the head only; the backbone is frozen and shared
            assert size["trainable"] == 2 * 2 * 8 * (32 + 32) + 32 * 4 + 4 and size["frozen"] > size["trainable"]
        rounds = pd.read_parquet(_run(work, method) / "rounds.parquet")
        assert (rounds["peak_memory_bytes"] > 0).all()
    epfl = pd.read_parquet(_run(work, "epfl") / "rounds.parquet")
    # EPFL: up A + B (4 adapters of 8x32 and 32x8), down A only, per client (4 clients, float32)
    assert (epfl["bytes_up"] == 4 * 4 * (4 * 8 * 32 * 2)).all() and (epfl["bytes_down"] == 4 * 4 * 4 * 8 * 32).all()


def test_report_labels_both_protocols_and_gives_the_cost_table(study):
    work, _ = study
    md = (work / "results" / STUDY / "report" / "table.md").read_text()
    assert "Test acc at best-val round (FHBench protocol)" in md and "Final mean client acc (all clients)" in md
    cost = md.split("### Cost: parameters, communication and memory")[1].split("###")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in cost.splitlines() if line.startswith("| ") and not line.startswith("| Strategy")}
    assert rows["fedavg"][1] == "2,180" and rows["fedavg-full"][2] == "0"
    header = next(line for line in cost.splitlines() if line.startswith("| Strategy"))
    head = [c.strip() for c in header.split("|")[2:-1]]
    assert rows["fedavg"][head.index("MB per round vs fedavg")] == "1.000"
    assert float(rows["fedavg-full"][head.index("MB per round vs fedavg")]) > 5
