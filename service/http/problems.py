"""One mapping from errors to application/problem+json (RFC 9457)."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from taskledger.events.errors import DomainError
from taskledger.service.writer.engine import WriterOverloaded, WriterUnavailable

log = logging.getLogger("taskledger.http")

PROBLEM = "application/problem+json"

_CODES = {
    400: ("validation_error", "Invalid request"),
    401: ("unauthorized", "Unauthorized"),
    403: ("forbidden", "Forbidden"),
    404: ("not_found", "Not found"),
    405: ("method_not_allowed", "Method not allowed"),
    409: ("conflict", "Conflict"),
    413: ("payload_too_large", "Payload too large"),
    415: ("unsupported_media_type", "Unsupported media type"),
    422: ("validation_error", "Invalid request"),
    429: ("too_many_requests", "Too many requests"),
    503: ("unavailable", "Service unavailable"),
}


def problem(status: int, code: str, title: str, detail: str, **extra: Any) -> Response[Any]:
    body = {"type": f"https://taskledger.dev/problems/{code}", "title": title,
            "status": status, "detail": detail, "code": code}
    body.update(extra)
    return Response(content=body, status_code=status, media_type=PROBLEM)


def _domain(_: Request[Any, Any, Any], exc: DomainError) -> Response[Any]:
    return problem(exc.status, exc.code, exc.title, exc.detail, **exc.extra)


RETRY_AFTER_SECONDS = 1

# The driver's ways of saying "the database is not there right now": refused or
# vanished sockets (OSError), a closed connection, a server starting up or
# shutting down (SQLSTATE class 57: operator intervention), a pool that could not
# hand out a connection in time.
DATABASE_DOWN: tuple[type[BaseException], ...] = (
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.OperatorInterventionError,
    OSError,
    TimeoutError,
)


def status_of(exc: BaseException) -> int:
    """The status the handlers below answer `exc` with (for the request metrics)."""
    if isinstance(exc, HTTPException):
        return exc.status_code
    if isinstance(exc, DomainError):
        return exc.status
    if isinstance(exc, (WriterUnavailable, WriterOverloaded, *DATABASE_DOWN)):
        return 503
    return 500


def _http(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    code, title = _CODES.get(status, ("error", "Error"))
    detail = exc.detail or title
    extra: dict[str, Any] = {}
    if isinstance(exc, ValidationException) and exc.extra:
        extra["errors"] = exc.extra
    if status == 413:
        detail = "the request body is larger than this service accepts"
    headers = dict(exc.headers or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    if status == 503:
        headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
    r = problem(status, code, title, str(detail), **extra)
    if headers:
        r.headers.update(headers)
    return r


def _retry_later(status: int, code: str, title: str, detail: str) -> Response[Any]:
    r = problem(status, code, title, detail)
    r.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return r


def _unavailable(_: Request[Any, Any, Any], exc: WriterUnavailable) -> Response[Any]:
    return _retry_later(503, "unavailable", "Service unavailable", str(exc))


def _overloaded(_: Request[Any, Any, Any], exc: WriterOverloaded) -> Response[Any]:
    return _retry_later(503, "overloaded", "Service overloaded", str(exc))


def _database_down(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    # The driver's text names hosts, sockets and users: it goes to the log only.
    log.warning("database unavailable on %s %s: %r", request.method, request.url.path, exc)
    return _retry_later(503, "unavailable", "Service unavailable", "the database is not reachable; retry later")


def _internal(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem(HTTP_500_INTERNAL_SERVER_ERROR, "internal_error", "Internal error",
                   "the service failed to handle this request")


exception_handlers: dict[Any, Any] = {
    DomainError: _domain,
    HTTPException: _http,
    WriterUnavailable: _unavailable,
    WriterOverloaded: _overloaded,
    **dict.fromkeys(DATABASE_DOWN, _database_down),
    Exception: _internal,
}
