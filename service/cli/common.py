"""What the command modules share: the flags every client or database command
takes, where the database is, a client built from the flags, and the clean
environment commands run in. Imports nothing of the CLI back."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from taskledger.client import AsyncClient, Client, Retry


def add_db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", default=None, help="PostgreSQL URL (default: embedded server)")
    p.add_argument("--data-dir", default=None, help="data dir for the embedded server")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("TASKLEDGER_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=os.environ.get("TASKLEDGER_TOKEN"))


def database_url(args: argparse.Namespace) -> tuple[str, Any]:
    """The URL to use, starting the embedded server when none is configured; the
    second value keeps that server running while it is referenced."""
    url = getattr(args, "database_url", None) or os.environ.get("TASKLEDGER_DATABASE_URL")
    if url:
        return url, None
    from taskledger.service.ops.embedded import start_embedded

    data_dir = getattr(args, "data_dir", None) or os.environ.get("TASKLEDGER_DATA_DIR") or ".taskledger"
    handle, url = start_embedded(data_dir)
    return url, handle


def client(args: argparse.Namespace, *, retry: Retry | None = None) -> Client:
    """The blocking client for --url and --token."""
    return Client(args.url, args.token, retry=retry)


def async_client(args: argparse.Namespace, *, retry: Retry | None = None) -> AsyncClient:
    """The asyncio client for --url and --token."""
    return AsyncClient(args.url, args.token, retry=retry)


def command_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a command the worker or runner runs: theirs without any
    TASKLEDGER_* variable (a spec must not read the token, the database URL or the
    audit key), plus `extra`."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith("TASKLEDGER_")}
    env.update(extra)
    return env


def console(stderr: bool = False) -> Any:
    """A rich console for tables and progress bars (imported only when drawn)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)

