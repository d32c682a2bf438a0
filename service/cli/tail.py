"""`taskledger tail`: follow the global feed over SSE, one JSON event a line.

It resumes by itself: every reconnect sends the last id it printed as
`Last-Event-ID`, so nothing is printed twice and nothing is skipped. Without
`--since-seq` it starts "from now", pinned to the head it finds first, so even a
reconnect before the first event loses nothing. Each event is printed as the
service sent it (`AsyncClient.follow_json`), not decoded and encoded again.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from taskledger.client import TaskledgerError, TransportError
from taskledger.service.cli.common import add_client_flags, client


def _disconnected(e: TaskledgerError) -> None:
    print(f"taskledger tail: disconnected ({e}); reconnecting", file=sys.stderr, flush=True)


def tail(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    types = [args.types] if args.types else None  # the comma list goes to the service as given
    with client(args) as c:
        try:
            for data in c.follow_json(args.since_seq, types=types, stream=args.stream, project=args.project,
                                      reconnect=not args.once, read_timeout=max(60.0, 4 * args.keepalive),
                                      on_retry=_disconnected):
                out.write(data + "\n")
                out.flush()
        except TaskledgerError as e:
            print(f"taskledger tail: {e}", file=sys.stderr)
            # A refusal is 2; under --once, a connection that broke or was turned away for now is 1.
            for_now = isinstance(e, TransportError) or e.status == 429 or e.status in c.retry.statuses
            return 1 if for_now else 2
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    try:
        return tail(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def register(sub: Any) -> None:
    p = sub.add_parser("tail", help="follow the global feed over SSE, one JSON event a line")
    p.add_argument("--since-seq", type=int, default=None, help="start after this seq (default: from now)")
    p.add_argument("--stream", default=None, help="only this stream, e.g. task:T-1")
    p.add_argument("--types", default=None, help="comma list of types; 'task.' is a prefix")
    p.add_argument("--project", default=None)
    p.add_argument("--once", action="store_true", help="exit when the stream ends instead of reconnecting")
    p.add_argument("--keepalive", type=float, default=15.0, help=argparse.SUPPRESS)
    add_client_flags(p)
    p.set_defaults(func=cmd_tail)
