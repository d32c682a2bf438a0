"""`taskledger mcp`: the service as Model Context Protocol tools, so a coding
agent can be a maker or a checker. This module only registers the command;
the server (and the `mcp` SDK it needs) is imported when the command runs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("mcp", help="serve the taskledger tools to an MCP client (stdio, or --http)")
    p.add_argument("--url", default=os.environ.get("TASKLEDGER_URL", "http://127.0.0.1:8080"),
                   help="the taskledger service (default: TASKLEDGER_URL)")
    p.add_argument("--token", default=os.environ.get("TASKLEDGER_TOKEN"),
                   help="the token every tool call acts as (default: TASKLEDGER_TOKEN)")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="with --http: the address to listen on")
    p.add_argument("--port", type=int, default=8765, help="with --http: the port to listen on")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.token:
        print("taskledger mcp needs a token: --token or TASKLEDGER_TOKEN", file=sys.stderr)
        return 2
    try:
        from taskledger.mcp.server import serve
    except ImportError as e:
        print(f"taskledger mcp needs the MCP SDK: pip install 'taskledger[mcp]' ({e})", file=sys.stderr)
        return 2
    serve(args.url, args.token, http=args.http, host=args.host, port=args.port)
    return 0
