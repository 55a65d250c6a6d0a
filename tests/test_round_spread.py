"""scripts/round_spread.py: the per-run spread of the paper's per-round metric that docs/studies.md
(pFedKD-WCL) quotes, on records whose values are known by construction."""

import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import REPO
from medpfl.report.paper import PaperTable

SCRIPT = REPO / "scripts" / "round_spread.py"


def _records(rounds: int, personalized: bool) -> pd.DataFrame:
    """Two clients per round; on the deployed view client 0 scores r/100 and client 1 scores
    (r + 2)/100 in round r (mean (r + 1) %). A personalized run also scores its global model on
    the local splits, at 0 (so reading that view would show); a global-only run has no
    personalized view."""
    rows = []
    for r in range(1, rounds + 1):
        for c, acc in ((0, r / 100), (1, (r + 2) / 100)):
            if personalized:
                rows.append({"round": r, "client": c, "view": "personalized_on_local", "accuracy": acc})
                rows.append({"round": r, "client": c, "view": "global_on_local", "accuracy": 0.0})
            else:
                rows.append({"round": r, "client": c, "view": "global_on_local", "accuracy": acc})
    return pd.DataFrame(rows)


def test_spread_reads_the_deployed_view_and_the_last_rounds():
    spread = runpy.run_path(str(SCRIPT))["spread"]
    s = spread(_records(60, personalized=True), last=50)
    tail = np.arange(11, 61) + 1.0  # rounds 11..60, mean accuracy r + 1 (%)
    assert s["final"] == pytest.approx(61.0)
    assert s["last10"] == pytest.approx(np.mean(np.arange(51, 61) + 1.0))  # 56.5
    assert s["last50 mean"] == pytest.approx(tail.mean())
    assert s["last50 std"] == pytest.approx(tail.std(ddof=1))
    assert (s["last50 min"], s["last50 max"]) == (pytest.approx(12.0), pytest.approx(61.0))
    # A run without a personalized view is scored on the global model's view.
    g = spread(_records(60, personalized=False), last=50)
    assert g["final"] == pytest.approx(61.0)


