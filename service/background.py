"""Stopping background tasks for certain.

On Python 3.11, `asyncio.wait_for` can swallow a cancellation that arrives just
as the awaited future completes (fixed in 3.12). A background loop built on
`wait_for` may then go on after `task.cancel()`, and a shutdown that simply
awaits it waits forever. `cancel_all` cancels again until every task is done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("taskledger.background")


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], *, every: float = 1.0) -> None:
    """Cancel `tasks` and wait until each has finished, cancelling again every `every` seconds.
    Like `gather(..., return_exceptions=True)`, a task's own failure is consumed, not raised."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
        for t in pending:
            log.warning("background task %s ignored a cancellation; cancelling it again", t.get_name())
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved, so asyncio does not report it as never retrieved
