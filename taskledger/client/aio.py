"""`AsyncClient`: the asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TypeVar

import httpx
from httpx_sse import aconnect_sse

from taskledger.client._api import Operations
from taskledger.client._call import (
    STREAM_READ_TIMEOUT,
    Backoff,
    Call,
    FeedCursor,
    Retry,
    feed_params,
    new_idempotency_key,
    retryable,
    settings,
)
from taskledger.client.errors import TransportError, from_response
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
        key = new_idempotency_key() if call.is_write() else None
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
            if retryable(r) and attempt < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, r.headers.get("retry-after")))
                continue
            return call.decode(r)

    async def follow(self, since_seq: int | None = None, *, types: list[str] | None = None,
               stream: str | None = None, project: str | None = None) -> AsyncIterator[Event]:
        """Every matching event after `since_seq` (None: from now), forever.

        A dropped connection is resumed with Last-Event-ID, so nothing is lost
        or repeated across drops and restarts of the service."""
        if since_seq is None:
            since_seq = (await self.events(limit=1)).head_seq
        cursor = FeedCursor(seq=since_seq, params=feed_params(types, stream, project))
        backoff = Backoff(self.retry)
        timeout = httpx.Timeout(self._http.timeout.connect, read=STREAM_READ_TIMEOUT)
        while True:
            retry_after = None
            params, extra = cursor.request()
            try:
                async with aconnect_sse(self._http, "GET", "/stream", params=params,
                                 headers={**self._headers, **extra}, timeout=timeout) as source:
                    r = source.response
                    if r.status_code != 200:
                        err = from_response(r.status_code, await r.aread())
                        if r.status_code not in (429, 503):
                            raise err
                        retry_after = r.headers.get("retry-after")
                    else:
                        cursor.resumed = True
                        async for message in source.aiter_sse():
                            if message.retry is not None:
                                backoff.hint_ms = message.retry
                            ev = cursor.accept(message.data)
                            if ev is not None:
                                backoff.reset()
                                yield ev
            except httpx.TransportError:
                pass
            await asyncio.sleep(backoff.next(retry_after))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        await self.aclose()
