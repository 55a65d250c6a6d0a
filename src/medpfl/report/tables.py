"""Load finished runs and turn them into the report's tables and metrics files.

Every table says how many seeds and rounds are behind each row (``seeds``, ``rounds``) and shows
each number as the **mean over seeds ± the half-width of its 95 % confidence interval over seeds**
(Student t on the per-seed values, ddof=1; :mod:`medpfl.report.stats`), or, where only one seed
has a value, the value followed by "(1 seed: no interval)". Per (dataset, partition) group, one
row per method:

* **Table 1 (FedKPer paper convention)**: the columns of Table 1 in Fowler & AlRegib, "FedKPer"
  (ICIP 2026). The paper's own ``±`` on Avg Global Acc, Avg Global BwT and Avg Local Acc is a
  **std over rounds** (``../shared/docs/fedkper-protocol.md`` §4.2: the mean over seeds of each
  run's std over rounds); it is kept as a separate column beside each of them, labelled
  "std over rounds (paper's ±)", and is not a measure of uncertainty of the mean.
* **Plain summary**: final-round and cost numbers.
* **Paired comparison vs <reference>**: :func:`paired_table` (differences to the reference
  method over shared seeds, with their 95 % CI).

A null (not applicable, e.g. global metrics of the ``local`` method) renders as ``—``.

An **Environment** table follows: one row per distinct environment fingerprint
(:mod:`medpfl.environment`) with the runs trained in it, so a reader sees whether the numbers
compared come from one machine, thread count and precision policy.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from medpfl.environment import summary as env_summary
from medpfl.io import InputFileError, read_json
from medpfl.report.stats import (CI_LEVEL, NO_INTERVAL, PAIRED_METRICS, Interval, finite, paired_frame,
                                 resolve_reference, t_interval)

NULL = "—"

#: Identity columns of ``metrics.json`` (also the first columns of ``summary.csv``).
ID_KEYS = ("study", "dataset", "partition", "method", "algorithm", "seed", "mlflow_run_id")

#: The per-run summary keys written by :func:`medpfl.metrics.summarize_run`, in that order.
SUMMARY_KEYS = (
    "avg_global_acc", "avg_global_acc_std_rounds", "final_global_acc", "final_global_bal_acc",
    "avg_global_bwt", "avg_global_bwt_std_rounds", "global_consistency",
    "avg_local_acc", "avg_local_acc_std_rounds", "avg_local_acc_plain",
    "avg_worst_client_acc", "avg_worst_client_acc_plain", "local_consistency", "balance",
    "final_client_acc_mean", "final_client_acc_worst", "final_client_acc_worst_client", "final_client_acc_worst_test_size",
    "final_client_acc_worst_ties", "final_client_bal_acc_mean", "final_client_acc_pooled",
    "final10_client_acc_mean",
    "final_local_models_on_global_test", "best_val_client_acc", "best_val_client_acc_worst",
    "bytes_up_total", "bytes_down_total", "mb_per_round", "mb_up_per_round", "mb_down_per_round",
    "compression_ratio", "trainable_params", "frozen_params", "peak_memory_mb", "seconds_per_round", "train_seconds_per_round", "eval_seconds_per_round", "wall_seconds",
    "rounds", "num_clients", "last_round", "clients_never_trained",
)

#: Keys of ``summary.json`` (the DVC metrics file): the mean over seeds of each.
JSON_KEYS = (
    "avg_global_acc", "avg_global_bwt", "global_consistency", "avg_local_acc", "avg_worst_client_acc",
    "local_consistency", "balance", "final_global_acc", "final_client_acc_worst", "mb_per_round",
)

#: Columns of ``round_metrics.csv`` that the report needs.
ROUND_COLUMNS = ("round", "global_test_acc", "local_bal_acc_mean")

TABLE1_TITLE = "Table 1 (FedKPer paper convention)"
TABLE1_LEAD = (f"Mean ± {CI_LEVEL} CI over seeds in every value column; the paper's ± (a std over rounds) "
               "in the columns that say so.")
PLAIN_TITLE = f"Plain summary (mean ± {CI_LEVEL} CI over seeds)"
PAIRED_TITLE = "Paired comparison vs {reference}"

#: Header of the columns that keep the FedKPer paper's ± (a std over rounds) beside a value.
ROUNDS_STD = "{label}: std over rounds (paper's ±)"

# (column header, value key, key of the per-run std over rounds shown beside it (the paper's ±) or None)
_TABLE1 = (
    ("Avg Global Acc ↑", "avg_global_acc", "avg_global_acc_std_rounds"),
    ("Avg Global BwT ↑", "avg_global_bwt", "avg_global_bwt_std_rounds"),
    ("Avg Global Consistency ↑", "global_consistency", None),
    ("Avg Local Acc ↑", "avg_local_acc", "avg_local_acc_std_rounds"),
    ("Avg Worst Client Acc ↑", "avg_worst_client_acc", None),
    ("Avg Local Consistency ↑", "local_consistency", None),
    ("Balance ↑", "balance", None),
)

# (column header, value key, decimals); ↑ / ↓: higher / lower is better (the best mean is bold)
_PLAIN = (
    ("Final Global Acc ↑", "final_global_acc", 3),
    ("Final mean client acc (all clients) ↑", "final_client_acc_mean", 3),
    ("Final worst client acc (all clients) ↑", "final_client_acc_worst", 3),
    ("Final pooled client acc (correct / tested) ↑", "final_client_acc_pooled", 3),
    ("Last-10-round mean client acc ↑", "final10_client_acc_mean", 3),
    ("Avg local acc (plain) ↑", "avg_local_acc_plain", 3),
    ("Test acc at best-val round (FHBench protocol) ↑", "best_val_client_acc", 3),
    ("MB per round ↓", "mb_per_round", 2),
    ("s per round ↓", "seconds_per_round", 2),
    ("DP ε (client-level, at DP δ)", "epsilon", 3),
)
#: The column naming the client behind "Final worst client acc", placed right after it
#: (:func:`worst_client_cell`).
WORST_CLIENT = "Final worst client: id (local test samples)"
#: plain-table columns shown only where some run has a value (best_val_client_acc needs validation
#: splits, epsilon DP-FedAvg: train.dp)
_PLAIN_IF_PRESENT = ("best_val_client_acc", "epsilon")
DP_DELTA = "DP δ"

COST_TITLE = "Cost: parameters, communication and memory"
COST_CAPTION = (
    "Per method, the mean over seeds. Trainable / frozen: parameter elements the clients train and the frozen "
    "backbone they share (one copy, never sent). MB up / down per round: what the clients send and receive in one "
    "round, all clients together, as sent (compressed where a method compresses); “vs {reference}”: the ratio of "
    "MB per round (up + down) to the reference method's. Upload / dense: the uploads' bytes over the same uploads sent "
    f"uncompressed, mean over rounds (1 for a method that sends its tensors as they are, {NULL} where nothing is sent; "
    "FedMIC's paper: 11.49 %). "
    "Peak memory: the training process's peak, CUDA memory "
    "allocated by tensors on a GPU, else the process's resident set size (interpreter and libraries included). "
    f"{NULL} = not recorded."
)

CI_NOTE = (
    f"Every ± is the half-width of the {CI_LEVEL} Student t confidence interval of the mean over seeds "
    "(t quantile with n − 1 degrees of freedom × sample std over seeds (ddof=1) / √n, n = seeds with a value); "
    f"“{NO_INTERVAL}” where only one seed has a value, and “(k of n seeds)” where some seeds have none. "
    "seeds: runs per method; rounds: training rounds per run. "
    "Bold: the best mean of its column (↑ higher is better, ↓ lower), every method that ties at the printed "
    "precision; none where fewer than two methods have a value or all are equal."
)
TABLE1_CAPTION = (
    f"{CI_NOTE} The columns “… std over rounds (paper's ±)” keep the FedKPer paper's ± for Avg Global Acc, "
    "Avg Global BwT and Avg Local Acc: the mean over seeds of each run's std over the evaluated rounds "
    "(fedkper-protocol.md §4.2); it says how much the accuracy moves from round to round, not how certain the "
    "mean is. Round averages are over the evaluated rounds (every eval.every rounds and the last). "
    "Avg Local Acc is the class-balanced accuracy of each sampled client's model right after local training "
    "on its local test split, averaged over the sampled clients and then over rounds; Avg Worst Client Acc is "
    "the per-round minimum of that accuracy over the sampled clients, averaged over rounds. "
    f"{NULL} = not applicable: the global-model columns of a method without a global model (local) and Balance, "
    "which needs both; its deployed accuracy is in the plain summary's final client accuracies."
)
NEVER_TRAINED_NOTE = (
    "Clients never trained: how many of the K clients no round trained (never sampled); their final "
    "client accuracy is that of the model the method gives a client it never trained (the global model, "
    "a fine-tuned global model, or an untrained personal model: docs/methods.md, “Never-trained clients”), "
    "and it is in the final mean and worst. ")
PLAIN_CAPTION = (
    f"{CI_NOTE} Final client accuracies are over all clients at the last evaluated round, with the model each "
    "client would deploy (its personalized model for personalized methods, else the global model); the "
    "last-10-round value averages that mean over the last 10 evaluated rounds. "
    f"{NEVER_TRAINED_NOTE}"
    f"{WORST_CLIENT}: the client with the lowest final accuracy (the lowest id among ties) and its local test "
    "split's size; where seeds differ, one entry per seed in seed order. "
    f"{NULL} = not applicable."
)
DP_NOTE = (
    "DP ε: the client-level privacy DP-FedAvg (train.dp) spent by the last round, at the run's DP δ (opacus' "
    "accountant, sample rate m/K, one step per round; it assumes Poisson sampling of clients, a trusted server and a "
    f"secret client sample: docs/methods.md, “Differential privacy”); {NULL} for runs without DP, and for noise "
    "added without clipping, which fits no mechanism with a bounded sensitivity. ")


def plain_caption(table: pd.DataFrame) -> str:
    """The plain table's caption: :data:`PLAIN_CAPTION`, with :data:`DP_NOTE` where the table has
    the DP columns."""
    return (DP_NOTE + PLAIN_CAPTION) if DP_DELTA in table.columns else PLAIN_CAPTION
PAIRED_CAPTION = (
    "Each cell: the mean over the seeds both methods share of (method − {reference}), paired by seed, then "
    f"[the {CI_LEVEL} Student t confidence interval of that mean difference] (t on the per-seed "
    "differences, n − 1 degrees of freedom, ddof=1) and whether the interval excludes 0 (excludes 0: a "
    "difference in the same direction over the seeds, beyond their spread; includes 0: not distinguishable "
    f"from no difference with these seeds). “{NO_INTERVAL}” where the two share only one seed with a value. "
    "shared seeds: seeds both methods have values for (“(k of n shared seeds)” where a metric has fewer). "
    "{fallback}"
    f"{NULL} = not applicable (a null value, e.g. no global model). All seeds: paired.csv."
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
    sampling: dict[str, Any] | None = None  # job.json's train.sampling (None: no job.json beside metrics.json)

    @property
    def key(self) -> tuple[str, str, str, Any]:
        return (self.meta["dataset"], self.meta["partition"], self.meta["method"], self.meta["seed"])


def read_csv(path: str | Path) -> pd.DataFrame:
    """``pd.read_csv`` whose errors name the file (``FileNotFoundError`` / :class:`~medpfl.io.InputFileError`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError, OSError) as e:
        raise InputFileError(f"{path}: unreadable CSV file ({e}); delete it and re-run the stage that writes it") from None


