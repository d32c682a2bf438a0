"""How an event row is selected, and what a read turns it into."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from taskledger.events.canonical import format_ts


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    data: dict[str, Any]


class RecordedEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    stream: str
    stream_seq: int
    type: str
    data: dict[str, Any]
    meta: dict[str, Any]
    recorded_at: str
    hash: str

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class LogEvent(msgspec.Struct, frozen=True, array_like=True):
    """One event as a fold reads it: the payload stays JSON text until the fold decodes it."""

    seq: int
    stream: str
    stream_seq: int
    type: str
    data: str
    recorded_at: str


# The JSON object clients receive: the database splices the stored parts into
# text around the timestamp (plain concatenation; json_build_object and to_char
# made reading a feed three times slower than reading the rows), and Python adds
# the timestamp, formatted once per batch of events that share it.
EVENT_ROW_SQL: Final = """seq, stream_seq, type, stream, meta->>'project' AS project,
    '{"seq":' || seq || ',"stream":' || to_json(stream)::text || ',"stream_seq":' || stream_seq
        || ',"type":' || to_json(type)::text || ',"data":' || data::text || ',"meta":' || meta::text
        || ',"recorded_at":"' AS head,
    recorded_at,
    '","hash":"' || hash || '"}' AS tail"""

_last_ts: list[Any] = [None, ""]


def event_json(row: Any) -> str:
    """The contract's event object for a row selected with EVENT_ROW_SQL."""
    ts = row[6]
    if ts != _last_ts[0]:
        _last_ts[0], _last_ts[1] = ts, format_ts(ts)
    return f"{row[5]}{_last_ts[1]}{row[7]}"


# recorded_at as the contract writes it (microseconds, UTC, 'Z')
RECORDED_AT_TEXT_SQL: Final = """to_char(recorded_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""

EVENT_COLUMNS_SQL: Final = f"""seq, stream, stream_seq, type, data::text AS data, meta::text AS meta,
    {RECORDED_AT_TEXT_SQL} AS recorded_at, hash"""

LOG_EVENT_SQL: Final = f"""seq, stream, stream_seq, type, data::text AS data,
    {RECORDED_AT_TEXT_SQL} AS recorded_at"""
"""The columns of a `LogEvent`, in its order."""

def record_from_row(row: Any) -> RecordedEvent:
    return RecordedEvent(
        seq=row["seq"],
        stream=row["stream"],
        stream_seq=row["stream_seq"],
        type=row["type"],
        data=msgspec.json.decode(row["data"]),
        meta=msgspec.json.decode(row["meta"]),
        recorded_at=row["recorded_at"],
        hash=row["hash"],
    )


def log_event_from_row(row: Any) -> LogEvent:
    return LogEvent(row[0], row[1], row[2], row[3], row[4], row[5])
