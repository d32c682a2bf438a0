"""Let the app act the moment its server is told to stop.

Granian runs the ASGI lifespan shutdown only after every open connection has
closed, so an endless SSE stream would hold a stopping worker until its kill
timeout and then be cut mid-stream. Its worker installs its SIGTERM/SIGINT
handler with `granian._signals.set_loop_signals`; `install()` (called by the
worker's entry point, `service.asgi`, before that happens) swaps in an
equivalent that first runs the hooks registered with `on_shutdown` — the live
hub ends its streams cleanly there — and then sets granian's own stop signal.
If granian's internals differ from what this expects, nothing is changed and
streams simply end at the kill timeout. Under uvicorn, sse-starlette's own
shutdown detection ends the streams.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

log = logging.getLogger("taskledger.signals")

_hooks: list[Callable[[], None]] = []


def on_shutdown(fn: Callable[[], None]) -> None:
    """Run `fn` (on the event loop's thread) when the server is told to stop."""
    _hooks.append(fn)


def run_hooks() -> None:
    for fn in list(_hooks):
        try:
            fn()
        except Exception:
            log.exception("shutdown hook failed")


def install() -> None:
    try:
        from granian import _signals
        from granian._granian import WorkerSignal
    except ImportError:
        return
    original = getattr(_signals, "set_loop_signals", None)
    if original is None or getattr(original, "_taskledger", False):
        return

    def set_loop_signals(loop: Any) -> Any:
        event = WorkerSignal()

        def handler(_signum: int, _frame: Any) -> None:
            run_hooks()
            event.set()

        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, handler, sig, None)
        except NotImplementedError:  # pragma: no cover - not on this platform
            return original(loop)
        return event

    set_loop_signals._taskledger = True  # type: ignore[attr-defined]
    _signals.set_loop_signals = set_loop_signals
