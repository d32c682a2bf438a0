"""Migrations apply once, even from two replicas at once; `serve` needs no PostgreSQL install."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from taskledger.service.ops.embedded import with_database
from taskledger.service.ops.migrate import migrate, migration_files
from tests.conftest import ServerProcess, _drop, create_database


@pytest.fixture
def empty_db(pg_url: str) -> Iterator[str]:
    name = "tl_empty_" + uuid.uuid4().hex[:8]
    asyncio.run(create_database(pg_url, name))
    yield with_database(pg_url, name)
    asyncio.run(_drop(pg_url, name))


async def test_two_replicas_migrating_at_once_apply_each_file_once(empty_db: str) -> None:
    conns = [await asyncpg.connect(empty_db) for _ in range(2)]
    try:
        applied = await asyncio.gather(*(migrate(c) for c in conns))
        names = [n for n, _ in migration_files()]
        assert sorted(applied[0] + applied[1]) == names
        assert await migrate(conns[0]) == []
        rows = await conns[0].fetch("SELECT name FROM schema_migrations ORDER BY name")
        assert [r["name"] for r in rows] == names
    finally:
        for c in conns:
            await c.close()


def test_serve_without_a_database_url_starts_embedded_postgres_and_reuses_it() -> None:
    # Not under pytest's tmp dirs: the embedded server runs as its own system user.
    data = Path(tempfile.mkdtemp(prefix="tl-serve-embedded-"))
    try:
        started = time.monotonic()
        s = ServerProcess(None, data_dir=data).start(timeout=90)
        ready_after = time.monotonic() - started
        try:
            tok = s.token("producer")
            with s.client(tok) as c:
                assert c.post("/tasks", json={"id": "kept", "project": "p", "title": "t"}).status_code == 201
        finally:
            s.stop()
        assert ready_after < 30, f"readyz took {ready_after:.1f}s"
        assert not (data / "pgdata" / "postmaster.pid").exists(), "the embedded server was not stopped on exit"

        s2 = ServerProcess(None, data_dir=data).start(timeout=90)
        try:
            with s2.client() as c:
                assert c.get("/tasks/kept").status_code == 200
        finally:
            s2.stop()
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_serve_prints_an_admin_token_once_when_none_is_configured(db_url: str) -> None:
    s = ServerProcess(db_url, env={"TASKLEDGER_ADMIN_TOKEN": ""})
    s.start()
    try:
        deadline = time.time() + 10
        while "admin token" not in s.log() and time.time() < deadline:
            time.sleep(0.1)
        line = next(ln for ln in s.log().splitlines() if "admin token" in ln)
        token = line.rsplit(" ", 1)[-1]
        r = httpx.post(s.base + "/tokens", json={"role": "reader", "name": "r"},
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201
    finally:
        s.stop()
    s2 = ServerProcess(db_url, env={"TASKLEDGER_ADMIN_TOKEN": ""})
    s2.log_path = s2.log_path.with_name(s2.log_path.name + ".2")
    s2.start()
    try:
        time.sleep(0.5)
        assert "admin token" not in s2.log()
    finally:
        s2.stop()
