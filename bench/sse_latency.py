"""Append -> deliver latency over SSE with many concurrent subscribers on one process.

    python -m bench.sse_latency [--subscribers 1000] [--rate 20] [--seconds 20]

Starts a database (embedded, or a fresh one on TASKLEDGER_BENCH_DATABASE_URL's
server) and one `taskledger serve` process (granian, one worker), opens N
subscribers to `GET /stream` from one client process using plain sockets (a
light client, so the measurement is the server's rather than an HTTP library's),
and has W writers append events at a steady total rate straight into the log.
Each event carries `t`, the wall-clock time just before its append transaction
began; latency = the time a subscriber read it minus `t`, so it includes the
commit, the wake-up, the tailer's read, fan-out, the socket and the client's own
scheduling. Every subscriber must receive every event exactly once, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import sys
import time
from datetime import UTC, datetime

import asyncpg

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
    server_version,
)
from taskledger import log as store
from taskledger.log import NewEvent

load = ""
_T = re.compile(rb'"t": ([0-9.e+-]+)')
_ID = re.compile(rb"\nid: ([0-9]+)\r")


class Subscriber(asyncio.Protocol):
    """One SSE connection as a bare asyncio protocol: the cheapest client Python has."""

    def __init__(self, path: str = "/stream", token: str = TOKEN) -> None:
        self.path = path
        self.token = token
        self.ids: list[int] = []
        self.latencies: list[float] = []
        self.received: list[tuple[int, float]] = []
        self.ready = asyncio.Event()
        self.closed = asyncio.Event()
        self.measure_after = float("inf")
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(
            f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
            f"Authorization: Bearer {self.token}\r\n\r\n".encode()
        )

    def data_received(self, data: bytes) -> None:
        now = time.time()
        buf = self.buf + data
        cut = buf.rfind(b"\r\n\r\n")
        if cut < 0:
            self.buf = buf
            return
        # Keep the blank line's last CRLF with the rest, so every id line there
        # still starts after a newline.
        done, self.buf = buf[: cut + 2], buf[cut + 2:]
        if not self.ready.is_set() and b"retry: " in done:
            self.ready.set()
        ids = [int(m) for m in _ID.findall(done)]
        self.ids.extend(ids)
        for seq, m in zip(ids, _T.findall(done), strict=False):
            t = float(m)
            if t >= self.measure_after:
                self.latencies.append(now - t)
                self.received.append((seq, now))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    async def run(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, "127.0.0.1", port)
        try:
            await self.closed.wait()
        finally:
            if self.transport is not None:
                self.transport.close()


COMMITTED: dict[int, float] = {}
"""seq -> wall clock right after its append transaction committed."""


async def writer(pool: asyncpg.Pool, w: int, writers: int, rate: float, start: float, until: float,
                 out: list[int]) -> None:
    period = writers / rate
    k = 0
    while True:
        due = start + (k + w / writers) * period
        if due >= until:
            return
        delay = due - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        async with pool.acquire() as c, c.transaction():
            rec = await store.append(c, f"task:bench-{w}", [NewEvent(type="task.note", data={"t": time.time()})],
                                     meta={"project": "bench"})
        done = time.time()
        for e in rec:
            COMMITTED[e.seq] = done
        out.extend(e.seq for e in rec)
        k += 1


async def _writers_alone(url: str, writers: int, rate: float, start: float, until: float) -> None:
    """The load generator as its own process: its timestamps owe nothing to the subscribers' loop."""
    pool = await asyncpg.create_pool(url, min_size=writers, max_size=writers)
    written: list[int] = []
    gc.disable()
    await asyncio.gather(*(writer(pool, w, writers, rate, start, until, written) for w in range(writers)))
    await pool.close()
    print(json.dumps({"written": written, "committed": COMMITTED}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--as-writers", nargs=3, metavar=("URL", "START", "UNTIL"), help=argparse.SUPPRESS)
    ap.add_argument("--same-process-writers", action="store_true",
                    help="append from the subscribers' process (as before: the writers then wait on its loop)")
    ap.add_argument("--workers", type=int, default=1, help="serve processes")
    ap.add_argument("--subscribers", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=20.0, help="events per second, all writers together")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--server", choices=["granian", "uvicorn"], default="granian")
    ap.add_argument("--data-dir", default="/tmp/taskledger-bench-pg")
    args = ap.parse_args()
    if args.as_writers:
        url, start, until = args.as_writers
        asyncio.run(_writers_alone(url, args.writers, args.rate, float(start), float(until)))
        return
    exit_cleanly_on_sigterm()
    raise_fd_limit()
    global load  # noqa: PLW0603 - printed at the end
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    pg = Postgres(data_dir=args.data_dir)
    try:
        asyncio.run(run(args, pg.database()))
    finally:
        pg.close()


async def run(args: argparse.Namespace, db: Database) -> None:
    url = await db.create()
    server = Server(url, env={"TASKLEDGER_MAX_STREAMS_PER_TOKEN": str(args.subscribers + 10)},
                    server=args.server, workers=args.workers)
    tasks: list[asyncio.Task[None]] = []
    try:
        await server.ready()
        subs = [Subscriber() for _ in range(args.subscribers)]
        t_connect = time.monotonic()
        for i, s in enumerate(subs):
            tasks.append(asyncio.create_task(s.run(server.port)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*(s.ready.wait() for s in subs)), 120)
        connect_s = time.monotonic() - t_connect
        pool = await asyncpg.create_pool(url, min_size=args.writers, max_size=args.writers)
        start = time.time() + 0.5
        cpu0, own0 = server.cpu_seconds(), time.process_time()
        for s in subs:
            s.measure_after = start + args.warmup
        written: list[int] = []
        # The client's own garbage collections would show up as delivery latency
        # (the writers and the 1,000 sockets share this process): measure the server.
        gc.collect()
        gc.disable()
        try:
            if args.same_process_writers:
                await asyncio.gather(*(writer(pool, w, args.writers, args.rate, start, start + args.seconds,
                                              written) for w in range(args.writers)))
            else:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.sse_latency", "--as-writers", url, str(start),
                    str(start + args.seconds), "--writers", str(args.writers), "--rate", str(args.rate),
                    stdout=asyncio.subprocess.PIPE)
                out, _ = await proc.communicate()
                got = json.loads(out)
                written.extend(got["written"])
                COMMITTED.update({int(k): v for k, v in got["committed"].items()})
        finally:
            gc.enable()
        cpu_server, cpu_client = server.cpu_seconds() - cpu0, time.process_time() - own0
        await pool.close()
        expected = sorted(written)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(len(s.ids) < len(expected) for s in subs):
            await asyncio.sleep(0.1)
        bad = sum(1 for s in subs if s.ids != expected)
        lat = [x for s in subs for x in s.latencies]
        subs_out = subs
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        server.stop()
        await db.drop()

    ms = [x * 1000 for x in lat]
    if os.environ.get("SSE_BENCH_SPREAD"):
        per_event: dict[int, list[float]] = {}
        for sub in subs_out:
            for k, x in enumerate(sub.latencies):
                per_event.setdefault(k, []).append(x * 1000)
        firsts = [min(v) for v in per_event.values()]
        spreads = [max(v) - min(v) for v in per_event.values()]
        print(f"first delivery of an event: p50 {percentile(firsts, 50):.1f} ms; "
              f"spread first..last: p50 {percentile(spreads, 50):.1f} ms p99 {percentile(spreads, 99):.1f}")
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {describe(machine(await server_version(db.server_url)))}")
    print(f"server: {args.server}, {args.workers} worker(s); writers in "
          f"{'the subscribers' if args.same_process_writers else 'their own'} process; "
          f"subscribers: {args.subscribers} (connected in {connect_s:.1f}s); "
          f"writers: {args.writers}; rate: {args.rate:g} events/s for {args.seconds:g}s "
          f"({len(expected)} events, {len(expected) * args.subscribers} deliveries)")
    print(f"CPU during the writes: server {cpu_server / args.seconds:.0%} of a core, "
          f"bench client {cpu_client / args.seconds:.0%} of a core; load average before: {load}")
    print(f"subscribers with a wrong sequence (missing, repeated or out of order): {bad}")
    print(f"latency over {len(ms)} deliveries after a {args.warmup:g}s warm-up: "
          f"p50 {percentile(ms, 50):.1f} ms, p90 {percentile(ms, 90):.1f} ms, "
          f"p99 {percentile(ms, 99):.1f} ms, max {max(ms, default=float('nan')):.1f} ms")
    from_commit = [(now - COMMITTED[seq]) * 1000 for sub in subs_out for seq, now in sub.received
                   if seq in COMMITTED]
    print(f"of which after the commit returned (the feed's own part): p50 {percentile(from_commit, 50):.1f} ms, "
          f"p90 {percentile(from_commit, 90):.1f} ms, p99 {percentile(from_commit, 99):.1f} ms, "
          f"max {max(from_commit, default=float('nan')):.1f} ms")
    print(f"target p99 < 100 ms: {'met' if ms and percentile(ms, 99) < 100 and bad == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
