"""Request ids on every log line, JSON logs under `serve`, and OpenTelemetry traces."""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from litestar import get
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from taskledger.service.http.app import create_app
from taskledger.service.logs import ContextFilter, JsonFormatter
from tests.conftest import ADMIN_TOKEN, ServerProcess, settings_for

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@get("/test-logs", operation_id="testLogs", exclude_from_auth=True)
async def _logs_a_line() -> str:
    logging.getLogger("taskledger.test").warning("inside the handler")
    return "ok"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    logging.getLogger("taskledger.access").setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("taskledger.access").setLevel(logging.NOTSET)


async def test_lines_logged_while_serving_a_request_carry_its_request_and_correlation_ids(
    db_url: str, captured: io.StringIO
) -> None:
    app = create_app(settings_for(db_url))
    app.register(_logs_a_line)
    async with AsyncTestClient(app=app, timeout=30) as http:
        r = await http.get("/test-logs", headers={"X-Request-Id": "req-42", "X-Correlation-Id": "corr-7"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
        other = await http.get("/test-logs")
    lines = [json.loads(ln) for ln in captured.getvalue().splitlines()]
    mine = [ln for ln in lines if ln.get("request_id") == "req-42"]
    assert {ln["logger"] for ln in mine} == {"taskledger.test", "taskledger.access"}, lines
    assert all(ln["correlation_id"] == "corr-7" for ln in mine)
    handler_line = next(ln for ln in mine if ln["logger"] == "taskledger.test")
    assert handler_line["message"] == "inside the handler" and handler_line["level"] == "WARNING"
    # a request without an id gets one, answered and logged
    generated = other.headers["x-request-id"]
    assert len(generated) == 32
    assert [ln["logger"] for ln in lines if ln.get("request_id") == generated] == [
        "taskledger.test", "taskledger.access"]
    assert not any("correlation_id" in ln for ln in lines if ln.get("request_id") == generated)


async def test_the_request_id_a_client_did_not_send_is_the_one_in_the_events_meta(db_url: str) -> None:
    app = create_app(settings_for(db_url))
    async with AsyncTestClient(app=app, timeout=30) as http:
        r = await http.post("/tasks", json={"id": "T-rid", "project": "p", "title": "t"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        events = (await http.get("/tasks/T-rid/events", headers=ADMIN)).json()["events"]
    assert events[0]["meta"]["request_id"] == r.headers["x-request-id"]


def test_serve_logs_json_lines_with_the_request_id(db_url: str) -> None:
    server = ServerProcess(db_url, env={"TASKLEDGER_LOG_LEVEL": "INFO"}).start()
    rid = "serve-" + uuid.uuid4().hex
    try:
        with server.client() as admin:
            assert admin.get("/events", headers={"X-Request-Id": rid}).status_code == 200
        deadline = time.monotonic() + 10
        while rid not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.stop()
    lines = [json.loads(ln) for ln in server.log().splitlines() if rid in ln]
    assert lines and all(ln["request_id"] == rid for ln in lines), server.log()
    access = next(ln for ln in lines if ln["logger"] == "taskledger.access")
    assert access["route"] == "/events" and access["status"] == 200 and access["method"] == "GET"


async def test_with_otel_a_request_makes_an_http_span_with_asyncpg_child_spans(db_url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(settings_for(db_url), tracer_provider=provider)
    async with AsyncTestClient(app=app, timeout=30) as http:
        assert (await http.get("/healthz")).status_code == 200
        # health checks and scrapes are not traced
        assert not [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        r = await http.get("/events", headers=ADMIN)
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    server = [s for s in spans if s.kind == SpanKind.SERVER and s.name == "GET /events"]
    assert len(server) == 1, [(s.name, s.kind) for s in spans]
    root = server[0]
    assert root.attributes is not None and root.attributes["http.route"] == "/events"
    db = [s for s in spans if s.attributes and s.attributes.get("db.system") == "postgresql"
          and s.parent is not None and s.parent.span_id == root.context.span_id]
    assert db, [(s.name, s.parent) for s in spans]
    assert all(s.context.trace_id == root.context.trace_id for s in db)


async def test_tracing_is_off_by_default(db_url: str) -> None:
    app = create_app(settings_for(db_url))
    assert not any(type(p).__name__ == "OpenTelemetryPlugin" for p in app.plugins)
    async with AsyncTestClient(app=app, timeout=30) as http:
        assert (await http.get("/events", headers=ADMIN)).status_code == 200


def test_otel_setting_turns_tracing_on(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    app = create_app(settings_for(db_url, otel=True))
    assert any(type(p).__name__ == "OpenTelemetryPlugin" for p in app.plugins)


def test_json_lines_survive_odd_extras() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %s", ("!",), None)
    record.payload = {"a": object()}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "boom !" and line["level"] == "ERROR" and "payload" in line
