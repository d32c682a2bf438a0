"""The audit trail: exports that verify, edits that do not, and a tampered row caught three ways."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import asyncpg

from taskledger.events import audit
from taskledger.service.cli.main import main as cli
from tests.conftest import AppHarness
from tests.flows import make, project


async def _some_history(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    for _ in range(3):
        await make(producer, maker, project())


async def _tamper(pool: asyncpg.Pool, seq: int) -> None:
    async with pool.acquire() as c, c.transaction():
        await c.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await c.execute(
            "UPDATE events SET data = jsonb_set(data, '{title}', '\"rewritten\"') WHERE seq = $1", seq)
        await c.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")


async def test_the_chain_verifies_from_the_table_whole_and_in_part(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    await _some_history(harness)
    head, head_hash = await pool.fetchrow("SELECT seq, hash FROM log_head")
    body = await harness.admin.ok(await harness.admin.get("/audit/verify"))
    assert body["ok"] is True and body["head_seq"] == head and body["head_hash"] == head_hash
    assert body["first_bad_seq"] is None
    admin = harness.admin
    part = await admin.ok(await admin.get("/audit/verify", params={"from_seq": 4, "to_seq": 9}))
    assert part["ok"] is True and part["checked"] == 6
    r = await admin.get("/audit/verify", params={"from_seq": 9, "to_seq": 4})
    assert r.status_code == 400
    reader = await harness.client("reader")
    assert (await reader.get("/audit/verify")).status_code == 403  # admin only: it hashes the whole log


async def test_a_row_altered_behind_the_guard_is_caught_by_the_endpoint_the_cli_and_check(
    harness: AppHarness, pool: asyncpg.Pool, db_url: str, tmp_path: Path
) -> None:
    await _some_history(harness)
    first = await pool.fetchval("SELECT min(seq) FROM events WHERE type = 'task.created' AND seq > 5")
    out = tmp_path / "before.jsonl"
    assert await asyncio.to_thread(
        cli, ["audit", "export", "--database-url", db_url, "--output", str(out)]) == 0
    await _tamper(pool, first)

    body = await harness.admin.ok(await harness.admin.get("/audit/verify"))
    assert body["ok"] is False and body["first_bad_seq"] == first

    tampered = tmp_path / "after.jsonl"
    assert await asyncio.to_thread(
        cli, ["audit", "export", "--database-url", db_url, "--output", str(tampered)]) == 0
    assert audit.verify_lines(tampered.read_text().splitlines()).first_bad_seq == first
    assert await asyncio.to_thread(cli, ["audit", "verify", str(tampered)]) == 1
    assert await asyncio.to_thread(cli, ["audit", "verify", str(out)]) == 0

    # check: the chain breaks, and the task row no longer equals the fold of the rewritten event
    assert await asyncio.to_thread(cli, ["check", "--database-url", db_url]) == 1


async def test_an_export_verifies_and_an_edited_line_names_its_event(
    harness: AppHarness, db_url: str, tmp_path: Path, capsys: object
) -> None:
    await _some_history(harness)
    out = tmp_path / "log.jsonl"
    assert await asyncio.to_thread(cli, ["audit", "export", "--database-url", db_url, "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    header, trailer = json.loads(lines[0]), json.loads(lines[-1])
    events = [json.loads(x) for x in lines[1:-1]]
    assert header["prev_hash"] == "0" * 64 and header["from_seq"] == 1
    assert list(events[0]) == ["seq", "stream", "stream_seq", "type", "data", "meta", "recorded_at", "hash"]
    assert trailer["taskledger_audit_end"]["last_hash"] == events[-1]["hash"]
    assert audit.verify_lines(lines).ok

    edited = list(lines)
    ev = json.loads(edited[5])
    ev["meta"]["actor"] = "someone-else"
    edited[5] = json.dumps(ev)
    v = audit.verify_lines(edited)
    assert not v.ok and v.first_bad_seq == ev["seq"] and v.line == 6
    bad = tmp_path / "edited.jsonl"
    bad.write_text("\n".join(edited) + "\n")
    assert await asyncio.to_thread(cli, ["audit", "verify", str(bad)]) == 1

    dropped = lines[:5] + lines[6:]
    assert audit.verify_lines(dropped).first_bad_seq == json.loads(lines[5])["seq"]
    assert not audit.verify_lines(lines[:-3]).ok  # truncated: no trailer


async def test_a_partial_export_carries_the_hash_it_chains_from(harness: AppHarness, db_url: str,
                                                               tmp_path: Path) -> None:
    await _some_history(harness)
    out = tmp_path / "part.jsonl"
    assert await asyncio.to_thread(cli, ["audit", "export", "--database-url", db_url, "--from-seq", "5",
                                         "--to-seq", "11", "-o", str(out)]) == 0
    lines = out.read_text().splitlines()
    header = json.loads(lines[0])
    async with _conn(db_url) as c:
        prev = await c.fetchval("SELECT hash FROM events WHERE seq = 4")
    assert header == {"taskledger_audit": 1, "from_seq": 5, "to_seq": 11, "prev_hash": prev}
    v = audit.verify_lines(lines)
    assert v.ok and (v.first_seq, v.last_seq, v.count) == (5, 11, 7)
    forged = [json.dumps({**header, "prev_hash": "f" * 64}), *lines[1:]]
    assert audit.verify_lines(forged).first_bad_seq == 5


class _conn:
    def __init__(self, url: str) -> None:
        self.url = url

    async def __aenter__(self) -> asyncpg.Connection:
        self.c = await asyncpg.connect(self.url)
        return self.c

    async def __aexit__(self, *exc: object) -> None:
        await self.c.close()
