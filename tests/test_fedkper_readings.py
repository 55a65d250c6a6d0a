"""scripts/fedkper_readings.py: the other readings of FedKPer Table 1's columns that docs/studies.md
quotes, on records whose values are known by construction."""

import runpy

import pandas as pd
import pytest

from helpers import REPO

SCRIPT = REPO / "scripts" / "fedkper_readings.py"


def _records() -> pd.DataFrame:
    """3 rounds, 4 clients, clients (0, 1), (2, 3), (1, 2) sampled in that training order.

    local_after_training: balanced a, plain a + 0.1; personalized_on_local: every client, 0.5 for
    the sampled ones and 0.0 for the others (so a reading that does not keep the sampled clients
    shows); global_on_local: every client, 0.2 sampled / 0.9 not; global_test: 0.6, 0.3, 0.5."""
    local = {0: [(0, 0.8), (1, 0.6)], 1: [(2, 0.9), (3, 0.7)], 2: [(1, 0.5), (2, 0.7)]}
    rows = []
    for r, pairs in local.items():
        sampled = {c for c, _ in pairs}
        for c, a in pairs:
            rows.append({"round": r, "view": "local_after_training", "client_id": c, "accuracy": a + 0.1,
                         "balanced_accuracy": a})
        for c in range(4):
            rows.append({"round": r, "view": "personalized_on_local", "client_id": c,
                         "accuracy": 1.0, "balanced_accuracy": 0.5 if c in sampled else 0.0})
            rows.append({"round": r, "view": "global_on_local", "client_id": c,
                         "accuracy": 1.0, "balanced_accuracy": 0.2 if c in sampled else 0.9})
        rows.append({"round": r, "view": "global_test", "client_id": -1, "accuracy": [0.6, 0.3, 0.5][r],
                     "balanced_accuracy": 0.0})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(SCRIPT))


def test_local_readings_average_the_sampled_clients_per_round(script):
    out = script["readings"](_records())
    # per-round means 0.7, 0.8, 0.6; minima 0.6, 0.7, 0.5
    assert out["avg_local_acc:spec"] == pytest.approx(0.7)
    assert out["avg_worst_client_acc:spec"] == pytest.approx(0.6)
    assert out["avg_local_acc:plain"] == pytest.approx(0.8)
    assert out["avg_worst_client_acc:plain"] == pytest.approx(0.7)
    assert out["avg_local_acc:deployed"] == pytest.approx(0.5)  # the non-sampled clients' 0.0 left out
    assert out["avg_local_acc:global"] == pytest.approx(0.2)  # the non-sampled clients' 0.9 left out
    # every client's personalized model: per round 2 x 0.5 + 2 x 0.0 over 4 clients; minimum 0.0
    assert out["avg_local_acc:all_clients"] == pytest.approx(0.25)
    assert out["avg_worst_client_acc:all_clients"] == pytest.approx(0.0)
    # without personalized models, every client's global model: (2 x 0.2 + 2 x 0.9) / 4 = 0.55
    glob = script["readings"](_records().query("view != 'personalized_on_local'"))
    assert glob["avg_local_acc:all_clients"] == pytest.approx(0.55)
    assert glob["avg_worst_client_acc:all_clients"] == pytest.approx(0.2)


def test_consistency_readings_follow_eq_7_on_each_trajectory(script):
    out = script["readings"](_records())
    # spec: mean curve 0.7, 0.8, 0.6 rises, then drops and never recovers: no interval, C = 1
    assert out["local_consistency:spec"] == pytest.approx(1.0)
    # with the tail: the drop 0.8 -> 0.6 is one round, without an intermediate round, so still none
    assert out["local_consistency:tail"] == pytest.approx(1.0)
    # rows: 0.8, 0.6, 0.9, 0.7, 0.5, 0.7; peak 0.8 recovers at 0.9 (i=0, j=2):
    # IPFR = (0 + 0.2 + 0.1) / 0.8 / 2 = 0.1875; peak 0.9 never recovers
    assert out["local_consistency:rows"] == pytest.approx(1 - 0.1875)
    # global 0.6, 0.3, 0.5: no recovery; with the tail: (0 + 0.3 + 0.1) / 0.6 / 2
    assert out["global_consistency:spec"] == pytest.approx(1.0)
    assert out["global_consistency:tail"] == pytest.approx(1 - 0.4 / 0.6 / 2)


