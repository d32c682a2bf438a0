"""Open streams never starve other requests: a real `taskledger serve` and real sockets.

Streams are opened with bare asyncio sockets (the cheapest client there is), so a
test can hold hundreds of them from one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from taskledger import log as store
from taskledger.log import NewEvent
from taskledger.service.http.server_limits import (
    RESERVED_FILES,
    fit_to_open_files,
    raise_open_files_limit,
    server_concurrency,
)
from taskledger.service.settings import Settings
from tests.conftest import ADMIN_TOKEN, ServerProcess
from tests.e2e import test_sse

shared_db = test_sse.shared_db  # this module's own database, made as test_sse makes its own

CAP = 200
PER_TOKEN = 150
SERVER_ENV = {
    "TASKLEDGER_MAX_STREAMS": str(CAP),
    # A small budget for the rest, so that streams past the cap, were they
    # admitted, would exhaust the server's own connection budget (cap + 50)
    # and leave every request hanging, as the defaults did at 1,024.
    "TASKLEDGER_MAX_CONNECTIONS": "50",
    "TASKLEDGER_MAX_STREAMS_PER_TOKEN": str(PER_TOKEN),
    "TASKLEDGER_SSE_KEEPALIVE_SECONDS": "0.5",
    "TASKLEDGER_SSE_SEND_TIMEOUT_SECONDS": "2",
    "TASKLEDGER_STREAM_RETRY_AFTER_SECONDS": "7",
}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    reader: asyncio.StreamReader | None = field(default=None, repr=False)
    writer: asyncio.StreamWriter | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def open_stream(port: int, token: str = ADMIN_TOKEN, *, rcvbuf: int | None = None) -> Answer:
    """GET /stream on a raw socket: a 200 is read up to its `retry:` line, anything else whole."""
    sock = None
    if rcvbuf is not None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    if status == 200:
        body = await reader.readuntil(b"\r\n\r\n")  # chunked: the size line, then `retry: ...`
        assert b"retry: " in body or b"retry: " in await reader.readuntil(b"\r\n\r\n")
        return Answer(status, headers, reader=reader, writer=writer)
    body = await reader.readexactly(int(headers["content-length"]))
    writer.close()
    return Answer(status, headers, body)


async def metric(base: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"taskledger_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


async def wait_for_metric(base: str, name: str, value: float, within: float = 15) -> None:
    deadline = time.monotonic() + within
    while (now := await metric(base, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {now}, expected {value}"
        await asyncio.sleep(0.1)


async def timed(coro: Any) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = await coro
    return r, time.monotonic() - t0


async def ordinary_requests_answer_within_a_second(base: str, token: str = ADMIN_TOKEN) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"}) as http:
        r, s = await timed(http.get("/healthz"))
        assert r.status_code == 200 and s < 1.0, (r.status_code, s)
        r, s = await timed(http.get("/tasks", params={"limit": 5}))
        assert r.status_code == 200 and s < 1.0, (r.status_code, s)
        r, s = await timed(http.post("/tasks", json={"title": "while streams are open", "project": "capacity"}))
        assert r.status_code == 201 and s < 1.0, (r.status_code, s, r.text)


@pytest.fixture(scope="module")
def capped(shared_db: str) -> Iterator[ServerProcess]:
    raise_open_files_limit()  # this process holds a few hundred sockets
    s = ServerProcess(shared_db, env=SERVER_ENV).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
async def streams() -> AsyncIterator[list[Answer]]:
    """Streams a test opens; closed after it, whatever happens."""
    held: list[Answer] = []
    try:
        yield held
    finally:
        for a in held:
            a.close()


async def test_past_the_stream_cap_every_attempt_is_answered_at_once_and_requests_stay_fast(
    capped: ServerProcess, streams: list[Answer]
) -> None:
    base, port = capped.base, capped.port
    refused_before = await metric(base, 'sse_streams_refused_total{reason="capacity"}')
    # Two tokens, so the process's cap and not a token's is what is reached.
    tokens = [ADMIN_TOKEN, await asyncio.to_thread(capped.token, "reader")]
    opened = await asyncio.gather(*(open_stream(port, tokens[i % 2]) for i in range(CAP)))
    streams.extend(opened)
    assert [a.status for a in opened] == [200] * CAP
    assert await metric(base, "sse_streams_open") == CAP

    t0 = time.monotonic()
    attempts = await asyncio.wait_for(asyncio.gather(*(open_stream(port) for _ in range(100))), 10)
    elapsed = time.monotonic() - t0
    streams.extend(attempts)
    assert all(a.status in (200, 503) for a in attempts)
    # Every slot was held, so every attempt was refused: at once, with a problem and Retry-After.
    assert [a.status for a in attempts] == [503] * 100
    assert elapsed < 5, elapsed
    for a in attempts:
        assert a.headers["content-type"].startswith("application/problem+json")
        assert a.headers["retry-after"] == "7"
        assert json.loads(a.body)["code"] == "too_many_streams"

    await ordinary_requests_answer_within_a_second(base)
    assert await metric(base, "sse_streams_open") == CAP
    assert await metric(base, "sse_streams_max") == CAP
    assert await metric(base, 'sse_streams_refused_total{reason="capacity"}') == refused_before + 100

    # A freed slot is taken again.
    opened[0].close()
    await wait_for_metric(base, "sse_streams_open", CAP - 1)
    again = await open_stream(port)
    streams.append(again)
    assert again.status == 200
    for a in streams:
        a.close()
    await wait_for_metric(base, "sse_streams_open", 0)


async def test_a_token_over_its_own_cap_gets_429_with_retry_after_while_others_are_admitted(
    capped: ServerProcess, streams: list[Answer]
) -> None:
    await wait_for_metric(capped.base, "sse_streams_open", 0)
    before = await metric(capped.base, 'sse_streams_refused_total{reason="token"}')
    token = await asyncio.to_thread(capped.token, "reader")
    held = await asyncio.gather(*(open_stream(capped.port, token) for _ in range(PER_TOKEN)))
    streams.extend(held)
    assert [a.status for a in held] == [200] * PER_TOKEN
    over = await open_stream(capped.port, token)
    assert over.status == 429
    assert over.headers["retry-after"] == "7"
    assert over.headers["content-type"].startswith("application/problem+json")
    assert json.loads(over.body)["code"] == "too_many_requests"
    assert await metric(capped.base, 'sse_streams_refused_total{reason="token"}') == before + 1
    other = await open_stream(capped.port, ADMIN_TOKEN)
    streams.append(other)
    assert other.status == 200
    for a in streams:
        a.close()
    await wait_for_metric(capped.base, "sse_streams_open", 0)


async def test_a_consumer_that_stopped_reading_is_dropped_after_the_send_timeout(
    capped: ServerProcess, streams: list[Answer], shared_db: str
) -> None:
    await wait_for_metric(capped.base, "sse_streams_open", 0)
    timeouts_before = await metric(capped.base, "sse_send_timeouts_total")
    stalled = await open_stream(capped.port, rcvbuf=4096)  # and never read again
    streams.append(stalled)
    assert await metric(capped.base, "sse_streams_open") == 1
    pool = await asyncpg.create_pool(shared_db, min_size=1, max_size=2)
    try:
        big = "x" * 4000
        deadline = time.monotonic() + 30
        # Fill the socket buffers until a send blocks; the stream must then end.
        while await metric(capped.base, "sse_send_timeouts_total") == timeouts_before:
            assert time.monotonic() < deadline, "the stalled consumer was never dropped"
            async with pool.acquire() as c, c.transaction():
                await store.append(c, f"task:stall-{uuid.uuid4().hex[:6]}",
                                   [NewEvent(type="task.note", data={"b": big})] * 50, meta={"project": "stall"})
            await asyncio.sleep(0.2)
    finally:
        await pool.close()
    await wait_for_metric(capped.base, "sse_streams_open", 0)
    # The server closed the connection: reading what it had buffered ends in EOF.
    assert stalled.reader is not None
    while await asyncio.wait_for(stalled.reader.read(1 << 20), 10):
        pass


def test_the_stream_cap_shrinks_to_fit_the_open_files_limit() -> None:
    s = Settings(max_streams=10_000, max_connections=1024)
    assert fit_to_open_files(s, 20_000) is s
    fitted = fit_to_open_files(s, 4096)
    assert fitted.max_streams == 4096 - RESERVED_FILES - 1024
    assert server_concurrency(fitted) + RESERVED_FILES == 4096
    assert fit_to_open_files(s, 1024).max_streams == 0


def test_serve_raises_its_soft_open_files_limit_to_the_hard_limit(db_url: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the server inherits this soft limit
    try:
        s = ServerProcess(db_url)
        s.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limit = asyncio.run(metric(s.base, "process_open_files_limit"))
        expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
        assert limit == expected
        assert s.proc is not None
        text = Path(f"/proc/{s.proc.pid}/limits").read_text()
        row = next(ln for ln in text.splitlines() if ln.startswith("Max open files"))
        assert re.split(r"\s{2,}", row)[1] == str(expected) or str(expected) in row
    finally:
        s.stop()


@pytest.mark.slow
async def test_1100_streams_against_the_defaults_leave_requests_answered(
    db_url: str, streams: list[Answer]
) -> None:
    """The issue's drill: 1,100 subscribers at the defaults, 64 streams per token."""
    raise_open_files_limit()
    s = await asyncio.to_thread(ServerProcess(db_url).start)
    try:
        tokens = [await asyncio.to_thread(s.token, "reader") for _ in range(18)]
        answers: list[Answer] = []
        for i in range(0, 1100, 100):
            answers.extend(await asyncio.wait_for(
                asyncio.gather(*(open_stream(s.port, tokens[k // 64]) for k in range(i, i + 100))), 30))
        streams.extend(answers)
        assert [a.status for a in answers] == [200] * 1100
        assert await metric(s.base, "sse_streams_open") == 1100
        await ordinary_requests_answer_within_a_second(s.base)
    finally:
        for a in streams:
            a.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(s.stop)
