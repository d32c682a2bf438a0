"""The taskledger Python client: `Client` (blocking) and `AsyncClient` (asyncio),
on httpx and httpx-sse, with the same methods.

    from taskledger.client import Client, CreateTask, Requirement, Verdict

    with Client(url, token=producer_token) as c:
        c.create_task(CreateTask(id="T-1", project="demo", title="Add /healthz",
                                 requirements=[Requirement(id="R1", text="GET /healthz answers 200")]))

Errors are `taskledger.client.errors` exceptions (`NotFound`, `Conflict`,
`InvalidTransition`, `LeaseMismatch`, ...) carrying the service's `code`; a
refused batch (`create_tasks`, `start_batch`, `complete_batch`) names the entry
it refused in `index`, and none of the batch was written.
"""

from taskledger.client._call import Call, Retry
from taskledger.client.aio import AsyncClient
from taskledger.client.errors import (
    Conflict,
    Forbidden,
    IdempotencyConflict,
    InvalidTransition,
    JobAlreadyCancelled,
    JobNotFound,
    LeaseMismatch,
    NotFound,
    PayloadTooLarge,
    ServerError,
    TaskledgerError,
    TaskNotFound,
    TooManyRequests,
    TransportError,
    Unauthorized,
    Unavailable,
    ValidationError,
    VersionConflict,
)
from taskledger.client.models import (
    Blocker,
    Claimed,
    CompleteEntry,
    CreateTask,
    Delivery,
    Event,
    EventPage,
    Job,
    JobCommand,
    JobReport,
    Requirement,
    StartEntry,
    StreamPage,
    Subtask,
    Task,
    TaskBatch,
    TaskPage,
    Verdict,
    Verification,
    Webhook,
)
from taskledger.client.sync import Client

__all__ = [
    "AsyncClient", "Blocker", "Call", "Claimed", "Client", "CompleteEntry", "Conflict", "CreateTask", "Delivery",
    "Event", "EventPage", "Forbidden", "IdempotencyConflict", "InvalidTransition", "Job", "JobAlreadyCancelled",
    "JobCommand", "JobNotFound", "JobReport", "LeaseMismatch", "NotFound", "PayloadTooLarge", "Requirement",
    "Retry", "ServerError", "StartEntry", "StreamPage", "Subtask", "Task", "TaskBatch", "TaskNotFound", "TaskPage",
    "TaskledgerError", "TooManyRequests", "TransportError", "Unauthorized", "Unavailable", "ValidationError",
    "Verdict", "Verification", "VersionConflict", "Webhook",
]