def load_run(run_dir: str | Path) -> Run:
    """Read ``metrics.json`` and ``round_metrics.csv`` from ``run_dir`` and check their shape."""
    run_dir = Path(run_dir)
    mpath = run_dir / "metrics.json"
    m = read_json(mpath)
    if not isinstance(m, dict):
        raise InputFileError(f"{mpath}: expected a JSON object, got {type(m).__name__}")
    missing = [k for k in ("dataset", "partition", "method", "seed", "summary") if k not in m]
    if missing:
        raise InputFileError(f"{mpath}: missing keys {missing}")
    if not isinstance(m["summary"], dict):
        raise InputFileError(f"{mpath}: 'summary' must be a JSON object")
    meta = {k: m.get(k) for k in ID_KEYS}
    summary = {k: _clean(v) for k, v in m["summary"].items()}

    rpath = run_dir / "round_metrics.csv"
    rounds = read_csv(rpath)
    missing = [c for c in ROUND_COLUMNS if c not in rounds.columns]
    if missing:
        raise InputFileError(f"{rpath}: missing columns {missing}")
    for c in rounds.columns:
        if c != "round":
            rounds[c] = pd.to_numeric(rounds[c], errors="coerce")
    env = m.get("environment") if isinstance(m.get("environment"), dict) else None
    earlier = tuple(e for e in (m.get("earlier_environments") or []) if isinstance(e, dict))
    return Run(run_dir=run_dir, meta=meta, summary=summary, rounds=rounds, environment=env,
               earlier_environments=earlier, sampling=_job_sampling(run_dir / "job.json"))


