"""What the sync and async clients share: a request as data (`Call`), the
operations that build them (`Op`, bound as methods on both clients), the retry
policy, and the decoding of answers and stream messages. No I/O here."""

from __future__ import annotations

import email.utils
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Generic, ParamSpec, TypeVar, overload

import httpx
import msgspec

from taskledger.client.errors import from_response
from taskledger.client.models import Event

if TYPE_CHECKING:
    from taskledger.client.aio import AsyncClient
    from taskledger.client.sync import Client

T = TypeVar("T")
P = ParamSpec("P")

USER_AGENT: Final = "taskledger-client/0.1"
_WRITES: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_enc = msgspec.json.Encoder()
_event = msgspec.json.Decoder(Event)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its answer."""

    method: str
    path: str
    answer: Any  # the type to decode a 2xx body into (T)
    body: Any = None
    params: Mapping[str, Any] = field(default_factory=dict)
    empty_is_none: bool = False  # 204 (nothing to claim) answers None
    idempotent: bool = True  # a write sends an Idempotency-Key (the same on each retry)

    def content(self) -> bytes | None:
        return None if self.body is None else _enc.encode(self.body)

    def query(self) -> dict[str, Any]:
        return {k: ",".join(v) if isinstance(v, list | tuple) else v
                for k, v in self.params.items() if v is not None}

    def headers(self, base: Mapping[str, str], idempotency_key: str | None) -> dict[str, str]:
        h = dict(base)
        if self.body is not None:
            h["Content-Type"] = "application/json"
        if idempotency_key is not None:
            h["Idempotency-Key"] = idempotency_key
        return h

    def is_write(self) -> bool:
        return self.method in _WRITES

    def idempotency_key(self) -> str | None:
        """A fresh key for a write that wants one, kept for all its retries."""
        return new_idempotency_key() if self.idempotent and self.is_write() else None

    def decode(self, response: httpx.Response) -> T:
        if response.status_code >= 400:
            raise from_response(response.status_code, response.content)
        if self.empty_is_none and (response.status_code == 204 or not response.content):
            return None  # type: ignore[return-value]
        if not response.content:
            return None  # type: ignore[return-value]
        out: T = msgspec.json.decode(response.content, type=self.answer)
        return out


def new_idempotency_key() -> str:
    return "tlc-" + uuid.uuid4().hex


@dataclass(frozen=True)
class Retry:
    """How often and how long to retry a request that met a 503 or a broken
    connection. Writes carry an Idempotency-Key, the same on every attempt,
    so a retried write is applied once and answers the first answer."""

    attempts: int = 6  # in all, the first included
    backoff: float = 0.2  # seconds before the first retry; doubles each time, with jitter
    max_backoff: float = 10.0
    max_retry_after: float = 60.0  # a longer Retry-After is capped to this
    # 503 is the service saying "not now"; 502 and 504 are a proxy in front of it
    # saying the same while a replica restarts. A write is safe to repeat: its
    # Idempotency-Key makes the service answer the first answer.
    statuses: frozenset[int] = frozenset({502, 503, 504})

    def retryable(self, response: httpx.Response) -> bool:
        return response.status_code in self.statuses

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before attempt `attempt + 1` (attempt counts from 1)."""
        hinted = parse_retry_after(retry_after)
        if hinted is not None:
            return min(hinted, self.max_retry_after)
        base = min(self.max_backoff, self.backoff * 2.0 ** min(attempt - 1, 30))
        jitter: float = random.random()  # noqa: S311 - jitter, not a secret
        return base / 2 + jitter * base / 2


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if value is None or not value.strip():
        return None
    v = value.strip()
    if v.isdigit():
        return float(v)
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


class Backoff:
    """Delays between reconnects of an endless stream: grows while attempts
    fail, starts over once an event arrives."""

    def __init__(self, retry: Retry) -> None:
        self.retry = retry
        self.failures = 0
        self.hint_ms: int | None = None  # the stream's `retry:` field

    def reset(self) -> None:
        self.failures = 0

    def next(self, retry_after: str | None = None) -> float:
        self.failures += 1
        if self.failures == 1 and retry_after is None and self.hint_ms is not None:
            return min(self.hint_ms / 1000, self.retry.max_backoff)
        return self.retry.delay(self.failures, retry_after)


@dataclass
class Cursor:
    """Where a follower is in a feed (the global one, cursor `seq`, or one task's
    or job's stream, cursor `stream_seq`), and what it asked for."""

    path: str
    params: dict[str, Any]
    pos: int | None = None  # None: "from now", read from the head before connecting
    resumed: bool = False

    def request(self) -> tuple[dict[str, Any], dict[str, str]]:
        """Query and headers for the next connection: `since_seq` the first time,
        `Last-Event-ID` on every reconnect (the header wins on the service)."""
        if self.resumed:
            return dict(self.params), {"Last-Event-ID": str(self.pos)}
        return {**self.params, "since_seq": self.pos}, {}

    def accept(self, message_id: str, data: str) -> str | None:
        """The event JSON in an SSE message, or None for a keep-alive or one already seen.
        The message's id is the cursor, so the event need not be decoded to advance it."""
        if not data or not message_id.isdigit():
            return None
        at = int(message_id)
        if self.pos is not None and at <= self.pos:
            return None
        self.pos = at
        return data


def decode_event(data: str) -> Event:
    return _event.decode(data)


class Op(Generic[P, T]):
    """An operation both clients offer: `build` makes the Call; bound on a
    `Client` it returns T, on an `AsyncClient` an awaitable of T."""

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__
        self.__name__ = build.__name__

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Op[P, T]: ...
    @overload
    def __get__(self, obj: Client, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncClient, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        build, send = self.build, obj.send

        def bound(*args: P.args, **kwargs: P.kwargs) -> Any:
            return send(build(*args, **kwargs))

        bound.__doc__ = self.__doc__
        bound.__name__ = self.__name__
        return bound


def settings(url: str | None, token: str | None) -> tuple[str, dict[str, str]]:
    """The base URL and headers: arguments first, then TASKLEDGER_URL / TASKLEDGER_TOKEN."""
    import os

    base = (url or os.environ.get("TASKLEDGER_URL") or "http://127.0.0.1:8080").rstrip("/")
    secret = token or os.environ.get("TASKLEDGER_TOKEN")
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    return base, headers


def feed_params(types: list[str] | None, stream: str | None = None, project: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"types": ",".join(types) if types else None, "stream": stream, "project": project}
    return {k: v for k, v in params.items() if v is not None}


def stream_path(kind: str, ident: str) -> str:
    """The SSE path of one task's or job's stream."""
    from urllib.parse import quote

    return f"/{kind}/{quote(ident, safe='')}/stream"


def retry_stream(status: int, retry: Retry) -> bool:
    """Whether a stream refused with `status` is worth reconnecting to: the retried
    statuses, and 429 (too many streams for this token, for now)."""
    return status == 429 or status in retry.statuses


# A stream is quiet between events, but the service sends a comment every 15 s:
# a connection silent for this long is dead (a vanished host sends no FIN).
STREAM_READ_TIMEOUT: Final = 45.0
