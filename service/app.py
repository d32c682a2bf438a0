"""The one app factory: `create_app(settings) -> Litestar`."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from litestar import Litestar, Request
from litestar.datastructures import State
from litestar.enums import ScopeType
from litestar.exceptions import ValidationException
from litestar.middleware.base import DefineMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.types import ASGIApp, Receive, Scope, Send

from service.auth import PUBLIC_PATHS, AuthMiddleware, TokenStore
from service.metrics import Metrics
from service.migrate import migrate
from service.problems import exception_handlers
from service.settings import Settings
from service.writer import Writer

log = logging.getLogger("taskledger")

# JSON strings cannot carry U+0000 into jsonb; an escaped NUL is refused up front
# (an even run of backslashes before it is an escaped backslash, not an escape).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


# Resource modules: each has ROUTES, and may have startup(app) / shutdown(app).
_MODULES: Sequence[str] = (
    "service.routes.system",
    "service.routes.tasks",
    "service.routes.task_batches",
    "service.routes.jobs",
    "service.routes.streams",
    "service.routes.admin",
    "service.routes.dashboard",
)


def _modules() -> list[Any]:
    return [importlib.import_module(name) for name in _MODULES]


def _flatten(handlers: list[Any]) -> list[Any]:
    out: list[Any] = []
    for h in handlers:
        if isinstance(h, list | tuple):
            out.extend(h)
        else:
            out.append(h)
    return out


async def _reject_nul(request: Request[Any, Any, Any]) -> None:
    if request.method in ("POST", "PUT", "PATCH"):
        body = await request.body()
        if _NUL_ESCAPE.search(body):
            raise ValidationException("strings may not contain U+0000")


def _metrics_middleware(metrics: Metrics) -> Callable[[ASGIApp], ASGIApp]:
    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            method = scope["method"]
            start = time.perf_counter()
            status = 500

            async def send_wrapper(message: Any) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            finally:
                route = scope.get("path_template") or "unmatched"
                metrics.observe_request(method, route, status, time.perf_counter() - start)

        return middleware
    return factory


Hook = Callable[[Litestar], Any]


def create_app(settings: Settings, *, extra_startup: Sequence[Hook] = ()) -> Litestar:
    if not settings.database_url:
        raise ValueError("create_app needs settings.database_url")
    dsn = settings.database_url

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        state = app.state
        if settings.migrate_on_start:
            conn = await asyncpg.connect(dsn)
            try:
                await migrate(conn)
            finally:
                await conn.close()
        state.pool = await asyncpg.create_pool(
            dsn, min_size=settings.pool_min, max_size=settings.pool_max
        )
        state.tokens = TokenStore(state.pool, settings.admin_token)
        listeners: list[Callable[[int], None]] = []
        state.commit_listeners = listeners

        def on_commit(head: int) -> None:
            for fn in listeners:
                fn(head)

        state.writer = Writer(dsn, batch_max=settings.batch_max, metrics=state.metrics, on_commit=on_commit)
        await state.writer.start()
        state.metrics.gauge("writer_queue_depth", lambda: state.writer.queue_depth)
        background: list[asyncio.Task[Any]] = []
        state.background = background
        for hook in [*(getattr(m, "startup", None) for m in modules), *extra_startup]:
            if hook is None:
                continue
            res = hook(app)
            if asyncio.iscoroutine(res):
                await res
        try:
            yield
        finally:
            for fn in reversed([getattr(m, "shutdown", None) for m in modules]):
                if fn is None:
                    continue
                res = fn(app)
                if asyncio.iscoroutine(res):
                    await res
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await state.writer.stop()
            await state.pool.close()

    metrics = Metrics()
    modules = _modules()
    state = State({"settings": settings, "metrics": metrics, "extra_authenticators": []})
    handlers = _flatten([m.ROUTES for m in modules])
    app = Litestar(
        route_handlers=handlers,
        lifespan=[lifespan],
        state=state,
        exception_handlers=exception_handlers,
        before_request=_reject_nul,
        middleware=[
            _metrics_middleware(metrics),
            DefineMiddleware(AuthMiddleware, exclude=[f"^{p}" for p in PUBLIC_PATHS] + ["^/$", "^/static/", "^/ui/"]),
        ],
        request_max_body_size=settings.max_body_bytes,
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
    return app