def test_a_run_without_a_view_gives_nan_and_the_table_averages_seeds(script, tmp_path):
    rec = _records()
    no_pers = rec[rec["view"] != "personalized_on_local"]
    assert pd.isna(script["readings"](no_pers)["avg_local_acc:deployed"])
    for seed, frame in ((1, rec), (2, no_pers)):
        d = tmp_path / "ds" / "part" / "m" / f"seed{seed}"
        d.mkdir(parents=True)
        frame.to_parquet(d / "records.parquet")
    table = script["per_method"](script["study_readings"](tmp_path))
    row = table.iloc[0]
    assert row["seeds"] == 2
    assert row["avg_local_acc:spec"] == pytest.approx(0.7)
    assert row["avg_local_acc:deployed"] == pytest.approx(0.5)  # the seed that has it


def test_main_fails_clearly_on_a_folder_without_runs(script, tmp_path):
    with pytest.raises(SystemExit, match="no \\*/\\*/\\*/seed\\*/records.parquet"):
        script["main"]([str(tmp_path)])


def test_framework_reading_and_the_paper_comparison(script, tmp_path):
    """The framework reading takes spec for the authors' own methods and plain for the ported ones;
    the comparison gives ours - paper per method and the rank agreement per reading."""
    table = pd.DataFrame({
        "dataset": ["d"] * 4, "partition": ["p"] * 4, "method": ["fedavg", "fedkper", "ditto", "fedala"],
        "seeds": [3] * 4,
        "avg_local_acc:spec": [0.70, 0.80, 0.60, 0.75], "avg_local_acc:plain": [0.90, 0.95, 0.85, 0.88],
        "avg_worst_client_acc:spec": [0.5, 0.6, 0.4, 0.55], "avg_worst_client_acc:plain": [0.6, 0.7, 0.5, 0.65],
    })
    mixed = script["add_framework_reading"](table)
    assert list(mixed["avg_local_acc:framework"]) == [0.70, 0.80, 0.85, 0.88]
    assert list(mixed["avg_worst_client_acc:framework"]) == [0.5, 0.6, 0.5, 0.65]
    paper = tmp_path / "paper.yaml"
    cells = {"fedavg": 0.72, "fedkper": 0.86, "ditto": 0.80, "fedala": 0.90}
    paper.write_text(
        "title: t\nsource: s\nmetrics:\n  avg_local_acc: {label: L}\nvalues:\n  d:\n"
        + "".join(f"    {m}: {{avg_local_acc: [{v}, 0.1]}}\n" for m, v in cells.items()))
    diffs, agree = script["against_paper"](mixed, paper, "d")
    fw = diffs[(diffs["column"] == "avg_local_acc") & (diffs["reading"] == "framework")].set_index("method")
    assert fw.loc["ditto", "diff"] == pytest.approx(0.05)
    assert fw.loc["fedkper", "diff"] == pytest.approx(-0.06)
    row = agree[(agree["column"] == "avg_local_acc") & (agree["reading"] == "framework")].iloc[0]
    assert row["methods"] == 4
    assert row["mean_abs_diff"] == pytest.approx((0.02 + 0.06 + 0.05 + 0.02) / 4)
    assert row["within_0.05"] == 3  # 0.02, 0.05 and 0.02; not 0.06
    assert row["spearman_rho"] == pytest.approx(0.8)  # ranks: ours 1, 2, 3, 4; paper 1, 3, 2, 4
    assert diffs[diffs["column"] == "avg_worst_client_acc"].empty  # the paper table has no such cells
    with pytest.raises(SystemExit, match="no values for data set 'x'"):
        script["against_paper"](mixed, paper, "x")
