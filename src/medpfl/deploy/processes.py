"""Flower's processes, started and stopped exactly: a SuperLink, SuperNodes (one per site) and
``flwr run``, as ``medpfl deploy`` starts them (``docs/deployment.md``).

:class:`LocalFederation` runs a whole federation on loopback in separate processes (tests, and a
dry run on one machine before the sites are set up). Every process starts in its own session
(``setsid``) with its own ``FLWR_HOME``; :meth:`LocalFederation.stop` stops each process it
started and the children Flower spawned from it (``flower-superexec``, ``flwr-serverapp``,
``flwr-clientapp``), and nothing else.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from medpfl.errors import DeploymentError

#: the Flower app folder (its pyproject.toml names medpfl's ServerApp and ClientApp)
APP_DIR = Path(__file__).with_name("flower_app")
FEDERATION = "medpfl"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(home: Path) -> dict[str, str]:
    """The environment of a Flower process: its own ``FLWR_HOME``, no telemetry or update check,
    this interpreter's ``bin`` first on the PATH (Flower starts ``flower-superexec``,
    ``flwr-serverapp`` and ``flwr-clientapp`` by name)."""
    env = dict(os.environ)
    env.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PYTHONUNBUFFERED": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    return env


def node_config(cfg: dict[str, str]) -> str:
    """``--node-config`` text: ``key="value"`` pairs (strings quoted, as Flower's parser wants)."""
    return " ".join(f'{k}="{v}"' for k, v in cfg.items())


def superlink_cmd(port: int, certs: Path | None = None) -> list[str]:
    """``flower-superlink`` on 127.0.0.1:``port``; ``certs``: a folder from
    :func:`medpfl.deploy.certs.make_certificates` (TLS), None: ``--insecure`` (loopback tests only)."""
    cmd = ["flower-superlink", "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)]
    if certs is None:
        return cmd + ["--insecure"]
    return cmd + ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
                  "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"]


def supernode_cmd(superlink: str, port: int, config: dict[str, str], certs: Path | None = None,
                  auth_key: Path | None = None) -> list[str]:
    """``flower-supernode`` connecting to ``superlink`` (host:port), serving its ClientApp runtime
    on ``port``, with the site's node config; with ``certs``, over TLS trusting ``certs/ca.crt``
    and authenticated by the private key ``auth_key`` (registered at the SuperLink)."""
    cmd = ["flower-supernode", "--superlink", superlink, "--port", str(port), "--node-config", node_config(config)]
    if certs is None:
        return cmd + ["--insecure"]
    cmd += ["--root-certificates", str(certs / "ca.crt")]
    return cmd + (["--auth-supernode-private-key", str(auth_key)] if auth_key is not None else [])


def write_cli_config(home: Path, address: str, certs: Path | None = None) -> None:
    """``$FLWR_HOME/config.toml`` for ``flwr run``: the federation :data:`FEDERATION` at ``address``."""
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{FEDERATION}"', "", f"[superlink.{FEDERATION}]", f'address = "{address}"']
    lines.append(f'root-certificates = "{certs / "ca.crt"}"' if certs is not None else "insecure = true")
    (home / "config.toml").write_text("\n".join(lines) + "\n")


def run_config_arg(cfg: dict) -> str:
    """``--run-config`` text: strings quoted (TOML), numbers as they are, booleans as
    ``true``/``false``."""
    parts = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            parts.append(f"{k}={'true' if v else 'false'}")
            continue
        parts.append(f"{k}={v}" if isinstance(v, (int, float)) and not isinstance(v, bool) else f'{k}="{v}"')
    return " ".join(parts)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    except OSError:
        return out
    for k in kids:
        out.append(int(k))
        out += _descendants(int(k))
    return out


def _alive(pid: int) -> bool:
    try:
        st = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    except OSError:
        return False
    return bool(st) and not st.startswith("Z")


@dataclass
class Proc:
    """A started Flower process: its command, log file and ``Popen``."""

    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
        """``sig`` to the process, SIGKILL after ``wait_s``; then its children (collected before)."""
        kids = _descendants(self.popen.pid)
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        deadline = time.monotonic() + 3  # Flower's children watch their parent and leave by themselves
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for k in kids:
            if _alive(k):
                try:
                    os.kill(k, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def start(name: str, cmd: list[str], home: Path, logs: Path) -> Proc:
    """``cmd`` in its own session, output to ``logs/<name>.log``. Raises DeploymentError when the
    program is not installed."""
    if shutil.which(cmd[0], path=flower_env(home)["PATH"]) is None:
        raise DeploymentError(f"{cmd[0]} not found: install flwr (scripts/setup.sh installs the pinned version)")
    home.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    fh = open(log, "ab")
    p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=flower_env(home),
                         start_new_session=True)
    fh.close()
    return Proc(name, cmd, log, p)


def wait_for_log(proc: Proc, pattern: str, timeout: float = 60.0) -> None:
    """Wait until ``pattern`` appears in the process's log. Raises DeploymentError (with the log's
    tail) when the process exits or the time runs out."""
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
        if re.search(pattern, text):
            return
        if proc.popen.poll() is not None:
            break
        time.sleep(0.2)
    tail = "\n".join((proc.log.read_text(errors="replace") if proc.log.exists() else "").splitlines()[-15:])
    raise DeploymentError(f"{proc.name} did not start ({' '.join(proc.cmd[:1])}; log {proc.log}):\n{tail}")


@dataclass
class LocalFederation:
    """A SuperLink and one SuperNode per entry of ``sites`` (each a node config dict) on
    loopback, under ``root`` (logs, FLWR_HOMEs). ``tls``: TLS and SuperNode authentication, with
    a CA, a server certificate and a key per site made in ``root/certs``
    (:mod:`medpfl.deploy.certs`), each site's public key registered before it starts; False:
    ``--insecure`` (never outside a test). Use as a context manager."""

    root: Path
    sites: list[dict[str, str]]
    tls: bool = True
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self):
        self.root = Path(self.root)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.site_ports = [free_port() for _ in self.sites]
        self.certs: Path | None = None
        if self.tls:
            from medpfl.deploy.certs import make_certificates

            self.certs = make_certificates(self.root / "certs", sites=[f"site{i}" for i in range(len(self.sites))])

    def __enter__(self) -> "LocalFederation":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        sl = start("superlink", superlink_cmd(self.port, self.certs), self.root / "home" / "superlink",
                   self.root / "logs")
        self.procs["superlink"] = sl
        wait_for_log(sl, r"Uvicorn running|Application startup complete", 90)
        write_cli_config(self.root / "home" / "cli", self.address, self.certs)
        if self.certs is not None:
            for i in range(len(self.sites)):
                self.flwr(["supernode", "register", str(self.certs / f"site{i}.pub"), FEDERATION], check=True)
        for i in range(len(self.sites)):
            self.start_site(i)

    def flwr(self, args: list[str], check: bool = False, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI against this federation (e.g. ``["supernode", "register", key, "medpfl"]``).
        Raises DeploymentError with ``check`` when it fails."""
        res = subprocess.run(["flwr", *args], env=flower_env(self.root / "home" / "cli"), capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise DeploymentError(f"flwr {' '.join(args)} failed: {(res.stdout + res.stderr)[-1500:]}")
        return res

    def start_site(self, i: int) -> Proc:
        """(Re)start site ``i``'s SuperNode; returns once it has registered."""
        name = f"site{i}"
        key = self.certs / name if self.certs is not None else None
        p = start(name, supernode_cmd(self.address, self.site_ports[i], self.sites[i], self.certs, key),
                  self.root / "home" / name, self.root / "logs")
        self.procs[name] = p
        n_before = p.log.read_text(errors="replace").count("SuperNode ID") if p.log.exists() else 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if p.log.read_text(errors="replace").count("SuperNode ID") > n_before:
                return p
            if p.popen.poll() is not None:
                break
            time.sleep(0.2)
        wait_for_log(p, r"$^", 0.1)  # raises with the log's tail
        return p

    def kill_site(self, i: int) -> None:
        """SIGKILL site ``i``'s SuperNode and its ClientApp processes (a crash)."""
        self.procs.pop(f"site{i}").stop(signal.SIGKILL, wait_s=5)

    def run(self, run_config: dict, timeout: float = 900.0) -> subprocess.CompletedProcess:
        """``flwr run <app> medpfl --stream --run-config ...``; returns when the run ends. Raises
        DeploymentError when the run wrote no ``records.parquet`` in its ``out-dir`` (``flwr
        run`` exits 0 even when the ServerApp fails)."""
        return flwr_run(run_config, self.root / "home" / "cli", timeout=timeout)


    def stop(self) -> None:
        """Stop every process started here (sites first), and their children."""
        for name in [n for n in self.procs if n != "superlink"] + ["superlink"]:
            p = self.procs.pop(name, None)
            if p is not None:
                p.stop()


def flwr_run(run_config: dict, home: Path, timeout: float | None = None, capture: bool = True
             ) -> subprocess.CompletedProcess:
    """``flwr run`` of medpfl's app with ``run_config`` (its ``out-dir`` must be set), the CLI's
    config in ``home``. Raises DeploymentError, with the end of Flower's output, when the run
    did not write ``<out-dir>/records.parquet`` (``flwr run`` exits 0 even when the ServerApp
    fails: the error is in the ServerApp's log stream above)."""
    out = Path(str(run_config["out-dir"])) / "records.parquet"
    t0 = time.time()
    cmd = ["flwr", "run", str(APP_DIR), FEDERATION, "--stream", "--run-config", run_config_arg(run_config)]
    res = subprocess.run(cmd, env=flower_env(home), capture_output=capture, text=True, timeout=timeout)
    if not (out.exists() and out.stat().st_mtime >= t0 - 1):
        tail = "\n".join(((res.stdout or "") + (res.stderr or "")).splitlines()[-25:]) if capture else ""
        raise DeploymentError(f"the deployed run wrote no {out} (flwr run exit status {res.returncode}); the "
                              f"ServerApp's error is in Flower's output" + (f":\n{tail}" if tail else " above"))
    return res
