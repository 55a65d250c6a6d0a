"""The MLflow UI opens a study as model training: the experiment type tag, the links of
``medpfl ui`` and the study's child runs, on a throw-away SQLite store."""

from __future__ import annotations

import json
import math
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from medpfl.cli import main
from medpfl.report.stats import t_interval
from medpfl.tracking import (EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, EXPERIMENT_NOTE, HEADLINE_METRICS, NOTE_TAG, SHARED_VIEW_TAG, RunLogger,
                             init_study, log_study, round_significant, share_key, study_children, study_view_state,
                             ui_urls)


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


@pytest.fixture()
def store(tmp_path):
    return f"sqlite:///{tmp_path}/mlruns.db", tmp_path


def test_new_experiment_is_a_model_training_experiment(store):
    uri, tmp = store
    rec = init_study("s1", "exp-a", tmp / "results" / "s1" / "mlflow_parent.json", uri=uri, artifact_root=tmp / "art")
    exp = _client(uri).get_experiment(rec["experiment_id"])
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert "medpfl ui" in exp.tags[NOTE_TAG] and "grouped by method" in exp.tags[NOTE_TAG]


def test_existing_experiment_gets_the_tag_and_a_user_choice_is_kept(store):
    uri, tmp = store
    c = _client(uri)
    old = c.create_experiment("old", artifact_location=(tmp / "art" / "old").as_uri())
    init_study("s", "old", tmp / "p1.json", uri=uri)
    assert c.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    mine = c.create_experiment("mine", artifact_location=(tmp / "art" / "mine").as_uri(),
                               tags={EXPERIMENT_KIND_TAG: "finetuning", NOTE_TAG: "my notes"})
    init_study("s", "mine", tmp / "p2.json", uri=uri)
    tags = c.get_experiment(mine).tags
    assert tags[EXPERIMENT_KIND_TAG] == "finetuning" and tags[NOTE_TAG] == "my notes"
    # a note an older medpfl wrote is replaced by the current one
    older = c.create_experiment("older", artifact_location=(tmp / "art" / "older").as_uri(),
                                tags={NOTE_TAG: "medpfl federated-learning benchmark. One parent run per study ..."})
    init_study("s", "older", tmp / "p3.json", uri=uri)
    assert c.get_experiment(older).tags[NOTE_TAG] == EXPERIMENT_NOTE


def _children(uri, tmp, parent_file):
    """Two datasets x two methods x two seeds, created out of order."""
    ids = {}
    for method, seed, ds in [("local", 2, "b"), ("fedavg", 1, "a"), ("local", 1, "a"), ("fedavg", 2, "b"),
                             ("fedavg", 2, "a"), ("local", 2, "a"), ("fedavg", 1, "b"), ("local", 1, "b")]:
        tags = {"study": "s1", "dataset": ds, "partition": "p", "method": method, "seed": str(seed),
                "medpfl.role": "training"}
        lg = RunLogger(parent_file, tmp / f"run-{ds}-{method}-{seed}.json", f"{ds}/p/{method}/seed{seed}", tags)
        lg.finish()
        ids[(ds, method, seed)] = lg.run_id
    return ids


def test_study_children_are_ordered_by_dataset_partition_method_seed(store):
    uri, tmp = store
    pf = tmp / "results" / "s1" / "mlflow_parent.json"
    rec = init_study("s1", "exp-a", pf, uri=uri, artifact_root=tmp / "art")
    ids = _children(uri, tmp, pf)
    init_study("s2", "exp-a", tmp / "other.json", uri=uri)  # another study's parent in the same experiment
    runs = study_children(rec)
    assert [r.info.run_id for r in runs] == [ids[k] for k in sorted(ids)]
    assert [r.info.run_name for r in runs][:3] == ["a/p/fedavg/seed1", "a/p/fedavg/seed2", "a/p/local/seed1"]


