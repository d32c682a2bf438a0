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
import time
import uuid
from typing import Any

import asyncpg
import httpx

from bench.harness import Postgres, Server, describe, machine
from taskledger import log as store
from taskledger.events.canonical import verify_chain


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


async def run(args: argparse.Namespace, url: str, machine_line: str) -> None:
    server = Server(url, args.server, args.workers)
    base = server.base
    try:
        await server.ready()
        producer = server.token("producer")
        makers = [server.token("worker", node=f"node-m{i}") for i in range(args.makers)]
        checkers = [server.token("worker", node=f"node-c{i}") for i in range(args.checkers)]
        async with httpx.AsyncClient(base_url=base, timeout=60,
                                     limits=httpx.Limits(max_connections=200, max_keepalive_connections=200)) as http:
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
            cpu0 = server.cpu_seconds()
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
            serve_cpu = server.cpu_seconds() - cpu0
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
        print(f"{machine_line}; load before {args.load}")
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
        server.stop()


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
    with Postgres(args.database_url) as pg, pg.database("bench_loop_") as db:
        info = machine(pg.version)
        asyncio.run(run(args, db.url, f"date: {info['date']}; machine: {describe(info)}"))


if __name__ == "__main__":
    main()
