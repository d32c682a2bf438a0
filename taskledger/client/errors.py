"""problem+json answers as exceptions: one class per family, each carrying the
service's `code`, `status`, `title`, `detail` and the whole problem document,
and for a refused batch the `index` of the entry it is about."""

from __future__ import annotations

from typing import Any

import msgspec


class TaskledgerError(Exception):
    """Anything the service refused, or could not be reached for."""

    status: int = 0
    code: str = "error"
    index: int | None = None  # a batch's refused entry (the problem's first `errors[].index`)

    def __init__(self, detail: str, *, status: int | None = None, code: str | None = None,
                 title: str = "", problem: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.title = title
        self.problem: dict[str, Any] = problem or {}
        self.index = _first_index(self.problem)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.detail}" if self.status else f"{self.code}: {self.detail}"


class TransportError(TaskledgerError):
    """The service could not be reached (after the retries the client was allowed)."""

    code = "transport_error"


class ValidationError(TaskledgerError):
    status, code = 400, "validation_error"


class Unauthorized(TaskledgerError):
    status, code = 401, "unauthorized"


class Forbidden(TaskledgerError):
    status, code = 403, "forbidden"


class NotFound(TaskledgerError):
    status, code = 404, "not_found"


class TaskNotFound(NotFound):
    code = "task_not_found"


class JobNotFound(NotFound):
    code = "job_not_found"


class Conflict(TaskledgerError):
    """409: the request does not fit the current state; nothing was written."""

    status, code = 409, "conflict"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class LeaseMismatch(Conflict):
    """The lease is not (or no longer) the caller's: stop working on the task."""

    code = "lease_mismatch"


class VersionConflict(Conflict):
    code = "version_conflict"


class IdempotencyConflict(Conflict):
    code = "idempotency_conflict"


class JobAlreadyCancelled(Conflict):
    code = "job_already_cancelled"


class PayloadTooLarge(TaskledgerError):
    status, code = 413, "payload_too_large"


class TooManyRequests(TaskledgerError):
    status, code = 429, "too_many_requests"


class Unavailable(TaskledgerError):
    """503 after every retry: the service or its database is down for now."""

    status, code = 503, "unavailable"


class ServerError(TaskledgerError):
    status, code = 500, "internal_error"


def _first_index(problem: dict[str, Any]) -> int | None:
    errors = problem.get("errors")
    for e in errors if isinstance(errors, list) else []:
        i = e.get("index") if isinstance(e, dict) else None
        if isinstance(i, int) and not isinstance(i, bool):
            return i
    return None


_BY_CODE: dict[str, type[TaskledgerError]] = {
    cls.code: cls
    for cls in (ValidationError, Unauthorized, Forbidden, NotFound, TaskNotFound, JobNotFound, Conflict,
                InvalidTransition, LeaseMismatch, VersionConflict, IdempotencyConflict, JobAlreadyCancelled,
                PayloadTooLarge, TooManyRequests, Unavailable, ServerError)
}
_BY_STATUS: dict[int, type[TaskledgerError]] = {
    400: ValidationError, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
    413: PayloadTooLarge, 422: ValidationError, 429: TooManyRequests, 503: Unavailable,
}


def from_response(status: int, body: bytes) -> TaskledgerError:
    """The exception for an error answer: by its problem `code`, else by its status."""
    problem: dict[str, Any] = {}
    try:
        decoded = msgspec.json.decode(body) if body else {}
        if isinstance(decoded, dict):
            problem = decoded
    except msgspec.DecodeError:
        pass
    code = problem.get("code")
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    if cls is None:
        cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else TaskledgerError)
    detail = problem.get("detail") or body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    return cls(str(detail), status=status, code=code if isinstance(code, str) else None,
               title=str(problem.get("title") or ""), problem=problem)
