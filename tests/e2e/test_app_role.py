"""`taskledger migrate --app-role NAME`: a role that can serve but cannot rewrite the log."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from tests.conftest import ROOT, ServerProcess


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"{role}@{parts.netloc.rpartition('@')[2]}", parts.path, parts.query, ""))


@pytest.fixture
async def app_role(db_url: str) -> AsyncIterator[str]:
    role = "tl_app_" + uuid.uuid4().hex[:8]
    out = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "taskledger.service.cli", "migrate", "--app-role", role, "--database-url", db_url],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    try:
        yield role
    finally:
        c = await asyncpg.connect(db_url)
        try:
            await c.execute(f'REASSIGN OWNED BY "{role}" TO CURRENT_USER')
            await c.execute(f'DROP OWNED BY "{role}"')
            await c.execute(f'DROP ROLE "{role}"')
        finally:
            await c.close()


@pytest.mark.parametrize("statement", [
    "UPDATE events SET type = 'x' WHERE seq = 1",
    "DELETE FROM events WHERE seq = 1",
    "TRUNCATE events",
    "ALTER TABLE events DISABLE TRIGGER events_append_only",
    "DROP TRIGGER events_append_only ON events",
    "SET session_replication_role = replica",
    "CREATE TRIGGER t BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION events_refuse_change()",
])
async def test_the_app_role_cannot_change_or_unguard_the_log(
    db_url: str, app_role: str, statement: str
) -> None:
    c = await asyncpg.connect(_as(db_url, app_role))
    try:
        await c.execute("INSERT INTO events (seq, stream, stream_seq, type, data, meta, recorded_at, hash) "
                        "VALUES (1, 's', 1, 't', '{}', '{}', now(), 'h')")  # it may append
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await c.execute(statement)
    finally:
        await c.close()


async def test_the_service_serves_as_the_app_role(db_url: str, app_role: str) -> None:
    s = await asyncio.to_thread(ServerProcess(_as(db_url, app_role)).start)
    try:
        producer = await asyncio.to_thread(s.token, "producer")
        with s.client(producer) as http:
            r = await asyncio.to_thread(http.post, "/tasks", json={"id": "A1", "project": "p", "title": "t",
                                                                   "verification": None})
            assert r.status_code == 201, r.text
        with s.client() as admin:
            r = await asyncio.to_thread(admin.post, "/admin/rebuild", json={"wait": True})
            assert r.status_code == 200 and all(x["state"] == "done" for x in r.json()["rebuilds"]), r.text
            assert (await asyncio.to_thread(admin.get, "/tasks/A1")).status_code == 200
            assert (await asyncio.to_thread(admin.get, "/audit/verify")).json()["ok"] is True
    finally:
        await asyncio.to_thread(s.stop)
    # migrations still run as the owner after the rebuild gave the app role new tables
    out = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "taskledger.service.cli", "migrate", "--app-role", app_role, "--database-url", db_url],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
