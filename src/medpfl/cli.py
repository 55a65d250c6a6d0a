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
import textwrap
from pathlib import Path

from medpfl.errors import PROJECT_ERRORS, ParamsError

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
    done = "" if where.startswith("generated") or job.get("folder") or a.out.endswith(".manifest.json") \
        else " (MD5 verified)"
    print(f"{job['dataset']}: {a.out} from {where}{done}")


def cmd_preprocess(a) -> None:
    from medpfl.data.preprocess import preprocess, preprocess_folder
    from medpfl.data.sources import dataset_spec

    job = _job(a.job) if a.job else {"dataset": a.dataset, "custom": {}}
    spec = dataset_spec(job["dataset"], job.get("custom") or None, job.get("synthetic"))
    if spec.folder is not None:  # a folder data set: --raw is the download stage's manifest
        samples = preprocess_folder(a.raw, a.out, a.samples, spec.folder, job.get("options"), verify=a.verify)
        what = f"{spec.folder.kind} samples"
    else:
        samples = preprocess(a.raw, a.out, a.samples, spec.num_classes, spec.n_channels, layout=spec.layout,
                             norm=spec.norm, class_names=spec.class_names)
        what = "images"
    counts = samples.groupby("split").size().to_dict()
    subjects = f", {samples['subject_id'].nunique()} subjects" if "subject_id" in samples.columns else ""
    print(f"{job['dataset']}: {len(samples)} {what} {counts}{subjects} -> {a.out}")


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
    # scheme subject: whole subjects per client (folder data sets with subject_id)
    subjects = pool["subject_id"].to_numpy() if "subject_id" in pool.columns else None
    table = build_partition(pool["sample_id"].to_numpy(), pool["label"].to_numpy(), cfg, job["name"], natural=natural,
                            official_test=(test["sample_id"].to_numpy(), test["label"].to_numpy()),
                            val=(val["sample_id"].to_numpy(), val["label"].to_numpy()), subjects=subjects)
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
    from medpfl.gpus import claim_for_device

    jobs = [_job(j) for j in a.job]
    if len(jobs) != len(a.out_dir):
        raise ParamsError(f"medpfl train: {len(jobs)} --job but {len(a.out_dir)} --out-dir (one run folder per job)")
    # one free GPU for this job (CUDA_VISIBLE_DEVICES), before torch is imported and reads it
    claim_for_device(str((jobs[0].get("train") or {}).get("device", "auto")))
    from medpfl.train import run_stacked_seeds, run_training

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    parent = Path(a.parent) if a.parent else None
    if len(jobs) == 1:
        run_training(jobs[0], Path(a.arrays), Path(a.samples), Path(a.partition_table), Path(a.out_dir[0]),
                     parent_file=parent)
    else:  # train.stack_seeds: one method's seeds as one computation
        run_stacked_seeds(jobs, Path(a.arrays), Path(a.samples), Path(a.partition_table),
                          [Path(d) for d in a.out_dir], parent_file=parent)


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
        from medpfl.io import read_json
        from medpfl.tracking import log_study

        # the MLflow runs behind this report (each run's metrics.json); other children of the study's parent
        # (a job's earlier run before a params edit, a failed attempt) are marked superseded
        current = [read_json(Path(r) / "metrics.json").get("mlflow_run_id") for r in a.runs]
        log_study(Path(a.parent), _job(a.study_params) if a.study_params else {}, [Path(p) for p in paths.values()],
                  current_runs=[c for c in current if c] or None)  # no tracked run: leave the children as they are
    print(f"report: {', '.join(str(p) for p in paths.values())}")


