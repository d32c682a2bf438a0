"""A test topology in one command: N `taskledger serve` replicas behind HAProxy, on PostgreSQL.

    python -m deploy.cluster                      # 3 replicas, proxy on 127.0.0.1:8080, own PostgreSQL
    python -m deploy.cluster --standby            # ... on a primary + synchronous hot standby
    python -m deploy.cluster --database-url URL   # ... on an existing server
    python -m deploy.cluster --replicas 1 --stream-replicas 2   # streams to processes of their own

It prints the proxy's URL and the admin token, and runs until interrupted; then
it stops everything it started (replicas drain first). The tests drive the same
classes: `Cluster` for the whole, `Replica`, `Proxy` and `deploy.postgres.PgServer`
for each part. HAProxy is Debian's package, installed when missing (as root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg
import httpx

from deploy.postgres import PgServer, free_port, multi_host_url

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).with_name("haproxy.cfg.tmpl")
DATABASE = "taskledger"
STREAM_PATHS = r"^/stream$ ^/tasks/[^/]+/stream$ ^/jobs/[^/]+/stream$"
"""The SSE routes (contract section 5), as HAProxy path regexes."""

_CHECKS = """\
    # /readyz turns 503 the moment a replica is told to stop (TASKLEDGER_DRAIN_SECONDS),
    # so it leaves the rotation while it still serves; fall x inter must be
    # well inside the drain delay.
    option httpchk
    http-check send meth GET uri /readyz
    http-check expect status 200
    default-server check inter {check_ms}ms fastinter {check_ms}ms downinter {check_ms}ms fall 2 rise 2
    # which replica answered (for operators and for the tests' spread checks)
    http-response set-header X-Taskledger-Replica %[srv_name]"""

_STREAM_ROUTING = f"""\
    # Streams to processes of their own: every delivery runs on its process's
    # event loop, so writes and reads keep a loop (and a core) free of fan-out.
    acl sse path_reg {STREAM_PATHS}
    use_backend streams if sse
"""


def ensure_haproxy() -> str:
    """The haproxy binary; Debian's package is installed when missing (needs root)."""
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if found:
        return found
    if os.geteuid() != 0:
        raise RuntimeError("haproxy is not installed: apt-get install -y haproxy")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "haproxy"], check=True, env=env, stdout=subprocess.DEVNULL)
    return shutil.which("haproxy") or "/usr/sbin/haproxy"


