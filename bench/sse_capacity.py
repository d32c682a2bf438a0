"""Capacity: many concurrent SSE subscribers at a steady event rate, beside a writer load.

    python -m bench.sse_capacity [--subscribers 10000] [--rate 5] [--seconds 20]
                                 [--workers 1] [--clients 4] [--load-rate 50]

One run, one database, one `taskledger serve` (granian, --workers N):

1. Baseline: the writer load alone, `POST /tasks` at --load-rate requests/s
   (open loop: a request is sent when it is due, whether or not the previous
   ones have been answered), for --seconds. Its latency is the baseline.
2. Subscribers: --subscribers streams on `GET /stream?project=feed`, spread over
   --clients client processes (each raises its own open-files limit and speaks
   bare asyncio sockets, so the client side is not the bottleneck). Memory per
   open stream is the server's resident memory after they connected minus
   before, divided by their number.
3. The same writer load again while a ticker appends --rate events/s to project
   `feed` straight into the log. Each event carries the wall clock just before
   its append transaction began; latency is the time a subscriber read it
   minus that, so it includes the commit, the wake-up, the tailer, fan-out,
   the socket and the client's own scheduling. Every subscriber must receive
   every ticker event exactly once, in order (the writer load's events are in
   another project and filtered out by the server).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import time
from array import array
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any

import asyncpg
import httpx

from bench.harness import ADMIN_TOKEN as TOKEN
from bench.harness import (
    Database,
    Postgres,
    Server,
    describe,
    exit_cleanly_on_sigterm,
    machine,
    percentile,
    raise_fd_limit,
)
from bench.sse_latency import Subscriber
from taskledger import log as store
from taskledger.log import NewEvent

FEED = "feed"


# -- a client process -------------------------------------------------------------


def client_main(conn: Connection, port: int, token: str, n: int) -> None:
    raise_fd_limit()
    asyncio.run(_client(conn, port, token, n))


async def _client(conn: Connection, port: int, token: str, n: int) -> None:
    loop = asyncio.get_running_loop()
    subs = [Subscriber(f"/stream?project={FEED}", token) for _ in range(n)]
    tasks: list[asyncio.Task[None]] = []
    for i, s in enumerate(subs):
        tasks.append(asyncio.create_task(s.run(port)))
        if i % 50 == 49:
            await asyncio.sleep(0.02)
    try:
        await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in subs)), 600)
    except TimeoutError:
        conn.send(("failed", sum(1 for s in subs if not s.ready.is_set())))
        return
    conn.send(("ready", n))
    _, measure_after = await loop.run_in_executor(None, conn.recv)
    for s in subs:
        s.measure_after = measure_after
    # This process's own collections would show up as delivery latency.
    gc.collect()
    gc.freeze()
    gc.disable()
    cpu0 = time.process_time()
    _, expected = await loop.run_in_executor(None, conn.recv)
    cpu = time.process_time() - cpu0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(len(s.ids) < len(expected) for s in subs):
        await asyncio.sleep(0.1)
    bad = sum(1 for s in subs if s.ids != expected)
    closed = sum(1 for s in subs if s.closed.is_set())
    lat = array("d", (x for s in subs for x in s.latencies))
    conn.send(("done", bad, closed, cpu, lat.tobytes()))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- the server side's load -----------------------------------------------------------


async def writer_load(base: str, rate: float, seconds: float) -> tuple[list[float], int]:
    """POST /tasks at `rate`/s for `seconds`, open loop: latencies (s) and failures."""
    latencies: list[float] = []
    failures = 0
    async with httpx.AsyncClient(base_url=base, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"},
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as http:

        async def one(k: int) -> None:
            nonlocal failures
            t0 = time.perf_counter()
            try:
                r = await http.post("/tasks", json={"title": f"load {k}", "project": "load"})
                ok = r.status_code == 201
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                failures += 1

        start = time.monotonic()
        pending: list[asyncio.Task[None]] = []
        k = 0
        while (due := start + k / rate) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            pending.append(asyncio.create_task(one(k)))
            k += 1
        await asyncio.gather(*pending)
    return latencies, failures


async def ticker(pool: asyncpg.Pool, rate: float, start: float, until: float, out: list[int]) -> None:
    k = 0
    while (due := start + k / rate) < until:
        await asyncio.sleep(max(0.0, due - time.time()))
        async with pool.acquire() as c, c.transaction():
            rec = await store.append(c, "task:feed-ticker", [NewEvent(type="task.note", data={"t": time.time()})],
                                     meta={"project": FEED})
        out.extend(e.seq for e in rec)
        k += 1


def _ms(xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return (f"p50 {percentile(ms, 50):.1f} ms, p90 {percentile(ms, 90):.1f} ms, "
            f"p99 {percentile(ms, 99):.1f} ms, max {max(ms, default=float('nan')):.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subscribers", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=5.0, help="ticker events per second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=1, help="server worker processes")
    ap.add_argument("--clients", type=int, default=4, help="client processes holding the subscribers")
    ap.add_argument("--load-rate", type=float, default=50.0, help="POST /tasks per second")
    ap.add_argument("--data-dir", default="/tmp/taskledger-bench-pg")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()
    raise_fd_limit()
    pg = Postgres(data_dir=args.data_dir)
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {describe(machine(pg.version))}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        asyncio.run(run(args, pg.database()))
    finally:
        pg.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


async def run(args: argparse.Namespace, db: Database) -> None:
    url = await db.create()
    cap = str(args.subscribers + 100)  # each worker may be handed any share of them
    server = Server(url, env={"TASKLEDGER_MAX_STREAMS_PER_TOKEN": cap, "TASKLEDGER_MAX_STREAMS": cap},
                    workers=args.workers)
    ctx = mp.get_context("spawn")
    clients: list[tuple[Any, Connection]] = []
    try:
        await server.ready()
        await writer_load(server.base, args.load_rate, 2)  # warm-up
        base_lat, base_fail = await writer_load(server.base, args.load_rate, args.seconds)
        print(f"writer load alone (baseline): {args.load_rate:g} POST /tasks/s for {args.seconds:g}s: "
              f"{_ms(base_lat)}; failures {base_fail}", flush=True)

        await asyncio.sleep(1)
        rss0 = server.rss_kib()
        t_connect = time.monotonic()
        share = [args.subscribers // args.clients + (1 if i < args.subscribers % args.clients else 0)
                 for i in range(args.clients)]
        for n in share:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(child, server.port, TOKEN, n), daemon=True)
            p.start()
            clients.append((p, parent))
        loop = asyncio.get_running_loop()
        for _, c in clients:
            msg = await loop.run_in_executor(None, c.recv)
            if msg[0] != "ready":
                raise RuntimeError(f"a client could not connect all its subscribers: {msg}")
        connect_s = time.monotonic() - t_connect
        await asyncio.sleep(2)
        rss1 = server.rss_kib()
        print(f"{args.subscribers} subscribers connected in {connect_s:.1f}s over {args.clients} client "
              f"processes; server RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB: "
              f"{(rss1 - rss0) / args.subscribers:.1f} KiB per open stream", flush=True)

        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        start = time.time() + 0.5
        for _, c in clients:
            c.send(("go", start + args.warmup))
        cpu0 = server.cpu_seconds()
        seqs: list[int] = []
        tick = asyncio.create_task(ticker(pool, args.rate, start, start + args.warmup + args.seconds, seqs))
        await asyncio.sleep(start + args.warmup - time.time())
        cpu_w = server.cpu_seconds()
        load_lat, load_fail = await writer_load(server.base, args.load_rate, args.seconds)
        cpu_server = server.cpu_seconds() - cpu_w
        await tick
        await pool.close()
        del cpu0
        for _, c in clients:
            c.send(("stop", seqs))
        bad = closed = 0
        cpu_clients = 0.0
        lat: list[float] = []
        for _, c in clients:
            msg = await loop.run_in_executor(None, c.recv)
            bad += msg[1]
            closed += msg[2]
            cpu_clients += msg[3]
            lat.extend(array("d", msg[4]))
    finally:
        for p, _ in clients:
            p.join(5)
            if p.is_alive():
                p.kill()
        server.stop()
        with contextlib.suppress(Exception):
            await db.drop()

    print(f"server: granian, {args.workers} worker(s); ticker {args.rate:g} events/s for "
          f"{args.warmup:g}+{args.seconds:g}s ({len(seqs)} events, {len(seqs) * args.subscribers} deliveries)")
    print(f"CPU while measuring: server {cpu_server / args.seconds:.0%} of a core, client processes "
          f"{cpu_clients / (args.warmup + args.seconds):.0%} of a core")
    print(f"subscribers with a wrong sequence (missing, repeated or out of order): {bad}; connections closed: {closed}")
    p99 = percentile([x * 1000 for x in lat], 99)
    print(f"append->deliver over {len(lat)} deliveries after the warm-up: {_ms(lat)}")
    print(f"writer load beside them: {_ms(load_lat)}; failures {load_fail}")
    b99, l99 = percentile(base_lat, 99), percentile(load_lat, 99)
    b50, l50 = percentile(base_lat, 50), percentile(load_lat, 50)
    print(f"writer load vs baseline: p50 {l50 / b50 - 1:+.0%}, p99 {l99 / b99 - 1:+.0%}")
    ok = p99 < 100 and bad == 0 and l50 <= b50 * 1.2 and l99 <= b99 * 1.2
    print(f"target (p99 < 100 ms, every sequence right, writer latency within 20 %): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
