"""The writer: runs commands in batches, one transaction and one commit each.

Every state change in taskledger is a command: an async function that reads
what it needs through a UnitOfWork, decides (pure domain code), and then
appends events and updates projections through the same UnitOfWork. HTTP
handlers do not open write transactions themselves; they submit commands here.

One writer task per process takes whatever commands are queued (up to
`batch_max`), opens one transaction, takes the log's head lock once
(`taskledger.log.LogTx`), runs the commands one after another, writes the head
and commits once. Commands that arrive while a batch commits form the next
batch, so under load many commands share one fsync, and the global head lock is
taken once per batch rather than once per event: that is what lets a gapless,
commit-ordered `seq` keep up with many writers. A command is acknowledged only
after its batch has committed.

A command that refuses (a DomainError: 404, 409, ...) must do so before it
writes; it then simply drops out of the batch. If anything else goes wrong, or
a command refuses after writing, the whole batch is rolled back and each of its
commands is run again alone, so one bad command never takes others with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from taskledger.events.errors import DomainError
from taskledger.log import ANY, LogTx, NewEvent, RecordedEvent, Write
from taskledger.service.metrics import Metrics

log = logging.getLogger("taskledger.writer")

T = TypeVar("T")


class Batch:
    """What the commands of one batch share: caches of the states they loaded or
    changed (by kind, e.g. "tasks") and the buffered writes to flush."""

    def __init__(self, conn: asyncpg.Connection, logtx: LogTx) -> None:
        self.conn = conn
        self.log = logtx
        self.cache: dict[str, dict[str, Any]] = {}
        self.appended: list[RecordedEvent] = []
        self._flushers: list[Callable[[asyncpg.Connection], Awaitable[Sequence[Write]]]] = []

    def kind(self, name: str) -> dict[str, Any]:
        return self.cache.setdefault(name, {})

    def on_flush(self, fn: Callable[[asyncpg.Connection], Awaitable[Sequence[Write]]]) -> None:
        """Run `fn` at every flush: the writes it returns go in with the buffered
        events, in their statement (`LogTx.flush`)."""
        self._flushers.append(fn)

    async def flush(self) -> None:
        writes: list[Write] = []
        for fn in self._flushers:
            writes.extend(await fn(self.conn))
        await self.log.flush(writes)


class UnitOfWork:
    """A command's view of the batch transaction.

    Appends are buffered and written together when the batch flushes: before
    any read or statement that may depend on them, and at the end of the batch.
    """

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.conn = batch.conn
        self.log = batch.log
        # The database's clock when the batch took the head lock: one clock for
        # every replica's leases and deadlines.
        self.now = batch.log.now
        self.dirty = False

    async def flush(self) -> None:
        await self.batch.flush()

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        await self.batch.flush()
        return await self.conn.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        await self.batch.flush()
        return await self.conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        await self.batch.flush()
        return await self.conn.fetchval(sql, *args)

    async def execute(self, sql: str, *args: Any) -> str:
        self.dirty = True
        await self.batch.flush()
        return await self.conn.execute(sql, *args)

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        self.dirty = True
        await self.batch.flush()
        await self.conn.executemany(sql, args)

    async def append(
        self,
        stream: str,
        events: Sequence[NewEvent],
        *,
        expected_version: int = ANY,
        meta: dict[str, Any] | None = None,
    ) -> list[RecordedEvent]:
        self.dirty = True
        recorded = await self.log.append(stream, events, expected_version=expected_version, meta=meta)
        self.batch.appended.extend(recorded)
        return recorded


Prefetch = tuple[str, str]
"""(kind, key): a state a command will load, fetched for the whole batch at once."""

Prefetcher = Callable[[Batch, list[str]], Awaitable[None]]


Command = Callable[[UnitOfWork], Awaitable[T]]


class _Item:
    __slots__ = ("enqueued", "fn", "future", "prefetch")

    def __init__(self, fn: Command[Any], future: asyncio.Future[Any], prefetch: Sequence[Prefetch]) -> None:
        self.fn = fn
        self.future = future
        self.prefetch = prefetch
        self.enqueued = time.perf_counter()


class _RefusedAfterWriting(Exception):
    def __init__(self, error: DomainError) -> None:
        super().__init__(str(error))
        self.error = error


class WriterUnavailable(Exception):
    pass


class WriterOverloaded(Exception):
    """The queue is full: answering later beats a latency nobody bounded."""


class Writer:
    def __init__(
        self,
        dsn: str,
        *,
        batch_max: int = 256,
        queue_max: int = 10_000,
        metrics: Metrics | None = None,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        self._dsn = dsn
        self._batch_max = batch_max
        self._queue_max = queue_max
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._conn: asyncpg.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._metrics = metrics
        self._on_commit = on_commit
        self._closing = False
        self.prefetchers: dict[str, Prefetcher] = {}

    async def start(self) -> None:
        self._conn = await self._connect()
        self._task = asyncio.create_task(self._run(), name="taskledger-writer")

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self._dsn, server_settings={"application_name": "taskledger-writer"})

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            # let queued commands finish (for a while), then stop
            deadline = time.monotonic() + 10
            while not self._queue.empty() and not self._task.done() and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    async def submit(self, fn: Command[T], *, prefetch: Sequence[Prefetch] = ()) -> T:
        """Run `fn` in a coming batch; `prefetch` names states it will load, so the
        batch loads them for all its commands in one query per kind."""
        if self._closing:
            raise WriterUnavailable("the service is shutting down")
        if self._queue.qsize() >= self._queue_max:
            if self._metrics is not None:
                self._metrics.inc("writer_overloaded_total")
            raise WriterOverloaded(f"{self._queue_max} commands are already waiting; retry later")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(fn, fut, prefetch))
        return await fut

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            batch = [item]
            while len(batch) < self._batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            try:
                await self._process(batch)
            except asyncio.CancelledError:
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(WriterUnavailable("the writer stopped"))
                raise
            except Exception:  # pragma: no cover - _process settles every future
                log.exception("writer batch failed")

    async def _process(self, batch: list[_Item]) -> None:
        batch = [it for it in batch if not it.future.done()]
        if not batch:
            return
        try:
            outcomes, head = await self._attempt(batch)
        except Exception as e:
            if len(batch) > 1:
                log.warning("batch of %d failed (%r); running its commands one by one", len(batch), e)
                for it in batch:
                    await self._process([it])
                return
            err: BaseException = e.error if isinstance(e, _RefusedAfterWriting) else e
            if not isinstance(err, DomainError):
                log.error("command failed: %r", err)
            if not batch[0].future.done():
                batch[0].future.set_exception(err)
            return
        if head is not None and self._on_commit is not None:
            self._on_commit(head)
        for it, (ok, value) in zip(batch, outcomes, strict=True):
            if it.future.done():
                continue
            if ok:
                it.future.set_result(value)
            else:
                it.future.set_exception(value)

    async def _attempt(self, batch: list[_Item]) -> tuple[list[tuple[bool, Any]], int | None]:
        try:
            return await self._attempt_once(batch)
        except _ConnectionLostBeforeCommit:
            # Nothing was committed: reconnect and run the batch once more.
            self._conn = None
            return await self._attempt_once(batch)

    async def _attempt_once(self, batch: list[_Item]) -> tuple[list[tuple[bool, Any]], int | None]:
        conn = self._conn
        if conn is None or conn.is_closed():
            conn = self._conn = await self._connect()
        outcomes: list[tuple[bool, Any]] = []
        committing = False
        began = time.perf_counter()
        try:
            # A plain BEGIN rather than conn.transaction(): the batch ends with
            # the head update and the COMMIT in one round trip
            # (LogTx.finish_and_commit).
            await conn.execute("BEGIN")
            logtx = await LogTx.begin(conn)
            shared = Batch(conn, logtx)
            await self._prefetch(shared, batch)
            for it in batch:
                uow = UnitOfWork(shared)
                try:
                    value = await it.fn(uow)
                except DomainError as e:
                    if uow.dirty:
                        raise _RefusedAfterWriting(e) from e
                    outcomes.append((False, e))
                else:
                    outcomes.append((True, value))
            await shared.flush()
            committing = True
            await logtx.finish_and_commit()
        except BaseException as e:
            if not conn.is_closed() and conn.is_in_transaction():
                with contextlib.suppress(Exception):
                    await conn.execute("ROLLBACK")
            if not committing and _connection_lost(e, conn):
                raise _ConnectionLostBeforeCommit() from e
            raise
        if self._metrics is not None:
            self._metrics.observe_commit(len(batch), time.perf_counter() - began, shared.appended,
                                         shared.kind("jobs"))
        head = logtx.head_seq if logtx.head_seq != logtx.start_seq else None
        return outcomes, head


    async def _prefetch(self, shared: Batch, batch: list[_Item]) -> None:
        wanted: dict[str, list[str]] = {}
        for it in batch:
            for kind, key in it.prefetch:
                wanted.setdefault(kind, []).append(key)
        for kind, keys in wanted.items():
            fn = self.prefetchers.get(kind)
            if fn is not None:
                await fn(shared, list(dict.fromkeys(keys)))


class _ConnectionLostBeforeCommit(Exception):
    pass


def _connection_lost(e: BaseException, conn: asyncpg.Connection) -> bool:
    return conn.is_closed() or isinstance(
        e, asyncpg.ConnectionDoesNotExistError | asyncpg.PostgresConnectionError | ConnectionError)