def _job_sampling(path: Path) -> dict[str, Any] | None:
    """``train.sampling`` of a run's ``job.json`` (``{"scheme": "round_seeded", "seed": None}`` where
    the job predates the key); None without the file. A file that is not a job's JSON object
    raises :class:`~medpfl.io.InputFileError` naming it."""
    if not path.is_file():
        return None
    job = read_json(path)
    train = job.get("train") if isinstance(job, dict) else None
    if not isinstance(train, dict):
        raise InputFileError(f"{path}: expected a JSON object with a 'train' object (the training job)")
    sampling = train.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise InputFileError(f"{path}: train.sampling must be a JSON object, got {sampling!r}")
    return {"scheme": sampling.get("scheme", "round_seeded"), "seed": sampling.get("seed")}


def load_runs(run_dirs: Iterable[str | Path]) -> list[Run]:
    """Load every run; raise :class:`~medpfl.io.InputFileError` (a ``ValueError``) on an empty list or a
    repeated (dataset, partition, method, seed)."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise InputFileError("report: no runs given")
    seen: dict[tuple, Path] = {}
    for r in runs:
        if r.key in seen:
            raise InputFileError(f"report: {r.run_dir} and {seen[r.key]} are the same run "
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
    return finite(r.summary.get(key) for r in runs)


def seed_mean(runs: list[Run], key: str) -> float | None:
    """Mean over seeds of a summary key, ignoring nulls; None when every run has null."""
    v = _values(runs, key)
    return float(v.mean()) if len(v) else None


def seed_interval(runs: list[Run], key: str) -> Interval | None:
    """Mean over seeds of a summary key and its 95 % t interval (:func:`medpfl.report.stats.t_interval`),
    ignoring nulls; None when every run has null."""
    return t_interval(r.summary.get(key) for r in runs)


def _fmt(x: float | None, nd: int, signed: bool = False) -> str:
    if x is None:
        return NULL
    s = f"{x:+.{nd}f}" if signed else f"{x:.{nd}f}"
    if float(s) == 0:
        s = s.lstrip("+-")  # no "-0.000" / "+0.000"
    return s


def ci_cell(iv: Interval | None, nd: int, seeds: int) -> str:
    """``mean ± half-width`` of the 95 % CI over seeds; ``value (1 seed: no interval)`` with one
    value; ``—`` without; ``(k of n seeds)`` appended when only k of the row's n seeds have a value."""
    if iv is None:
        return NULL
    if iv.n < 2:
        cell = f"{_fmt(iv.mean, nd)} ({NO_INTERVAL})"
    else:
        cell = f"{_fmt(iv.mean, nd)} ± {_fmt(iv.half_width, nd)}"
    return cell + (f" ({iv.n} of {seeds} seeds)" if iv.n != seeds else "")


