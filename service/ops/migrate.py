"""Applies the plain SQL files in `sql/` in name order, once each.

A session-level advisory lock serialises replicas that start together; each
file runs in its own transaction with the row that records it.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources

import asyncpg

_LOCK_KEY = 0x7461736B6C6467  # "taskldg"


def migration_files() -> list[tuple[str, str]]:
    root = resources.files("taskledger.sql")
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


_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# The log's own tables: the app role reads and appends, nothing more.
_LOG_TABLES = ("events", "log_head", "schema_migrations")


async def grant_app_role(conn: asyncpg.Connection, role: str, password: str | None = None) -> list[str]:
    """Create (or bring up to date) the role the service should run as.

    On `events` it may only SELECT and INSERT: no UPDATE, DELETE or TRUNCATE,
    and as it owns neither `events` nor its triggers it cannot disable them.
    It updates `log_head` (the head lock is a SELECT ... FOR UPDATE), reads
    `schema_migrations`, and has full use of every other table. It owns the
    tables projections rebuild (a rebuild swaps in a new table, which only an
    owner may do); the role running this becomes a member, so later migrations
    can still alter them. Run it again after every upgrade that adds tables.
    Returns the statements run (without the password).
    """
    if not _ROLE_NAME.match(role):
        raise ValueError("the role name must match [a-z_][a-z0-9_]{0,62}")
    from taskledger.projections import catalog

    rebuilt = sorted({t.name for p in catalog.PROJECTIONS for t in p.tables})
    others = [r["tablename"] for r in await conn.fetch(
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY tablename")
        if r["tablename"] not in _LOG_TABLES and r["tablename"] not in rebuilt]
    db = await conn.fetchval("SELECT current_database()")
    me = await conn.fetchval("SELECT current_user")
    r = f'"{role}"'
    stmts = [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') "
        f"THEN CREATE ROLE {r} LOGIN; END IF; END $$",
        f"ALTER ROLE {r} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS",
        f'GRANT CONNECT, TEMPORARY ON DATABASE "{db}" TO {r}',
        # CREATE: a rebuild creates its shadow tables next to the live ones
        f"GRANT USAGE, CREATE ON SCHEMA {await conn.fetchval('SELECT current_schema()')} TO {r}",
        f"REVOKE ALL ON events, log_head, schema_migrations FROM {r}",
        f"GRANT SELECT, INSERT ON events TO {r}",
        f"GRANT SELECT, UPDATE ON log_head TO {r}",
        f"GRANT SELECT ON schema_migrations TO {r}",
        *([f"GRANT SELECT, INSERT, UPDATE, DELETE ON {', '.join(others)} TO {r}"] if others else []),
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {await conn.fetchval('SELECT current_schema()')} TO {r}",
    ]
    if role != me:
        stmts.append(f'GRANT {r} TO "{me}"')
    stmts += [f"ALTER TABLE {t} OWNER TO {r}" for t in rebuilt]
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
        for s in stmts:
            await conn.execute(s)
        if password:
            await conn.execute(f"ALTER ROLE {r} PASSWORD {_literal(password)}")
    return stmts


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
