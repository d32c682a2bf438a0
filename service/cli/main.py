"""The `taskledger` command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from taskledger.service.http import server_limits
from taskledger.service.logs import configure_logging
from taskledger.service.settings import Settings

# Modules that add sub-commands: each has `register(subparsers)`.
_CLI_MODULES: Sequence[str] = (
    "taskledger.service.cli.tail",
    "taskledger.service.cli.tasks",
    "taskledger.service.cli.jobs",
    "taskledger.service.cli.admin",
    "taskledger.mcp",
)


def _database_url(args: argparse.Namespace) -> tuple[str, Any]:
    """The URL to use, starting the embedded server when none is configured."""
    url = getattr(args, "database_url", None) or os.environ.get("TASKLEDGER_DATABASE_URL")
    if url:
        return url, None
    from taskledger.service.ops.embedded import start_embedded

    data_dir = getattr(args, "data_dir", None) or os.environ.get("TASKLEDGER_DATA_DIR") or ".taskledger"
    handle, url = start_embedded(data_dir)
    return url, handle


async def _migrate(url: str) -> list[str]:
    from taskledger.service.ops.migrate import migrate

    conn = await asyncpg.connect(url)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def _bootstrap_admin(url: str) -> str | None:
    from taskledger.service.http.auth import create_token

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
    url, handle = _database_url(args)
    applied = asyncio.run(_migrate(url))
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
                # the drain (service.server_signals) runs inside this timeout
                workers_kill_timeout=5 + math.ceil(settings.drain_seconds),
                **server_limits.granian_options(settings),
            ).serve()
    finally:
        del handle
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    url, handle = _database_url(args)
    applied = asyncio.run(_migrate(url))
    print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    if args.app_role:
        from taskledger.service.cli.admin import grant_app_role

        rc = grant_app_role(url, args.app_role, os.environ.get("TASKLEDGER_APP_ROLE_PASSWORD"))
        if rc:
            return rc
    del handle
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    from taskledger.service.http.auth import create_token

    if args.role == "worker" and not args.node:
        print("a worker token needs --node", file=sys.stderr)
        return 2
    url, handle = _database_url(args)
    asyncio.run(_migrate(url))

    async def go() -> str:
        conn = await asyncpg.connect(url)
        try:
            new = await create_token(conn, role=args.role, name=args.name, node=args.node,
                                     expires_in_seconds=args.expires_in_seconds)
            return new.token
        finally:
            await conn.close()

    print(asyncio.run(go()))
    del handle
    return 0


def command_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a command the worker or runner runs: theirs without any
    TASKLEDGER_* variable (a spec must not read the token, the database URL or the
    audit key), plus `extra`."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith("TASKLEDGER_")}
    env.update(extra)
    return env


def add_db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", default=None, help="PostgreSQL URL (default: embedded server)")
    p.add_argument("--data-dir", default=None, help="data dir for the embedded server")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("TASKLEDGER_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=os.environ.get("TASKLEDGER_TOKEN"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taskledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

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

    p = sub.add_parser("token", help="manage API tokens")
    tsub = p.add_subparsers(dest="token_command", required=True)
    c = tsub.add_parser("create", help="print a new API token")
    c.add_argument("--role", required=True, choices=["admin", "producer", "worker", "reviewer", "reader"])
    c.add_argument("--name", required=True)
    c.add_argument("--node", default=None)
    c.add_argument("--expires-in-seconds", type=int, default=None, help="the token stops working after this")
    add_db_flags(c)
    c.set_defaults(func=cmd_token_create)
    from taskledger.service.cli.admin import register_token_commands

    register_token_commands(tsub)

    for name in _CLI_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # JSON under `serve` (its workers read the same variable), text in the tools
    if args.command == "serve":
        os.environ.setdefault("TASKLEDGER_LOG_FORMAT", "json")
    configure_logging(os.environ.get("TASKLEDGER_LOG_FORMAT"))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
