"""An MLflow tracking server backed by PostgreSQL, for training jobs on many nodes.

``medpfl tracking-server start --dir FOLDER`` runs PostgreSQL's and MLflow's own programs, in
one folder (:func:`paths`)::

    FOLDER/server.json            what runs: pids, ports, URIs (written atomically by start / stop)
    FOLDER/postgres/data/         the PostgreSQL cluster (initdb on first use)
    FOLDER/postgres/socket/       its Unix socket (mode 0700: only its owner and root connect)
    FOLDER/postgres/postgres.log  PostgreSQL's log
    FOLDER/artifacts/             the runs' artifacts, uploaded through the server
    FOLDER/mlflow.log             the MLflow server's log

PostgreSQL listens on its Unix socket only (``listen_addresses=''``, trust authentication for
the socket's owner): nothing but the MLflow server on the same machine talks to it, so it takes
no TCP port. The MLflow server (``mlflow server --backend-store-uri postgresql://... --serve-
artifacts --artifacts-destination FOLDER/artifacts``) listens on ``host:port``; clients set
``MLFLOW_TRACKING_URI=http://host:port`` and upload artifacts through it (experiments created
through the server get ``mlflow-artifacts:/`` locations), so jobs on other nodes need no shared
artifact path. As root, PostgreSQL runs as the ``postgres`` user (``initdb`` refuses root);
otherwise as the current user.

:func:`start` creates what is missing and starts what is not running, :func:`stop` stops exactly
what ``server.json`` records (the MLflow server's process group, then ``pg_ctl stop``),
:func:`status` says what runs. Errors are :class:`~medpfl.errors.TrackingServerError`, one line
naming the folder, port or program.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

from medpfl.errors import PostgresUnavailable, TrackingServerError

#: ``medpfl tracking-server start``'s default port (MLflow's own default).
DEFAULT_PORT = 5000
#: PostgreSQL's port number: with no TCP listener it only names the socket file
#: (``FOLDER/postgres/socket/.s.PGSQL.5432``), so it never conflicts with another server.
PG_PORT = 5432
#: The database the MLflow server keeps its runs in, and the PostgreSQL role it connects as.
DATABASE = "mlflow"
DB_ROLE = "postgres"
#: The record of a started server, in the server's folder.
STATE_FILE = "server.json"
#: Linux's limit on a Unix socket path (``sun_path``, 108 bytes with the final NUL).
MAX_SOCKET_PATH = 107
#: The Debian package that holds PostgreSQL's server programs (``initdb``, ``pg_ctl``).
DEBIAN_PACKAGE = "postgresql"
#: Where :func:`find_postgres_bin` looks for PostgreSQL's programs after the PATH (glob patterns).
PG_ROOTS = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def paths(folder: str | Path) -> dict[str, Path]:
    """The files and folders of the tracking server in ``folder`` (made absolute): ``folder``,
    ``state`` (server.json), ``pg`` (postgres/), ``data``, ``socket``, ``pg_log``, ``artifacts``,
    ``mlflow_log``. Creates nothing."""
    root = Path(folder).expanduser().resolve()
    pg = root / "postgres"
    return {"folder": root, "state": root / STATE_FILE, "pg": pg, "data": pg / "data", "socket": pg / "socket",
            "pg_log": pg / "postgres.log", "artifacts": root / "artifacts", "mlflow_log": root / "mlflow.log"}


# ----- small pieces shared with scripts/mlflow_pages.py -----------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (bound and released; another process may take it before it
    is used, in which case the server's start fails with a clear error)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` cannot be bound (another server listens there). Uses
    ``SO_REUSEADDR`` as servers do, so a port only in TIME_WAIT counts as free."""
    with socket.socket(_family(host)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def health_ok(base_url: str, timeout: float = 2.0) -> bool:
    """Whether the MLflow server at ``base_url`` answers 200 on ``/health``."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_healthy(base_url: str, proc: subprocess.Popen | None = None, timeout: float = 180.0,
                 log_file: Path | None = None, what: str = "mlflow server") -> None:
    """Poll ``base_url``'s ``/health`` every 0.5 s until it answers 200.

    Raises :class:`TrackingServerError` (with the end of ``log_file``) when ``proc`` exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if health_ok(base_url):
            if proc is None or proc.poll() is None:
                return
        if proc is not None and proc.poll() is not None:
            raise TrackingServerError(f"{what} exited with status {proc.returncode} before answering "
                                      f"{base_url}/health{_log_tail(log_file)}")
        if time.monotonic() > deadline:
            raise TrackingServerError(f"{what} did not answer {base_url}/health within {timeout:.0f} s"
                                      f"{_log_tail(log_file)}")
        time.sleep(0.5)


def _log_tail(log_file: Path | None, lines: int = 8) -> str:
    if log_file is None or not Path(log_file).is_file():
        return ""
    tail = [ln for ln in Path(log_file).read_text(errors="replace").splitlines() if ln.strip()][-lines:]
    return f" (last lines of {log_file}: " + " | ".join(ln.strip() for ln in tail) + ")" if tail else ""


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` exists and is not a zombie, and (when ``start_ticks`` is given and
    ``/proc`` exists) is the same process that was recorded: its start time in clock ticks since
    boot (``/proc/<pid>/stat`` field 22) equals ``start_ticks``, so a reused pid is not taken for it."""
    stat = _proc_stat(pid)
    if stat is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return start_ticks is None or not Path("/proc").is_dir()
    state, ticks = stat
    if state == "Z":
        return False
    return start_ticks is None or ticks == start_ticks


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in ticks)`` of ``pid`` from ``/proc/<pid>/stat``; None without it."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[19])


def start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (``/proc``); None where unknown."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in process group ``pgid``."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(-pgid, os.WNOHANG)  # reap our own children of the group (the test starts them)
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                raw = (d / "stat").read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(pgid: int, timeout: float = 30.0) -> bool:
    """Send SIGTERM to process group ``pgid``, wait up to ``timeout`` seconds for every process in
    it to exit, then SIGKILL what is left. Returns True when a process was still there to stop."""
    if not _group_alive(pgid):
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return True
            time.sleep(0.2)
    if _group_alive(pgid):
        raise TrackingServerError(f"process group {pgid} is still alive after SIGKILL")
    return True


def client_host(host: str) -> str:
    """The host name clients put in the tracking URI for a server bound to ``host``: the host
    itself, or for a wildcard address (``0.0.0.0``, ``::``) this machine's fully qualified name
    (its short name where the fully qualified one is ``localhost``)."""
    if host not in WILDCARD_HOSTS:
        return host
    fqdn = socket.getfqdn()
    return socket.gethostname() if fqdn.startswith("localhost") else fqdn


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _local_host(host: str) -> str:
    """The address this machine reaches a server bound to ``host`` at (loopback for wildcards)."""
    if host == "::":
        return "::1"
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def default_allowed_hosts(host: str) -> list[str] | None:
    """The ``--allowed-hosts`` list (Host headers MLflow 3's security middleware accepts) for a
    server bound to ``host``: None (MLflow's default: localhost and private IP addresses) for a
    loopback address, else that default plus this machine's names (short and fully qualified)
    and ``host``, each with any port, so jobs on other nodes may use the machine's name."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    try:
        from mlflow.server.security_utils import get_default_allowed_hosts

        base = list(get_default_allowed_hosts())
    except ImportError:  # another MLflow layout: localhost only, then our names
        base = ["localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*"]
    return base + [x for n in _machine_names(host) for x in (n, f"{n}:*")]


def _machine_names(host: str) -> list[str]:
    """This machine's short and fully qualified names and ``host``, once each; no wildcard address
    and no ``localhost`` (which MLflow allows anyway)."""
    return [n for n in dict.fromkeys([socket.gethostname(), socket.getfqdn(), host])
            if n and n not in WILDCARD_HOSTS and not n.startswith("localhost")]


def default_cors_origins(host: str, port: int) -> list[str] | None:
    """The ``--cors-allowed-origins`` list for a server bound to ``host:port``: None (MLflow's
    default: ``localhost`` origins only) for a loopback address, else ``http://<name>:<port>`` for
    this machine's names and ``host``. Without it a browser that opened the UI by the machine's
    name gets 403 on every POST the UI sends (MLflow 3.17.2: the runs list stays empty)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    return [f"http://{_url_host(n)}:{port}" for n in _machine_names(host)]


# ----- PostgreSQL ------------------------------------------------------------------------------
def find_postgres_bin(data_dir: Path | None = None) -> Path:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``, ``psql``, ``createdb``).

    In order: ``$MEDPFL_PG_BIN``; for an existing cluster (``data_dir/PG_VERSION``), Debian's
    folder of that major version; ``initdb`` on the ``PATH``; the newest
    ``/usr/lib/postgresql/<major>/bin`` (Debian, Ubuntu) or ``/usr/pgsql-<major>/bin`` (RHEL;
    :data:`PG_ROOTS`). Raises :class:`~medpfl.errors.PostgresUnavailable` naming the Debian
    package when none is found."""
    need = ("initdb", "pg_ctl", "psql", "createdb")

    def complete(d: Path) -> bool:
        return all(os.access(d / n, os.X_OK) for n in need)

    env = os.environ.get("MEDPFL_PG_BIN")
    if env:
        if not complete(Path(env)):
            raise PostgresUnavailable(f"MEDPFL_PG_BIN={env}: no {', '.join(need)} there")
        return Path(env)
    if data_dir is not None and (Path(data_dir) / "PG_VERSION").is_file():
        major = (Path(data_dir) / "PG_VERSION").read_text().strip()
        for d in (Path(f"/usr/lib/postgresql/{major}/bin"), Path(f"/usr/pgsql-{major}/bin")):
            if complete(d):
                return d
    on_path = shutil.which("initdb")
    if on_path and complete(Path(on_path).parent):
        return Path(on_path).parent

    def major_of(d: Path) -> float:
        digits = "".join(c for c in d.parent.name.split("-")[-1] if c.isdigit() or c == ".")
        try:
            return float(digits)
        except ValueError:
            return -1.0

    import glob

    found = [Path(d) for pattern in PG_ROOTS for d in glob.glob(pattern) if complete(Path(d))]
    if found:
        return max(found, key=major_of)
    raise PostgresUnavailable(
        f"PostgreSQL's server programs (initdb, pg_ctl) not found on the PATH nor in /usr/lib/postgresql/*/bin: "
        f"install Debian's `{DEBIAN_PACKAGE}` package (apt-get install {DEBIAN_PACKAGE}; "
        "scripts/install_system_packages.sh does it) or set MEDPFL_PG_BIN to their folder")


def _pg_user() -> str | None:
    """The user PostgreSQL runs as: ``postgres`` when we are root (``initdb`` refuses root), else
    None (the current user). Raises :class:`TrackingServerError` when root has no such user."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable("running as root, PostgreSQL must run as the `postgres` user (initdb refuses "
                                  "root), and there is none: install Debian's `postgresql` package, which creates "
                                  "it, or run medpfl tracking-server as another user") from None
    return "postgres"


def _as_pg_user(cmd: list[str], pg_user: str | None, cwd: Path, timeout: float = 120.0,
                check: bool = True, what: str | None = None,
                error: type[TrackingServerError] = TrackingServerError) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``pg_user`` (None: as we are), capturing its output; with ``check``, a
    non-zero status raises ``error`` with its last output lines."""
    kw: dict[str, Any] = {}
    if pg_user is not None:
        import grp
        import pwd

        pw = pwd.getpwnam(pg_user)
        kw = {"user": pw.pw_uid, "group": pw.pw_gid,
              "extra_groups": [g.gr_gid for g in grp.getgrall() if pg_user in g.gr_mem]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no PGHOST/PGDATA of the caller
    env.update({"LC_ALL": "C", "LANG": "C"})
    if pg_user is not None:
        env["HOME"] = str(cwd)
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, **kw)
    except subprocess.TimeoutExpired:
        raise error(f"{what or Path(cmd[0]).name} did not finish within {timeout:.0f} s") from None
    if check and r.returncode != 0:
        out = " | ".join(ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip())[-800:]
        raise error(f"{what or shlex.join(cmd)} failed (status {r.returncode}): {out}")
    return r


def _prepare_pg_folder(p: dict[str, Path], pg_user: str | None) -> None:
    """Create ``postgres/``, ``data/`` and ``socket/`` for the PostgreSQL user (mode 0700) and check
    that it can reach them (as root: the ``postgres`` user must be able to enter every parent) and
    that the socket's path fits Linux's limit."""
    sock = p["socket"] / f".s.PGSQL.{PG_PORT}"
    if len(str(sock).encode()) > MAX_SOCKET_PATH:
        raise TrackingServerError(f"--dir {p['folder']} is too deep for PostgreSQL's socket {sock} "
                                  f"({len(str(sock).encode())} bytes; Linux allows {MAX_SOCKET_PATH}): choose a "
                                  "shorter --dir")
    for d in (p["pg"], p["data"], p["socket"]):
        d.mkdir(exist_ok=True)
        os.chmod(d, 0o700)
    if pg_user is None:
        return
    import pwd

    pw = pwd.getpwnam(pg_user)
    for d in (p["pg"], p["data"], p["socket"]):
        try:
            os.chown(d, pw.pw_uid, pw.pw_gid)
        except PermissionError:
            raise TrackingServerError(f"cannot give {d} to the `{pg_user}` user (a network file system that "
                                      "squashes root?): put --dir on a local disk") from None
    r = _as_pg_user(["test", "-w", str(p["data"])], pg_user, Path("/"), check=False)
    if r.returncode != 0:
        raise PostgresUnavailable(f"the `{pg_user}` user cannot reach {p['data']}: a parent folder of --dir "
                                  f"{p['folder']} is not open to it (chmod o+x each parent, or choose a --dir "
                                  f"it can enter, e.g. under /srv or /var/tmp)")


def _pg_running(pg_bin: Path, p: dict[str, Path], pg_user: str | None) -> bool:
    r = _as_pg_user([str(pg_bin / "pg_ctl"), "status", "-D", str(p["data"])], pg_user, p["pg"], check=False)
    return r.returncode == 0


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def backend_uri(socket_dir: Path, database: str = DATABASE, port: int = PG_PORT) -> str:
    """The SQLAlchemy URI of ``database`` on the PostgreSQL server whose socket is in
    ``socket_dir``: ``postgresql://postgres@/mlflow?host=<socket dir>&port=5432`` (libpq reads a
    ``host`` that starts with ``/`` as a socket folder)."""
    return f"postgresql://{DB_ROLE}@/{database}?host={quote(str(socket_dir), safe='/')}&port={port}"


def _ensure_postgres(p: dict[str, Path], pg_bin: Path, pg_user: str | None) -> tuple[bool, bool]:
    """Create the cluster where missing, start it where not running, create the database where
    missing. Returns ``(created the cluster, started it)``."""
    created = started = False
    _prepare_pg_folder(p, pg_user)
    if not (p["data"] / "PG_VERSION").is_file():
        _as_pg_user([str(pg_bin / "initdb"), "-D", str(p["data"]), "-A", "trust", "-U", DB_ROLE, "-E", "UTF8",
                     "--no-locale"], pg_user, p["pg"], timeout=300, what=f"initdb -D {p['data']}",
                    error=PostgresUnavailable)
        created = True
    if not _pg_running(pg_bin, p, pg_user):
        opts = (f"-p {PG_PORT} -k {shlex.quote(str(p['socket']))} -c listen_addresses='' "
                "-c unix_socket_permissions=0700")
        r = _as_pg_user([str(pg_bin / "pg_ctl"), "start", "-D", str(p["data"]), "-l", str(p["pg_log"]), "-w",
                         "-t", "120", "-o", opts], pg_user, p["pg"], timeout=180, check=False)
        if r.returncode != 0:
            raise PostgresUnavailable(f"PostgreSQL did not start (pg_ctl start -D {p['data']}, status "
                                      f"{r.returncode}){_log_tail(p['pg_log'])}")
        started = True
    conn = ["-h", str(p["socket"]), "-p", str(PG_PORT), "-U", DB_ROLE]
    try:
        q = _as_pg_user([str(pg_bin / "psql"), *conn, "-d", "postgres", "-tAc",
                         f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"], pg_user, p["pg"],
                        what=f"psql on {p['socket']}")
        if q.stdout.strip() != "1":
            _as_pg_user([str(pg_bin / "createdb"), *conn, DATABASE], pg_user, p["pg"], what=f"createdb {DATABASE}")
    except BaseException:
        if started:  # leave nothing running that this call started
            _stop_postgres(pg_bin, p, pg_user)
        raise
    return created, started


def _stop_postgres(pg_bin: Path, p: dict[str, Path], pg_user: str | None, timeout: float = 120.0) -> bool:
    """``pg_ctl stop -m fast`` the cluster in ``p['data']``; True when it was running."""
    if not (p["data"] / "PG_VERSION").is_file() or not _pg_running(pg_bin, p, pg_user):
        return False
    _as_pg_user([str(pg_bin / "pg_ctl"), "stop", "-D", str(p["data"]), "-m", "fast", "-w", "-t", str(int(timeout))],
                pg_user, p["pg"], timeout=timeout + 30, what=f"pg_ctl stop -D {p['data']}")
    return True


# ----- the server ------------------------------------------------------------------------------
def read_state(folder: str | Path) -> dict | None:
    """The record ``start`` wrote in ``folder/server.json``; None when there is none."""
    from medpfl.io import read_json

    f = paths(folder)["state"]
    return read_json(f) if f.is_file() else None


def _write_state(folder: Path, record: dict) -> None:
    from medpfl.io import write_json

    write_json(paths(folder)["state"], record)


def _mlflow_alive(rec: dict | None) -> bool:
    m = (rec or {}).get("mlflow") or {}
    return bool(m.get("pid")) and process_alive(int(m["pid"]), m.get("start_ticks"))


def _check_folder(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrackingServerError(f"--dir {root}: cannot create it ({e.strerror})") from None
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise TrackingServerError(f"--dir {root}: not a writable folder")


def start(folder: str | Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT, workers: int = 1,
          timeout: float = 180.0, allowed_hosts: list[str] | None = None,
          cors_origins: list[str] | None = None) -> dict:
    """Start (creating what is missing) the PostgreSQL-backed MLflow tracking server in ``folder``.

    Creates the folder and the PostgreSQL cluster on first use (``initdb`` as ``postgres`` when
    root), starts PostgreSQL on its own socket, creates the ``mlflow`` database, starts
    ``mlflow server`` on ``host:port`` with ``workers`` worker processes (its own process
    group; MLflow's job runner off: ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` unless set),
    waits up to ``timeout`` seconds for ``/health`` and writes ``folder/server.json``.
    ``allowed_hosts``: the Host headers the server accepts (default
    :func:`default_allowed_hosts`); ``cors_origins``: the origins a browser may send requests
    from (default :func:`default_cors_origins`). A server already running there is left as it is.

    Returns the record (``tracking_uri``, ``mlflow``: pid, pgid, port, ...; ``postgres``: bin,
    data, socket, pid, ...; ``started``: what this call started). Raises
    :class:`TrackingServerError` for a folder that cannot be written, a port in use, or a server
    that does not come up (what this call started is stopped again), and its subclass
    :class:`~medpfl.errors.PostgresUnavailable` when PostgreSQL is missing or cannot start."""
    p = paths(folder)
    root = p["folder"]
    if not 0 < port < 65536:
        raise TrackingServerError(f"--port {port}: not a TCP port (1-65535)")
    if workers < 1:
        raise TrackingServerError(f"--workers {workers}: at least 1")
    old = read_state(root) or {}
    if _mlflow_alive(old):
        if _pg_running(find_postgres_bin(p["data"]), p, _pg_user()):
            return {**old, "started": []}
        stop_process_group(int(old["mlflow"]["pgid"]))  # PostgreSQL died under it: start both again
    if port_in_use(host, port):
        raise TrackingServerError(f"port {port} on {host} is in use (another server; `ss -ltnp` names it): "
                                  "choose another with --port")
    pg_bin = find_postgres_bin(p["data"])
    pg_user = _pg_user()
    _check_folder(root)
    created, pg_started = _ensure_postgres(p, pg_bin, pg_user)
    started = ["postgres"] if pg_started else []
    uri = backend_uri(p["socket"])
    p["artifacts"].mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--serve-artifacts",
           "--artifacts-destination", str(p["artifacts"]), "--host", host, "--port", str(port),
           "--workers", str(workers)]
    allowed = allowed_hosts if allowed_hosts is not None else default_allowed_hosts(host)
    if allowed:
        cmd += ["--allowed-hosts", ",".join(allowed)]
    origins = cors_origins if cors_origins is not None else default_cors_origins(host, port)
    if origins:
        cmd += ["--cors-allowed-origins", ",".join(origins)]
    env = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        env.pop(var, None)
    with open(p["mlflow_log"], "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{_url_host(_local_host(host))}:{port}"
    try:
        wait_healthy(base, proc, timeout, p["mlflow_log"])
    except BaseException:
        stop_process_group(proc.pid)
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            proc.wait(5)
        if pg_started:
            _stop_postgres(pg_bin, p, pg_user)
        raise
    started.append("mlflow")
    record = {
        "folder": str(root),
        "tracking_uri": f"http://{_url_host(client_host(host))}:{port}",
        "local_uri": base,
        "host": host, "port": port, "workers": workers,
        "mlflow": {"pid": proc.pid, "pgid": os.getpgid(proc.pid), "start_ticks": start_ticks(proc.pid),
                   "command": cmd, "log": str(p["mlflow_log"])},
        "postgres": {"bin": str(pg_bin), "data": str(p["data"]), "socket": str(p["socket"]), "port": PG_PORT,
                     "pid": _postmaster_pid(p["data"]), "user": pg_user or _current_user(), "database": DATABASE,
                     "log": str(p["pg_log"]), "backend_store_uri": uri,
                     "version": (p["data"] / "PG_VERSION").read_text().strip()},
        "artifacts": str(p["artifacts"]),
        "state": "running",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "created_cluster": created or bool(old.get("created_cluster")),
    }
    _write_state(root, record)
    return {**record, "started": started}


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def _started(folder: str | Path) -> tuple[dict, dict]:
    """``(paths(folder), its server.json record)``; raises :class:`TrackingServerError` when
    ``folder`` holds no ``server.json``."""
    p = paths(folder)
    rec = read_state(p["folder"])
    if rec is None:
        raise TrackingServerError(f"{p['state']}: no tracking server was started in {p['folder']} "
                                  "(medpfl tracking-server start --dir ... writes it)")
    return p, rec


def _recorded_pg_bin(rec: dict, p: dict) -> Path:
    """The PostgreSQL binaries ``start`` recorded, else the ones matching the cluster's version
    (:func:`find_postgres_bin`, which raises :class:`TrackingServerError` when none is found)."""
    pg = rec.get("postgres") or {}
    return Path(pg["bin"]) if pg.get("bin") and Path(pg["bin"]).is_dir() else find_postgres_bin(p["data"])


def stop(folder: str | Path, timeout: float = 30.0) -> dict:
    """Stop what :func:`start` started in ``folder``: the MLflow server's process group (only if
    its recorded pid is still that process) and the PostgreSQL cluster (``pg_ctl stop -m
    fast``). Marks ``server.json`` stopped. Returns ``{"stopped": [...], "record": ...}``.

    Raises :class:`TrackingServerError` when ``folder`` holds no ``server.json``."""
    p, rec = _started(folder)
    stopped = []
    if _mlflow_alive(rec) and stop_process_group(int(rec["mlflow"]["pgid"]), timeout):
        stopped.append("mlflow")
    if _stop_postgres(_recorded_pg_bin(rec, p), p, _pg_user()):
        stopped.append("postgres")
    rec = {**rec, "state": "stopped", "stopped_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_state(p["folder"], rec)
    return {"stopped": stopped, "record": rec}


def status(folder: str | Path) -> dict:
    """What runs of the tracking server in ``folder``: ``{"record", "mlflow": bool (process alive
    and /health answers), "postgres": bool (pg_ctl status), "running": both}``.

    Raises :class:`TrackingServerError` when ``folder`` holds no ``server.json``."""
    p, rec = _started(folder)
    mlflow_up = _mlflow_alive(rec) and health_ok(rec["local_uri"])
    try:
        pg_up = (p["data"] / "PG_VERSION").is_file() and _pg_running(_recorded_pg_bin(rec, p), p, _pg_user())
    except TrackingServerError:
        pg_up = False
    return {"record": rec, "mlflow": mlflow_up, "postgres": pg_up, "running": mlflow_up and pg_up}


def backup_command(rec: dict, out: str = "mlflow.dump") -> str:
    """The ``pg_dump`` command line that writes the server's database to ``out`` (custom format,
    restored with ``pg_restore``), for the record ``rec`` of :func:`start`."""
    pg = rec["postgres"]
    return (f"{shlex.quote(str(Path(pg['bin']) / 'pg_dump'))} -h {shlex.quote(pg['socket'])} -p {pg['port']} "
            f"-U {DB_ROLE} -Fc -f {shlex.quote(out)} {pg['database']}")
