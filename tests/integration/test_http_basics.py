"""The HTTP skeleton: auth, roles, problem+json, limits, health, metrics, /events."""

from __future__ import annotations

from tests.conftest import AppHarness


async def test_health_and_readiness_need_no_token(harness: AppHarness) -> None:
    anon = harness.anonymous()
    assert (await anon.get("/healthz")).json() == {"status": "ok"}
    r = await anon.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"


async def test_metrics_are_prometheus_text(harness: AppHarness) -> None:
    await harness.admin.get("/events")
    r = await harness.anonymous().get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "taskledger_http_requests_total{" in r.text
    assert "# TYPE taskledger_http_request_seconds histogram" in r.text


async def test_missing_and_unknown_tokens_are_401_problems(harness: AppHarness) -> None:
    r = await harness.anonymous().get("/events")
    assert r.status_code == 401
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == "unauthorized" and body["status"] == 401 and body["title"] and body["type"]
    r = await harness.anonymous().get("/events", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


async def test_only_admin_creates_tokens(harness: AppHarness) -> None:
    reader = await harness.client("reader")
    r = await reader.post("/tokens", {"role": "admin", "name": "x"})
    assert r.status_code == 403 and r.json()["code"] == "forbidden"


async def test_token_requests_are_validated(harness: AppHarness) -> None:
    a = harness.admin
    for body in ({"role": "wizard", "name": "x"}, {"role": "reader"}, {"role": "reader", "name": "x", "extra": 1},
                 {"role": "worker", "name": "w"}, {"role": "reader", "name": ""}):
        r = await a.post("/tokens", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == "validation_error"


async def test_malformed_json_is_a_400_problem(harness: AppHarness) -> None:
    r = await harness.admin.http.post("/tokens", content=b"{not json", headers={
        **harness.admin.headers, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "validation_error"


async def test_a_12_megabyte_body_is_413(harness: AppHarness) -> None:
    r = await harness.admin.http.post("/tokens", content=b"x" * (12 * 1024 * 1024), headers={
        **harness.admin.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"


async def test_escaped_nul_in_a_string_is_refused(harness: AppHarness) -> None:
    r = await harness.admin.http.post("/tokens", content=b'{"role":"reader","name":"a\\u0000b"}', headers={
        **harness.admin.headers, "content-type": "application/json"})
    assert r.status_code == 400


async def test_events_page_and_bad_cursors(harness: AppHarness) -> None:
    a = harness.admin
    body = (await a.get("/events", params={"since_seq": 0})).json()
    assert body == {"events": [], "next_seq": 0, "head_seq": 0}
    for bad in ("-1", "abc", "1.5", "99"):
        r = await a.get("/events", params={"since_seq": bad})
        assert r.status_code == 400, (bad, r.text)
    assert (await a.get("/events", params={"limit": 0})).status_code == 400
    assert (await a.get("/events", params={"limit": 100001})).status_code == 400
