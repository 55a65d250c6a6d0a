"""MLflow tracking: one parent run per study, one child run per training job.

Tracking URI: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<project>/mlruns.db`` (the MLflow 3
file store is deprecated and raises since 3.13). With a SQLite (or other database) store,
artifacts go to ``<project>/mlartifacts/`` for experiments created here; with a tracking server
(``http://host:port``, e.g. ``medpfl tracking-server``: :mod:`medpfl.tracking_server`) the server
chooses their location (``mlflow-artifacts:/`` when it serves artifacts) and every upload goes
through it, so jobs on other nodes need no shared artifact folder. The ``mlflow-init`` stage creates the store, the experiment and
the parent run once, before parallel training jobs start (a fresh SQLite store migrated by
several processes at once crashes; ``docs/pipeline.md``), and writes ``parent.json``; every
child reads the URI and ids from that file, so all jobs of a study land in the same store.

The experiment is tagged as a model-training experiment (``mlflow.experimentKind =
custom_model_development``), so the MLflow UI treats it as runs to compare rather than as a
GenAI project; :func:`ui_urls` gives the links that open a study's runs in the UI's
machine-learning view (``medpfl ui``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from medpfl.errors import TrackingError  # noqa: F401  (defined in medpfl.errors; importable here as before)
from medpfl.io import read_json, write_json

log = logging.getLogger(__name__)
os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")

#: The experiment tag the MLflow 3 UI reads for an experiment's type (the server's JS bundle:
#: ``mlflow.experimentKind``, values ``genai_development``, ``custom_model_development``, ...).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: The experiment's description in the UI.
NOTE_TAG = "mlflow.note.content"
EXPERIMENT_NOTE = (
    "medpfl federated-learning benchmark. Open a study with `medpfl ui`: its first link shows the methods compared "
    "(runs grouped by method, the mean over seeds; one click on a group shows its seeds). One parent run per study "
    "(tag medpfl.role=study; its description is the study's summary table, its artifacts the report) and one child "
    "run per training job, named 'method sSEED dataset/partition' and tagged study, dataset, partition, method, "
    "algorithm, seed. Child runs hold the per-round curves (step = round), the FedKPer-paper summary metrics "
    "(avg_global_acc, avg_global_bwt, global_consistency, avg_local_acc, avg_worst_client_acc, local_consistency, "
    "balance, ...) and the environment fingerprint (env.* tags); values are rounded to 4 significant digits (the "
    "full values are in each run's metrics.json)."
)


def retry(fn, *args, attempts: int = 8, base_delay: float = 0.2, **kwargs):
    """Call ``fn`` and retry on errors with exponential back-off and jitter: several training
    jobs writing to one SQLite store can meet "database is locked"."""
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException, sqlalchemy OperationalError, connection errors
            if i == attempts - 1:
                raise TrackingError(f"MLflow call {getattr(fn, '__name__', fn)} failed {attempts} times: {e}") from e
            delay = base_delay * 2**i * (0.5 + random.random())
            log.warning("MLflow call failed (%s); retrying in %.1fs", e, delay)
            time.sleep(delay)


def default_tracking_uri(root: Path | None = None) -> str:
    """The store new studies are tracked in: ``$MLFLOW_TRACKING_URI`` when set (a tracking server,
    ``http://host:port``, or a database URI), else ``sqlite:///<root or cwd>/mlruns.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(root or Path.cwd()).resolve() / 'mlruns.db'}"


def is_server_uri(uri: str) -> bool:
    """Whether ``uri`` names an MLflow tracking server (``http://`` or ``https://``) rather than a
    store the client opens itself (``sqlite:///``, ``postgresql://``, ...)."""
    return uri.startswith(("http://", "https://"))


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def check_reachable(uri: str, timeout: float = 10.0) -> None:
    """Fail fast with a clear message if the tracking server or store does not answer: a server's
    ``/health`` within ``timeout`` seconds (MLflow's own client retries a dead server for minutes),
    a SQLite file's folder. Raises :class:`TrackingError` naming the URI."""
    if is_server_uri(uri):
        import urllib.error
        import urllib.request

        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                if r.status != 200:
                    raise TrackingError(f"MLflow server {uri} answered {r.status} on /health")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable ({e}); start it "
                                "(`medpfl tracking-server start --dir ...`, or `mlflow server ...`) or set "
                                "MLFLOW_TRACKING_URI to a reachable store") from None
    elif uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.parent.exists():
            raise TrackingError(f"MLflow store {uri}: folder {path.parent} does not exist")
    elif uri.startswith("file:") or "://" not in uri:
        raise TrackingError(f"MLflow tracking URI {uri!r}: the file store is deprecated in MLflow 3; "
                            "use sqlite:///path/to/mlruns.db or a server URL")


