"""The batching writer: one bad command never takes its batch down with it."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from taskledger.events.errors import InvalidTransition
from taskledger.log import NewEvent
from taskledger.service.writer.engine import UnitOfWork, Writer


def cmd(stream: str, *, then: Exception | None = None, before: Exception | None = None):  # type: ignore[no-untyped-def]
    async def fn(uow: UnitOfWork) -> int:
        if before is not None:
            raise before
        out = await uow.append(stream, [NewEvent(type="x", data={})], expected_version=0)
        if then is not None:
            raise then
        return out[0].seq

    return fn


async def test_commands_in_one_batch_share_one_commit(db_url: str, pool: asyncpg.Pool) -> None:
    w = Writer(db_url, batch_max=64)
    await w.start()
    try:
        seqs = await asyncio.gather(*(w.submit(cmd(f"s{i}")) for i in range(50)))
    finally:
        await w.stop()
    assert sorted(seqs) == list(range(1, 51))
    assert await pool.fetchval("SELECT seq FROM log_head") == 50


async def test_a_refusal_before_writing_drops_out_and_the_rest_commit(db_url: str, pool: asyncpg.Pool) -> None:
    w = Writer(db_url)
    await w.start()
    try:
        results = await asyncio.gather(
            w.submit(cmd("a")), w.submit(cmd("b", before=InvalidTransition("no"))), w.submit(cmd("c")),
            return_exceptions=True)
    finally:
        await w.stop()
    assert isinstance(results[1], InvalidTransition)
    assert sorted(r for r in results if isinstance(r, int)) == [1, 2]


@pytest.mark.parametrize("late", [InvalidTransition("refused after writing"), RuntimeError("bug")])
async def test_a_failure_after_writing_rolls_back_only_that_command(
    db_url: str, pool: asyncpg.Pool, late: Exception
) -> None:
    w = Writer(db_url)
    await w.start()
    try:
        results = await asyncio.gather(
            w.submit(cmd("a")), w.submit(cmd("b", then=late)), w.submit(cmd("c")), return_exceptions=True)
    finally:
        await w.stop()
    assert type(results[1]) is type(late)
    assert sorted(r for r in results if isinstance(r, int)) == [1, 2]
    streams = [r["stream"] for r in await pool.fetch("SELECT stream FROM events ORDER BY seq")]
    assert sorted(streams) == ["a", "c"]
    assert await pool.fetchval("SELECT seq FROM log_head") == 2


async def test_the_writer_reconnects_after_its_connection_is_killed(db_url: str, pool: asyncpg.Pool) -> None:
    w = Writer(db_url)
    await w.start()
    try:
        assert await w.submit(cmd("a")) == 1
        killed = await pool.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'taskledger-writer'")
        assert [r[0] for r in killed] == [True]
        await asyncio.sleep(0.2)
        # the first command after the kill is not lost: the batch is retried on a new connection
        assert await w.submit(cmd("b")) == 2
        assert await w.submit(cmd("c")) == 3
    finally:
        await w.stop()