def test_ui_urls_open_the_study_view_of_the_machine_learning_page():
    parent = {"experiment_id": "7", "study": "pfedkd-mnist", "parent_run_id": "x", "tracking_uri": "sqlite:///x"}
    urls = ui_urls(parent, "http://127.0.0.1:5000/", ["r1", "r2"])
    exp = urlsplit(urls["experiment"])
    assert exp.scheme == "http" and exp.netloc == "127.0.0.1:5000"
    route, _, query = exp.fragment.partition("?")
    assert route == "/experiments/7/runs"
    q = parse_qs(query)
    assert q["workflowType"] == ["machine_learning"] and q["compareRunsMode"] == ["CHART"]
    assert q["viewStateShareKey"] == ["medpfl-pfedkd-mnist-charts"]
    # the UI drops a shared view when the link also carries a search facet
    assert not {"searchFilter", "orderByKey", "orderByAsc", "startTime", "lifecycleFilter"} & set(q)
    q = parse_qs(urlsplit(urls["table"]).fragment.partition("?")[2])
    assert q["viewStateShareKey"] == ["medpfl-pfedkd-mnist-table"] and q["compareRunsMode"] == ["TABLE"]
    q = parse_qs(urlsplit(urls["runs"]).fragment.partition("?")[2])
    assert q["searchFilter"] == ["tags.study = 'pfedkd-mnist' and tags.`medpfl.role` = 'training'"]
    route, _, query = urlsplit(urls["compare"]).fragment.partition("?")
    assert route == "/compare-runs"
    q = parse_qs(query)
    assert json.loads(q["runs"][0]) == ["r1", "r2"] and json.loads(q["experiments"][0]) == ["7"]
    assert "compare" not in ui_urls(parent, "http://h:1")


def test_study_view_groups_the_study_runs_by_method_headline_charts_first():
    charts = study_view_state("my study!", "charts")
    assert charts["searchFilter"] == "tags.study = 'my study!' and tags.`medpfl.role` = 'training'"
    assert charts["groupBy"] == {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "method"}]}
    assert charts["runsHiddenMode"] == "SHOW_ALL" and charts["isAccordionReordered"] is True
    sections = [s["uuid"] for s in charts["compareRunSections"]]
    assert sections == ["medpfl-headline", "medpfl-curves", "medpfl-other"]
    bars = [c["metricKey"] for c in charts["compareRunCharts"] if c["type"] == "BAR"]
    assert bars == [k for k, _ in HEADLINE_METRICS] and bars[0] == "avg_global_acc"
    assert not any(k.endswith("_std_rounds") for k in bars)  # the paper's std-over-rounds columns stay below
    assert {c["metricSectionId"] for c in charts["compareRunCharts"] if c["type"] == "LINE"} == {"medpfl-curves"}
    assert len({c["uuid"] for c in charts["compareRunCharts"]}) == len(charts["compareRunCharts"])
    table = study_view_state("s", "table")
    assert table["groupBy"] == charts["groupBy"] and "compareRunCharts" not in table
    assert table["selectedColumns"][3:] == [f"metrics.`{k}`" for k, _ in HEADLINE_METRICS]
    assert share_key("my study!", "charts") == "medpfl-my-study-charts"
    with pytest.raises(ValueError, match="layout"):
        study_view_state("s", "grid")


def test_the_study_views_are_published_as_shared_views_of_the_experiment(store):
    uri, tmp = store
    rec = init_study("s1", "exp-a", tmp / "p.json", uri=uri, artifact_root=tmp / "art")
    tags = _client(uri).get_experiment(rec["experiment_id"]).tags
    for layout in ("charts", "table"):
        assert json.loads(tags[SHARED_VIEW_TAG + share_key("s1", layout)]) == study_view_state("s1", layout)


def test_logged_metrics_are_rounded_to_four_significant_digits_counts_kept(store):
    assert round_significant(0.123456) == 0.1235 and round_significant(-1234.56) == -1235.0
    assert round_significant(9.87654e-7) == 9.877e-7 and round_significant(0.0) == 0.0
    assert math.isnan(round_significant(float("nan"))) and round_significant(float("inf")) == float("inf")
    uri, tmp = store
    pf = tmp / "p.json"
    init_study("s1", "exp", pf, uri=uri, artifact_root=tmp / "art")
    lg = RunLogger(pf, tmp / "run.json", "r", {"method": "fedavg"})
    lg.log_metrics({"acc": 0.87654321, "bytes_up": 123456789.0, "bad": float("nan")}, step=3)
    m = _client(uri).get_run(lg.run_id).data.metrics
    assert m == {"acc": 0.8765, "bytes_up": 123456789.0}


def test_the_report_stage_makes_the_parent_carry_the_study(store):
    uri, tmp = store
    pf = tmp / "results" / "s1" / "mlflow_parent.json"
    rec = init_study("s1", "exp-a", pf, uri=uri, artifact_root=tmp / "art")
    ids = _children(uri, tmp, pf)
    c = _client(uri)
    values = {("a", "fedavg", 1): 0.5, ("a", "fedavg", 2): 0.7, ("a", "local", 1): 0.25}
    for key, v in values.items():
        c.log_metric(ids[key], "avg_local_acc", v)
    before = c.get_run(rec["parent_run_id"]).info.end_time
    log_study(pf, {"seeds": [1, 2]}, [])
    runs = {r.info.run_id: r for r in study_children(rec)}
    for (ds, method, seed), rid in ids.items():  # method first: the UI cuts names from the right
        assert runs[rid].info.run_name == f"{method} s{seed} {ds}/p"
    parent = c.get_run(rec["parent_run_id"])
    assert parent.info.end_time >= before and parent.info.status == "FINISHED"
    note = parent.data.tags[NOTE_TAG]
    iv = t_interval([0.5, 0.7])  # fedavg on a: mean 0.6 and its 95 % t interval over the two seeds
    assert f"| fedavg | 2 | {iv.mean:.4g} ± {iv.half_width:.2g} |" in note
    assert "| local | 2 | 0.25 (n = 1) |" in note  # one of its two seeds has the metric
    assert "### a / p" in note and "### b / p" in note and "Avg Local Acc" in note
    assert parent.data.params["seeds"] == "[1, 2]"


