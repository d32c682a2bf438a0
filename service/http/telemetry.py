"""Request context, structured logs and (optional) OpenTelemetry tracing.

- The request middleware, outermost in the app, puts the request id (the
  client's `X-Request-Id` when it is valid, else a new one) and the
  `X-Correlation-Id` into context variables for as long as the request runs,
  answers with `X-Request-Id`, counts the request in the metrics and writes
  one access line (logger `taskledger.access`, INFO).
- service.logs formats every log line with those ids.
- `Tracing` (the `otel` extra, TASKLEDGER_OTEL=1): Litestar's OpenTelemetry
  plugin makes a span per request, the asyncpg instrumentation a span per
  query; the exporter is configured by the standard OTEL_* variables.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from taskledger.service.http.problems import status_of
from taskledger.service.logs import CORRELATION_ID, REQUEST_ID, VALID_ID
from taskledger.service.metrics import Metrics

access_log = logging.getLogger("taskledger.access")


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            try:
                text = bytes(v).decode("ascii")
            except UnicodeDecodeError:
                return None
            return text if VALID_ID.match(text) else None
    return None


def request_middleware(metrics: Metrics) -> Callable[[ASGIApp], ASGIApp]:
    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            method = scope["method"]
            start = time.perf_counter()
            status = 500
            request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
            rid = REQUEST_ID.set(request_id)
            cid = CORRELATION_ID.set(_header(scope, b"x-correlation-id"))

            async def send_wrapper(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                    headers = list(message.get("headers") or [])
                    headers.append((b"x-request-id", request_id.encode()))
                    message = {**message, "headers": headers}
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            except Exception as e:
                # raised by a middleware (401 from authentication, 503 when the
                # token lookup finds no database): the exception handler outside
                # this one answers with this status
                status = status_of(e)
                raise
            finally:
                seconds = time.perf_counter() - start
                route = scope.get("path_template") or "unmatched"
                metrics.observe_request(method, route, status, seconds)
                if access_log.isEnabledFor(logging.INFO):
                    access_log.info("%s %s %d %.1f ms", method, route, status, seconds * 1000,
                                    extra={"method": method, "route": route, "path": scope.get("path"),
                                           "status": status, "duration_ms": round(seconds * 1000, 3)})
                REQUEST_ID.reset(rid)
                CORRELATION_ID.reset(cid)

        return middleware
    return factory


# -- traces ---------------------------------------------------------------------


class Tracing:
    """OpenTelemetry for one app: the Litestar plugin and asyncpg spans.

    `provider` defaults to one built from the environment: OTEL_SERVICE_NAME
    and OTEL_RESOURCE_ATTRIBUTES name the resource, OTEL_TRACES_SAMPLER picks
    the sampler, OTEL_TRACES_EXPORTER is `otlp` (the default; OTLP over HTTP to
    OTEL_EXPORTER_OTLP_ENDPOINT), `console` or `none`.
    """

    def __init__(self, provider: Any = None) -> None:
        try:
            from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin
            from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
        except ImportError as e:  # pragma: no cover - depends on the installed extras
            raise RuntimeError("TASKLEDGER_OTEL=1 needs the otel extra: pip install 'taskledger[otel]'") from e
        self.provider = provider if provider is not None else _provider_from_env()
        self.plugin = OpenTelemetryPlugin(OpenTelemetryConfig(
            tracer_provider=self.provider, scope_span_details_extractor=_span_details,
            exclude=["^/metrics$", "^/healthz$", "^/readyz$"]))
        self._asyncpg = AsyncPGInstrumentor()  # type: ignore[no-untyped-call]

    def start(self) -> None:
        # The instrumentation patches asyncpg for the whole process: the last
        # app started in a process is the one whose provider gets the spans.
        if self._asyncpg.is_instrumented_by_opentelemetry:
            self._asyncpg.uninstrument()
        self._asyncpg.instrument(tracer_provider=self.provider)

    def stop(self) -> None:
        if self._asyncpg.is_instrumented_by_opentelemetry:
            self._asyncpg.uninstrument()
        self.provider.force_flush()


def _span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    """Spans named by route template (`GET /tasks/{task_id:str}`), not by path, so they group."""
    from opentelemetry.semconv.attributes.http_attributes import HTTP_ROUTE

    route = scope.get("path_template") or scope.get("path", "")
    method = scope.get("method")
    name = f"{method} {route}" if method else str(route)
    return name, {HTTP_ROUTE: route}


def _provider_from_env() -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "taskledger"})
    provider = TracerProvider(resource=resource)
    kind = (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").lower()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif kind != "none":
        raise ValueError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, not {kind!r}")
    return provider