def cmd_ui(a) -> int:
    """Print (and by default serve) the MLflow UI of one study, with the links to its runs."""
    import subprocess
    import time
    import urllib.request
    import webbrowser

    from medpfl.io import read_json
    from medpfl.tracking import TrackingError, check_reachable, is_server_uri, publish_study_views, study_children, ui_urls

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
    remote = is_server_uri(uri)  # a tracking server serves the UI itself: nothing to start
    base = uri if remote else f"http://{a.host}:{a.port}"
    try:
        if remote:
            check_reachable(uri)  # at once, rather than after MLflow's client has retried for minutes
        publish_study_views(parent)  # a study tracked by an older medpfl gets its views too
        ids = [r.info.run_id for r in study_children(parent)]
    except TrackingError as e:
        log.warning("could not reach the study's store (%s); printing the links only", e)
        ids = []
    urls = ui_urls(parent, base, ids[:a.max_compare])
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", a.host, "--port", str(a.port)]
    print(f"study {study}: experiment {parent.get('experiment', '?')} (id {parent['experiment_id']}), "
          f"{len(ids)} training runs, store {uri}")
    if remote:
        print(f"server:   the tracking server {uri} (it serves the UI; nothing to start)")
    else:
        print("server:   mlflow ui --backend-store-uri " + uri + f" --host {a.host} --port {a.port}")
    print(f"methods:  {urls['experiment']}")
    print("          charts, one entry per method (mean over seeds; curves with the min-max band); "
          "click a group for its seeds")
    print(f"table:    {urls['table']}")
    print("          a row per method (mean over seeds) above its seed runs, headline metrics as columns")
    print(f"runs:     {urls['runs']}")
    if "compare" in urls:
        shown = "" if len(ids) <= a.max_compare else f" (the first {a.max_compare} of {len(ids)})"
        print(f"compare:  {urls['compare']}{shown}")
        print("          MLflow's compare page: every seed run side by side, params and metrics")
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


def cmd_deploy(a) -> int:
    """``medpfl deploy certs|job|superlink|site|run`` (:mod:`medpfl.deploy`, docs/deployment.md).
    superlink and site replace this process with Flower's (``exec``); run returns ``flwr run``'s
    exit status."""
    import json
    import os
    import tempfile

    from medpfl.deploy import processes as fp
    from medpfl.errors import DeploymentError

    certs = Path(a.certs) if getattr(a, "certs", None) else None
    if a.action in ("superlink", "site", "run") and certs is None and not a.insecure:
        raise DeploymentError(f"medpfl deploy {a.action}: give --certs FOLDER (TLS and SuperNode authentication; "
                              "make it with `medpfl deploy certs`) or, for a test on loopback only, --insecure")
    if a.action == "certs":
        from medpfl.deploy.certs import make_certificates

        folder = make_certificates(Path(a.dir), hosts=a.host or ["localhost", "127.0.0.1"], sites=a.site)
        print(f"certificates in {folder}: ca.crt (give it to every site and to `medpfl deploy run`), ca.key (keep "
              "it), server.pem + server.key (the SuperLink's)" + (", and a key pair per site: " + ", ".join(
                  f"{s} (private, to that site) + {s}.pub (register it)" for s in a.site) if a.site else ""))
        return 0
    if a.action == "prepare-site":
        from medpfl.deploy.site import prepare_site_files

        paths = prepare_site_files(Path(a.file), Path(a.out), a.client_id, a.num_classes, a.channels, a.layout,
                                   val=a.val)
        print(f"site files in {a.out} (client {a.client_id}); start the site with: medpfl deploy site --arrays "
              f"{paths['arrays']} --samples {paths['samples']} --partition-table {paths['partition-table']} "
              f"--client-ids {a.client_id} ...")
        return 0
    if a.action == "job":
        from medpfl.compose import load_params
        from medpfl.config import train_job

        params = load_params(Path(a.params), [Path(o) for o in a.overlay])
        job = train_job(params, a.dataset, a.partition, a.method, a.seed)
        Path(a.out).write_text(json.dumps(job, indent=1, sort_keys=True) + "\n")
        print(f"{a.out}: {a.method} on {a.dataset}/{a.partition}, seed {a.seed}; the study's files: "
              f"data/processed/{a.dataset}.npz, data/processed/{a.dataset}.samples.parquet, "
              f"data/partitions/{a.dataset}/{a.partition}/partition.parquet")
        return 0
    if a.action == "superlink":
        cmd = fp.superlink_cmd(a.port, certs)
        cmd[cmd.index("--host") + 1] = a.host
        env = fp.flower_env(Path(a.home)) if a.home else {**os.environ, **{k: v for k, v in fp.flower_env(
            Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))).items() if k != "FLWR_HOME"}}
        os.execvpe(cmd[0], cmd, env)
    if a.action == "site":
        cfg = {"arrays": str(Path(a.arrays).resolve()), "samples": str(Path(a.samples).resolve()),
               "partition-table": str(Path(a.partition_table).resolve()), "client-ids": a.client_ids or "",
               "state-dir": str(Path(a.state_dir).resolve()), "device": a.device}
        cmd = fp.supernode_cmd(a.superlink, a.port, cfg, certs, Path(a.key) if a.key else None)
        os.execvpe(cmd[0], cmd, {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})
    if a.action == "run":
        home = Path(tempfile.mkdtemp(prefix="medpfl-flwr-"))
        fp.write_cli_config(home, a.superlink, certs)
        cfg = {"job": str(Path(a.job).resolve()), "arrays": str(Path(a.arrays).resolve()),
               "samples": str(Path(a.samples).resolve()), "partition-table": str(Path(a.partition_table).resolve()),
               "out-dir": str(Path(a.out_dir).resolve()), "parent": str(Path(a.parent).resolve()) if a.parent else "",
               "timeout": float(a.timeout), "secagg": bool(a.secagg), "secagg-clip": float(a.secagg_clip)}
        fp.flwr_run(cfg, home, capture=False)  # raises DeploymentError (one line) when the run wrote nothing
        print(f"deployed run done: {cfg['out-dir']}")
        return 0
    return 2


