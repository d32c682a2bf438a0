"""`taskledger token create|list|revoke`: API tokens, straight in the database."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import asyncpg
import msgspec

from taskledger.service.cli.common import add_db_flags, console, database_url
from taskledger.service.cli.serve import migrate_now


def cmd_token_create(args: argparse.Namespace) -> int:
    from taskledger.service.tokens import create_token

    if args.role == "worker" and not args.node:
        print("a worker token needs --node", file=sys.stderr)
        return 2
    url, handle = database_url(args)
    migrate_now(url)

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


def cmd_token_list(args: argparse.Namespace) -> int:
    from taskledger.service.tokens import list_tokens

    url, handle = database_url(args)

    async def go() -> list[Any]:
        conn = await asyncpg.connect(url)
        try:
            return await list_tokens(conn)
        finally:
            await conn.close()

    tokens = asyncio.run(go())
    if args.json:
        for t in tokens:
            print(msgspec.json.encode(t).decode())
    else:
        from rich.table import Table

        table = Table()
        for col in ("id", "name", "role", "node", "created", "expires", "revoked"):
            table.add_column(col)
        for t in tokens:
            table.add_row(t.id, t.name, t.role, t.node or "-", f"{t.created_at:%Y-%m-%d %H:%M:%S}",
                          f"{t.expires_at:%Y-%m-%d %H:%M:%S}" if t.expires_at else "-",
                          f"{t.revoked_at:%Y-%m-%d %H:%M:%S}" if t.revoked_at else "-")
        console().print(table)
    del handle
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    from taskledger.service.tokens import revoke_token

    url, handle = database_url(args)

    async def go() -> Any:
        conn = await asyncpg.connect(url)
        try:
            return await revoke_token(conn, args.id)
        finally:
            await conn.close()

    info = asyncio.run(go())
    del handle
    if info is None:
        print(f"token {args.id} does not exist", file=sys.stderr)
        return 1
    print(f"revoked token {info.id} ({info.name}, {info.role}) at {info.revoked_at:%Y-%m-%d %H:%M:%S%z}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("token", help="manage API tokens")
    tsub = p.add_subparsers(dest="token_command", required=True)
    c = tsub.add_parser("create", help="print a new API token")
    c.add_argument("--role", required=True, choices=["admin", "producer", "worker", "reviewer", "reader"])
    c.add_argument("--name", required=True)
    c.add_argument("--node", default=None)
    c.add_argument("--expires-in-seconds", type=int, default=None, help="the token stops working after this")
    add_db_flags(c)
    c.set_defaults(func=cmd_token_create)
    p = tsub.add_parser("list", help="list tokens: id, name, role, node, created, expires, revoked (no secrets)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    add_db_flags(p)
    p.set_defaults(func=cmd_token_list)
    p = tsub.add_parser("revoke", help="revoke a token by id; every replica refuses it within a second")
    p.add_argument("id", type=int)
    add_db_flags(p)
    p.set_defaults(func=cmd_token_revoke)
