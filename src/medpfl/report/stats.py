"""Confidence intervals over seeds and paired comparisons against a reference method.

Every number in the report's tables is a mean over seeds. With two or more seeds it comes with a
95 % Student t confidence interval for that mean, computed from the per-seed values::

    mean ± t_{0.975, n-1} · s / √n          s: sample std over seeds (ddof=1), n: seeds with a value

(``scipy.stats.t.interval`` with ``scale = scipy.stats.sem``). With one seed there is no
interval, and the report says so ("1 seed: no interval").

A paired comparison of a method against the reference method uses the seeds both have a value
for (the same seed means the same partition and, for the engine's seeded parts, the same
initialisation and batch order): the per-seed differences ``d_s = method_s − reference_s``, their
mean, and the t interval of that mean (the same formula on the ``d_s``; equal to
``scipy.stats.ttest_rel(method, reference).confidence_interval()``). The difference is called
clear when the interval excludes 0. With one shared seed: the difference, and no interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import pandas as pd
from scipy import stats

from medpfl.errors import ParamsError

#: Confidence level of every interval in the report.
CONFIDENCE = 0.95
#: How the report writes it ("95 %").
CI_LEVEL = f"{CONFIDENCE * 100:g} %"
#: Per-seed values whose sample std is at most this times max(1, |mean|) count as equal (float noise).
EQUAL_RTOL = 1e-12
#: What the report says where a number rests on a single seed.
NO_INTERVAL = "1 seed: no interval"
NOT_APPLICABLE = "not applicable"
NO_SHARED_SEED = "no shared seed"

#: The metrics compared with the reference method: (summary key, label).
PAIRED_METRICS = (
    ("final_global_acc", "Final Global Acc"),
    ("avg_global_acc", "Avg Global Acc"),
    ("avg_local_acc", "Avg Local Acc"),
    ("avg_worst_client_acc", "Avg Worst Client Acc"),
    ("final_client_acc_worst", "Final worst client acc"),
    ("final_client_acc_mean", "Final mean client acc"),
    ("final_client_acc_pooled", "Final pooled client acc"),
    ("balance", "Balance"),
)

PAIRED_COLUMNS = ("dataset", "partition", "reference", "method", "metric", "label", "n_shared_seeds", "shared_seeds",
                  "mean_method", "mean_reference", "mean_diff", "ci_low", "ci_high", "confidence", "excludes_zero",
                  "p_value", "note")


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and its t confidence interval (``low``/``high`` None when ``n < 2``)."""

    mean: float
    n: int
    low: float | None = None
    high: float | None = None

    @property
    def half_width(self) -> float | None:
        return None if self.high is None else self.high - self.mean

    @property
    def excludes_zero(self) -> bool | None:
        return None if self.low is None else bool(self.low > 0 or self.high < 0)


def finite(values: Iterable) -> np.ndarray:
    """The finite values (None, NaN and inf dropped) as float64."""
    out = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return np.array(out, dtype=np.float64)


def t_interval(values: Iterable, confidence: float = CONFIDENCE) -> Interval | None:
    """Mean and Student t confidence interval of the values (ddof=1, n − 1 degrees of freedom).

    None without a finite value; no interval (``low = high = None``) with one value; a zero-width
    interval when all values are equal up to float noise (:data:`EQUAL_RTOL`;
    ``scipy.stats.t.interval`` needs a positive scale)."""
    v = finite(values)
    n = len(v)
    if n == 0:
        return None
    mean = float(v.mean())
    if n < 2:
        return Interval(mean, 1)
    if float(v.std(ddof=1)) <= EQUAL_RTOL * max(1.0, abs(mean)):
        return Interval(mean, n, mean, mean)
    sem = float(stats.sem(v))  # std(ddof=1) / sqrt(n)
    low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
    return Interval(mean, n, float(low), float(high))


def resolve_reference(methods: list[str], reference: str | None = None) -> str:
    """The reference method: ``reference`` when it is one of ``methods``, else ``fedavg`` when
    present, else the first method. A ``reference`` that is not among the methods is an error
    (:class:`medpfl.errors.ParamsError`, a ``ValueError``, naming ``report.reference``)."""
    if not methods:
        raise ParamsError("report.reference: no methods to compare")
    if reference is not None:
        if reference not in methods:
            raise ParamsError(f"report.reference: {reference!r} is not one of the methods {list(methods)}")
        return reference
    return "fedavg" if "fedavg" in methods else methods[0]


def paired_difference(method: Mapping[int, float | None], reference: Mapping[int, float | None],
                      confidence: float = CONFIDENCE) -> dict:
    """Paired comparison of per-seed values ``{seed: value}`` of a method and the reference.

    Returns ``n_shared_seeds``, ``shared_seeds``, ``mean_method``, ``mean_reference`` (over the
    shared seeds), ``mean_diff``, ``ci_low``, ``ci_high``, ``excludes_zero``, ``p_value``
    (two-sided paired t-test, ``scipy.stats.ttest_rel``) and ``note`` ("" or why something is
    missing: not applicable, no shared seed, 1 seed: no interval)."""
    a = {s: v for s, v in method.items() if len(finite([v]))}
    b = {s: v for s, v in reference.items() if len(finite([v]))}
    out = {"n_shared_seeds": 0, "shared_seeds": "", "mean_method": None, "mean_reference": None, "mean_diff": None,
           "ci_low": None, "ci_high": None, "confidence": confidence, "excludes_zero": None, "p_value": None,
           "note": ""}
    if not a or not b:
        out["note"] = NOT_APPLICABLE
        return out
    shared = sorted(set(a) & set(b))
    if not shared:
        out["note"] = NO_SHARED_SEED
        return out
    x = np.array([float(a[s]) for s in shared])
    y = np.array([float(b[s]) for s in shared])
    iv = t_interval(x - y, confidence)
    out.update(n_shared_seeds=len(shared), shared_seeds=" ".join(str(s) for s in shared),
               mean_method=float(x.mean()), mean_reference=float(y.mean()), mean_diff=iv.mean,
               ci_low=iv.low, ci_high=iv.high, excludes_zero=iv.excludes_zero)
    if iv.n < 2:
        out["note"] = NO_INTERVAL
    elif iv.low != iv.high:
        out["p_value"] = float(stats.ttest_rel(x, y).pvalue)
    return out


def paired_frame(groups: Mapping[tuple[str, str], Mapping[str, Mapping[int, Mapping[str, float | None]]]],
                 reference: str | None = None) -> tuple[pd.DataFrame, dict[tuple[str, str], str]]:
    """Paired comparisons of every method with the reference, per (dataset, partition) group.

    groups: ``{(dataset, partition): {method: {seed: summary}}}``. The reference is resolved per
    group with :func:`resolve_reference` on the group's methods (an explicit reference missing from
    a group falls back as if none were given). Returns the long table (columns
    :data:`PAIRED_COLUMNS`, one row per group, method other than the reference and metric of
    :data:`PAIRED_METRICS`) and ``{group: reference used}``."""
    rows, used = [], {}
    for (ds, part), methods in groups.items():
        names = list(methods)
        ref = resolve_reference(names, reference if reference in names else None)
        used[(ds, part)] = ref
        for m in names:
            if m == ref:
                continue
            for key, label in PAIRED_METRICS:
                d = paired_difference({s: r.get(key) for s, r in methods[m].items()},
                                      {s: r.get(key) for s, r in methods[ref].items()})
                rows.append({"dataset": ds, "partition": part, "reference": ref, "method": m, "metric": key,
                             "label": label, **d})
    return pd.DataFrame(rows, columns=list(PAIRED_COLUMNS)), used