def git_commit(cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def refresh_experiment_tags(client, exp) -> None:
    """An experiment made before (by an older medpfl, or by hand): add the type tag and the note
    where missing, replace a note an older medpfl wrote (it starts as :data:`EXPERIMENT_NOTE`
    does), and keep whatever a user set."""
    if EXPERIMENT_KIND_TAG not in exp.tags:
        retry(client.set_experiment_tag, exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    note = exp.tags.get(NOTE_TAG)
    if note is None or (note != EXPERIMENT_NOTE and note.startswith(EXPERIMENT_NOTE.split(".")[0] + ".")):
        retry(client.set_experiment_tag, exp.experiment_id, NOTE_TAG, EXPERIMENT_NOTE)


def init_study(study: str, experiment: str, out: Path, uri: str | None = None,
               artifact_root: Path | None = None) -> dict:
    """Create (or reuse) the store, the experiment and a parent run for ``study``; write ``out``.

    The parent depends only on the study and experiment names (so editing a parameter or
    adding a method keeps it); the report stage logs the current params and tables to it.
    A new experiment's artifacts go to ``artifact_root/<experiment>`` (default
    ``<cwd>/mlartifacts``) in a store the client opens itself; on a tracking server
    (:func:`is_server_uri`) the server places them unless ``artifact_root`` is given (a local
    folder there would be written by each job on its own node). Returns the parent record
    ``{"tracking_uri", "experiment_id", "parent_run_id", "study", "experiment", "mlflow_version"}``.
    Raises :class:`TrackingError` when the store does not answer.
    """
    import mlflow

    uri = uri or default_tracking_uri()
    check_reachable(uri)
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        location = {}
        if artifact_root is not None or not is_server_uri(uri):
            root = (artifact_root or Path.cwd() / "mlartifacts").resolve()
            location = {"artifact_location": (root / experiment).as_uri()}
        try:
            exp_id = client.create_experiment(experiment, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
                                                                NOTE_TAG: EXPERIMENT_NOTE}, **location)
        except Exception:  # another study's mlflow-init created it a moment ago (a shared server)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                raise
    if exp is not None:
        exp_id = exp.experiment_id
        refresh_experiment_tags(client, exp)
        if is_server_uri(uri) and artifact_root is None and _local_location(exp.artifact_location):
            log.warning("MLflow experiment %s on the server %s keeps its artifacts in the local folder %s (it was "
                        "created without the server's artifact proxy): jobs on other nodes write there on their "
                        "own disk; use a new experiment name (mlflow.experiment) to get server-side artifacts",
                        experiment, uri, exp.artifact_location)
    tags = {"study": study, "git_commit": git_commit(), "medpfl.role": "study"}
    run = client.create_run(exp_id, run_name=study, tags=tags)
    client.set_terminated(run.info.run_id, "FINISHED")
    record = {"tracking_uri": uri, "experiment_id": exp_id, "parent_run_id": run.info.run_id, "study": study,
              "experiment": experiment, "mlflow_version": mlflow.__version__}
    publish_study_views(record)
    write_json(out, record)
    return record


def _local_location(location: str | None) -> bool:
    """Whether an experiment's artifact location is a path on the client's file system."""
    return bool(location) and (location.startswith("file:") or "://" not in location and ":/" not in location)


#: ``medpfl.role`` of a training run that is not behind the study's current report (a job's run
#: before a params or code edit trained it again, a failed attempt, a method removed from the
#: study): the study views' filter (``medpfl.role = 'training'``) leaves it out; nothing is deleted.
SUPERSEDED = "superseded"


def log_study(parent_file: Path, params: dict[str, Any], artifacts: list[Path],
              current_runs: list[str] | None = None) -> None:
    """Log the study's resolved params (as ``config/params.json``; MLflow params are immutable,
    so they are logged only once, as they were at the first report) and the report files to the
    parent run; make the parent carry the study: its description (``mlflow.note.content``) is
    the per-method summary (:func:`study_summary_markdown`) with the links' use, and its end time
    is the report's (so its duration spans the study); the children get method-first names
    (:func:`run_name`; runs trained by an older medpfl or restored from an archive included) and
    the study's shared views are (re)published (:func:`publish_study_views`).

    ``current_runs``: the MLflow run ids behind the report (each run folder's ``metrics.json``);
    a training child not among them gets ``medpfl.role = superseded`` (:data:`SUPERSEDED`), so
    the views and the summary count each job once; a superseded run named again becomes a
    training run again. None: every child counts."""
    parent = read_json(parent_file)
    check_reachable(parent["tracking_uri"])
    client = _client(parent["tracking_uri"])
    run_id = parent["parent_run_id"]
    if params:
        retry(client.log_dict, run_id, params, "config/params.json")
        from mlflow.entities import Param

        existing = client.get_run(run_id).data.params
        new = [Param(k, str(v)[:6000]) for k, v in flatten(params).items() if k not in existing]
        for i in range(0, len(new), 100):
            retry(client.log_batch, run_id, params=new[i:i + 100])
    for path in artifacts:
        retry(client.log_artifact, run_id, str(path), "report")
    children = study_children(parent)
    if current_runs is not None:
        from mlflow.entities import RunTag

        keep = set(current_runs)
        for r in children:
            role = r.data.tags.get("medpfl.role")
            want = "training" if r.info.run_id in keep else SUPERSEDED
            if role in ("training", SUPERSEDED) and role != want:
                retry(client.log_batch, r.info.run_id, tags=[RunTag("medpfl.role", want)])
        children = [r for r in children if r.info.run_id in keep]
    for r in children:
        t = r.data.tags
        if all(k in t for k in ("method", "seed", "dataset", "partition")):
            name = run_name(t["method"], t["seed"], t["dataset"], t["partition"])
            if r.info.run_name != name:
                retry(client.update_run, r.info.run_id, name=name)
    publish_study_views(parent)
    refresh_experiment_tags(client, client.get_experiment(parent["experiment_id"]))
    from mlflow.entities import RunTag

    retry(client.log_batch, run_id, tags=[RunTag(NOTE_TAG, study_summary_markdown(parent["study"], children))])
    retry(client.set_terminated, run_id, "FINISHED", int(time.time() * 1000))


def study_summary_markdown(study: str, children: list) -> str:
    """The study's parent-run description: per (data set, partition) a markdown table of the
    headline metrics (:data:`HEADLINE_METRICS` that some run has), a row per method with the
    mean over seeds ± the half-width of the 95 % t interval (``medpfl.report.stats.t_interval``;
    "n = 1" where one seed), from the children's logged summary metrics."""
    from medpfl.report.stats import t_interval

    by: dict[tuple[str, str], dict[str, list]] = {}
    for r in children:
        t = r.data.tags
        by.setdefault((t.get("dataset", "?"), t.get("partition", "?")), {}).setdefault(t.get("method", "?"), []).append(r)
    lines = [f"**medpfl study `{study}`**: {len(children)} training runs. Each cell: mean over seeds ± half-width "
             "of the 95 % t interval (sources of variance: see the report's caption). The study's report is in this "
             "run's artifacts (`report/`); the per-seed runs are its child runs.", ""]
    for (ds, part), methods in sorted(by.items()):
        keys = [(k, title) for k, title in HEADLINE_METRICS
                if any(k in r.data.metrics for runs in methods.values() for r in runs)]
        lines += [f"### {ds} / {part}", "",
                  "| method | seeds | " + " | ".join(title for _, title in keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
        for method, runs in sorted(methods.items()):
            cells = []
            for k, _ in keys:
                iv = t_interval([r.data.metrics.get(k) for r in runs])
                if iv is None:
                    cells.append("—")
                elif iv.half_width is None:
                    cells.append(f"{iv.mean:.4g} (n = 1)")
                else:
                    cells.append(f"{iv.mean:.4g} ± {iv.half_width:.2g}")
            lines.append(f"| {method} | {len(runs)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)[:MAX_NOTE_CHARS]


#: MLflow's limit on a tag value (``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``).
MAX_NOTE_CHARS = 8000


def study_children(parent: dict) -> list:
    """The study's training runs (children of its parent run), ordered by dataset, partition,
    method and seed."""
    client = _client(parent["tracking_uri"])
    runs = retry(client.search_runs, [parent["experiment_id"]],
                 f"tags.mlflow.parentRunId = '{parent['parent_run_id']}'", max_results=5000)

    def key(r):
        t = r.data.tags
        seed = t.get("seed", "")
        return (t.get("dataset", ""), t.get("partition", ""), t.get("method", ""),
                int(seed) if seed.isdigit() else 0, r.info.run_name or "")

    return sorted(runs, key=key)


#: The study view's headline bar charts, in display order: (summary metric key, chart title).
#: The FedKPer-paper metrics (``docs/metrics.md``), then the final client accuracy, the worst
#: client, the bytes and the privacy spent (DP runs only; a metric no run has is left out).
HEADLINE_METRICS: tuple[tuple[str, str], ...] = (
    ("avg_global_acc", "Avg Global Acc ↑ (FedKPer Table 1)"),
    ("avg_local_acc", "Avg Local Acc ↑ (FedKPer Table 1)"),
    ("avg_worst_client_acc", "Avg Worst Client Acc ↑"),
    ("final_client_acc_mean", "Final mean client accuracy ↑ (deployed models)"),
    ("final_client_acc_worst", "Final worst client accuracy ↑"),
    ("final_global_acc", "Final global-model accuracy ↑"),
    ("balance", "Balance ↑ (FedKPer)"),
    ("global_consistency", "Avg Global Consistency ↑"),
    ("local_consistency", "Avg Local Consistency ↑"),
    ("avg_global_bwt", "Avg Global BwT ↑"),
    ("mb_per_round", "MB per round ↓ (up + down)"),
    ("epsilon", "Privacy spent: ε at δ ↓ (DP runs)"),
)
#: The per-round curves (step = round) of the study view: (metric key, chart title).
CURVE_METRICS: tuple[tuple[str, str], ...] = (
    ("global_test_acc", "Global model: test accuracy per round"),
    ("personalized_acc_mean", "Personalized models: mean client accuracy per round"),
    ("local_acc_mean", "After local training: mean client accuracy per round"),
    ("local_acc_worst", "After local training: worst client accuracy per round"),
    ("dp_epsilon", "Privacy spent per round: ε at δ"),
)
#: The experiment tag prefix under which the MLflow UI (3.x) keeps a shared view of the runs page
#: (the UI's "Share" button; read back by the ``viewStateShareKey`` URL parameter).
SHARED_VIEW_TAG = "mlflow.sharedViewState."
#: MLflow's own number of significant digits is none: summary metrics are logged rounded to this
#: many (the full values stay in each run's ``metrics.json``).
LOGGED_DIGITS = 4


def round_significant(x: float, digits: int = LOGGED_DIGITS) -> float:
    """``x`` rounded to ``digits`` significant digits (``0.123456 -> 0.1235``; 0, NaN and inf as
    they are)."""
    if not math.isfinite(x) or x == 0:
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def study_filter(study: str) -> str:
    """The MLflow search filter of a study's training runs (its children; not the parent)."""
    return f"tags.study = '{study}' and tags.`medpfl.role` = 'training'"


def share_key(study: str, layout: str) -> str:
    """The shared-view key of a study's ``layout`` (``charts`` or ``table``): letters, digits and
    ``-`` only (it is a URL parameter and part of an experiment tag's key)."""
    import re

    return f"medpfl-{re.sub(r'[^A-Za-z0-9]+', '-', study).strip('-')}-{layout}"


def study_view_state(study: str, layout: str = "charts") -> dict[str, Any]:
    """The MLflow runs-page state that opens a study as a comparison of methods (MLflow 3.17's
    shared view state: the fields of the UI's search facets and runs-page UI state).

    Both layouts show the study's training runs grouped by the ``method`` tag with the group's
    average (``groupBy``), every group shown (``runsHiddenMode: SHOW_ALL``), the per-seed runs
    inside each group (one click on the group). ``charts``: a first section of bar charts, one
    bar per method (:data:`HEADLINE_METRICS`), and a second of per-round line charts
    (:data:`CURVE_METRICS`; a group's line is the mean over its seeds with the min-max band);
    MLflow adds every other metric in a last section. ``table``: the runs table with the
    headline metrics as columns, a group row per method holding the mean over seeds.

    Raises ValueError for another layout."""
    if layout not in ("charts", "table"):
        raise ValueError(f"study view layout {layout!r}: expected 'charts' or 'table'")
    state: dict[str, Any] = {
        "searchFilter": study_filter(study),
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "method"}]},
        "runsHiddenMode": "SHOW_ALL",
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }
    if layout == "table":
        state["selectedColumns"] = (["tags.`seed`", "tags.`dataset`", "tags.`partition`"]
                                    + [f"metrics.`{k}`" for k, _ in HEADLINE_METRICS])
        return state
    sections = [
        {"uuid": "medpfl-headline", "name": "Methods compared: mean over seeds (bars)", "display": True,
         "isReordered": True, "deleted": False, "isGenerated": False},
        {"uuid": "medpfl-curves", "name": "Per round: mean over seeds, band = min to max", "display": True,
         "isReordered": True, "deleted": False, "isGenerated": False},
        {"uuid": "medpfl-other", "name": "Model metrics", "display": True, "isReordered": False, "deleted": False,
         "isGenerated": True},  # MLflow puts every metric not charted above here
    ]
    charts: list[dict[str, Any]] = [
        {"type": "BAR", "uuid": f"medpfl-bar-{k}", "metricKey": k, "displayName": title, "deleted": False,
         "isGenerated": False, "metricSectionId": "medpfl-headline"} for k, title in HEADLINE_METRICS]
    charts += [
        {"type": "LINE", "uuid": f"medpfl-line-{k}", "metricKey": k, "selectedMetricKeys": [k], "displayName": title,
         "deleted": False, "isGenerated": False, "metricSectionId": "medpfl-curves", "xAxisKey": "step",
         "selectedXAxisMetricKey": "", "xAxisScaleType": "linear", "scaleType": "linear", "lineSmoothness": 0,
         "range": {}, "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
         "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False} for k, title in CURVE_METRICS]
    state.update({"compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True})
    return state


def publish_study_views(parent: dict) -> dict[str, str]:
    """Store the study's two views (:func:`study_view_state`) as shared views of its experiment
    (experiment tags ``mlflow.sharedViewState.<key>``, as the UI's Share button does) and return
    ``{layout: key}``. Idempotent; the tags are rewritten, so a newer medpfl's view replaces an
    older one. Raises :class:`TrackingError` when the store does not answer."""
    client = _client(parent["tracking_uri"])
    keys = {}
    for layout in ("charts", "table"):
        key = share_key(parent["study"], layout)
        retry(client.set_experiment_tag, parent["experiment_id"], SHARED_VIEW_TAG + key,
              json.dumps(study_view_state(parent["study"], layout), ensure_ascii=False, separators=(",", ":")))
        keys[layout] = key
    return keys


def ui_urls(parent: dict, base: str, run_ids: list[str] = ()) -> dict[str, str]:
    """Links into the MLflow UI at ``base`` (``http://127.0.0.1:5000``) for one study:

    * ``experiment``: the study's comparison, as charts (:func:`study_view_state`, stored by
      :func:`publish_study_views`; the link names the shared view, ``viewStateShareKey``, and the
      machine-learning view, ``workflowType``: the MLflow 3.17 UI picks the view from this
      switch, default GenAI, rather than from the experiment tag). The UI ignores a shared view
      when the link also has a search filter, so the filter is in the view;
    * ``table``: the same runs as a table, a row per method (mean over seeds) above its seeds;
    * ``runs``: the study's runs, filtered, with no grouping (the UI's own defaults);
    * ``compare``: MLflow's compare page for ``run_ids`` (params and metrics side by side).
    """
    base = base.rstrip("/")
    exp = parent["experiment_id"]
    study = parent["study"]

    def runs_page(**q: str) -> str:
        return f"{base}/#/experiments/{exp}/runs?{urlencode(q, quote_via=quote)}"

    out = {
        "experiment": runs_page(viewStateShareKey=share_key(study, "charts"), workflowType="machine_learning",
                                compareRunsMode="CHART"),
        "table": runs_page(viewStateShareKey=share_key(study, "table"), workflowType="machine_learning",
                           compareRunsMode="TABLE"),
        "runs": runs_page(workflowType="machine_learning", compareRunsMode="TABLE", searchFilter=study_filter(study)),
    }
    if run_ids:
        ids = quote(json.dumps(list(run_ids), separators=(",", ":")))
        out["compare"] = (f"{base}/#/compare-runs?runs={ids}&experiments={quote(json.dumps([exp]))}"
                          "&workflowType=machine_learning")
    return out


def run_name(method: str, seed: int | str, dataset: str, partition: str) -> str:
    """A training run's MLflow name, method first (the UI cuts long names from the right):
    ``fedavg s1 bloodmnist/dir0.1``."""
    return f"{method} s{seed} {dataset}/{partition}"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` (lists are kept as their string)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def logged_value(x: float) -> float:
    """A metric value as medpfl logs it to MLflow: integers exact, other values to
    :data:`LOGGED_DIGITS` significant digits."""
    return x if x.is_integer() else round_significant(x)


class RunLogger:
    """A child run of the study's parent: params, per-round metrics (step = round), artifacts.

    ``run_file`` (``mlflow_run.json`` in the run folder) records the run id as soon as the run
    exists, so a resumed job (killed, failed or still marked running) continues the same MLflow
    run instead of starting a new one. A run that FINISHED is not continued: a job that trains
    again in the same folder after finishing (a params or code edit re-runs it) is a new run, so
    its params and curves are not mixed into the old one's (MLflow params are immutable).
    ``start_time`` (ms since the epoch) dates a new run (default: now).
    """

    def __init__(self, parent_file: Path, run_file: Path, run_name: str, tags: dict[str, str], resume: bool = True,
                 start_time: int | None = None):
        parent = read_json(parent_file)
        self.uri = parent["tracking_uri"]
        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if env_uri and env_uri != self.uri:
            log.warning("MLFLOW_TRACKING_URI is %s but the study's parent run (%s) is in %s: this run is logged "
                        "there, with its parent. To move the study to %s, delete %s (mlflow-init then creates a "
                        "parent there) and run again", env_uri, parent_file, self.uri, env_uri, parent_file)
        check_reachable(self.uri)
        self.client = _client(self.uri)
        self.run_file = Path(run_file)
        run_id = None
        if resume and self.run_file.exists():
            try:
                run_id = read_json(self.run_file)["run_id"]
                if self.client.get_run(run_id).info.status == "FINISHED":
                    run_id = None
            except Exception:
                run_id = None
        if run_id is None:
            all_tags = {"mlflow.parentRunId": parent["parent_run_id"], "mlflow.runName": run_name, **tags}
            run = retry(self.client.create_run, parent["experiment_id"], start_time=start_time, run_name=run_name,
                        tags=all_tags)
            run_id = run.info.run_id
            write_json(self.run_file, {"run_id": run_id, "experiment_id": parent["experiment_id"],
                                       "parent_run_id": parent["parent_run_id"], "tracking_uri": self.uri})
            self.resumed = False
        else:
            retry(self.client.update_run, run_id, status="RUNNING")
            self.resumed = True
        self.run_id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        flat = {k: str(v)[:6000] for k, v in flatten(params).items() if k not in existing}
        items = list(flat.items())
        for i in range(0, len(items), 100):
            retry(self.client.log_batch, self.run_id, params=[Param(k, v) for k, v in items[i:i + 100]])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log ``metrics`` at ``step`` (0 when None); NaN and None are skipped, fractional values are
        rounded to :data:`LOGGED_DIGITS` significant digits (the MLflow UI prints up to 16 and has
        no setting for it; the full values are in the run's files), integers are kept exact."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, logged_value(float(v)), ts, step if step is not None else 0) for k, v in metrics.items()
              if v is not None and v == v]
        for i in range(0, len(ms), 500):
            retry(self.client.log_batch, self.run_id, metrics=ms[i:i + 500])

    def rename(self, name: str) -> None:
        """Give the run a new name (MLflow's ``mlflow.runName`` tag, as the UI shows it)."""
        retry(self.client.update_run, self.run_id, name=name)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        retry(self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        retry(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_dict(self, obj: dict, name: str) -> None:
        retry(self.client.log_dict, self.run_id, obj, name)

    def finish(self, status: str = "FINISHED") -> None:
        retry(self.client.set_terminated, self.run_id, status)

    @classmethod
    def reopen(cls, run_file: Path) -> "RunLogger":
        """The run recorded in ``run_file`` (evaluate stage)."""
        info = read_json(run_file)
        self = cls.__new__(cls)
        self.uri = info["tracking_uri"]
        check_reachable(self.uri)
        self.client = _client(self.uri)
        self.run_file = Path(run_file)
        self.run_id = info["run_id"]
        self.resumed = True
        return self
