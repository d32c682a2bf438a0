"""The `taskledger` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from taskledger import mcp
from taskledger.service.cli import admin, runner, serve, tail, tokens, watch, worker
from taskledger.service.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taskledger", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each module adds its commands; this order is the order `--help` lists them in.
    for module in (serve, tokens, tail, worker, runner, watch, admin, mcp):
        module.register(sub)
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
