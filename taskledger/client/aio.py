"""`AsyncClient`: the asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import TypeVar

import httpx
from httpx_sse import aconnect_sse

from taskledger.client._api import Operations
from taskledger.client._call import (
    STREAM_READ_TIMEOUT,
    Backoff,
    Call,
    Cursor,
    Retry,
    decode_event,
    feed_params,
    retry_stream,
    settings,
    stream_path,
)
from taskledger.client.errors import TaskledgerError, TransportError, from_response
from taskledger.client.models import Event

T = TypeVar("T")


class AsyncClient(Operations):
    """A taskledger client holding one token, for asyncio.

    >>> async with AsyncClient("http://127.0.0.1:8080", token="tl_...") as c:
    ...     task = await c.claim(task_types=["implement"])

    Every method retries a 503 (after its Retry-After) and a broken connection,
    with backoff; writes send an Idempotency-Key that stays the same across the
    retries. Errors raise `taskledger.client.errors` exceptions carrying `code`.
    """

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 retry: Retry | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        base, headers = settings(url, token)
        self.retry = retry or Retry()
        self._headers = headers
        self._http = httpx.AsyncClient(base_url=base, timeout=timeout, transport=transport)

    async def send(self, call: Call[T]) -> T:
        """Run one Call: retries included, the answer decoded or an error raised."""
        key = call.idempotency_key()
        headers = call.headers(self._headers, key)
        content, params = call.content(), call.query()
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await self._http.request(call.method, call.path, content=content, params=params, headers=headers)
            except httpx.TransportError as e:
                if attempt >= self.retry.attempts:
                    raise TransportError(f"{call.method} {call.path}: {e!r}") from e
                await asyncio.sleep(self.retry.delay(attempt))
                continue
            if self.retry.retryable(r) and attempt < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, r.headers.get("retry-after")))
                continue
            return call.decode(r)

    async def follow(self, since_seq: int | None = None, *, types: list[str] | None = None,
               stream: str | None = None, project: str | None = None, reconnect: bool = True,
               read_timeout: float | None = None,
               on_retry: Callable[[TaskledgerError], None] | None = None) -> AsyncIterator[Event]:
        """Every matching event of the global feed after `since_seq` (None: from now), forever.

        A dropped connection is resumed with Last-Event-ID, so nothing is lost
        or repeated across drops and restarts of the service; `on_retry` hears of
        each drop or busy answer before the wait. `reconnect=False` ends with the
        first connection instead (a drop raises TransportError)."""
        async for data in self.follow_json(since_seq, types=types, stream=stream, project=project,
                                      reconnect=reconnect, read_timeout=read_timeout, on_retry=on_retry):
            yield decode_event(data)

    def follow_json(self, since_seq: int | None = None, *, types: list[str] | None = None,
                    stream: str | None = None, project: str | None = None, reconnect: bool = True,
                    read_timeout: float | None = None,
                    on_retry: Callable[[TaskledgerError], None] | None = None) -> AsyncIterator[str]:
        """As `follow`, each event as the JSON text the service sent (to print or forward as is)."""
        cursor = Cursor("/stream", feed_params(types, stream, project), since_seq)
        return self._messages(cursor, reconnect=reconnect, read_timeout=read_timeout, on_retry=on_retry)

    async def follow_task(self, task_id: str, since_seq: int = 0, *,
                    types: list[str] | None = None) -> AsyncIterator[Event]:
        """Every event of one task's stream after `since_seq` (a `stream_seq`), forever."""
        cursor = Cursor(stream_path("tasks", task_id), feed_params(types), since_seq)
        async for data in self._messages(cursor, reconnect=True, read_timeout=None, on_retry=None):
            yield decode_event(data)

    async def follow_job(self, job_id: str, since_seq: int = 0, *,
                   types: list[str] | None = None) -> AsyncIterator[Event]:
        """Every event of one job's stream after `since_seq` (a `stream_seq`), forever."""
        cursor = Cursor(stream_path("jobs", job_id), feed_params(types), since_seq)
        async for data in self._messages(cursor, reconnect=True, read_timeout=None, on_retry=None):
            yield decode_event(data)

    async def _messages(self, cursor: Cursor, *, reconnect: bool, read_timeout: float | None,
                  on_retry: Callable[[TaskledgerError], None] | None) -> AsyncIterator[str]:
        backoff = Backoff(self.retry)
        timeout = httpx.Timeout(self._http.timeout.connect, read=read_timeout or STREAM_READ_TIMEOUT)
        while True:
            retry_after: str | None = None
            failure: TaskledgerError | None = None
            try:
                if cursor.pos is None:
                    cursor.pos = (await self.events(limit=1)).head_seq
                params, extra = cursor.request()
                async with aconnect_sse(self._http, "GET", cursor.path, params=params,
                                 headers={**self._headers, **extra}, timeout=timeout) as source:
                    r = source.response
                    if r.status_code != 200:
                        retry_after = r.headers.get("retry-after")
                        raise from_response(r.status_code, await r.aread())
                    cursor.resumed = True
                    async for message in source.aiter_sse():
                        if message.retry is not None:
                            backoff.hint_ms = message.retry
                        data = cursor.accept(message.id, message.data)
                        if data is not None:
                            backoff.reset()
                            yield data
            except httpx.TransportError as e:
                failure = TransportError(f"GET {cursor.path}: {e!r}")
            except TaskledgerError as e:
                if not (isinstance(e, TransportError) or retry_stream(e.status, self.retry)):
                    raise
                failure = e
            if not reconnect:
                if failure is not None:
                    raise failure
                return
            if failure is not None and on_retry is not None:
                on_retry(failure)
            await asyncio.sleep(backoff.next(retry_after))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        await self.aclose()
