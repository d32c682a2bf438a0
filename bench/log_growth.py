"""How much disk the log takes per million events, and how much WAL it writes.

    .venv/bin/python -m bench.log_growth                   # 200,000 events, about a minute
    .venv/bin/python -m bench.log_growth --events 1000000

Seeds a fresh migrated database with maker-checker lifecycles from the pure
model (`bench.rebuild.seed`: 12 events over two streams per task, real payloads
and meta, a valid hash chain, written with COPY), runs VACUUM ANALYZE, then
reads the size of the `events` heap, its TOAST and each index, and the WAL
written meanwhile. Sizes grow linearly with the event count (append-only, no
updates, no dead rows), so the per-event figures scale to a million and beyond.
Uses a throw-away embedded PostgreSQL unless `--database-url` names a server
(where it creates and drops its own database).
"""

from __future__ import annotations

import argparse
import asyncio

import asyncpg

from bench.harness import Database, Postgres, describe, machine
from bench.rebuild import seed

SIZES = """
SELECT c.relname AS name, pg_relation_size(c.oid) AS bytes
FROM pg_class c
WHERE c.oid = 'events'::regclass
   OR c.oid = (SELECT reltoastrelid FROM pg_class WHERE oid = 'events'::regclass)
   OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'events'::regclass)
ORDER BY bytes DESC
"""


async def main_async(events: int, pg: Postgres) -> None:
    async with Database(pg.url, "tl_bench_growth_") as db:
        conn = await asyncpg.connect(db.url)
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
        head, secs = await seed(conn, events)
        wal = await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)", wal0)
        await conn.execute("VACUUM ANALYZE events")
        rows = await conn.fetch(SIZES)
        total = await conn.fetchval("SELECT pg_total_relation_size('events')")
        payload = await conn.fetchval(
            "SELECT avg(pg_column_size(data) + pg_column_size(meta)) FROM events")
        print(f"seeded {head:,} events in {secs:.1f}s")
        print("| relation | bytes/event | MB per 1,000,000 events |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['bytes'] / head:,.0f} | {r['bytes'] / head * 1e6 / 2**20:,.0f} |")
        print(f"| **events, total** | **{total / head:,.0f}** | **{total / head * 1e6 / 2**20:,.0f}** |")
        per = float(wal) / head
        print(f"| WAL written while seeding (COPY) | {per:,.0f} | {per * 1e6 / 2**20:,.0f} |")
        print(f"average stored data+meta per event: {float(payload):,.0f} bytes")
        await conn.close()
        info = machine(pg.version)
        print(f"machine: {describe(info)}; {info['date']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    with Postgres(args.database_url) as pg:
        asyncio.run(main_async(args.events, pg))


if __name__ == "__main__":
    main()
