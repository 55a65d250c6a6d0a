"""Load finished runs and turn them into the report's tables and metrics files.

Two tables are built per (dataset, partition) group, one row per method:

* **Table 1 (FedKPer paper convention)**, the columns of Table 1 in Fowler & AlRegib,
  "FedKPer" (ICIP 2026), summarised as ``../shared/docs/fedkper-protocol.md`` §4.2 infers
  the authors did: Avg Global Acc, Avg Global BwT and Avg Local Acc are the mean over seeds
  of each run's round average, and their ``±`` is the mean over seeds of each run's **std
  over rounds**; Avg Global Consistency, Avg Worst Client Acc and Avg Local Consistency are
  one number per run, shown as mean ``±`` **std over seeds** (population, ddof=0; ``± n/a``
  with a single seed); Balance is the mean over seeds, without ``±``.
* **Plain summary**: final-round and cost numbers as mean ``±`` std over seeds (ddof=0).

A null (not applicable, e.g. global metrics of the ``local`` method) renders as ``—``.

An **Environment** table follows: one row per distinct environment fingerprint
(:mod:`medpfl.environment`) with the runs trained in it, so a reader sees whether the numbers
compared come from one machine, thread count and precision policy.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from medpfl.environment import summary as env_summary
from medpfl.io import read_json

NULL = "—"
NA_STD = "n/a"

#: Identity columns of ``metrics.json`` (also the first columns of ``summary.csv``).
ID_KEYS = ("study", "dataset", "partition", "method", "algorithm", "seed", "mlflow_run_id")

#: The per-run summary keys written by :func:`medpfl.metrics.summarize_run`, in that order.
SUMMARY_KEYS = (
    "avg_global_acc", "avg_global_acc_std_rounds", "final_global_acc", "final_global_bal_acc",
    "avg_global_bwt", "avg_global_bwt_std_rounds", "global_consistency",
    "avg_local_acc", "avg_local_acc_std_rounds", "avg_local_acc_plain",
    "avg_worst_client_acc", "avg_worst_client_acc_plain", "local_consistency", "balance",
    "final_client_acc_mean", "final_client_acc_worst", "final_client_bal_acc_mean", "final10_client_acc_mean",
    "final_local_models_on_global_test", "bytes_up_total", "bytes_down_total", "mb_per_round",
    "seconds_per_round", "train_seconds_per_round", "eval_seconds_per_round", "wall_seconds",
    "rounds", "num_clients", "last_round",
)

#: Keys of ``summary.json`` (the DVC metrics file): the mean over seeds of each.
JSON_KEYS = (
    "avg_global_acc", "avg_global_bwt", "global_consistency", "avg_local_acc", "avg_worst_client_acc",
    "local_consistency", "balance", "final_global_acc", "final_client_acc_worst", "mb_per_round",
)

#: Columns of ``round_metrics.csv`` that the report needs.
ROUND_COLUMNS = ("round", "global_test_acc", "local_bal_acc_mean")

TABLE1_TITLE = "Table 1 (FedKPer paper convention)"
PLAIN_TITLE = "Plain summary (mean ± std over seeds)"

# (column header, value key, "±" key or how the ± is computed)
#   "rounds:<key>": ± is the mean over seeds of the per-run std over rounds in <key>
#   "seeds":        ± is the std over seeds of the value
#   None:           no ±
_TABLE1 = (
    ("Avg Global Acc ↑", "avg_global_acc", "rounds:avg_global_acc_std_rounds"),
    ("Avg Global BwT ↑", "avg_global_bwt", "rounds:avg_global_bwt_std_rounds"),
    ("Avg Global Consistency ↑", "global_consistency", "seeds"),
    ("Avg Local Acc ↑", "avg_local_acc", "rounds:avg_local_acc_std_rounds"),
    ("Avg Worst Client Acc ↑", "avg_worst_client_acc", "seeds"),
    ("Avg Local Consistency ↑", "local_consistency", "seeds"),
    ("Balance ↑", "balance", None),
)

# (column header, value key, decimals)
_PLAIN = (
    ("Final Global Acc", "final_global_acc", 3),
    ("Final mean client acc (all clients)", "final_client_acc_mean", 3),
    ("Final worst client acc (all clients)", "final_client_acc_worst", 3),
    ("Last-10-round mean client acc", "final10_client_acc_mean", 3),
    ("Avg local acc (plain)", "avg_local_acc_plain", 3),
    ("MB per round", "mb_per_round", 2),
    ("s per round", "seconds_per_round", 2),
)

TABLE1_CAPTION = (
    "± on Avg Global Acc, Avg Global BwT and Avg Local Acc is the mean over seeds of each run's std over rounds, "
    "while ± on the two consistencies and Avg Worst Client Acc is the std over seeds (population, ddof=0; "
    f"“{NA_STD}” with one seed) and Balance has none (FedKPer paper Table 1; fedkper-protocol.md §4.2). "
    "Avg Local Acc is the class-balanced accuracy of each sampled client's model right after local training "
    "on its local test split, averaged over the sampled clients and then over rounds; Avg Worst Client Acc is "
    "the per-round minimum of that accuracy over the sampled clients, averaged over rounds. "
    f"{NULL} = not applicable."
)
PLAIN_CAPTION = (
    "Mean ± std over seeds (population, ddof=0; “n/a” with one seed). Final client accuracies are over all "
    "clients at the last evaluated round, with the model each client would deploy (its personalized model for "
    "personalized methods, else the global model); the last-10-round value averages that mean over the last 10 "
    f"evaluated rounds. {NULL} = not applicable."
)


@dataclass
class Run:
    """One finished training run: its ``metrics.json`` content and ``round_metrics.csv`` table."""

    run_dir: Path
    meta: dict[str, Any]
    summary: dict[str, Any]
    rounds: pd.DataFrame
    environment: dict[str, Any] | None = None  # the fingerprint training recorded (None: trained before)
    earlier_environments: tuple[dict[str, Any], ...] = ()  # of earlier sessions, when resumed elsewhere

    @property
    def key(self) -> tuple[str, str, str, Any]:
        return (self.meta["dataset"], self.meta["partition"], self.meta["method"], self.meta["seed"])


def read_csv(path: str | Path) -> pd.DataFrame:
    """``pd.read_csv`` whose errors name the file (``FileNotFoundError`` / ``ValueError``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path}: unreadable CSV file ({e}); delete it and re-run the stage that writes it") from None


