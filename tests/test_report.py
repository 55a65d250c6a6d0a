"""Tests of the report stage on small synthetic run folders (CPU, fast)."""

from __future__ import annotations

import re

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from scipy import stats

from medpfl.report import build_report
from medpfl.report.tables import SUMMARY_KEYS

ROUND_COLS = ["round", "global_test_acc", "global_test_bal_acc", "global_test_loss", "global_on_local_mean",
              "global_on_local_worst", "bwt", "local_bal_acc_mean", "local_bal_acc_worst", "local_acc_mean",
              "local_acc_worst", "personalized_acc_mean", "personalized_acc_worst", "bytes_up", "bytes_down",
              "train_seconds", "eval_seconds", "round_seconds", "cum_seconds"]
GLOBAL_KEYS = ("avg_global_acc", "avg_global_acc_std_rounds", "final_global_acc", "final_global_bal_acc",
               "avg_global_bwt", "avg_global_bwt_std_rounds", "global_consistency", "balance")
ROUNDS = 5


def _summary(method: str, seed: int) -> dict:
    """Distinct, hand-chosen values per (method, seed) so that seed means and stds are checkable."""
    base = {"fedavg": 0.40, "fedkper": 0.60, "local": 0.50}[method] + 0.02 * seed
    s = {k: round(base + 0.001 * i, 6) for i, k in enumerate(SUMMARY_KEYS)}
    s["avg_global_acc"] = round(base, 6)
    s["avg_global_acc_std_rounds"] = round(0.10 + 0.01 * seed, 6)
    s["avg_global_bwt"] = round(-0.2 + 0.01 * seed, 6)
    s["avg_global_bwt_std_rounds"] = round(0.05 * seed, 6)
    s["global_consistency"] = round(0.70 + 0.03 * seed, 6)
    s["avg_local_acc"] = round(base + 0.3, 6)
    s["avg_local_acc_std_rounds"] = round(0.12 + 0.02 * seed, 6)
    s["avg_worst_client_acc"] = round(0.55 + 0.05 * seed, 6)
    s["local_consistency"] = round(0.80 - 0.01 * seed, 6)
    s["balance"] = round((s["avg_global_acc"] + s["avg_local_acc"]) / 2, 6)
    s["mb_per_round"] = round(1.5 * seed, 6)
    s["rounds"], s["num_clients"], s["last_round"] = ROUNDS, 4, ROUNDS - 1
    s["clients_never_trained"] = seed if method == "fedavg" else 0  # differs between fedavg's seeds
    # the final worst client: fedavg's differs between seeds; fedkper's is client 7 with 34 test
    # samples, tied with two more clients at seed 2; local's is client 0
    s["final_client_acc_worst_client"] = {"fedavg": seed + 2, "fedkper": 7, "local": 0}[method]
    s["final_client_acc_worst_test_size"] = {"fedavg": 30 + seed, "fedkper": 34, "local": 12}[method]
    s["final_client_acc_worst_ties"] = 3 if (method, seed) == ("fedkper", 2) else 1
    if method == "local":
        for k in GLOBAL_KEYS:
            s[k] = None
    return s


def _write_run(root: Path, method: str, seed: int, dataset: str = "bloodmnist", partition: str = "dir0.1") -> Path:
    d = root / dataset / partition / method / f"seed{seed}"
    d.mkdir(parents=True)
    summary = _summary(method, seed)
    meta = {"study": "test", "dataset": dataset, "partition": partition, "method": method,
            "algorithm": method.upper(), "seed": seed, "mlflow_run_id": None, "summary": summary}
    (d / "metrics.json").write_text(json.dumps(meta))
    rng = np.random.default_rng([seed, len(method)])
    df = pd.DataFrame({c: rng.uniform(0.2, 0.9, ROUNDS) for c in ROUND_COLS})
    df["round"] = np.arange(ROUNDS)
    if method == "local":
        for c in ("global_test_acc", "global_test_bal_acc", "global_test_loss", "global_on_local_mean",
                  "global_on_local_worst", "bwt"):
            df[c] = np.nan
    elif method == "fedkper":
        df.loc[[1, 3], "global_test_acc"] = np.nan  # evaluated every other round
    df.to_csv(d / "round_metrics.csv", index=False)
    return d


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    root = tmp_path / "runs"
    return [_write_run(root, m, s) for m in ("fedavg", "fedkper", "local") for s in (1, 2)]


