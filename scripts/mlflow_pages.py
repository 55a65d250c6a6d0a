"""The pages a user opens to compare a study's methods, rendered in a real browser (headless
Chromium): the MLflow links that ``medpfl ui`` prints, the HTML report and the Snakemake report.

    python scripts/mlflow_pages.py --out docs/img                     # a small synthetic demo study
    python scripts/mlflow_pages.py --out docs/img --results results --study default \\
        --snakemake-report report.html                                 # the default study, as run

Without ``--results``, a demo study is trained first in a temporary folder (synthetic 28 x 28
images in the MedMNIST layout, 4 clients, FedAvg / Local / FedKPer x 2 seeds x 3 rounds: about
half a minute on 2 cores), through the same code as the pipeline's train, evaluate and report
stages. The MLflow server (``mlflow ui``, the project's pinned MLflow) is started on a free
loopback port on the study's store and stopped when done. The browser is Debian's ``chromium``
(``$CHROMIUM`` overrides; ``.ci/run`` installs it) driven by Playwright (a dev dependency), which
waits for each page's content (the method groups, the first chart) before the screenshot;
Chromium gets the flags this machine needs (no sandbox as root, no background networking: the
network is closed).

Writes ``mlflow-methods.png`` (the first link: charts per method), ``mlflow-table.png`` (a row
per method), ``mlflow-compare.png`` (MLflow's compare page), ``mlflow-study-run.png`` (the parent
run: the study's summary), ``report.png`` (``results/<study>/report/table.html``) and, with
``--snakemake-report``, ``snakemake-report.png``. ``tests/test_ui_browser.py`` uses the same
functions and asserts on the rendered pages.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from medpfl.tracking_server import free_port, stop_process_group, wait_healthy  # free_port: for the tests too

#: The flags headless Chromium needs here: root (no sandbox), no GPU, and no background
#: connections (the machine's closed network refuses them, many at a time).
CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium() -> str | None:
    """The Chromium executable: ``$CHROMIUM``, else ``chromium`` / ``chromium-browser`` on the PATH;
    None when there is none."""
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def mlflow_server(uri: str, port: int | None = None, timeout: float = 120.0):
    """Start ``mlflow ui`` for the store ``uri`` on 127.0.0.1 and yield its base URL; on exit stop
    exactly the process group it started (SIGTERM, then SIGKILL after 10 s). A store that is
    itself a tracking server (``http://...``, e.g. ``medpfl tracking-server``) is yielded as it is.

    Raises :class:`medpfl.errors.TrackingServerError` (with the server's last output) when it does
    not answer ``/health`` within ``timeout`` seconds. The start, the wait and the stop are
    :mod:`medpfl.tracking_server`'s (``free_port``, ``wait_healthy``, ``stop_process_group``)."""
    if uri.startswith(("http://", "https://")):
        yield uri.rstrip("/")
        return
    port = port or free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_file = Path(tmp) / "mlflow-ui.log"
        with open(log_file, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host",
                                     "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"})
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout, log_file, what=f"mlflow ui on port {port}")
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process_group(proc.pid, timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


@contextlib.contextmanager
def browser(size: tuple[int, int] = (1600, 1000)):
    """A headless Chromium page (Playwright, driving the system's Chromium: :func:`chromium`) of
    ``size`` pixels; closed on exit. Raises RuntimeError when Chromium is missing."""
    from playwright.sync_api import sync_playwright

    exe = chromium()
    if exe is None:
        raise RuntimeError("headless Chromium not found (install Debian's chromium, or set $CHROMIUM)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=list(CHROMIUM_FLAGS))
        try:
            yield b.new_page(viewport={"width": size[0], "height": size[1]})
        finally:
            b.close()


def open_page(page, url: str, wait_for: tuple[str, ...] = (), charts: bool = False, timeout_ms: int = 90000) -> str:
    """Load ``url`` in ``page``, wait until each text in ``wait_for`` is shown (and, with
    ``charts``, until a Plotly chart is drawn), then return the page's visible text (the SVG
    text of the charts included: legends, axis titles). Raises Playwright's TimeoutError when a
    text does not appear within ``timeout_ms``."""
    page.goto(url)
    for text in wait_for:
        page.get_by_text(text, exact=False).first.wait_for(timeout=timeout_ms)
    if charts:
        page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=timeout_ms)
    page.wait_for_timeout(1500)  # the remaining charts and fonts settle
    svg = " ".join(page.locator(".js-plotly-plot").all_text_contents())
    return page.locator("body").inner_text() + "\n" + svg


def chart_cards(page) -> dict[str, str]:
    """The drawn chart cards of an MLflow runs page: ``{chart title: the card's visible text}``
    (title, axis ticks, bar labels, then the legend: one name per run or group)."""
    out = {}
    for card in page.locator('[data-testid="experiment-view-compare-runs-card"]').all():
        text = card.inner_text()
        title = text.split("\n", 1)[0].strip()
        out.setdefault(title, text)
    return out


def screenshot(page, png: Path) -> None:
    """The current view of ``page`` as a PNG file."""
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(png))


