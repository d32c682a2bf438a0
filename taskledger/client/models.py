"""What the client sends and what it reads back, as msgspec Structs.

Requests mirror the service's request schemas; views mirror what it answers.
Views ignore fields they do not know, so a newer service never breaks an older
client; tests/unit/test_client_schema.py checks both against openapi/openapi.json.
They restate the service's Structs on purpose: the client imports nothing from
`service/`, `events/` or `projections/`, so the wire format (the OpenAPI
document) is the only thing the two share.
Request Structs leave unset fields out of the body, so the service's defaults
apply (and `verification=None`, "no verification", stays distinct from
"the default checker").
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

TaskType = Literal["implement", "verify"]
Outcome = Literal["PASS", "FAIL", "BLOCKED"]
Category = Literal["code", "environment", "info_missing", "infrastructure"]
VerdictValue = Literal["PASS", "FAIL"]


class _Request(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ------------------------------------------------------------------ requests


class Requirement(_Request):
    """An acceptance criterion a checker judges; `check` is a shell command the
    reference worker runs for it (exit 0 = PASS)."""

    id: str
    text: str = ""
    check: str | None = None


class Verification(_Request):
    checkers: list[str] = msgspec.field(default_factory=lambda: ["verifier"])


class _TaskFields(_Request):
    title: str
    id: str | None = None
    project: str | None = None
    spec: str = ""
    task_type: TaskType = "implement"
    priority: int = 0
    estimated_minutes: int | None = None
    requirements: list[Requirement] = []
    verification: Verification | UnsetType | None = UNSET
    max_attempts: int = 3
    retry_predecessor: bool = True
    assignee: str | None = None
    labels: list[str] = []
    node_blacklist: list[str] = []
    escalate_after_seconds: int | None = None


class CreateTask(_TaskFields):
    """A new task. Leave `verification` unset for the default checker; `None`
    means the maker's word is final."""

    parent_task_id: str | None = None


class Subtask(_TaskFields):
    """A new sub-task proposed by a round review (its project defaults to the parent's)."""


class Claim(_Request):
    task_types: list[TaskType] = msgspec.field(default_factory=lambda: ["implement", "verify"])
    projects: list[str] | None = None
    lease_seconds: int = 60


class ClaimBatch(Claim):
    """Claim up to `max` tasks at once, each with a lease of its own; with `start`
    each is also started (its own `task.claimed` then `task.started`)."""

    max: int = 10
    start: bool = False


class ClaimJob(_Request):
    lease_seconds: int | None = None  # None: the service's job heartbeat timeout
    projects: list[str] | None = None


ReportEvent = Literal["stage", "command_started", "command_completed", "cache_hit", "command_skipped",
                      "heartbeat", "error", "finish"]
Stage = Literal["init", "load_cache", "select_cmds", "running", "parallel", "sequential", "completing", "cleanup"]


class JobReport(_Request):
    """A job runner's report; each `event` takes its own fields (the service
    refuses others): `stage` a stage; `command_started` command, index, total;
    `command_completed` those and exit_code, duration, output, output_truncated,
    timed_out; `command_skipped` and `cache_hit` command, index, reason; `error`
    error; `heartbeat` nothing; `finish` status, exit_code, result, error."""

    event: ReportEvent
    lease_id: str | None = None
    stage: Stage | None = None
    command: str | None = None
    index: int | None = None
    total: int | None = None
    exit_code: int | None = None
    duration: float | None = None
    reason: str | None = None
    error: str | None = None
    status: Literal["completed", "failed", "cancelled"] | None = None
    result: Any = None
    output: str | None = None
    output_truncated: bool | None = None
    timed_out: bool | None = None


class Lease(_Request):
    lease_id: str


class Heartbeat(_Request):
    lease_id: str
    lease_seconds: int | None = None


class Verdict(_Request):
    """A checker's judgement of one requirement."""

    requirement_id: str
    verdict: VerdictValue
    reason: str = ""


class Complete(_Request):
    lease_id: str
    result: Any = None
    outcome: Outcome | None = None
    verdicts: list[Verdict] = []
    category: Category | None = None


class StartEntry(Lease, kw_only=True):
    """One entry of `start_batch`: a claimed task and the lease it was claimed with."""

    task_id: str


class CompleteEntry(Complete, kw_only=True):
    """One entry of `complete_batch`: the body of `complete`, and the task it reports on."""

    task_id: str


class CreateBatch(_Request):
    tasks: list[CreateTask]


class StartBatch(_Request):
    tasks: list[StartEntry]


class CompleteBatch(_Request):
    tasks: list[CompleteEntry]


class Fail(_Request):
    lease_id: str
    error: str = ""


class Release(_Request):
    lease_id: str
    reason: str = ""


class Reassign(msgspec.Struct, kw_only=True):
    assignee: str | None  # always sent: null gives the task to anyone


class Cancel(_Request):
    reason: str = ""


class Unblock(_Request):
    action: Literal["retry", "reverify"] = "retry"
    notes: str | None = None


class RoundReview(_Request):
    decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"]
    notes: str = ""
    goal_clear: bool | str | None = None
    coverage: str | None = None
    next_round: str | None = None
    new_subtasks: list[Subtask] = []


class Collect(_Request):
    project: str | None = None
    limit: int = 100


class CreateJob(_Request):
    commands: list[str]
    project: str | None = None
    job_id: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []
    command_timeout_seconds: float | None = None