def test_main_lists_every_run_with_its_deployed_view(tmp_path, monkeypatch, capsys):
    for method, personalized in (("pfedme-mlr", True), ("fedavg-mlr", False)):
        run = tmp_path / "runs" / "mnist" / "a0.05-n20" / method / "seed1"
        run.mkdir(parents=True)
        _records(20, personalized).to_parquet(run / "records.parquet")
    monkeypatch.setattr(sys, "argv", ["round_spread.py", str(tmp_path), "--last", "5"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert "last5 std" in lines[0]
    body = {ln.split()[2]: ln.split() for ln in lines[1:]}
    assert set(body) == {"pfedme-mlr", "fedavg-mlr"}
    for cols in body.values():
        assert cols[4] == "21.0"  # final round 20: mean of 20 % and 22 %, from the deployed view


def test_main_names_a_folder_without_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["round_spread.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no runs"):
        runpy.run_path(str(SCRIPT), run_name="__main__")


def test_archive_runs_are_read_and_runs_win(tmp_path):
    """run_records: archive/ and runs/, the same run in both read from runs/, a checkpoint-only
    archived run left out."""
    run_records = runpy.run_path(str(SCRIPT))["run_records"]
    for part, seed in (("archive", 1), ("archive", 2), ("runs", 2), ("runs", 3)):
        d = tmp_path / part / "ds" / "p" / "m" / f"seed{seed}"
        d.mkdir(parents=True)
        _records(3, False).to_parquet(d / "records.parquet")
    ckpt = tmp_path / "archive" / "ds" / "p" / "m" / "seed4"
    ckpt.mkdir(parents=True)
    (ckpt / "checkpoint.pt.gz").write_bytes(b"")
    found = run_records(tmp_path)
    assert sorted(k[3] for k in found) == ["seed1", "seed2", "seed3"]
    assert found[("ds", "p", "m", "seed2")].parts[-6] == "runs"
    assert found[("ds", "p", "m", "seed1")].parts[-6] == "archive"


def test_seed_summary_gives_the_reports_interval_and_paper_verdict():
    summary = runpy.run_path(str(SCRIPT))["seed_summary"]
    runs = pd.DataFrame({"dataset": "d", "partition": "p",
                         "method": ["a", "a", "a", "b"], "seed": ["seed10", "seed2", "seed1", "seed1"],
                         "final": [84.0, 80.0, 82.0, 50.0]})
    paper = PaperTable("T", "S", {"final_client_acc_mean": {}},
                       {"d": {"a": {"final_client_acc_mean": (0.85, 0.001)}, "b": {"final_client_acc_mean": (0.5, None)}}},
                       Path("t.yaml"), percent=True)
    out = summary(runs, paper).set_index("method")
    # seeds in numeric order (1, 2, 10): 82, 80, 84; mean 82, sd 2, t(0.975, 2) = 4.3027
    assert out.loc["a", "finals"] == "82.00 80.00 84.00"
    half = 4.302652729911275 * 2 / np.sqrt(3)
    assert out.loc["a", "mean"] == pytest.approx(82.0)
    assert (out.loc["a", "low"], out.loc["a", "high"]) == (pytest.approx(82 - half), pytest.approx(82 + half))
    assert out.loc["a", "diff"] == pytest.approx(-3.0)
    assert out.loc["a", "paper_in_ci"] == "yes"  # 85 < 82 + 4.97
    assert out.loc["b", "paper_in_ci"] == "—"  # one seed: no interval
    assert np.isnan(out.loc["b", "low"])
    paper.values["d"] = {"a": {"final_client_acc_mean": (0.88, 0.001)}}
    out = summary(runs, paper).set_index("method")
    assert out.loc["a", "paper_in_ci"] == "no"
    assert np.isnan(out.loc["b", "paper"])
    # a partition-keyed value wins over the data set's, as in the report; a reading takes its row's
    paper.values["d/p"] = {"a": {"final_client_acc_mean": (0.80, 0.001)}}
    out = summary(runs.assign(method=["a", "a", "a", "v"]), paper, {"v": "a"}).set_index("method")
    assert out.loc["a", "diff"] == pytest.approx(2.0) and out.loc["v", "paper"] == pytest.approx(80.0)


def _archive_two_seeds(results: Path) -> None:
    """Archived records of pfedme-mlr and pfedme-code-mlr, seeds 1 and 2, under ``results``: the
    personalized view ends at 21 % on seed 1 and 23 % on seed 2."""
    for method in ("pfedme-mlr", "pfedme-code-mlr"):
        for seed in (1, 2):
            run = results / "archive" / "ds" / "p" / method / f"seed{seed}"
            run.mkdir(parents=True)
            rec = _records(20, True)
            rec["accuracy"] += 0.02 * (seed - 1) * (rec["view"] == "personalized_on_local")
            rec.to_parquet(run / "records.parquet")


def test_main_compares_a_variant_with_its_rows_paper_value(tmp_path, monkeypatch, capsys):
    _archive_two_seeds(tmp_path)
    paper = tmp_path / "paper.yaml"
    paper.write_text("title: t\nsource: s\npercent: true\nmetrics:\n  final_client_acc_mean: {label: A}\n"
                     "values:\n  ds:\n    pfedme-mlr: {final_client_acc_mean: [0.21, 0.01]}\n")
    argv = ["round_spread.py", str(tmp_path), "--seeds", "--paper-table", str(paper)]
    monkeypatch.setattr(sys, "argv", argv + ["--compare", "pfedme-code-mlr=pfedme-mlr"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    summary = out.split("final round over seeds")[1].splitlines()
    rows = {ln.split()[2]: ln.split() for ln in summary[2:]}
    # both methods: final 21 % (seed 1) and 23 % (seed 2), mean 22, 95 % interval 22 ± 12.71;
    # the variant gets the row's paper value, 21 %: inside, diff +1
    for method in ("pfedme-mlr", "pfedme-code-mlr"):
        assert rows[method][-6:] == ["22.0", "9.29", "34.71", "21.0", "1.0", "yes"]
    monkeypatch.setattr(sys, "argv", argv + ["--compare", "pfedme-code-mlr=fedavg-mlr"])
    with pytest.raises(SystemExit, match="has no final_client_acc_mean for 'fedavg-mlr'"):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    monkeypatch.setattr(sys, "argv", ["round_spread.py", str(tmp_path), "--compare", "pfedme-code-mlr=pfedme-mlr"])
    with pytest.raises(SystemExit, match="--compare needs --paper-table"):
        runpy.run_path(str(SCRIPT), run_name="__main__")


def test_main_takes_the_paper_tables_readings(tmp_path, monkeypatch, capsys):
    """Without --compare, a ``readings`` entry of the paper table sets the variant beside its row's
    paper value; without the entry the variant has none."""
    _archive_two_seeds(tmp_path)
    base = ("title: t\nsource: s\npercent: true\nmetrics:\n  final_client_acc_mean: {label: A}\n"
            "values:\n  ds:\n    pfedme-mlr: {final_client_acc_mean: [0.21, 0.01]}\n")

    def summary(text: str) -> dict[str, list[str]]:
        paper = tmp_path / "paper.yaml"
        paper.write_text(text)
        monkeypatch.setattr(sys, "argv", ["round_spread.py", str(tmp_path), "--seeds", "--paper-table", str(paper)])
        runpy.run_path(str(SCRIPT), run_name="__main__")
        lines = capsys.readouterr().out.split("final round over seeds")[1].splitlines()
        return {ln.split()[2]: ln.split() for ln in lines[2:]}

    assert summary(base + "readings: {pfedme-code-mlr: pfedme-mlr}\n")["pfedme-code-mlr"][-3:] == ["21.0", "1.0", "yes"]
    assert summary(base)["pfedme-code-mlr"][-3:] == ["NaN", "NaN", "—"]