def load_run(run_dir: str | Path) -> Run:
    """Read ``metrics.json`` and ``round_metrics.csv`` from ``run_dir`` and check their shape."""
    run_dir = Path(run_dir)
    mpath = run_dir / "metrics.json"
    m = read_json(mpath)
    if not isinstance(m, dict):
        raise ValueError(f"{mpath}: expected a JSON object, got {type(m).__name__}")
    missing = [k for k in ("dataset", "partition", "method", "seed", "summary") if k not in m]
    if missing:
        raise ValueError(f"{mpath}: missing keys {missing}")
    if not isinstance(m["summary"], dict):
        raise ValueError(f"{mpath}: 'summary' must be a JSON object")
    meta = {k: m.get(k) for k in ID_KEYS}
    summary = {k: _clean(v) for k, v in m["summary"].items()}

    rpath = run_dir / "round_metrics.csv"
    rounds = read_csv(rpath)
    missing = [c for c in ROUND_COLUMNS if c not in rounds.columns]
    if missing:
        raise ValueError(f"{rpath}: missing columns {missing}")
    for c in rounds.columns:
        if c != "round":
            rounds[c] = pd.to_numeric(rounds[c], errors="coerce")
    env = m.get("environment") if isinstance(m.get("environment"), dict) else None
    earlier = tuple(e for e in (m.get("earlier_environments") or []) if isinstance(e, dict))
    return Run(run_dir=run_dir, meta=meta, summary=summary, rounds=rounds, environment=env,
               earlier_environments=earlier)


def load_runs(run_dirs: Iterable[str | Path]) -> list[Run]:
    """Load every run; raise ``ValueError`` on an empty list or a repeated (dataset, partition, method, seed)."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("report: no runs given")
    seen: dict[tuple, Path] = {}
    for r in runs:
        if r.key in seen:
            raise ValueError(f"report: {r.run_dir} and {seen[r.key]} are the same run "
                             f"(dataset, partition, method, seed) = {r.key}")
        seen[r.key] = r.run_dir
    return runs


def _clean(v: Any) -> Any:
    """NaN / inf -> None so that null stays null in every output."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def groups(runs: list[Run]) -> dict[tuple[str, str], dict[str, list[Run]]]:
    """``{(dataset, partition): {method: [runs]}}``, groups and methods in order of first appearance."""
    out: dict[tuple[str, str], dict[str, list[Run]]] = {}
    for r in runs:
        out.setdefault((r.meta["dataset"], r.meta["partition"]), {}).setdefault(r.meta["method"], []).append(r)
    return out


def _values(runs: list[Run], key: str) -> np.ndarray:
    vals = [r.summary.get(key) for r in runs]
    return np.array([float(v) for v in vals if v is not None and math.isfinite(float(v))], dtype=np.float64)


def seed_mean(runs: list[Run], key: str) -> float | None:
    """Mean over seeds of a summary key, ignoring nulls; None when every run has null."""
    v = _values(runs, key)
    return float(v.mean()) if len(v) else None


