"""The audit chain as stored: verifying and exporting the table, appending signed checkpoints.

The rules (hashing, signing, checking a link or a file) are pure and live in
`taskledger.events.audit`; this module reads and writes the log for them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any, Final

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from taskledger.events.actor import system_meta
from taskledger.events.audit import (
    CHECKPOINT_STREAM,
    CHECKPOINT_TYPE,
    VerifyResult,
    check_link,
    check_one,
    checkpoint_data,
    checkpoint_due,
    compact,
    header_line,
    is_checkpoint,
    trailer_line,
)
from taskledger.events.canonical import GENESIS_HASH
from taskledger.log.appending import ANY, LogTx
from taskledger.log.position import HEAD_SEQ_SQL, head
from taskledger.log.reads import event_json_pages
from taskledger.log.records import EVENT_ROW_SQL, NewEvent, RecordedEvent, event_json

PAGE: Final = 5_000

_dec = msgspec.json.Decoder()

_LAST_CHECKPOINT: Final = ("SELECT seq, recorded_at FROM events WHERE stream = $1 "
                           "ORDER BY stream_seq DESC LIMIT 1")


async def append_checkpoint(
    log: LogTx, key: Ed25519PrivateKey, *, every_events: int = 0, every_seconds: float = 0,
    started_at: datetime | None = None,
) -> RecordedEvent | None:
    """Append a checkpoint over the head, inside the caller's transaction (which
    holds the head lock, so replicas checking at once take turns and the second
    sees the first's checkpoint). With neither `every_*` given it always
    appends; else only when that many events or seconds passed since the last
    one, and never over a head that is itself a checkpoint."""
    if every_events or every_seconds:
        last = await log.conn.fetchrow(_LAST_CHECKPOINT, CHECKPOINT_STREAM)
        last_seq, last_at = (None, None) if last is None else (int(last["seq"]), last["recorded_at"])
        if not checkpoint_due(log.head_seq, last_seq, last_at, log.now, every_events, every_seconds,
                              started_at or log.now):
            return None
    data = checkpoint_data(key, log.head_seq, log.head_hash)
    (ev,) = await log.append(CHECKPOINT_STREAM, [NewEvent(type=CHECKPOINT_TYPE, data=data)],
                             expected_version=ANY, meta=system_meta())
    return ev


async def checkpoint_look(conn: Any) -> tuple[int, int | None, datetime | None]:
    """(head, last checkpoint's seq, its time): a cheap look outside the head lock."""
    row = await conn.fetchrow(
        f"SELECT {HEAD_SEQ_SQL} AS head, c.seq, c.recorded_at FROM "
        "(SELECT 1) AS one LEFT JOIN LATERAL (SELECT seq, recorded_at FROM events WHERE stream = $1 "
        "ORDER BY stream_seq DESC LIMIT 1) AS c ON true", CHECKPOINT_STREAM)
    return int(row["head"]), row["seq"], row["recorded_at"]


async def last_checkpoint(conn: Any) -> tuple[str | None, int]:
    """The last checkpoint's event JSON (None when there is none) and how many there are."""
    last = await conn.fetchrow(
        f"SELECT {EVENT_ROW_SQL} FROM events WHERE stream = $1 AND type = $2 "
        "ORDER BY stream_seq DESC LIMIT 1", CHECKPOINT_STREAM, CHECKPOINT_TYPE)
    if last is None:
        return None, 0
    count = await conn.fetchval("SELECT count(*) FROM events WHERE stream = $1 AND type = $2",
                                CHECKPOINT_STREAM, CHECKPOINT_TYPE)
    return event_json(last), int(count)


async def _anchor(conn: Any, from_seq: int) -> str | None:
    if from_seq <= 1:
        return GENESIS_HASH
    h = await conn.fetchval("SELECT hash FROM events WHERE seq = $1", from_seq - 1)
    return None if h is None else str(h)


async def verify_table(
    conn: Any, from_seq: int = 1, to_seq: int | None = None, public_key: Ed25519PublicKey | None = None,
) -> VerifyResult:
    """Recompute the chain over events[from_seq..to_seq] (to the head by default), in pages.

    A missing seq counts as the first bad one. When the range reaches the head,
    the head row's hash must equal the recomputed one.
    """
    head_seq, head_hash = await head(conn)
    from_seq = max(from_seq, 1)
    to = head_seq if to_seq is None else min(to_seq, head_seq)
    res = VerifyResult(ok=True, head_seq=head_seq, head_hash=head_hash, first_bad_seq=None,
                       from_seq=from_seq, to_seq=to, checked=0)
    prev = await _anchor(conn, from_seq)
    if prev is None:
        res.ok, res.first_bad_seq, res.reason = False, from_seq - 1, f"event {from_seq - 1} is missing"
        return res
    expected = from_seq
    async for page in event_json_pages(conn, from_seq, to, PAGE):
        for text in page:
            ev = _dec.decode(text)
            bad = check_one(ev, expected, prev)
            if bad is None and is_checkpoint(ev):
                bad = check_link(ev, prev, public_key)
                res.checkpoints += bad is None
            if bad is not None:
                res.ok, res.first_bad_seq, res.reason = False, expected if bad == "gap" else ev["seq"], bad
                return res
            prev = ev["hash"]
            expected += 1
            res.checked += 1
    if expected <= to:
        res.ok, res.first_bad_seq, res.reason = False, expected, f"event {expected} is missing"
    elif to == head_seq and head_seq > 0 and prev != head_hash:
        res.ok, res.first_bad_seq, res.reason = False, head_seq, "log_head's hash differs from the chain"
    return res


async def export_lines(conn: Any, from_seq: int = 1, to_seq: int | None = None) -> AsyncIterator[str]:
    """The export file (see `taskledger.events.audit`), a line at a time."""
    head_seq = (await head(conn)).seq
    from_seq = max(from_seq, 1)
    to = head_seq if to_seq is None else min(to_seq, head_seq)
    prev = await _anchor(conn, from_seq)
    if prev is None:
        raise ValueError(f"event {from_seq - 1} is missing: the export has no anchor")
    yield header_line(from_seq, to, prev)
    count, last_seq, last_hash = 0, None, prev
    async for page in event_json_pages(conn, from_seq, to, PAGE):
        for text in page:
            line = compact(text)
            ev = _dec.decode(line)
            count, last_seq, last_hash = count + 1, ev["seq"], ev["hash"]
            yield line
    yield trailer_line(count, last_seq, last_hash)
