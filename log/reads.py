"""Reading the log: the global feed, pages for the projections, one stream, a seq's time.

Every read is by `seq` (the global position, gapless and visible in commit
order) or by (`stream`, `stream_seq`); both are keys of `events`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from taskledger.log.filters import feed_where
from taskledger.log.position import HEAD_SEQ_SQL
from taskledger.log.records import (
    EVENT_COLUMNS_SQL,
    EVENT_ROW_SQL,
    LOG_EVENT_SQL,
    RECORDED_AT_TEXT_SQL,
    LogEvent,
    RecordedEvent,
    event_json,
    log_event_from_row,
    record_from_row,
)

# ------------------------------------------------------------------ the global feed


async def read(
    conn: Any,
    *,
    since_seq: int = 0,
    limit: int = 1000,
    types: Sequence[str] = (),
    stream: str | None = None,
    project: str | None = None,
    to_seq: int | None = None,
) -> list[RecordedEvent]:
    where, args = feed_where(1, after=since_seq, upto=to_seq, types=types, stream=stream, project=project)
    rows = await conn.fetch(
        f"SELECT {EVENT_COLUMNS_SQL} FROM events WHERE {where} ORDER BY seq LIMIT {int(limit)}",
        *args,
    )
    return [record_from_row(r) for r in rows]


async def read_json(
    conn: Any,
    *,
    since_seq: int = 0,
    limit: int = 1000,
    types: Sequence[str] = (),
    stream: str | None = None,
    project: str | None = None,
    to_seq: int | None = None,
) -> list[tuple[int, str, str]]:
    """(seq, type, event JSON text) rows, for feeds that pass events through."""
    where, args = feed_where(1, after=since_seq, upto=to_seq, types=types, stream=stream, project=project)
    rows = await conn.fetch(
        f"SELECT {EVENT_ROW_SQL} FROM events WHERE {where} ORDER BY seq LIMIT {int(limit)}", *args
    )
    return [(r[0], r[2], event_json(r)) for r in rows]


_TAIL_SQL: Final = f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq > $1 ORDER BY seq LIMIT $2"


async def tail_rows(conn: Any, after: int, limit: int) -> list[Any]:
    """The next `limit` rows (EVENT_ROW_SQL) after `after`, every stream: the live tailer's read."""
    rows: list[Any] = await conn.fetch(_TAIL_SQL, after, limit)
    return rows


async def feed_rows(
    conn: Any, after: int, upto: int, limit: int, *, types: Sequence[str] = (), stream: str | None = None,
    project: str | None = None,
) -> list[Any]:
    """Rows (EVENT_ROW_SQL) with `after` < seq <= `upto` matching the filters: a subscriber's catch-up."""
    where, args = feed_where(4, types=types, stream=stream, project=project)
    rows: list[Any] = await conn.fetch(
        f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq > $1 AND seq <= $2 AND {where} ORDER BY seq LIMIT $3",
        after, upto, limit, *args,
    )
    return rows


