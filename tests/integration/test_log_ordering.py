"""The global seq is gapless and visible in commit order, whatever commits when."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from taskledger import log as store
from taskledger.log import NewEvent
from taskledger.service.writer.engine import UnitOfWork, Writer


async def _reader(pool: asyncpg.Pool, stop: asyncio.Event, seen: list[int], violations: list[str]) -> None:
    """Pages the log the way a feed does: WHERE seq > cursor, and checks every page."""
    cursor = 0
    while True:
        done = stop.is_set()
        rows = await pool.fetch("SELECT seq FROM events WHERE seq > $1 ORDER BY seq LIMIT 500", cursor)
        for r in rows:
            if r["seq"] != cursor + 1:
                violations.append(f"after {cursor} the reader saw {r['seq']}")
            cursor = r["seq"]
            seen.append(cursor)
        if done and not rows:
            return
        await asyncio.sleep(0)


async def test_a_slow_transaction_never_lets_readers_skip_its_events(pool: asyncpg.Pool) -> None:
    seen: list[int] = []
    violations: list[str] = []
    stop = asyncio.Event()
    reader = asyncio.create_task(_reader(pool, stop, seen, violations))

    slow = await pool.acquire()
    tx = slow.transaction()
    await tx.start()
    await store.append(slow, "task:slow", [NewEvent(type="task.created", data={})], expected_version=0)

    async def fast(i: int) -> None:
        async with pool.acquire() as c, c.transaction():
            await store.append(c, f"task:fast-{i}", [NewEvent(type="task.created", data={"i": i})],
                               expected_version=0)

    fast_tasks = [asyncio.create_task(fast(i)) for i in range(15)]
    await asyncio.sleep(0.5)  # the fast ones are all waiting to commit after the slow one
    assert all(not t.done() for t in fast_tasks)
    assert seen == []
    await tx.commit()
    await pool.release(slow)
    await asyncio.gather(*fast_tasks)
    stop.set()
    await reader
    assert violations == []
    assert seen == list(range(1, 17))
    first = await store.read(pool, since_seq=0, limit=1)
    assert first[0].stream == "task:slow"


async def test_rolled_back_appends_leave_no_hole(pool: asyncpg.Pool) -> None:
    async def attempt(i: int) -> None:
        async with pool.acquire() as c:
            try:
                async with c.transaction():
                    await store.append(c, f"s-{i}", [NewEvent(type="x", data={})], expected_version=0)
                    await asyncio.sleep(random.random() / 50)
                    if i % 3 == 0:
                        raise RuntimeError("roll back")
            except RuntimeError:
                pass

    await asyncio.gather(*(attempt(i) for i in range(30)))
    seqs = [r["seq"] for r in await pool.fetch("SELECT seq FROM events ORDER BY seq")]
    assert seqs == list(range(1, 21))


async def test_many_writers_through_the_writer_are_seen_in_order_by_a_concurrent_reader(
    pool: asyncpg.Pool, db_url: str
) -> None:
    writers = [Writer(db_url, batch_max=64) for _ in range(3)]  # three "replicas"
    for w in writers:
        await w.start()
    seen: list[int] = []
    violations: list[str] = []
    stop = asyncio.Event()
    reader = asyncio.create_task(_reader(pool, stop, seen, violations))

    async def client(i: int) -> None:
        w = writers[i % len(writers)]
        for n in range(25):
            async def cmd(uow: UnitOfWork, i: int = i, n: int = n) -> int:
                out = await uow.append(f"c{i}", [NewEvent(type="x", data={"n": n})], expected_version=n)
                return out[0].seq
            await w.submit(cmd)

    await asyncio.gather(*(client(i) for i in range(16)))
    stop.set()
    await reader
    for w in writers:
        await w.stop()
    assert violations == []
    assert seen == list(range(1, 16 * 25 + 1))
    ok, bad, _ = __import__("taskledger.events.canonical", fromlist=["verify_chain"]).verify_chain(
        [e.as_dict() for e in await store.read(pool, since_seq=0, limit=10_000)])
    assert ok, bad