def _rows(md: str, heading: str) -> dict[str, list[str]]:
    """First column -> the other cells of the first table after ``### <heading>`` in table.md."""
    block = re.split(r"\n#+ ", md.split(f"### {heading}")[1])[0]  # up to the next heading of any level
    rows = {}
    for line in block.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            # bold (the best of a column) is left out here and tested in test_best_value_per_column_is_bold
            cells = [c.strip().removeprefix("**").removesuffix("**") for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _table1_rows(md: str) -> dict[str, list[str]]:
    """Strategy -> cells of the Table 1 block in table.md (seeds, rounds, then the metric columns)."""
    return _rows(md, "Table 1 (FedKPer paper convention)")


def _ci(values, nd: int = 3) -> str:
    """``mean ± half-width`` of the 95 % t interval over seeds (ddof=1), as the report prints it."""
    v = np.asarray(values, dtype=float)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return f"{v.mean():.{nd}f} ± {half:.{nd}f}"


#: Table 1 cells after seeds and rounds: (value key, key of the std over rounds beside it or None).
T1 = (("avg_global_acc", "avg_global_acc_std_rounds"), ("avg_global_bwt", "avg_global_bwt_std_rounds"),
      ("global_consistency", None), ("avg_local_acc", "avg_local_acc_std_rounds"),
      ("avg_worst_client_acc", None), ("local_consistency", None), ("balance", None))


def _t1_index(key: str) -> int:
    """Index of a value key's cell in a :func:`_table1_rows` row."""
    i = 2
    for k, r in T1:
        if k == key:
            return i
        i += 2 if r else 1
    raise KeyError(key)


def _png_ok(data: bytes) -> bool:
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    length, = struct.unpack(">I", data[8:12])
    chunk = data[12:16 + length]
    return chunk[:4] == b"IHDR" and struct.unpack(">I", data[16 + length:20 + length])[0] == zlib.crc32(chunk)


def test_build_report_writes_all_files(runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    paths = build_report(runs, out, title="Test study")
    assert set(paths) == {"summary_csv", "table_md", "table_html", "curves_png", "summary_json", "paired_csv"}
    for p in paths.values():
        assert Path(p).is_file() and Path(p).parent == out
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left behind


def test_table1_paper_convention(runs: list[Path], tmp_path: Path) -> None:
    paths = build_report(runs, tmp_path / "report")
    md = paths["table_md"].read_text(encoding="utf-8")
    header = ("| Strategy | seeds | rounds | Avg Global Acc ↑ | Avg Global Acc: std over rounds (paper's ±) "
              "| Avg Global BwT ↑ | Avg Global BwT: std over rounds (paper's ±) | Avg Global Consistency ↑ "
              "| Avg Local Acc ↑ | Avg Local Acc: std over rounds (paper's ±) "
              "| Avg Worst Client Acc ↑ | Avg Local Consistency ↑ | Balance ↑ |")
    assert " ".join(header.split()) in " ".join(md.split())
    assert "### Table 1 (FedKPer paper convention)\n\nMean ± 95 % CI over seeds in every value column" in md
    rows = _table1_rows(md)
    assert list(rows) == ["Strategy", "fedavg", "fedkper", "local"]  # order of first appearance

    for method in ("fedavg", "fedkper"):
        s = [_summary(method, seed) for seed in (1, 2)]
        cells = rows[method]
        assert cells[:2] == ["2", str(ROUNDS)]  # seeds and rounds behind the row
        # every value: mean over seeds ± half-width of the 95 % t interval over seeds
        for key, rounds_key in T1:
            i = _t1_index(key)
            assert cells[i] == _ci([x[key] for x in s]), (method, key)
            if rounds_key:  # beside it, the paper's ±: the mean over seeds of the std over rounds
                assert cells[i + 1] == f"{np.mean([x[rounds_key] for x in s]):.3f}", (method, rounds_key)
    # Spot check by hand for fedavg: seeds give 0.42/0.44 (s = 0.01414, sem = 0.01, t(0.975, 1) = 12.706)
    # and std over rounds 0.11/0.12.
    assert rows["fedavg"][2:4] == ["0.430 ± 0.127", "0.115"]
    assert rows["fedavg"][_t1_index("global_consistency")] == "0.745 ± 0.191"  # 0.73 / 0.76

    local = rows["local"]
    for key in ("avg_global_acc", "avg_global_bwt", "global_consistency", "balance"):
        assert local[_t1_index(key)] == "—"
    assert local[3] == local[5] == "—"  # no std over rounds of a global accuracy either
    assert "±" in local[_t1_index("avg_local_acc")]
    assert "class-balanced accuracy" in md and "std over rounds" in md and "95 % Student t confidence interval" in md
    assert "std over seeds (population" not in md


def test_single_seed_says_no_interval(tmp_path: Path) -> None:
    d = _write_run(tmp_path / "runs", "fedavg", 1)
    md = build_report([d], tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    cells = _table1_rows(md)["fedavg"]
    s = _summary("fedavg", 1)
    assert cells[:2] == ["1", str(ROUNDS)]
    assert cells[2] == f"{s['avg_global_acc']:.3f} (1 seed: no interval)"
    assert cells[3] == f"{s['avg_global_acc_std_rounds']:.3f}"  # the paper's ± stays, labelled as std over rounds
    assert cells[_t1_index("global_consistency")] == f"{s['global_consistency']:.3f} (1 seed: no interval)"
    assert "±" not in " ".join(cells)
    plain = _rows(md, "Plain summary")["fedavg"]
    assert plain[2] == f"{s['final_global_acc']:.3f} (1 seed: no interval)"
    assert "1 seed: no interval" in md.split("### Plain summary")[1]  # the caption says it too


def test_plain_table(runs: list[Path], tmp_path: Path) -> None:
    md = build_report(runs, tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    assert "### Plain summary (mean ± 95 % CI over seeds)" in md
    rows = _rows(md, "Plain summary")
    assert rows["Strategy"][:3] == ["seeds", "rounds", "Final Global Acc ↑"]
    cells = rows["fedavg"]
    s = [_summary("fedavg", seed) for seed in (1, 2)]
    assert cells[:2] == ["2", str(ROUNDS)]
    assert cells[2] == _ci([x["final_global_acc"] for x in s])
    mb = rows["Strategy"].index("MB per round ↓")
    assert cells[mb] == _ci([x["mb_per_round"] for x in s], nd=2)
    assert cells[mb] == "2.25 ± 9.53"  # 1.5 / 3.0: sem 0.75 x t(0.975, 1) 12.706
    assert rows["local"][2] == "—"
    # the FHBench-protocol column is shown because these runs have a value for it
    assert "Test acc at best-val round (FHBench protocol) ↑" in rows["Strategy"]
    # clients no round trained, of K = 4: a range where the seeds differ
    never = rows["Strategy"].index("Clients never trained")
    assert cells[never] == "1–2 of 4" and rows["fedkper"][never] == "0 of 4"
    assert "Clients never trained: how many of the K clients" in md


def test_cost_table_and_conditional_columns(runs: list[Path], tmp_path: Path) -> None:
    """The cost table gives the parameter counts, MB up/down and the ratio to the reference;
    the best-val column disappears from the plain table when no run has validation splits."""
    md = build_report(runs, tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    cost = _rows(md, "Cost: parameters")
    head = cost["Strategy"]
    s1, s2 = _summary("fedkper", 1), _summary("fedkper", 2)
    ratio = ((s1["mb_per_round"] + s2["mb_per_round"]) / 2) / ((1.5 + 3.0) / 2)
    assert cost["fedkper"][head.index("MB per round vs fedavg")] == f"{ratio:.3f}"
    assert cost["fedavg"][head.index("MB per round vs fedavg")] == "1.000"
    up = (s1["mb_up_per_round"] + s2["mb_up_per_round"]) / 2
    assert cost["fedkper"][head.index("MB up per round")] == f"{up:.3f}"
    comp = (s1["compression_ratio"] + s2["compression_ratio"]) / 2  # uploads over their dense size
    assert cost["fedkper"][head.index("Upload / dense")] == f"{comp:.4f}"
    for run in runs:  # no validation splits anywhere: the column goes
        m = json.loads((run / "metrics.json").read_text())
        m["summary"]["best_val_client_acc"] = None
        (run / "metrics.json").write_text(json.dumps(m))
    md2 = build_report(runs, tmp_path / "report2")["table_md"].read_text(encoding="utf-8")
    assert "FHBench protocol" not in "".join(_rows(md2, "Plain summary")["Strategy"])


def test_summary_csv_and_json(runs: list[Path], tmp_path: Path) -> None:
    paths = build_report(runs, tmp_path / "report")
    df = pd.read_csv(paths["summary_csv"])
    assert len(df) == len(runs) == 6
    assert list(df.columns[:7]) == ["study", "dataset", "partition", "method", "algorithm", "seed", "mlflow_run_id"]
    assert set(SUMMARY_KEYS) <= set(df.columns)
    row = df[(df["method"] == "fedkper") & (df["seed"] == 2)].iloc[0]
    assert row["avg_global_acc"] == pytest.approx(_summary("fedkper", 2)["avg_global_acc"])
    assert df.loc[df["method"] == "local", "avg_global_acc"].isna().all()

    js = json.loads(paths["summary_json"].read_text())
    fk = js["bloodmnist"]["dir0.1"]["fedkper"]
    assert set(fk) == {"avg_global_acc", "avg_global_bwt", "global_consistency", "avg_local_acc",
                       "avg_worst_client_acc", "local_consistency", "balance", "final_global_acc",
                       "final_client_acc_worst", "mb_per_round"}
    for key, value in fk.items():
        assert value == pytest.approx(np.mean([_summary("fedkper", seed)[key] for seed in (1, 2)]))
    loc = js["bloodmnist"]["dir0.1"]["local"]
    assert loc["avg_global_acc"] is None and loc["balance"] is None
    assert loc["avg_local_acc"] == pytest.approx(np.mean([_summary("local", s)["avg_local_acc"] for s in (1, 2)]))


def test_figures_and_html(runs: list[Path], tmp_path: Path) -> None:
    part_fig = tmp_path / "partition.png"
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.bar([0, 1], [1, 2])
    fig.savefig(part_fig)
    plt.close(fig)

    paths = build_report(runs, tmp_path / "report", partition_figures=[part_fig], title="My <study>")
    png = paths["curves_png"].read_bytes()
    assert png.startswith(b"\x89PNG") and _png_ok(png)
    page = paths["table_html"].read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2  # curves + the partition figure
    assert "Table 1 (FedKPer paper convention)" in page and "Avg Global Acc ↑" in page
    assert "Plain summary (mean ± 95 % CI over seeds)" in page and "Paired comparison vs fedavg" in page
    assert "My &lt;study&gt;" in page and "<style>" in page
    assert "http://" not in page and "https://" not in page and 'src="data:' in page
    assert "<td>—</td>" in page  # null global metrics of "local"


def test_two_groups(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    dirs = [_write_run(root, "fedavg", 1), _write_run(root, "fedavg", 1, partition="iid"),
            _write_run(root, "local", 1, dataset="organsmnist")]
    paths = build_report(dirs, tmp_path / "report")
    md = paths["table_md"].read_text(encoding="utf-8")
    assert md.index("## bloodmnist / dir0.1") < md.index("## bloodmnist / iid") < md.index("## organsmnist / dir0.1")
    js = json.loads(paths["summary_json"].read_text())
    assert set(js["bloodmnist"]) == {"dir0.1", "iid"} and set(js["organsmnist"]["dir0.1"]) == {"local"}
    assert _png_ok(paths["curves_png"].read_bytes())


def test_wall_time_per_group_and_in_all(tmp_path: Path) -> None:
    """The Wall time table sums the runs' wall_seconds per (dataset, partition) and over all runs,
    in hours, with the longest run in minutes; a group whose runs report none shows the null mark."""
    from medpfl.report.tables import NULL, load_runs, wall_table

    root = tmp_path / "runs"
    dirs = [_write_run(root, "fedavg", 1), _write_run(root, "fedkper", 1), _write_run(root, "fedavg", 1, partition="iid"),
            _write_run(root, "local", 1, dataset="organsmnist")]
    walls = [3600.0, 5400.0, 900.0, None]
    for d, w in zip(dirs, walls):
        m = json.loads((d / "metrics.json").read_text())
        m["summary"]["wall_seconds"] = w
        (d / "metrics.json").write_text(json.dumps(m))
    t = wall_table(load_runs(dirs)).set_index("data set / partition")
    assert list(t.index) == ["bloodmnist / dir0.1", "bloodmnist / iid", "organsmnist / dir0.1", "all runs"]
    assert t.loc["bloodmnist / dir0.1"].tolist() == ["2", "2.50", "90.0"]
    assert t.loc["bloodmnist / iid"].tolist() == ["1", "0.25", "15.0"]
    assert t.loc["organsmnist / dir0.1"].tolist() == ["1", NULL, NULL]
    assert t.loc["all runs"].tolist() == ["4", "2.75", "90.0"]
    paths = build_report(dirs, tmp_path / "report")
    md = paths["table_md"].read_text(encoding="utf-8")
    assert "## Wall time" in md and "| all runs " in md and md.index("## Wall time") < md.index("## Environment")
    assert "<h2>Wall time</h2>" in paths["table_html"].read_text(encoding="utf-8")


def test_errors(runs: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="report: no runs given"):
        build_report([], tmp_path / "report")

    (runs[0] / "metrics.json").unlink()
    with pytest.raises(FileNotFoundError, match=str(runs[0] / "metrics.json").replace("\\", "\\\\")):
        build_report(runs, tmp_path / "report")
    assert not (tmp_path / "report" / "summary.csv").exists()

    (runs[1] / "round_metrics.csv").unlink()
    with pytest.raises(FileNotFoundError, match="round_metrics.csv"):
        build_report(runs[1:], tmp_path / "report")

    (runs[2] / "round_metrics.csv").write_text("")
    with pytest.raises(ValueError, match=f"{runs[2]}.*round_metrics.csv"):
        build_report(runs[2:], tmp_path / "report")

    (runs[3] / "metrics.json").write_text("{not json")
    with pytest.raises(ValueError, match="metrics.json"):
        build_report(runs[3:], tmp_path / "report")

    dup = runs[4]
    with pytest.raises(ValueError, match="same run"):
        build_report([dup, dup], tmp_path / "report")

    with pytest.raises(FileNotFoundError, match="nope.png"):
        build_report(runs[4:], tmp_path / "report", partition_figures=[tmp_path / "nope.png"])


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "round_metrics.csv").write_text(""), "round_metrics.csv: unreadable CSV file"),
    (lambda d: (d / "metrics.json").write_text("{not json"), "metrics.json: not valid JSON"),
    (lambda d: (d / "metrics.json").write_text("[]"), "metrics.json: expected a JSON object"),
    (lambda d: (d / "round_metrics.csv").write_text("round\n0\n"), "round_metrics.csv: missing columns"),
])
def test_medpfl_report_on_a_damaged_run_exits_2_in_one_line(runs: list[Path], tmp_path: Path, capsys, damage,
                                                             match) -> None:
    """``medpfl report`` names the damaged file in one error line (no traceback), exits 2 and
    writes no report."""
    from medpfl.cli import main

    damage(runs[1])
    out = tmp_path / "report"
    code = main(["report", "--runs", *map(str, runs[:2]), "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"medpfl report: error: {runs[1]}"), err
    assert match in lines[0] and "Traceback" not in err
    assert not out.exists()


def test_all_nan_seed_values_are_null(tmp_path: Path) -> None:
    # NaN in metrics.json (json.dumps writes it as non-standard NaN) must become null.
    d = _write_run(tmp_path / "runs", "fedavg", 1)
    meta = json.loads((d / "metrics.json").read_text())
    meta["summary"]["global_consistency"] = float("nan")
    (d / "metrics.json").write_text(json.dumps(meta))
    paths = build_report([d], tmp_path / "report")
    assert json.loads(paths["summary_json"].read_text())["bloodmnist"]["dir0.1"]["fedavg"]["global_consistency"] is None
    cells = _table1_rows(paths["table_md"].read_text(encoding="utf-8"))["fedavg"]
    assert cells[_t1_index("global_consistency")] == "—"


def test_best_value_per_column_is_bold(runs: list[Path], tmp_path: Path) -> None:
    """The best mean of a column with a direction is bold in table.md and <strong> in table.html;
    ties at the printed precision are all bold; no bold where all are equal or one has a value."""
    from medpfl.report.tables import mark_best

    t = pd.DataFrame({"Strategy": ["a", "b", "c"], "Acc ↑": ["0.50", "0.70", "0.70"], "MB ↓": ["3", "1", "2"],
                      "Count": ["1", "5", "9"], "Same ↑": ["1", "1", "1"], "Lone ↑": ["0.1", "—", "—"]})
    means = pd.DataFrame({"Acc ↑": [0.5, 0.7001, 0.6999], "MB ↓": [3.0, 1.0, 2.0], "Count": [1, 5, 9],
                          "Same ↑": [1.0, 1.0, 1.0], "Lone ↑": [0.1, None, None]})
    out = mark_best(t, means, {"Acc ↑": 3, "MB ↓": 0, "Count": 0, "Same ↑": 0, "Lone ↑": 1})
    assert out["Acc ↑"].tolist() == ["0.50", "**0.70**", "**0.70**"]  # 0.700 and 0.700 as printed
    assert out["MB ↓"].tolist() == ["3", "**1**", "2"]
    assert out["Count"].tolist() == t["Count"].tolist()  # no direction: never marked
    assert out["Same ↑"].tolist() == t["Same ↑"].tolist() and out["Lone ↑"].tolist() == t["Lone ↑"].tolist()

    paths = build_report(runs, tmp_path / "report")
    md = paths["table_md"].read_text(encoding="utf-8")
    t1 = md.split("### Table 1")[1].split("###")[0]
    # fedkper has the highest Avg Global Acc (0.63 vs fedavg's 0.43; local has none)
    fk = next(line for line in t1.splitlines() if line.startswith("| fedkper"))
    fa = next(line for line in t1.splitlines() if line.startswith("| fedavg"))
    assert f"**{_ci([_summary('fedkper', s)['avg_global_acc'] for s in (1, 2)])}**" in fk
    assert "**" not in fa.split("|")[4]
    # MB per round is equal for every method: nothing bold in that column
    plain = md.split("### Plain summary")[1].split("###")[0].splitlines()
    head = [c.strip() for c in plain[2].strip("|").split("|")]
    mb = head.index("MB per round ↓")
    assert not any("**" in line.strip("|").split("|")[mb] for line in plain[4:] if line.startswith("| "))
    page = paths["table_html"].read_text(encoding="utf-8")
    assert f"<strong>{_ci([_summary('fedkper', s)['avg_global_acc'] for s in (1, 2)])}</strong>" in page
    assert "**" not in page


def test_worst_client_named(runs: list[Path], tmp_path: Path) -> None:
    """The plain table names the final worst client beside its accuracy: id and local test size,
    one per seed where seeds differ, and how many clients tie."""
    md = build_report(runs, tmp_path / "report")["table_md"].read_text(encoding="utf-8")
    rows = _rows(md, "Plain summary")
    head = rows["Strategy"]
    i = head.index("Final worst client: id (local test samples)")
    assert head[i - 1] == "Final worst client acc (all clients) ↑"  # right beside the accuracy
    assert rows["fedavg"][i] == "3 (31) / 4 (32)"  # seeds 1 and 2 name different clients
    assert rows["fedkper"][i] == "7 (34), up to 3 tied"
    assert rows["local"][i] == "0 (12)"
    for run in runs:  # runs evaluated before the keys existed: no column
        m = json.loads((run / "metrics.json").read_text())
        for k in ("final_client_acc_worst_client", "final_client_acc_worst_test_size", "final_client_acc_worst_ties"):
            m["summary"].pop(k)
        (run / "metrics.json").write_text(json.dumps(m))
    md2 = build_report(runs, tmp_path / "report2")["table_md"].read_text(encoding="utf-8")
    assert "Final worst client: id (local test samples)" not in _rows(md2, "Plain summary")["Strategy"]


def _write_job(run: Path, sampling: dict | None) -> None:
    train = {"rounds": ROUNDS} if sampling is None else {"rounds": ROUNDS, "sampling": sampling}
    (run / "job.json").write_text(json.dumps({"method": run.parent.name, "train": train}))


def test_variance_sentence_follows_the_runs_sampling(runs: list[Path], tmp_path: Path) -> None:
    """Under each interval table, one sentence names the sources of variance the intervals cover,
    read from the runs' job.json train.sampling."""
    def notes(out: str) -> list[str]:
        md = build_report(runs, tmp_path / out)["table_md"].read_text(encoding="utf-8")
        return [line for line in md.splitlines() if line.startswith("Sources of variance")]

    for r in runs:
        _write_job(r, {"scheme": "seed_round", "seed": None})
    got = notes("seeded")
    assert len(got) == 3  # Table 1, plain summary, paired comparison
    assert all("client sampling (train.sampling.scheme seed_round" in n and "do not cover the partition" in n
               for n in got)
    assert "same clients" in got[2]  # the paired sentence says pairing shares the schedule

    for r in runs:
        _write_job(r, {"scheme": "round_seeded", "seed": None})
    got = notes("fixed")
    assert all("cover the training seed's model initialisation and clients' batch order. They do not cover client "
               "sampling (train.sampling.scheme round_seeded" in n for n in got)

    for r in runs:  # a job.json from before train.sampling existed: the old default, round_seeded
        _write_job(r, None)
    assert "do not cover client sampling (train.sampling.scheme round_seeded" in notes("old")[0]

    _write_job(runs[0], {"scheme": "stream", "seed": None})  # fedavg seed 1 differs: mixed
    assert "fedavg: the client schedule varies with the seed (stream)" in notes("mixed")[0]

    for r in runs:
        (r / "job.json").unlink()
    assert "not recorded (no job.json" in notes("unknown")[0]

    (runs[0] / "job.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"job\.json: expected a JSON object"):
        build_report(runs, tmp_path / "bad")


def test_html_tables_scroll_with_a_fixed_first_column(runs: list[Path], tmp_path: Path) -> None:
    """Every table of table.html sits in a horizontally scrolling block whose first column stays
    in view, with wrapping headers, and the page is at most 1500 px wide (a 1,600 px window)."""
    page = build_report(runs, tmp_path / "report")["table_html"].read_text(encoding="utf-8")
    tables = page.count("<table")
    assert tables >= 5 and page.count('<div class="scroll">\n<table') == tables
    css = page.split("<style>")[1].split("</style>")[0]
    assert re.search(r"div\.scroll \{[^}]*overflow-x: auto", css)
    assert re.search(r"th:first-child \{[^}]*position: sticky; left: 0", css)
    assert re.search(r"table\.report th \{[^}]*white-space: normal", css)
    assert re.search(r"body \{[^}]*max-width: 1500px", css)


def _chromium() -> str | None:
    import shutil

    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_html_page_fits_a_1600_px_window_in_a_browser(runs: list[Path], tmp_path: Path) -> None:
    """Laid out by a real browser (headless Chromium, where installed): the page is no wider than
    a 1,600 px window, and a table wider than its block scrolls inside it with the method column
    still in view."""
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium to lay the page out")
    page_path = build_report(runs, tmp_path / "report")["table_html"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(page_path.as_uri())
            assert page.evaluate("document.documentElement.scrollWidth") <= 1600
            blocks = page.evaluate("[...document.querySelectorAll('div.scroll')].map(d => [d.clientWidth, d.scrollWidth])")
            assert blocks and all(client <= 1500 for client, _ in blocks)
            wide = [i for i, (client, scroll) in enumerate(blocks) if scroll > client]
            for i in wide:  # scrolled to its right end, the first column stays at the block's left edge
                left = page.evaluate(
                    "i => { const d = document.querySelectorAll('div.scroll')[i]; d.scrollLeft = d.scrollWidth; "
                    "const c = d.querySelector('tbody td'); "
                    "return [c.getBoundingClientRect().left, d.getBoundingClientRect().left, d.scrollLeft]; }", i)
                assert left[2] > 0  # it did scroll
                assert abs(left[0] - left[1]) <= 1
        finally:
            browser.close()
