"""The task aggregate's facts: value types, one frozen tagged Struct per event, and their codec.

Stored events are forever: a new field gets a default, an existing field never
changes its type, and a tag never changes (it is the stored `type`). The test
`test_events_recorded_by_earlier_versions_still_decode` holds payloads as
earlier versions wrote them.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

Outcome = Literal["PASS", "FAIL", "BLOCKED"]
Category = Literal["code", "environment", "info_missing", "infrastructure"]
TaskType = Literal["implement", "verify"]
Decision = Literal["GOAL_ACHIEVED", "NEW_ROUND"]
UnblockAction = Literal["retry", "reverify"]

DEFAULT_CHECKER: Final = "verifier"
# Seed 000: a verifier task runs first (priority 0) and is estimated at 10 minutes,
# unless the maker's `verification` says otherwise.
VERIFIER_PRIORITY: Final = 0
VERIFIER_ESTIMATED_MINUTES: Final = 10


class Requirement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    text: str = ""
    check: str | None = None


class Verification(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    checkers: list[str] = msgspec.field(default_factory=lambda: [DEFAULT_CHECKER])
    priority: int | None = None
    estimated_minutes: int | None = None


class RequirementVerdict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requirement_id: str
    verdict: Literal["PASS", "FAIL"]
    reason: str = ""


class Unmet(msgspec.Struct, frozen=True, kw_only=True):
    requirement_id: str
    reason: str = ""
    checker: str | None = None


class VerdictRecord(msgspec.Struct, frozen=True, kw_only=True):
    checker: str
    verifier_task_id: str
    outcome: Outcome
    verdicts: list[RequirementVerdict] = []
    category: Category | None = None
    node: str | None = None
    worker: str | None = None
    reason: str = ""
    token_id: str | None = None


class CheckerReport(msgspec.Struct, frozen=True, kw_only=True):
    """One checker's word, as a blocker keeps it."""

    checker: str
    outcome: Outcome
    category: Category | None = None
    reason: str = ""


class RoundRecord(msgspec.Struct, frozen=True, kw_only=True):
    round: int
    subtask_ids: list[str] = []
    total: int | None = None
    done: int | None = None
    failed: int | None = None
    cancelled: int | None = None
    decision: str | None = None
    notes: str | None = None
    goal_clear: bool | str | None = None
    coverage: str | None = None
    next_round: str | None = None
    reviewed_by: str | None = None


class TaskEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class TaskCreated(TaskEvent, frozen=True, kw_only=True, tag="task.created"):
    id: str
    project: str
    title: str
    spec: str = ""
    task_type: TaskType = "implement"
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
    escalate_after_seconds: int | None = None
    round: int | None = None
    # verifier tasks only
    checker: str | None = None
    maker_attempt: int | None = None
    maker_node: str | None = None
    maker_worker: str | None = None
    notes: str | None = None  # an operator's notes, when an unblock asked to verify again


class TaskClaimed(TaskEvent, frozen=True, kw_only=True, tag="task.claimed"):
    node: str | None
    worker: str
    lease_id: str
    lease_expires_at: str
    attempt: int
    token_id: str | None = None


class TaskStarted(TaskEvent, frozen=True, kw_only=True, tag="task.started"):
    worker: str
    node: str | None = None
    attempt: int = 1


class TaskCompleted(TaskEvent, frozen=True, kw_only=True, tag="task.completed"):
    worker: str
    node: str | None = None
    attempt: int = 1
    result: Any = None
    # verify tasks only
    outcome: Outcome | None = None
    verdicts: list[RequirementVerdict] = []
    category: Category | None = None
    reason: str = ""


class TaskVerifying(TaskEvent, frozen=True, kw_only=True, tag="task.verifying"):
    attempt: int
    checkers: list[str]
    verifier_task_ids: list[str]
    maker_node: str | None = None
    maker_worker: str | None = None


class TaskVerdict(TaskEvent, frozen=True, kw_only=True, tag="task.verdict"):
    checker: str
    verifier_task_id: str
    outcome: Outcome
    verdicts: list[RequirementVerdict] = []
    category: Category | None = None
    attempt: int = 1
    node: str | None = None
    worker: str | None = None
    synthesized: bool = False
    reason: str = ""
    token_id: str | None = None


class TaskVerified(TaskEvent, frozen=True, kw_only=True, tag="task.verified"):
    attempt: int
    checkers: list[str]


class TaskRejected(TaskEvent, frozen=True, kw_only=True, tag="task.rejected"):
    attempt: int
    unmet_requirements: list[Unmet]
    reason: str = ""


class TaskRetryScheduled(TaskEvent, frozen=True, kw_only=True, tag="task.retry_scheduled"):
    attempt: int
    rework_notes: list[Unmet] = []
    reason: str = ""


class TaskBlocked(TaskEvent, frozen=True, kw_only=True, tag="task.blocked"):
    blocker_id: str
    reason: str
    unmet_requirements: list[Unmet] = []
    category: Category | None = None
    attempt: int = 1
    reports: list[CheckerReport] = []


