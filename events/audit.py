"""Proving the log: the hash chain's rules, over an export or (through
`taskledger.log.audit`) over the table.

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
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from taskledger.events.canonical import GENESIS_HASH, event_hash

CHECKPOINT_STREAM: Final = "audit"
CHECKPOINT_TYPE: Final = "audit.checkpoint"

FORMAT_VERSION: Final = 1

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


def is_checkpoint(ev: dict[str, Any]) -> bool:
    return ev.get("type") == CHECKPOINT_TYPE and ev.get("stream") == CHECKPOINT_STREAM


def check_link(ev: dict[str, Any], prev: str, key: Ed25519PublicKey | None) -> str | None:
    """A checkpoint in the log names the event before it, and (with a key) is signed."""
    data = ev["data"]
    if data.get("covers_seq") != ev["seq"] - 1 or data.get("covers_hash") != prev:
        return f"the checkpoint at seq {ev['seq']} does not match the chain before it"
    return None if key is None else check_checkpoint(data, key)


def check_one(ev: Any, expected_seq: int, prev: str) -> str | None:
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
        bad = check_one(obj, expected, prev)
        if bad is not None:
            return fail(n, expected if bad == "gap" else seq, f"line {n}: {bad}")
        if is_checkpoint(obj):
            why = check_link(obj, prev, public_key)
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
