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

Draining (`drain_seconds` > 0, for replicas behind a load balancer): the first
SIGTERM runs the `on_drain` hooks at once (`/readyz` turns 503) and everything
else only `drain_seconds` later. Meanwhile the server keeps serving, so the
balancer's health check takes the replica out of rotation while no request can
fail; then streams end cleanly (their clients reconnect through the balancer
to another replica), granian stops accepting, lets in-flight requests finish,
and the lifespan shutdown stops the writer. Signals that arrive while draining
are ignored: a process-group kill and granian's main process each send one,
and the drain is bounded anyway by the main process's kill timeout.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

log = logging.getLogger("taskledger.signals")

_hooks: list[Callable[[], None]] = []
_drain_hooks: list[Callable[[], None]] = []


def on_drain(fn: Callable[[], None]) -> None:
    """Run `fn` (on the event loop's thread) the moment the server is told to stop,
    `drain_seconds` before the `on_shutdown` hooks."""
    _drain_hooks.append(fn)


def on_shutdown(fn: Callable[[], None]) -> None:
    """Run `fn` (on the event loop's thread) when the server is told to stop."""
    _hooks.append(fn)


def _run(hooks: list[Callable[[], None]]) -> None:
    for fn in list(hooks):
        try:
            fn()
        except Exception:
            log.exception("shutdown hook failed")


def run_hooks() -> None:
    _run(_hooks)


def run_drain_hooks() -> None:
    _run(_drain_hooks)


def install(drain_seconds: float = 0.0) -> None:
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
        stopping = False

        def stop() -> None:
            run_hooks()
            event.set()

        def handler(_signum: int, _frame: Any) -> None:
            nonlocal stopping
            if stopping:
                return
            stopping = True
            run_drain_hooks()
            if drain_seconds > 0:
                log.warning("draining for %.1fs before stopping", drain_seconds)
                loop.call_later(drain_seconds, stop)
            else:
                stop()

        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, handler, sig, None)
        except NotImplementedError:  # pragma: no cover - not on this platform
            return original(loop)
        return event

    set_loop_signals._taskledger = True  # type: ignore[attr-defined]
    _signals.set_loop_signals = set_loop_signals
