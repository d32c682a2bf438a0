"""Live subscriptions: one tailer per process, fanned out to bounded subscribers.

The tailer
----------
One task per service process follows the log. It owns a dedicated connection
(never a pooled one, `application_name=taskledger-tailer`) that LISTENs on
`taskledger_events`. A notification, a local commit (`notify`) and a short poll
timer are all the same thing to it: a wake-up. Awake, it reads
`WHERE seq > cursor ORDER BY seq LIMIT page` until a short page, hands every page
to its subscribers and advances `cursor`. The log guarantees that seq is gapless
and becomes visible in commit order, so reading past the cursor never skips an
event; the payload of a notification is never trusted. When the connection
drops it reconnects with backoff, LISTENs again and simply reads on from its
cursor: nothing is lost, because the table, not the notification, is the truth.

The catch-up -> live handoff (do not change without reading this)
----------------------------------------------------------------
A subscriber's position is `pos`, the global seq of the last event it has been
given (or has skipped as not matching). Live delivery and catch-up reading meet
at one number, `sub.start`:

1. The subscriber registers with the hub *first*. Registration runs with no
   await, so it is atomic with respect to fan-out, which also never awaits
   between handing a page out and advancing the cursor. `sub.start` is the
   tailer's cursor at that instant, and from then on the tailer pushes every
   matching event with seq > `sub.start` into the subscriber's queue.
2. Everything with seq <= `sub.start` is therefore already committed and in
   the table. While `pos < sub.start`, the subscriber reads the table in pages
   `WHERE seq > pos AND seq <= sub.start`; a short page means it has reached
   `sub.start`, so `pos = sub.start`. Meanwhile live events queue up.
3. Then it drains its queue, dropping anything with seq <= `pos` (there is
   none unless the client's cursor was ahead of the tailer, e.g. "from now"
   taken from the database head while the tailer was a little behind).

So the two sources tile the seq line at `sub.start`: no gap, no duplicate, and
always in seq order.

A subscriber that cannot keep up (its queue would pass `queue_max`) is
detached by the tailer at once: its queue is dropped and the tailer stops
feeding it. It never blocks the tailer or anyone else, and its memory is
bounded by `queue_max` rows plus one catch-up page read ahead. Once it is
past its current `start` (all of which is in the table), it re-registers
(`sub.start` = the tailer's cursor now) and goes back to step 2 from its own
`pos`: catch-up from the table in pages, then live again. Dropped queue items
are never needed: they all have seq > `pos` and are read again from the
table. Catch-up reads use the pool, never the tailer's connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Final, Literal, Protocol

import asyncpg

from taskledger import log as store
from taskledger.service.background import cancel_all
from taskledger.service.metrics import Metrics

log = logging.getLogger("taskledger.live")

APPLICATION_NAME: Final = "taskledger-tailer"

# (seq, stream_seq, type, event JSON text, stream, project, frame): the first
# four are what a client is sent; stream and project are for filtering; frame is
# the SSE message with `id: <seq>`, encoded once by the tailer for all global-feed
# subscribers (None on rows read for catch-up).
Row = tuple[int, int, str, str, str | None, str | None, bytes | None]

Refusal = Literal["capacity", "token"]
"""Why a stream is refused: the process holds `max_streams`, or the token its own cap."""


def frame(seq_or_stream_seq: int, type_: str, data: str) -> str:
    """One SSE message. jsonb text never has raw line breaks; split them anyway if present."""
    if "\n" in data or "\r" in data:
        data = "\r\ndata: ".join(data.splitlines())
    return f"id: {seq_or_stream_seq}\r\nevent: {type_}\r\ndata: {data}\r\n\r\n"

class Stoppable(Protocol):
    async def wait(self) -> Any: ...


class Filter:
    """The contract's feed filters: `types` (exact, or prefix when ending in '.'), stream, project.

    `matches` applies them to a live row; catch-up reads apply the same filters
    in SQL (`taskledger.log.filters`)."""

    __slots__ = ("exact", "key", "prefixes", "project", "stream", "types")

    def __init__(self, types: Sequence[str] = (), stream: str | None = None,
                 project: str | None = None) -> None:
        self.types = tuple(types)
        self.exact = frozenset(t for t in types if not t.endswith("."))
        self.prefixes = tuple(t for t in types if t.endswith("."))
        self.stream = stream
        self.project = project
        self.key = (self.types, stream, project)

    @property
    def everything(self) -> bool:
        return not self.types and self.stream is None and self.project is None

    def matches(self, row: Row) -> bool:
        if self.stream is not None and row[4] != self.stream:
            return False
        if self.project is not None and row[5] != self.project:
            return False
        if self.types:
            t = row[2]
            return t in self.exact or t.startswith(self.prefixes)
        return True


class Subscription:
    __slots__ = ("closed", "detached", "filter", "items", "start", "wake")

    def __init__(self, flt: Filter, start: int) -> None:
        self.filter = flt
        self.start = start
        self.items: deque[Row] = deque()
        self.wake = asyncio.Event()
        self.detached = False
        self.closed = False


class Hub:
    """The process's tailer and its subscribers."""

    def __init__(
        self,
        dsn: str,
        pool: asyncpg.Pool,
        *,
        poll_seconds: float = 1.0,
        queue_max: int = 1000,
        page: int = 1000,
        catchup_page: int = 2000,
        max_streams: int = 10_000,
        wake_slice: int = 200,
        metrics: Metrics | None = None,
    ) -> None:
        self._dsn = dsn
        self._pool = pool
        self._poll = poll_seconds
        self.queue_max = queue_max
        self._page = page
        self.catchup_page = catchup_page
        self._metrics = metrics
        self.cursor = 0
        self.known_head = 0
        self.connected = False
        self._subs: set[Subscription] = set()
        self.max_streams = max_streams
        self.wake_slice = wake_slice
        self.open_streams = 0
        self._streams: Counter[str] = Counter()
        self._drained = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._closed = False
        self._last_advance = time.monotonic()

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        self.cursor = self.known_head = (await store.head(self._pool)).seq
        self._task = asyncio.create_task(self._run(), name="taskledger-tailer")

    def end_streams(self) -> None:
        """Shutting down: end every subscription (its stream closes cleanly) and take no more."""
        self._closed = True
        for sub in list(self._subs):
            sub.closed = True
            sub.wake.set()

    async def stop(self, drain_seconds: float = 3.0) -> None:
        """End every subscription and stop the tailer."""
        self.end_streams()
        # Give the open responses a moment to send their end, so that clients see a
        # clean end of stream and reconnect elsewhere rather than a broken one.
        if self._streams:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), drain_seconds)
        if self._task is not None:
            await cancel_all([self._task])
        await self._close_conn()

    @property
    def closed(self) -> bool:
        return self._closed

    def notify(self, head: int) -> None:
        """A wake-up: someone committed up to `head` (a hint, never trusted for content)."""
        self.known_head = max(self.known_head, head)
        self._wake.set()

    # -- stream admission: the process's cap and the per-token cap --------

    def refusal(self, key: str, per_token: int) -> Refusal | None:
        """Why a new stream for `key` would be refused now (None: it would be admitted)."""
        if self.open_streams >= self.max_streams:
            return "capacity"
        if self._streams[key] >= per_token:
            return "token"
        return None

    def acquire_stream(self, key: str, per_token: int) -> Refusal | None:
        """Take a stream slot for `key`, or answer why not. Never awaits."""
        why = self.refusal(key, per_token)
        if why is not None:
            return why
        self._streams[key] += 1
        self.open_streams += 1
        return None

    def release_stream(self, key: str) -> None:
        self.open_streams -= 1
        self._streams[key] -= 1
        if self._streams[key] <= 0:
            del self._streams[key]
            if not self._streams:
                self._drained.set()

    # -- metrics -----------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    @property
    def lag(self) -> int:
        return max(0, self.known_head - self.cursor)

    def register_metrics(self, metrics: Metrics) -> None:
        metrics.gauge("sse_subscribers", lambda: self.subscribers)
        metrics.gauge("sse_streams_open", lambda: self.open_streams)
        metrics.gauge("sse_streams_max", lambda: self.max_streams)
        for why in ("capacity", "token"):  # shown from the start, not from the first refusal
            metrics.inc("sse_streams_refused_total", 0, reason=why)
        metrics.gauge("sse_tailer_lag_events", lambda: self.lag)
        metrics.gauge("sse_tailer_cursor", lambda: self.cursor)
        metrics.gauge("sse_tailer_connected", lambda: int(self.connected))
        metrics.gauge("sse_tailer_idle_seconds",
                      lambda: round(time.monotonic() - self._last_advance, 3) if self.lag else 0.0)

    def count_refusal(self, why: Refusal) -> None:
        self._inc("sse_streams_refused_total", reason=why)

    def count(self, name: str) -> None:
        self._inc(name)

    def _inc(self, name: str, by: int = 1, **labels: str) -> None:
        if self._metrics is not None:
            self._metrics.inc(name, by, **labels)

    # -- the tailer --------------------------------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: object) -> None:
        try:
            self.notify(int(str(payload)))
        except ValueError:
            self._wake.set()

    def _on_lost(self, _conn: Any) -> None:
        self.connected = False
        self._wake.set()

    async def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        self.connected = False
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 2)
            except Exception:
                conn.terminate()

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                conn = await asyncpg.connect(
                    self._dsn, server_settings={"application_name": APPLICATION_NAME}, timeout=10
                )
                self._conn = conn
                conn.add_termination_listener(self._on_lost)
                await conn.add_listener(store.NOTIFY_CHANNEL, self._on_notify)
                self.connected = True
                backoff = 0.05
                while not self._closed:
                    self._wake.clear()
                    await self._drain(conn)
                    if conn.is_closed():
                        raise ConnectionError("the tailer's connection closed")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self._poll)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._closed:
                    return
                log.warning("tailer lost its connection (%r); reconnecting in %.2fs", e, backoff)
                self._inc("sse_tailer_reconnects_total")
            await self._close_conn()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _drain(self, conn: asyncpg.Connection) -> None:
        while True:
            if not self._subs:
                # Nobody to feed: move the cursor to the head without reading rows.
                head = (await store.head(conn)).seq
                if not self._subs:  # still nobody (no await between check and move)
                    if head > self.cursor:
                        self.cursor = head
                        self._last_advance = time.monotonic()
                    self.known_head = max(self.known_head, self.cursor)
                    return
            rows: list[Row] = []
            for r in await store.tail_rows(conn, self.cursor, self._page):
                j = store.event_json(r)
                rows.append((r[0], r[1], r[2], j, r[3], r[4], frame(r[0], r[2], j).encode()))
            if not rows:
                self.known_head = max(self.known_head, self.cursor)
                return
            if rows[0][0] != self.cursor + 1:  # pragma: no cover - the log's invariant
                log.error("log gap: cursor %d, next seq %d", self.cursor, rows[0][0])
            self._publish(rows)
            self.cursor = rows[-1][0]
            self._last_advance = time.monotonic()
            self.known_head = max(self.known_head, self.cursor)
            if len(rows) < self._page:
                return

    def _publish(self, rows: list[Row]) -> None:
        """Hand a page to every subscriber. Never awaits, never blocks."""
        qmax = self.queue_max
        # Subscribers mostly share a few filters (a dashboard's, a project's): each
        # distinct filter is applied to the page once, not once per subscriber.
        matches: dict[tuple[Any, ...], list[Row]] = {}
        woken: list[Subscription] = []
        for sub in self._subs:
            if sub.detached:
                continue
            flt = sub.filter
            if flt.everything:
                matched = rows
            else:
                found = matches.get(flt.key)
                if found is None:
                    found = matches[flt.key] = [r for r in rows if flt.matches(r)]
                matched = found
            if not matched:
                continue
            if len(sub.items) + len(matched) > qmax:
                sub.detached = True
                sub.items.clear()
                self._inc("sse_subscriber_overflows_total")
            else:
                sub.items.extend(matched)
            woken.append(sub)
        self._wake_slices(woken, 0)

    def _wake_slices(self, subs: list[Subscription], first: int) -> None:
        """Wake `subs` a slice per event-loop turn, not all at once.

        Every subscriber woken in one turn sends before the loop looks at its
        sockets again: with ten thousand streams one event would hold every other
        request of this process for the whole fan-out. A slice at a time, a
        request waits for one slice at most. Only wake-ups are deferred: the
        items are already queued, and a subscriber checks its queue before it
        waits, so the handoff above is unchanged.
        """
        end = first + self.wake_slice
        for sub in subs[first:end]:
            sub.wake.set()
        if end < len(subs):
            asyncio.get_running_loop().call_soon(self._wake_slices, subs, end)

    # -- subscribers -------------------------------------------------------

    def _subscribe(self, flt: Filter) -> Subscription:
        sub = Subscription(flt, self.cursor)
        if self._closed:
            sub.closed = True
        self._subs.add(sub)
        return sub

    def _reattach(self, sub: Subscription) -> None:
        sub.items.clear()
        sub.start = self.cursor
        sub.detached = False

    @staticmethod
    async def _watch(sub: Subscription, stop: Stoppable) -> None:
        await stop.wait()
        sub.closed = True
        sub.wake.set()

    async def _catchup(self, flt: Filter, after: int, upto: int) -> list[Row]:
        rows = await store.feed_rows(self._pool, after, upto, self.catchup_page, types=flt.types,
                                     stream=flt.stream, project=flt.project)
        return [(r[0], r[1], r[2], store.event_json(r), None, None, None) for r in rows]

    async def follow(self, flt: Filter, pos: int, *, stop: Stoppable | None = None,
                     ) -> AsyncGenerator[list[Row], None]:
        """Every event matching `flt` with seq > `pos`, exactly once, in seq order, forever.

        Yields non-empty batches; returns when the hub stops or `stop` is set.
        """
        sub = self._subscribe(flt)
        watcher = asyncio.create_task(self._watch(sub, stop)) if stop is not None else None
        # Catch-up reads one page ahead: the next page is read while this one is sent.
        prefetch: asyncio.Task[list[Row]] | None = None
        prefetch_at = (0, 0)  # the (after, upto) the prefetched page was read for
        try:
            while not sub.closed:
                if pos < sub.start:
                    # Catch-up. If the queue overflows meanwhile, the subscriber stays
                    # detached until it reaches this `start`, and re-registers then:
                    # re-registering mid-way would only move the target and waste the
                    # page read ahead.
                    upto = sub.start
                    if prefetch is not None and prefetch_at == (pos, upto):
                        rows = await prefetch
                    else:
                        if prefetch is not None:
                            prefetch.cancel()
                        rows = await self._catchup(flt, pos, upto)
                    prefetch = None
                    if len(rows) < self.catchup_page:
                        nxt = upto
                    else:
                        nxt = rows[-1][0]
                        prefetch_at = (nxt, upto)
                        prefetch = asyncio.create_task(self._catchup(flt, nxt, upto))
                    if rows:
                        self._inc("sse_events_delivered_total", len(rows))
                        yield rows
                    pos = nxt
                    continue
                if sub.detached:
                    self._reattach(sub)
                    continue
                if sub.items:
                    items = sub.items
                    while items and items[0][0] <= pos:
                        items.popleft()
                    if items:
                        batch = list(items)
                        items.clear()
                        pos = batch[-1][0]
                        self._inc("sse_events_delivered_total", len(batch))
                        yield batch
                    continue
                sub.wake.clear()
                if sub.items or sub.detached or sub.closed:
                    continue
                await sub.wake.wait()
        finally:
            self._subs.discard(sub)
            if watcher is not None:
                watcher.cancel()
            if prefetch is not None:
                prefetch.cancel()
                with contextlib.suppress(BaseException):
                    await prefetch


def on_commit(hub: Hub) -> Callable[[int], None]:
    return hub.notify
