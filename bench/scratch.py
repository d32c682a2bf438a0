"""A throw-away database for a benchmark: on the server named by a URL, or on an
embedded PostgreSQL started in a temporary directory."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import asyncpg

from taskledger.service.ops.embedded import start_embedded, with_database
from taskledger.service.ops.migrate import migrate


@contextmanager
def server(database_url: str | None, prefix: str) -> Iterator[str]:
    """`database_url` (or TASKLEDGER_DATABASE_URL), else an embedded server that lives as long as this."""
    url = database_url or os.environ.get("TASKLEDGER_DATABASE_URL")
    if url:
        yield url
        return
    handle, url = start_embedded(tempfile.mkdtemp(prefix=prefix))
    try:
        yield url
    finally:
        del handle


@asynccontextmanager
async def migrated_database(url: str, prefix: str) -> AsyncIterator[asyncpg.Connection]:
    """A new migrated database on the server at `url`, dropped afterwards."""
    name = prefix + uuid.uuid4().hex[:8]
    admin = await asyncpg.connect(url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    conn = await asyncpg.connect(with_database(url, name))
    try:
        await migrate(conn)
        yield conn
    finally:
        await conn.close()
        admin = await asyncpg.connect(url)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
