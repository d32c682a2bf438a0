"""Bad input is a 4xx problem, always, and writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from taskledger.service.http.app import MAX_JSON_DEPTH, json_depth
from tests.conftest import AppHarness


async def _head(h: AppHarness) -> int:
    return int((await h.admin.get("/events", params={"limit": 1})).json()["head_seq"])


async def _post_raw(h: AppHarness, path: str, body: bytes, **headers: str) -> Any:
    return await h.http.post(path, content=body, headers={
        **h.admin.headers, "content-type": "application/json", **headers})


def _problem(r: Any, status: int = 400, code: str = "validation_error") -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    assert body["code"] == code
    return body


async def test_a_body_that_is_not_utf8_is_400_and_writes_nothing(harness: AppHarness) -> None:
    before = await _head(harness)
    body = b'{"id": "U1", "project": "p", "title": "caf\xe9 \xff\xfe", "verification": null}'
    _problem(await _post_raw(harness, "/tasks", body))
    _problem(await _post_raw(harness, "/tasks", body, **{"Idempotency-Key": "k-utf8"}))
    assert await _head(harness) == before


@pytest.mark.parametrize("opener", ["[", '{"a":'])
async def test_json_nested_deeper_than_64_levels_is_400_and_writes_nothing(
    harness: AppHarness, opener: str
) -> None:
    closer = "]" if opener == "[" else "}"
    deep = opener * 5000 + "1" + closer * 5000
    before = await _head(harness)
    body = ('{"id": "D1", "project": "p", "title": "t", "verification": null, "spec": "s", '
            '"labels": [], "requirements": [], "result": ' + deep + "}").encode()
    _problem(await _post_raw(harness, "/tasks", body))
    worker = await harness.client("worker", node="n1")
    r = await harness.admin.post("/tasks", {"id": "D2", "project": "p", "title": "t", "verification": None})
    assert r.status_code == 201
    claim = (await worker.post("/tasks/claim", {"projects": ["p"]})).json()
    done = ('{"lease_id": "' + claim["lease_id"] + '", "result": ' + deep + "}").encode()
    _problem(await harness.http.post("/tasks/D2/complete", content=done,
                                     headers={**worker.headers, "content-type": "application/json"}))
    assert await _head(harness) == before + 2  # the create and the claim, nothing else


async def test_65_levels_are_refused_and_64_accepted(harness: AppHarness) -> None:
    ok = {"id": "N64", "project": "p", "title": "t", "verification": None}
    nested: Any = 1
    for _ in range(MAX_JSON_DEPTH - 1):  # the body object itself is one level
        nested = [nested]
    r = await harness.admin.post("/tasks", {**ok, "labels": []}, headers={})
    assert r.status_code == 201
    worker = await harness.client("worker", node="n1")
    claim = (await worker.post("/tasks/claim", {"projects": ["p"]})).json()
    await worker.ok(await worker.post(f"/tasks/{claim['id']}/start", {"lease_id": claim["lease_id"]}))
    r = await worker.post(f"/tasks/{claim['id']}/complete", {"lease_id": claim["lease_id"], "result": nested})
    assert r.status_code == 200, r.text
    too_deep = {"lease_id": claim["lease_id"], "result": [nested]}
    _problem(await worker.post(f"/tasks/{claim['id']}/complete", too_deep))


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, "\\"[[[", {"c": []}]}') == 4
    assert json_depth(b'"\\\\"') == 0
    assert json_depth(b"[[]]") == 2


@pytest.mark.parametrize("path", [
    "/tasks?project=a%00b", "/events?types=task.%00", "/jobs?project=%00", "/blockers?project=x%00",
    "/tasks/T1?as_of_seq=1&x=%00",
])
async def test_a_nul_in_any_query_parameter_is_400(harness: AppHarness, path: str) -> None:
    _problem(await harness.admin.get(path))


@pytest.mark.parametrize("path", [
    "/tasks/T1/events?since_seq=2147483648", "/jobs/J1/events?since_seq=2147483648",
    "/tasks/T1/stream?since_seq=2147483648", "/jobs/J1/stream?since_seq=2147483648",
    "/events?since_seq=9223372036854775808", "/stream?since_seq=9223372036854775808",
    "/tasks/T1?as_of_seq=9223372036854775808", "/events?limit=99999999999999999999",
])
async def test_cursors_beyond_their_column_are_400(harness: AppHarness, path: str) -> None:
    await harness.admin.post("/tasks", {"id": "T1", "project": "p", "title": "t", "verification": None})
    await harness.admin.post("/jobs", {"job_id": "J1", "project": "p", "commands": ["true"]})
    _problem(await harness.admin.get(path))


async def test_a_last_event_id_beyond_stream_seq_is_400(harness: AppHarness) -> None:
    await harness.admin.post("/tasks", {"id": "T1", "project": "p", "title": "t", "verification": None})
    _problem(await harness.admin.get("/tasks/T1/stream", headers={"Last-Event-ID": "2147483648"}))


@pytest.mark.parametrize("value", ["x" * 201, "tab\there", "caf\u00e9"])
async def test_x_request_id_is_capped_like_the_correlation_id(harness: AppHarness, value: str) -> None:
    before = await _head(harness)
    body = {"id": "R1", "project": "p", "title": "t", "verification": None}
    raw = value.encode("latin-1")
    for header in ("X-Request-Id", "X-Correlation-Id"):
        r = await harness.http.post("/tasks", json=body, headers=[
            ("authorization", harness.admin.headers["Authorization"]), (header.lower(), raw)])  # type: ignore[list-item]
        _problem(r)
    assert await _head(harness) == before
    r = await harness.admin.post("/tasks", body, headers={"X-Request-Id": "r" * 200})
    assert r.status_code == 201
    ev = (await harness.admin.get("/tasks/R1/events")).json()["events"][0]
    assert ev["meta"]["request_id"] == "r" * 200