def seed_std(runs: list[Run], key: str) -> float | None:
    """Population std (ddof=0) over seeds, ignoring nulls; None with fewer than two values."""
    v = _values(runs, key)
    return float(v.std(ddof=0)) if len(v) > 1 else None


def _fmt(x: float | None, nd: int) -> str:
    if x is None:
        return NULL
    s = f"{x:.{nd}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s  # no "-0.000"


def _pm(mean: float | None, pm: float | None, nd: int, pm_missing: str) -> str:
    if mean is None:
        return NULL
    return f"{_fmt(mean, nd)} ± {_fmt(pm, nd) if pm is not None else pm_missing}"


def table1(methods: dict[str, list[Run]]) -> pd.DataFrame:
    """Table 1 in the FedKPer paper's convention (see the module docstring) as formatted strings."""
    rows = []
    for method, runs in methods.items():
        row = {"Strategy": method}
        for col, key, how in _TABLE1:
            mean = seed_mean(runs, key)
            if how is None:
                row[col] = _fmt(mean, 3)
            elif how == "seeds":
                row[col] = _pm(mean, seed_std(runs, key), 3, NA_STD)
            else:
                row[col] = _pm(mean, seed_mean(runs, how.split(":", 1)[1]), 3, NULL)
        rows.append(row)
    return pd.DataFrame(rows, columns=["Strategy"] + [c for c, _, _ in _TABLE1])


def plain_table(methods: dict[str, list[Run]]) -> pd.DataFrame:
    """Plain summary: mean ± std over seeds (ddof=0) of final and cost numbers, with the seed count."""
    rows = []
    for method, runs in methods.items():
        row: dict[str, Any] = {"Strategy": method}
        for col, key, nd in _PLAIN:
            row[col] = _pm(seed_mean(runs, key), seed_std(runs, key), nd, NA_STD)
        row["seeds"] = str(len(runs))
        rows.append(row)
    return pd.DataFrame(rows, columns=["Strategy"] + [c for c, _, _ in _PLAIN] + ["seeds"])


def summary_frame(runs: list[Run]) -> pd.DataFrame:
    """One row per run: the identity columns, then every summary key (known keys first)."""
    extra: list[str] = []
    for r in runs:
        extra += [k for k in r.summary if k not in SUMMARY_KEYS and k not in extra]
    cols = list(ID_KEYS) + list(SUMMARY_KEYS) + extra + ["environment_id"]
    rows = [{**r.meta, **r.summary, "environment_id": (r.environment or {}).get("id")} for r in runs]
    return pd.DataFrame(rows, columns=cols)


ENV_TITLE = "Environment"
ENV_CAPTION = (
    "One row per distinct environment fingerprint (CPU model and SIMD level, BLAS, torch threads, torch/CUDA/cuDNN "
    "versions, device, determinism flags, precision policy) and the runs trained in it "
    "(dataset/partition/method/seed). Re-running a job in the same fingerprint reproduces its numbers exactly; "
    "another CPU model or thread count changes float results slightly (README, Reproducibility). “unknown”: trained before fingerprints were recorded. "
    "Full fingerprints: job.json and metrics.json of each run, env.* tags in MLflow."
)


def _run_label(r: Run) -> str:
    return f"{r.meta['dataset']}/{r.meta['partition']}/{r.meta['method']}/seed{r.meta['seed']}"


def environment_table(runs: list[Run], max_listed: int = 12) -> pd.DataFrame:
    """One row per distinct environment fingerprint, in order of first appearance: its id, the
    short description (:func:`medpfl.environment.summary`) and the runs that used it (all of
    them named, or their count when more than ``max_listed``). A run resumed in another
    environment is listed under its last one, marked with the earlier ids."""
    by_id: dict[str, list[Run]] = {}
    envs: dict[str, dict | None] = {}
    for r in runs:
        key = (r.environment or {}).get("id") or "unknown"
        by_id.setdefault(key, []).append(r)
        envs.setdefault(key, r.environment)
    rows = []
    for key, rs in by_id.items():
        labels = [_run_label(r) + (f" (resumed; before: {', '.join(str(e.get('id')) for e in r.earlier_environments)})"
                                   if r.earlier_environments else "") for r in rs]
        if len(by_id) == 1 and not any(r.earlier_environments for r in rs):
            used = f"all {len(rs)} runs"
        elif len(labels) > max_listed:
            used = f"{len(rs)} runs: " + ", ".join(labels[:max_listed]) + f", … ({len(rs) - max_listed} more)"
        else:
            used = f"{len(rs)}: " + ", ".join(labels)
        rows.append({"Fingerprint": key, **env_summary(envs[key]), "Runs": used})
    return pd.DataFrame(rows)


