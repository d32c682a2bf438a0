"""The committed OpenAPI document is the app's, to the byte."""

from __future__ import annotations

from pathlib import Path

from taskledger.service.http.openapi import render

COMMITTED = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"


def test_committed_openapi_matches_the_app() -> None:
    assert COMMITTED.read_text() == render(), (
        "openapi/openapi.json is stale: run `make openapi` and commit the result")


def test_every_operation_has_an_explicit_id() -> None:
    import json

    doc = json.loads(render())
    ops = [op for path in doc["paths"].values() for op in path.values() if isinstance(op, dict)]
    assert ops and all(op.get("operationId") for op in ops)
    ids = [op["operationId"] for op in ops]
    assert len(ids) == len(set(ids))


async def test_the_service_serves_the_same_document(harness: object) -> None:
    import json

    r = await harness.anonymous().get("/schema/openapi.json")  # type: ignore[attr-defined]
    assert r.status_code == 200
    assert r.json() == json.loads(COMMITTED.read_text())
