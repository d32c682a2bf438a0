"""The client's Structs agree with openapi/openapi.json: every field the client
knows exists in the service's schema with a compatible type, and every field
the schema requires is one the client has."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from taskledger.client import models
from tests.conftest import ROOT

SPEC = json.loads((ROOT / "openapi" / "openapi.json").read_text())
SCHEMAS: dict[str, Any] = SPEC["components"]["schemas"]

# client Struct -> (schema name, direction): "in" = the client sends it, "out" = the client reads it
PAIRS: list[tuple[type[msgspec.Struct], str, str]] = [
    (models.CreateTask, "CreateTask", "in"),
    (models.Subtask, "SubtaskBody", "in"),
    (models.Requirement, "RequirementBody", "in"),
    (models.Verification, "VerificationBody", "in"),
    (models.Claim, "ClaimBody", "in"),
    (models.ClaimBatch, "ClaimBatch", "in"),
    (models.ClaimJob, "ClaimRequest", "in"),
    (models.JobReport, "ReportRequest", "in"),
    (models.Lease, "LeaseBody", "in"),
    (models.Heartbeat, "HeartbeatBody", "in"),
    (models.Verdict, "VerdictBody", "in"),
    (models.Complete, "CompleteBody", "in"),
    (models.CreateBatch, "CreateBatch", "in"),
    (models.StartEntry, "StartEntry", "in"),
    (models.StartBatch, "StartBatch", "in"),
    (models.CompleteEntry, "CompleteEntry", "in"),
    (models.CompleteBatch, "CompleteBatch", "in"),
    (models.Fail, "FailBody", "in"),
    (models.Release, "ReleaseBody", "in"),
    (models.Reassign, "ReassignBody", "in"),
    (models.Cancel, "CancelBody", "in"),
    (models.Unblock, "UnblockBody", "in"),
    (models.RoundReview, "RoundReviewBody", "in"),
    (models.Collect, "CollectBody", "in"),
    (models.CreateJob, "CreateJobRequest", "in"),
    (models.CreateToken, "TokenRequest", "in"),
    (models.CreateWebhook, "CreateWebhook", "in"),
    (models.Task, "TaskState", "out"),
    (models.VerdictRecord, "VerdictRecord", "out"),
    (models.Unmet, "Unmet", "out"),
    (models.TaskPage, "TaskList", "out"),
    (models.EventPage, "EventPage", "out"),
    (models.StreamPage, "StreamPage", "out"),
    (models.BlockerList, "BlockerList", "out"),
    (models.TokenCreated, "TokenResponse", "out"),
    (models.Webhook, "WebhookView", "out"),
    (models.WebhookList, "WebhookList", "out"),
    (models.Delivery, "DeliveryView", "out"),
    (models.DeliveryList, "DeliveryList", "out"),
]


def _types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a schema admits (a $ref is an object; no type at all is anything)."""
    if "$ref" in schema:
        return {"object"}
    out: set[str] = set()
    for alt in schema.get("oneOf", []) + schema.get("anyOf", []):
        out |= _types(alt)
    t = schema.get("type")
    if isinstance(t, str):
        out.add(t)
    elif isinstance(t, list):
        out.update(t)
    if "enum" in schema:
        out.update("null" if v is None else {str: "string", int: "integer", bool: "boolean"}[type(v)]
                   for v in schema["enum"])
    if "const" in schema:
        out.add("null" if schema["const"] is None else "string")
    if not out and not schema.get("oneOf") and not schema.get("anyOf"):
        return {"any"}
    return out


def _fits(narrow: set[str], wide: set[str]) -> bool:
    if "any" in wide or "any" in narrow:  # a side that declares no type cannot disagree
        return True
    widened = set(wide) | ({"integer"} if "number" in wide else set())
    return narrow <= widened


def _client_schema(cls: type[msgspec.Struct]) -> dict[str, Any]:
    _, defs = msgspec.json.schema_components([cls], ref_template="#/$defs/{name}")
    return defs[cls.__name__]


def check(cls: type[msgspec.Struct], name: str, direction: str) -> None:
    assert name in SCHEMAS, f"openapi.json has no schema {name}"
    server = SCHEMAS[name]
    mine = _client_schema(cls)
    server_props: dict[str, Any] = server.get("properties", {})
    for field, prop in mine.get("properties", {}).items():
        assert field in server_props, f"{cls.__name__}.{field} is not in {name}"
        ours, theirs = _types(prop), _types(server_props[field])
        # what the client sends must be accepted; what the service sends must be readable
        ok = _fits(ours, theirs) if direction == "in" else _fits(theirs, ours)
        assert ok, f"{cls.__name__}.{field}: client {sorted(ours)} vs {name} {sorted(theirs)}"
        if "array" in ours and "items" in prop and "items" in server_props[field]:
            a, b = _types(prop["items"]), _types(server_props[field]["items"])
            assert (_fits(a, b) if direction == "in" else _fits(b, a)), f"{cls.__name__}.{field} items"
    for field in server.get("required", []):
        assert field in mine.get("properties", {}), f"{name} requires {field}, which {cls.__name__} lacks"
    if direction == "out":
        for field in mine.get("required", []):
            assert field in server.get("required", []), (
                f"{cls.__name__} requires {field}, which {name} does not promise")
    else:  # a body the service refuses without a field must not be sendable without it
        for field in server.get("required", []):
            assert field in mine.get("required", []), f"{name} requires {field}; {cls.__name__} may omit it"


@pytest.mark.parametrize(("cls", "name", "direction"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_client_struct_matches_the_openapi_schema(cls: type[msgspec.Struct], name: str, direction: str) -> None:
    check(cls, name, direction)


class _UnknownField(msgspec.Struct, kw_only=True):
    lease_id: str
    lease_minutes: int


class _WrongType(msgspec.Struct, kw_only=True):
    id: str
    project: str
    title: str
    attempt: str


class _MissingRequired(msgspec.Struct, kw_only=True):
    lease_id: str = ""


class _RequiresTooMuch(msgspec.Struct, kw_only=True):
    id: str
    project: str
    title: str
    lease_id: str


@pytest.mark.parametrize(("cls", "name", "direction"), [
    (_UnknownField, "LeaseBody", "in"), (_WrongType, "TaskState", "out"),
    (_MissingRequired, "FailBody", "in"), (_RequiresTooMuch, "TaskState", "out"),
])
def test_the_check_catches_a_struct_that_disagrees(cls: type[msgspec.Struct], name: str, direction: str) -> None:
    with pytest.raises(AssertionError):
        check(cls, name, direction)


@pytest.mark.parametrize("path", ["/tasks/batch", "/tasks/claim/batch", "/tasks/start/batch", "/tasks/complete/batch"])
def test_every_batch_route_answers_what_task_batch_reads(path: str) -> None:
    responses = SPEC["paths"][path]["post"]["responses"]
    ok = next(r for status, r in responses.items() if status.startswith("2"))
    schema = ok["content"]["application/json"]["schema"]
    mine = _client_schema(models.TaskBatch)
    assert set(mine["properties"]) == set(schema["properties"]) and mine["required"] == schema["required"]
    assert schema["properties"]["tasks"]["items"] == {"$ref": "#/components/schemas/TaskState"}
    assert issubclass(models.Claimed, models.TaskBatch)
