"""`taskledger serve` and `taskledger migrate`: the service itself, and its database."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from typing import Any

import asyncpg

from taskledger.service.cli.common import add_db_flags, database_url
from taskledger.service.http import server_limits
from taskledger.service.settings import Settings


async def _migrate(url: str) -> list[str]:
    from taskledger.service.ops.migrate import migrate

    conn = await asyncpg.connect(url)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


def migrate_now(url: str) -> list[str]:
    """Apply pending migrations to `url`; the names applied."""
    return asyncio.run(_migrate(url))


async def _bootstrap_admin(url: str) -> str | None:
    from taskledger.service.tokens import create_token

    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_advisory_lock(7461)")
        try:
            exists = await conn.fetchval("SELECT 1 FROM tokens WHERE role = 'admin' AND revoked_at IS NULL")
            if exists:
                return None
            return (await create_token(conn, role="admin", name="admin", node=None)).token
        finally:
            await conn.execute("SELECT pg_advisory_unlock(7461)")
    finally:
        await conn.close()


def _limited(settings: Settings) -> Settings:
    """Raise the open-files limit and fit the stream cap in it; the workers read the cap from the environment."""
    soft, _hard = server_limits.raise_open_files_limit()
    fitted = server_limits.fit_to_open_files(settings, soft)
    if fitted.max_streams != settings.max_streams:
        print(f"the open-files limit ({soft}) cannot hold {settings.max_streams} streams beside "
              f"{settings.max_connections} other connections: serving at most {fitted.max_streams} streams per process",
              file=sys.stderr, flush=True)
    os.environ["TASKLEDGER_MAX_STREAMS"] = str(fitted.max_streams)
    return fitted


def cmd_serve(args: argparse.Namespace) -> int:
    url, handle = database_url(args)
    applied = migrate_now(url)
    if applied:
        print(f"applied migrations: {', '.join(applied)}", file=sys.stderr)
    if not os.environ.get("TASKLEDGER_ADMIN_TOKEN"):
        token = asyncio.run(_bootstrap_admin(url))
        if token:
            print(f"admin token (shown once): {token}", flush=True)
    os.environ["TASKLEDGER_DATABASE_URL"] = url
    os.environ["TASKLEDGER_MIGRATE_ON_START"] = "false"
    settings = _limited(Settings.from_env(host=args.host, port=args.port, workers=args.workers))
    print(f"taskledger serving on http://{settings.host}:{settings.port} ({args.server}; per process: "
          f"{settings.max_streams} streams + {settings.max_connections} other connections)",
          file=sys.stderr, flush=True)
    try:
        if args.server == "uvicorn":
            import uvicorn

            uvicorn.run(
                "taskledger.service.http.asgi:app", host=settings.host, port=settings.port,
                workers=settings.workers, lifespan="on", log_level="warning",
                timeout_graceful_shutdown=5, **server_limits.uvicorn_options(settings),
            )
        else:
            from granian import Granian
            from granian.constants import Interfaces

            Granian(
                "taskledger.service.http.asgi:app", address=settings.host, port=settings.port,
                interface=Interfaces.ASGI, workers=settings.workers, log_enabled=False,
                # the drain (service.http.server_signals) runs inside this timeout
                workers_kill_timeout=5 + math.ceil(settings.drain_seconds),
                **server_limits.granian_options(settings),
            ).serve()
    finally:
        del handle
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    url, handle = database_url(args)
    applied = migrate_now(url)
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    if args.app_role:
        rc = grant_app_role(url, args.app_role, os.environ.get("TASKLEDGER_APP_ROLE_PASSWORD"))
        if rc:
            return rc
    del handle
    return 0


def grant_app_role(url: str, role: str, password: str | None) -> int:
    from taskledger.service.ops import migrate

    async def go() -> list[str]:
        conn = await asyncpg.connect(url)
        try:
            return await migrate.grant_app_role(conn, role, password)
        finally:
            await conn.close()

    try:
        asyncio.run(go())
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    except asyncpg.InsufficientPrivilegeError as e:
        print(f"creating the app role needs the right to create roles and grant on every table: {e}",
              file=sys.stderr)
        return 1
    print(f"app role {role}: SELECT and INSERT on events; serve with a database URL that connects as {role}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the HTTP service")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--server", choices=["granian", "uvicorn"], default="granian")
    add_db_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("migrate", help="apply pending migrations and exit")
    p.add_argument("--app-role", default=None, metavar="NAME",
                   help="also create or update NAME, a role that may only read and append the event log "
                        "(password from TASKLEDGER_APP_ROLE_PASSWORD); serve as it (docs/SECURITY.md)")
    add_db_flags(p)
    p.set_defaults(func=cmd_migrate)
