"""A one-node SLURM cluster on this machine, for tests (``tests/test_slurm.py``) and by hand.

``LocalSlurm(folder).start()`` writes a minimal ``slurm.conf`` (select/cons_tres, no accounting
daemon, everything under ``folder``), a fresh MUNGE key, starts ``munged``, ``slurmctld`` and
``slurmd`` in the foreground as children of this process and waits until ``sinfo`` shows the
node idle; ``stop()`` ends exactly those three processes, by their PIDs, and removes the
``/etc/slurm/slurm.conf`` symlink it made. The symlink is needed because the job step of
snakemake-executor-plugin-slurm clears every ``SLURM_*`` variable (``SLURM_CONF`` too) before
its inner ``srun``, which then finds no configuration anywhere else.

Anything that keeps the cluster from starting raises :class:`SlurmUnavailable` with the reason
(not root, a binary missing, a real ``/etc/slurm/slurm.conf``, a daemon that exits or a node that
never comes up), which the test turns into a skip.

By hand (as root)::

    python tests/slurm_local.py /tmp/slurm [GPUS]   # starts it, prints the command to stop it
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ETC_CONF = Path("/etc/slurm/slurm.conf")
ETC_GRES = Path("/etc/slurm/gres.conf")  # slurmd reads it from there, whatever -f says
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol")
MARKER = "medpfl-local-slurm"  # in the conf's folder name: a dangling link of ours can be replaced
FAKE_GPU_DEVICES = ("/dev/null", "/dev/zero", "/dev/full")  # character devices nothing opens as a GPU
MIN_JOB_AGE_S = 300  # squeue keeps finished jobs this long: the executor's squeue status needs it


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """A one-node cluster whose state, spool, logs, key and sockets live in ``folder``.

    ``cpus``: the node's CPUs (default: this machine's); ``memory_mb``: the memory it declares
    (default 64 GB, whatever this machine has: ``SlurmdParameters=config_overrides`` makes slurmd
    take the configured node as it is, and nothing enforces memory here, as no cgroup plugin is
    configured, so the workflow's requests fit as on a real node); ``gpus``:
    fake GPUs the node declares as GRES (``gres.conf`` ``Name=gpu File=/dev/null``, ``/dev/zero``):
    SLURM then accepts and schedules ``--gpus=1`` as on a GPU node and sets the job's
    ``CUDA_VISIBLE_DEVICES``; nothing uses a real GPU.
    """

    def __init__(self, folder: Path, cpus: int | None = None, memory_mb: int | None = None, gpus: int = 0):
        self.folder = Path(folder).resolve() / MARKER
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.gpus = gpus
        self.host = socket.gethostname()
        self.conf = self.folder / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.linked: list[Path] = []

    # ----- set up -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`SlurmUnavailable` when this machine cannot run the cluster."""
        if os.geteuid() != 0:
            raise SlurmUnavailable("not root: munged and slurmd here run as root (SlurmUser=root)")
        missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
        if missing:
            raise SlurmUnavailable(f"missing {', '.join(missing)} (scripts/install_system_packages.sh installs "
                                   "slurm-wlm and munge)")
        for etc in self._links():
            if etc.exists() or etc.is_symlink():
                target = os.readlink(etc) if etc.is_symlink() else None
                if not (target and MARKER in target and not Path(target).exists()):
                    raise SlurmUnavailable(f"{etc} already exists (a real SLURM configuration, or another "
                                           f"test's cluster{': ' + target if target else ''}); not touching it")

    def _links(self) -> list[Path]:
        return [ETC_CONF, ETC_GRES] if self.gpus else [ETC_CONF]

    def write_config(self) -> None:
        d = self.folder
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o755)  # munged wants its socket's folder searchable by all
        memory = self.memory_mb or 65536
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        # a GPU GRES needs a character device of its own (Count alone registers 0 GPUs, two GPUs on
        # one file are refused, and with a plain file SLURM sets no CUDA_VISIBLE_DEVICES)
        if self.gpus > len(FAKE_GPU_DEVICES):
            raise SlurmUnavailable(f"at most {len(FAKE_GPU_DEVICES)} fake GPUs")
        (d / "gres.conf").write_text("".join(f"NodeName={self.host} Name=gpu File={dev}\n"
                                             for dev in FAKE_GPU_DEVICES[:self.gpus]))
        self.conf.write_text("\n".join([
            "ClusterName=medpfl",
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={d}/munge/munge.socket.2",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"MinJobAge={MIN_JOB_AGE_S}",
            "KillWait=5",
            *(["GresTypes=gpu"] if self.gpus else []),  # scancel: SIGTERM, then SIGKILL after 5 s (default 30)
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory}{gres} "
            "State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.folder / f"{name}.out", "w")
        # own session: a Ctrl-C in the test's terminal does not reach the daemons
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _fail(self, what: str) -> SlurmUnavailable:
        tails = []
        for f in sorted(self.folder.glob("*.out")) + sorted(self.folder.glob("*.log")):
            text = f.read_text(errors="replace").strip().splitlines()[-5:]
            if text:
                tails.append(f"{f.name}: " + " | ".join(text))
        self.stop()
        return SlurmUnavailable(f"{what}; " + "; ".join(tails))

    def start(self, timeout: float = 60) -> "LocalSlurm":
        """Start munged, slurmctld, slurmd; return once ``sinfo`` shows the node idle.

        Raises :class:`SlurmUnavailable` (daemons already stopped) when a daemon exits or the node
        is not idle within ``timeout`` seconds."""
        self.check()
        self.write_config()
        d = self.folder
        key = d / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, capture_output=True)
        os.chmod(key, 0o600)  # munged refuses a key readable by others (and the packaged one, owned by munge)
        ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
        for etc in self._links():
            if etc.is_symlink():
                etc.unlink()  # a dangling link left by a killed run of ours (check() made sure)
            etc.symlink_to(self.folder / etc.name)
            self.linked.append(etc)
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}", f"--socket={d}/munge/munge.socket.2",
                               f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munged.log",
                               f"--seed-file={d}/munge/munged.seed", "--force"])
        deadline = time.monotonic() + timeout
        while not (d / "munge" / "munge.socket.2").exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise self._fail("munged did not start")
            time.sleep(0.05)
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])  # -c: no state from a former run
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise self._fail(f"{name} exited with status {p.returncode}")
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                                   env=self.env()).stdout.strip()
            if state == "idle":
                return self
            if time.monotonic() > deadline:
                raise self._fail(f"node not idle after {timeout:.0f} s (sinfo: {state or 'no answer'})")
            time.sleep(0.2)

    def env(self, base: dict | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with ``SLURM_CONF`` set to this cluster's file."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ----- tear down ----------------------------------------------------------------------
    def stop(self) -> None:
        """End the daemons this object started (slurmd, slurmctld, munged, by PID: SIGTERM, then
        SIGKILL after 10 s) and remove the links it created in ``/etc/slurm``."""
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for etc in self.linked:
            if etc.is_symlink() and Path(os.readlink(etc)) == self.folder / etc.name:
                etc.unlink()
        self.linked = []

    def log(self, name: str) -> str:
        """The text of ``slurmctld.log``, ``slurmd.log`` or ``munged.log`` ('' while absent)."""
        f = self.folder / name
        return f.read_text(errors="replace") if f.exists() else ""


if __name__ == "__main__":
    cluster = LocalSlurm(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm"),
                         gpus=int(sys.argv[2]) if len(sys.argv) > 2 else 0).start()
    pids = " ".join(str(p.pid) for p in cluster.procs.values())
    print(f"cluster up ({cluster.conf}); stop it with: kill {pids} && rm {' '.join(map(str, cluster.linked))}")