async def event_json_pages(conn: Any, from_seq: int, to_seq: int, page: int) -> Any:
    """The contract's event JSON (text) for seqs from_seq..to_seq, a page at a time."""
    pos = from_seq - 1
    while pos < to_seq:
        end = min(pos + page, to_seq)
        rows = await conn.fetch(
            f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq > $1 AND seq <= $2 ORDER BY seq", pos, end)
        yield [event_json(r) for r in rows]
        pos = end


async def event_json_at(conn: Any, seq: int) -> str | None:
    """The contract's event JSON (text) of the event at `seq`."""
    row = await conn.fetchrow(f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq = $1", seq)
    return None if row is None else event_json(row)


# ------------------------------------------------------------------ pages for the projections


async def read_page(conn: Any, prefix: str, after: int, upto: int, types: Sequence[str] = ()) -> list[LogEvent]:
    """The events of streams starting with `prefix` with `after` < seq <= `upto`, in seq order;
    with `types`, only the events of those types (the server skips the others unformatted)."""
    if types:
        rows = await conn.fetch(
            f"SELECT {LOG_EVENT_SQL} FROM events WHERE seq > $1 AND seq <= $2 "
            "AND left(stream, $3) = $4 AND type = ANY($5::text[]) ORDER BY seq",
            after, upto, len(prefix), prefix, list(types),
        )
    else:
        rows = await conn.fetch(
            f"SELECT {LOG_EVENT_SQL} FROM events WHERE seq > $1 AND seq <= $2 "
            "AND left(stream, $3) = $4 ORDER BY seq",
            after, upto, len(prefix), prefix,
        )
    return [log_event_from_row(r) for r in rows]


async def read_stream_firsts(conn: Any, streams: Sequence[str]) -> list[LogEvent]:
    """The first event of each of `streams` that has one (in seq order)."""
    rows = await conn.fetch(
        f"SELECT {LOG_EVENT_SQL} FROM events WHERE stream = ANY($1::text[]) AND stream_seq = 1 ORDER BY seq",
        list(streams),
    )
    return [log_event_from_row(r) for r in rows]


async def read_stream_before(conn: Any, streams: Sequence[str], before: int) -> list[LogEvent]:
    """Every event of `streams` with seq < `before`, in seq order (to refold evicted state)."""
    rows = await conn.fetch(
        f"SELECT {LOG_EVENT_SQL} FROM events WHERE stream = ANY($1::text[]) AND seq < $2 ORDER BY seq",
        list(streams), before,
    )
    return [log_event_from_row(r) for r in rows]


# ------------------------------------------------------------------ one stream


async def read_stream(
    conn: Any,
    stream: str,
    *,
    since_stream_seq: int = 0,
    limit: int = 1000,
    to_seq: int | None = None,
) -> list[RecordedEvent]:
    args: list[Any] = [stream, since_stream_seq]
    extra = ""
    if to_seq is not None:
        args.append(to_seq)
        extra = " AND seq <= $3"
    rows = await conn.fetch(
        f"SELECT {EVENT_COLUMNS_SQL} FROM events WHERE stream = $1 AND stream_seq > $2{extra} "
        f"ORDER BY stream_seq LIMIT {int(limit)}",
        *args,
    )
    return [record_from_row(r) for r in rows]


async def stream_events(conn: Any, stream: str, *, to_seq: int | None = None) -> list[LogEvent]:
    """Every event of `stream` (up to global seq `to_seq`), in stream order, as a fold reads them."""
    args: list[Any] = [stream]
    extra = ""
    if to_seq is not None:
        args.append(to_seq)
        extra = " AND seq <= $2"
    rows = await conn.fetch(
        f"SELECT {LOG_EVENT_SQL} FROM events WHERE stream = $1{extra} ORDER BY stream_seq", *args)
    return [log_event_from_row(r) for r in rows]


async def stream_rows(conn: Any, stream: str, since_stream_seq: int, limit: int) -> list[Any]:
    """Rows (EVENT_ROW_SQL) of `stream` after `since_stream_seq`, in stream order."""
    rows: list[Any] = await conn.fetch(
        f"SELECT {EVENT_ROW_SQL} FROM events WHERE stream = $1 "
        f"AND stream_seq > $2 ORDER BY stream_seq LIMIT {int(limit)}", stream, since_stream_seq)
    return rows


async def stream_version(conn: Any, stream: str) -> int | None:
    """The last stream_seq of `stream`, None when it has no events."""
    v = await conn.fetchval("SELECT max(stream_seq) FROM events WHERE stream = $1", stream)
    return None if v is None else int(v)


async def stream_position(conn: Any, stream: str, stream_seq: int) -> tuple[int, int | None, int | None]:
    """In one snapshot: the head's seq, the last stream_seq of `stream` (None when
    it has no events) and the global seq of its event `stream_seq` (None when absent)."""
    row = await conn.fetchrow(
        f"SELECT {HEAD_SEQ_SQL} AS head, "
        "(SELECT max(stream_seq) FROM events WHERE stream = $1) AS last, "
        "(SELECT seq FROM events WHERE stream = $1 AND stream_seq = $2) AS at",
        stream, stream_seq,
    )
    assert row is not None
    return int(row["head"]), row["last"], row["at"]


# ------------------------------------------------------------------ time


async def recorded_at(conn: Any, seq: int) -> datetime | None:
    """When the event at `seq` was recorded (None when there is none)."""
    t: datetime | None = await conn.fetchval("SELECT recorded_at FROM events WHERE seq = $1", seq)
    return t


async def seq_at(conn: Any, when: datetime, head: int) -> tuple[int, str | None]:
    """The last seq (<= `head`) recorded at or before `when` (0 before the first
    event), and its recorded_at as the contract writes it."""
    # recorded_at is taken under the head lock, so it rises with seq: a binary
    # search over the primary key, a few dozen index look-ups at most.
    lo, hi = 0, head
    while lo < hi:
        mid = (lo + hi + 1) // 2
        t = await recorded_at(conn, mid)
        if t is not None and t <= when:
            lo = mid
        else:
            hi = mid - 1
    text = None if lo == 0 else await conn.fetchval(
        f"SELECT {RECORDED_AT_TEXT_SQL} FROM events WHERE seq = $1", lo)
    return lo, text
