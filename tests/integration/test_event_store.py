"""The event store's contract, against real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from taskledger import log as store
from taskledger.events.canonical import GENESIS_HASH, event_hash, verify_chain
from taskledger.events.errors import VersionConflict
from taskledger.log import ANY, NewEvent


def ev(t: str = "task.created", **data: object) -> NewEvent:
    return NewEvent(type=t, data=dict(data))


async def append(pool: asyncpg.Pool, stream: str, events: list[NewEvent], **kw: object) -> list[store.RecordedEvent]:
    async with pool.acquire() as c, c.transaction():
        return await store.append(c, stream, events, **kw)  # type: ignore[arg-type]


async def test_first_append_numbers_from_one_and_chains_from_genesis(pool: asyncpg.Pool) -> None:
    out = await append(pool, "task:a", [ev(title="x")], expected_version=0)
    assert [(e.seq, e.stream_seq) for e in out] == [(1, 1)]
    e = out[0]
    assert e.hash == event_hash(GENESIS_HASH, seq=1, stream="task:a", stream_seq=1, type=e.type,
                                data=e.data, meta=e.meta, recorded_at=e.recorded_at)
    assert await store.head(pool) == (1, e.hash)


async def test_multi_event_append_is_atomic_and_contiguous(pool: asyncpg.Pool) -> None:
    await append(pool, "task:a", [ev()], expected_version=0)
    out = await append(pool, "task:b", [ev(), ev("task.claimed"), ev("task.started")], expected_version=0)
    assert [e.seq for e in out] == [2, 3, 4]
    assert [e.stream_seq for e in out] == [1, 2, 3]


async def test_rolled_back_append_leaves_no_trace(pool: asyncpg.Pool) -> None:
    await append(pool, "task:a", [ev()], expected_version=0)
    with pytest.raises(RuntimeError):
        async with pool.acquire() as c, c.transaction():
            await store.append(c, "task:b", [ev(), ev()], expected_version=0)
            raise RuntimeError("boom")
    assert (await store.head(pool))[0] == 1
    out = await append(pool, "task:c", [ev()], expected_version=0)
    assert out[0].seq == 2
    assert await pool.fetchval("SELECT count(*) FROM events") == 2


async def test_wrong_expected_version_conflicts_and_writes_nothing(pool: asyncpg.Pool) -> None:
    await append(pool, "task:a", [ev()], expected_version=0)
    with pytest.raises(VersionConflict):
        await append(pool, "task:a", [ev("task.claimed")], expected_version=0)
    with pytest.raises(VersionConflict):
        await append(pool, "task:a", [ev("task.claimed")], expected_version=5)
    assert await pool.fetchval("SELECT count(*) FROM events") == 1
    out = await append(pool, "task:a", [ev("task.claimed")], expected_version=1)
    assert out[0].stream_seq == 2


async def test_any_version_appends_at_the_end(pool: asyncpg.Pool) -> None:
    await append(pool, "s", [ev(), ev()], expected_version=ANY)
    out = await append(pool, "s", [ev()], expected_version=ANY)
    assert out[0].stream_seq == 3


async def test_two_writers_expecting_the_same_version_exactly_one_wins(pool: asyncpg.Pool) -> None:
    await append(pool, "task:a", [ev()], expected_version=0)

    async def writer(i: int) -> str:
        try:
            await append(pool, "task:a", [ev("task.claimed", by=i)], expected_version=1)
            return "won"
        except VersionConflict:
            return "lost"

    results = await asyncio.gather(*(writer(i) for i in range(8)))
    assert sorted(results) == ["lost"] * 7 + ["won"]
    assert await pool.fetchval("SELECT max(stream_seq) FROM events WHERE stream = 'task:a'") == 2


@pytest.mark.parametrize("sql", [
    "UPDATE events SET type = 'x'",
    "DELETE FROM events",
    "TRUNCATE events",
])
async def test_the_database_refuses_to_change_the_log(pool: asyncpg.Pool, sql: str) -> None:
    await append(pool, "task:a", [ev()], expected_version=0)
    with pytest.raises(asyncpg.PostgresError, match="append-only"):
        await pool.execute(sql)
    assert await pool.fetchval("SELECT count(*) FROM events") == 1


async def test_hash_chain_verifies_and_catches_a_tampered_row(pool: asyncpg.Pool) -> None:
    for i in range(5):
        await append(pool, f"task:{i}", [ev(n=i, f=1.5, big=1e20, txt="naïve ✓")], expected_version=0)
    rows = [e.as_dict() for e in await store.read(pool, since_seq=0)]
    ok, bad, last = verify_chain(rows)
    assert ok and bad is None and last == (await store.head(pool))[1]
    async with pool.acquire() as c, c.transaction():
        await c.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await c.execute("""UPDATE events SET data = jsonb_set(data, '{n}', '99') WHERE seq = 3""")
        await c.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")
    rows = [e.as_dict() for e in await store.read(pool, since_seq=0)]
    ok, bad, _ = verify_chain(rows)
    assert not ok and bad == 3


async def test_notify_is_sent_once_per_commit(pool: asyncpg.Pool, db_url: str) -> None:
    listener = await asyncpg.connect(db_url)
    got: list[str] = []
    await listener.add_listener(store.NOTIFY_CHANNEL, lambda *a: got.append(a[3]))
    try:
        async with pool.acquire() as c, c.transaction():
            log = await store.LogTx.begin(c)
            await log.append("a", [ev(), ev()], expected_version=0)
            await log.append("b", [ev()], expected_version=0)
            await log.finish()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert got == ["3"]
    finally:
        await listener.close()


async def test_read_filters_by_type_prefix_stream_and_project(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as c, c.transaction():
        log = await store.LogTx.begin(c)
        await log.append("task:a", [ev("task.created"), ev("task.claimed")], expected_version=0,
                         meta={"project": "p1"})
        await log.append("job:j", [ev("job.created")], expected_version=0, meta={"project": "p2"})
        await log.finish()
    assert [e.type for e in await store.read(pool, types=["task."])] == ["task.created", "task.claimed"]
    assert [e.type for e in await store.read(pool, types=["job.created", "task.claimed"])] == [
        "task.claimed", "job.created"]
    assert [e.seq for e in await store.read(pool, stream="job:j")] == [3]
    assert [e.seq for e in await store.read(pool, project="p1")] == [1, 2]
    assert [e.seq for e in await store.read(pool, types=["task_"])] == []
