"""The hub's delivery path: shared encodings, coalesced sends, body sends straight to the server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import asyncpg
import pytest
from httpx_sse._decoders import SSEDecoder

from taskledger import log as store
from taskledger.log import NewEvent
from taskledger.service.http.live import Batch, Filter, Hub, StreamStop
from taskledger.service.http.routes.streams import SERVER_SEND, _EventSource, _Stream, keep_server_send


@pytest.fixture
async def hub(db_url: str, pool: asyncpg.Pool) -> AsyncIterator[Hub]:
    h = Hub(db_url, pool, poll_seconds=0.05)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()


async def append(pool: asyncpg.Pool, stream: str, project: str, type_: str = "task.note") -> int:
    async with pool.acquire() as c, c.transaction():
        rec = await store.append(c, stream, [NewEvent(type=type_, data={"x": 1})], meta={"project": project})
    return rec[-1].seq


async def published(hub: Hub, seq: int) -> None:
    deadline = time.monotonic() + 5
    while hub.cursor < seq:
        assert time.monotonic() < deadline, f"the tailer never reached {seq} (at {hub.cursor})"
        await asyncio.sleep(0.01)


async def next_batch(gen: AsyncGenerator[Batch, None]) -> Batch:
    return await asyncio.wait_for(gen.__anext__(), 5)


def parse(frames: bytes) -> list[tuple[int, str, dict[str, Any]]]:
    decoder = SSEDecoder()
    out = []
    text = frames.decode()
    assert text.endswith("\r\n\r\n")
    for line in text.split("\r\n")[:-1]:  # the text after the last line break is not a line
        ev = decoder.decode(line)
        if ev is not None:
            out.append((int(ev.id), ev.event, json.loads(ev.data)))
    return out


async def test_events_queued_together_go_out_as_one_send_of_separate_messages_in_order(
    hub: Hub, pool: asyncpg.Pool
) -> None:
    gen = hub.follow(Filter(project="coalesce"), hub.cursor)
    first = await append(pool, "task:c1", "coalesce")
    assert [r[0] for r in await next_batch(gen)] == [first]
    # The consumer is busy (not iterating) while three commits are published as three pages.
    seqs = []
    for i in range(3):
        await append(pool, "task:other", "elsewhere")
        seqs.append(await append(pool, f"task:c{i + 2}", "coalesce", "task.created"))
        await published(hub, seqs[-1])
    batch = await next_batch(gen)
    assert [r[0] for r in batch] == seqs
    by_seq = parse(batch.frames(by_stream_seq=False))
    assert [(i, t, d["seq"]) for i, t, d in by_seq] == [(s, "task.created", s) for s in seqs]
    by_stream_seq = parse(batch.frames(by_stream_seq=True))
    assert [(i, d["seq"]) for i, _, d in by_stream_seq] == [(1, s) for s in seqs]
    await gen.aclose()


async def test_subscribers_with_one_filter_share_one_encoding_of_each_event(hub: Hub, pool: asyncpg.Pool) -> None:
    same = [hub.follow(Filter(project="shared"), hub.cursor) for _ in range(3)]
    other = hub.follow(Filter(types=["task."], project="shared"), hub.cursor)
    gens = [*same, other]
    # start them all (a generator subscribes when first iterated), then wait for one event each
    pending = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0.1)
    seq = await append(pool, "task:s1", "shared")
    batches: list[Batch] = [await asyncio.wait_for(p, 5) for p in pending]
    assert [[r[0] for r in b] for b in batches] == [[seq]] * 4
    frames = [b.frames(by_stream_seq=False) for b in batches]
    assert frames[0] is frames[1] is frames[2]  # encoded once for the three
    assert frames[3] == frames[0]
    assert batches[3] is not batches[0]
    for g in gens:
        await g.aclose()


async def test_a_stop_set_before_or_while_following_ends_the_subscription(hub: Hub, pool: asyncpg.Pool) -> None:
    early = StreamStop()
    early.set()
    assert [b async for b in hub.follow(Filter(project="stop"), hub.cursor, stop=early)] == []
    stop = StreamStop()
    gen = hub.follow(Filter(project="stop"), hub.cursor, stop=stop)
    waiting = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.05)
    stop.set()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)
    assert hub.subscribers == 0


async def test_stream_bodies_go_to_the_server_send_and_only_the_start_through_the_middleware(
    db_url: str, pool: asyncpg.Pool
) -> None:
    hub = Hub(db_url, pool)
    assert hub.acquire_stream("k", 1) is None

    async def body() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"id: {i}\r\ndata: x\r\n\r\n".encode()

    server: list[dict[str, Any]] = []
    through_middleware: list[str] = []

    async def server_send(message: Any) -> None:
        server.append(message)

    def middleware(inner: Any) -> Any:  # a send wrapper like Litestar's and the request middleware's
        async def wrapped(message: Any) -> None:
            through_middleware.append(message["type"])
            await inner(message)
        return wrapped

    async def stream_route(scope: Any, receive: Any, send: Any) -> None:
        response = _EventSource(body(), ping=15, stall_seconds=5)
        await _Stream(response, hub, "k")(scope, receive, middleware(send))

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    scope: dict[str, Any] = {"type": "http", "method": "GET", "path": "/stream", "headers": []}
    await asyncio.wait_for(keep_server_send(stream_route)(scope, receive, server_send), 5)
    assert scope[SERVER_SEND] is server_send
    assert [m["type"] for m in server] == ["http.response.start"] + ["http.response.body"] * 4
    assert [m["body"] for m in server[1:4]] == [f"id: {i}\r\ndata: x\r\n\r\n".encode() for i in range(3)]
    # the start (status, headers) and the end still pass the middleware; the three events do not
    assert through_middleware == ["http.response.start", "http.response.body"]
    assert server[-1]["more_body"] is False
    assert hub.open_streams == 0
