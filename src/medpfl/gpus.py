"""One GPU per training job on a machine with several: a free one, claimed with a lock file.

Snakemake's local executor counts ``resources: gpu=1`` against ``--resources gpu=N`` and so
runs at most N training jobs at once, but it does not say *which* GPU a job may use (no
``CUDA_VISIBLE_DEVICES`` handling; snakemake/snakemake#281). :func:`claim_gpu` does that in
the job itself: it takes an exclusive, non-blocking :func:`fcntl.flock` on one lock file per
GPU (``<lock folder>/gpu-<id>.lock``), the first free one, keeps it for the life of the
process (the kernel drops a ``flock`` when its process ends, however it ends, so a killed job
frees its GPU) and sets ``CUDA_VISIBLE_DEVICES`` to that GPU's id. It must run before torch
initialises CUDA (CUDA reads the variable once, at initialisation); this module does not
import torch.

Environment:

- ``MEDPFL_GPUS``: the GPU ids to share out, comma-separated as ``CUDA_VISIBLE_DEVICES`` takes
  them (``0,1,2,3`` or ``GPU-<uuid>``): a subset of the machine's GPUs, or fake ids for a test
  on a CPU machine. Unset: every GPU ``nvidia-smi -L`` lists, by index.
- ``MEDPFL_GPU_LOCK_DIR``: the lock folder (default ``<system temp dir>/medpfl-gpus-<uid>``).
  It must be local to the machine: the ids name this machine's GPUs.
- ``MEDPFL_GPU_WAIT``: seconds to wait for a GPU when all are held (default 600).
- ``CUDA_VISIBLE_DEVICES`` already set (a scheduler such as SLURM sets it, or you did): it is
  kept, nothing is locked.

Why ``nvidia-smi -L`` and not ``torch.cuda.device_count()``: in this process the latter
initialises the CUDA driver, which then ignores a ``CUDA_VISIBLE_DEVICES`` set afterwards; in
a subprocess it costs a second torch import per job. ``nvidia-smi`` is also the probe that
decides whether the Snakemake rule asks for a GPU at all (``HAS_GPU`` in
``workflow/rules/common.smk``), so the rule and the job agree on whether there is one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from medpfl.errors import GpuError

log = logging.getLogger(__name__)

#: Default seconds :func:`claim_gpu` waits for a free GPU before it gives up.
DEFAULT_WAIT_S = 600.0
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_SMI_LINE = re.compile(r"^GPU (\d+):", re.M)
_HELD: list[int] = []  # the file descriptors of the locks this process holds (never closed)


@dataclass(frozen=True)
class GpuClaim:
    """What :func:`claim_gpu` did. ``gpu``: the id now in ``CUDA_VISIBLE_DEVICES`` (None when it
    assigned nothing); ``reason``: one sentence for the log; ``lock_file``: the held lock (None
    when nothing was locked); ``waited_s``: seconds spent waiting for a free GPU."""

    gpu: str | None
    reason: str
    lock_file: Path | None = None
    waited_s: float = 0.0


def gpu_ids() -> list[str]:
    """The GPU ids to share out: ``$MEDPFL_GPUS`` when set, else the indices ``nvidia-smi -L``
    lists (empty without ``nvidia-smi`` or when it fails: no GPU). Raises :class:`GpuError` for
    a malformed ``MEDPFL_GPUS`` (an empty or odd id, a repeated id)."""
    text = os.environ.get("MEDPFL_GPUS")
    if text is not None:
        ids = [t.strip() for t in text.split(",")]
        bad = [t for t in ids if not _ID.match(t)]
        if bad or not ids:
            raise GpuError(f"MEDPFL_GPUS={text!r}: expected comma-separated GPU ids as CUDA_VISIBLE_DEVICES "
                           f"takes them (e.g. 0,1,2,3 or GPU-<uuid>); bad id(s): {bad}")
        if len(set(ids)) != len(ids):
            raise GpuError(f"MEDPFL_GPUS={text!r}: an id appears twice")
        return ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi -L failed (%s): no GPU to assign", e)
        return []
    return _SMI_LINE.findall(out)


def lock_dir() -> Path:
    """The lock folder: ``$MEDPFL_GPU_LOCK_DIR``, else ``<system temp dir>/medpfl-gpus-<uid>``
    (per user: one user's jobs share the GPUs among themselves)."""
    env = os.environ.get("MEDPFL_GPU_LOCK_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"medpfl-gpus-{os.getuid()}"


def _wait_limit() -> float:
    text = os.environ.get("MEDPFL_GPU_WAIT")
    if text is None:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise GpuError(f"MEDPFL_GPU_WAIT={text!r}: expected seconds >= 0")
    return value


def _try_lock(path: Path) -> int | None:
    """An exclusive flock on ``path`` (created if missing): its descriptor, or None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def gpu_locks() -> list[tuple[str, str | None]]:
    """Who holds each GPU's lock now: ``[(id, holder)]`` for every id of :func:`gpu_ids`, in
    order, ``holder`` the ``pid ... on <host> since <time>`` line its job wrote, or None when the
    GPU is free (no lock file yet, or nobody holds its ``flock``). Creates nothing: a lock file is
    opened read-only and, when free, locked and unlocked at once (a job claiming that GPU in the
    same microseconds moves on to the next one or retries, as for any held GPU). Raises what
    :func:`gpu_ids` raises."""
    folder, out = lock_dir(), []
    for gpu in gpu_ids():
        path = folder / f"gpu-{gpu}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            out.append((gpu, None))
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            out.append((gpu, _holder(path)))
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            out.append((gpu, None))
        finally:
            os.close(fd)
    return out


def claim_gpu(wait_s: float | None = None, poll_s: float = 0.5) -> GpuClaim:
    """Claim one free GPU for this process and set ``CUDA_VISIBLE_DEVICES`` to its id.

    Keeps a ``CUDA_VISIBLE_DEVICES`` already set (returns ``gpu=None``); returns ``gpu=None``
    too when :func:`gpu_ids` finds no GPU. Otherwise tries the ids in order, takes the first
    whose lock is free, writes ``pid host time`` into the lock file (for the error message of a
    job that finds none free) and keeps the lock until the process exits. When all are held it
    retries every ``poll_s`` seconds for ``wait_s`` seconds (default ``$MEDPFL_GPU_WAIT``, else
    600). Call it once per process. Raises :class:`GpuError` when the wait runs out (the message
    names the lock folder and the holders), for a bad ``MEDPFL_GPUS`` or ``MEDPFL_GPU_WAIT``,
    and when the lock folder cannot be created.
    """
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return GpuClaim(None, f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} is already set "
                              "(by a scheduler such as SLURM, or by hand): kept, no GPU lock taken")
    ids = gpu_ids()
    if not ids:
        return GpuClaim(None, "no GPU found (no nvidia-smi, or it lists none; MEDPFL_GPUS unset)")
    wait_s = _wait_limit() if wait_s is None else wait_s
    folder = lock_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise GpuError(f"GPU lock folder {folder} (MEDPFL_GPU_LOCK_DIR): cannot create it: {e}") from e
    start = time.monotonic()
    while True:
        for gpu in ids:
            path = folder / f"gpu-{gpu}.lock"
            fd = _try_lock(path)
            if fd is None:
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                     .encode())
            _HELD.append(fd)
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            if "MEDPFL_GPUS" not in os.environ:  # indices from nvidia-smi: make CUDA number GPUs as it does
                os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            waited = time.monotonic() - start
            return GpuClaim(gpu, f"GPU {gpu} of {','.join(ids)} (lock {path}"
                                 + (f", after waiting {waited:.0f} s)" if waited >= 1 else ")"), path, waited)
        waited = time.monotonic() - start
        if waited >= wait_s:
            held = "; ".join(f"GPU {g}: {_holder(folder / f'gpu-{g}.lock')}" for g in ids)
            raise GpuError(f"no free GPU after {waited:.0f} s: all of {','.join(ids)} are locked in {folder} "
                           f"(MEDPFL_GPU_LOCK_DIR) by other jobs ({held}); run at most that many jobs at once "
                           f"(snakemake --resources gpu={len(ids)}) or raise MEDPFL_GPU_WAIT")
        time.sleep(min(poll_s, max(wait_s - waited, 0.01)))


def claim_for_device(device: str) -> GpuClaim | None:
    """What ``medpfl train`` calls before it imports torch: claim a GPU (:func:`claim_gpu`) for a
    job whose ``train.device`` is ``auto`` or ``cuda``, or for any job while ``$MEDPFL_GPUS`` is
    set (the Snakemake rule gives every training job a GPU token; it is also how tests fake
    GPUs on a CPU). A device naming its own index (``cuda:1``), ``cpu`` or ``mps`` gets None:
    nothing is claimed. Logs the outcome; raises what :func:`claim_gpu` raises."""
    if device.startswith("cuda:"):
        log.info("GPU: train.device=%s names its GPU itself; no GPU assigned", device)
        return None
    if device not in ("auto", "cuda") and "MEDPFL_GPUS" not in os.environ:
        return None
    claim = claim_gpu()
    if claim.gpu is not None:
        log.info("GPU: CUDA_VISIBLE_DEVICES=%s: %s", claim.gpu, claim.reason)
    else:
        log.info("GPU: %s", claim.reason)
    return claim
