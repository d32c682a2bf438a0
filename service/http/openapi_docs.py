"""The OpenAPI document tells the whole truth: every answer a route can give.

Litestar documents what a handler returns and a generic 400; the service also
answers problem+json for auth (401/403), missing resources (404), refused
transitions (409), large bodies (413), stream caps (429) and outages (503).
`complete` adds those to every operation from one table, marks the public
routes as needing no token, and names the schema of answers whose handler
returns a replayable `Response[Any]` (idempotent commands).
"""

from __future__ import annotations

import copy
from typing import Any, Final

from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin

PROBLEM: Final = "application/problem+json"
_REF: Final = {"$ref": "#/components/schemas/Problem"}

PROBLEM_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "description": "RFC 9457 problem details; `code` is the contract's error code.",
    "required": ["type", "title", "status", "detail", "code"],
    "properties": {
        "type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
        "detail": {"type": "string"}, "code": {"type": "string"},
    },
    "additionalProperties": True,
}

_WHY: Final = {
    400: "invalid input (validation_error): nothing was written",
    401: "no token, or an unknown, revoked or expired one (unauthorized); carries WWW-Authenticate: Bearer",
    403: "the token's role may not do this (forbidden)",
    404: "no such resource",
    409: "the current state does not allow this, or an Idempotency-Key was reused with another request",
    413: "the body is larger than the service accepts (payload_too_large)",
    429: "this token has too many open streams",
    503: "the database is unreachable (unavailable) or the writer's queue is full (overloaded); see Retry-After",
}
_RETRY_AFTER: Final = {"Retry-After": {"description": "seconds to wait before retrying",
                                       "schema": {"type": "integer"}}}

# Routes a client reaches without a token.
PUBLIC: Final = {("get", "/healthz"), ("get", "/readyz"), ("get", "/metrics"), ("get", "/"),
                 ("post", "/ui/session"), ("get", "/ui/session"), ("delete", "/ui/session")}
# Answers without the database, so never 503; and never 401 (the session routes
# are public but refuse a bad token or cookie).
_NO_DATABASE: Final = {("get", "/healthz"), ("get", "/metrics"), ("get", "/")}
_NEVER_401: Final = _NO_DATABASE | {("get", "/readyz")}
# Claims answer 204 when there is nothing to claim.
_EMPTY_204: Final = {"claimTask", "claimJob"}

# operationId -> the schema of its success answer, where the handler cannot say.
_TASK_VIEW: Final = {"$ref": "#/components/schemas/TaskState"}
_SUCCESS_SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "createTask": _TASK_VIEW, "getTask": _TASK_VIEW, "claimTask": _TASK_VIEW, "startTask": _TASK_VIEW,
    "completeTask": _TASK_VIEW, "failTask": _TASK_VIEW, "cancelTask": _TASK_VIEW, "unblockTask": _TASK_VIEW,
    "reviewRound": _TASK_VIEW,
    **{op: {"type": "object", "required": ["tasks"], "properties": {"tasks": {"type": "array", "items": _TASK_VIEW}}}
       for op in ("createTasks", "claimTasks", "startTasks", "completeTasks")},
}
_OBJECT: Final = {"type": "object"}


def _problem(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"description": _WHY[status], "content": {PROBLEM: {"schema": _REF}}}
    if status == 503:
        out["headers"] = _RETRY_AFTER
    if status == 401:
        out["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def complete(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc.setdefault("components", {}).setdefault("schemas", {})["Problem"] = PROBLEM_SCHEMA
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses: dict[str, Any] = op["responses"]
            public = (method, path) in PUBLIC
            streams = any(PROBLEM not in k and "event-stream" in k
                          for r in responses.values() for k in r.get("content", {}))
            statuses = {400}
            if not public:
                statuses |= {401, 403, 404}
            elif (method, path) not in _NEVER_401:
                statuses |= {401}
            if method in ("post", "delete", "put", "patch"):
                statuses |= {409}
            if "requestBody" in op:
                statuses |= {413}
            if streams:
                statuses |= {429}
            if (method, path) not in _NO_DATABASE:
                statuses |= {503}
            for status in statuses:
                responses[str(status)] = _problem(status)
            if public:
                op["security"] = []
            if op.get("operationId") == "rebuildProjections" and "202" in responses:
                responses["200"] = {**responses["202"], "description": "with wait: true, the finished rebuild"}
            if op.get("operationId") in _EMPTY_204:
                responses["204"] = {"description": "nothing to claim now"}
            if "204" in responses:
                responses["204"].pop("content", None)  # no body
            for code, r in responses.items():
                for media, content in r.get("content", {}).items():
                    if content.get("schema") in ({}, None) and media == "application/json" and code[0] == "2":
                        content["schema"] = _SUCCESS_SCHEMAS.get(op.get("operationId", ""), _OBJECT)
    return doc


def install(app: Litestar) -> None:
    """Build the app's document once, completed; /schema/openapi.json serves it."""
    plugin = app.plugins.get(OpenAPIPlugin)
    plugin._openapi_schema = complete(plugin.provide_openapi().to_schema())


def document(app: Litestar) -> dict[str, Any]:
    schema: dict[str, Any] = app.plugins.get(OpenAPIPlugin).provide_openapi_schema()
    return schema