def rounds_of(runs: list[Run]) -> str:
    """The runs' number of rounds ("30"; "30, 50" when seeds differ; "—" when unknown)."""
    vals = sorted({int(r.summary["rounds"]) for r in runs if r.summary.get("rounds") is not None})
    return ", ".join(map(str, vals)) if vals else NULL


def _counts(runs: list[Run]) -> dict[str, str]:
    return {"seeds": str(len(runs)), "rounds": rounds_of(runs)}


def table1(methods: dict[str, list[Run]]) -> pd.DataFrame:
    """Table 1 in the FedKPer paper's columns (see the module docstring) as formatted strings: seeds,
    rounds, each value as mean ± 95 % CI over seeds, and beside Avg Global Acc, BwT and Local Acc
    the paper's ± (mean over seeds of the std over rounds)."""
    rows, cols = [], ["Strategy", "seeds", "rounds"]
    for col, _, rounds_key in _TABLE1:
        cols += [col] + ([ROUNDS_STD.format(label=col.rstrip(" ↑"))] if rounds_key else [])
    for method, runs in methods.items():
        row = {"Strategy": method, **_counts(runs)}
        for col, key, rounds_key in _TABLE1:
            row[col] = ci_cell(seed_interval(runs, key), 3, len(runs))
            if rounds_key:
                row[ROUNDS_STD.format(label=col.rstrip(" ↑"))] = _fmt(seed_mean(runs, rounds_key), 3)
        rows.append(row)
    means = pd.DataFrame({col: [seed_mean(runs, key) for runs in methods.values()] for col, key, _ in _TABLE1})
    return mark_best(pd.DataFrame(rows, columns=cols), means, {col: 3 for col, _, _ in _TABLE1})


def direction(column: str) -> int:
    """+1 where higher is better (the header ends in ↑), -1 where lower is (↓), 0 otherwise."""
    return 1 if column.endswith("↑") else -1 if column.endswith("↓") else 0


def mark_best(table: pd.DataFrame, means: pd.DataFrame, decimals: dict[str, int]) -> pd.DataFrame:
    """``table`` with the best cell of every column of ``means`` that has a :func:`direction` in
    Markdown bold (``**…**``; :func:`render_html` makes it ``<strong>``).

    means: one row per row of ``table`` (same order), one column per value column, the number
    the cell shows (None / NaN: no value). The best is the largest (↑) or smallest (↓) mean
    rounded to the column's ``decimals``, so every method that ties at the printed precision is
    bold; a column where fewer than two rows have a value, or all values are equal, gets none."""
    out = table.copy()
    for col in means.columns:
        d = direction(col)
        shown = pd.to_numeric(means[col], errors="coerce").round(decimals[col])
        if not d or shown.count() < 2 or shown.nunique() < 2:
            continue
        best = shown.max() if d > 0 else shown.min()
        rows = (shown == best).to_numpy()
        out.loc[rows, col] = "**" + out.loc[rows, col].astype(str) + "**"
    return out


#: Schemes of ``train.sampling`` whose schedule is drawn from the run seed (unless ``sampling.seed`` fixes it).
SEEDED_SCHEMES = ("seed_round", "stream")


