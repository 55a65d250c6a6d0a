"""End to end: Snakemake runs the whole DAG on a tiny synthetic study in a temporary folder.

One module-scoped run (2 methods x 2 seeds, 4 clients, 2 rounds) is shared by the tests below,
which run in file order: the report/MLflow checks, a no-op second invocation, the HTML report,
the lint, and last the test that edits ``params.yaml`` (adds a method).
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from helpers import (TINY_TRAIN, copy_repo, job_stats, mlflow_client, make_env,
                     planned_jobs, read_params, snakemake, snapshot, study_runs, tiny_params, write_params,
                     write_synthetic)
from medpfl.tracking import round_significant

pytestmark = pytest.mark.slow

STUDY = "ci"
METHODS = ("fedavg", "local")
SEEDS = (1,)
FL_METHODS = {"fedavg", "fedkper"}  # methods with a global model
ROUNDS = TINY_TRAIN["rounds"]
REPORT_FILES = ("table.md", "table.html", "curves.png", "summary.csv", "summary.json")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A finished default-target run: ``(workdir, env, snakemake output)``, with a snapshot of the
    repository's workflow (so that concurrent edits of the package cannot change code hashes)."""
    snakefile = copy_repo(tmp_path_factory.mktemp("workflow")) / "Snakefile"
    work = tmp_path_factory.mktemp("pipeline")
    synth = write_synthetic(work / "synth.npz")
    write_params(work, tiny_params(synth, study=STUDY, methods=METHODS, seeds=SEEDS))
    env = make_env(work)
    proc = snakemake(work, env=env, snakefile=snakefile)  # no target: rule all (default_target)
    return work, env, proc.stdout, snakefile


def _run_dir(work, method, seed):
    return work / "results" / STUDY / "runs" / "synth" / "d" / method / f"seed{seed}"


def _outputs(work):
    return snapshot(work, "data/**/*") | snapshot(work, "results/**/*")