class CreateToken(_Request):
    role: Literal["admin", "producer", "worker", "reviewer", "reader"]
    name: str
    node: str | None = None
    expires_in_seconds: int | None = None


class CreateWebhook(_Request):
    url: str
    secret: str
    types: list[str] | None = None
    format: Literal["event", "issue"] = "event"
    since_seq: int | None = None


# ------------------------------------------------------------------ views


class Unmet(msgspec.Struct, kw_only=True):
    requirement_id: str
    reason: str = ""
    checker: str | None = None


class VerdictRecord(msgspec.Struct, kw_only=True):
    """One checker's report on the current attempt, on the task it checked."""

    checker: str
    verifier_task_id: str
    outcome: Outcome
    verdicts: list[Verdict] = []
    category: Category | None = None
    node: str | None = None
    worker: str | None = None


class Task(msgspec.Struct, kw_only=True):
    """A task as the service shows it. `seq` is the global position of its last
    event (a read-your-writes token); `version` its position in its own stream."""

    id: str
    project: str
    title: str
    spec: str = ""
    task_type: TaskType = "implement"
    state: str = "pending"
    parent_task_id: str | None = None
    priority: int = 0
    estimated_minutes: int | None = None
    requirements: list[Requirement] = []
    verification: Verification | None = None
    max_attempts: int = 3
    retry_predecessor: bool = True
    assignee: str | None = None
    labels: list[str] = []
    node_blacklist: list[str] = []
    attempt: int = 1
    node: str | None = None
    worker: str | None = None
    lease_id: str | None = None
    lease_expires_at: str | None = None
    result: Any = None
    error: str | None = None
    verifier_task_ids: list[str] = []
    verdicts: list[VerdictRecord] = []
    rework_notes: list[Unmet] = []
    operator_notes: str | None = None
    blocker_id: str | None = None
    checker: str | None = None
    outcome: Outcome | None = None
    category: Category | None = None
    is_parent: bool = False
    round: int | None = None
    created_at: str = ""
    updated_at: str = ""
    version: int = 0
    seq: int = 0


class TaskPage(msgspec.Struct, kw_only=True):
    tasks: list[Task]
    next_after: str | None


class Collected(msgspec.Struct, kw_only=True):
    tasks: list[Task]


class TaskBatch(msgspec.Struct, kw_only=True):
    """The views a batch route answers, in the order of its request."""

    tasks: list[Task]


class Claimed(TaskBatch):
    """The tasks a batch claim took (none when there was nothing to claim)."""


class Event(msgspec.Struct, kw_only=True):
    """One entry of the log, as every feed shows it."""

    seq: int
    stream: str
    stream_seq: int
    type: str
    data: dict[str, Any]
    meta: dict[str, Any]
    recorded_at: str
    hash: str


class EventPage(msgspec.Struct, kw_only=True):
    events: list[Event]
    next_seq: int
    head_seq: int


class StreamPage(msgspec.Struct, kw_only=True):
    """A page of one task's or job's stream; `next_seq` is a `stream_seq`."""

    events: list[Event]
    next_seq: int


class Blocker(msgspec.Struct, kw_only=True):
    id: str
    task_id: str
    reason: str
    unmet_requirements: list[Unmet] = []
    category: Category | None = None
    opened_seq: int = 0
    resolved_seq: int | None = None
    open: bool = True


class BlockerList(msgspec.Struct, kw_only=True):
    blockers: list[Blocker]


class JobCommand(msgspec.Struct, kw_only=True):
    """One command of a job and how its run went."""

    command: str
    state: str = "pending"
    exit_code: int | None = None
    duration: float | None = None
    reason: str | None = None
    output: str | None = None
    output_truncated: bool = False
    timed_out: bool = False


class Job(msgspec.Struct, kw_only=True):
    """A job's status (`eta_sec` is null until a command has completed); while
    it runs, the runner holding it and its `lease_id` (shown to that runner)."""

    job_id: str
    state: str
    stage: str = "init"
    progress: float = 0.0
    elapsed_sec: float | None = None
    eta_sec: float | None = None
    current_command: str | None = None
    total_commands: int = 0
    completed_commands: int = 0
    failed_commands: int = 0
    result: Any = None
    cancel_requested: bool = False
    project: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []
    command_timeout_seconds: float | None = None
    commands: list[JobCommand] = []
    node: str | None = None
    worker: str | None = None
    lease_id: str | None = None
    attempt: int = 0
    error: str | None = None
    exit_code: int | None = None
    version: int = 0
    seq: int = 0


class TokenCreated(msgspec.Struct, kw_only=True):
    id: str
    token: str
    role: str
    name: str
    node: str | None = None
    expires_at: str | None = None


class Webhook(msgspec.Struct, kw_only=True):
    """A registered webhook (its secret is never shown)."""

    id: str
    url: str
    types: list[str]
    format: Literal["event", "issue"]
    checkpoint_seq: int
    created_at: str


class WebhookList(msgspec.Struct, kw_only=True):
    webhooks: list[Webhook]


class Delivery(msgspec.Struct, kw_only=True):
    """One attempt to deliver one event to a webhook."""

    id: int
    seq: int
    event_type: str
    attempt: int
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: float
    attempted_at: str


class DeliveryList(msgspec.Struct, kw_only=True):
    deliveries: list[Delivery]