def cmd_tracking_server(a) -> int:
    """``medpfl tracking-server start|stop|status --dir FOLDER``: an MLflow tracking server backed by
    PostgreSQL (:mod:`medpfl.tracking_server`); start prints the ``export MLFLOW_TRACKING_URI=...``
    line for the jobs. Returns 0, or 3 from ``status`` when the server is not (fully) running."""
    from medpfl import tracking_server as ts

    if a.action == "start":
        rec = ts.start(a.dir, host=a.host, port=a.port, workers=a.workers, timeout=a.timeout,
                       allowed_hosts=a.allowed_hosts.split(",") if a.allowed_hosts else None,
                       cors_origins=a.cors_allowed_origins.split(",") if a.cors_allowed_origins else None)
        pg, m = rec["postgres"], rec["mlflow"]
        verb = "started" if rec["started"] else "already running"
        print(f"tracking server in {rec['folder']}: {verb}" + (f" ({', '.join(rec['started'])})" if rec["started"] else ""))
        print(f"  MLflow      {rec['tracking_uri']} (pid {m['pid']}, {rec['workers']} worker(s), log {m['log']})")
        print(f"  PostgreSQL  {pg['version']}, database {pg['database']} in {pg['data']} (socket {pg['socket']}, "
              f"runs as {pg['user']}, log {pg['log']})")
        print(f"  artifacts   {rec['artifacts']} (uploaded through the server)")
        print(f"  stop it:    medpfl tracking-server stop --dir {rec['folder']}")
        print(f"export MLFLOW_TRACKING_URI={rec['tracking_uri']}")
        return 0
    if a.action == "stop":
        out = ts.stop(a.dir)
        what = " and ".join({"mlflow": "the MLflow server", "postgres": "PostgreSQL"}[w] for w in out["stopped"])
        print(f"tracking server in {out['record']['folder']}: " + (f"stopped {what}" if what else "was not running"))
        return 0
    st = ts.status(a.dir)
    rec = st["record"]
    word = "running" if st["running"] else ("stopped" if not (st["mlflow"] or st["postgres"]) else "partly running")
    print(f"tracking server in {rec['folder']}: {word}")
    print(f"  MLflow      {rec['tracking_uri']}: " + (f"up (pid {rec['mlflow']['pid']}, /health ok)" if st["mlflow"]
                                                        else "down"))
    print(f"  PostgreSQL  {rec['postgres']['data']}: " + ("up" if st["postgres"] else "down"))
    print(f"  artifacts   {rec['artifacts']}")
    print(f"  back up:    {ts.backup_command(rec)}")
    if st["running"]:
        print(f"export MLFLOW_TRACKING_URI={rec['tracking_uri']}")
    return 0 if st["running"] else 3


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
DESCRIPTION = """\
Reproducible federated and personalized federated learning benchmarks on medical images.

Run a study from the project folder (the one holding params.yaml and the Snakefile):
  snakemake --cores all                                    the default study (params.yaml)
  snakemake --cores all --configfile config/<study>.yaml   a named study (params.yaml + overlay)
Then compare its runs in MLflow:
  medpfl ui [--overlay config/<study>.yaml]
Before spending hours:
  medpfl check-params [--overlay config/<study>.yaml]      validate the parameters
  medpfl doctor [--overlay config/<study>.yaml]            check params, data, MLflow, GPU, DVC
Jobs on many nodes: one MLflow tracking server (PostgreSQL) for all of them:
  medpfl tracking-server start --dir FOLDER --host 0.0.0.0 then export the MLFLOW_TRACKING_URI it prints"""

