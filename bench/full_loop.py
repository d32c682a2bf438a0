"""The whole maker-checker loop through HTTP, with many concurrent workers.

    .venv/bin/python -m bench.full_loop                      # 2,000 tasks, 16 makers, 16 checkers
    .venv/bin/python -m bench.full_loop --tasks 500 --makers 4 --checkers 4

Starts a throw-away embedded PostgreSQL (or uses `--database-url`, where it
creates and drops its own database) and one `taskledger serve` process, creates
the tasks, then runs maker workers (node-m*) and checker workers (node-c*) as
asyncio clients in this process. Each loop is: create → claim → start →
complete (the service appends task.verifying and creates the verifier) →
checker claim → start → complete with PASS (task.verdict, task.verified).

It reports loops/s (tasks verified per second), HTTP commands/s (seven per
loop, plus the create) and events/s (eleven per loop), checks every task ended
`verified` with its verdict from a node other than its maker's, that seq is
1..head with no hole, and that the hash chain verifies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
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

from taskledger import log as store
from taskledger.events.canonical import verify_chain
from taskledger.service.ops.embedded import start_embedded, with_database

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "bench-admin-" + uuid.uuid4().hex


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_of(pid: int) -> float:
    """CPU seconds of a process and its children (from /proc)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
        pids += [int(p) for p in out.split()]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError):
            continue
    return total


async def worker(base: str, token: str, kind: str, project: str, stop: asyncio.Event,
                 counts: dict[str, int]) -> None:
    h = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        await _work(http, h, kind, project, stop, counts)


async def _work(http: httpx.AsyncClient, h: dict[str, str], kind: str, project: str, stop: asyncio.Event,
                counts: dict[str, int]) -> None:
    while not stop.is_set():
        r = await http.post("/tasks/claim", headers=h,
                            json={"task_types": [kind], "projects": [project], "lease_seconds": 60})
        if r.status_code == 204:
            await asyncio.sleep(0.02)
            continue
        r.raise_for_status()
        t = r.json()
        lease = t["lease_id"]
        (await http.post(f"/tasks/{t['id']}/start", headers=h, json={"lease_id": lease})).raise_for_status()
        body: dict[str, Any] = {"lease_id": lease}
        if kind == "verify":
            body |= {"outcome": "PASS", "verdicts": [{"requirement_id": "R1", "verdict": "PASS", "reason": "ok"}]}
        else:
            body["result"] = {"ok": True}
        (await http.post(f"/tasks/{t['id']}/complete", headers=h, json=body)).raise_for_status()
        counts[kind] += 1


