"""The side-by-side with a paper's table (report.paper_table): loading the table, our value vs the
paper's, the differences, both rankings, the rank agreement, and the files and sections the
report gains."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from medpfl.cli import main
from medpfl.report import build_report
from medpfl.report.paper import PaperTable, PaperTableError, compare, comparison_tables, load_paper_table, rank_agreement
from tests.test_report import _summary, _write_run

REPO = Path(__file__).resolve().parents[1]


def _paper(tmp_path: Path, values: dict) -> Path:
    p = tmp_path / "paper.yaml"
    p.write_text(yaml.safe_dump({
        "title": "Test table", "source": "A. Author, Venue 2026, Table 1",
        "metrics": {"avg_global_acc": {"label": "Avg Global Acc", "higher_is_better": True},
                    "avg_global_bwt": {"label": "Avg Global BwT", "higher_is_better": True}},
        "values": values}))
    return p


def test_the_repository_table_is_complete_and_matches_the_paper_text():
    t = load_paper_table(REPO / "config" / "papers" / "fedkper-table1.yaml")
    assert set(t.values) == {"bloodmnist", "organsmnist", "organcmnist"}
    for ds, methods in t.values.items():
        assert len(methods) == 12, ds
        for m, cells in methods.items():
            assert set(cells) == set(t.metrics), (ds, m)
            # Balance is (Avg Global Acc + Avg Local Acc) / 2 in every row of the paper
            g, loc, bal = cells["avg_global_acc"][0], cells["avg_local_acc"][0], cells["balance"][0]
            assert abs((g + loc) / 2 - bal) <= 0.0011, (ds, m)
    # spot checks against the paper text (Table 1 rows)
    assert t.values["bloodmnist"]["fedkper"]["avg_global_acc"] == (0.645, 0.188)
    assert t.values["organsmnist"]["fedcurv"]["local_consistency"] == (0.824, 0.0)
    assert t.values["organcmnist"]["fedkd"]["avg_global_bwt"] == (-0.179, 0.067)


def test_compare_gives_diffs_and_ranks():
    ours = {"ds / p": {"dataset": "ds", "methods": {"a": {"avg_global_acc": 0.5, "avg_global_bwt": -0.1},
                                                     "b": {"avg_global_acc": 0.7, "avg_global_bwt": None},
                                                     "c": {"avg_global_acc": 0.6, "avg_global_bwt": -0.3},
                                                     "x": {"avg_global_acc": 0.9, "avg_global_bwt": 0.0}}}}

    P = PaperTable("T", "S", {"avg_global_acc": {"label": "G", "higher_is_better": True},
                              "avg_global_bwt": {"label": "B", "higher_is_better": True}},
                   {"ds": {"a": {"avg_global_acc": (0.4, 0.1), "avg_global_bwt": (-0.2, 0.1)},
                           "b": {"avg_global_acc": (0.8, 0.1), "avg_global_bwt": (-0.1, 0.1)},
                           "c": {"avg_global_acc": (0.6, None), "avg_global_bwt": (-0.15, 0.1)}}}, Path("t.yaml"))

    df = compare(ours, P)
    assert set(df["method"]) == {"a", "b", "c"}  # "x" is not in the paper
    g = df[df["metric"] == "avg_global_acc"].set_index("method")
    assert g.loc["a", "diff"] == pytest.approx(0.1) and g.loc["b", "diff"] == pytest.approx(-0.1)
    assert g["rank_ours"].to_dict() == {"a": 3, "b": 1, "c": 2}
    assert g["rank_paper"].to_dict() == {"a": 3, "b": 1, "c": 2}
    b = df[df["metric"] == "avg_global_bwt"].set_index("method")
    assert b.loc["b", "ours"] is None or pd.isna(b.loc["b", "ours"])  # not applicable stays missing
    assert pd.isna(b.loc["b", "rank_ours"]) and pd.isna(b.loc["b", "rank_paper"])  # ranked among both only
    # ours: a (-0.1) beats c (-0.3); the paper: c (-0.15) beats a (-0.2): the orders disagree
    assert (b.loc["a", "rank_ours"], b.loc["c", "rank_ours"]) == (1, 2)
    assert (b.loc["a", "rank_paper"], b.loc["c", "rank_paper"]) == (2, 1)
    agree = rank_agreement(df).set_index("metric")
    assert agree.loc["avg_global_acc", "spearman_rho"] == pytest.approx(1.0)
    assert agree.loc["avg_global_acc", "mean_abs_diff"] == pytest.approx(0.2 / 3)
    assert agree.loc["avg_global_bwt", "methods"] == 2 and math.isnan(agree.loc["avg_global_bwt", "spearman_rho"])


def test_report_with_a_paper_table(tmp_path):
    root = tmp_path / "runs"
    dirs = [_write_run(root, m, s) for m in ("fedavg", "fedkper", "local") for s in (1, 2)]
    values = {"bloodmnist": {"fedavg": {"avg_global_acc": [0.409, 0.147], "avg_global_bwt": [-0.255, 0.113]},
                             "fedkper": {"avg_global_acc": [0.645, 0.188], "avg_global_bwt": [-0.127, 0.101]},
                             "local": {"avg_global_acc": [0.3, None], "avg_global_bwt": [-0.1, None]}}}
    paths = build_report(dirs, tmp_path / "report", paper_table=_paper(tmp_path, values))
    df = pd.read_csv(paths["paper_comparison_csv"])
    ours_fedavg = (_summary("fedavg", 1)["avg_global_acc"] + _summary("fedavg", 2)["avg_global_acc"]) / 2
    row = df[(df["method"] == "fedavg") & (df["metric"] == "avg_global_acc")].iloc[0]
    assert row["ours"] == pytest.approx(ours_fedavg) and row["paper"] == 0.409
    assert row["diff"] == pytest.approx(ours_fedavg - 0.409)
    local = df[(df["method"] == "local") & (df["metric"] == "avg_global_acc")].iloc[0]
    assert pd.isna(local["ours"]) and pd.isna(local["diff"])  # no global model: not applicable
    md = paths["table_md"].read_text()
    assert "Side by side with the paper: Test table" in md and "A. Author, Venue 2026" in md
    assert "Rank agreement" in md and ("+0." in md or "-0." in md)
    assert "Side by side" in paths["table_html"].read_text()
    assert pd.read_csv(paths["paper_agreement_csv"])["methods"].tolist() == [2, 2]


GOOD = "title: t\nsource: s\nmetrics: {a: {label: A}}\nvalues: {d: {m: {a: [0.5, null]}}}\n"
BAD_TABLES = [  # (file content or None for no file, what the one-line message must say)
    (None, "file not found"),
    ("title: t\nsource: [s\nmetrics: {}\n", "not valid YAML at line 3, column 8"),
    ("title: t\n  source: s\n", "not valid YAML at line 2"),
    ("- a list\n", "expected a mapping with the keys title, source, metrics, values, got list"),
    ("", "expected a mapping"),
    ("title: x\n", r"needs the keys .* \(missing: source, metrics, values\)"),
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {d: {m: {b: [1, 2]}}}\n", r"values\.d\.m\.b: not declared"),
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {d: {m: {a: 0.5}}}\n", r"values\.d\.m\.a: expected \[value"),
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {d: {m: {a: [1, 2, 3]}}}\n", r"values\.d\.m\.a: expected \[value"),
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {d: {m: {a: ['0.5', x]}}}\n", r"values\.d\.m\.a: expected \[val"),
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {d: [m]}\n", r"values\.d: .*dictionary"),
    ("title: t\nsource: s\nmetrics: {a: {higher_is_beter: true}}\nvalues: {}\n", r"metrics\.a\.higher_is_beter: unknown key"),
    ("title: t\nsource: s\nmetrics: {}\nvalues: {}\nblocks: {x: fedavg}\n", r"blocks\.x: .*list"),
    ("title: t\nsource: s\nmetrics: {}\nvalues: {}\npercent: maybe\n", r"percent: .*boolean"),
]


def _write(content: str | None, folder: Path) -> Path:
    """``folder/bad.yaml`` holding ``content`` (no file for None)."""
    p = folder / "bad.yaml"
    if content is not None:
        p.write_text(content)
    return p


def test_a_good_minimal_paper_table_loads(tmp_path):
    """The baseline the bad tables below differ from."""
    t = load_paper_table(_write(GOOD, tmp_path))
    assert t.values == {"d": {"m": {"a": (0.5, None)}}} and t.metrics == {"a": {"label": "A", "higher_is_better": True}}


@pytest.mark.parametrize("content,match", BAD_TABLES)
def test_bad_paper_tables_fail_naming_the_file_and_key(tmp_path, content, match):
    p = _write(content, tmp_path)
    with pytest.raises(PaperTableError, match=match) as e:
        load_paper_table(p)
    assert str(e.value).startswith(f"report.paper_table: {p}: ") and "\n" not in str(e.value)
    dirs = [_write_run(tmp_path / "runs", "fedavg", 1)]
    with pytest.raises(ValueError):
        build_report(dirs, tmp_path / "report", paper_table=p)
    assert not (tmp_path / "report").exists()  # nothing written before the inputs are known good


@pytest.mark.parametrize("content,match", [BAD_TABLES[i] for i in (0, 1, 7, 11)])
def test_medpfl_report_with_a_bad_paper_table_exits_2_in_one_line(tmp_path, capsys, content, match):
    """Missing, not YAML, a bad cell, an unknown key: ``medpfl report`` prints one error line
    naming the file (and key), no traceback, exit status 2, and writes no report."""
    p = _write(content, tmp_path)
    run = _write_run(tmp_path / "runs", "fedavg", 1)
    code = main(["report", "--runs", str(run), "--out-dir", str(tmp_path / "report"), "--paper-table", str(p)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"medpfl report: error: report.paper_table: {p}: "), err
    assert re.search(match, lines[0]) and "Traceback" not in err
    assert not (tmp_path / "report").exists()


def test_partition_keyed_values_blocks_and_percent():
    """A paper whose columns are our partitions (``<dataset>/<partition>`` keys) and which ranks
    methods within blocks (one per model): ranks, correlations and the percent display."""
    P = PaperTable("T", "S", {"acc": {"label": "Acc", "higher_is_better": True}},
                   {"ds/p1": {"a-x": {"acc": (0.9, 0.01)}, "b-x": {"acc": (0.8, 0.01)}, "c-x": {"acc": (0.7, 0.01)},
                              "a-y": {"acc": (0.95, 0.01)}, "b-y": {"acc": (0.5, 0.01)}},
                    "ds": {"a-x": {"acc": (0.1, None)}}},
                   Path("t.yaml"), blocks={"X": ["a-x", "b-x", "c-x"], "Y": ["a-y", "b-y"]}, percent=True)
    ours = {"ds / p1": {"dataset": "ds", "partition": "p1",
                        "methods": {"c-x": {"acc": 0.85}, "b-x": {"acc": 0.75}, "a-x": {"acc": 0.8},
                                    "b-y": {"acc": 0.6}, "a-y": {"acc": 0.55}}},
            "ds / p2": {"dataset": "ds", "partition": "p2", "methods": {"a-x": {"acc": 0.2}}}}
    df = compare(ours, P)
    g1 = df[df["group"] == "ds / p1"].set_index("method")
    assert list(g1.index) == ["a-x", "b-x", "c-x", "a-y", "b-y"]  # the paper's order
    assert g1["block"].to_dict() == {"a-x": "X", "b-x": "X", "c-x": "X", "a-y": "Y", "b-y": "Y"}
    assert g1["rank_ours"].to_dict() == {"c-x": 1, "a-x": 2, "b-x": 3, "b-y": 1, "a-y": 2}  # within each block
    assert g1["rank_paper"].to_dict() == {"a-x": 1, "b-x": 2, "c-x": 3, "a-y": 1, "b-y": 2}
    # p2 has no key of its own: the dataset's values apply
    assert df[df["group"] == "ds / p2"]["paper"].tolist() == [0.1]
    agree = rank_agreement(df)
    x = agree[(agree["group"] == "ds / p1") & (agree["block"] == "X")].iloc[0]
    assert x["methods"] == 3 and x["spearman_rho"] == pytest.approx(-0.5)
    y = agree[(agree["group"] == "ds / p1") & (agree["block"] == "Y")].iloc[0]
    assert y["methods"] == 2 and math.isnan(y["spearman_rho"])
    t = dict(comparison_tables(df, agree, percent=True)["ds / p1"])["Acc"].set_index("Method")
    assert t.loc["c-x", "ours"] == "85.00" and t.loc["c-x", "paper"] == "70.00 ± 1.00"
    assert t.loc["c-x", "ours − paper"] == "+15.00" and t.loc["a-y", "ours − paper"] == "-40.00"
    assert dict(comparison_tables(df, agree)["ds / p1"])["Acc"].set_index("Method").loc["c-x", "ours"] == "0.850"


@pytest.mark.parametrize("name", ["pfedkd-table1.yaml", "pfedkd-table2.yaml"])
def test_the_pfedkd_tables_match_the_spec(name):
    """Spot checks against the verbatim tables of methods-pfedkdwcl-epfl.md A.5, and the study's
    partitions and method variants as keys."""
    t = load_paper_table(REPO / "config" / "papers" / name)
    assert t.percent and set(t.blocks) == {"MLR", "MLP"}
    for key, methods in t.values.items():
        assert set(methods) == set(t.blocks["MLR"]) | set(t.blocks["MLP"]), key
    if name == "pfedkd-table1.yaml":
        assert set(t.values) == {f"mnist/{p}" for p in ("a0.5-top2-n20", "a0.5-top2-n50", "a0.05-n20", "a0.05-n50")}
        assert t.values["mnist/a0.05-n20"]["fedavg-mlr"]["final_client_acc_mean"] == (0.8105, 0.003)
        assert t.values["mnist/a0.05-n50"]["fedgkd-mlp"]["final_client_acc_mean"] == (0.9879, 0.0001)
        assert t.values["mnist/a0.5-top2-n50"]["pfedkdwcl-mlr"]["final_client_acc_mean"] == (0.9797, 0.0001)
    else:
        assert set(t.values) == {"synthetic_0.5_0.5"}
        assert t.values["synthetic_0.5_0.5"]["fedgkd-mlp"]["final_client_acc_mean"] == (0.2278, 0.0001)
        assert t.values["synthetic_0.5_0.5"]["pfedkdwcl-mlr"]["final_client_acc_mean"] == (0.8948, 0.0001)


def test_round_spread_on_a_hand_computed_case():
    """Mean over seeds of each run's mean over its last rounds with a value, the mean of their stds,
    and the lowest / highest round over all seeds; rows out of order, null and infinite rounds are handled."""
    from medpfl.report.paper import round_spread
    a = pd.DataFrame({"round": [3, 0, 1, 2], "acc": [0.9, math.inf, 0.5, None]})  # last 2 finite: 0.5, 0.9
    b = pd.DataFrame({"round": [0, 1, 2, 3], "acc": [0.2, 0.6, 0.7, 0.8]})   # last 2: 0.7, 0.8
    s = round_spread([a, b], "acc", 2)
    assert s.mean == pytest.approx((0.7 + 0.75) / 2)
    assert s.std == pytest.approx((math.sqrt(0.08) + math.sqrt(0.005)) / 2)  # ddof=1 of (0.5, 0.9), (0.7, 0.8)
    assert (s.low, s.high, s.rounds, s.seeds) == (0.5, 0.9, 2, 2)
    assert round_spread([a], "acc", 10).rounds == 2  # a shorter run: every finite round it has
    assert round_spread([a], "other", 2) is None and round_spread([a.assign(acc=None)], "acc", 2) is None
    with pytest.raises(ValueError, match="last must be >= 1"):
        round_spread([a], "acc", 0)


def test_the_side_by_side_shows_our_round_spread_and_whether_the_paper_lies_in_it(tmp_path):
    """A metric with per_round: the report adds our spread over the last rounds, computed from each
    run's round_metrics.csv, and says whether the paper's value lies inside it."""
    root = tmp_path / "runs"
    dirs = [_write_run(root, m, s) for m in ("fedavg", "fedkper") for s in (1, 2)]
    last = 3
    spread = {}
    for m in ("fedavg", "fedkper"):
        tails = [pd.read_csv(root / "bloodmnist" / "dir0.1" / m / f"seed{s}" / "round_metrics.csv")
                 .sort_values("round")["local_acc_mean"].iloc[-last:] for s in (1, 2)]
        spread[m] = (float(sum(t.mean() for t in tails) / 2), float(min(t.min() for t in tails)),
                     float(max(t.max() for t in tails)))
    inside = (spread["fedavg"][1] + spread["fedavg"][2]) / 2  # a paper value inside fedavg's range
    p = tmp_path / "paper.yaml"
    p.write_text(yaml.safe_dump({
        "title": "T", "source": "S", "last_rounds": last,
        "metrics": {"avg_local_acc": {"label": "Local", "per_round": "local_acc_mean"},
                    "avg_global_acc": {"label": "Global"}},
        "values": {"bloodmnist": {"fedavg": {"avg_local_acc": [inside, None], "avg_global_acc": [0.5, None]},
                                  "fedkper": {"avg_local_acc": [spread["fedkper"][2] + 0.01, None],
                                              "avg_global_acc": [0.5, None]}}}}))
    paths = build_report(dirs, tmp_path / "report", paper_table=p)
    df = pd.read_csv(paths["paper_comparison_csv"]).set_index(["method", "metric"])
    for m in ("fedavg", "fedkper"):
        row = df.loc[(m, "avg_local_acc")]
        assert (row["last_mean"], row["last_low"], row["last_high"]) == pytest.approx(spread[m])
        assert row["last_rounds"] == last
    assert bool(df.loc[("fedavg", "avg_local_acc"), "paper_in_last_range"])
    assert not bool(df.loc[("fedkper", "avg_local_acc"), "paper_in_last_range"])  # just above our highest round
    assert df.loc[("fedavg", "avg_global_acc"), ["last_mean", "paper_in_last_range"]].isna().all()  # no per_round
    md = paths["table_md"].read_text()
    header = f"ours, last {last} rounds: mean [min, max]"
    local = md.split("#### Local")[1].split("####")[0]
    assert header in local and "| paper in that range" in local and "| yes " in local and "| no " in local
    assert f"[{spread['fedavg'][1]:.3f}, {spread['fedavg'][2]:.3f}]" in local
    assert header not in md.split("#### Global")[1].split("####")[0]  # a metric without per_round: no column
    assert f"Ours, last {last} rounds" in md  # the caption says what the column is


@pytest.mark.parametrize("content, match", [
    ("title: t\nsource: s\nmetrics: {a: {}}\nvalues: {}\nlast_rounds: 0\n", r"last_rounds: .*greater than 0"),
    ("title: t\nsource: s\nmetrics: {a: {per_round: 3}}\nvalues: {}\n", r"metrics\.a\.per_round: .*string"),
])
def test_a_bad_round_spread_setting_names_its_key(tmp_path, content, match):
    with pytest.raises(PaperTableError, match=match):
        load_paper_table(_write(content, tmp_path))


def test_a_per_round_column_no_run_has_stops_the_report_naming_the_key(tmp_path):
    """A misspelt per_round would otherwise show "—" in every row; nothing is written."""
    dirs = [_write_run(tmp_path / "runs", "fedavg", 1)]
    p = tmp_path / "paper.yaml"
    p.write_text("title: t\nsource: s\nmetrics: {avg_local_acc: {per_round: local_acc_mea}}\n"
                 "values: {bloodmnist: {fedavg: {avg_local_acc: [0.5, null]}}}\n")
    with pytest.raises(PaperTableError, match=rf"report.paper_table: {re.escape(str(p))}: "
                                              r"metrics\.avg_local_acc\.per_round: 'local_acc_mea' is not a column"):
        build_report(dirs, tmp_path / "report", paper_table=p)
    assert not (tmp_path / "report").exists()


def test_the_side_by_side_says_whether_the_paper_lies_inside_our_seed_interval(tmp_path):
    """Three seeds (hand-made records): ours is the mean ± the half-width of its 95 % t interval over
    seeds, and "paper in ours' 95 % CI" says whether the paper's value lies inside it (yes for a
    value just inside the interval's end, no for one just outside); the rank agreement counts them.
    With one seed the report builds as before: no interval, no such column."""
    from scipy import stats as st

    root = tmp_path / "runs"
    dirs = [_write_run(root, m, s) for m in ("fedavg", "fedkper", "local") for s in (1, 2, 3)]
    iv = {}
    for m in ("fedavg", "fedkper", "local"):
        v = [_summary(m, s)["avg_local_acc"] for s in (1, 2, 3)]
        mean = sum(v) / 3
        half = float(st.t.ppf(0.975, 2) * st.sem(v))
        iv[m] = (mean, mean - half, mean + half)
    values = {"bloodmnist": {"fedavg": {"avg_local_acc": [iv["fedavg"][2] - 1e-6, None]},     # inside, at the end
                             "fedkper": {"avg_local_acc": [iv["fedkper"][1] - 1e-4, None]},   # just below
                             "local": {"avg_local_acc": [iv["local"][0], 0.01]}}}              # at our mean
    p = tmp_path / "paper.yaml"
    p.write_text(yaml.safe_dump({"title": "T", "source": "S", "metrics": {"avg_local_acc": {"label": "Local"}},
                                 "values": values}))
    paths = build_report(dirs, tmp_path / "report", paper_table=p)
    df = pd.read_csv(paths["paper_comparison_csv"]).set_index("method")
    for m in iv:
        assert (df.loc[m, "ours"], df.loc[m, "ours_ci_low"], df.loc[m, "ours_ci_high"]) == pytest.approx(iv[m])
        assert df.loc[m, "ours_seeds"] == 3
    assert df["paper_in_ci"].astype(bool).to_dict() == {"fedavg": True, "fedkper": False, "local": True}
    md = paths["table_md"].read_text()
    local = md.split("#### Local")[1].split("####")[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in local.splitlines() if line.startswith("| ") and "Method" not in line}
    header = [c.strip() for c in next(ln for ln in local.splitlines() if "| Method" in ln).split("|")[1:-1]]
    col = header.index("paper in ours' 95 % CI") - 1
    assert {m: rows[m][col] for m in iv} == {"fedavg": "yes", "fedkper": "no", "local": "yes"}
    assert rows["fedavg"][0] == f"{iv['fedavg'][0]:.3f} ± {iv['fedavg'][2] - iv['fedavg'][0]:.3f}"
    agreement = pd.read_csv(paths["paper_agreement_csv"]).iloc[0]
    assert (agreement["in_ci"], agreement["with_ci"]) == (2, 3)
    assert "| 2 of 3" in md.split("#### Rank agreement")[1]
    assert "Paper in ours' 95 % CI" in md  # the caption defines the column

    # one seed: the report builds as before, without intervals or the column
    one = build_report([d for d in dirs if d.name == "seed1"], tmp_path / "report1", paper_table=p)
    df1 = pd.read_csv(one["paper_comparison_csv"])
    assert df1["paper_in_ci"].isna().all() and df1["ours_ci_low"].isna().all()
    md1 = one["table_md"].read_text()
    assert "paper in ours'" not in md1 and "Paper in ours'" not in md1 and "1 seed: no interval" in md1


def test_a_reading_is_compared_with_its_paper_row_but_not_ranked():
    """``readings``: a study variant set beside the paper's value of the row it reads another way,
    in that row's block, without ranks, and left out of the rank agreement (hand-computed)."""
    P = PaperTable("T", "S", {"acc": {"label": "Acc", "higher_is_better": True}},
                   {"ds": {"a-x": {"acc": (0.9, 0.01)}, "b-x": {"acc": (0.8, 0.01)}, "c-x": {"acc": (0.7, 0.01)}}},
                   Path("t.yaml"), blocks={"X": ["a-x", "b-x", "c-x"]},
                   readings={"b-code-x": "b-x", "z-code-x": "a-x"})  # z-code-x: not in the study
    ours = {"ds / p": {"dataset": "ds", "methods": {"a-x": {"acc": 0.85}, "b-x": {"acc": 0.75}, "c-x": {"acc": 0.65},
                                                   "b-code-x": {"acc": 0.95}}}}
    with_reading = compare(ours, P)
    assert with_reading["method"].tolist() == ["a-x", "b-x", "c-x", "b-code-x"]
    r = with_reading.set_index("method").loc["b-code-x"]
    assert r["reading_of"] == "b-x" and r["block"] == "X" and r["paper"] == 0.8
    assert r["diff"] == pytest.approx(0.15) and pd.isna(r["rank_ours"]) and pd.isna(r["rank_paper"])
    # the paper rows rank as without the reading (0.95 would otherwise rank first)
    assert with_reading.set_index("method")["rank_ours"].dropna().to_dict() == {"a-x": 1, "b-x": 2, "c-x": 3}
    assert with_reading["reading_of"].iloc[:3].isna().all()
    without = compare({"ds / p": {**ours["ds / p"], "methods": {k: v for k, v in ours["ds / p"]["methods"].items()
                                                               if k != "b-code-x"}}}, P)
    pd.testing.assert_frame_equal(rank_agreement(with_reading), rank_agreement(without))
    t = dict(comparison_tables(with_reading, rank_agreement(with_reading), percent=True)["ds / p"])["Acc"]
    row = t.set_index("Method").loc["b-code-x (reading of b-x)"]
    assert (row["ours"], row["paper"], row["ours − paper"], row["rank ours"]) == ("95.00", "80.00 ± 1.00", "+15.00", "—")


@pytest.mark.parametrize("readings, match", [
    ("{m: m}", r"readings\.m: is a row of the paper's table itself"),
    ("{v: nope}", r"readings\.v: 'nope' is not a row of values \(m\)"),
    ("{v: [m]}", r"readings\.v: .*string"),
])
def test_a_bad_reading_names_its_key(tmp_path, readings, match):
    with pytest.raises(PaperTableError, match=match):
        load_paper_table(_write(GOOD + f"readings: {readings}\n", tmp_path))


def test_the_pfedkd_tables_readings_are_variants_of_their_studies():
    """Every reading of the pFedKD-WCL tables is a method variant of the study the table serves."""
    for table, study in (("pfedkd-table1.yaml", "pfedkd-mnist.yaml"), ("pfedkd-table2.yaml", "pfedkd-synthetic.yaml")):
        readings = load_paper_table(REPO / "config" / "papers" / table).readings
        methods = set(yaml.safe_load((REPO / "config" / study).read_text())["methods"])
        assert readings and set(readings) <= methods, (table, set(readings) - methods)
