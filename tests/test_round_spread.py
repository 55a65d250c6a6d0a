"""scripts/round_spread.py: the per-run spread of the paper's per-round metric that docs/studies.md
(pFedKD-WCL) quotes, on records whose values are known by construction."""

import runpy
import sys

import numpy as np
import pandas as pd
import pytest

from helpers import REPO

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