#: (name, one-line help) of the commands a person runs, in the order --help lists them.
USER_COMMANDS = {
    "ui": "compare a study's methods in the MLflow UI (prints its links: methods, table, runs, compare; serves mlflow ui)",
    "tracking-server": "start, stop or show an MLflow tracking server backed by PostgreSQL, for jobs on many nodes",
    "deploy": "run a method across real sites with Flower: certificates, the server side, a site, a run",
    "check-params": "validate params.yaml (+ overlays) and exit",
    "doctor": "check params, data MD5s, MLflow store, GPU, DVC and Snakemake state",
    "sync": "after git checkout: dvc checkout, then snakemake --touch",
    "synthetic": "write a small synthetic data set in the official MedMNIST .npz layout",
}
#: (name, one-line help) of the stage commands: what each Snakemake rule runs.
STAGE_COMMANDS = {
    "download": "fetch a data set's file (mirror first, then the official URL), MD5-checked; a folder data set: "
                "verify its root in a mirror (or download it; MEDPFL_OFFLINE=1: never), write a manifest",
    "preprocess": "official .npz (or a folder data set's reader) -> compact arrays + sample table",
    "partition": "split the pool over clients; local train/test(/val) splits",
    "partition-figure": "heat map of a partition's samples per class and client",
    "mlflow-init": "create the MLflow store, experiment and the study's parent run",
    "train": "one training job (data set x partition x method x seed)",
    "evaluate": "metrics of one training run",
    "report": "tables and figures across methods and seeds",
}


def _listing(commands: dict[str, str]) -> str:
    width = max(len(n) for n in {**USER_COMMANDS, **STAGE_COMMANDS})
    return "\n".join(f"  {n:<{width}}  {h}" for n, h in commands.items())


EPILOG = f"""\
commands:
{_listing(USER_COMMANDS)}

stage commands (Snakemake runs these, one per rule, with explicit paths and a --job JSON;
run them by hand only to debug a stage):
{_listing(STAGE_COMMANDS)}

medpfl <command> -h shows a command's options."""

