"""Applies the plain SQL files in `sql/` in name order, once each.

A session-level advisory lock serialises replicas that start together; each
file runs in its own transaction with the row that records it.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import asyncpg

_LOCK_KEY = 0x7461736B6C6467  # "taskldg"


def migration_files() -> list[tuple[str, str]]:
    root = resources.files("sql")
    files = sorted(
        (p.name, p.read_text(encoding="utf-8")) for p in root.iterdir() if p.name.endswith(".sql")
    )
    return files


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply pending migrations; returns the names applied now."""
    applied_now: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
    try:
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   name       text PRIMARY KEY,
                   checksum   text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_migrations")}
        for name, text in migration_files():
            checksum = hashlib.sha256(text.encode()).hexdigest()
            if name in done:
                if done[name] != checksum:
                    raise RuntimeError(f"migration {name} changed after it was applied")
                continue
            async with conn.transaction():
                await conn.execute(text)
                await conn.execute(
                    "INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)", name, checksum
                )
            applied_now.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied_now
