"""Server-Sent Events: the global feed and one task's or job's stream.

The handlers validate everything (cursor, filters, existence, the per-token
cap) before the response starts, so a bad request is a problem+json answer and
never an empty stream that hangs. The stream itself is sse-starlette's
`EventSourceResponse`, returned to Litestar as an ASGI app; events come from the
process's one `Hub` (service.http.live).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any, Final, cast

import anyio
import asyncpg
from litestar import Controller, Request, Response, get
from litestar.exceptions import HTTPException
from litestar.params import FromPath, HeaderParameter, Parameter
from litestar.types import ASGIApp, Receive, Scope, Send
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError

from taskledger import log as store
from taskledger.events.errors import JobNotFound, TaskNotFound, ValidationFailed
from taskledger.service.http.deps import HubDep, PoolDep, SettingsDep, TokensDep
from taskledger.service.http.live import Filter, Hub, Refusal, StreamStop
from taskledger.service.http.problems import problem
from taskledger.service.http.routes.common import MAX_STREAM_SEQ, SinceSeq, StreamSinceSeq, check_id, split_types
from taskledger.service.settings import Settings
from taskledger.service.tokens import Principal, TokenStore

log = logging.getLogger("taskledger.sse")

RETRY_MS: Final = 2000
SERVER_SEND: Final = "taskledger.server_send"
_CURSOR = re.compile(r"^[0-9]{1,19}$")
_MAX_CURSOR: Final = 2**62

LastEventId = Annotated[str | None, HeaderParameter(
    name="Last-Event-ID", required=False, max_length=64,
    description="resume after this cursor; wins over since_seq")]
Types = Annotated[str | None, Parameter(max_length=4000, description="comma list; 'task.' is a prefix")]
StreamName = Annotated[str | None, Parameter(max_length=200)]
Project = Annotated[str | None, Parameter(max_length=200)]


def _cursor(since_seq: int | None, last_event_id: str | None) -> int | None:
    """The client's cursor: Last-Event-ID wins over since_seq; None means "from now"."""
    if last_event_id is not None and last_event_id.strip() != "":
        v = last_event_id.strip()
        if not _CURSOR.match(v) or int(v) > _MAX_CURSOR:
            raise ValidationFailed("Last-Event-ID must be a non-negative integer cursor")
        return int(v)
    return since_seq


async def _events(hub: Hub, flt: Filter, pos: int, by_stream_seq: bool,
                  stop: StreamStop) -> AsyncIterator[bytes]:
    yield f"retry: {RETRY_MS}\r\n\r\n".encode()
    try:
        async with contextlib.aclosing(hub.follow(flt, pos, stop=stop)) as batches:
            async for batch in batches:
                yield batch.frames(by_stream_seq)
    except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as e:
        # A catch-up read failed (database restarting): end the stream; the client
        # reconnects with Last-Event-ID and resumes exactly where it was.
        log.warning("ending an SSE stream after a database error: %r", e)


def keep_server_send(app: ASGIApp) -> ASGIApp:
    """Wrap the whole app so that a stream can send its body to the server directly.

    Every layer between the server and a handler that wraps `send` (Litestar's
    exception handlers, the request middleware, tracing) does so to see
    `http.response.start`. A stream sends its start through them like any
    response, then one body message per delivery: with thousands of streams
    those wrappers cost as much as the send itself, so the body goes straight
    to the server's `send`, kept in the scope under SERVER_SEND.
    """

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        cast(dict[str, Any], scope)[SERVER_SEND] = send
        await app(scope, receive, send)

    return handler