JOB_HELP = "the job description as JSON, or @FILE to read it from FILE"


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``medpfl.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("medpfl")
    except PackageNotFoundError:
        from medpfl import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``medpfl`` parser: the user commands and one stage command per Snakemake rule."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="medpfl", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"medpfl {package_version()}",
                   help="print medpfl's version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level instead of INFO")
    # The parsers are added without help=, so argparse does not list them in one flat block: the
    # epilog lists them in two groups.
    sub = p.add_subparsers(dest="command", required=True, metavar="<command>",
                           help="one of the commands listed below")

    def command(name: str, fn, **kw) -> argparse.ArgumentParser:
        text = USER_COMMANDS.get(name) or STAGE_COMMANDS[name]
        if name in STAGE_COMMANDS:
            text += " (a Snakemake stage command: the pipeline runs it, with explicit paths)"
        s = sub.add_parser(name, description=textwrap.fill(text[0].upper() + text[1:] + "."), formatter_class=fmt,
                           **kw)
        s.set_defaults(fn=fn)
        return s

    def overlay(s: argparse.ArgumentParser) -> None:
        s.add_argument("--overlay", action="append", default=[], metavar="YAML",
                       help="a study overlay merged over the params file, e.g. config/pfedkd-mnist.yaml "
                            "(repeat for several, applied in order; default: none)")

    s = command("download", cmd_download)
    s.add_argument("--dataset", metavar="NAME", help="data set name, e.g. bloodmnist (used when --job is absent)")
    s.add_argument("--job", metavar="JSON", help=JOB_HELP + ': {"dataset": NAME, "custom": {NAME: {path, md5, '
                   '...}}, "synthetic": {...}} (data.custom / data.synthetic of params.yaml)')
    s.add_argument("--out", required=True, metavar="PATH", help="where to write the raw file, e.g. "
                   "data/raw/bloodmnist.npz")

    s = command("preprocess", cmd_preprocess)
    s.add_argument("--dataset", metavar="NAME", help="data set name (used when --job is absent)")
    s.add_argument("--job", metavar="JSON", help=JOB_HELP + ': {"dataset": NAME, "custom": {...}, '
                   '"synthetic": {...}}, as for download')
    s.add_argument("--raw", required=True, metavar="PATH", help="the downloaded raw file (data/raw/<dataset>.npz), "
                   "or a folder data set's manifest (data/raw/<dataset>.manifest.json)")
    s.add_argument("--out", required=True, metavar="NPZ", help="processed arrays to write "
                   "(data/processed/<dataset>.npz)")
    s.add_argument("--samples", required=True, metavar="PARQUET", help="sample table to write: one row per "
                   "image with its split and label (data/processed/<dataset>.samples.parquet)")
    s.add_argument("--verify", choices=("size", "sha256"), default="size",
                   help="folder data sets: check the manifest's files by size (default, cheap) or re-hash them all "
                        "(sha256)")

    s = command("partition", cmd_partition)
    s.add_argument("--job", required=True, metavar="JSON", help=JOB_HELP + ': {"dataset": NAME, "name": '
                   'PARTITION, "config": {the partition\'s flat settings: scheme, num_clients, seed, ...}}')
    s.add_argument("--arrays", required=True, metavar="NPZ", help="processed arrays from preprocess")
    s.add_argument("--samples", required=True, metavar="PARQUET", help="sample table from preprocess")
    s.add_argument("--out-dir", required=True, metavar="DIR", help="folder to write partition.parquet and "
                   "client_stats.json into (data/partitions/<dataset>/<partition>)")

    s = command("partition-figure", cmd_partition_figure)
    s.add_argument("--stats", required=True, metavar="JSON", help="the partition's client_stats.json")
    s.add_argument("--out", required=True, metavar="PNG", help="PNG file to write")

    s = command("mlflow-init", cmd_mlflow_init)
    s.add_argument("--study", required=True, metavar="NAME", help="the study's name (params.yaml: study)")
    s.add_argument("--experiment", required=True, metavar="NAME", help="MLflow experiment name "
                   "(params.yaml: mlflow.experiment)")
    s.add_argument("--out", required=True, metavar="JSON", help="where to write the parent run's description "
                   "(results/<study>/mlflow_parent.json); the store is $MLFLOW_TRACKING_URI, else "
                   "sqlite:///mlruns.db in the current folder")

    s = command("train", cmd_train, epilog=textwrap.fill(
        "GPU: a job whose train.device is auto or cuda (or any job while MEDPFL_GPUS is set) first claims one "
        "free GPU of the machine (nvidia-smi -L, or the ids in MEDPFL_GPUS) with a lock file in "
        "MEDPFL_GPU_LOCK_DIR and runs with CUDA_VISIBLE_DEVICES set to it; a CUDA_VISIBLE_DEVICES already set "
        "(SLURM) is kept. See docs/cluster.md.", break_on_hyphens=False))
    s.add_argument("--job", required=True, action="append", metavar="JSON", help=JOB_HELP + ': {"study", '
                   '"dataset", "partition", "method", "algorithm", "method_params": {...}, "seed": INT, '
                   '"num_clients": INT, "train": {...}, "eval": {...}[, "pool": "all"]} (medpfl.config.train_job '
                   'writes it). Given several times (one per seed of one method, each with its --out-dir, in '
                   'order): the seeds train as one computation (train.stack_seeds, docs/contract.md)')
    s.add_argument("--arrays", required=True, metavar="NPZ", help="processed arrays from preprocess")
    s.add_argument("--samples", required=True, metavar="PARQUET", help="sample table from preprocess")
    s.add_argument("--partition-table", required=True, metavar="PARQUET", help="partition.parquet from partition")
    s.add_argument("--parent", metavar="JSON", help="mlflow_parent.json from mlflow-init: log the run as its "
                   "child (default: no MLflow tracking)")
    s.add_argument("--out-dir", required=True, action="append", metavar="DIR", help="run folder for "
                   "records.parquet, rounds.parquet, job.json, checkpoints and final_model.pt (one per --job)")
    s.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads for this job "
                   "(default: %(default)s = torch's own default)")

    s = command("evaluate", cmd_evaluate)
    s.add_argument("--run-dir", required=True, metavar="DIR", help="a train run folder (holds records.parquet); "
                   "metrics.json, round_metrics.csv and client_accuracy.csv are written into it")

    s = command("report", cmd_report)
    s.add_argument("--runs", nargs="+", required=True, metavar="DIR", help="evaluated run folders to compare")
    s.add_argument("--partition-figures", nargs="*", default=[], metavar="PNG",
                   help="partition heat maps to include (default: none)")
    s.add_argument("--out-dir", required=True, metavar="DIR", help="folder for table.md, table.html, "
                   "summary.csv, summary.json, paired.csv and curves.png")
    s.add_argument("--title", metavar="TEXT", help="the report's title (default: none)")
    s.add_argument("--parent", metavar="JSON", help="mlflow_parent.json: log the study params and the report "
                   "to the parent run (default: no MLflow logging)")
    s.add_argument("--study-params", metavar="JSON", help="the study's resolved params as JSON (or @FILE), "
                   "logged to the parent run with --parent")
    s.add_argument("--paper-table", metavar="YAML", help="a paper's table as data (report.paper_table, "
                   "config/papers/*.yaml): add the side-by-side comparison")
    s.add_argument("--reference", metavar="METHOD", help="the method the others are compared with, paired by seed "
                   "(report.reference; default: fedavg when present, else the first method)")

    s = command("ui", cmd_ui)
    s.add_argument("--study", metavar="NAME", help="the study's name (default: the study of params.yaml + overlays)")
    s.add_argument("--params", default="params.yaml", metavar="YAML", help="the params file (default: %(default)s)")
    overlay(s)
    s.add_argument("--results", default="results", metavar="DIR",
                   help="the results folder, holding <study>/mlflow_parent.json (default: %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address mlflow ui listens on (default: %(default)s)")
    s.add_argument("--port", type=int, default=5000, help="port mlflow ui listens on (default: %(default)s)")
    s.add_argument("--no-serve", action="store_true", help="only print the server command and the links")
    s.add_argument("--browser", action="store_true", help="open the runs link in a browser once the server answers")
    s.add_argument("--max-compare", type=int, default=100, metavar="N",
                   help="at most this many runs in the compare link (default: %(default)s)")

    s = command("tracking-server", cmd_tracking_server, epilog=textwrap.fill(
        "start creates FOLDER on first use (a PostgreSQL cluster in FOLDER/postgres, initdb as the postgres user "
        "when run as root; artifacts in FOLDER/artifacts, uploaded through the server), starts PostgreSQL on its "
        "own Unix socket and mlflow server on HOST:PORT, records both in FOLDER/server.json and prints the "
        "export MLFLOW_TRACKING_URI=... line for the jobs. stop stops exactly what start started; status exits "
        "3 when the server is not running. See docs/cluster.md.", break_on_hyphens=False))
    ts_sub = s.add_subparsers(dest="action", required=True, metavar="{start,stop,status}",
                              help="start the server (creating it on first use), stop it, or show its state")
    for action, text in (("start", "start the PostgreSQL-backed MLflow tracking server in --dir"),
                         ("stop", "stop what start started in --dir (the MLflow server, then PostgreSQL)"),
                         ("status", "show whether the server in --dir runs (exit status 3 when not)")):
        a_ = ts_sub.add_parser(action, description=text[0].upper() + text[1:] + ".", help=text)
        a_.add_argument("--dir", required=True, metavar="FOLDER",
                        help="the server's folder: server.json, postgres/ (database), artifacts/, logs")
        if action == "start":
            a_.add_argument("--host", default="127.0.0.1", help="address the MLflow server listens on: 0.0.0.0 for "
                            "jobs on other nodes (default: %(default)s)")
            a_.add_argument("--port", type=int, default=5000, help="port the MLflow server listens on "
                            "(default: %(default)s)")
            a_.add_argument("--workers", type=int, default=1, metavar="N", help="MLflow server worker processes, "
                            "about 250 MB each (default: %(default)s)")
            a_.add_argument("--timeout", type=float, default=180.0, metavar="S", help="seconds to wait for the "
                            "server's /health (default: %(default)s)")
            a_.add_argument("--allowed-hosts", metavar="LIST", help="comma-separated Host headers the server "
                            "accepts (mlflow server --allowed-hosts; default: localhost and private addresses, "
                            "plus this machine's names when --host is not a loopback address)")
            a_.add_argument("--cors-allowed-origins", metavar="LIST", help="comma-separated origins a browser may "
                            "use the UI from (mlflow server --cors-allowed-origins; default: localhost, plus "
                            "http://<this machine's names>:PORT when --host is not a loopback address)")

    s = command("deploy", cmd_deploy, epilog=textwrap.fill(
        "A deployment: make certificates once (certs), start the SuperLink on the server (superlink), register "
        "each site's public key (flwr supernode register SITE.pub medpfl), start a SuperNode at each site "
        "(site), then run a job (job writes one from the params; run). superlink, site and run need --certs "
        "(TLS and SuperNode authentication) or, for a loopback test only, --insecure. See docs/deployment.md.", break_on_hyphens=False))
    d_sub = s.add_subparsers(dest="action", required=True,
                             metavar="{certs,prepare-site,job,superlink,site,run}", help="what to do")
    for action, text in (("certs", "make a CA, the SuperLink's TLS certificate and a key pair per site"),
                         ("prepare-site", "turn a site's own file (an official layout) into the files its "
                          "SuperNode reads: arrays, samples, a one-client partition"),
                         ("job", "write the job of one study run (data set, partition, method, seed) as JSON"),
                         ("superlink", "start the SuperLink (the federation's server side) in the foreground"),
                         ("site", "start a site's SuperNode in the foreground, serving its own data"),
                         ("run", "run a job across the connected sites; the outputs of medpfl train in --out-dir")):
        a_ = d_sub.add_parser(action, description=text[0].upper() + text[1:] + ".", help=text)
        if action == "certs":
            a_.add_argument("dir", metavar="FOLDER", help="where to write the files")
            a_.add_argument("--host", action="append", metavar="NAME", help="a DNS name or IP address the sites "
                            "reach the SuperLink by (repeat; default: localhost and 127.0.0.1)")
            a_.add_argument("--site", action="append", default=[], metavar="NAME", help="make an authentication "
                            "key pair NAME / NAME.pub for a site (repeat)")
        if action == "prepare-site":
            a_.add_argument("file", help="the site's data file in an official layout (e.g. MedMNIST .npz)")
            a_.add_argument("--out", required=True, metavar="FOLDER", help="where to write the three files")
            a_.add_argument("--client-id", type=int, required=True, help="this site's client id (0..K-1)")
            a_.add_argument("--num-classes", type=int, required=True, help="classes of the data set (as all sites)")
            a_.add_argument("--channels", type=int, required=True, help="image channels (3D: the depth)")
            a_.add_argument("--layout", default="medmnist", help="as data.custom's layout (default: %(default)s)")
            a_.add_argument("--val", action="store_true", help="keep the file's val split as a local val split")
        if action == "job":
            a_.add_argument("--params", default="params.yaml", help="the params file (default: %(default)s)")
            overlay(a_)
            for k, h in (("dataset", "a data set of the params (data.datasets)"),
                         ("partition", "a partition of the params (partitions.<name>)"),
                         ("method", "a method of the params (methods)")):
                a_.add_argument(f"--{k}", required=True, help=h)
            a_.add_argument("--seed", type=int, default=1, help="(default: %(default)s)")
            a_.add_argument("--out", default="job.json", help="the JSON file to write (default: %(default)s)")
        if action in ("superlink", "site", "run"):
            a_.add_argument("--certs", metavar="FOLDER", help="TLS: the folder of `deploy certs` (the SuperLink "
                            "reads ca.crt, server.pem, server.key and authenticates sites; a site and run read "
                            "ca.crt)")
            a_.add_argument("--insecure", action="store_true", help="plain HTTP without node authentication: "
                            "for a test on loopback only")
        if action == "superlink":
            a_.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
            a_.add_argument("--port", type=int, default=9092, help="the one HTTP port of the Fleet, Control and "
                            "ServerAppIo APIs (default: %(default)s)")
            a_.add_argument("--home", metavar="FOLDER", help="FLWR_HOME of the SuperLink (default: $FLWR_HOME)")
        if action in ("site", "run"):
            a_.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
            a_.add_argument("--arrays", required=True, help="processed arrays (.npz)")
            a_.add_argument("--samples", required=True, help="the sample table (.samples.parquet)")
            a_.add_argument("--partition-table", required=True, help="the partition table (partition.parquet)")
        if action == "site":
            a_.add_argument("--port", type=int, default=9094, help="the SuperNode's local ClientApp port "
                            "(default: %(default)s)")
            a_.add_argument("--client-ids", default="", metavar="LIST", help="comma-separated client ids this "
                            "site holds (default: every client in its partition table)")
            a_.add_argument("--state-dir", required=True, metavar="FOLDER", help="where the site keeps its "
                            "clients' states and personalized models")
            a_.add_argument("--key", metavar="FILE", help="the site's private authentication key (deploy certs "
                            "--site NAME); its .pub must be registered at the SuperLink")
            a_.add_argument("--device", default="cpu", help="torch device at the site (default: %(default)s)")
        if action == "run":
            a_.add_argument("--job", required=True, help="the job JSON (deploy job)")
            a_.add_argument("--out-dir", required=True, metavar="FOLDER", help="records.parquet, rounds.parquet, "
                            "job.json, final_model.pt (global model), checkpoint.pt while it runs")
            a_.add_argument("--parent", metavar="FILE", help="the study's MLflow parent file "
                            "(results/<study>/mlflow_parent.json) to log the run under")
            a_.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds a round waits for "
                            "the sites (default: %(default)s)")
            a_.add_argument("--secagg", action="store_true", help="sum each round's model upload under Flower's "
                            "SecAgg+: the server sees only the sites' weighted mean (docs/deployment.md)")
            a_.add_argument("--secagg-clip", type=float, default=8.0, metavar="C", help="SecAgg+'s clipping range "
                            "of a site's update (weight/max weight x (upload - download)); a site whose update "
                            "leaves it stops the round (default: %(default)s)")

    s = command("check-params", cmd_check_params)
    s.add_argument("params", nargs="?", default="params.yaml", help="the params file (default: %(default)s)")
    overlay(s)

    s = command("doctor", cmd_doctor)
    s.add_argument("params", nargs="?", default="params.yaml", help="the params file (default: %(default)s)")
    overlay(s)
    s.add_argument("--no-pipeline", action="store_true", help="skip the dvc status / snakemake dry-run checks")

    s = command("sync", cmd_sync)
    overlay(s)

    s = command("synthetic", cmd_synthetic)
    s.add_argument("--out", required=True, metavar="NPZ", help=".npz file to write")
    s.add_argument("--num-classes", type=int, default=4, metavar="N", help="classes (default: %(default)s)")
    s.add_argument("--n-channels", type=int, default=3, metavar="N", help="image channels (default: %(default)s)")
    s.add_argument("--size", type=int, default=28, metavar="PX", help="image side in pixels (default: %(default)s)")
    s.add_argument("--train", type=int, default=400, metavar="N", help="train images (default: %(default)s)")
    s.add_argument("--val", type=int, default=40, metavar="N", help="val images (default: %(default)s)")
    s.add_argument("--test", type=int, default=120, metavar="N", help="test images (default: %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default: %(default)s)")
    return p


def unknown_command(argv: list[str]) -> str | None:
    """The one-line error for a mistyped command in ``argv``, naming the nearest commands; None if
    the first non-option word is a command (or there is none: argparse reports that)."""
    import difflib

    word = next((a for a in argv if not a.startswith("-")), None)
    names = [*USER_COMMANDS, *STAGE_COMMANDS]
    if word is None or word in names:
        return None
    near = difflib.get_close_matches(word, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}?" if near else f"the commands are {', '.join(names)}"
    return f"medpfl: error: unknown command {word!r}; {hint} (medpfl --help lists them)"


def known_errors() -> tuple[type[BaseException], ...]:
    """The exceptions ``main`` reports as one ``error:`` line with exit status 2."""
    return (*PROJECT_ERRORS, FileNotFoundError, json.JSONDecodeError)


def main(argv: list[str] | None = None) -> int:
    """Run ``medpfl argv`` (default: ``sys.argv[1:]``); return the exit status: 2 for a mistyped
    command or a known error, else the command's own status (argparse itself exits 2 on bad options)."""
    os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")
    argv = sys.argv[1:] if argv is None else list(argv)
    if bad := unknown_command(argv):
        print(bad, file=sys.stderr)
        return 2
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