def test_full_dag_outputs_and_mlflow(study):
    work, env, out, sf = study
    stats = job_stats(out)
    n = len(METHODS) * len(SEEDS)
    assert stats == {"download": 1, "preprocess": 1, "partition": 1, "partition_figure": 1, "mlflow_init": 1,
                     "train": n, "evaluate": n, "report": 1, "all": 1}, out[-3000:]

    # report and partition figure
    report = work / "results" / STUDY / "report"
    for f in REPORT_FILES:
        assert (report / f).is_file() and (report / f).stat().st_size > 0, f
    assert (report / "curves.png").read_bytes().startswith(PNG)
    # the partition figure is drawn by its own rule, outside the DVC-versioned data/partitions
    heatmap = work / "data" / "figures" / "synth" / "d" / "heatmap.png"
    assert heatmap.read_bytes().startswith(PNG)
    assert not (work / "data" / "partitions" / "synth" / "d" / "heatmap.png").exists()
    table = (report / "table.md").read_text()
    assert all(m in table for m in METHODS)
    summary = json.loads((report / "summary.json").read_text())
    assert set(summary["synth"]["d"]) == set(METHODS)

    # MLflow: one study parent, one FINISHED child per (method, seed) under it
    client = mlflow_client(work)
    parents, children = study_runs(client)
    assert len(parents) == 1, [p.info.run_name for p in parents]
    parent = parents[0]
    assert parent.data.tags["study"] == STUDY and parent.info.status == "FINISHED"
    assert json.loads((work / "results" / STUDY / "mlflow_parent.json").read_text())["parent_run_id"] == \
        parent.info.run_id
    assert sorted((c.data.tags["method"], int(c.data.tags["seed"])) for c in children) == \
        sorted((m, s) for m in METHODS for s in SEEDS)
    steps = list(range(ROUNDS))
    for child in children:
        rid = child.info.run_id
        method, seed = child.data.tags["method"], int(child.data.tags["seed"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED", (method, seed, child.info.status)
        run_dir = _run_dir(work, method, seed)
        assert json.loads((run_dir / "mlflow_run.json").read_text())["run_id"] == rid
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["mlflow_run_id"] == rid

        assert [m.step for m in client.get_metric_history(rid, "local_bal_acc_mean")] == steps, (method, seed)
        history = client.get_metric_history(rid, "global_test_acc")
        if method in FL_METHODS:
            assert [m.step for m in history] == steps, (method, seed)
            assert all(0.0 <= m.value <= 1.0 for m in history)
            assert child.data.metrics["avg_global_acc"] == round_significant(metrics["summary"]["avg_global_acc"])
        else:
            assert history == [], f"{method} has no global model but logged global_test_acc"
        for key in ("avg_local_acc", "avg_worst_client_acc", "rounds"):
            assert child.data.metrics[key] == round_significant(metrics["summary"][key]), (method, key)
        assert child.data.metrics["rounds"] == ROUNDS
        assert child.data.params["train.rounds"] == str(ROUNDS)

        top = {a.path for a in client.list_artifacts(rid)}
        assert {"model", "evaluation"} <= top
        assert "model/final_model.pt" in {a.path for a in client.list_artifacts(rid, "model")}
        evaluation = {a.path for a in client.list_artifacts(rid, "evaluation")}
        assert {"evaluation/metrics.json", "evaluation/round_metrics.csv"} <= evaluation
        per_round = pd.read_csv(run_dir / "round_metrics.csv")
        assert per_round["round"].tolist() == steps


def test_second_invocation_does_nothing(study):
    work, env, _, sf = study
    before = _outputs(work)
    runs_before = len(study_runs(mlflow_client(work))[1])
    proc = snakemake(work, env=env, snakefile=sf)
    assert "Nothing to be done" in proc.stdout, proc.stdout[-3000:]
    assert _outputs(work) == before
    assert len(study_runs(mlflow_client(work))[1]) == runs_before


def test_html_report(study, tmp_path):
    work, env, _, sf = study
    html = tmp_path / "report.html"
    snakemake(work, "--report", str(html), env=env, snakefile=sf)
    text = html.read_text(errors="replace")
    assert html.stat().st_size > 10_000 and "<html" in text.lower()
    for name in ("table.md", "curves.png", "heatmap.png"):
        assert name in text, f"{name} is not in the Snakemake report"
    # results first: the "Results" category sorts before "Study setup" (the menu's order), every
    # file in a subcategory, and the landing text points there
    cats = json.loads(re.search(r"var categories = (\{.*?\});", text).group(1))
    assert sorted(cats) == ["Results", "Study setup"]
    assert {k: sorted(v) for k, v in cats.items()} == {"Results": ["Figures", "Tables"], "Study setup": ["Partitions"]}
    assert "Results first:" in text


def test_lint(study):
    work, env, _, sf = study
    proc = snakemake(work, "--lint", env=env, check=False, snakefile=sf)
    assert proc.returncode == 0, f"snakemake --lint exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    assert "Congratulations" in proc.stdout


def test_editing_one_method_reruns_only_its_runs(study):
    """The train stage hashes the engine, the models and each method's own modules: a new
    method module re-runs nothing, an edit to ``local.py`` re-runs only Local (dry run; the
    copy's sources are restored afterwards)."""
    work, env, _, sf = study
    algos = sf.parent / "src" / "medpfl" / "algorithms"
    new_mod = algos / "zz_new_method.py"
    local = algos / "local.py"
    before = local.read_text()
    try:
        new_mod.write_text('"""A method module added later."""\n')
        dry = snakemake(work, "--dry-run", env=env, snakefile=sf).stdout
        assert "train" not in job_stats(dry), dry[-3000:]
        local.write_text(before + "\n# an edit\n")
        dry = snakemake(work, "--dry-run", env=env, snakefile=sf).stdout
        assert sorted(w.get("method") for r, w in planned_jobs(dry) if r == "train") == ["local"] * len(SEEDS)
    finally:
        new_mod.unlink(missing_ok=True)
        local.write_text(before)


def test_adding_a_method_trains_only_that_method(study):
    """Edits params.yaml: keep this test last in the module."""
    work, env, _, sf = study
    params = read_params(work)
    params["methods"] = [*METHODS, "fedkper"]
    write_params(work, params)

    dry = snakemake(work, "--dry-run", env=env, snakefile=sf).stdout
    n = len(SEEDS)
    assert job_stats(dry) == {"train": n, "evaluate": n, "report": 1, "all": 1}, dry[-3000:]
    assert sorted((r, w.get("method")) for r, w in planned_jobs(dry) if r in ("train", "evaluate")) == \
        sorted([("evaluate", "fedkper")] * n + [("train", "fedkper")] * n)

    old = snapshot(work / "results" / STUDY / "runs") | snapshot(work, "data/**/*")
    proc = snakemake(work, env=env, snakefile=sf)
    assert job_stats(proc.stdout) == job_stats(dry)
    now = snapshot(work / "results" / STUDY / "runs") | snapshot(work, "data/**/*")
    assert {k: now[k] for k in old} == old, "existing runs or data were rewritten"
    for seed in SEEDS:
        assert (_run_dir(work, "fedkper", seed) / "metrics.json").is_file()
    summary = json.loads((work / "results" / STUDY / "report" / "summary.json").read_text())
    assert set(summary["synth"]["d"]) == {*METHODS, "fedkper"}

    parents, children = study_runs(mlflow_client(work))
    assert len(parents) == 1, "adding a method created a second study parent run"
    assert len(children) == (len(METHODS) + 1) * n
    new = [c for c in children if c.data.tags["method"] == "fedkper"]
    assert len(new) == n
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id and c.info.status == "FINISHED"
               for c in new)
