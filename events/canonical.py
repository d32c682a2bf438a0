"""Canonical JSON and the hash chain.

The hash of an event is sha256 over the previous event's hash (hex) followed by
the canonical JSON of the event without its hash: keys sorted, no whitespace,
UTF-8, and every float that holds an integral value written as an integer.

That last rule exists because `data` and `meta` are stored as jsonb, which keeps
numbers as `numeric`: a payload written as `1e20` comes back as
`100000000000000000000`. Writing integral floats as integers makes the canonical
form of what we wrote equal to the canonical form of what we read back, so an
auditor can recompute the chain from the table, or from an export, alike.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import msgspec

GENESIS_HASH = "0" * 64

_encoder = msgspec.json.Encoder(order="sorted")


_PLAIN = frozenset({str, int, bool, type(None)})


def _normalise(value: Any) -> Any:
    t = type(value)
    if t in _PLAIN:  # the common leaves, by exact type: no isinstance chain per value
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return value
    if isinstance(value, dict):
        return {k: v if type(v) in _PLAIN else _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v if type(v) in _PLAIN else _normalise(v) for v in value]
    return value


def canonical_json(value: Any) -> bytes:
    return _encoder.encode(_normalise(value))


def format_ts(ts: datetime) -> str:
    """ISO 8601 in UTC with microseconds and a `Z`: the one spelling we hash."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def hash_event(
    prev_hash: str,
    *,
    seq: int,
    stream: str,
    stream_seq: int,
    type: str,
    data: Any,
    meta: Any,
    recorded_at: str,
    meta_json: bytes | None = None,
) -> tuple[str, str]:
    """(canonical JSON of `data`, the event's hash): the writer stores the one and
    chains the other, encoding the payload once. `meta_json`, when given, is
    `canonical_json(meta)` already encoded (one meta for many events)."""
    data_json = canonical_json(data)
    h = hashlib.sha256()
    h.update(prev_hash.encode("ascii"))
    h.update(_envelope(seq, stream, stream_seq, type, data_json,
                       canonical_json(meta) if meta_json is None else meta_json, recorded_at))
    return data_json.decode(), h.hexdigest()


def _envelope(
    seq: int, stream: str, stream_seq: int, type: str, data_json: bytes, meta_json: bytes, recorded_at: str
) -> bytes:
    # The canonical JSON of the whole event, assembled from already-canonical
    # parts; keys in sorted order: data, meta, recorded_at, seq, stream,
    # stream_seq, type.
    return b"".join((
        b'{"data":', data_json, b',"meta":', meta_json,
        b',"recorded_at":', _encoder.encode(recorded_at), b',"seq":', str(seq).encode(),
        b',"stream":', _encoder.encode(stream), b',"stream_seq":', str(stream_seq).encode(),
        b',"type":', _encoder.encode(type), b"}",
    ))


def event_hash(
    prev_hash: str,
    *,
    seq: int,
    stream: str,
    stream_seq: int,
    type: str,
    data: Any,
    meta: Any,
    recorded_at: str,
) -> str:
    return hash_event(prev_hash, seq=seq, stream=stream, stream_seq=stream_seq, type=type, data=data,
                      meta=meta, recorded_at=recorded_at)[1]


def verify_chain(events: Any, prev_hash: str = GENESIS_HASH) -> tuple[bool, int | None, str]:
    """Recompute the chain over `events` (dicts in seq order).

    Returns (ok, first_bad_seq, last_good_hash). A gap in seq counts as bad.
    """
    expected_seq: int | None = None
    for ev in events:
        seq = ev["seq"]
        if expected_seq is not None and seq != expected_seq:
            return False, seq, prev_hash
        h = event_hash(
            prev_hash,
            seq=seq,
            stream=ev["stream"],
            stream_seq=ev["stream_seq"],
            type=ev["type"],
            data=ev["data"],
            meta=ev["meta"],
            recorded_at=ev["recorded_at"],
        )
        if h != ev["hash"]:
            return False, seq, prev_hash
        prev_hash = h
        expected_seq = seq + 1
    return True, None, prev_hash
