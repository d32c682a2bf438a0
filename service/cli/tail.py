"""`taskledger tail`: follow the global feed over SSE, one JSON event a line.

It resumes by itself: every reconnect sends the last id it printed as
`Last-Event-ID`, so nothing is printed twice and nothing is skipped. Without
`--since-seq` it starts "from now", pinned to the head it finds first, so even a
reconnect before the first event loses nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import httpx
from httpx_sse import connect_sse

from taskledger.service.cli.main import add_client_flags

_RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


class _Fatal(Exception):
    pass


def _head(http: httpx.Client) -> int:
    r = http.get("/events", params={"limit": 1})
    _check(r)
    return int(r.json()["head_seq"])


def _check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        r.read()
        detail = r.json().get("detail", r.text)
    except Exception:
        detail = r.text
    if r.status_code in _RETRYABLE_STATUS:
        raise httpx.TransportError(f"{r.status_code}: {detail}")
    raise _Fatal(f"{r.status_code}: {detail}")


def tail(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    params: dict[str, str] = {}
    if args.types:
        params["types"] = args.types
    if args.stream:
        params["stream"] = args.stream
    if args.project:
        params["project"] = args.project
    last: int | None = args.since_seq
    failures = 0
    retry = 2.0  # the server's `retry:` (seconds); doubled per failed attempt in a row
    timeout = httpx.Timeout(10.0, read=max(60.0, 4 * args.keepalive))
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout) as http:
        while True:
            try:
                if last is None:
                    last = _head(http)
                with connect_sse(http, "GET", "/stream", params=params,
                                 headers={"Last-Event-ID": str(last)}) as es:
                    _check(es.response)
                    failures = 0
                    for ev in es.iter_sse():
                        if ev.retry is not None:
                            retry = ev.retry / 1000
                        if not ev.id or not ev.data:
                            continue
                        out.write(ev.data + "\n")
                        out.flush()
                        last = int(ev.id)
                if args.once:
                    return 0
            except _Fatal as e:
                print(f"taskledger tail: {e}", file=sys.stderr)
                return 2
            except (httpx.HTTPError, OSError) as e:
                if args.once:
                    print(f"taskledger tail: {e}", file=sys.stderr)
                    return 1
                print(f"taskledger tail: disconnected ({e}); reconnecting", file=sys.stderr, flush=True)
            # The stream ended (the server is shutting down) or broke: wait, then resume.
            time.sleep(min(retry * 2**failures, 30.0))
            failures += 1


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
