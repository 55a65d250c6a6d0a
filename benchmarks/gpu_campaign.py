#!/usr/bin/env python3
"""The GPU campaign in one command per part: ``prepare`` here, ``run`` on the GPU machine,
``collect`` here.

    python benchmarks/gpu_campaign.py prepare                  # here: builds .gpu/ (the carry), checks 64 MiB
    python benchmarks/gpu_campaign.py size                     # here: the 64 MiB check alone
    python3 benchmarks/gpu_campaign.py run --part 1 2          # there: each part writes $OUT/part<N>-<name>.json
    python benchmarks/gpu_campaign.py collect DIR ...          # here: benchmarks/results/<gpu>-<date>.json/.md

The parts (each can be re-run alone and writes its own results file; ``benchmarks/README.md``,
"GPU campaign", has the tool calls and the expected minutes):

1. ``tests``: ``tests/test_gpu.py`` and ``tests/test_gpu_methods.py`` (every method, stacked
   against sequential on the device, with the tolerance stated there), through pytest.
2. ``executors``: the executors' throughput (``benchmarks/executors.py``'s round, measured
   harder: warm-up apart, >= 5 rounds per executor in alternating blocks, median and spread,
   samples/s, ms per client-step, peak memory; the m-sweep 2 -> 500 clients per round with a
   line fit; every client's model evaluated with a fixed batch against ``eval.memory_fraction``;
   eager against CUDA graphs, ``train.cuda_graphs``, capture time apart; not run on a CPU).
3. ``pfllib``: PFLlib's FedAvg beside medpfl's on the same clients and device
   (``../shared/tools/peer-pfllib``, carried with PFLlib's ``system/`` in ``.gpu/pfllib``); says
   so in its file when PFLlib was not carried.
4. ``table1``: the FedKPer Table 1 BloodMNIST study (``config/fedkper-table1.yaml`` +
   ``-cpu.yaml``: 13 methods x 3 seeds x 100 rounds), every job through medpfl's own CLI
   (``medpfl train`` then ``evaluate``; no Snakemake, no MLflow: neither is on the GPU machine),
   several jobs at a time; ``--shard i/n`` runs every n-th job; ``--stack-seeds`` runs each
   method's seeds as one process and one computation (``train.stack_seeds``), and shards by
   method; the runs come back as a tarball
   and ``collect`` builds the study's report here.
5. ``large``: a few rounds of ViT-B/16 + LoRA at 224 px (FHBench's setting) and ResNet-101 at
   64 px (FedMIC's), pretrained weights if cached, else random: seconds per round, peak memory.

What the GPU machine lacks travels in the carry folder ``.gpu/`` (``prepare``): wheels of
pydantic, pandera and their needs for CPython 3.12 / manylinux x86-64, the official
``bloodmnist.npz`` (preprocessed there in seconds, MD5-checked), the sample table and the
partitions the parts use, PFLlib's ``system/`` and the peer harness. ``run`` installs the wheels
into ``/tmp`` only when pydantic or pandera cannot be imported.

A dry run on a CPU (``run --part all --device cpu --rounds 1 --dry-run``) runs every part at
tiny sizes (fewer methods, clients, epochs and sweep points): it proves each part starts and
writes its file; its timings are no measurements.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
LIMIT_MIB = 64
CARRY = ".gpu"
#: the parts by number: (name, what the results file holds)
PARTS = {1: "tests", 2: "executors", 3: "pfllib", 4: "table1", 5: "large"}
#: keys every part's results file has, and each part's own ``result`` keys (tests check them)
COMMON_KEYS = ("campaign", "part", "name", "status", "dry_run", "device", "machine", "args", "started", "wall_s",
               "result", "error", "notes")
RESULT_KEYS = {
    1: ("command", "tolerance", "summary", "tests"),
    2: ("protocol", "cuda_init_s", "fedkper_round", "m_sweep", "graphs"),
    3: ("present", "reason", "sequence", "runs", "ratios"),
    4: ("study", "shard", "jobs_total", "parallel", "wall_s", "sum_job_wall_s", "runs"),
    5: ("runs",),
}
#: what the GPU machine lacks (KINDS.md): carried as wheels, pinned as in requirements.lock
#: medmnist: its ``info.py`` names the data sets (``medpfl.data.sources`` reads it without importing the
#: package, which needs torchvision); missing there, validating params fails (the first GPU call, 2026-11-25)
WHEELS = ("pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions", "pandera",
          "typeguard", "typing-inspect", "mypy_extensions", "medmnist")
#: PFLlib's utils/mem_utils imports calmsize; PyPI has only its sdist: built into a wheel here
SDISTS = ("calmsize==0.1.3",)
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64")
#: the partitions the parts read, built here by medpfl's partition stage: (name, overlays)
PARTITIONS = (("dir0.1", ()),  # the default study's: the peer harness's clients (part 3)
              ("fedkper-dir0.1", ("config/fedkper-table1.yaml", "config/fedkper-table1-cpu.yaml")))  # part 4
PFLLIB_MIRROR = Path("/work/.mirror/TsingZ0+PFLlib/repo")
HARNESS = ROOT.parent / "shared" / "tools" / "peer-pfllib"
SITE = Path(os.environ.get("MEDPFL_CAMPAIGN_SITE", "/tmp/medpfl-campaign-site"))


class CampaignError(RuntimeError):
    """A known failure of the campaign's own set-up (named input missing, carry over its limit)."""


