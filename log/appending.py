"""Appending to the log: one append-only `events` table with a gapless global `seq`.

How `seq` stays gapless and visible in commit order
----------------------------------------------------
Every appending transaction first locks the single row of `log_head`
(`SELECT ... FOR UPDATE`), which holds the last committed `seq` and hash. It
numbers its events from there, chains their hashes, writes the new head back,
and commits. PostgreSQL releases a transaction's row locks only after its
commit is visible, so the next appender cannot even read the head until the
previous one is committed: seq order *is* commit order, and a rolled-back
transaction rolls its head update back with its events, so no hole is left.

A sequence or identity column would be wrong here: its value is drawn at insert
and becomes visible at commit, so a reader paging `WHERE seq > cursor` can pass
over a slow transaction's event for good.

Holding one lock per append would cap throughput at one commit (one fsync) per
event. The service therefore never appends one command per transaction: its
writer (`service.writer.engine`) runs many commands in one transaction under one head
lock and one commit, so the lock is taken once per batch. See docs/DESIGN.md.
Do not change the locking here without reading that document.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, Final, NamedTuple

import asyncpg
import msgspec

from taskledger.events.canonical import canonical_json, format_ts, hash_event
from taskledger.events.errors import VersionConflict
from taskledger.log.position import lock_head
from taskledger.log.records import NewEvent, RecordedEvent

NOTIFY_CHANNEL: Final = "taskledger_events"
_HEX64: Final = re.compile(r"[0-9a-f]{64}")


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Final[Any] = _Any()
"""Pass as `expected_version` to append without an expectation."""


_json = msgspec.json.Encoder()

# One statement appends every buffered event of a transaction, across streams,
# and checks in the same snapshot that each stream touched for the first time
# was where the appender expected it (the insert cannot see its own rows, so
# the check reads the stream as it stood before this flush).
_INSERT_EVENTS = """ins AS (
    INSERT INTO events (seq, stream, stream_seq, type, data, meta, recorded_at, hash)
    SELECT s, st, ss, t, d::jsonb, m::jsonb, r, h
    FROM unnest($1::bigint[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[],
                $7::timestamptz[], $8::text[]) AS u(s, st, ss, t, d, m, r, h)
    RETURNING 1
)"""
_CHECK = """
SELECT (SELECT count(*) FROM ins) AS inserted,
       array(SELECT c.stream FROM unnest($9::text[], $10::int[]) AS c(stream, expected)
             WHERE coalesce((SELECT max(e.stream_seq) FROM events e WHERE e.stream = c.stream), 0)
                   <> c.expected) AS conflicts
"""
_EVENT_PARAMS: Final = 10
_NO_EVENTS = "\nSELECT 0::bigint AS inserted, ARRAY[]::text[] AS conflicts\n"
_PARAM = re.compile(r"\$(\d+)")
_EVENT_KEYS: Final = frozenset({"events_pkey", "events_stream_position"})


class Write(NamedTuple):
    """A statement (INSERT, UPDATE or DELETE; parameters $1..$n) for the log's next
    flush to run inside its own statement, as a data-modifying CTE: a batch's view
    rows go in with its events in one round trip. The writes of one flush see the
    same snapshot, so no two of them may touch the same row."""

    sql: str
    args: Sequence[Any]


def _renumber(sql: str, offset: int) -> str:
    return _PARAM.sub(lambda m: f"${int(m[1]) + offset}", sql)


@lru_cache(maxsize=64)
def _flush_sql(events: bool, writes: tuple[str, ...]) -> str:
    ctes = [_INSERT_EVENTS] if events else []
    offset = _EVENT_PARAMS if events else 0
    for i, sql in enumerate(writes):
        ctes.append(f"w{i} AS ({_renumber(sql, offset)})")
        offset += max((int(m) for m in _PARAM.findall(sql)), default=0)
    return "WITH " + ",\n".join(ctes) + (_CHECK if events else _NO_EVENTS)


_STREAM_VERSION = "SELECT coalesce(max(stream_seq), 0) FROM events WHERE stream = $1"

class LogTx:
    """The log's part of one database transaction.

    `begin` takes the head lock. `append` numbers and chains events at once
    (so callers can fold them) but only buffers the rows; `flush` writes
    everything buffered in one statement; `finish` flushes, writes the head back
    and queues one NOTIFY (delivered at commit). The caller owns the
    transaction and commits it.
    """

    def __init__(
        self, conn: asyncpg.Connection, head_seq: int, head_hash: str, now: datetime | None = None
    ) -> None:
        self.conn = conn
        self.now = now or datetime.now(UTC)
        self.head_seq = head_seq
        self.head_hash = head_hash
        self.start_seq = head_seq
        self.recorded_at = format_ts(self.now)  # every event of the transaction carries it
        self._versions: dict[str, int] = {}
        self._meta_json: dict[str, bytes] = {}
        self._rows: list[tuple[Any, ...]] = []
        self._expect: dict[str, int] = {}

    @classmethod
    async def begin(cls, conn: asyncpg.Connection) -> LogTx:
        if not conn.is_in_transaction():
            raise RuntimeError("LogTx.begin needs an open transaction")
        (seq, hash_), now = await lock_head(conn)
        return cls(conn, seq, hash_, now)

    async def stream_version(self, stream: str) -> int:
        v = self._versions.get(stream)
        if v is None:
            v = await self.conn.fetchval(_STREAM_VERSION, stream)
            self._versions[stream] = v
        return v

    @property
    def pending(self) -> bool:
        return bool(self._rows)

    async def append(
        self,
        stream: str,
        events: Sequence[NewEvent],
        *,
        expected_version: int = ANY,
        meta: dict[str, Any] | None = None,
    ) -> list[RecordedEvent]:
        """Append `events` to `stream`, all or none (the transaction decides).

        `expected_version` is the stream's current `stream_seq` as the caller
        saw it (0 for a new stream); a mismatch raises VersionConflict, here
        when this transaction already touched the stream, else at `flush`.
        """
        if not events:
            return []
        known = self._versions.get(stream)
        if expected_version is ANY:
            base = known if known is not None else await self.stream_version(stream)
        elif known is not None:
            if known != expected_version:
                raise VersionConflict(
                    f"stream {stream} is at version {known}, not {expected_version}",
                    stream=stream, expected=expected_version, actual=known,
                )
            base = known
        else:
            base = expected_version
            self._expect[stream] = expected_version

        meta = meta or {}
        meta_text = _json.encode(meta).decode()
        meta_json = self._meta_json.get(meta_text)
        if meta_json is None:  # the commands of a batch mostly share one meta
            meta_json = self._meta_json[meta_text] = canonical_json(meta)
        recorded_at = self.recorded_at
        out: list[RecordedEvent] = []
        prev = self.head_hash
        seq = self.head_seq
        for i, ev in enumerate(events, start=1):
            seq += 1
            canonical, h = hash_event(
                prev, seq=seq, stream=stream, stream_seq=base + i, type=ev.type,
                data=ev.data, meta=meta, recorded_at=recorded_at, meta_json=meta_json,
            )
            self._rows.append((seq, stream, base + i, ev.type, canonical, meta_text, self.now, h))
            out.append(RecordedEvent(
                seq=seq, stream=stream, stream_seq=base + i, type=ev.type,
                data=ev.data, meta=meta, recorded_at=recorded_at, hash=h,
            ))
            prev = h
        self.head_seq = seq
        self.head_hash = prev
        self._versions[stream] = base + len(events)
        return out

    async def flush(self, writes: Sequence[Write] = ()) -> None:
        """Write the buffered events, and `writes` with them, in one statement."""
        if not self._rows and not writes:
            return
        rows, self._rows = self._rows, []
        expect, self._expect = self._expect, {}
        args: list[Any] = []
        if rows:
            args += [list(c) for c in zip(*rows, strict=True)]
            args += [list(expect), list(expect.values())]
        for w in writes:
            args += w.args
        try:
            row = await self.conn.fetchrow(_flush_sql(bool(rows), tuple(w.sql for w in writes)), *args)
        except asyncpg.UniqueViolationError as e:
            if e.constraint_name not in _EVENT_KEYS:
                raise
            raise VersionConflict("a stream moved on while appending") from e
        assert row is not None
        if row["conflicts"]:
            stream = row["conflicts"][0]
            raise VersionConflict(
                f"stream {stream} is not at version {expect[stream]}",
                stream=stream, expected=expect[stream],
            )

    async def finish(self) -> None:
        await self.flush()
        if self.head_seq != self.start_seq:
            await self.conn.execute(self._head_sql())

    async def finish_and_commit(self) -> None:
        """`finish` and COMMIT in one round trip: the head update and the COMMIT
        go as one simple-protocol query, so a failing head update skips the
        COMMIT (the caller rolls back). The caller must have begun the
        transaction with a plain BEGIN, not an asyncpg Transaction object."""
        await self.flush()
        head = self._head_sql() + "; " if self.head_seq != self.start_seq else ""
        await self.conn.execute(head + "COMMIT")

    def _head_sql(self) -> str:
        # One wake-up per commit (NOTIFY is delivered at commit); listeners read
        # the table, not the payload.
        # The same statement moves the checkpoint of every inline projection
        # (sql/004_projections.sql): their rows were written in this
        # transaction, so they have folded the log up to the new head. This is
        # the projections' only hook in the append path; it adds no statement.
        # Literals, not parameters, so it can share a query with the COMMIT:
        # only an int and the hex hash this class computed are spliced in.
        seq, h = int(self.head_seq), self.head_hash
        if not _HEX64.fullmatch(h):
            raise ValueError(f"head hash {h!r} is not 64 hex digits")
        return (f"WITH h AS (UPDATE log_head SET seq = {seq}, hash = '{h}' WHERE id = 1), "
                f"c AS (UPDATE projection_checkpoints SET seq = {seq}, updated_at = now() WHERE inline) "
                f"SELECT pg_notify('{NOTIFY_CHANNEL}', '{seq}')")


async def append(
    conn: asyncpg.Connection,
    stream: str,
    events: Sequence[NewEvent],
    *,
    expected_version: int = ANY,
    meta: dict[str, Any] | None = None,
) -> list[RecordedEvent]:
    """Append inside the caller's transaction (which must be open)."""
    log = await LogTx.begin(conn)
    out = await log.append(stream, events, expected_version=expected_version, meta=meta)
    await log.finish()
    return out
