"""Signed checkpoints: a database owner who rewrites and re-chains the log, or cuts
its tail and resets the head to a valid prefix, is caught."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from litestar.testing import AsyncTestClient

from taskledger import log as store
from taskledger.events import audit
from taskledger.events.canonical import event_hash
from taskledger.service.cli.main import main as cli
from taskledger.service.http.app import create_app
from tests.conftest import AUDIT_KEY, AppHarness, settings_for


async def _tasks(h: AppHarness, prefix: str, n: int) -> None:
    for i in range(n):
        r = await h.admin.post("/tasks", {"id": f"{prefix}-{i}", "project": "audit", "title": "t",
                                          "verification": None})
        assert r.status_code == 201, r.text


async def _public_key(h: AppHarness) -> str:
    body = (await h.admin.get("/audit/key")).json()
    assert body["algorithm"] == "Ed25519" and len(body["key_id"]) == 16
    return str(body["public_key"])


def _cli(*args: str) -> int:
    os.environ["TASKLEDGER_AUDIT_KEY"] = str(AUDIT_KEY)
    try:
        return cli(list(args))
    finally:
        os.environ.pop("TASKLEDGER_AUDIT_KEY", None)


async def _export(db_url: str, path: Path) -> Path:
    assert await asyncio.to_thread(_cli, "audit", "export", "--database-url", db_url, "-o", str(path)) == 0
    return path


async def _rewrite_and_rechain(pool: asyncpg.Pool, seq: int, *, forge_checkpoints: bool) -> None:
    """As the database owner: change event `seq`, recompute every later hash (and,
    if asked, the hashes the checkpoints name), and move log_head along."""
    async with pool.acquire() as c, c.transaction():
        await c.execute("SET LOCAL session_replication_role = replica")  # triggers off
        await c.execute("UPDATE events SET data = jsonb_set(data, '{title}', '\"rewritten\"') WHERE seq = $1", seq)
        prev = await c.fetchval("SELECT hash FROM events WHERE seq = $1", seq - 1)
        for ev in await store.read(c, since_seq=seq - 1, limit=100_000):
            data = dict(ev.data)
            if forge_checkpoints and ev.type == audit.CHECKPOINT_TYPE:
                data["covers_hash"] = prev
                await c.execute("UPDATE events SET data = $1::jsonb WHERE seq = $2", json.dumps(data), ev.seq)
            h = event_hash(prev, seq=ev.seq, stream=ev.stream, stream_seq=ev.stream_seq, type=ev.type,
                           data=data, meta=ev.meta, recorded_at=ev.recorded_at)
            await c.execute("UPDATE events SET hash = $1 WHERE seq = $2", h, ev.seq)
            prev = h
        await c.execute("UPDATE log_head SET hash = $1 WHERE id = 1", prev)


async def test_the_service_appends_signed_checkpoints_every_n_events(db_url: str, tmp_path: Path) -> None:
    app = create_app(settings_for(db_url, audit_checkpoint_every_events=5, audit_checkpoint_every_seconds=0))
    async with AsyncTestClient(app=app, timeout=30) as http:
        h = AppHarness(http, app)
        await _tasks(h, "A", 12)
        await asyncio.sleep(2.5)
        key = await _public_key(h)
        verdict = (await h.admin.get("/audit/verify")).json()
        assert verdict["ok"] is True and verdict["checkpoints"] >= 2, verdict
    out = await _export(db_url, tmp_path / "log.jsonl")
    assert await asyncio.to_thread(_cli, "audit", "verify", str(out), "--public-key", key) == 0
    cps = [json.loads(ln) for ln in out.read_text().splitlines() if '"audit.checkpoint"' in ln]
    assert len(cps) >= 2
    assert all(cp["data"]["covers_seq"] == cp["seq"] - 1 for cp in cps)


async def test_replicas_checkpointing_together_append_no_storm(db_url: str) -> None:
    every = 5
    settings = settings_for(db_url, audit_checkpoint_every_events=every, audit_checkpoint_every_seconds=0)
    apps = [create_app(settings) for _ in range(3)]
    async with AsyncTestClient(app=apps[0], timeout=30) as a, AsyncTestClient(app=apps[1], timeout=30) as b, \
            AsyncTestClient(app=apps[2], timeout=30) as c:
        replicas = [AppHarness(http, app) for http, app in zip((a, b, c), apps, strict=True)]
        for round_ in range(4):
            await asyncio.gather(*(_tasks(h, f"R{round_}-{i}", 4) for i, h in enumerate(replicas)))
            await asyncio.sleep(1.3)
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch("SELECT seq, data FROM events WHERE type = 'audit.checkpoint' ORDER BY seq")
    finally:
        await conn.close()
    cps = [(r["seq"], json.loads(r["data"])["covers_seq"]) for r in rows]
    assert len(cps) >= 4, cps  # 48 task events: due several times
    assert len(cps) <= 48 // every + 1, cps
    # each checkpoint comes at least `every` events after the one before: no replica doubled one
    assert all(later[1] - earlier[0] >= every for earlier, later in itertools.pairwise(cps)), cps


@pytest.mark.parametrize("forge", [False, True])
async def test_a_rewritten_and_rechained_log_is_caught_by_its_checkpoints(
    harness: AppHarness, pool: asyncpg.Pool, db_url: str, tmp_path: Path, forge: bool
) -> None:
    await _tasks(harness, "B", 5)
    assert await asyncio.to_thread(_cli, "audit", "checkpoint", "--database-url", db_url) == 0
    await _tasks(harness, "C", 3)
    key = await _public_key(harness)
    clean = await _export(db_url, tmp_path / "clean.jsonl")
    assert await asyncio.to_thread(_cli, "audit", "verify", str(clean), "--public-key", key) == 0

    await _rewrite_and_rechain(pool, 3, forge_checkpoints=forge)
    tampered = await _export(db_url, tmp_path / "tampered.jsonl")
    # Re-chained, the hashes agree again; a checkpoint left as it was still names
    # the old hash, and one forged to name the new hash agrees too: without the
    # key that attack passes.
    assert audit.verify_lines(tampered.read_text().splitlines()).ok is forge
    v = audit.verify_lines(tampered.read_text().splitlines(), public_key=audit.parse_public_key(key))
    assert not v.ok and v.first_bad_seq == 6, v
    assert await asyncio.to_thread(_cli, "audit", "verify", str(tampered), "--public-key", key) == 1
    body = (await harness.admin.get("/audit/verify")).json()
    assert body["ok"] is False and body["first_bad_seq"] == 6, body


async def test_a_cut_tail_is_caught_by_a_checkpoint_kept_outside(
    harness: AppHarness, pool: asyncpg.Pool, db_url: str, tmp_path: Path, capsys: Any
) -> None:
    await _tasks(harness, "D", 4)
    capsys.readouterr()
    assert await asyncio.to_thread(_cli, "audit", "checkpoint", "--database-url", db_url) == 0
    kept = tmp_path / "kept.jsonl"
    line = capsys.readouterr().out.strip()
    kept.write_text(line + "\n")
    cp = json.loads(line)
    assert cp["type"] == "audit.checkpoint" and cp["seq"] == 5 and cp["data"]["covers_seq"] == 4
    await _tasks(harness, "E", 3)
    key = await _public_key(harness)

    async with pool.acquire() as c, c.transaction():
        await c.execute("SET LOCAL session_replication_role = replica")
        await c.execute("DELETE FROM events WHERE seq >= 4")
        await c.execute("UPDATE log_head SET seq = 3, hash = (SELECT hash FROM events WHERE seq = 3) WHERE id = 1")
    prefix = await _export(db_url, tmp_path / "prefix.jsonl")
    assert await asyncio.to_thread(_cli, "audit", "verify", str(prefix), "--public-key", key) == 0  # valid prefix
    assert await asyncio.to_thread(
        _cli, "audit", "verify", str(prefix), "--public-key", key, "--checkpoint", str(kept)) == 1
    assert "cut off" in capsys.readouterr().out


async def test_a_forged_kept_checkpoint_is_refused(harness: AppHarness, db_url: str, tmp_path: Path,
                                                   capsys: Any) -> None:
    await _tasks(harness, "F", 2)
    capsys.readouterr()
    assert await asyncio.to_thread(_cli, "audit", "checkpoint", "--database-url", db_url) == 0
    cp = json.loads(capsys.readouterr().out)
    cp["data"]["covers_hash"] = "f" * 64
    forged = tmp_path / "forged.jsonl"
    forged.write_text(json.dumps(cp) + "\n")
    out = await _export(db_url, tmp_path / "log.jsonl")
    key = await _public_key(harness)
    assert await asyncio.to_thread(
        _cli, "audit", "verify", str(out), "--public-key", key, "--checkpoint", str(forged)) == 2
    assert "not signed by this key" in capsys.readouterr().err


@pytest.mark.parametrize("content", [
    b"", b"\xff\xfe not text", b"not json\n", b"[1, 2]\n", b'{"taskledger_audit": 1, "from_seq": "x"}\n',
    b'{"seq": 1, "stream": "task:x"}\n', b'{"taskledger_audit": 1, "from_seq": 1, "to_seq": 1, '
    b'"prev_hash": "' + b"0" * 64 + b'"}\n{"taskledger_audit_end": 5}\n',
])
def test_audit_verify_on_a_malformed_file_says_what_is_wrong_and_exits_2(
    tmp_path: Path, capsys: Any, content: bytes
) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    rc = cli(["audit", "verify", str(f)])
    err = capsys.readouterr().err
    if content == b"":
        assert rc == 0  # an empty log exports as nothing; an empty file holds no lie
        return
    assert rc == 2 and err.strip() and "Traceback" not in err, err


def test_audit_verify_on_a_missing_file_or_bad_key_exits_2(tmp_path: Path, capsys: Any) -> None:
    assert cli(["audit", "verify", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    assert cli(["audit", "verify", str(f), "--public-key", "not-a-key"]) == 2
    assert "public key" in capsys.readouterr().err