class Replica:
    """One `taskledger serve` process on 127.0.0.1."""

    def __init__(self, name: str, database_url: str, root: Path, env: dict[str, str]) -> None:
        self.name = name
        self.database_url = database_url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> Replica:
        cmd = [sys.executable, "-m", "taskledger.service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--database-url", self.database_url]
        env = {**os.environ, **self.env}
        env.pop("TASKLEDGER_DATABASE_URL", None)
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60) -> Replica:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited: {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/readyz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"replica {self.name} never became ready: {self.log()}")

    def start(self) -> Replica:
        return self.spawn().wait_ready()

    def serving(self) -> bool:
        """Whether it still answers requests (whatever its readiness)."""
        try:
            return httpx.get(self.base + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the server's main process, as systemd does (it drains, then exits)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """kill -9 of the server and its workers."""
        if self.running:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> None:
        if self.running:
            self.terminate()
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


def _servers(replicas: list[Replica]) -> str:
    return "\n".join(f"    server {r.name} 127.0.0.1:{r.port}" for r in replicas)


def _maxconn() -> int:
    """As many connections as the file descriptor limit allows (two each), at most 20,000."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(256, min(20_000, (soft - 64) // 2))


class Proxy:
    """HAProxy in the foreground, with its admin socket for the servers' states."""

    def __init__(self, root: Path, replicas: list[Replica], *, port: int | None = None, bind: str = "127.0.0.1",
                 check_ms: int = 200, stream_replicas: list[Replica] | None = None) -> None:
        self.port = port or free_port()
        self.base = f"http://{bind}:{self.port}"
        self.cfg = root / "haproxy.cfg"
        self.socket = root / "haproxy.sock"
        self.log_path = root / "haproxy.log"
        checks = _CHECKS.format(check_ms=check_ms)
        stream_backend = ""
        if stream_replicas:
            # a stream lasts: the replica with the fewest open ones takes the next
            stream_backend = "\nbackend streams\n    balance leastconn\n" + checks + "\n" + _servers(stream_replicas)
        self.cfg.write_text(string.Template(TEMPLATE.read_text()).substitute(
            stats_socket=self.socket, bind=bind, port=self.port, checks=checks, servers=_servers(replicas),
            stream_routing=_STREAM_ROUTING if stream_replicas else "", stream_backend=stream_backend,
            maxconn=_maxconn()))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proxy:
        haproxy = ensure_haproxy()
        subprocess.run([haproxy, "-c", "-q", "-f", str(self.cfg)], check=True)
        with self.log_path.open("ab") as logf:
            self.proc = subprocess.Popen([haproxy, "-db", "-f", str(self.cfg)], stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("haproxy did not start: " + self.log_path.read_text(errors="replace"))
            time.sleep(0.05)
        return self

    def command(self, cmd: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket))
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def states(self) -> dict[str, str]:
        """Each replica's state as the proxy sees it: UP, DOWN, `UP 1/2` (rising), ..."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        out: dict[str, str] = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("pxname") in ("replicas", "streams") and row.get("svname") not in ("BACKEND", None):
                out[row["svname"]] = row["status"]
        return out

    def wait_state(self, name: str, state: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.states().get(name) == state:
                return
            time.sleep(0.05)
        raise RuntimeError(f"replica {name} is {self.states().get(name)}, not {state}, after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


async def _ensure_database(url: str, name: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


class Cluster:
    """Replicas behind the proxy, on `database_url` or on PostgreSQL servers of its own."""

    def __init__(self, *, replicas: int = 3, database_url: str | None = None, standby: bool = False,
                 root: Path | None = None, port: int | None = None, bind: str = "127.0.0.1",
                 admin_token: str | None = None, drain_seconds: float = 1.5, check_ms: int = 200,
                 env: dict[str, str] | None = None, stream_replicas: int = 0) -> None:
        """`stream_replicas` > 0: that many more replicas serve the SSE routes
        (STREAM_PATHS) and nothing else; the `replicas` serve everything else."""
        self.root = root or Path(tempfile.mkdtemp(prefix="tl-cluster-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._own_root = root is None
        self.n = replicas
        self.n_streams = stream_replicas
        self.database_url = database_url
        self.standby = standby
        self.admin_token = admin_token or "cluster-admin-" + uuid.uuid4().hex
        self.env = {"TASKLEDGER_ADMIN_TOKEN": self.admin_token, "TASKLEDGER_DRAIN_SECONDS": str(drain_seconds),
                    **(env or {})}
        self.port = port
        self.bind = bind
        self.check_ms = check_ms
        self.servers: list[PgServer] = []
        self.replicas: list[Replica] = []
        self.stream_replicas: list[Replica] = []
        self.proxy: Proxy | None = None

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.base

    def start(self) -> Cluster:
        try:
            if self.database_url is None:
                self.database_url = self._start_postgres()
            self.replicas = [Replica(f"r{i + 1}", self.database_url, self.root, self.env) for i in range(self.n)]
            self.stream_replicas = [Replica(f"s{i + 1}", self.database_url, self.root, self.env)
                                    for i in range(self.n_streams)]
            every = self.replicas + self.stream_replicas
            for r in every:  # all at once; migrations serialise on their advisory lock
                r.spawn()
            for r in every:
                r.wait_ready()
            self.proxy = Proxy(self.root, self.replicas, port=self.port, bind=self.bind,
                               check_ms=self.check_ms, stream_replicas=self.stream_replicas).start()
            for r in every:
                self.proxy.wait_state(r.name, "UP")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_postgres(self) -> str:
        primary = PgServer(self.root, "pg1").init_primary(sync_standby="pg2" if self.standby else None).start()
        self.servers.append(primary)
        if self.standby:
            standby = PgServer(self.root, "pg2").init_standby(primary).start()
            self.servers.append(standby)
            standby.wait_streaming(primary)
        asyncio.run(_ensure_database(primary.url(), DATABASE))
        if self.standby:
            return multi_host_url(self.servers, DATABASE)
        return primary.url(DATABASE)

    def replica(self, name: str) -> Replica:
        return next(r for r in self.replicas + self.stream_replicas if r.name == name)

    def restart(self, r: Replica, timeout: float = 60) -> bool:
        """Rolling-restart step: SIGTERM, wait for the exit, start again on the same
        port, wait until the proxy has it back in rotation. True when the proxy
        took the replica out of rotation while it was still serving (it drained)."""
        assert self.proxy is not None
        r.terminate()
        drained = False
        deadline = time.monotonic() + timeout
        while r.running and time.monotonic() < deadline:
            if self.proxy.states().get(r.name, "").startswith("DOWN"):
                drained = r.serving()
                break
            time.sleep(0.02)
        code = r.wait(timeout)
        if code != 0:
            raise RuntimeError(f"replica {r.name} exited {code} on SIGTERM: {r.log()}")
        r.start()
        self.proxy.wait_state(r.name, "UP", timeout)
        return drained

    def stop(self) -> None:
        every = self.replicas + self.stream_replicas
        for r in every:
            r.terminate()
        for r in every:
            r.stop()
        if self.proxy is not None:
            self.proxy.stop()
        for s in reversed(self.servers):
            s.destroy()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
                 ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--stream-replicas", type=int, default=0,
                   help="replicas that serve only the SSE routes (the proxy routes those paths to them)")
    p.add_argument("--port", type=int, default=8080, help="the proxy's port")
    p.add_argument("--bind", default="127.0.0.1", help="the proxy's address")
    p.add_argument("--database-url", default=None, help="use this PostgreSQL (default: start one)")
    p.add_argument("--standby", action="store_true", help="a primary and a synchronous hot standby")
    p.add_argument("--dir", type=Path, default=None, help="where data and logs go (default: a temp dir)")
    p.add_argument("--drain-seconds", type=float, default=1.5)
    args = p.parse_args(argv)
    cluster = Cluster(replicas=args.replicas, database_url=args.database_url, standby=args.standby,
                      root=args.dir, port=args.port, bind=args.bind,
                      admin_token=os.environ.get("TASKLEDGER_ADMIN_TOKEN"), drain_seconds=args.drain_seconds,
                      stream_replicas=args.stream_replicas)
    stop = False

    def on_signal(_signum: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster.start()
    try:
        print(f"taskledger cluster: {cluster.url}  (admin token: {cluster.admin_token})", flush=True)
        for r in cluster.replicas + cluster.stream_replicas:
            print(f"  replica {r.name}: {r.base}  log {r.log_path}", flush=True)
        for s in cluster.servers:
            print(f"  postgres {s.name}: {s.url()}  log {s.log}", flush=True)
        print(f"  haproxy: {cluster.proxy.cfg if cluster.proxy else ''}; Ctrl-C stops everything", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
