"""Confidence intervals over seeds and paired comparisons with the reference method
(medpfl.report.stats, paired.csv, the report's tables, report.reference). Hand-computed cases."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats

from medpfl.cli import main
from medpfl.compose import validate_params
from medpfl.config import ParamsError
from medpfl.report import build_report
from medpfl.report.stats import (NO_INTERVAL, PAIRED_COLUMNS, PAIRED_METRICS, paired_difference, resolve_reference,
                                 t_interval)
from tests.test_report import _rows, _t1_index, _table1_rows, _write_run

REPO = Path(__file__).resolve().parents[1]

#: t_{0.975, 2}, the 97.5 % quantile of Student's t with 2 degrees of freedom, by hand: with 2 degrees
#: of freedom the quantile has the closed form t_p = (2p − 1) · sqrt(2 / (4p(1 − p))) (tables: 4.303).
T975_DF2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))


def _run(root: Path, method: str, seed: int, **values) -> Path:
    """A run folder as tests/test_report.py writes it, with some summary values replaced."""
    d = _write_run(root, method, seed)
    meta = json.loads((d / "metrics.json").read_text())
    meta["summary"].update(values)
    (d / "metrics.json").write_text(json.dumps(meta))
    return d


def test_the_t_quantile_is_the_textbook_one():
    assert stats.t.ppf(0.975, 2) == pytest.approx(T975_DF2, abs=1e-12)
    assert round(T975_DF2, 6) == 4.302653


def test_interval_of_three_seeds_by_hand():
    # 0.60, 0.70, 0.80: mean 0.70, s = 0.1 (ddof=1), sem = 0.1 / sqrt(3) = 0.057735,
    # half-width = 4.302653 x 0.057735 = 0.248414
    iv = t_interval([0.60, 0.70, 0.80])
    half = T975_DF2 * 0.1 / math.sqrt(3)
    assert half == pytest.approx(0.248414, abs=1e-6)
    assert iv.n == 3 and iv.mean == pytest.approx(0.70)
    assert iv.low == pytest.approx(0.70 - half, abs=1e-12) and iv.high == pytest.approx(0.70 + half, abs=1e-12)
    assert iv.half_width == pytest.approx(half, abs=1e-12)
    # nulls are dropped, not counted as seeds
    assert t_interval([0.60, None, 0.70, float("nan"), 0.80]) == iv


def test_one_value_has_no_interval_and_none_is_none():
    iv = t_interval([0.42])
    assert iv.mean == 0.42 and iv.n == 1 and iv.low is None and iv.high is None and iv.excludes_zero is None
    assert t_interval([None, float("nan")]) is None
    same = t_interval([0.5, 0.5, 0.5])  # equal values: a zero-width interval, not NaN
    assert (same.low, same.high) == (0.5, 0.5)


def test_three_seed_interval_in_both_tables(tmp_path):
    root = tmp_path / "runs"
    dirs = [_run(root, "fedavg", s, avg_global_acc=v, final_global_acc=v, avg_global_acc_std_rounds=0.1)
            for s, v in ((1, 0.60), (2, 0.70), (3, 0.80))]
    md = build_report(dirs, tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    t1 = _table1_rows(md)["fedavg"]
    assert t1[:2] == ["3", "5"]  # seeds, rounds
    assert t1[_t1_index("avg_global_acc")] == "0.700 ± 0.248"
    assert t1[_t1_index("avg_global_acc") + 1] == "0.100"  # the paper's ± (std over rounds), its own column
    assert _rows(md, "Plain summary")["fedavg"][2] == "0.700 ± 0.248"


def test_one_seed_wording_everywhere(tmp_path):
    root = tmp_path / "runs"
    dirs = [_write_run(root, "fedavg", 1), _write_run(root, "fedkper", 1)]
    paths = build_report(dirs, tmp_path / "report")
    md = paths["table_md"].read_text(encoding="utf-8")
    t1 = _rows(md, "Table 1 (FedKPer paper convention)")["fedkper"]
    plain = _rows(md, "Plain summary")["fedkper"]
    pair = _rows(md, "Paired comparison vs fedavg")["fedkper"]
    assert t1[2] == "0.620 (1 seed: no interval)" and t1[3] == "0.110"  # value; the paper's std over rounds
    assert plain[2] == "0.622 (1 seed: no interval)"
    assert pair[:2] == ["1", "+0.200 (1 seed: no interval)"]  # shared seeds; fedkper − fedavg on seed 1
    assert not any("±" in c for c in t1 + plain + pair)  # no interval is ever printed from one seed
    df = pd.read_csv(paths["paired_csv"])
    assert (df["note"] == NO_INTERVAL).all() and df["ci_low"].isna().all() and df["excludes_zero"].isna().all()
    assert "1 seed: no interval" in paths["table_html"].read_text(encoding="utf-8")


def test_some_seeds_without_a_value_are_counted(tmp_path):
    root = tmp_path / "runs"
    dirs = [_run(root, "fedavg", 1, global_consistency=0.7), _run(root, "fedavg", 2, global_consistency=None),
            _run(root, "fedavg", 3, global_consistency=0.8)]
    md = build_report(dirs, tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    half = stats.t.ppf(0.975, 1) * np.std([0.7, 0.8], ddof=1) / math.sqrt(2)
    assert _table1_rows(md)["fedavg"][_t1_index("global_consistency")] == f"0.750 ± {half:.3f} (2 of 3 seeds)"


# -- paired comparisons ------------------------------------------------------------------------
def test_paired_difference_that_excludes_zero():
    # differences 0.10, 0.12, 0.11: mean 0.11, s = 0.01, sem = 0.005774, half-width = 0.024841
    d = paired_difference({1: 0.50, 2: 0.62, 3: 0.71}, {1: 0.40, 2: 0.50, 3: 0.60})
    half = T975_DF2 * 0.01 / math.sqrt(3)
    assert d["n_shared_seeds"] == 3 and d["shared_seeds"] == "1 2 3"
    assert d["mean_diff"] == pytest.approx(0.11)
    assert d["ci_low"] == pytest.approx(0.11 - half, abs=1e-9) and d["ci_high"] == pytest.approx(0.11 + half, abs=1e-9)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((0.085159, 0.134841), abs=1e-6)
    assert d["excludes_zero"] is True and d["note"] == ""
    # the same as scipy's paired t-test interval
    ci = stats.ttest_rel([0.50, 0.62, 0.71], [0.40, 0.50, 0.60]).confidence_interval(0.95)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert 0 < d["p_value"] < 0.05


def test_paired_difference_that_includes_zero_and_pairs_by_seed():
    # differences (seed order) 0.05, -0.03, 0.01: mean 0.01, s = 0.04, half-width = 4.302653 x 0.04 / sqrt(3)
    method = {3: 0.61, 1: 0.55, 2: 0.47, 4: 0.99}  # seed 4 has no reference run: left out
    reference = {1: 0.50, 2: 0.50, 3: 0.60}
    d = paired_difference(method, reference)
    half = T975_DF2 * 0.04 / math.sqrt(3)
    assert d["n_shared_seeds"] == 3 and d["shared_seeds"] == "1 2 3"
    assert d["mean_diff"] == pytest.approx(0.01)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((0.01 - half, 0.01 + half))
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((-0.089365, 0.109365), abs=1e-6)
    assert d["excludes_zero"] is False and d["p_value"] > 0.05
    # means over the shared seeds only (seed 4 left out)
    assert d["mean_method"] == pytest.approx(1.63 / 3) and d["mean_reference"] == pytest.approx(1.6 / 3)


def test_paired_difference_edge_cases():
    one = paired_difference({1: 0.6, 2: 0.7}, {1: 0.5})
    assert one["n_shared_seeds"] == 1 and one["mean_diff"] == pytest.approx(0.1)
    assert one["ci_low"] is None and one["note"] == NO_INTERVAL and one["excludes_zero"] is None
    na = paired_difference({1: None, 2: None}, {1: 0.5, 2: 0.6})
    assert na["note"] == "not applicable" and na["mean_diff"] is None
    none = paired_difference({1: 0.6}, {2: 0.5})
    assert none["note"] == "no shared seed" and none["n_shared_seeds"] == 0


def test_paired_csv_and_section(tmp_path):
    root = tmp_path / "runs"
    ref = {1: 0.40, 2: 0.50, 3: 0.60}
    clear = {1: 0.50, 2: 0.62, 3: 0.71}  # +0.11 [+0.085, +0.135]
    unclear = {1: 0.45, 2: 0.47, 3: 0.61}  # +0.01 [-0.089, +0.109]
    dirs = []
    for seed in (3, 1, 2):  # pairing is by seed, not by order
        dirs.append(_run(root, "fedkper", seed, final_global_acc=clear[seed]))
        dirs.append(_run(root, "fedavg", seed, final_global_acc=ref[seed], final_client_acc_mean=ref[seed] + 0.1))
        dirs.append(_run(root, "local", seed, final_client_acc_mean=unclear[seed] + 0.1,
                         avg_local_acc=None if seed == 2 else 0.5))  # seed 2: no value
    paths = build_report(dirs, tmp_path / "report")
    df = pd.read_csv(paths["paired_csv"])
    assert list(df.columns) == list(PAIRED_COLUMNS)
    assert set(df["reference"]) == {"fedavg"} and set(df["method"]) == {"fedkper", "local"}
    assert set(df["metric"]) == {k for k, _ in PAIRED_METRICS}
    row = df[(df["method"] == "fedkper") & (df["metric"] == "final_global_acc")].iloc[0]
    assert row["mean_diff"] == pytest.approx(0.11) and bool(row["excludes_zero"])
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.085159, 0.134841), abs=1e-6)
    row = df[(df["method"] == "local") & (df["metric"] == "final_client_acc_mean")].iloc[0]
    assert row["mean_diff"] == pytest.approx(0.01) and not bool(row["excludes_zero"])
    loc = df[(df["method"] == "local") & (df["metric"] == "final_global_acc")].iloc[0]
    assert loc["note"] == "not applicable" and pd.isna(loc["mean_diff"])  # no global model

    md = paths["table_md"].read_text(encoding="utf-8")
    rows = _rows(md, "Paired comparison vs fedavg")
    assert rows["Method"][:3] == ["shared seeds", "Final Global Acc", "Avg Global Acc"]
    assert list(rows) == ["Method", "fedkper", "local"]  # the reference has no row of its own
    assert rows["fedkper"][:2] == ["3", "+0.110 [+0.085, +0.135], excludes 0"]
    labels = rows["Method"]
    assert rows["local"][labels.index("Final mean client acc")] == "+0.010 [-0.089, +0.109], includes 0"
    assert rows["local"][labels.index("Final Global Acc")] == "—"
    assert rows["local"][labels.index("Avg Local Acc")].endswith("(2 of 3 shared seeds)")
    assert df[(df["method"] == "local") & (df["metric"] == "avg_local_acc")]["shared_seeds"].item() == "1 3"
    assert "Paired comparison vs fedavg" in paths["table_html"].read_text(encoding="utf-8")


# -- the reference method ----------------------------------------------------------------------
def test_reference_fallback():
    assert resolve_reference(["fedkper", "fedavg", "local"]) == "fedavg"
    assert resolve_reference(["fedkper", "local"]) == "fedkper"  # no fedavg: the first method
    assert resolve_reference(["fedkper", "fedavg"], "fedkper") == "fedkper"
    with pytest.raises(ValueError, match="report.reference: 'nope' is not one of the methods"):
        resolve_reference(["fedkper", "fedavg"], "nope")


def test_reference_in_the_report(tmp_path):
    root = tmp_path / "runs"
    dirs = [_write_run(root, m, s) for m in ("local", "fedkper") for s in (1, 2)]
    md = build_report(dirs, tmp_path / "r1")["table_md"].read_text(encoding="utf-8")
    assert "### Paired comparison vs local" in md and "report.reference not set" in md  # no fedavg: the first
    paths = build_report(dirs, tmp_path / "r2", reference="fedkper")
    md = paths["table_md"].read_text(encoding="utf-8")
    assert "### Paired comparison vs fedkper" in md and "Reference: fedkper (report.reference)" in md
    assert set(pd.read_csv(paths["paired_csv"])["method"]) == {"local"}
    with pytest.raises(ValueError, match="report.reference: 'fedavg'"):
        build_report(dirs, tmp_path / "r3", reference="fedavg")
    assert not (tmp_path / "r3").exists()  # nothing written before the inputs are known good


def test_reference_through_the_cli(tmp_path, capsys):
    root = tmp_path / "runs"
    dirs = [str(_write_run(root, m, 1)) for m in ("fedavg", "fedkper")]
    out = tmp_path / "report"
    assert main(["report", "--runs", *dirs, "--out-dir", str(out), "--reference", "fedkper"]) == 0
    assert "### Paired comparison vs fedkper" in (out / "table.md").read_text(encoding="utf-8")
    assert (out / "paired.csv").is_file()
    assert main(["report", "--runs", *dirs, "--out-dir", str(out), "--reference", "nope"]) == 2
    assert "report.reference" in capsys.readouterr().err


def test_params_report_reference(tmp_path):
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    data = copy.deepcopy(base)
    data["methods"] = ["local", "fedkper"]
    assert validate_params(data).report_reference() == "local"  # no fedavg: the first method
    data["methods"] = ["local", "fedkper", "fedavg"]
    assert validate_params(data).report_reference() == "fedavg"
    data.setdefault("report", {})["reference"] = "fedkper"
    p = validate_params(data)
    assert p.report.reference == "fedkper" and p.report_reference() == "fedkper"
    data["report"]["reference"] = "fedprox"  # a registered method, but not one of this study's
    with pytest.raises(ParamsError) as e:
        validate_params(data, "test.yaml")
    msg = str(e.value)
    assert msg.startswith("test.yaml") and "report.reference" in msg and "'fedprox'" in msg
    data["report"]["reference"] = 3
    with pytest.raises(ParamsError, match="report.reference"):
        validate_params(data, "test.yaml")


def test_side_by_side_shows_our_interval(tmp_path):
    root = tmp_path / "runs"
    dirs = [_run(root, "fedavg", s, avg_global_acc=v) for s, v in ((1, 0.60), (2, 0.70), (3, 0.80))]
    dirs.append(_write_run(root, "fedkper", 1))
    paper = tmp_path / "paper.yaml"
    paper.write_text(yaml.safe_dump({
        "title": "T", "source": "S", "metrics": {"avg_global_acc": {"label": "Avg Global Acc"}},
        "values": {"bloodmnist": {"fedavg": {"avg_global_acc": [0.5, 0.1]},
                                  "fedkper": {"avg_global_acc": [0.6, 0.1]}}}}))
    paths = build_report(dirs, tmp_path / "report", paper_table=paper)
    df = pd.read_csv(paths["paper_comparison_csv"]).set_index("method")
    assert df.loc["fedavg", "ours_seeds"] == 3
    assert df.loc["fedavg", "ours_ci_high"] - 0.7 == pytest.approx(T975_DF2 * 0.1 / math.sqrt(3))
    assert pd.isna(df.loc["fedkper", "ours_ci_low"]) and df.loc["fedkper", "ours_seeds"] == 1
    md = paths["table_md"].read_text(encoding="utf-8")
    side = _rows(md, "Avg Global Acc")  # the side-by-side's "#### Avg Global Acc" table
    assert side["fedavg"][0] == "0.700 ± 0.248" and side["fedkper"][0].endswith(f"({NO_INTERVAL})")
    assert "95 % Student t confidence interval over seeds" in md.split("### Side by side")[1]
