"""The comparison on arrival, checked in a real browser: the links that ``medpfl ui`` prints,
opened in headless Chromium (Playwright) against a running MLflow server on a small trained
study, show the methods compared without a click (``scripts/mlflow_pages.py`` builds the study
and renders the pages; the same script makes the screenshots in ``docs/img/``)."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from medpfl.io import read_json
from medpfl.tracking import HEADLINE_METRICS, study_children

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _pages_module():
    spec = importlib.util.spec_from_file_location("mlflow_pages", REPO / "scripts" / "mlflow_pages.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mlflow_pages"] = mod
    spec.loader.exec_module(mod)
    return mod


pages_mod = _pages_module()


def _skip_reason() -> str | None:
    if pages_mod.chromium() is None:
        return "no Chromium on this machine (Debian's chromium; .ci/run installs it)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("ui-study")
    parent = pages_mod.build_demo_study(folder, methods=("fedavg", "local"), seeds=(1, 2), rounds=2)
    return parent


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_medpfl_ui_links_open_on_the_methods_compared(study):
    parent = read_json(study)
    methods = ["fedavg", "local"]
    port = pages_mod.free_port()
    with pages_mod.mlflow_server(parent["tracking_uri"], port) as base, pages_mod.browser() as page:
        urls = pages_mod.pages(study, base)
        # the first link: charts, one entry per method, no click
        text = pages_mod.open_page(page, urls["experiment"], tuple(f"Group: {m}" for m in methods), charts=True)
        assert "Methods compared: mean over seeds" in text
        assert "Per round: mean over seeds" in text
        charted = [k for k, _ in HEADLINE_METRICS if k in text]
        # every headline metric the runs have is a chart of the first section (epsilon: DP runs only)
        assert charted[:5] == ["avg_global_acc", "avg_local_acc", "avg_worst_client_acc", "final_client_acc_mean",
                               "final_client_acc_worst"]
        cards = pages_mod.chart_cards(page)
        legend = cards["avg_local_acc"].splitlines()
        assert {"fedavg", "local"} <= set(legend), legend  # one bar per method, named by method
        legend = cards["avg_global_acc"].splitlines()
        assert "fedavg" in legend and "local" not in legend  # Local has no global model: no bar
        # the seed runs are one click away: inside their method's group, named method first
        for m in methods:
            for s in (1, 2):
                assert f"{m} s{s} synth/dir1.0" in text
        # the table link: a row per method holding the mean over seeds, the headline metrics as columns
        text = pages_mod.open_page(page, urls["table"], tuple(f"Group: {m}" for m in methods))
        assert "avg_local_acc" in text and "final_client_acc_mean" in text
        # the study's parent run carries its summary
        text = pages_mod.open_page(page, urls["study_run"], ("mean over seeds",))
        assert "fedavg" in text and "local" in text and "Avg Local Acc" in text
        # MLflow's compare page: every seed run named method first
        text = pages_mod.open_page(page, urls["compare"], ("fedavg s1 synth/dir1.0",))
        assert all(f"{m} s{s} synth/dir1.0" in text for m in methods for s in (1, 2))
    assert _closed(port)  # the server this test started is gone


def test_the_demo_study_is_tracked_as_the_pipeline_tracks_a_study(study):
    parent = read_json(study)
    runs = study_children(parent)
    assert sorted(r.info.run_name for r in runs) == [f"{m} s{s} synth/dir1.0" for m in ("fedavg", "local") for s in (1, 2)]
    assert all(r.info.status == "FINISHED" and "avg_local_acc" in r.data.metrics for r in runs)