def variance_note(runs: list[Run], paired: bool = False) -> str:
    """One sentence on what the intervals over these runs' seeds cover, from each run's
    ``job.json`` ``train.sampling`` (:attr:`Run.sampling`): the training seed always sets the
    model initialisation and each client's batch order; the client schedule varies with it only
    for a scheme in :data:`SEEDED_SCHEMES` without a fixed ``sampling.seed``; the partition and
    the data are fixed. ``paired``: the sentence for a paired comparison (what pairing by seed
    shares)."""
    kinds: dict[str, list[str]] = {}
    for r in runs:
        smp = r.sampling
        if smp is None:
            kind = "unknown"
        elif smp.get("scheme") in SEEDED_SCHEMES and smp.get("seed") is None:
            kind = f"seeded:{smp['scheme']}"
        elif smp.get("scheme") in SEEDED_SCHEMES:
            kind = f"fixed:{smp['scheme']} with train.sampling.seed {smp['seed']}"
        else:
            kind = f"fixed:{smp.get('scheme')}"
        kinds.setdefault(kind, [])
        if r.meta["method"] not in kinds[kind]:
            kinds[kind].append(r.meta["method"])
    seed_part = "the training seed's model initialisation and clients' batch order"
    if len(kinds) == 1:
        kind = next(iter(kinds))
        how, _, scheme = kind.partition(":")
        if how == "seeded":
            covers = (f"{seed_part}, and client sampling (train.sampling.scheme {scheme}: each seed draws its own "
                      "schedule of which clients train in which round")
            covers += (", the same for every method of that seed, so a paired difference compares methods on the same "
                       "clients" if paired else ", shared by every method of that seed") + ")"
            leaves = "the partition or the data (fixed across seeds)"
        elif how == "fixed":
            covers = seed_part
            leaves = (f"client sampling (train.sampling.scheme {scheme}: every seed and method trains the same clients "
                      "in the same rounds), the partition or the data (fixed across seeds)")
        else:
            covers = seed_part
            leaves = ("the partition or the data (fixed across seeds); whether they cover client sampling is not "
                      "recorded (no job.json beside these runs' metrics.json)")
        return f"Sources of variance: these intervals cover {covers}. They do not cover {leaves}."
    parts = []
    for kind, methods in kinds.items():
        how, _, scheme = kind.partition(":")
        what = {"seeded": f"varies with the seed ({scheme})", "fixed": f"is the same for every seed ({scheme})",
                "unknown": "is not recorded (no job.json)"}[how]
        parts.append(f"{', '.join(methods)}: the client schedule {what}")
    return ("Sources of variance: these intervals cover the training seed's model initialisation and clients' batch "
            "order, and the runs differ in client sampling (" + "; ".join(parts) + "); the partition and the data "
            "are fixed across seeds.")


NEVER_TRAINED = "Clients never trained"


