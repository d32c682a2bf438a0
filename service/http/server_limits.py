"""The server's limits, set from the settings rather than inherited from defaults.

Why this module exists (read before changing a limit)
-----------------------------------------------------
An ASGI server admits a bounded number of connections per worker process
(granian: `backpressure`, by default its backlog divided by the workers, and a
slot is held for a connection's whole life, idle keep-alive included; uvicorn:
`limit_concurrency`). An SSE stream is a connection that never ends, so with the
defaults ~1,024 open streams spent granian's whole budget: it stopped accepting
and every request, `/healthz` included, waited unanswered in the listen queue.

So each process has two budgets, and the server's is their sum:

- `max_streams` open SSE streams, counted by the live hub; a stream past it is
  answered 503 at once and its connection closed (service.routes.streams), so
  streams can never take more than their share;
- `max_connections` other connections: requests in flight and idle keep-alive
  connections, which are closed after `keep_alive_seconds`. Past that, new
  connections wait in the listen queue (`backlog`) for a free slot, as in any
  server.

Every stream and every connection is an open file: `serve` raises the soft
RLIMIT_NOFILE to the hard limit, and when even the hard limit cannot hold both
budgets it lowers the stream cap to fit (and says so) rather than let `accept`
fail, which would leave clients hanging again.
"""

from __future__ import annotations

import logging
import resource
from typing import Any, Final

import msgspec

from taskledger.service.settings import Settings

log = logging.getLogger("taskledger.limits")

# Open files a process needs besides its connections: the pool, the tailer's and
# the writer's connections, log files, the interpreter's own.
RESERVED_FILES: Final = 256


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; answer the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # pragma: no cover - refused by the kernel
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def fit_to_open_files(settings: Settings, open_files: int) -> Settings:
    """The settings with the stream cap lowered, if needed, so that both budgets fit in `open_files`."""
    room = open_files - RESERVED_FILES - settings.max_connections
    if settings.max_streams <= room:
        return settings
    return msgspec.structs.replace(settings, max_streams=max(0, room))


def server_concurrency(settings: Settings) -> int:
    """Connections one server process admits at once: every stream plus the other connections."""
    return settings.max_streams + settings.max_connections


def granian_options(settings: Settings) -> dict[str, Any]:
    from granian.http import HTTP1Settings

    return {
        "backlog": settings.backlog,
        "backpressure": server_concurrency(settings),
        # hyper's header read timeout also ends an idle keep-alive connection and
        # so gives its slot back (granian allows 1 ms to 60 s).
        "http1_settings": HTTP1Settings(
            header_read_timeout=min(60_000, max(1, round(settings.keep_alive_seconds * 1000)))),
    }


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    # uvicorn answers 503 itself past `limit_concurrency` (connections or tasks).
    return {
        "backlog": settings.backlog,
        "limit_concurrency": server_concurrency(settings),
        "timeout_keep_alive": settings.keep_alive_seconds,
    }
