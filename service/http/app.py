"""The one app factory: `create_app(settings) -> Litestar`."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import resource
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.exceptions import ValidationException
from litestar.middleware.base import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from taskledger.service.background import cancel_all
from taskledger.service.http import openapi_docs, server_signals
from taskledger.service.http.auth import PUBLIC_PATHS, AuthMiddleware
from taskledger.service.http.deps import Services, dependencies
from taskledger.service.http.live import Hub
from taskledger.service.http.problems import exception_handlers
from taskledger.service.http.routes import admin, dashboard, jobs, streams, system, task_batches, tasks, webhooks
from taskledger.service.http.sessions import Sessions, deployment_secret
from taskledger.service.http.telemetry import Tracing, request_middleware
from taskledger.service.metrics import Metrics
from taskledger.service.ops import sweepers
from taskledger.service.ops.audit_key import load_or_create
from taskledger.service.ops.migrate import migrate
from taskledger.service.ops.webhooks import Deliverer
from taskledger.service.settings import Settings
from taskledger.service.tokens import TokenStore
from taskledger.service.writer import session as task_sessions
from taskledger.service.writer.commands import CommandRunner
from taskledger.service.writer.engine import Writer

log = logging.getLogger("taskledger")

# JSON strings cannot carry U+0000 into jsonb; an escaped NUL is refused up front
# (an even run of backslashes before it is an escaped backslash, not an escape).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
MAX_JSON_DEPTH = 64
# Everything but the bytes that open, close or quote: what is left of a body is
# short, and walking it finds the nesting depth without decoding anything.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"\\')


# Resource modules, each with its ROUTES; what they use comes by injection (deps).
_ROUTE_MODULES: Sequence[Any] = (system, tasks, task_batches, jobs, streams, admin, dashboard, webhooks)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in `body` (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for b in body.translate(None, _NOT_STRUCTURE):
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


async def _reject_bad_input(request: Request[Any, Any, Any]) -> None:
    """Input no handler can store, refused before any handler runs: a NUL in the
    query (PostgreSQL text cannot hold one), a body that is not UTF-8, a NUL in a
    JSON string, or JSON nested deeper than MAX_JSON_DEPTH (the decoder and the
    canonical JSON of the hash chain are recursive)."""
    qs = request.scope.get("query_string", b"")
    if b"%00" in qs or b"\x00" in qs:
        raise ValidationException("query parameters may not contain NUL (%00)")
    if request.method in ("POST", "PUT", "PATCH", "DELETE"):
        body = await request.body()
        if not body:
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValidationException(f"the body is not valid UTF-8 (byte {e.start})") from e
        if _NUL_ESCAPE.search(body):
            raise ValidationException("strings may not contain U+0000")
        if json_depth(body) > MAX_JSON_DEPTH:
            raise ValidationException(f"JSON may nest at most {MAX_JSON_DEPTH} levels deep")


Hook = Callable[[Litestar], Any]


def create_app(settings: Settings, *, extra_startup: Sequence[Hook] = (), tracer_provider: Any = None) -> Litestar:
    """`tracer_provider` (an OpenTelemetry SDK one) turns tracing on as
    `settings.otel` does, with that provider instead of one from OTEL_*."""
    if not settings.database_url:
        raise ValueError("create_app needs settings.database_url")
    dsn = settings.database_url

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        s = services
        if settings.migrate_on_start:
            conn = await asyncpg.connect(dsn)
            try:
                await migrate(conn)
            finally:
                await conn.close()
        s.pool = await asyncpg.create_pool(dsn, min_size=settings.pool_min, max_size=settings.pool_max)
        if tracing is not None:
            tracing.start()
        s.tokens = TokenStore(s.pool, settings.admin_token)
        listeners = s.commit_listeners

        def on_commit(head: int) -> None:
            for fn in listeners:
                fn(head)

        s.writer = Writer(dsn, batch_max=settings.batch_max, queue_max=settings.writer_queue_max,
                          metrics=metrics, on_commit=on_commit)
        s.writer.prefetchers["tasks"] = task_sessions.prefetch_tasks
        await s.writer.start()
        s.command_runner = CommandRunner(s.writer, idempotency_ttl_seconds=settings.idempotency_ttl_seconds)
        metrics.gauge("writer_queue_depth", lambda: s.writer.queue_depth)
        s.background.append(asyncio.create_task(s.tokens.run(), name="taskledger-token-revalidation"))

        def drain() -> None:
            s.draining = True

        server_signals.on_drain(drain)
        s.audit_key = load_or_create(settings)
        s.background.extend(sweepers.start(s.pool, s.writer, settings, s.audit_key, listeners))
        s.hub = Hub(dsn, s.pool, poll_seconds=settings.sse_poll_seconds, queue_max=settings.sse_queue_max,
                    max_streams=settings.max_streams, metrics=metrics)
        await s.hub.start()
        s.hub.register_metrics(metrics)
        metrics.gauge("process_open_files_limit", lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        listeners.append(s.hub.notify)
        server_signals.on_shutdown(s.hub.end_streams)
        s.sessions = Sessions(s.pool, await deployment_secret(s.pool), ttl=settings.stream_token_ttl_seconds,
                              admin_token=settings.admin_token)
        s.authenticators.append(functools.partial(dashboard.cookie_authenticator, s.sessions))
        # this replica's webhook delivery, woken by its own commits
        s.webhooks = Deliverer(dsn, s.pool, settings)
        listeners.append(s.webhooks.wake)
        s.webhooks.start()
        for hook in extra_startup:
            res = hook(app)
            if asyncio.iscoroutine(res):
                await res
        try:
            yield
        finally:
            await s.webhooks.stop()
            await s.hub.stop()
            await cancel_all(s.background)
            await s.writer.stop()
            try:
                # graceful: waits for every acquired connection to come back; a
                # task cancelled inside acquire() can leave one out for good
                await asyncio.wait_for(s.pool.close(), 5)
            except TimeoutError:
                log.warning("the connection pool did not close in 5 s; terminating it")
                s.pool.terminate()
            if tracing is not None:
                tracing.stop()

    metrics = Metrics(cache_seconds=settings.metrics_cache_seconds)
    tracing = Tracing(tracer_provider) if settings.otel or tracer_provider is not None else None
    services = Services(settings, metrics)
    app = Litestar(
        route_handlers=[h for m in _ROUTE_MODULES for h in m.ROUTES],
        lifespan=[lifespan],
        state=State({"services": services}),
        dependencies=dependencies(services),
        exception_handlers=exception_handlers,
        before_request=_reject_bad_input,
        middleware=[
            request_middleware(metrics),
            DefineMiddleware(AuthMiddleware, exclude=[f"^{p}" for p in PUBLIC_PATHS] + ["^/$", "^/static/", "^/ui/"],
                             tokens=lambda: services.tokens, authenticators=services.authenticators),
        ],
        request_max_body_size=settings.max_body_bytes,
        plugins=[] if tracing is None else [tracing.plugin],
        logging_config=None,  # service.logs configures logging once per process; Litestar would redo the root
        openapi_config=OpenAPIConfig(
            title="taskledger",
            version="0.1.0",
            description="Event-sourced maker-checker workflow service.",
            path="/schema",
            render_plugins=[],
            components=Components(
                security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}
            ),
            security=[{"bearer": []}],
        ),
        debug=False,
    )
    openapi_docs.install(app)
    app.asgi_handler = streams.keep_server_send(app.asgi_handler)
    return app