async def run(args: argparse.Namespace, url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TASKLEDGER_ADMIN_TOKEN": ADMIN}
    log = Path(tempfile.mkstemp(prefix="full-loop-serve-", suffix=".log")[1])
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "taskledger.service.cli", "serve", "--port", str(port), "--database-url", url,
             "--server", args.server, "--workers", str(args.workers)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60,
                                     limits=httpx.Limits(max_connections=200, max_keepalive_connections=200)) as http:
            for _ in range(600):
                try:
                    if (await http.get("/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            admin = {"Authorization": f"Bearer {ADMIN}"}

            async def token(role: str, node: str | None = None) -> str:
                body = {"role": role, "name": f"{role}-{uuid.uuid4().hex[:6]}"} | ({"node": node} if node else {})
                r = await http.post("/tokens", headers=admin, json=body)
                r.raise_for_status()
                return str(r.json()["token"])

            producer = await token("producer")
            makers = [await token("worker", f"node-m{i}") for i in range(args.makers)]
            checkers = [await token("worker", f"node-c{i}") for i in range(args.checkers)]
            project = "loop-" + uuid.uuid4().hex[:6]
            ids = [f"L-{i}" for i in range(args.tasks)]
            ph = {"Authorization": f"Bearer {producer}"}
            sem = asyncio.Semaphore(32)

            async def create(tid: str) -> None:
                async with sem:
                    r = await http.post("/tasks", headers=ph, json={
                        "id": tid, "project": project, "title": "loop", "spec": "true",
                        "requirements": [{"id": "R1", "text": "works"}]})
                    r.raise_for_status()

            stop = asyncio.Event()
            counts = {"implement": 0, "verify": 0}
            cpu0 = cpu_of(proc.pid)
            client0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            workers = [asyncio.create_task(worker(base, tok, "implement", project, stop, counts)) for tok in makers]
            workers += [asyncio.create_task(worker(base, tok, "verify", project, stop, counts)) for tok in checkers]
            await asyncio.gather(*(create(i) for i in ids))
            while counts["verify"] < args.tasks:
                await asyncio.sleep(0.05)
                if time.perf_counter() - t0 > args.timeout:
                    raise RuntimeError(f"timed out: {counts}")
            elapsed = time.perf_counter() - t0
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            serve_cpu = cpu_of(proc.pid) - cpu0
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            client_cpu = (c1.ru_utime + c1.ru_stime) - (client0.ru_utime + client0.ru_stime)
            r = await http.get("/tasks", headers=ph, params={"project": project, "state": "verified", "limit": 1})
            r.raise_for_status()
        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        try:
            verified = await pool.fetchval(
                "SELECT count(*) FROM tasks WHERE project = $1 AND task_type = 'implement' AND state = 'verified'",
                project)
            same_node = await pool.fetchval(
                """SELECT count(*) FROM tasks t, jsonb_array_elements(t.body->'verdicts') v
                   WHERE t.project = $1 AND t.task_type = 'implement' AND v->>'node' = t.maker_node""", project)
            head, _ = await store.head(pool)
            events = [e.as_dict() for e in await store.read(pool, since_seq=0, limit=10_000_000)]
        finally:
            await pool.close()
        ok, bad, _ = verify_chain(events)
        gapless = [e["seq"] for e in events] == list(range(1, head + 1))
        n = args.tasks
        print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} cpus; load before {args.load}")
        print(f"server: {args.server} x{args.workers}; makers {args.makers}, checkers {args.checkers}; "
              f"tasks {n}")
        print(f"all verified: {verified == n} ({verified}/{n}); verdicts from the maker's node: {same_node}; "
              f"seq 1..{head} without holes: {gapless}; hash chain verifies: {ok} (first bad {bad})")
        print(f"elapsed {elapsed:.1f}s: {n / elapsed:,.0f} loops/s, {8 * n / elapsed:,.0f} HTTP commands/s, "
              f"{head / elapsed:,.0f} events/s (events per loop {head / n:.1f})")
        print(f"CPU: serve {100 * serve_cpu / elapsed:.0f}% of a core, bench client {100 * client_cpu / elapsed:.0f}%")
        if verified != n or same_node or not gapless or not ok:
            raise SystemExit("FAILED a check")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--makers", type=int, default=16)
    ap.add_argument("--checkers", type=int, default=16)
    ap.add_argument("--server", choices=["granian", "uvicorn"], default="granian")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    args.load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    tmp = None
    handle = None
    db = "bench_loop_" + uuid.uuid4().hex[:8]
    if args.database_url:
        admin_url = args.database_url
    else:
        tmp = tempfile.mkdtemp(prefix="full-loop-pg-")
        handle, u = start_embedded(tmp)
        admin_url = with_database(u, "postgres")

    async def create_db() -> None:
        c = await asyncpg.connect(admin_url)
        try:
            await c.execute(f'CREATE DATABASE "{db}"')
        finally:
            await c.close()

    async def drop_db() -> None:
        c = await asyncpg.connect(admin_url)
        try:
            await c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        finally:
            await c.close()

    asyncio.run(create_db())
    try:
        asyncio.run(run(args, with_database(admin_url, db)))
    finally:
        asyncio.run(drop_db())
        if handle is not None:
            handle.cleanup()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
