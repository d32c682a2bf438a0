"""Proving the log: recompute its hash chain from the table or from an export.

Export format (docs/AUDIT.md): JSON lines. The first line is a header
``{"taskledger_audit": 1, "from_seq", "to_seq", "prev_hash"}`` — `prev_hash` is
the hash of the event before `from_seq` (64 zeros from seq 1), the anchor a
partial export chains from. Then one event per line, exactly the contract's
event JSON with its `hash`. The last line is a trailer
``{"taskledger_audit_end": {"count", "last_seq", "last_hash"}}``, so a
truncated file is told apart from a short log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

import msgspec

from events.canonical import GENESIS_HASH, event_hash
from events.store import EVENT_ROW_SQL, event_json

FORMAT_VERSION: Final = 1
PAGE: Final = 5_000

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


class VerifyResult(msgspec.Struct, kw_only=True):
    ok: bool
    head_seq: int
    head_hash: str
    first_bad_seq: int | None
    from_seq: int
    to_seq: int
    checked: int
    reason: str | None = None


async def _anchor(conn: Any, from_seq: int) -> str | None:
    if from_seq <= 1:
        return GENESIS_HASH
    h = await conn.fetchval("SELECT hash FROM events WHERE seq = $1", from_seq - 1)
    return None if h is None else str(h)


async def event_pages(conn: Any, from_seq: int, to_seq: int, page: int = PAGE) -> AsyncIterator[list[str]]:
    """The contract's event JSON (text) for seqs from_seq..to_seq, a page at a time."""
    pos = from_seq - 1
    while pos < to_seq:
        end = min(pos + page, to_seq)
        rows = await conn.fetch(
            f"SELECT {EVENT_ROW_SQL} FROM events WHERE seq > $1 AND seq <= $2 ORDER BY seq", pos, end)
        yield [event_json(r) for r in rows]
        pos = end


async def verify_table(conn: Any, from_seq: int = 1, to_seq: int | None = None) -> VerifyResult:
    """Recompute the chain over events[from_seq..to_seq] (to the head by default), in pages.

    A missing seq counts as the first bad one. When the range reaches the head,
    the head row's hash must equal the recomputed one.
    """
    row = await conn.fetchrow("SELECT seq, hash FROM log_head WHERE id = 1")
    head, head_hash = int(row["seq"]), str(row["hash"])
    from_seq = max(from_seq, 1)
    to = head if to_seq is None else min(to_seq, head)
    res = VerifyResult(ok=True, head_seq=head, head_hash=head_hash, first_bad_seq=None,
                       from_seq=from_seq, to_seq=to, checked=0)
    prev = await _anchor(conn, from_seq)
    if prev is None:
        res.ok, res.first_bad_seq, res.reason = False, from_seq - 1, f"event {from_seq - 1} is missing"
        return res
    expected = from_seq
    async for page in event_pages(conn, from_seq, to):
        for text in page:
            ev = _dec.decode(text)
            bad = _check_one(ev, expected, prev)
            if bad is not None:
                res.ok, res.first_bad_seq, res.reason = False, expected if bad == "gap" else ev["seq"], bad
                return res
            prev = ev["hash"]
            expected += 1
            res.checked += 1
    if expected <= to:
        res.ok, res.first_bad_seq, res.reason = False, expected, f"event {expected} is missing"
    elif to == head and head > 0 and prev != head_hash:
        res.ok, res.first_bad_seq, res.reason = False, head, "log_head's hash differs from the chain"
    return res


def _check_one(ev: Any, expected_seq: int, prev: str) -> str | None:
    """None when `ev` is the next link after `prev`, else why not."""
    if ev.get("seq") != expected_seq:
        return "gap"
    try:
        h = event_hash(prev, seq=ev["seq"], stream=ev["stream"], stream_seq=ev["stream_seq"],
                       type=ev["type"], data=ev["data"], meta=ev["meta"], recorded_at=ev["recorded_at"])
    except (KeyError, TypeError) as e:
        return f"event {expected_seq} is malformed: {e!r}"
    if h != ev.get("hash"):
        return f"event {expected_seq}: hash does not match its content and predecessor"
    return None


