"""A batch's view and lease rows go in with its events, in the flush's one statement.

`LogTx.flush(writes)` runs each write as a data-modifying CTE of the statement
that appends the buffered events; the task commands buffer their view rows and
lease rows for it (one entry per task, so a lease that begins and ends in one
batch is one delete, never an upsert and a delete of one row in one statement).
"""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from taskledger.events.errors import VersionConflict
from taskledger.events.task.rules import NewTask
from taskledger.log import LogTx, NewEvent, Write
from taskledger.service.tokens import Principal
from taskledger.service.writer import tasks as cmds
from taskledger.service.writer.commands import Ctx
from taskledger.service.writer.engine import UnitOfWork, Writer

_NOTE = Write("INSERT INTO ui_secrets (id, secret) VALUES ($1, $2)", [1, b"k" * 32])


async def test_the_writes_go_in_with_the_events_and_their_parameters_follow_the_events(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as c, c.transaction():
        tx = await LogTx.begin(c)
        await tx.append("s-1", [NewEvent(type="x", data={"n": 1})], expected_version=0)
        await tx.flush([_NOTE, Write("DELETE FROM ui_secrets WHERE id = $1 AND $2::int = 2", [7, 2])])
        await tx.finish()
    assert await pool.fetchval("SELECT count(*) FROM events WHERE stream = 's-1'") == 1
    assert await pool.fetchval("SELECT secret FROM ui_secrets WHERE id = 1") == b"k" * 32


async def test_writes_alone_need_no_events(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as c, c.transaction():
        tx = await LogTx.begin(c)
        await tx.flush([_NOTE])
        await tx.finish()
    assert await pool.fetchval("SELECT count(*) FROM ui_secrets") == 1
    assert await pool.fetchval("SELECT seq FROM log_head") == 0


async def test_a_writes_own_unique_violation_is_not_taken_for_a_version_conflict(pool: asyncpg.Pool) -> None:
    await pool.execute("INSERT INTO ui_secrets (id, secret) VALUES (1, $1)", b"o" * 32)
    async with pool.acquire() as c:
        with pytest.raises(asyncpg.UniqueViolationError):
            async with c.transaction():
                tx = await LogTx.begin(c)
                await tx.append("s-2", [NewEvent(type="x", data={})], expected_version=0)
                await tx.flush([_NOTE])
    # and a stream that moved on is still a version conflict, the writes undone with it
    await pool.execute("DELETE FROM ui_secrets")
    async with pool.acquire() as c:
        with pytest.raises(VersionConflict):
            async with c.transaction():
                tx = await LogTx.begin(c)
                await tx.append("s-3", [NewEvent(type="x", data={})], expected_version=0)
                await tx.flush()
                tx._versions.clear()  # as if another appender had been first: the key collides
                tx._expect.clear()
                await tx.append("s-3", [NewEvent(type="x", data={})], expected_version=0)
                await tx.flush([_NOTE])
    assert await pool.fetchval("SELECT count(*) FROM ui_secrets") == 0
    assert await pool.fetchval("SELECT count(*) FROM events") == 0


def _ctx(name: str, node: str) -> Ctx:
    return Ctx(principal=Principal(name=name, role="worker", node=node, token_hash="h", token_id=""),
               request_id=uuid.uuid4().hex)


async def _run(db_url: str, fn):  # type: ignore[no-untyped-def]
    w = Writer(db_url)
    await w.start()
    try:
        return await w.submit(fn)
    finally:
        await w.stop()


async def _one_task(db_url: str, project: str) -> str:
    tid = f"t-{uuid.uuid4().hex[:8]}"
    await _run(db_url, lambda u: cmds.create(u, _ctx("p", "np"), NewTask(id=tid, project=project, title="t",
                                                                          verification=None),
                                             default_escalation=3600))
    return tid


async def test_a_lease_taken_and_ended_in_one_batch_leaves_no_lease(db_url: str, pool: asyncpg.Pool) -> None:
    tid = await _one_task(db_url, "pa")
    ctx = _ctx("w1", "n1")

    async def claim_start_complete(u: UnitOfWork) -> str:
        [got] = await cmds.claim_many(u, ctx, task_types=["implement"], projects=["pa"], lease_seconds=60,
                                      limit=1, start=True)
        assert got.lease_id is not None
        done = await cmds.complete(u, ctx, tid, lease_id=got.lease_id, result={"ok": True}, verdict=None)
        return done.state

    assert await _run(db_url, claim_start_complete) == "completed"
    assert await pool.fetchval("SELECT count(*) FROM task_leases WHERE task_id = $1", tid) == 0
    assert await pool.fetchval("SELECT state FROM tasks WHERE id = $1", tid) == "completed"
    assert [r["type"] for r in await pool.fetch(
        "SELECT type FROM events WHERE stream = $1 ORDER BY stream_seq", f"task:{tid}")] == [
        "task.created", "task.claimed", "task.started", "task.completed"]


async def test_a_lease_released_and_taken_again_in_one_batch_is_the_new_one(
    db_url: str, pool: asyncpg.Pool,
) -> None:
    tid = await _one_task(db_url, "pb")
    ctx = _ctx("w2", "n2")
    first = await _run(db_url, lambda u: cmds.claim_many(u, ctx, task_types=["implement"], projects=["pb"],
                                                          lease_seconds=60, limit=1))
    old = first[0].lease_id

    async def release_and_claim(u: UnitOfWork) -> str | None:
        await cmds.release(u, ctx, tid, lease_id=old, reason="again")
        again = await cmds.claim_many(u, ctx, task_types=["implement"], projects=["pb"], lease_seconds=60,
                                      limit=1)
        # and a third lease, taken after the second is released, all before the flush
        await cmds.release(u, ctx, tid, lease_id=again[0].lease_id or "", reason="once more")
        third = await cmds.claim_many(u, ctx, task_types=["implement"], projects=["pb"], lease_seconds=60,
                                      limit=1)
        return third[0].lease_id

    new = await _run(db_url, release_and_claim)
    assert new is not None and new != old
    assert await pool.fetchval("SELECT lease_id FROM task_leases WHERE task_id = $1", tid) == new
    assert await pool.fetchval("SELECT body->>'lease_id' FROM tasks WHERE id = $1", tid) == new
