"""Projections: checkpoints, check, rebuild without downtime, time travel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import asyncpg
import httpx
import pytest

from taskledger.projections import catalog, framework
from taskledger.projections import tasks as tasks_view
from taskledger.service.cli.main import main as cli
from tests.conftest import AppHarness, Client, ServerProcess
from tests.flows import claim, complete_verify, create_task, make, project


async def _busy_day(producer: Client, maker: Client, checker: Client) -> dict[str, Any]:
    """Verified, rejected-then-blocked, unblocked and cancelled tasks, and a job."""
    proj = project()
    ok = await make(producer, maker, proj)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "PASS")
    blocked = await make(producer, maker, proj, max_attempts=1)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL")
    await producer.ok(await producer.post(f"/tasks/{blocked['id']}/unblock", {"action": "retry"}))
    gone = await create_task(producer, proj)
    await producer.ok(await producer.post(f"/tasks/{gone['id']}/cancel", {"reason": "no longer needed"}))
    job = await producer.ok(
        await producer.post("/jobs", {"commands": ["true", "false"], "project": proj}), 201)
    return {"verified": ok["id"], "blocked": blocked["id"], "cancelled": gone["id"], "job": job["job_id"]}


async def _actors(harness: AppHarness) -> tuple[Client, Client, Client]:
    return (await harness.client("producer"), await harness.client("worker", node="node-a"),
            await harness.client("worker", node="node-b"))


async def _check(pool: asyncpg.Pool, names: list[str] | None = None) -> list[framework.Difference]:
    async with pool.acquire() as conn:
        return await framework.check(conn, catalog.select(names))


async def _index_names(pool: asyncpg.Pool) -> list[tuple[str, str]]:
    rows = await pool.fetch(
        "SELECT tablename, indexname FROM pg_indexes WHERE tablename IN ('tasks', 'blockers', 'jobs') "
        "ORDER BY 1, 2")
    return [(r[0], r[1]) for r in rows]


async def test_inline_checkpoints_follow_the_head_with_every_batch(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    await _busy_day(*await _actors(harness))
    head = await pool.fetchval("SELECT seq FROM log_head")
    cps = {r["name"]: r["seq"] for r in await pool.fetch("SELECT name, seq FROM projection_checkpoints")}
    assert cps == {"tasks": head, "blockers": head, "jobs": head}
    body = await harness.admin.ok(await harness.admin.get("/admin/projections"))
    assert {p["name"]: (p["checkpoint_seq"], p["lag"]) for p in body["projections"]} == {
        "tasks": (head, 0), "blockers": (head, 0), "jobs": (head, 0)}


async def test_check_finds_nothing_when_the_views_are_the_fold_of_the_log(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    await _busy_day(*await _actors(harness))
    assert await pool.fetchval("SELECT count(*) FROM blockers") >= 1
    assert await _check(pool) == []


async def test_check_names_projection_key_and_field_of_a_tampered_row(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    ids = await _busy_day(*await _actors(harness))
    await pool.execute("UPDATE tasks SET body = jsonb_set(body, '{title}', '\"forged\"'), priority = 9 "
                       "WHERE id = $1", ids["verified"])
    await pool.execute("DELETE FROM blockers")
    await pool.execute("UPDATE jobs SET state = 'completed' WHERE id = $1", ids["job"])
    diffs = await _check(pool)
    named = {(d.projection, d.key, d.field) for d in diffs}
    assert ("tasks", ids["verified"], "body.title") in named
    assert ("tasks", ids["verified"], "priority") in named
    assert ("jobs", ids["job"], "state") in named
    assert any(d.projection == "blockers" and d.field == "(row)" for d in diffs)

    rc = await asyncio.to_thread(cli, ["check", "--database-url", str(pool._connect_args[0])])  # type: ignore[attr-defined]
    assert rc == 1


async def test_rebuild_repairs_the_rows_and_keeps_table_and_index_names(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    ids = await _busy_day(*await _actors(harness))
    before = await _index_names(pool)
    await pool.execute("UPDATE tasks SET state = 'forged' WHERE id = $1", ids["cancelled"])
    admin = harness.admin
    r = await admin.ok(await admin.post("/admin/rebuild", {"wait": True}))
    assert [(x["projection"], x["state"]) for x in r["rebuilds"]] == [
        ("tasks", "done"), ("blockers", "done"), ("jobs", "done")]
    assert await _check(pool) == []
    assert await _index_names(pool) == before
    assert not await pool.fetchval("SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_\\_rebuild%'")
    t = await admin.ok(await admin.get(f"/tasks/{ids['cancelled']}"))
    assert t["state"] == "cancelled"


async def test_rebuild_is_for_admins_and_names_unknown_projections(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    r = await producer.post("/admin/rebuild", {"projection": "tasks"})
    assert r.status_code == 403
    r = await harness.admin.post("/admin/rebuild", {"projection": "nope"})
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    r = await harness.admin.post("/admin/rebuild", {"projection": "tasks", "extra": 1})
    assert r.status_code == 400


@pytest.mark.parametrize("read_ahead", [False, True], ids=["one_connection", "pages_read_ahead"])
async def test_a_rebuild_under_concurrent_writes_equals_the_live_projection_row_for_row(
    server: ServerProcess, db_url: str, read_ahead: bool
) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
        producer = Client(http, server.token("producer"))  # type: ignore[arg-type]
        maker = Client(http, server.token("worker", node="node-a"))  # type: ignore[arg-type]
        checker = Client(http, server.token("worker", node="node-b"))  # type: ignore[arg-type]
        for _ in range(3):
            await _busy_day(producer, maker, checker)
        stop = asyncio.Event()
        progressed = asyncio.Event()
        done = 0

        async def writer_load() -> None:
            nonlocal done
            while not stop.is_set():
                await _busy_day(producer, maker, checker)
                done += 1
                progressed.set()

        async def another_day() -> None:
            progressed.clear()
            await asyncio.wait_for(progressed.wait(), 60)

        load = asyncio.create_task(writer_load())
        conn = await asyncpg.connect(db_url)
        reader = await asyncpg.connect(db_url) if read_ahead else None
        try:
            for p in catalog.PROJECTIONS:
                # small pages and a tiny lock window, so writes land between pages and during catch-up
                res = await framework.rebuild(conn, p, page_seqs=7, catch_up_under_lock=3, reader=reader)
                assert res.seq > 0
                # writes go on against the swapped-in tables
                await another_day()
            await producer.ok(await producer.get("/tasks", params={"limit": 5}))
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await load
            await conn.close()
            if reader is not None:
                await reader.close()
        assert done >= 4
        pool = await asyncpg.create_pool(db_url, min_size=1, max_size=2)
        try:
            assert await _check(pool) == []
        finally:
            await pool.close()


async def test_two_rebuilds_of_one_projection_do_not_run_at_once(pool: asyncpg.Pool, db_url: str) -> None:
    holder = await asyncpg.connect(db_url)
    conn = await asyncpg.connect(db_url)
    try:
        await holder.execute("SELECT pg_advisory_lock(hashtext('taskledger:rebuild:tasks'))")
        try:
            await framework.rebuild(conn, catalog.TASKS)
        except framework.RebuildBusy:
            pass
        else:
            raise AssertionError("the second rebuild ran")
    finally:
        await holder.close()
        await conn.close()


async def test_task_and_job_views_as_of_a_seq_are_folds_of_the_log_prefix(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer, maker, _ = await _actors(harness)
    proj = project()
    t = await create_task(producer, project())
    created_seq = t["seq"]
    done = await make(producer, maker, proj)
    job = await producer.ok(await producer.post("/jobs", {"commands": ["a", "b"], "project": proj}), 201)
    job_created = await pool.fetchval("SELECT max(seq) FROM events WHERE stream = $1", f"job:{job['job_id']}")
    await producer.ok(await producer.post(f"/jobs/{job['job_id']}/cancel"))
    tid = done["id"]
    past = await producer.ok(await producer.get(f"/tasks/{tid}", params={"as_of_seq": done["seq"] - 1}))
    assert past["state"] == "completed" and past["seq"] == done["seq"] - 1
    past = await producer.ok(await producer.get(f"/tasks/{tid}", params={"as_of_seq": done["seq"] - 2}))
    assert past["state"] == "running"
    assert (await producer.ok(await producer.get(f"/tasks/{t['id']}", params={"as_of_seq": created_seq})))[
        "state"] == "pending"
    jp = await producer.ok(await producer.get(f"/jobs/{job['job_id']}", params={"as_of_seq": job_created}))
    assert jp["state"] == "pending" and jp["seq"] == job_created
    now = await producer.ok(await producer.get(f"/jobs/{job['job_id']}"))
    assert now["state"] == "cancelled"
    r = await producer.get(f"/jobs/{job['job_id']}", params={"as_of_seq": job_created - 1})
    assert r.status_code == 404 and r.json()["code"] == "job_not_found"
    r = await producer.get(f"/jobs/{job['job_id']}", params={"as_of_seq": 10**9})
    assert r.status_code == 400


class _CountFold:
    """A toy async projection: events per type."""

    def reset(self) -> None:
        pass

    async def apply(self, conn: Any, page: Any, tables: Any) -> None:
        counts: dict[str, int] = {}
        for e in page:
            counts[e.type] = counts.get(e.type, 0) + 1
        await conn.executemany(
            f"INSERT INTO {tables['event_counts']} (type, n) VALUES ($1, $2) "
            f"ON CONFLICT (type) DO UPDATE SET n = {tables['event_counts']}.n + EXCLUDED.n",
            list(counts.items()))


async def test_an_async_projection_folds_from_its_checkpoint_and_checks_like_the_inline_ones(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    await pool.execute("CREATE TABLE event_counts (type text PRIMARY KEY, n bigint NOT NULL)")
    counts = framework.Projection(
        name="event_counts", version=1, tables=(framework.Table("event_counts", "type"),),
        streams="task:", new_fold=_CountFold, inline=False)
    producer, maker, checker = await _actors(harness)
    await _busy_day(producer, maker, checker)
    async with pool.acquire() as conn:
        reached = await framework.advance(conn, counts, _CountFold(), page_seqs=5)
    head = await pool.fetchval("SELECT seq FROM log_head")
    assert reached == head
    await _busy_day(producer, maker, checker)  # the writer leaves an async checkpoint alone
    assert await pool.fetchval("SELECT seq FROM projection_checkpoints WHERE name = 'event_counts'") == head
    expected = dict(await pool.fetch(
        "SELECT type, count(*) FROM events WHERE stream LIKE 'task:%' AND seq <= $1 GROUP BY type", head))
    assert dict(await pool.fetch("SELECT type, n FROM event_counts")) == expected
    async with pool.acquire() as conn:
        assert await framework.check(conn, [counts]) == []
        await conn.execute("UPDATE event_counts SET n = n + 1 WHERE type = 'task.created'")
        diffs = await framework.check(conn, [counts])
    assert [(d.key, d.field) for d in diffs] == [("task.created", "n")]


@pytest.mark.parametrize("cache_max", [1, 3, 50_000])
async def test_a_rebuild_that_evicts_its_cache_between_pages_writes_the_same_rows(
    harness: AppHarness, pool: asyncpg.Pool, db_url: str, cache_max: int
) -> None:
    # Rows are held back and written once (COPY for new rows, an upsert for the
    # rest); a small cache evicts between pages, so rows are written, reloaded
    # and written again, and streams span many pages.
    actors = await _actors(harness)
    for _ in range(2):
        await _busy_day(*actors)
    live = await pool.fetch("SELECT to_jsonb(t)::text AS r FROM tasks t ORDER BY id")
    p = dataclasses.replace(catalog.TASKS, new_fold=lambda: tasks_view.TaskFold(cache_max=cache_max))
    conn = await asyncpg.connect(db_url)
    reader = await asyncpg.connect(db_url)
    try:
        res = await framework.rebuild(conn, p, page_seqs=5, catch_up_under_lock=0, reader=reader)
    finally:
        await conn.close()
        await reader.close()
    assert res.seq == await pool.fetchval("SELECT seq FROM log_head")
    assert await pool.fetch("SELECT to_jsonb(t)::text AS r FROM tasks t ORDER BY id") == live
    assert await _check(pool) == []


@pytest.mark.parametrize("cache_max", [0, 50_000])
async def test_the_blocker_rebuild_reads_only_blocker_events_and_writes_the_same_rows(
    harness: AppHarness, pool: asyncpg.Pool, db_url: str, cache_max: int
) -> None:
    # cache_max=0 forgets every task after each page: its latest blocker comes back
    # from the rows written, its project from its stream's first event
    producer, maker, checker = actors = await _actors(harness)
    for _ in range(2):
        await _busy_day(*actors)
        proj = project()
        blocked = await make(producer, maker, proj, max_attempts=1)
        v = await claim(checker, proj, ["verify"])
        assert v is not None
        await complete_verify(checker, v, "FAIL")
        await producer.ok(await producer.post(f"/tasks/{blocked['id']}/cancel", {"reason": "given up"}))
    live = await pool.fetch("SELECT to_jsonb(b)::text AS r FROM blockers b ORDER BY id")
    assert {r["r"].split('"resolution": ')[1].split(",")[0] for r in live} == {'"retry"', '"cancelled"'}
    p = dataclasses.replace(catalog.BLOCKERS, new_fold=lambda: tasks_view.BlockerFold(cache_max=cache_max))
    conn = await asyncpg.connect(db_url)
    try:
        async with conn.transaction():
            page = await framework.store.read_page(conn, "task:", 0, 10**9, p.types)
        assert page and {e.type for e in page} <= set(tasks_view.BLOCKER_EVENTS)
        res = await framework.rebuild(conn, p, page_seqs=3, catch_up_under_lock=0)
    finally:
        await conn.close()
    assert res.seq == await pool.fetchval("SELECT seq FROM log_head")
    assert await pool.fetch("SELECT to_jsonb(b)::text AS r FROM blockers b ORDER BY id") == live
    assert await _check(pool) == []