def log(msg: str) -> None:
    print(f"[campaign {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


# ----------------------------------------------------------------------------- the 64 MiB check
def _entry_bytes(p: Path) -> int:
    if p.is_symlink():
        return len(os.readlink(p))
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(_entry_bytes(q) for q in p.rglob("*") if q.is_symlink() or q.is_file())
    return 0


def tree_files(root: Path) -> list[Path]:
    """What the device tool sends of a checkout: tracked and untracked-not-ignored files (git's
    view), plus a ``shared/`` folder inside it."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    files = [root / p for p in out.split("\0") if p]
    shared = root / "shared"
    if shared.is_dir():
        files += [q for q in shared.rglob("*") if q.is_file() or q.is_symlink()]
    return sorted(set(files))


def travel_size(root: Path, carry: list[Path], limit_mib: float = LIMIT_MIB) -> dict:
    """Bytes of the working tree that travels and of the carried paths, against the limit.
    ``biggest``: the tree's top-level folders (``results/<study>`` one level deeper) by size."""
    carry = [c.resolve() for c in carry]
    tree = 0
    groups: dict[str, int] = {}
    for f in tree_files(root):
        if not (f.exists() or f.is_symlink()) or any(f.resolve() == c or c in f.resolve().parents for c in carry):
            continue
        n = _entry_bytes(f)
        tree += n
        rel = f.relative_to(root).parts
        key = "/".join(rel[:2]) if rel[0] == "results" and len(rel) > 2 else rel[0]
        groups[key] = groups.get(key, 0) + n
    carried = {str(c.relative_to(root) if c.is_relative_to(root) else c): _entry_bytes(c) for c in carry}
    total = tree + sum(carried.values())
    return {"tree_bytes": tree, "carry_bytes": carried, "total_bytes": total, "limit_bytes": int(limit_mib * MIB),
            "ok": total <= limit_mib * MIB,
            "biggest": sorted(groups.items(), key=lambda kv: -kv[1])[:8]}


def print_size(rep: dict) -> None:
    mib = lambda n: f"{n / MIB:8.2f} MiB"  # noqa: E731
    print(f"working tree (tracked + untracked, not ignored): {mib(rep['tree_bytes'])}")
    for name, n in rep["carry_bytes"].items():
        print(f"carry {name + ':':<42} {mib(n)}")
    print(f"{'total:':<48} {mib(rep['total_bytes'])}   limit {rep['limit_bytes'] / MIB:.0f} MiB -> "
          f"{'OK' if rep['ok'] else 'OVER THE LIMIT'}")
    if not rep["ok"]:
        print("largest parts of the tree:")
        for k, n in rep["biggest"]:
            print(f"  {k:<44} {mib(n)}")


def ensure_ignored(root: Path, carry: Path, add_exclude: bool) -> None:
    """The carry folder must be ignored by git in the checkout the device tool sends (else it
    travels as untracked files and cannot be named in ``carry``). ``.gitignore`` lists ``/.gpu/``;
    in a checkout whose ``.gitignore`` predates that, ``--add-exclude`` appends the one line
    ``/.gpu/`` to that checkout's ``.git/info/exclude``."""
    rel = carry.relative_to(root)
    if subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(rel) + "/"]).returncode == 0:
        return
    exclude = Path(subprocess.run(["git", "-C", str(root), "rev-parse", "--git-path", "info/exclude"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else root / exclude
    line = f"/{rel.as_posix()}/"
    if not add_exclude:
        raise CampaignError(f"{rel}/ is not ignored by git here, so it would travel as untracked files: run "
                            f"`echo {line} >> {exclude}` (or prepare --add-exclude)")
    with open(exclude, "a") as f:
        f.write(f"\n{line}\n")
    log(f"added {line} to {exclude}")


# ----------------------------------------------------------------------------- prepare (here)
def lock_pins(names) -> dict[str, str]:
    """``name -> version`` from requirements.lock (names compared with - and _ alike)."""
    norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            n, v = line.split("==", 1)
            pins[norm(n)] = v.strip()
    missing = [n for n in names if norm(n) not in pins]
    if missing:
        raise CampaignError(f"requirements.lock has no pin for {missing}")
    return {n: pins[norm(n)] for n in names}


def download_wheels(dest: Path, python_version: str = "3.12") -> list[dict]:
    """The pinned wheels for CPython ``python_version`` on manylinux x86-64 (the device README's
    ``pip download`` command), plus the sdists of :data:`SDISTS` built into pure-Python wheels."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = lock_pins(WHEELS)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *[a for p in PIP_PLATFORMS for a in ("--platform", p)],
           "-d", str(dest), *[f"{n}=={v}" for n, v in pins.items()]]
    log("pip download " + " ".join(f"{n}=={v}" for n, v in pins.items()))
    subprocess.run(cmd, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SDISTS:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp,
                            spec], check=True)
            for sd in Path(tmp).glob("*.tar.gz"):
                subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                                "-w", str(dest), str(sd)], check=True)
                sd.unlink()
    wheels = sorted(dest.glob("*.whl"))
    names = [w.name.split("-")[0].lower() for w in wheels]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise CampaignError(f"{dest}: more than one wheel of {sorted(dupes)} (remove the old ones)")
    return [{"file": w.name, "bytes": w.stat().st_size, "md5": md5(w)} for w in wheels]


def find_raw(raw: str | None) -> Path:
    if raw:
        return Path(raw)
    from medpfl.data.sources import default_mirrors

    for p in [ROOT / "data" / "raw" / "bloodmnist.npz", *[m / "bloodmnist.npz" for m in default_mirrors(ROOT)]]:
        if p.is_file():
            return p
    raise CampaignError("bloodmnist.npz not found in data/raw/ nor in ../shared/data/medmnist (give --raw FILE)")


def prepare_data(dest: Path, raw: Path) -> dict:
    """``dest/bloodmnist.npz`` (the official file, MD5-checked), the sample table, and
    :data:`PARTITIONS` built by medpfl's own partition stage; MD5s of the processed arrays and
    tables (the GPU side preprocesses again and compares)."""
    from medpfl.cli import main as medpfl_main
    from medpfl.compose import load_params
    from medpfl.config import partition_job
    from medpfl.data.preprocess import preprocess
    from medpfl.data.sources import checksum_ok, dataset_spec

    spec = dataset_spec("bloodmnist")
    if not checksum_ok(raw, spec):
        raise CampaignError(f"{raw}: MD5 is not the official one ({spec.md5})")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "bloodmnist.npz"
    if not (target.is_file() and md5(target) == spec.md5):
        shutil.copyfile(raw, target)
    out = {"dataset": "bloodmnist", "raw": "bloodmnist.npz", "raw_md5": spec.md5, "num_classes": spec.num_classes,
           "n_channels": spec.n_channels, "layout": spec.layout, "norm": list(spec.norm) if spec.norm else None,
           "class_names": list(spec.class_names) if spec.class_names else None, "partitions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        arrays, samples = Path(tmp) / "bloodmnist.npz", dest / "bloodmnist.samples.parquet"
        preprocess(target, arrays, samples, spec.num_classes, spec.n_channels, layout=spec.layout, norm=spec.norm,
                   class_names=spec.class_names)
        out["arrays_md5"], out["samples_md5"] = md5(arrays), md5(samples)
        for name, overlays in PARTITIONS:
            params = load_params(ROOT / "params.yaml", [ROOT / o for o in overlays])
            job = partition_job(params, "bloodmnist", name)
            pdir = dest / "partitions" / name
            rc = medpfl_main(["partition", "--job", json.dumps(job), "--arrays", str(arrays), "--samples", str(samples),
                              "--out-dir", str(pdir)])
            if rc:
                raise CampaignError(f"partition {name} failed ({rc})")
            out["partitions"][name] = {"overlays": list(overlays), "md5": md5(pdir / "partition.parquet")}
    return out


def prepare_pfllib(dest: Path, git_dir: Path | None, harness: Path) -> dict:
    """PFLlib's ``system/`` (from a fetched git directory: ``git archive HEAD:system``; PFLlib is
    never committed here) and the peer harness (``../shared/tools/peer-pfllib``)."""
    out: dict = {"present": False}
    if git_dir is None or not git_dir.exists():
        out["reason"] = f"no fetched PFLlib git directory ({git_dir}); fetch github:TsingZ0/PFLlib, give --pfllib-git"
        return out
    if not harness.is_dir():
        out["reason"] = f"no peer harness at {harness}"
        return out
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "PFLlib").mkdir(parents=True)
    commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    arch = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "--prefix=system/", "HEAD:system"],
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest / "PFLlib")], input=arch, check=True)
    shutil.copytree(harness, dest / "harness", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for p in (dest / "harness").rglob("*"):  # the shared copy is read-only
        p.chmod(p.stat().st_mode | 0o200)
    out.update(present=True, commit=commit, source="https://github.com/TsingZ0/PFLlib (system/ only)",
               files=sum(1 for _ in (dest / "PFLlib").rglob("*.py")))
    return out


def cmd_prepare(a) -> int:
    root = ROOT
    carry = (root / a.carry).resolve()
    ensure_ignored(root, carry, a.add_exclude)
    carry.mkdir(exist_ok=True)
    sys.path[:0] = [str(root / "src"), str(root)]
    manifest = {"created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "commit": subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip(),
                "python_target": a.python_version}
    if a.no_wheels:
        shutil.rmtree(carry / "wheels", ignore_errors=True)
        manifest["wheels"] = []
    else:
        manifest["wheels"] = download_wheels(carry / "wheels", a.python_version)
    manifest["data"] = prepare_data(carry / "data", find_raw(a.raw))
    if a.no_pfllib:
        shutil.rmtree(carry / "pfllib", ignore_errors=True)
        manifest["pfllib"] = {"present": False, "reason": "prepare --no-pfllib"}
    else:
        manifest["pfllib"] = prepare_pfllib(carry / "pfllib", Path(a.pfllib_git) if a.pfllib_git else None,
                                            Path(a.harness))
    (carry / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if not manifest["pfllib"]["present"]:
        log(f"PFLlib not carried: {manifest['pfllib']['reason']} (part 3 will say so)")
    rep = travel_size(root, [carry], a.limit_mib)
    print_size(rep)
    return 0 if rep["ok"] else 3


def cmd_size(a) -> int:
    rep = travel_size(ROOT, [(ROOT / c).resolve() for c in a.carry], a.limit_mib)
    print_size(rep)
    return 0 if rep["ok"] else 3


# ----------------------------------------------------------------------------- run (there)
@dataclass
class Ctx:
    device: str
    rounds: int | None
    dry_run: bool
    out: Path
    work: Path
    carry: Path
    deadline: float
    shard: tuple[int, int] = (1, 1)
    jobs: int = 0
    tests_k: str | None = None
    stack_seeds: bool = False
    notes: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def setup_python(carry: Path) -> dict:
    """Make medpfl importable without an install: ``src`` and the repository on ``sys.path``
    (and on ``PYTHONPATH`` for the parts' subprocesses); the carried wheels installed into
    :data:`SITE` when pydantic or pandera is missing (the GPU machine), else only those of the
    wheels whose module is missing (calmsize for PFLlib on a CPU)."""
    wheels = sorted((carry / "wheels").glob("*.whl"))
    core_missing = [m for m in ("pydantic", "pandera") if importlib.util.find_spec(m) is None]
    if core_missing:
        todo = wheels
        if not todo:
            raise CampaignError(f"{core_missing} cannot be imported and {carry}/wheels holds no wheels: run prepare "
                                "here and carry the folder")
    else:
        todo = [w for w in wheels if importlib.util.find_spec(w.name.split("-")[0]) is None]
    if todo:
        log(f"installing {len(todo)} carried wheels into {SITE}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, todo)], check=True)
    paths = ([str(SITE)] if SITE.is_dir() else []) + [str(ROOT / "src"), str(ROOT)]
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")
    os.environ["PYTHONUNBUFFERED"] = "1"
    return {"installed_wheels": [w.name for w in todo], "site": str(SITE) if todo else None,
            "missing_before": core_missing}


def ensure_data(ctx: Ctx) -> dict:
    """The processed BloodMNIST arrays, sample table and partitions under ``<work>/data``, built
    from the carried official file by medpfl's preprocess; MD5s compared with prepare's."""
    from medpfl.data.preprocess import preprocess

    man_path = ctx.carry / "manifest.json"
    if not man_path.is_file():
        raise CampaignError(f"{man_path} missing: run `python benchmarks/gpu_campaign.py prepare` here and carry "
                            f"{ctx.carry.name}")
    man = json.loads(man_path.read_text())["data"]
    d = ctx.work / "data"
    arrays = d / "processed" / "bloodmnist.npz"
    samples = d / "processed" / "bloodmnist.samples.parquet"
    info = {"arrays": str(arrays), "samples": str(samples), "partitions": {}, "checks": {}}
    if not arrays.is_file():
        raw = ctx.carry / "data" / man["raw"]
        got = md5(raw)
        if got != man["raw_md5"]:
            raise CampaignError(f"{raw}: MD5 {got}, expected {man['raw_md5']}")
        t = time.perf_counter()
        preprocess(raw, arrays, samples, man["num_classes"], man["n_channels"], layout=man["layout"],
                   norm=tuple(man["norm"]) if man["norm"] else None, class_names=man["class_names"])
        info["preprocess_s"] = time.perf_counter() - t
    info["checks"]["arrays_md5_as_prepared"] = md5(arrays) == man["arrays_md5"]
    info["checks"]["samples_md5_as_prepared"] = md5(samples) == man["samples_md5"]
    if not all(info["checks"].values()):
        ctx.notes.append(f"processed files differ in bytes from prepare's ({info['checks']}): other pandas/pyarrow/"
                         "numpy versions write other bytes; the arrays' values are checked by load_processed")
    for name, meta in man["partitions"].items():
        src = ctx.carry / "data" / "partitions" / name
        dst = d / "partitions" / "bloodmnist" / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copyfile(f, dst / f.name)
        info["partitions"][name] = str(dst / "partition.parquet")
    return info


def machine_info(device: str) -> dict:
    import torch

    def ver(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    info = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
            "hostname": platform.node(), "cpu_count": os.cpu_count(),
            "versions": {n: ver(n) for n in ("torch", "numpy", "pandas", "pyarrow", "pydantic", "pandera",
                                             "transformers", "peft", "timm", "scipy", "matplotlib", "pytest")},
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "flags": {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                      "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                      "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
                      "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                      "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
                      "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                      "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
            "torch_threads": torch.get_num_threads(), "gpu": None}
    try:
        from medpfl.environment import cpu_model

        info["cpu_model"] = cpu_model()
    except Exception:  # noqa: BLE001
        info["cpu_model"] = platform.processor()
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = {"name": p.name, "memory_gib": p.total_memory / 2**30, "multiprocessors": p.multi_processor_count,
               "capability": f"{p.major}.{p.minor}"}
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
            gpu["nvidia_smi"] = q
        except Exception:  # noqa: BLE001
            pass
        info["gpu"] = gpu
    man = ROOT / CARRY / "manifest.json"
    if man.is_file():
        m = json.loads(man.read_text())
        info["prepared"] = {"commit": m.get("commit"), "created": m.get("created")}
    return info


def results_name(part: int, ctx: Ctx) -> str:
    name = f"part{part}-{PARTS[part]}"
    if part == 4 and ctx.stack_seeds:
        name += "-stacked"
    if part == 4 and ctx.shard != (1, 1):
        name += f"-s{ctx.shard[0]}of{ctx.shard[1]}"
    return name


def write_results(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, Path):
        return str(o)
    return str(o)


def run_part(part: int, ctx: Ctx, args: dict, machine: dict) -> dict:
    from benchmarks import gpu_parts

    fn = getattr(gpu_parts, f"part{part}_{PARTS[part]}")
    path = ctx.out / f"{results_name(part, ctx)}.json"
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    head = {"campaign": 1, "part": part, "name": PARTS[part], "dry_run": ctx.dry_run, "device": ctx.device,
            "machine": machine, "args": args, "started": started}
    ctx.notes = []
    t = time.perf_counter()
    status, result, error = "ok", {}, None
    log(f"part {part} ({PARTS[part]}) starts; {ctx.remaining():.0f} s left of this command's budget")

    def checkpoint(partial: dict) -> None:  # a part writes what it has after each step
        write_results(path, {**head, "status": "running", "wall_s": time.perf_counter() - t, "result": partial,
                             "error": None, "notes": list(ctx.notes)})

    try:
        result = fn(ctx, checkpoint)
        status = result.pop("_status", "ok")
    except Exception as e:  # noqa: BLE001 - the file records the failure, the next part still runs
        status, error = "error", "".join(traceback.format_exception(e))[-6000:]
        log(f"part {part} failed: {e!r}")
    obj = {**head, "status": status, "wall_s": time.perf_counter() - t, "result": result, "error": error,
           "notes": list(ctx.notes)}
    write_results(path, obj)
    log(f"part {part} {status} in {obj['wall_s']:.1f} s -> {path}")
    return obj


def cmd_run(a) -> int:
    t0 = time.monotonic()
    sys.stdout.reconfigure(line_buffering=True)
    carry = (ROOT / a.carry).resolve()
    env_info = setup_python(carry)
    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CampaignError("--device cuda but torch sees no CUDA device")
    outdir = Path(a.out or os.environ.get("OUT") or "")
    if not str(outdir) or str(outdir) == ".":
        outdir = ROOT / "benchmarks" / "results" / f"parts-{'dryrun-' if a.dry_run else ''}{device.split(':')[0]}-" \
                                                   f"{dt.date.today().isoformat()}"
    i, n = (int(x) for x in a.shard.split("/"))
    ctx = Ctx(device=device, rounds=a.rounds, dry_run=a.dry_run, out=outdir.resolve(), work=Path(a.work).resolve(),
              carry=carry, deadline=t0 + a.budget_s, shard=(i, n), jobs=a.jobs, tests_k=a.tests_k,
              stack_seeds=a.stack_seeds)
    ctx.work.mkdir(parents=True, exist_ok=True)
    ctx.data = ensure_data(ctx)
    machine = machine_info(device)
    machine["setup"] = env_info
    machine["data"] = ctx.data
    parts = sorted(PARTS) if "all" in a.part else sorted({int(p) for p in a.part})
    args = {k: v for k, v in vars(a).items() if k != "fn"}
    log(f"device {device} ({(machine.get('gpu') or {}).get('name') or machine.get('cpu_model')}), parts {parts}, "
        f"results in {ctx.out}")
    bad = 0
    for p in parts:
        obj = run_part(p, ctx, args, machine)
        bad += obj["status"] == "error"
    return 1 if bad else 0


# ----------------------------------------------------------------------------- collect (here)
def load_parts(paths: list[Path]) -> tuple[dict[str, dict], list[Path]]:
    parts, tars = {}, []
    for p in paths:
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        for f in files:
            if re.fullmatch(r"part\d-[a-z0-9]+(-stacked)?(-s\d+of\d+)?\.json", f.name):
                parts[f.stem] = json.loads(f.read_text())
            elif f.name.endswith("-runs.tar.gz"):
                tars.append(f)
    return parts, tars


def check_keys(obj: dict) -> list[str]:
    """Missing keys of a part's results file (empty: complete)."""
    miss = [k for k in COMMON_KEYS if k not in obj]
    if obj.get("status") not in ("error",) and "part" in obj:
        miss += [f"result.{k}" for k in RESULT_KEYS.get(obj["part"], ()) if k not in (obj.get("result") or {})]
    return miss


def cmd_collect(a) -> int:
    from benchmarks import gpu_report

    parts, tars = load_parts([Path(p) for p in a.paths])
    if not parts:
        raise CampaignError(f"no part*.json under {a.paths}")
    first = next(iter(parts.values()))
    machine = first.get("machine") or {}
    gpu = (machine.get("gpu") or {}).get("name")
    dry = any(p.get("dry_run") for p in parts.values())
    name = a.name or (slug(gpu) if gpu else slug("cpu " + (machine.get("cpu_model") or "unknown")))
    if dry and not a.name:
        name += "-dryrun"
    date = min(p.get("started", "")[:10] for p in parts.values()) or dt.date.today().isoformat()
    out_dir = Path(a.out_dir)
    stem = out_dir / f"{name}-{date}"
    merged = {"machine": machine, "machine_name": gpu or machine.get("cpu_model"), "date": date, "dry_run": dry,
              "parts": parts, "missing_keys": {k: check_keys(v) for k, v in parts.items()}}
    study = None
    plain = [t for t in tars if "-stacked" not in t.name]
    tars = plain or tars  # one report: the separate runs where there are some, else the stacked seeds'
    if tars:
        sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
        study_dir = Path(a.study_dir) if a.study_dir else (Path(tempfile.mkdtemp(prefix="campaign-table1-")) if dry
                                                           else ROOT / "results" / "fedkper-table1-gpu")
        study = gpu_report.table1_report(tars, study_dir, f"FedKPer Table 1, BloodMNIST, on {merged['machine_name']}")
        merged["table1_report"] = study
    out_dir.mkdir(parents=True, exist_ok=True)
    write_results(stem.with_suffix(".json"), merged)
    stem.with_suffix(".md").write_text(gpu_report.markdown(merged))
    print(f"written {stem}.json and {stem}.md")
    for k, miss in merged["missing_keys"].items():
        if miss:
            print(f"  {k}: missing {miss}")
    return 0


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prepare", help="here: build the carry folder (wheels, data, PFLlib) and check 64 MiB")
    s.add_argument("--carry", default=CARRY)
    s.add_argument("--raw", help="the official bloodmnist.npz (default: data/raw, then ../shared/data/medmnist)")
    s.add_argument("--pfllib-git", default=str(PFLLIB_MIRROR) if PFLLIB_MIRROR.exists() else None,
                   help="a fetched PFLlib git directory (the search tool's fetch of github:TsingZ0/PFLlib)")
    s.add_argument("--harness", default=str(HARNESS))
    s.add_argument("--python-version", default="3.12")
    s.add_argument("--no-wheels", action="store_true")
    s.add_argument("--no-pfllib", action="store_true")
    s.add_argument("--add-exclude", action="store_true", help="append /.gpu/ to .git/info/exclude if not ignored")
    s.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    s.set_defaults(fn=cmd_prepare)
    s = sub.add_parser("size", help="here: bytes that would travel (tree + carry) against 64 MiB")
    s.add_argument("--carry", nargs="*", default=[CARRY])
    s.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    s.set_defaults(fn=cmd_size)
    s = sub.add_parser("run", help="there: run parts, each writing $OUT/part<N>-<name>.json")
    s.add_argument("--part", nargs="+", required=True, help="1..5 or all")
    s.add_argument("--device", default="auto", help="auto | cuda | cpu")
    s.add_argument("--rounds", type=int, help="rounds of every training (default: each part's own)")
    s.add_argument("--dry-run", action="store_true", help="tiny sizes: proves each part starts and writes its file")
    s.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results/parts-<device>-<date>)")
    s.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "medpfl-campaign"))
    s.add_argument("--carry", default=CARRY)
    s.add_argument("--budget-s", type=float, default=570.0,
                   help="this command's time budget: parts stop starting new steps when it runs out")
    s.add_argument("--shard", default="1/1", help="part 4: run the i-th of n shares of the jobs (i/n)")
    s.add_argument("--jobs", type=int, default=0, help="part 4: training jobs at a time (0: min(13, cores))")
    s.add_argument("--stack-seeds", action="store_true", help="part 4: each method's seeds as one process and one "
                   "computation (train.stack_seeds: medpfl train with one --job per seed); the results file is "
                   "named part4-table1-stacked")
    s.add_argument("--tests-k", help="part 1: a pytest -k expression (default: all; dry run: fedavg or fedkper)")
    s.set_defaults(fn=cmd_run)
    s = sub.add_parser("collect", help="here: merge returned part files into benchmarks/results/<gpu>-<date>.*")
    s.add_argument("paths", nargs="+", help="folders or files holding part*.json (and part4 run tarballs)")
    s.add_argument("--name", help="results name (default: the GPU's name, slugged)")
    s.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    s.add_argument("--study-dir", help="where part 4's runs and report go (default: results/fedkper-table1-gpu)")
    s.set_defaults(fn=cmd_collect)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        return int(a.fn(a) or 0)
    except CampaignError as e:
        print(f"gpu_campaign {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