def never_trained_cell(runs: list[Run]) -> str:
    """``"k of K"``: how many of the K clients no round trained, over the runs (seeds) of a method
    (``"k1–k2 of K"`` where seeds differ, e.g. with a seed-dependent client schedule); ``—``
    where no run recorded it (runs evaluated before the count existed)."""
    vals = [r.summary.get("clients_never_trained") for r in runs]
    vals = [int(v) for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return NULL
    ks = {r.summary.get("num_clients") for r in runs} - {None}
    of = f" of {int(next(iter(ks)))}" if len(ks) == 1 else ""
    lo, hi = min(vals), max(vals)
    return f"{lo}{of}" if lo == hi else f"{lo}–{hi}{of}"


def plain_table(methods: dict[str, list[Run]]) -> pd.DataFrame:
    """Plain summary: seeds, rounds and mean ± 95 % CI over seeds of final and cost numbers; and
    the clients no round trained (:func:`never_trained_cell`), where the runs recorded it."""
    everyone = [r for runs in methods.values() for r in runs]
    cols = [(c, k, nd) for c, k, nd in _PLAIN if k not in _PLAIN_IF_PRESENT or seed_mean(everyone, k) is not None]
    dp = any(k == "epsilon" for _, k, _ in cols)
    never = any(r.summary.get("clients_never_trained") is not None for r in everyone)
    named = any(r.summary.get("final_client_acc_worst_client") is not None for r in everyone)
    rows = []
    for method, runs in methods.items():
        row: dict[str, Any] = {"Strategy": method, **_counts(runs)}
        for col, key, nd in cols:
            row[col] = ci_cell(seed_interval(runs, key), nd, len(runs))
            if key == "final_client_acc_worst" and named:
                row[WORST_CLIENT] = worst_client_cell(runs)
        if dp:
            row[DP_DELTA] = dp_delta_cell(runs)
        if never:
            row[NEVER_TRAINED] = never_trained_cell(runs)
        rows.append(row)
    columns = ["Strategy", "seeds", "rounds"]
    for c, k, _ in cols:
        columns += [c] + ([WORST_CLIENT] if k == "final_client_acc_worst" and named else [])
    columns += ([DP_DELTA] if dp else []) + ([NEVER_TRAINED] if never else [])
    means = pd.DataFrame({c: [seed_mean(runs, k) for runs in methods.values()] for c, k, _ in cols})
    return mark_best(pd.DataFrame(rows, columns=columns), means, {c: nd for c, _, nd in cols})


def worst_client_cell(runs: list[Run]) -> str:
    """Who the final worst client is (``metrics.json``: ``final_client_acc_worst_client``,
    ``_test_size``, ``_ties``): ``"7 (34)"`` where every seed names client 7 with 34 local test
    samples; ``"7 (34) / 12 (20) / 3 (18)"``, one entry per seed in the runs' order, where
    seeds differ; ``", 3 tied"`` appended where up to 3 clients share the lowest accuracy; ``—``
    where no run names one (evaluated before the key existed, or no client accuracy)."""
    def entry(r: Run) -> str | None:
        c = r.summary.get("final_client_acc_worst_client")
        if c is None:
            return None
        n = r.summary.get("final_client_acc_worst_test_size")
        return f"{int(c)}" + ("" if n is None else f" ({int(n)})")

    entries = [e for e in (entry(r) for r in runs) if e is not None]
    if not entries:
        return NULL
    cell = entries[0] if len(set(entries)) == 1 else " / ".join(entries)
    ties = max(int(r.summary.get("final_client_acc_worst_ties") or 1) for r in runs)
    return cell + (f", {'up to ' if len(entries) > 1 else ''}{ties} tied" if ties > 1 else "")


def dp_delta_cell(runs: list[Run]) -> str:
    """The δ at which the runs' ε is stated (``dp_delta``; ``"1e-05"``, several joined by ", "
    where seeds differ); ``—`` where no run has one (not private)."""
    vals = sorted({float(v) for v in (r.summary.get("dp_delta") for r in runs) if v is not None})
    return ", ".join(f"{v:g}" for v in vals) if vals else NULL


def _count_cell(x: float | None) -> str:
    return NULL if x is None else f"{x:,.0f}"


def cost_table(methods: dict[str, list[Run]], reference: str | None = None) -> tuple[pd.DataFrame, str]:
    """Per method: trainable and frozen parameters, MB per round up and down, the ratio of MB per
    round to the reference method (``report.reference``; :func:`resolve_reference`), the uploads'
    compression ratio (``compression_ratio``) and the peak memory (means over seeds). Returns
    ``(table, reference)``."""
    ref = resolve_reference(list(methods), reference)
    ref_mb = seed_mean(methods[ref], "mb_per_round")
    ratio_col = f"MB per round vs {ref}"
    rows = []
    for method, runs in methods.items():
        mb = seed_mean(runs, "mb_per_round")
        peak = seed_mean(runs, "peak_memory_mb")
        rows.append({"Strategy": method, "seeds": str(len(runs)),
                     "Trainable params": _count_cell(seed_mean(runs, "trainable_params")),
                     "Frozen params": _count_cell(seed_mean(runs, "frozen_params")),
                     "MB up per round": _fmt(seed_mean(runs, "mb_up_per_round"), 3),
                     "MB down per round": _fmt(seed_mean(runs, "mb_down_per_round"), 3),
                     ratio_col: NULL if mb is None or not ref_mb else f"{mb / ref_mb:.3f}",
                     "Upload / dense": _fmt(seed_mean(runs, "compression_ratio"), 4),
                     "Peak memory MB": NULL if peak is None else f"{peak:,.0f}"})
    return pd.DataFrame(rows), ref


def paired(runs: list[Run], reference: str | None = None) -> tuple[pd.DataFrame, dict[tuple[str, str], str]]:
    """The paired comparisons of every method with the reference, per (dataset, partition)
    (:func:`medpfl.report.stats.paired_frame`: the rows of ``paired.csv``) and the reference used
    per group."""
    by_seed = {g: {m: {r.meta["seed"]: r.summary for r in rs} for m, rs in methods.items()}
               for g, methods in groups(runs).items()}
    return paired_frame(by_seed, reference)


def paired_cell(row: pd.Series | dict, nd: int = 3, shared: int | None = None) -> str:
    """``+0.020 [+0.005, +0.035], excludes 0``; ``+0.020 (1 seed: no interval)``; ``—``; with
    ``(k of n shared seeds)`` appended when only k of the ``shared`` seeds have a value."""
    if row["mean_diff"] is None or pd.isna(row["mean_diff"]):
        return NULL
    d = _fmt(row["mean_diff"], nd, signed=True)
    if row["ci_low"] is None or pd.isna(row["ci_low"]):
        cell = f"{d} ({NO_INTERVAL})"
    else:
        where = "excludes 0" if row["excludes_zero"] else "includes 0"
        cell = f"{d} [{_fmt(row['ci_low'], nd, signed=True)}, {_fmt(row['ci_high'], nd, signed=True)}], {where}"
    n = int(row["n_shared_seeds"])
    return cell + (f" ({n} of {shared} shared seeds)" if shared is not None and n != shared else "")


def paired_table(df: pd.DataFrame, dataset: str, partition: str) -> pd.DataFrame:
    """One group's paired comparison as formatted strings: a row per method other than the
    reference, with the seeds it shares with the reference (the most over the metrics) and a
    :func:`paired_cell` per metric."""
    g = df[(df["dataset"] == dataset) & (df["partition"] == partition)]
    labels = [label for _, label in PAIRED_METRICS]
    rows = []
    for method, d in g.groupby("method", sort=False):
        shared = int(d["n_shared_seeds"].max())
        row = {"Method": method, "shared seeds": str(shared)}
        row.update({r["label"]: paired_cell(r, shared=shared) for _, r in d.iterrows()})
        rows.append(row)
    return pd.DataFrame(rows, columns=["Method", "shared seeds"] + labels)


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


WALL_TITLE = "Wall time"
WALL_CAPTION = (
    "Per data set / partition and for all runs of the report: the number of runs, the sum of their wall times "
    "(each run's training and evaluation seconds summed over its rounds, wall_seconds; a resumed run counts each "
    "round once and not its restarts) in hours, and the longest run in minutes. Runs that ran side by side overlap "
    f"in real time: the sum is the compute the study takes on one worker, not its elapsed time. {NULL}: no run "
    "reports it."
)


def wall_table(runs: list[Run]) -> pd.DataFrame:
    """Rows ``data set / partition`` (in :func:`groups` order) and ``all runs``; columns the run
    count, the sum of the runs' ``wall_seconds`` in hours (2 decimals) and the longest run's in
    minutes (1 decimal); ``NULL`` where no run of the row has a finite ``wall_seconds``."""
    def row(label: str, rs: list[Run]) -> dict[str, str]:
        w = _values(rs, "wall_seconds")
        return {"data set / partition": label, "runs": str(len(rs)),
                "wall h (sum of runs)": _fmt(float(w.sum()) / 3600 if w.size else None, 2),
                "longest run min": _fmt(float(w.max()) / 60 if w.size else None, 1)}

    rows = [row(f"{ds} / {part}", [r for rs in methods.values() for r in rs])
            for (ds, part), methods in groups(runs).items()]
    rows.append(row("all runs", runs))
    return pd.DataFrame(rows)


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


def _paired_sections(runs: list[Run],
                     reference: str | None) -> dict[tuple[str, str], tuple[str, pd.DataFrame | None, str]]:
    """``{group: (heading, table or None when there is no other method, caption)}``."""
    df, used = paired(runs, reference)
    out = {}
    for (ds, part), ref in used.items():
        if reference is None:
            why = (f"Reference: {ref} (report.reference not set: fedavg when the study has it, else the first "
                   "method). ")
        elif reference != ref:
            why = (f"Reference: {ref} (report.reference {reference!r} has no runs here: fedavg when present, else "
                   "the first method). ")
        else:
            why = f"Reference: {ref} (report.reference). "
        t = paired_table(df, ds, part)
        out[(ds, part)] = (PAIRED_TITLE.format(reference=ref), t if len(t) else None,
                           PAIRED_CAPTION.format(reference=ref, fallback=why))
    return out


def render_markdown(runs: list[Run], title: str = "", curves_name: str | None = "curves.png",
                    paper: tuple[str, str, dict] | None = None, reference: str | None = None) -> str:
    """The Markdown report: per (dataset, partition) group Table 1, the plain summary and the
    paired comparison with the reference method (:func:`paired`; ``reference`` as
    :func:`medpfl.report.stats.resolve_reference`), and where a paper table is given
    (``(heading, caption, {group: [(label, table)]})``) the side-by-side section."""
    lines = [f"# {title or 'medpfl report'}", ""]
    sections = _paired_sections(runs, reference)
    for (ds, part), methods in groups(runs).items():
        group_runs = [r for rs in methods.values() for r in rs]
        note, pnote = variance_note(group_runs), variance_note(group_runs, paired=True)
        lines += [f"## {ds} / {part}", "", f"### {TABLE1_TITLE}", "", TABLE1_LEAD, "",
                  _md_table(table1(methods)), "", note, "",
                  f"*{TABLE1_CAPTION}*", "", f"### {PLAIN_TITLE}", "", _md_table(plain := plain_table(methods)), "",
                  note, "", f"*{plain_caption(plain)}*", ""]
        ct, cref = cost_table(methods, reference if reference in methods else None)
        lines += [f"### {COST_TITLE}", "", _md_table(ct), "", f"*{COST_CAPTION.format(reference=cref)}*", ""]
        heading, pt, caption = sections[(ds, part)]
        lines += [f"### {heading}", "", _md_table(pt) if pt is not None else "No other method to compare.", ""]
        lines += [pnote, ""] if pt is not None else []
        lines += [f"*{caption}*", ""]
        group = f"{ds} / {part}"
        if paper and group in paper[2]:
            lines += [f"### {paper[0]}", "", f"*{paper[1]}*", ""]
            for label, t in paper[2][group]:
                lines += [f"#### {label}", "", _md_table(t), ""]
    lines += [f"## {WALL_TITLE}", "", _md_table(wall_table(runs)), "", f"*{WALL_CAPTION}*", ""]
    lines += [f"## {ENV_TITLE}", "", _md_table(environment_table(runs)), "", f"*{ENV_CAPTION}*", ""]
    if curves_name:
        lines += ["## Accuracy per round", "", f"![Accuracy per round]({curves_name})", ""]
    return "\n".join(lines)


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1500px;
       padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #444; padding-bottom: .2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #bbb; }
div.scroll { overflow-x: auto; max-width: 100%; margin: .5em 0; }
table.report { border-collapse: separate; border-spacing: 0; font-size: 0.9em; }
table.report th, table.report td { border: 1px solid #ccc; padding: .3em .6em; text-align: right; white-space: nowrap;
                                   background: #fff; }
table.report th { background: #f0f0f0; text-align: center; white-space: normal; min-width: 4em; max-width: 9em;
                  vertical-align: bottom; }
table.report td:first-child, table.report th:first-child { position: sticky; left: 0; z-index: 1;
                                                           border-right: 2px solid #999; }
table.report td:first-child { text-align: left; font-weight: 600; }
table.report tbody tr:nth-child(even) td { background: #fafafa; }
table.report td strong { color: #000; }
p.variance { font-size: 0.85em; color: #333; max-width: 60em; }
p.caption { font-size: 0.85em; color: #555; max-width: 60em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; }
table.env td, table.env td:first-child { white-space: normal; text-align: left; font-weight: normal; }
table.env td:first-child { font-family: monospace; }
"""


_BOLD = re.compile(r"\*\*(.+?)\*\*")


def _html_table(df: pd.DataFrame, classes: str | list[str] = "report") -> str:
    """``df`` as an HTML table inside a horizontally scrolling ``div.scroll`` (the first column
    stays in view, the headers wrap: the page fits its window); every cell escaped, and a
    Markdown-bold cell (:func:`mark_best`) as ``<strong>``."""
    cells = df.map(lambda v: _BOLD.sub(r"<strong>\1</strong>", html.escape(str(v))))
    cells.columns = [html.escape(str(c)) for c in df.columns]
    table = cells.to_html(index=False, escape=False, classes=classes, border=0)
    return f'<div class="scroll">\n{table}\n</div>'


def _html_note(text: str) -> str:
    return f'<p class="variance">{html.escape(text)}</p>'


def render_html(runs: list[Run], title: str = "", images: Iterable[tuple[str, str, str]] = (),
                paper: tuple[str, str, dict] | None = None, reference: str | None = None) -> str:
    """A self-contained HTML page (inline CSS, images as data URIs).

    images: ``(caption, mime type, base64 data)`` for each figure to embed; paper, reference: as
    :func:`render_markdown`.
    """
    t = html.escape(title or "medpfl report")
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{t}</title>",
             f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{t}</h1>"]
    sections = _paired_sections(runs, reference)
    for (ds, part), methods in groups(runs).items():
        group_runs = [r for rs in methods.values() for r in rs]
        note, pnote = _html_note(variance_note(group_runs)), _html_note(variance_note(group_runs, paired=True))
        parts += [f"<h2>{html.escape(str(ds))} / {html.escape(str(part))}</h2>",
                  f"<h3>{html.escape(TABLE1_TITLE)}</h3>", f"<p>{html.escape(TABLE1_LEAD)}</p>",
                  _html_table(table1(methods)), note,
                  f'<p class="caption">{html.escape(TABLE1_CAPTION)}</p>',
                  f"<h3>{html.escape(PLAIN_TITLE)}</h3>", _html_table(plain := plain_table(methods)), note,
                  f'<p class="caption">{html.escape(plain_caption(plain))}</p>']
        ct, cref = cost_table(methods, reference if reference in methods else None)
        parts += [f"<h3>{html.escape(COST_TITLE)}</h3>", _html_table(ct),
                  f'<p class="caption">{html.escape(COST_CAPTION.format(reference=cref))}</p>']
        heading, pt, caption = sections[(ds, part)]
        parts += [f"<h3>{html.escape(heading)}</h3>",
                  _html_table(pt) + pnote if pt is not None else "<p>No other method to compare.</p>",
                  f'<p class="caption">{html.escape(caption)}</p>']
        group = f"{ds} / {part}"
        if paper and group in paper[2]:
            parts += [f"<h3>{html.escape(paper[0])}</h3>", f'<p class="caption">{html.escape(paper[1])}</p>']
            for label, t in paper[2][group]:
                parts += [f"<h4>{html.escape(label)}</h4>", _html_table(t)]
    parts += [f"<h2>{WALL_TITLE}</h2>", _html_table(wall_table(runs)),
              f'<p class="caption">{html.escape(WALL_CAPTION)}</p>']
    parts += [f"<h2>{ENV_TITLE}</h2>",
              _html_table(environment_table(runs), classes=["report", "env"]),
              f'<p class="caption">{html.escape(ENV_CAPTION)}</p>']
    images = list(images)
    if images:
        parts.append("<h2>Figures</h2>")
    for caption, mime, data in images:
        c = html.escape(caption)
        parts.append(f'<figure><img alt="{c}" src="data:{mime};base64,{data}"><figcaption>{c}</figcaption></figure>')
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)
