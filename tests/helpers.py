"""Helpers for the end-to-end tests (test_pipeline.py, test_dvc.py, test_cli_errors.py).

Everything runs in temporary folders: a tiny synthetic data set in the official MedMNIST
``.npz`` layout, a ``params.yaml`` that declares it as a custom data set, and a throw-away
SQLite MLflow store. Nothing is written in the repository.
"""

from __future__ import annotations

import hashlib
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
BIN = Path(sys.executable).parent  # the venv's bin: medpfl, snakemake, dvc

# Smallest settings that still exercise every stage: 4 clients, 2 rounds, half participation.
SYNTH_COUNTS = {"train": 160, "val": 16, "test": 48}
TINY_TRAIN = {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 16, "executor": "sequential",
              "device": "cpu"}


def md5(path: Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def copy_repo(dst: Path) -> Path:
    """Copy the repository's tracked files (working-tree content) to ``dst``; return ``dst``.

    Tests run this snapshot of the workflow: the rules' code-hash params then cannot change
    under a running test when someone edits the package meanwhile.
    """
    dst = Path(dst)
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():  # skip files tracked but deleted in the working tree
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    assert (dst / "Snakefile").is_file() and (dst / "dvc.yaml").is_file()
    return dst


def tool(name: str) -> str:
    """The venv's console script (``medpfl``, ``snakemake``, ``dvc``), else the one on PATH."""
    p = BIN / name
    if p.exists():
        return str(p)
    found = shutil.which(name)
    assert found, f"{name} not found next to {sys.executable} nor on PATH"
    return found


def make_env(tmp: Path, mirror: Path | None = None) -> dict[str, str]:
    """Subprocess environment: a tmp MLflow store, no data mirror, the venv first on PATH."""
    env = dict(os.environ)
    env.update({
        "MLFLOW_TRACKING_URI": f"sqlite:///{Path(tmp).resolve()}/mlruns.db",
        "MEDPFL_DATA_MIRROR": str(mirror) if mirror else "",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "DISABLE_PANDERA_IMPORT_WARNING": "True",
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "medpfl-tests",
        "GIT_AUTHOR_EMAIL": "tests@example.invalid",
        "GIT_COMMITTER_NAME": "medpfl-tests",
        "GIT_COMMITTER_EMAIL": "tests@example.invalid",
    })
    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(var, None)  # would hijack the parent/child runs
    return env


def write_synthetic(path: Path, seed: int = 0) -> dict:
    """A tiny synthetic set (4 classes, 3 channels, 28 px); returns its custom-data-set entry."""
    from medpfl.data.synthetic import write_synthetic_npz

    path = Path(path)
    digest = write_synthetic_npz(path, num_classes=4, n_channels=3, size=28,
                                 counts=(SYNTH_COUNTS["train"], SYNTH_COUNTS["val"], SYNTH_COUNTS["test"]), seed=seed)
    return {"path": str(path.resolve()), "md5": digest, "n_channels": 3, "num_classes": 4}


def tiny_params(synth: dict, study: str = "ci", methods=("fedavg", "local"), seeds=(1,), **train) -> dict:
    """The repository's ``params.yaml`` with the tiny synthetic study swapped in.

    Starting from the real file keeps every section that ``dvc.yaml`` lists under ``params:``
    (DVC fails when one is missing, even where the schema has a default).
    """
    base = yaml.safe_load((REPO / "params.yaml").read_text()) or {}
    base.update({
        "study": study,
        "data": {"datasets": ["synth"], "custom": {"synth": synth}},
        "partitions": {"d": {"num_clients": 4, "alpha": 0.5, "min_samples": 5}},
        "methods": list(methods),
        "seeds": list(seeds),
    })
    base["train"] = {**(base.get("train") or {}), **TINY_TRAIN, **train}
    base["eval"] = {**(base.get("eval") or {}), "every": 1, "batch_size": 256}
    base.setdefault("method_params", {})
    return base


def write_params(folder: Path, params: dict) -> Path:
    p = Path(folder) / "params.yaml"
    p.write_text(yaml.safe_dump(params, sort_keys=False))
    return p


def read_params(folder: Path) -> dict:
    return yaml.safe_load((Path(folder) / "params.yaml").read_text())


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600, check: bool = True,
        merge: bool = False) -> subprocess.CompletedProcess:
    """Run a command; on an unexpected exit status fail with its output (and any job logs).

    ``merge``: stderr goes into ``stdout``, in order (Snakemake logs to stderr, DVC to stdout).
    """
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        logs = ""
        for log in sorted(Path(cwd).glob("logs/**/*.log")) + sorted(Path(cwd).glob("results/**/*.log")):
            logs += f"\n--- {log}\n{log.read_text()[-3000:]}"
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{(proc.stderr or '')[-6000:]}{logs}")
    return proc


