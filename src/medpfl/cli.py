"""``medpfl``: one command, one sub-command per pipeline stage.

Snakemake rules call these with explicit paths and a JSON job description (``--job``), so a
rule's ``params:`` hold exactly what the stage uses. Known errors (bad params, bad data,
impossible partitions, unreachable tracking, a diverged training run) print one clear message and exit with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from medpfl.errors import PROJECT_ERRORS

log = logging.getLogger("medpfl")


def _job(text: str) -> dict:
    if text.startswith("@"):
        return json.loads(Path(text[1:]).read_text())
    return json.loads(text)


# ----- stages --------------------------------------------------------------------------------
def cmd_download(a) -> None:
    from medpfl.data.sources import fetch

    job = _job(a.job) if a.job else {"dataset": a.dataset, "custom": {}}
    where = fetch(job["dataset"], a.out, custom=job.get("custom") or None, synthetic=job.get("synthetic"))
    print(f"{job['dataset']}: {a.out} from {where}" + ("" if where.startswith("generated") else " (MD5 verified)"))


def cmd_preprocess(a) -> None:
    from medpfl.data.preprocess import preprocess
    from medpfl.data.sources import dataset_spec

    job = _job(a.job) if a.job else {"dataset": a.dataset, "custom": {}}
    spec = dataset_spec(job["dataset"], job.get("custom") or None, job.get("synthetic"))
    samples = preprocess(a.raw, a.out, a.samples, spec.num_classes, spec.n_channels, layout=spec.layout,
                         norm=spec.norm, class_names=spec.class_names)
    counts = samples.groupby("split").size().to_dict()
    print(f"{job['dataset']}: {len(samples)} images {counts} -> {a.out}")


def cmd_partition(a) -> None:
    from medpfl.config import partition_from_job
    from medpfl.data.partition import build_partition, client_class_counts, partition_pool, server_class_counts
    from medpfl.data.preprocess import load_processed
    from medpfl.io import write_json, write_parquet

    job = _job(a.job)
    cfg = partition_from_job(job["config"])  # the flat job description (PartitionConfigBase.job_dict)
    data = load_processed(a.arrays, a.samples)
    pool = partition_pool(data.samples, cfg)  # the official train split, or every split with pool: all
    natural = None
    if "natural_client" in pool.columns:  # a generated federated set carries its own clients
        natural = (pool["natural_client"].to_numpy(), pool["natural_split"].to_numpy())
    test = data.samples[data.samples["split"] == "test"]  # for local_test.rule official_test
    val = data.samples[data.samples["split"] == "val"]  # for server_data
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, job["name"], natural=natural,
                            official_test=(test["sample_id"].to_numpy(), test["label"].to_numpy()),
                            val=(val["sample_id"].to_numpy(), val["label"].to_numpy()))
    out = Path(a.out_dir)
    write_parquet(out / "partition.parquet", table)
    counts = client_class_counts(table, data.num_classes)
    names = list(data.class_names) if data.class_names is not None else None
    server = server_class_counts(table, data.num_classes)  # None (and no key) without server data
    write_json(out / "client_stats.json", {"dataset": job["dataset"], "partition": job["name"], "config": job["config"],
                                           "num_classes": data.num_classes, "class_names": names, "clients": counts,
                                           **({"server": server} if server is not None else {})})
    sizes = table[table["client_id"] >= 0].groupby("client_id").size()
    split_totals = ""
    if (table["local_split"] == "val").any():
        totals = table.groupby("local_split").size()
        split_totals = " (local " + ", ".join(f"{s_} {int(totals.get(s_, 0))}" for s_ in ("train", "test", "val")) + ")"
    if server is not None:
        split_totals += f"; server data {sum(server)} unlabeled samples from the val split"
    print(f"{job['dataset']}/{job['name']}: {len(sizes)} clients, sizes {sizes.min()}..{sizes.max()}{split_totals}")


def cmd_partition_figure(a) -> None:
    from medpfl.io import read_json
    from medpfl.report.partition_figure import partition_heatmap, partition_title

    stats = read_json(a.stats)
    partition_heatmap(stats["clients"], stats["num_classes"], Path(a.out), class_names=stats.get("class_names"),
                      title=partition_title(stats))
    print(f"{stats['dataset']}/{stats['partition']}: {a.out}")


def cmd_mlflow_init(a) -> None:
    from medpfl.tracking import init_study

    rec = init_study(a.study, a.experiment, Path(a.out))
    print(f"MLflow: experiment {a.experiment} ({rec['experiment_id']}), parent run {rec['parent_run_id']} "
          f"in {rec['tracking_uri']}")


def cmd_train(a) -> None:
    from medpfl.train import run_training

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    run_training(_job(a.job), Path(a.arrays), Path(a.samples), Path(a.partition_table), Path(a.out_dir),
                 parent_file=Path(a.parent) if a.parent else None)


def cmd_evaluate(a) -> None:
    from medpfl.evaluate import evaluate_run

    s = evaluate_run(Path(a.run_dir))
    shown = {k: s[k] for k in ("avg_global_acc", "avg_local_acc", "avg_worst_client_acc", "balance") if k in s}
    print(f"{a.run_dir}: {shown}")


def cmd_report(a) -> None:
    from medpfl.report import build_report

    paths = build_report([Path(p) for p in a.runs], Path(a.out_dir), [Path(p) for p in a.partition_figures],
                         title=a.title or "", paper_table=Path(a.paper_table) if a.paper_table else None,
                         reference=a.reference)
    if a.parent:
        from medpfl.tracking import log_study

        log_study(Path(a.parent), _job(a.study_params) if a.study_params else {}, [Path(p) for p in paths.values()])
    print(f"report: {', '.join(str(p) for p in paths.values())}")


def cmd_ui(a) -> int:
    """Print (and by default serve) the MLflow UI of one study, with the links to its runs."""
    import subprocess
    import time
    import urllib.request
    import webbrowser

    from medpfl.io import read_json
    from medpfl.tracking import TrackingError, study_children, ui_urls

    study = a.study
    if not study:
        from medpfl.compose import load_params

        study = load_params(a.params, a.overlay).study
    parent_file = Path(a.results) / study / "mlflow_parent.json"
    if not parent_file.is_file():
        raise FileNotFoundError(f"{parent_file}: no MLflow parent run for study {study!r}; run the study first "
                                "(snakemake --cores all [--configfile config/<study>.yaml])")
    parent = read_json(parent_file)
    uri = parent["tracking_uri"]
    remote = uri.startswith(("http://", "https://"))
    base = uri if remote else f"http://{a.host}:{a.port}"
    try:
        ids = [r.info.run_id for r in study_children(parent)]
    except TrackingError as e:
        log.warning("could not list the study's runs (%s); printing the experiment link only", e)
        ids = []
    urls = ui_urls(parent, base, ids[:a.max_compare])
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", a.host, "--port", str(a.port)]
    print(f"study {study}: experiment {parent.get('experiment', '?')} (id {parent['experiment_id']}), "
          f"{len(ids)} training runs, store {uri}")
    if not remote:
        print("server:   mlflow ui --backend-store-uri " + uri + f" --host {a.host} --port {a.port}")
    print(f"runs:     {urls['experiment']}")
    if "compare" in urls:
        shown = "" if len(ids) <= a.max_compare else f" (the first {a.max_compare} of {len(ids)})"
        print(f"compare:  {urls['compare']}{shown}")
    sys.stdout.flush()
    if remote or a.no_serve:
        if a.browser:
            webbrowser.open(urls["experiment"])
        return 0
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 120
        while a.browser and time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    webbrowser.open(urls["experiment"])
                    break
            except OSError:
                time.sleep(0.5)
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def cmd_check_params(a) -> None:
    from medpfl.compose import load_params

    p = load_params(a.params, a.overlay)
    print(f"{a.params}: ok (study {p.study}: {len(p.dataset_partitions())} (data set, partition) pairs x "
          f"{len(p.methods)} methods x {len(p.seeds)} seeds)")


def cmd_doctor(a) -> int:
    from medpfl.doctor import doctor

    return doctor(Path(a.params), a.overlay, pipeline=not a.no_pipeline)


def cmd_sync(a) -> int:
    from medpfl.doctor import sync

    return sync(a.overlay)


def cmd_synthetic(a) -> None:
    from medpfl.data.synthetic import write_synthetic_npz

    md5 = write_synthetic_npz(Path(a.out), a.num_classes, a.n_channels, a.size, (a.train, a.val, a.test), a.seed)
    print(json.dumps({"path": str(a.out), "md5": md5, "n_channels": a.n_channels, "num_classes": a.num_classes}))


# ----- parser --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="medpfl", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("download", help="fetch a data set file (mirror first, then the official URL), MD5-checked")
    s.add_argument("--dataset")
    s.add_argument("--job", help="JSON {dataset, custom}")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_download)

    s = sub.add_parser("preprocess", help="official .npz -> compact uint8 NCHW arrays + sample table")
    s.add_argument("--dataset")
    s.add_argument("--job")
    s.add_argument("--raw", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--samples", required=True)
    s.set_defaults(fn=cmd_preprocess)

    s = sub.add_parser("partition", help="split the train pool over clients; local train/test splits")
    s.add_argument("--job", required=True, help="JSON {dataset, name, config}")
    s.add_argument("--arrays", required=True)
    s.add_argument("--samples", required=True)
    s.add_argument("--out-dir", required=True)
    s.set_defaults(fn=cmd_partition)

    s = sub.add_parser("partition-figure", help="heat map of a partition's samples per class and client")
    s.add_argument("--stats", required=True, help="the partition's client_stats.json")
    s.add_argument("--out", required=True, help="PNG file to write")
    s.set_defaults(fn=cmd_partition_figure)

    s = sub.add_parser("mlflow-init", help="create the MLflow store, experiment and the study's parent run")
    s.add_argument("--study", required=True)
    s.add_argument("--experiment", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_mlflow_init)

    s = sub.add_parser("train", help="one federated training job (dataset x partition x method x seed)")
    s.add_argument("--job", required=True)
    s.add_argument("--arrays", required=True)
    s.add_argument("--samples", required=True)
    s.add_argument("--partition-table", required=True)
    s.add_argument("--parent", help="parent.json from mlflow-init (omit: no tracking)")
    s.add_argument("--out-dir", required=True)
    s.add_argument("--threads", type=int, default=0)
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("evaluate", help="metrics of one training run (paper protocol and plain views)")
    s.add_argument("--run-dir", required=True)
    s.set_defaults(fn=cmd_evaluate)

    s = sub.add_parser("report", help="tables and figures across methods and seeds")
    s.add_argument("--runs", nargs="+", required=True)
    s.add_argument("--partition-figures", nargs="*", default=[])
    s.add_argument("--out-dir", required=True)
    s.add_argument("--title")
    s.add_argument("--parent", help="parent.json: log the study params and the report to the parent run")
    s.add_argument("--study-params", help="JSON of the study's resolved params")
    s.add_argument("--paper-table", help="a paper's table as data (report.paper_table): add the side-by-side")
    s.add_argument("--reference", help="the method the others are compared with, paired by seed (report.reference; "
                                       "default: fedavg when present, else the first method)")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("ui", help="open a study's runs in the MLflow UI (prints the links; serves mlflow ui)")
    s.add_argument("--study", help="the study's name (default: the study of params.yaml + overlays)")
    s.add_argument("--params", default="params.yaml")
    s.add_argument("--overlay", action="append", default=[], help="a study overlay, e.g. config/pfedkd-mnist.yaml")
    s.add_argument("--results", default="results", help="the results folder (holds <study>/mlflow_parent.json)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5000)
    s.add_argument("--no-serve", action="store_true", help="only print the command and the links")
    s.add_argument("--browser", action="store_true", help="open the runs link in a browser once the server answers")
    s.add_argument("--max-compare", type=int, default=100, help="at most this many runs in the compare link")
    s.set_defaults(fn=cmd_ui)

    s = sub.add_parser("check-params", help="validate params.yaml (+ overlays) and exit")
    s.add_argument("params", nargs="?", default="params.yaml")
    s.add_argument("--overlay", action="append", default=[])
    s.set_defaults(fn=cmd_check_params)

    s = sub.add_parser("doctor", help="check params, data MD5s, MLflow, GPU, DVC and Snakemake state")
    s.add_argument("params", nargs="?", default="params.yaml")
    s.add_argument("--overlay", action="append", default=[])
    s.add_argument("--no-pipeline", action="store_true", help="skip the dvc status / snakemake dry-run checks")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("sync", help="after git checkout: dvc checkout, then snakemake --touch")
    s.add_argument("--overlay", action="append", default=[])
    s.set_defaults(fn=cmd_sync)

    s = sub.add_parser("synthetic", help="write a small synthetic data set in the official MedMNIST .npz layout")
    s.add_argument("--out", required=True)
    s.add_argument("--num-classes", type=int, default=4)
    s.add_argument("--n-channels", type=int, default=3)
    s.add_argument("--size", type=int, default=28)
    s.add_argument("--train", type=int, default=400)
    s.add_argument("--val", type=int, default=40)
    s.add_argument("--test", type=int, default=120)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_synthetic)
    return p


def known_errors() -> tuple[type[BaseException], ...]:
    return (*PROJECT_ERRORS, FileNotFoundError, json.JSONDecodeError)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status = args.fn(args)
    except known_errors() as e:
        print(f"medpfl {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