class TaskReverifyScheduled(TaskEvent, frozen=True, kw_only=True, tag="task.reverify_scheduled"):
    attempt: int
    verifier_task_ids: list[str]
    reason: str = ""
    # verifiers whose PASS stands; before this field a re-verification asked every checker again
    kept_verifier_task_ids: list[str] = []


class TaskUnblocked(TaskEvent, frozen=True, kw_only=True, tag="task.unblocked"):
    blocker_id: str
    action: UnblockAction
    notes: str | None = None
    attempt: int = 1
    verifier_task_ids: list[str] = []
    rework_notes: list[Unmet] = []
    kept_verifier_task_ids: list[str] = []


class TaskFailed(TaskEvent, frozen=True, kw_only=True, tag="task.failed"):
    attempt: int
    error: str = ""
    worker: str | None = None


class TaskLeaseExpired(TaskEvent, frozen=True, kw_only=True, tag="task.lease_expired"):
    lease_id: str
    attempt: int
    worker: str | None = None
    next_attempt: int | None = None


class TaskReleased(TaskEvent, frozen=True, kw_only=True, tag="task.released"):
    """The lease holder gave the claim back: pending again, no attempt spent."""

    worker: str
    node: str | None = None
    attempt: int = 1
    reason: str = ""


class TaskReassigned(TaskEvent, frozen=True, kw_only=True, tag="task.reassigned"):
    """Directed work nobody answered goes to another worker, or to anyone (null)."""

    assignee: str | None
    previous: str | None = None
    by: str | None = None


class TaskDeadlettered(TaskEvent, frozen=True, kw_only=True, tag="task.deadlettered"):
    reason: str
    attempt: int = 1


class TaskCancelled(TaskEvent, frozen=True, kw_only=True, tag="task.cancelled"):
    reason: str = ""
    by: str | None = None


class TaskCollected(TaskEvent, frozen=True, kw_only=True, tag="task.collected"):
    by: str | None = None


class TaskEscalated(TaskEvent, frozen=True, kw_only=True, tag="task.escalated"):
    state: str
    waited_seconds: int
    reason: str = ""


class TaskSubtaskAdded(TaskEvent, frozen=True, kw_only=True, tag="task.subtask_added"):
    subtask_id: str
    round: int


class TaskRoundReview(TaskEvent, frozen=True, kw_only=True, tag="task.round_review"):
    round: int
    total: int
    done: int
    failed: int
    cancelled: int


class TaskRoundReopened(TaskEvent, frozen=True, kw_only=True, tag="task.round_reopened"):
    """A sub-task of the round under review is open again: the round runs on."""

    round: int
    subtask_id: str
    reason: str = ""


class TaskRoundReviewed(TaskEvent, frozen=True, kw_only=True, tag="task.round_reviewed"):
    round: int
    decision: Decision
    notes: str = ""
    goal_clear: bool | str | None = None
    coverage: str | None = None
    next_round: str | None = None
    new_subtask_ids: list[str] = []
    reviewer: str | None = None


class TaskClosed(TaskEvent, frozen=True, kw_only=True, tag="task.closed"):
    round: int


AnyTaskEvent = (
    TaskCreated | TaskClaimed | TaskStarted | TaskCompleted | TaskVerifying | TaskVerdict
    | TaskVerified | TaskRejected | TaskRetryScheduled | TaskBlocked | TaskReverifyScheduled
    | TaskUnblocked | TaskFailed | TaskLeaseExpired | TaskReleased | TaskReassigned
    | TaskDeadlettered | TaskCancelled | TaskCollected | TaskEscalated | TaskSubtaskAdded
    | TaskRoundReview | TaskRoundReopened | TaskRoundReviewed | TaskClosed
)

EVENT_TYPES: Final = tuple(t.__struct_config__.tag for t in AnyTaskEvent.__args__)

# ---------------------------------------------------------------- the codec
# One way in and out of the log: `data` is the event's fields without the tag
# (the table has a column for the type).

_decoders: Final[dict[str, msgspec.json.Decoder[Any]]] = {
    str(cls.__struct_config__.tag): msgspec.json.Decoder(cls) for cls in AnyTaskEvent.__args__
}


def decode(type_: str, data: str | bytes | dict[str, Any]) -> AnyTaskEvent:
    """A stored (type, data) pair back into its event Struct; `data` as JSON text or as a dict."""
    if isinstance(data, dict):
        ev: AnyTaskEvent = msgspec.convert({**data, "type": type_}, AnyTaskEvent)
        return ev
    dec = _decoders.get(type_)
    if dec is None:
        raise ValueError(f"unknown task event type {type_!r}")
    out: AnyTaskEvent = dec.decode(data)
    return out


def payload(ev: TaskEvent) -> dict[str, Any]:
    """The event as stored in `data`: its fields, without the tag."""
    d: dict[str, Any] = msgspec.to_builtins(ev)
    d.pop("type", None)
    return d


def event_type(ev: TaskEvent) -> str:
    return str(ev.__struct_config__.tag)
