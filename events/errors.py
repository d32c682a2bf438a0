"""Domain and store errors.

Each carries the contract's error `code` and the HTTP status it maps to; the
service turns them into problem+json in one place (`service.problems`).
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    code = "domain_error"
    status = 400
    title = "Request refused"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class ValidationFailed(DomainError):
    code = "validation_error"
    status = 400
    title = "Invalid request"


class NotFound(DomainError):
    code = "not_found"
    status = 404
    title = "Not found"


class TaskNotFound(NotFound):
    code = "task_not_found"
    title = "Task not found"


class JobNotFound(NotFound):
    code = "job_not_found"
    title = "Job not found"


class Forbidden(DomainError):
    code = "forbidden"
    status = 403
    title = "Forbidden"


class Conflict(DomainError):
    code = "conflict"
    status = 409
    title = "Conflict"


class InvalidTransition(Conflict):
    code = "invalid_transition"
    title = "Transition not allowed"


class LeaseMismatch(Conflict):
    code = "lease_mismatch"
    title = "Lease mismatch"


class VersionConflict(Conflict):
    code = "version_conflict"
    title = "Version conflict"


class IdempotencyConflict(Conflict):
    code = "idempotency_conflict"
    title = "Idempotency key reused with another request"


class AlreadyExists(Conflict):
    code = "already_exists"
    title = "Already exists"


class JobAlreadyCancelled(Conflict):
    code = "job_already_cancelled"
    title = "Job already cancelled"
