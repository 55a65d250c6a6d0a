"""The environment a training run ran in, and the determinism settings it applies.

:func:`configure_determinism` applies ``train.deterministic`` before a job touches the GPU;
:func:`capture` records the run's *environment fingerprint*: CPU model and SIMD level, BLAS,
core count and the torch threads used, torch / CUDA / cuDNN versions and the GPU (and
``CUDA_VISIBLE_DEVICES``: which of the machine's GPUs, see :mod:`medpfl.gpus`), the
determinism flags torch reports, the precision policy (``train.precision``, the float32 matmul
precision, the TF32 switches), Python and platform. The train stage writes it into ``job.json``
(key ``environment``, beside the job description, never inside it: it is an output, so it
changes neither the Snakemake params nor the checkpoint fingerprint) and as ``env.*`` tags on
the run's MLflow child run; the evaluate stage copies it into ``metrics.json`` and the report
lists the distinct fingerprints of a study and the runs that used each.

``id`` hashes the keys in :data:`NUMERIC_KEYS`, the ones that can change a run's numbers;
keys such as the platform string or the core count are recorded but do not split a study
into several fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from typing import Any

import torch

#: ``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (CUDA >= 10.2; PyTorch "Reproducibility").
CUBLAS_WORKSPACE = ":4096:8"

#: The keys whose values can change a run's numbers; ``id`` is a hash of them.
NUMERIC_KEYS = (
    "cpu_model", "cpu_capability", "blas", "torch_threads", "torch_version", "cuda_version", "cudnn_version",
    "device", "gpu_name", "deterministic_algorithms", "cudnn_deterministic", "cudnn_benchmark",
    "cublas_workspace_config", "precision", "float32_matmul_precision", "cuda_matmul_allow_tf32",
    "cudnn_allow_tf32",
)


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo`` (x86 ``model name``; Arm ``Hardware`` /
    ``CPU implementer`` + ``CPU part``), else :func:`platform.processor`, else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = f.read()
    except OSError:
        info = ""
    for key in ("model name", "Hardware", "Processor", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", info, re.M)
        if m and m.group(1).strip():
            return m.group(1).strip()
    impl = re.search(r"^CPU implementer\s*:\s*(\S+)", info, re.M)
    part = re.search(r"^CPU part\s*:\s*(\S+)", info, re.M)
    if impl and part:
        return f"{platform.machine()} implementer {impl.group(1)} part {part.group(1)}"
    return platform.processor() or platform.machine() or "unknown"


def _blas() -> str | None:
    """The BLAS torch was built with (``BLAS_INFO`` in ``torch.__config__.show()``: mkl, open, ...)."""
    try:
        m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    except Exception:  # noqa: BLE001 - build info is optional
        return None
    return m.group(1) if m else None


def _cpu_capability() -> str | None:
    """The SIMD level of torch's CPU kernels on this machine (``AVX2``, ``AVX512``, ``DEFAULT``...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001
        return None


def configure_determinism(deterministic: bool, device: torch.device) -> None:
    """On CUDA with ``deterministic``: deterministic algorithms where torch has them
    (``use_deterministic_algorithms(True, warn_only=True)``: an op without one warns instead of
    failing), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set; it must be set before
    cuBLAS starts, hence before any CUDA work of the job), cuDNN deterministic and no cuDNN
    benchmarking. Nothing is changed on a CPU, where torch's kernels are already run-to-run
    deterministic for a fixed thread count, nor with ``deterministic`` false (torch's defaults)."""
    if not deterministic or device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def capture(device: torch.device, precision: str, deterministic: bool) -> dict[str, Any]:
    """The environment fingerprint of this process for a job on ``device`` (call it after
    :func:`configure_determinism` and after the thread count is set). Flat and JSON-ready;
    ``id`` identifies the values of :data:`NUMERIC_KEYS`."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_capability": _cpu_capability(),
        "blas": _blas(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": cudnn,
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        "train_deterministic": bool(deterministic),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # the job's GPU (medpfl.gpus, SLURM)
        "precision": precision,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
    }
    env["id"] = fingerprint_id(env)
    return env


def fingerprint_id(env: dict[str, Any]) -> str:
    """12 hex digits identifying the values of :data:`NUMERIC_KEYS` in ``env``."""
    core = {k: env.get(k) for k in NUMERIC_KEYS}
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:12]


def mlflow_tags(env: dict[str, Any]) -> dict[str, str]:
    """``env.<key>`` tags for the MLflow child run (tags, not params: a run resumed elsewhere
    updates them). ``None`` becomes ``"none"``."""
    return {f"env.{k}": ("none" if v is None else str(v)) for k, v in env.items()}


def summary(env: dict[str, Any] | None) -> dict[str, str]:
    """The short columns the report shows for one fingerprint."""
    if not env:
        return {"CPU": "unknown", "threads": "—", "torch": "—", "device": "—", "deterministic": "—",
                "precision": "—", "Python / platform": "—"}
    cpu = env.get("cpu_model") or "unknown"
    extra = ", ".join(str(x) for x in (env.get("cpu_capability"), env.get("blas") and f"BLAS {env['blas']}") if x)
    device = env.get("device") or "—"
    if env.get("gpu_name"):
        device = f"{device} ({env['gpu_name']}, CUDA {env.get('cuda_version')}, cuDNN {env.get('cudnn_version')})"
    det = "on" if env.get("deterministic_algorithms") else "off"
    if not str(env.get("device", "")).startswith("cuda"):
        det += " (not needed on a CPU)"
    else:
        det += (f" (cuDNN deterministic {env.get('cudnn_deterministic')}, benchmark {env.get('cudnn_benchmark')}, "
                f"CUBLAS_WORKSPACE_CONFIG {env.get('cublas_workspace_config')})")
    tf32 = [n for n, k in (("matmul", "cuda_matmul_allow_tf32"), ("cuDNN", "cudnn_allow_tf32")) if env.get(k)]
    prec = f"{env.get('precision')}, matmul {env.get('float32_matmul_precision')}"
    if str(env.get("device", "")).startswith("cuda"):
        prec += f", TF32 {'/'.join(tf32) if tf32 else 'off'}"
    return {
        "CPU": f"{cpu} ({extra})" if extra else cpu,
        "threads": f"{env.get('torch_threads')} of {env.get('cpu_count')} cores",
        "torch": str(env.get("torch_version")),
        "device": device,
        "deterministic": det,
        "precision": prec,
        "Python / platform": f"{env.get('python')} / {env.get('platform')}",
    }