def test_medpfl_ui_prints_the_command_and_the_links(store, capsys):
    uri, tmp = store
    pf = tmp / "results" / "s1" / "mlflow_parent.json"
    rec = init_study("s1", "exp-a", pf, uri=uri, artifact_root=tmp / "art")
    ids = _children(uri, tmp, pf)
    assert main(["ui", "--study", "s1", "--results", str(tmp / "results"), "--port", "5123", "--no-serve"]) == 0
    out = capsys.readouterr().out
    assert f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5123" in out
    assert (f"methods:  http://127.0.0.1:5123/#/experiments/{rec['experiment_id']}/runs?viewStateShareKey=medpfl-s1-charts"
            in out)
    assert "8 training runs" in out
    compare = next(line for line in out.splitlines() if line.startswith("compare:"))
    assert set(json.loads(unquote(compare.split("runs=")[1].split("&")[0]))) == set(ids.values())


def test_medpfl_ui_without_the_study_says_what_to_run(tmp_path, capsys):
    assert main(["ui", "--study", "nope", "--results", str(tmp_path), "--no-serve"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "mlflow_parent.json" in err and "snakemake" in err


def test_ui_is_documented():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "medpfl ui" in readme


def test_a_job_training_again_after_finishing_is_a_new_run_an_interrupted_one_continues(store):
    uri, tmp = store
    parent = tmp / "parent.json"
    init_study("s1", "exp", parent, uri=uri, artifact_root=tmp / "art")
    run_file = tmp / "run" / "mlflow_run.json"
    first = RunLogger(parent, run_file, "d/p/fedavg/seed1", {"method": "fedavg"})
    first.log_params({"train": {"lr": 0.1}})
    assert not first.resumed
    first.finish("KILLED")  # Ctrl-C: the checkpointed job goes on in the same run
    resumed = RunLogger(parent, run_file, "d/p/fedavg/seed1", {"method": "fedavg"})
    assert resumed.resumed and resumed.run_id == first.run_id
    assert _client(uri).get_run(first.run_id).info.status == "RUNNING"
    resumed.finish()
    again = RunLogger(parent, run_file, "d/p/fedavg/seed1", {"method": "fedavg"})  # e.g. the lr was edited
    again.log_params({"train": {"lr": 0.05}})
    assert not again.resumed and again.run_id != first.run_id
    assert json.loads(run_file.read_text())["run_id"] == again.run_id
    c = _client(uri)
    assert c.get_run(again.run_id).data.params["train.lr"] == "0.05"
    assert c.get_run(first.run_id).data.params["train.lr"] == "0.1"


def test_runs_not_behind_the_report_are_superseded_and_left_out(store):
    """A job trained again after a params edit (or a failed attempt) leaves an older child run:
    the report stage marks it superseded, the views' filter and the summary leave it out, and
    a run named current again is a training run again."""
    uri, tmp = store
    pf = tmp / "results" / "s1" / "mlflow_parent.json"
    rec = init_study("s1", "exp-a", pf, uri=uri, artifact_root=tmp / "art")
    ids = _children(uri, tmp, pf)
    old = ids[("a", "fedavg", 1)]
    current = [rid for k, rid in ids.items() if k != ("a", "fedavg", 1)]
    log_study(pf, {}, [], current_runs=current)
    c = _client(uri)
    assert c.get_run(old).data.tags["medpfl.role"] == "superseded"
    shown = c.search_runs([rec["experiment_id"]], study_view_state("s1")["searchFilter"])
    assert sorted(r.info.run_id for r in shown) == sorted(current)
    note = c.get_run(rec["parent_run_id"]).data.tags[NOTE_TAG]
    assert "7 training runs" in note and "| fedavg | 1 |" in note  # on a/p only seed 2 is current
    log_study(pf, {}, [], current_runs=list(ids.values()))
    assert c.get_run(old).data.tags["medpfl.role"] == "training"