class _EventSource(EventSourceResponse):
    """sse-starlette's response with a send timeout that costs nothing per event.

    A consumer that stopped reading fills its socket buffer, and then the server's
    send never returns: the stream would hold its slot, its socket and its
    buffered bytes for good. sse-starlette's own `send_timeout` enters an anyio
    cancel scope around every send; with a thousand subscribers that scope was a
    third of the server's cost per delivered event. Instead a data send only notes
    when it began, and the keep-alive task, which wakes anyway, ends the stream
    when a send has waited longer than `stall_seconds` or its own keep-alive
    cannot be sent within that time. The client reconnects with Last-Event-ID and
    loses nothing.

    Body messages (events and keep-alives) go to `server_send`, the server's own
    `send` (see keep_server_send), when there is one.
    """

    def __init__(self, *args: Any, stall_seconds: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stall_seconds = stall_seconds
        self.sending_since: float | None = None
        self.server_send: Send | None = None

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        self.sending_since = time.monotonic()
        if self.server_send is not None and message["type"] == "http.response.body":
            await self.server_send(message)
        else:
            await send(message)
        self.sending_since = None

    async def _ping(self, send: Any) -> None:
        send = self.server_send or send
        while self.active:
            await anyio.sleep(self._ping_interval)
            since = self.sending_since
            if since is not None and time.monotonic() - since > self.stall_seconds:
                raise SendTimeoutError
            ping = f": ping - {datetime.now(UTC)}\r\n\r\n".encode()
            async with self._send_lock:
                if self.active:
                    with anyio.move_on_after(self.stall_seconds) as scope:
                        await send({"type": "http.response.body", "body": ping, "more_body": True})
                    if scope.cancel_called:
                        raise SendTimeoutError


class _Stream:
    """The SSE response, releasing its stream slot however it ends."""

    def __init__(self, response: _EventSource, hub: Hub, key: str) -> None:
        self._response = response
        self._hub = hub
        self._key = key
        self._released = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._response.server_send = cast(dict[str, Any], scope).get(SERVER_SEND)
        try:
            await self._response(scope, receive, send)  # type: ignore[arg-type]
        except SendTimeoutError:
            # The consumer stopped reading: drop it (the connection is cut).
            self._hub.count("sse_send_timeouts_total")
            log.info("dropped an SSE consumer that stopped reading")
        finally:
            self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._hub.release_stream(self._key)


class StreamRefused(Exception):
    """A stream that cannot be admitted now; answered at once, with Retry-After."""

    def __init__(self, why: Refusal, settings: Settings) -> None:
        super().__init__(why)
        self.why = why
        self.settings = settings


def _refused(_: Request[Any, Any, Any], exc: StreamRefused) -> Response[Any]:
    settings = exc.settings
    if exc.why == "capacity":
        r = problem(503, "too_many_streams", "Too many streams",
                    f"this server process already holds its maximum of {settings.max_streams} streams; "
                    "retry later (other requests are still served)")
    else:
        r = problem(429, "too_many_requests", "Too many requests",
                    f"this token already has {settings.max_streams_per_token} open streams")
    # The client is told to come back later: it has no use for this connection meanwhile.
    r.headers.update({"Retry-After": str(settings.stream_retry_after_seconds), "Connection": "close"})
    return r


def _stream_key(request: Request[Any, Any, Any]) -> str:
    user = request.user
    return user.token_hash if isinstance(user, Principal) else "anonymous"


def _admissible(request: Request[Any, Any, Any], hub: Hub, settings: Settings) -> None:
    """Refuse a stream before any database work when the caps are already reached."""
    if hub.closed:
        raise HTTPException(status_code=503, detail="the service is shutting down",
                            headers={"Retry-After": str(settings.stream_retry_after_seconds)})
    why = hub.refusal(_stream_key(request), settings.max_streams_per_token)
    if why is not None:
        hub.count_refusal(why)
        raise StreamRefused(why, settings)


def _open(request: Request[Any, Any, Any], hub: Hub, settings: Settings, tokens: TokenStore,
          flt: Filter, pos: int, by_stream_seq: bool) -> ASGIApp:
    _admissible(request, hub, settings)
    key = _stream_key(request)
    why = hub.acquire_stream(key, settings.max_streams_per_token)
    if why is not None:  # taken meanwhile, while this request read the database
        hub.count_refusal(why)
        raise StreamRefused(why, settings)
    # sse-starlette sets `stop` when the server is shutting down (uvicorn); the
    # stream then ends cleanly within the grace period instead of being cut.
    stop = StreamStop()
    tokens.watch(request.user, stop)  # a revoked or expired token's streams end
    response = _EventSource(
        _events(hub, flt, pos, by_stream_seq, stop),
        ping=settings.sse_keepalive_seconds,
        headers={"Cache-Control": "no-store"},
        shutdown_event=cast(anyio.Event, stop),
        shutdown_grace_period=2.0,
        stall_seconds=settings.sse_send_timeout_seconds,
    )
    return _Stream(response, hub, key)


async def _one_stream(
    request: Request[Any, Any, Any], pool: asyncpg.Pool, hub: Hub, settings: Settings, tokens: TokenStore,
    stream: str, cursor: int | None, types: str | None, missing: type[TaskNotFound] | type[JobNotFound],
) -> ASGIApp:
    _admissible(request, hub, settings)
    if cursor is not None and cursor > MAX_STREAM_SEQ:
        raise ValidationFailed(f"cursor {cursor} is beyond any stream_seq ({MAX_STREAM_SEQ})")
    head, last, at = await store.stream_position(pool, stream, cursor or 0)
    if last is None:
        raise missing(f"{stream} has no events")
    if cursor is None:
        pos = head
    elif cursor > last:
        raise ValidationFailed(f"cursor {cursor} is beyond the last stream_seq of {stream} ({last})")
    else:
        pos = int(at) if cursor > 0 and at is not None else 0
    return _open(request, hub, settings, tokens, Filter(split_types(types), stream=stream), pos, by_stream_seq=True)


class StreamController(Controller):
    tags = ["events"]
    exception_handlers = {StreamRefused: _refused}

    @get("/stream", operation_id="streamEvents", media_type="text/event-stream",
         summary="Follow the global feed over SSE (cursor: seq)")
    async def feed(
        self,
        request: Request[Any, Any, Any],
        pool: PoolDep,
        hub: HubDep,
        settings: SettingsDep,
        tokens: TokensDep,
        *,
        since_seq: SinceSeq = None,
        last_event_id: LastEventId = None,
        types: Types = None,
        stream: StreamName = None,
        project: Project = None,
    ) -> ASGIApp:
        _admissible(request, hub, settings)
        cursor = _cursor(since_seq, last_event_id)
        head = (await store.head(pool)).seq
        if cursor is not None and cursor > head:
            raise ValidationFailed(f"cursor {cursor} is beyond the head of the log ({head})")
        flt = Filter(split_types(types), stream=stream, project=project)
        return _open(request, hub, settings, tokens, flt, head if cursor is None else cursor, by_stream_seq=False)

    @get("/tasks/{task_id:str}/stream", operation_id="streamTask", media_type="text/event-stream",
         summary="Follow one task's stream over SSE (cursor: stream_seq)")
    async def task(
        self, request: Request[Any, Any, Any], pool: PoolDep, hub: HubDep, settings: SettingsDep, tokens: TokensDep,
        task_id: FromPath[str], *, since_seq: StreamSinceSeq = None,
        last_event_id: LastEventId = None, types: Types = None,
    ) -> ASGIApp:
        check_id(task_id, "task id")
        return await _one_stream(request, pool, hub, settings, tokens, f"task:{task_id}",
                                 _cursor(since_seq, last_event_id), types, TaskNotFound)

    @get("/jobs/{job_id:str}/stream", operation_id="streamJob", media_type="text/event-stream",
         summary="Follow one job's stream over SSE (cursor: stream_seq)")
    async def job(
        self, request: Request[Any, Any, Any], pool: PoolDep, hub: HubDep, settings: SettingsDep, tokens: TokensDep,
        job_id: FromPath[str], *, since_seq: StreamSinceSeq = None,
        last_event_id: LastEventId = None, types: Types = None,
    ) -> ASGIApp:
        check_id(job_id, "job id")
        return await _one_stream(request, pool, hub, settings, tokens, f"job:{job_id}",
                                 _cursor(since_seq, last_event_id), types, JobNotFound)


ROUTES = [StreamController]

