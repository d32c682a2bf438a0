"""The canonical JSON the hash chain is computed over: one spelling, however it was reached."""

from __future__ import annotations

from taskledger.events.canonical import canonical_json, hash_event

PAYLOAD = {"b": [1.0, 2.5, True, None, ("x", {"z": 3.0, "a": False})], "a": {"n": 1e20, "s": "é"}, "i": 7}


def test_integral_floats_are_integers_at_every_depth_and_keys_are_sorted() -> None:
    assert canonical_json(PAYLOAD) == (
        '{"a":{"n":100000000000000000000,"s":"é"},"b":[1,2.5,true,null,["x",{"a":false,"z":3}]],"i":7}'
    ).encode()


def test_a_meta_encoded_once_chains_the_same_hash_as_one_encoded_per_event() -> None:
    meta = {"actor": "w", "node": "n1", "ratio": 2.0}
    kw = {"seq": 3, "stream": "task:T", "stream_seq": 1, "type": "task.started", "data": PAYLOAD,
          "recorded_at": "2026-11-24T20:00:00.000000Z"}
    assert hash_event("0" * 64, meta=meta, meta_json=canonical_json(meta), **kw) == hash_event(
        "0" * 64, meta=meta, **kw)