# ------------------------------------------------------------------ export files


def header_line(from_seq: int, to_seq: int, prev_hash: str) -> str:
    return _enc.encode({"taskledger_audit": FORMAT_VERSION, "from_seq": from_seq, "to_seq": to_seq,
                        "prev_hash": prev_hash}).decode()


def trailer_line(count: int, last_seq: int | None, last_hash: str) -> str:
    return _enc.encode({"taskledger_audit_end": {"count": count, "last_seq": last_seq,
                                                 "last_hash": last_hash}}).decode()


def compact(event_json: str) -> str:
    """One event JSON object on one line, keys in the contract's order."""
    return _enc.encode(_dec.decode(event_json)).decode()


async def export_lines(conn: Any, from_seq: int = 1, to_seq: int | None = None) -> AsyncIterator[str]:
    head = int(await conn.fetchval("SELECT seq FROM log_head WHERE id = 1"))
    from_seq = max(from_seq, 1)
    to = head if to_seq is None else min(to_seq, head)
    prev = await _anchor(conn, from_seq)
    if prev is None:
        raise ValueError(f"event {from_seq - 1} is missing: the export has no anchor")
    yield header_line(from_seq, to, prev)
    count, last_seq, last_hash = 0, None, prev
    async for page in event_pages(conn, from_seq, to):
        for text in page:
            line = compact(text)
            ev = _dec.decode(line)
            count, last_seq, last_hash = count + 1, ev["seq"], ev["hash"]
            yield line
    yield trailer_line(count, last_seq, last_hash)


class FileVerdict(msgspec.Struct, kw_only=True):
    ok: bool
    count: int
    first_seq: int | None
    last_seq: int | None
    last_hash: str | None
    first_bad_seq: int | None = None
    line: int | None = None
    reason: str | None = None


def verify_lines(lines: Iterable[str]) -> FileVerdict:
    """Recompute the chain of an export (see the module docstring for the format)."""
    out = FileVerdict(ok=True, count=0, first_seq=None, last_seq=None, last_hash=None)
    prev: str | None = None
    expected: int | None = None
    header: dict[str, Any] | None = None
    trailer: dict[str, Any] | None = None
    n = 0

    def fail(n: int, seq: int | None, reason: str) -> FileVerdict:
        out.ok, out.line, out.first_bad_seq, out.reason = False, n, seq, reason
        return out

    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if trailer is not None:
            return fail(n, None, "content after the trailer")
        try:
            obj = _dec.decode(raw)
        except msgspec.DecodeError as e:
            return fail(n, expected, f"line {n} is not JSON: {e}")
        if not isinstance(obj, dict):
            return fail(n, expected, f"line {n} is not a JSON object")
        if "taskledger_audit" in obj:
            if n != 1 or header is not None:
                return fail(n, None, "a header line that is not the first line")
            header = obj
            prev, expected = str(obj.get("prev_hash")), int(obj.get("from_seq", 1))
            continue
        if "taskledger_audit_end" in obj:
            trailer = obj["taskledger_audit_end"]
            continue
        seq = obj.get("seq")
        if prev is None:
            if seq != 1:
                return fail(n, seq if isinstance(seq, int) else None,
                            f"the file starts at seq {seq} without a header giving the previous hash")
            prev, expected = GENESIS_HASH, 1
        assert expected is not None
        bad = _check_one(obj, expected, prev)
        if bad is not None:
            return fail(n, expected if bad == "gap" else seq, f"line {n}: {bad}")
        if out.first_seq is None:
            out.first_seq = seq
        prev, out.last_seq, out.last_hash = obj["hash"], seq, obj["hash"]
        expected += 1
        out.count += 1
    if header is not None:
        if trailer is None:
            return fail(n if out.count else 1, expected, "no trailer: the file is truncated")
        last = out.last_hash or header["prev_hash"]
        if trailer.get("count") != out.count or trailer.get("last_hash") != last:
            return fail(n, expected, "the trailer does not match the events (lines missing or added)")
        if out.count and out.last_seq != header.get("to_seq"):
            return fail(n, expected, "the events end before the header's to_seq")
    return out
