"""Proving the log: recompute its hash chain from the table or from an export.

Export format (docs/AUDIT.md): JSON lines. The first line is a header
``{"taskledger_audit": 1, "from_seq", "to_seq", "prev_hash"}`` — `prev_hash` is
the hash of the event before `from_seq` (64 zeros from seq 1), the anchor a
partial export chains from. Then one event per line, exactly the contract's
event JSON with its `hash`. The last line is a trailer
``{"taskledger_audit_end": {"count", "last_seq", "last_hash"}}``, so a
truncated file is told apart from a short log.

Signed checkpoints
------------------
A hash chain proves nothing to someone who may rewrite the whole table: disable
the triggers, change an event, recompute every later hash and `log_head`. So
the service appends `audit.checkpoint` events on stream `audit`, each signing
with an Ed25519 key the database never sees the (seq, hash) of the event just
before it. A rewrite before a checkpoint then breaks either the chain through
the checkpoint or its signature. Cutting the tail off the log (a valid prefix)
is caught by a checkpoint kept outside the database (`taskledger audit
checkpoint` prints one): the export must reach it and pass through it.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator, Iterable
from datetime import datetime, timedelta
from typing import Any, Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from taskledger.events.actor import system_meta
from taskledger.events.canonical import GENESIS_HASH, event_hash
from taskledger.events.store import ANY, EVENT_ROW_SQL, LogTx, NewEvent, RecordedEvent, event_json

CHECKPOINT_STREAM: Final = "audit"
CHECKPOINT_TYPE: Final = "audit.checkpoint"

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
    checkpoints: int = 0  # signed checkpoints on the way, each checked


# ------------------------------------------------------------------ checkpoints


def public_key_text(key: Ed25519PublicKey) -> str:
    """The public key as published (GET /audit/key): base64 of its 32 raw bytes."""
    return base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def key_id(key: Ed25519PublicKey) -> str:
    return hashlib.sha256(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).hexdigest()[:16]


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A public key as GET /audit/key publishes it (base64 of 32 bytes); ValueError if it is not one."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except ValueError as e:
        raise ValueError("the public key is not base64") from e
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, not {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _message(covers_seq: int, covers_hash: str) -> bytes:
    return f"taskledger-checkpoint:v1:{covers_seq}:{covers_hash}".encode()


def checkpoint_data(key: Ed25519PrivateKey, covers_seq: int, covers_hash: str) -> dict[str, Any]:
    return {"covers_seq": covers_seq, "covers_hash": covers_hash, "key_id": key_id(key.public_key()),
            "signature": base64.b64encode(key.sign(_message(covers_seq, covers_hash))).decode()}


def check_checkpoint(data: Any, key: Ed25519PublicKey) -> str | None:
    """None when `data` is a checkpoint signed by `key`, else why not."""
    try:
        covers_seq, covers_hash, sig = data["covers_seq"], data["covers_hash"], data["signature"]
        if not isinstance(covers_seq, int) or not isinstance(covers_hash, str) or not isinstance(sig, str):
            return "a checkpoint needs covers_seq (int), covers_hash and signature (strings)"
        key.verify(base64.b64decode(sig, validate=True), _message(covers_seq, covers_hash))
    except (KeyError, TypeError):
        return "a checkpoint needs covers_seq, covers_hash and signature"
    except (ValueError, InvalidSignature):
        return f"the checkpoint over seq {data.get('covers_seq')} is not signed by this key"
    return None


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
        last = await log.conn.fetchrow(
            "SELECT seq, recorded_at FROM events WHERE stream = $1 ORDER BY stream_seq DESC LIMIT 1",
            CHECKPOINT_STREAM)
        last_seq, last_at = (None, None) if last is None else (int(last["seq"]), last["recorded_at"])
        if not checkpoint_due(log.head_seq, last_seq, last_at, log.now, every_events, every_seconds,
                              started_at or log.now):
            return None
    data = checkpoint_data(key, log.head_seq, log.head_hash)
    (ev,) = await log.append(CHECKPOINT_STREAM, [NewEvent(type=CHECKPOINT_TYPE, data=data)],
                             expected_version=ANY, meta=system_meta())
    return ev


def checkpoint_due_sql() -> str:
    """(head, last checkpoint's seq, its time): a cheap look outside the head lock."""
    return ("SELECT (SELECT seq FROM log_head WHERE id = 1) AS head, c.seq, c.recorded_at FROM "
            "(SELECT 1) AS one LEFT JOIN LATERAL (SELECT seq, recorded_at FROM events WHERE stream = 'audit' "
            "ORDER BY stream_seq DESC LIMIT 1) AS c ON true")


def checkpoint_due(head: int, last_seq: int | None, last_at: datetime | None, now: datetime,
                   every_events: int, every_seconds: float, started_at: datetime) -> bool:
    """Whether `every_events` events or `every_seconds` seconds passed since the
    last checkpoint (before the first one: since seq 0 and `started_at`)."""
    if last_seq is None or last_at is None:
        last_seq, last_at = 0, started_at
    if head <= last_seq:
        return False
    return bool((every_events and head - last_seq >= every_events)
                or (every_seconds and now - last_at >= timedelta(seconds=every_seconds)))


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


async def verify_table(
    conn: Any, from_seq: int = 1, to_seq: int | None = None, public_key: Ed25519PublicKey | None = None,
) -> VerifyResult:
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
            if bad is None and is_checkpoint(ev):
                bad = _check_link(ev, prev, public_key)
                res.checkpoints += bad is None
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


def is_checkpoint(ev: dict[str, Any]) -> bool:
    return ev.get("type") == CHECKPOINT_TYPE and ev.get("stream") == CHECKPOINT_STREAM


def _check_link(ev: dict[str, Any], prev: str, key: Ed25519PublicKey | None) -> str | None:
    """A checkpoint in the log names the event before it, and (with a key) is signed."""
    data = ev["data"]
    if data.get("covers_seq") != ev["seq"] - 1 or data.get("covers_hash") != prev:
        return f"the checkpoint at seq {ev['seq']} does not match the chain before it"
    return None if key is None else check_checkpoint(data, key)


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
    malformed: bool = False  # the file is not an export at all (exit 2), rather than a broken one
    checkpoints: int = 0  # signed checkpoints inside the file that were checked
    external_checkpoints: int = 0  # given checkpoints the export passed through


class _Malformed(Exception):
    pass


def _int(obj: dict[str, Any], key: str, default: int | None = None) -> int:
    v = obj.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise _Malformed(f"{key} must be an integer, not {v!r}")
    return v


def _hash(v: Any, what: str) -> str:
    if not isinstance(v, str) or len(v) != 64:
        raise _Malformed(f"{what} must be a 64-character hex hash, not {v!r}")
    return v


def _event(obj: dict[str, Any]) -> int:
    for k, t in (("seq", int), ("stream", str), ("stream_seq", int), ("type", str), ("data", dict),
                 ("meta", dict), ("recorded_at", str), ("hash", str)):
        if not isinstance(obj.get(k), t):
            raise _Malformed(f"an event needs {k} ({t.__name__}); this object has {obj.get(k)!r}")
    return int(obj["seq"])


def parse_checkpoints(lines: Iterable[str], key: Ed25519PublicKey) -> list[tuple[int, str, int, str]]:
    """Checkpoints kept outside the database (JSON lines as `taskledger audit
    checkpoint` prints them): (covers_seq, covers_hash, seq, hash) each, after
    checking each signature. ValueError names the first bad one."""
    out = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = _dec.decode(raw)
        except msgspec.DecodeError as e:
            raise ValueError(f"checkpoint line {n} is not JSON: {e}") from e
        if not isinstance(obj, dict) or obj.get("type") != CHECKPOINT_TYPE or not isinstance(obj.get("data"), dict):
            raise ValueError(f"checkpoint line {n} is not an {CHECKPOINT_TYPE} event")
        try:
            seq, h = _event(obj), _hash(obj["hash"], "hash")
        except _Malformed as e:
            raise ValueError(f"checkpoint line {n}: {e}") from e
        bad = check_checkpoint(obj["data"], key)
        if bad is not None:
            raise ValueError(f"checkpoint line {n}: {bad}")
        out.append((int(obj["data"]["covers_seq"]), str(obj["data"]["covers_hash"]), seq, h))
    return out


def verify_lines(
    lines: Iterable[str], *, public_key: Ed25519PublicKey | None = None,
    checkpoints: Iterable[tuple[int, str, int, str]] = (),
) -> FileVerdict:
    """Recompute the chain of an export (see the module docstring for the format).

    With `public_key`, every checkpoint in the file must carry its signature;
    every checkpoint, with a key or not, must name the (seq, hash) the chain
    passes through just before it. `checkpoints` (from parse_checkpoints) are
    ones kept outside the database: the chain must pass through each one the
    export's range covers, and the export must not stop short of any.
    """
    out = FileVerdict(ok=True, count=0, first_seq=None, last_seq=None, last_hash=None)
    given: dict[int, str] = {}
    for covers_seq, covers_hash, seq, h in checkpoints:
        given[covers_seq], given[seq] = covers_hash, h
    prev: str | None = None
    expected: int | None = None
    header: dict[str, Any] | None = None
    trailer: dict[str, Any] | None = None
    n = 0

    def fail(n: int, seq: int | None, reason: str, malformed: bool = False) -> FileVerdict:
        out.ok, out.line, out.first_bad_seq, out.reason, out.malformed = False, n, seq, reason, malformed
        return out

    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if trailer is not None:
            return fail(n, None, "content after the trailer")
        try:
            obj = _dec.decode(raw)
        except msgspec.DecodeError as e:
            return fail(n, expected, f"line {n} is not JSON: {e}", malformed=True)
        if not isinstance(obj, dict):
            return fail(n, expected, f"line {n} is not a JSON object", malformed=True)
        try:
            if "taskledger_audit" in obj:
                if n != 1 or header is not None:
                    return fail(n, None, "a header line that is not the first line", malformed=True)
                header = obj
                prev, expected = _hash(obj.get("prev_hash"), "the header's prev_hash"), _int(obj, "from_seq", 1)
                _int(obj, "to_seq")
                if expected - 1 in given and given[expected - 1] != prev:
                    return fail(n, expected - 1, f"the export's anchor is not the chain of checkpoint "
                                                 f"{expected - 1}: the log was rewritten")
                continue
            if "taskledger_audit_end" in obj:
                trailer = obj["taskledger_audit_end"]
                if not isinstance(trailer, dict):
                    return fail(n, None, "the trailer is not a JSON object", malformed=True)
                continue
            seq = _event(obj)
        except _Malformed as e:
            return fail(n, expected, f"line {n}: {e}", malformed=True)
        if prev is None:
            if seq != 1:
                return fail(n, seq, f"the file starts at seq {seq} without a header giving the previous hash")
            prev, expected = GENESIS_HASH, 1
        assert expected is not None
        bad = _check_one(obj, expected, prev)
        if bad is not None:
            return fail(n, expected if bad == "gap" else seq, f"line {n}: {bad}")
        if is_checkpoint(obj):
            why = _check_link(obj, prev, public_key)
            if why is not None:
                return fail(n, seq, f"line {n}: {why}")
            out.checkpoints += public_key is not None
        if seq in given:
            if given.pop(seq) != obj["hash"]:
                return fail(n, seq, f"line {n}: the chain does not pass through the given checkpoint at "
                                    f"seq {seq}: the log was rewritten")
            out.external_checkpoints += 1
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
    short = sorted(s for s in given if out.last_seq is None or s > out.last_seq)
    if short:
        return fail(n, short[0], f"the export stops at seq {out.last_seq} but a given checkpoint covers seq "
                                 f"{short[0]}: events were cut off the log")
    return out