def summary_metrics(runs: list[Run]) -> dict[str, dict[str, dict[str, dict[str, float | None]]]]:
    """``{dataset: {partition: {method: {metric: mean over seeds}}}}`` for :data:`JSON_KEYS`."""
    out: dict = {}
    for (ds, part), methods in groups(runs).items():
        for method, rs in methods.items():
            out.setdefault(ds, {}).setdefault(part, {})[method] = {k: seed_mean(rs, k) for k in JSON_KEYS}
    return out


def _md_table(df: pd.DataFrame) -> str:
    # disable_numparse keeps "0.600" as written (tabulate would print 0.6).
    return df.to_markdown(index=False, disable_numparse=True)


def render_markdown(runs: list[Run], title: str = "", curves_name: str | None = "curves.png",
                    paper: tuple[str, str, dict] | None = None) -> str:
    """The Markdown report: both tables for every (dataset, partition) group, and where a paper
    table is given (``(heading, caption, {group: [(label, table)]})``) the side-by-side section."""
    lines = [f"# {title or 'medpfl report'}", ""]
    for (ds, part), methods in groups(runs).items():
        lines += [f"## {ds} / {part}", "", f"### {TABLE1_TITLE}", "", _md_table(table1(methods)), "",
                  f"*{TABLE1_CAPTION}*", "", f"### {PLAIN_TITLE}", "", _md_table(plain_table(methods)), "",
                  f"*{PLAIN_CAPTION}*", ""]
        group = f"{ds} / {part}"
        if paper and group in paper[2]:
            lines += [f"### {paper[0]}", "", f"*{paper[1]}*", ""]
            for label, t in paper[2][group]:
                lines += [f"#### {label}", "", _md_table(t), ""]
    lines += [f"## {ENV_TITLE}", "", _md_table(environment_table(runs)), "", f"*{ENV_CAPTION}*", ""]
    if curves_name:
        lines += ["## Accuracy per round", "", f"![Accuracy per round]({curves_name})", ""]
    return "\n".join(lines)


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #444; padding-bottom: .2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #bbb; }
table.report { border-collapse: collapse; margin: .5em 0; font-size: 0.9em; }
table.report th, table.report td { border: 1px solid #ccc; padding: .3em .6em; text-align: right; white-space: nowrap; }
table.report th { background: #f0f0f0; text-align: center; }
table.report td:first-child { text-align: left; font-weight: 600; }
table.report tbody tr:nth-child(even) { background: #fafafa; }
p.caption { font-size: 0.85em; color: #555; max-width: 60em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; }
table.env td, table.env td:first-child { white-space: normal; text-align: left; font-weight: normal; }
table.env td:first-child { font-family: monospace; }
"""


def _html_table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, escape=True, classes="report", border=0)


def render_html(runs: list[Run], title: str = "", images: Iterable[tuple[str, str, str]] = (),
                paper: tuple[str, str, dict] | None = None) -> str:
    """A self-contained HTML page (inline CSS, images as data URIs).

    images: ``(caption, mime type, base64 data)`` for each figure to embed; paper: as
    :func:`render_markdown`.
    """
    t = html.escape(title or "medpfl report")
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{t}</title>",
             f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{t}</h1>"]
    for (ds, part), methods in groups(runs).items():
        parts += [f"<h2>{html.escape(str(ds))} / {html.escape(str(part))}</h2>",
                  f"<h3>{html.escape(TABLE1_TITLE)}</h3>", _html_table(table1(methods)),
                  f'<p class="caption">{html.escape(TABLE1_CAPTION)}</p>',
                  f"<h3>{html.escape(PLAIN_TITLE)}</h3>", _html_table(plain_table(methods)),
                  f'<p class="caption">{html.escape(PLAIN_CAPTION)}</p>']
        group = f"{ds} / {part}"
        if paper and group in paper[2]:
            parts += [f"<h3>{html.escape(paper[0])}</h3>", f'<p class="caption">{html.escape(paper[1])}</p>']
            for label, t in paper[2][group]:
                parts += [f"<h4>{html.escape(label)}</h4>", _html_table(t)]
    parts += [f"<h2>{ENV_TITLE}</h2>",
              environment_table(runs).to_html(index=False, escape=True, classes=["report", "env"], border=0),
              f'<p class="caption">{html.escape(ENV_CAPTION)}</p>']
    images = list(images)
    if images:
        parts.append("<h2>Figures</h2>")
    for caption, mime, data in images:
        c = html.escape(caption)
        parts.append(f'<figure><img alt="{c}" src="data:{mime};base64,{data}"><figcaption>{c}</figcaption></figure>')
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)