def build_demo_study(folder: Path, methods: tuple[str, ...] = ("fedavg", "local", "fedkper"),
                     seeds: tuple[int, ...] = (1, 2), rounds: int = 3, study: str = "demo") -> Path:
    """Train and evaluate a small study in ``folder`` through the pipeline's own code, tracked in
    ``folder/mlruns.db``, and run its report stage (tables, the MLflow parent's summary and
    views). Synthetic 4-class 3 x 28 x 28 images in the MedMNIST ``.npz`` layout, Dirichlet(1.0)
    over 4 clients, every client each round, 1 local epoch. Returns the parent file
    (``results/<study>/mlflow_parent.json``)."""
    from medpfl.compose import validate_params
    from medpfl.config import train_job
    from medpfl.data.partition import build_partition
    from medpfl.data.preprocess import load_processed, preprocess
    from medpfl.data.synthetic import write_synthetic_npz
    from medpfl.evaluate import evaluate_run
    from medpfl.io import md5sum, write_parquet
    from medpfl.report import build_report
    from medpfl.tracking import init_study, log_study
    from medpfl.train import run_training

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    write_synthetic_npz(d / "synth.npz", 4, 3, 28, (160, 20, 60), seed=2)
    preprocess(d / "synth.npz", d / "arrays.npz", d / "samples.parquet", 4, 3)
    data = load_processed(d / "arrays.npz", d / "samples.parquet")
    params = validate_params({
        "study": study,
        "data": {"datasets": ["synth"], "custom": {"synth": {"path": str(d / "synth.npz"), "md5": md5sum(d / "synth.npz"),
                                                             "n_channels": 3, "num_classes": 4}}},
        "partitions": [{"name": "dir1.0", "num_clients": 4, "alpha": 1.0, "min_samples": 10}],
        "methods": list(methods), "seeds": list(seeds),
        "train": {"participation": 1.0, "executor": "sequential", "device": "cpu", "rounds": rounds,
                  "local_epochs": 1, "batch_size": 16, "checkpoint_every": 0},
    })
    pool = data.samples[data.samples["split"] == "train"]
    write_parquet(d / "partition.parquet", build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(),
                                                           params.partitions["dir1.0"], "dir1.0"))
    results = d / "results" / study
    parent = results / "mlflow_parent.json"
    init_study(study, f"medpfl-{study}", parent, uri=f"sqlite:///{d.resolve()}/mlruns.db",
               artifact_root=d / "mlartifacts")
    runs = []
    for method in methods:
        for seed in seeds:
            run = results / "runs" / "synth" / "dir1.0" / method / f"seed{seed}"
            run_training(train_job(params, "synth", "dir1.0", method, seed), d / "arrays.npz", d / "samples.parquet",
                         d / "partition.parquet", run, parent_file=parent)
            evaluate_run(run)
            runs.append(run)
    paths = build_report(runs, results / "report", [], title=f"medpfl study {study}")
    log_study(parent, params.model_dump(mode="json"), [Path(p) for p in paths.values()])
    return parent


def pages(parent_file: Path, base: str) -> dict[str, str]:
    """The study's pages on the server at ``base``: ``medpfl ui``'s links (``experiment``,
    ``table``, ``runs``, ``compare``) and the parent run's page (``study_run``)."""
    from medpfl.io import read_json
    from medpfl.tracking import study_children, ui_urls

    parent = read_json(parent_file)
    urls = ui_urls(parent, base, [r.info.run_id for r in study_children(parent)])
    urls["study_run"] = (f"{base}/#/experiments/{parent['experiment_id']}/runs/{parent['parent_run_id']}"
                         "?workflowType=machine_learning")
    return urls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/img", help="folder for the PNG screenshots (default: docs/img)")
    ap.add_argument("--results", help="a results folder holding <study>/mlflow_parent.json (default: train a demo "
                                      "study in a temporary folder)")
    ap.add_argument("--study", default="default", help="the study in --results (default: default)")
    ap.add_argument("--snakemake-report", help="a Snakemake report (snakemake --report report.html) to screenshot")
    a = ap.parse_args(argv)
    out = Path(a.out)
    with tempfile.TemporaryDirectory() as tmp:
        if a.results:
            parent = Path(a.results) / a.study / "mlflow_parent.json"
        else:
            os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlruns.db")
            parent = build_demo_study(Path(tmp))
        from medpfl.io import read_json
        from medpfl.tracking import publish_study_views, study_children

        rec = read_json(parent)
        publish_study_views(rec)
        methods = sorted({r.data.tags.get("method", "?") for r in study_children(rec)})
        groups = tuple(f"Group: {m}" for m in methods)
        with mlflow_server(rec["tracking_uri"]) as base, browser() as page:
            urls = pages(parent, base)
            for name, key, wait, charts in (("mlflow-methods.png", "experiment", groups, True),
                                            ("mlflow-table.png", "table", groups, False),
                                            ("mlflow-compare.png", "compare", (), False),
                                            ("mlflow-study-run.png", "study_run", ("mean over seeds",), False)):
                if key in urls:
                    open_page(page, urls[key], wait, charts)
                    screenshot(page, out / name)
                    print(f"{out / name}: {urls[key]}")
            report = parent.parent / "report" / "table.html"
            if report.is_file():
                open_page(page, report.resolve().as_uri())
                screenshot(page, out / "report.png")
                print(f"{out / 'report.png'}: {report}")
            if a.snakemake_report:
                open_page(page, Path(a.snakemake_report).resolve().as_uri())
                screenshot(page, out / "snakemake-report.png")
                print(f"{out / 'snakemake-report.png'}: {a.snakemake_report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