def snakemake(workdir: Path, *args: str, env: dict, check: bool = True, snakefile: Path = SNAKEFILE,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """``snakemake -s <repo Snakefile> --directory <workdir> --cores 2 <args>``."""
    cmd = [tool("snakemake"), "-s", str(snakefile), "--directory", str(workdir), *args]
    if not any(a in ("--lint", "--cores", "-c") or a.startswith("--cores") for a in args):
        cmd += ["--cores", "2"]
    return run(cmd, cwd=workdir, env=env, check=check, timeout=timeout, merge=True)


JOB_STATS_RE = re.compile(r"Job stats:\njob\s+count\n[- ]+\n(?P<rows>(?:\S+\s+\d+\n)+)")


def job_stats(output: str) -> dict[str, int]:
    """``{rule: count}`` from the first 'Job stats' table of a Snakemake log (without 'total')."""
    m = JOB_STATS_RE.search(output)
    if not m:
        return {}
    rows = (line.split() for line in m.group("rows").splitlines())
    return {r[0]: int(r[1]) for r in rows if r[0] != "total"}


PLANNED_JOB_RE = re.compile(r"^(?:local)?rule (?P<rule>\w+):\n(?P<body>(?:    .*\n)*)", re.M)


def planned_jobs(output: str) -> list[tuple[str, dict[str, str]]]:
    """``[(rule, wildcards)]`` for every job block that Snakemake printed (dry run or real run)."""
    jobs = []
    for m in PLANNED_JOB_RE.finditer(output):
        wc: dict[str, str] = {}
        w = re.search(r"^    wildcards: (.*)$", m.group("body"), re.M)
        if w:
            for part in w.group(1).split(", "):
                k, _, v = part.partition("=")
                wc[k] = v
        jobs.append((m.group("rule"), wc))
    return jobs


def snapshot(root: Path, pattern: str = "**/*") -> dict[str, tuple[int, str]]:
    """``{relative path: (mtime_ns, md5)}`` of the files under ``root`` matching ``pattern``."""
    root = Path(root)
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, md5(p))
            for p in sorted(root.glob(pattern)) if p.is_file()}


def mlflow_client(workdir_or_uri):
    from mlflow.tracking import MlflowClient

    uri = workdir_or_uri if str(workdir_or_uri).startswith("sqlite:") else \
        f"sqlite:///{Path(workdir_or_uri).resolve()}/mlruns.db"
    return MlflowClient(tracking_uri=uri)


def study_runs(client, experiment: str = "medpfl"):
    """``(parents, children)``: runs tagged ``medpfl.role=study`` and all others, in ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"MLflow experiment {experiment!r} was not created"
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("medpfl.role") == "study"]
    children = [r for r in runs if r.data.tags.get("medpfl.role") != "study"]
    return parents, children





def low_rank_delta(params: dict, gen) -> dict:
    """A model-shaped update with a decaying spectrum: for each tensor of 2+ dims, a rank-j
    (j = min(6, rows)) product with amplitudes 1e-2 * 2^-i, i < j, reshaped to the tensor's
    shape; 1-D tensors get 1e-2 N(0, 1). Draws from ``gen`` (a torch.Generator) in key order.
    Compression tests (FedKD, FedMIC) send it: each client keeps its leading components, the
    mean of two clients has more and the server truncates it again."""
    import torch

    delta = {}
    for k, v in params.items():
        if v.dim() >= 2:
            rows, cols = v.shape[0], v[0].numel()
            j = min(6, rows)
            a, b = torch.randn(rows, j, generator=gen), torch.randn(j, cols, generator=gen)
            delta[k] = (1e-2 * (a * 0.5 ** torch.arange(j)) @ b).reshape(v.shape)
        else:
            delta[k] = 1e-2 * torch.randn(v.shape, generator=gen)
    return delta


def generated_configs(script: str, tmp: Path) -> list[str]:
    """Run ``scripts/<script>`` in a bare copy under ``tmp`` (only the script, empty ``config/`` and
    ``config/papers/``), assert that every YAML file it writes equals the committed file of the
    same path, and return the written paths (relative, sorted) for the caller to check the set."""
    fake = tmp / "repo"
    (fake / "scripts").mkdir(parents=True)
    (fake / "config" / "papers").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / script, fake / "scripts")
    runpy.run_path(str(fake / "scripts" / script), run_name="__main__")
    written = sorted(str(q.relative_to(fake)) for q in (fake / "config").rglob("*.yaml"))
    for rel in written:
        assert (fake / rel).read_text() == (REPO / rel).read_text(), rel
    return written
