"""Catch-up speed: one SSE subscriber reading the whole log from since_seq=0.

    python -m bench.sse_catchup [--events 1000000]

Seeds a fresh database with N events through the event store (valid hash chain,
1,000 events per append), then, in the same run and on the same rows:

* raw asyncpg read: the rows paged `WHERE seq > $1 ORDER BY seq LIMIT 2000`,
  every column, as asyncpg returns them (jsonb as text);
* raw asyncpg read of the event JSON the feed sends (the same query the
  server's catch-up uses), for reference;
* SSE: `GET /stream?since_seq=0` on a `taskledger serve` process, read by a
  bare socket client that counts events and checks the ids are 1..N in order.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg

from bench.harness import ADMIN_TOKEN as TOKEN
from bench.harness import Database, Postgres, Server, describe, exit_cleanly_on_sigterm, machine, server_version
from taskledger import log as store
from taskledger.log import EVENT_ROW_SQL, NewEvent, event_json

_ID = re.compile(rb"\nid: ([0-9]+)\r")


async def seed(url: str, n: int, per_append: int = 1000) -> float:
    t0 = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        done = 0
        while done < n:
            k = min(per_append, n - done)
            events = [
                NewEvent(type="task.note" if (done + i) % 5 else "task.created",
                         data={"title": f"event {done + i}", "n": done + i, "labels": ["bench", "seed"],
                               "note": "lorem ipsum dolor sit amet, consectetur adipiscing elit"})
                for i in range(k)
            ]
            async with conn.transaction():
                await store.append(conn, f"task:seed-{done // per_append}", events,
                                   meta={"project": "bench", "actor": "seed", "role": "producer"})
            done += k
        await conn.execute("VACUUM ANALYZE events")
    finally:
        await conn.close()
    return time.perf_counter() - t0


async def raw_read(url: str, sql: str, n: int, page: int = 2000, build: Any = None) -> float:
    """Events/s reading `sql` in keyset pages; `build(row)` is applied to each row if given."""
    conn = await asyncpg.connect(url)
    try:
        t0 = time.perf_counter()
        cursor, total = 0, 0
        while True:
            rows = await conn.fetch(sql, cursor, page)
            if not rows:
                break
            if build is not None:
                for r in rows:
                    build(r)
            total += len(rows)
            cursor = rows[-1][0]
        dt = time.perf_counter() - t0
    finally:
        await conn.close()
    assert total == n, (total, n)
    return n / dt


class Counter(asyncio.Protocol):
    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.last = 0
        self.in_order = True
        self.buf = b""
        self.done = asyncio.get_running_loop().create_future()
        self.bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(f"GET /stream?since_seq=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())

    def data_received(self, data: bytes) -> None:
        self.bytes += len(data)
        buf = self.buf + data
        cut = buf.rfind(b"\r\n\r\n")
        if cut < 0:
            self.buf = buf
            return
        # Keep the blank line's last CRLF with the rest, so every id line there
        # still starts after a newline.
        done, self.buf = buf[: cut + 2], buf[cut + 2:]
        ids = _ID.findall(done)
        if ids:
            first, last = int(ids[0]), int(ids[-1])
            if first != self.last + 1 or last != self.last + len(ids):
                self.in_order = False
            self.count += len(ids)
            self.last = last
        if self.count >= self.n and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"closed after {self.count} events"))


async def sse_read(port: int, n: int) -> tuple[float, Counter]:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    transport, proto = await loop.create_connection(lambda: Counter(n), "127.0.0.1", port)
    try:
        await asyncio.wait_for(proto.done, max(60.0, n / 2000))
    except TimeoutError:
        raise RuntimeError(f"stalled after {proto.count} events, last id {proto.last}") from None
    finally:
        transport.close()
    return n / (time.perf_counter() - t0), proto


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--server", choices=["granian", "uvicorn"], default="granian")
    ap.add_argument("--data-dir", default="/tmp/taskledger-bench-pg")
    args = ap.parse_args()
    exit_cleanly_on_sigterm()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    pg = Postgres(data_dir=args.data_dir)
    try:
        asyncio.run(run(args, pg.database(), load))
    finally:
        pg.close()


async def run(args: argparse.Namespace, db: Database, load: str) -> None:
    n = args.events
    url = await db.create()
    try:
        seeded = await seed(url, n)
        print(f"seeded {n} events in {seeded:.1f}s", flush=True)
        size = await (await asyncpg.connect(url)).fetchval("SELECT pg_size_pretty(pg_table_size('events'))")
        server = Server(url, server=args.server)
        try:
            await server.ready()
            raw_cols = await raw_read(
                url, "SELECT seq, stream, stream_seq, type, data, meta, recorded_at, hash FROM events "
                "WHERE seq > $1 ORDER BY seq LIMIT $2", n)
            raw_json = await raw_read(
                url, f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq > $1 ORDER BY seq LIMIT $2", n,
                build=event_json)
            cpu0 = server.cpu_seconds()
            sse, proto = await sse_read(server.port, n)
            cpu = server.cpu_seconds() - cpu0
        finally:
            server.stop()
    finally:
        await db.drop()
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {describe(machine(await server_version(db.server_url)))}; load average before: {load}")
    print(f"seeded {n} events ({size}) through the store in {seeded:.1f}s")
    print(f"raw asyncpg read, all columns, pages of 2000: {raw_cols:,.0f} events/s")
    print(f"raw asyncpg read, event JSON as the feed sends it: {raw_json:,.0f} events/s")
    print(f"SSE catch-up from since_seq=0 ({args.server}): {sse:,.0f} events/s "
          f"({proto.bytes / 1e6:.0f} MB; server CPU {cpu:.1f}s); ids 1..{proto.last} in order: {proto.in_order}")
    ratio = sse / raw_cols
    print(f"catch-up / raw read = {ratio:.2f} (target >= 0.5: {'met' if ratio >= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
