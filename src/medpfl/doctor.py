"""``medpfl doctor``: check a setup before spending GPU hours; ``medpfl sync``: re-align
Snakemake with DVC after switching versions.

Checks: the params file validates; each data set's raw file is present with the official MD5
(or a mirror has it, or the network will be needed); the MLflow store answers (a SQLite store
that does not exist yet is reported missing, never created; a tracking server answers
``/health`` and a search through its API, so its database is up too), and the study's parent
run is in that store; a GPU is
visible (informational), and which GPUs training jobs hold (``medpfl.gpus`` locks, where GPUs
are shared out on this machine); DVC's stages are up to date and Snakemake has nothing to do. Each
check prints ``ok``, ``warn`` or ``FAIL`` with what to do; the exit status is 1 if any failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Check:
    name: str
    status: str  # ok | warn | FAIL
    detail: str


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check_params(params_file: Path, overlays: list[str]) -> tuple[Check, object]:
    from medpfl.compose import load_params
    from medpfl.config import ParamsError

    try:
        p = load_params(params_file, overlays)
        return Check("params", "ok", f"{params_file} valid (study {p.study})"), p
    except ParamsError as e:
        return Check("params", "FAIL", str(e)), None


def check_data(params, root: Path) -> list[Check]:
    from medpfl.data.sources import checksum_ok, dataset_spec, default_mirrors
    from medpfl.io import md5sum

    out = []
    for name in params.data.datasets:
        custom = {k: v.model_dump() for k, v in params.data.custom.items()}
        spec = dataset_spec(name, custom)
        if spec.layout == "synthetic":
            out.append(Check(f"data {name}", "ok", "generated locally by the download stage (no file to fetch)"))
            continue
        raw = root / "data" / "raw" / spec.raw_filename
        if raw.exists():
            got = md5sum(raw)
            if checksum_ok(raw, spec):
                out.append(Check(f"data {name}", "ok", f"{raw} MD5 {got}"))
            else:
                out.append(Check(f"data {name}", "FAIL", f"{raw} MD5 {got}, expected {spec.md5}: delete it and re-run "
                                 "`snakemake data_all --cores all`"))
            continue
        mirrors = [m / spec.filename for m in default_mirrors(root) if (m / spec.filename).exists()]
        if mirrors:
            ok = checksum_ok(mirrors[0], spec)
            out.append(Check(f"data {name}", "ok" if ok else "FAIL",
                             f"not downloaded yet; mirror {mirrors[0]} {'has the right MD5' if ok else 'has a WRONG MD5'}"))
        else:
            out.append(Check(f"data {name}", "warn", f"not downloaded and no mirror: the download stage will fetch "
                             f"{spec.url} (set MEDPFL_DATA_MIRROR for offline machines)"))
    return out


def check_mlflow(in_project: bool = True) -> Check:
    """Does the tracking store (``$MLFLOW_TRACKING_URI``, else ``mlruns.db`` here) answer? A
    SQLite store that does not exist yet is reported missing and is not created: opening it with
    MLflow would create the file and its tables (the ``mlflow-init`` stage does that on purpose).
    ``in_project``: the current folder holds the params file, so the first ``snakemake`` run will
    create the store here; outside a project a missing store is only reported."""
    from medpfl.tracking import TrackingError, check_reachable, default_tracking_uri

    uri = default_tracking_uri()
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.exists():
            if not path.parent.is_dir():
                return Check("mlflow", "FAIL", f"{uri}: missing, and its folder {path.parent} does not exist, so "
                             "mlflow-init cannot create it: create the folder or set MLFLOW_TRACKING_URI")
            if in_project:
                return Check("mlflow", "warn", f"{uri}: missing (created by the first `snakemake` run, in its "
                             "mlflow_init job)")
            return Check("mlflow", "warn", f"{uri}: missing (no params file here, so this is not a project "
                         "folder: run `medpfl doctor` in the project)")
    try:
        check_reachable(uri)
        if uri.startswith(("http://", "https://")):
            server_api_readable(uri)
            return Check("mlflow", "ok", f"{uri} answers (a tracking server: /health and its database)")
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).search_experiments(max_results=1)
        return Check("mlflow", "ok", f"{uri} readable")
    except (TrackingError, Exception) as e:
        return Check("mlflow", "FAIL", f"{uri}: {e}")


def server_api_readable(uri: str, timeout: float = 10.0) -> None:
    """Search one experiment through the REST API of the tracking server at ``uri`` (one request,
    no retries: MLflow's client retries a failing server for minutes). ``/health`` answers
    without the database; this request needs it. Raises :class:`~medpfl.errors.TrackingError`
    with the server's answer when it fails."""
    import urllib.error
    import urllib.request

    from medpfl.errors import TrackingError

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = " ".join(e.read().decode(errors="replace").split())[:300]
        raise TrackingError(f"{uri} answers /health but its API fails (HTTP {e.code} on {url}: {body}); "
                            "is its database up? (medpfl tracking-server status --dir ...)") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise TrackingError(f"{uri}: the API request {url} failed ({e})") from None


def check_study_store(params, root: Path) -> Check | None:
    """Is the study's MLflow parent run (``results/<study>/mlflow_parent.json``) in the store new
    runs would use (``$MLFLOW_TRACKING_URI``, else ``mlruns.db`` here)? Every job logs where its
    parent is, so after switching stores (to a tracking server, say) the study stays in the old
    one until the parent file is deleted. None when the study has no parent yet."""
    from medpfl.tracking import default_tracking_uri

    parent_file = root / "results" / params.study / "mlflow_parent.json"
    if not parent_file.is_file():
        return None
    try:
        parent_uri = json.loads(parent_file.read_text())["tracking_uri"]
    except (ValueError, KeyError, TypeError) as e:
        return Check("mlflow study", "FAIL", f"{parent_file}: unreadable ({e}); delete it (the mlflow_init job "
                     "writes it again)")
    uri = default_tracking_uri(root)
    if parent_uri == uri:
        return Check("mlflow study", "ok", f"study {params.study}'s parent run is in {uri}")
    return Check("mlflow study", "warn", f"study {params.study}'s parent run ({parent_file}) is in {parent_uri}, not "
                 f"in {uri}: its jobs keep logging to {parent_uri}. To track it in {uri}, delete {parent_file} "
                 "(the mlflow_init job creates a parent there; the runs already logged stay where they are)")


def check_gpu() -> Check:
    import torch

    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("gpu", "ok", f"CUDA {torch.version.cuda}: {names}")
    return Check("gpu", "warn", "no CUDA device visible: training runs on the CPU (train.device auto)")


def check_gpu_locks() -> Check | None:
    """The GPU locks of ``medpfl.gpus`` (several GPUs on one machine): which GPUs training jobs
    hold now and by whom, from the lock folder (``$MEDPFL_GPU_LOCK_DIR``); None where there is
    no GPU to share out (no ``nvidia-smi`` and ``MEDPFL_GPUS`` unset), or when a scheduler
    assigns the GPUs (``CUDA_VISIBLE_DEVICES`` set: no lock is taken). ``warn`` when every GPU is
    held (the next training job waits up to ``MEDPFL_GPU_WAIT`` seconds), ``FAIL`` for a bad
    ``MEDPFL_GPUS``."""
    from medpfl.errors import GpuError
    from medpfl.gpus import gpu_locks, lock_dir

    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return None
    try:
        locks = gpu_locks()
    except GpuError as e:
        return Check("gpu locks", "FAIL", str(e))
    if not locks:
        return None
    held = [(g, h) for g, h in locks if h is not None]
    free = [g for g, h in locks if h is None]
    detail = (f"{lock_dir()}: free {', '.join(free) or 'none'}"
              + "".join(f"; GPU {g} held by {h}" for g, h in held))
    if not free:
        detail += "; every GPU is held: the next training job waits for one (MEDPFL_GPU_WAIT)"
    return Check("gpu locks", "ok" if free else "warn", detail)


def check_pipeline(root: Path, overlays: list[str]) -> list[Check]:
    out = []
    if shutil.which("dvc") and (root / ".dvc").is_dir():
        r = _run(["dvc", "status", "--json"])
        if r.returncode != 0:
            out.append(Check("dvc", "FAIL", r.stderr.strip()[-500:]))
        else:
            changed = json.loads(r.stdout or "{}")
            out.append(Check("dvc", "ok" if not changed else "warn",
                             "all stages up to date" if not changed else f"stages to run: {', '.join(changed)} (`dvc repro`)"))
    cmd = ["snakemake", "--dry-run", "--quiet", "rules", "--cores", "1"]
    for ov in overlays:
        cmd += ["--configfile", ov]
    r = _run(cmd)
    if r.returncode != 0:
        out.append(Check("snakemake", "FAIL", (r.stderr or r.stdout).strip()[-800:]))
    elif "Nothing to be done" in r.stdout + r.stderr or not (r.stdout + r.stderr).strip():
        out.append(Check("snakemake", "ok", "nothing to be done"))
    else:
        pending = " ".join((r.stdout + r.stderr).split())[-400:]
        out.append(Check("snakemake", "warn", f"jobs to run: {pending}. If DVC is up to date but Snakemake wants to "
                         "re-run, its metadata is stale (after git checkout + dvc checkout): run `medpfl sync`"))
    return out


def doctor(params_file: Path = Path("params.yaml"), overlays: list[str] = (), pipeline: bool = True) -> int:
    """Run the checks from the current folder, print one line per check, and return 1 if any
    failed, else 0. It creates no file (a missing MLflow store is reported, not created)."""
    root = Path.cwd()
    checks: list[Check] = []
    c, params = check_params(params_file, list(overlays))
    checks.append(c)
    if params is not None:
        checks += check_data(params, root)
    checks.append(check_mlflow(in_project=Path(params_file).is_file()))
    if params is not None and (study := check_study_store(params, root)) is not None:
        checks.append(study)
    checks.append(check_gpu())
    if (locks := check_gpu_locks()) is not None:
        checks.append(locks)
    if pipeline and params is not None:
        checks += check_pipeline(root, list(overlays))
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.status:>4}  {c.name:<{width}}  {c.detail}")
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def sync(overlays: list[str] = ()) -> int:
    """``dvc checkout`` then ``snakemake --touch``: after ``git checkout <rev>``, make the
    workspace's data match ``dvc.lock`` and tell Snakemake the restored files are current."""
    steps = [["dvc", "checkout"], ["snakemake", "--touch", "--cores", "1"] + [a for ov in overlays for a in ("--configfile", ov)]]
    for cmd in steps:
        print("+", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, env=os.environ.copy())
        if r.returncode != 0:
            print(f"medpfl sync: `{' '.join(cmd)}` failed with status {r.returncode}")
            return r.returncode
    return 0
