"""Route handlers get what they use by name, through Litestar's dependency injection
(service/http/deps.py): those names stay out of what clients send."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from taskledger.service.http import deps
from taskledger.service.http.app import create_app
from taskledger.service.metrics import Metrics
from taskledger.service.settings import Settings
from tests.conftest import AppHarness

ROUTES = Path(__file__).resolve().parents[2] / "service" / "http" / "routes"
INJECTED = sorted(deps.dependencies(deps.Services(Settings(), Metrics())))


def _request_names(document: dict[str, Any]) -> set[str]:
    """Every query, path and header parameter, and every top-level body field, of every route."""
    schemas = document["components"]["schemas"]
    names: set[str] = set()

    def fields(schema: dict[str, Any]) -> None:
        if "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        names.update(schema.get("properties", {}))
        for alternative in schema.get("oneOf", []) + schema.get("anyOf", []):
            fields(alternative)

    for path in document["paths"].values():
        for op in path.values():
            names.update(p["name"] for p in op.get("parameters", []))
            for media in op.get("requestBody", {}).get("content", {}).values():
                fields(media["schema"])
    return names


def test_no_request_field_or_parameter_shares_a_name_with_an_injected_dependency() -> None:
    # Litestar reports a client's invalid value under a dependency's name as a
    # failed dependency (500): a body field named `commands` did exactly that.
    document = create_app(Settings(database_url="postgresql://unused/none")).openapi_schema.to_schema()
    sent = _request_names(document)
    assert {"commands", "since_seq", "lease_id", "state"} <= sent  # the walk finds what clients send
    assert not sent & set(INJECTED)


async def test_a_query_parameter_named_like_an_injected_dependency_is_refused(harness: AppHarness) -> None:
    # the list routes take `pool` (and may come to take others): still no filter of that name
    for name in INJECTED:
        for path in ("/tasks", "/events", "/jobs", "/blockers"):
            r = await harness.admin.get(path, params={name: "1"})
            assert r.status_code == 400 and r.json()["code"] == "validation_error", (name, path, r.text)
            assert name in r.json()["detail"]


def test_route_modules_declare_what_they_use_instead_of_reaching_into_app_state() -> None:
    offenders = [f"{f.name}:{n}" for f in sorted(ROUTES.glob("*.py"))
                 for n, line in enumerate(f.read_text().splitlines(), 1) if re.search(r"\bapp\.state\b", line)]
    assert offenders == []
