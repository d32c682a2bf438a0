"""One task's own lifecycle: create, claim, the lease actions, cancel, collect, escalate.

Each `decide_*` takes the state, the command and (where time matters) `now`,
and returns the events to append or raises a DomainError; nothing here does
I/O. Verification lives in `events.task.panel`, rounds in `events.task.rounds`,
rules that span tasks in `events.task.reactions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Final

import msgspec

from taskledger.events.canonical import format_ts
from taskledger.events.errors import AlreadyExists, InvalidTransition, LeaseMismatch, ValidationFailed
from taskledger.events.lease import Holder, Lease, check_holder
from taskledger.events.task.events import (
    Requirement,
    TaskCancelled,
    TaskClaimed,
    TaskCollected,
    TaskCreated,
    TaskDeadlettered,
    TaskEscalated,
    TaskEvent,
    TaskFailed,
    TaskLeaseExpired,
    TaskReassigned,
    TaskReleased,
    TaskRetryScheduled,
    TaskStarted,
    TaskSubtaskAdded,
    TaskType,
    Verification,
)
from taskledger.events.task.state import LEASED, StateName, TaskState

Changes = list[tuple[str, list[TaskEvent]]]
"""Events to append, per task stream, in order."""


class NewTask(msgspec.Struct, kw_only=True, frozen=True):
    """A create command (the HTTP layer has checked sizes and patterns)."""

    id: str
    project: str
    title: str
    spec: str = ""
    task_type: TaskType = "implement"
    parent_task_id: str | None = None
    priority: int = 0
    estimated_minutes: int | None = None
    requirements: list[Requirement] = []
    verification: Verification | None = msgspec.field(default_factory=Verification)
    max_attempts: int = 3
    retry_predecessor: bool = True
    assignee: str | None = None
    labels: list[str] = []
    node_blacklist: list[str] = []
    escalate_after_seconds: int | None = None


class Claim(msgspec.Struct, kw_only=True, frozen=True):
    holder: Holder  # with the new lease id
    lease_seconds: int = 60
    task_types: Sequence[TaskType] = ("implement", "verify")
    projects: Sequence[str] | None = None


def task_created(t: NewTask, *, default_escalation: int, round_: int | None) -> TaskCreated:
    return TaskCreated(
        id=t.id, project=t.project, title=t.title, spec=t.spec, task_type=t.task_type,
        parent_task_id=t.parent_task_id, priority=t.priority, estimated_minutes=t.estimated_minutes,
        requirements=list(t.requirements), verification=t.verification, max_attempts=t.max_attempts,
        retry_predecessor=t.retry_predecessor, assignee=t.assignee, labels=list(t.labels),
        node_blacklist=list(t.node_blacklist),
        escalate_after_seconds=t.escalate_after_seconds if t.escalate_after_seconds is not None
        else default_escalation,
        round=round_,
    )


def validate_new_task(t: NewTask) -> None:
    if t.task_type == "verify":
        raise ValidationFailed("verify tasks are created by the service when an implement task completes")
    ids = [r.id for r in t.requirements]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("requirement ids must be unique")
    if t.verification is not None:
        checkers = t.verification.checkers
        if not checkers:
            raise ValidationFailed("verification.checkers must name at least one checker")
        if len(set(checkers)) != len(checkers):
            raise ValidationFailed("verification.checkers must be unique")
    if t.max_attempts < 1:
        raise ValidationFailed("max_attempts must be at least 1")
    if t.parent_task_id == t.id:
        raise ValidationFailed("a task cannot be its own parent")


def decide_create(
    existing: TaskState | None, t: NewTask, parent: TaskState | None, *, default_escalation: int
) -> Changes:
    validate_new_task(t)
    if existing is not None:
        raise AlreadyExists(f"task {t.id} already exists", task_id=t.id)
    if t.parent_task_id is None:
        return [(t.id, [task_created(t, default_escalation=default_escalation, round_=None)])]
    if parent is None:
        raise ValidationFailed(f"parent task {t.parent_task_id} does not exist")
    if parent.task_type == "verify":
        raise InvalidTransition("a verify task cannot have sub-tasks")
    if parent.is_parent and parent.state == "in_progress":
        rnd = parent.round or 1
    elif not parent.is_parent and parent.state == "pending":
        rnd = 1
    else:
        raise InvalidTransition(
            f"sub-tasks can be added to a pending task or a parent whose round is running; "
            f"{parent.id} is {parent.state}"
            + (" (use round-review NEW_ROUND)" if parent.state == "round_review" else ""),
            state=parent.state,
        )
    return [(t.id, [task_created(t, default_escalation=default_escalation, round_=rnd)]),
            (parent.id, [TaskSubtaskAdded(subtask_id=t.id, round=rnd)])]


def claimable_by(s: TaskState, c: Claim) -> bool:
    """The rule a claim must satisfy (the SQL query pre-filters; this decides)."""
    node, worker = c.holder.node, c.holder.worker
    if s.state != "pending" or s.is_parent or s.task_type not in c.task_types:
        return False
    if c.projects is not None and s.project not in c.projects:
        return False
    if s.assignee is not None and s.assignee != worker:
        return False
    if node is not None and node in s.node_blacklist:
        return False
    return s.task_type != "verify" or (node is not None and node != s.maker_node and worker != s.maker_worker)


def decide_claim(s: TaskState, c: Claim, now: datetime) -> list[TaskEvent]:
    if not claimable_by(s, c) or c.holder.lease_id is None:
        raise InvalidTransition(f"task {s.id} cannot be claimed by {c.holder.worker} now", state=s.state)
    return [TaskClaimed(node=c.holder.node, worker=c.holder.worker, token_id=c.holder.token_id,
                        lease_id=c.holder.lease_id,
                        lease_expires_at=format_ts(now + timedelta(seconds=c.lease_seconds)),
                        attempt=s.attempt)]


def lease_of(s: TaskState) -> Lease:
    return Lease(lease_id=s.lease_id, worker=s.worker, node=s.node, token_id=s.token_id)


def check_lease(s: TaskState, who: Holder, states: Sequence[StateName], action: str) -> None:
    # The lease is checked first: a request that does not hold the task is told
    # so, whatever state the task is in.
    check_holder(lease_of(s), who, what=f"task {s.id}", task_id=s.id)
    if s.state not in states:
        raise InvalidTransition(f"cannot {action} task {s.id}: it is {s.state}", state=s.state)


def decide_start(s: TaskState, who: Holder) -> list[TaskEvent]:
    check_lease(s, who, ("claimed",), "start")
    return [TaskStarted(worker=who.worker, node=s.node, attempt=s.attempt)]


def check_heartbeat(s: TaskState, who: Holder) -> None:
    check_lease(s, who, tuple(LEASED), "heartbeat")


def decide_fail(s: TaskState, who: Holder, error: str) -> list[TaskEvent]:
    check_lease(s, who, tuple(LEASED), "fail")
    events: list[TaskEvent] = [TaskFailed(attempt=s.attempt, error=error, worker=who.worker)]
    if s.attempt < s.max_attempts:
        events.append(TaskRetryScheduled(attempt=s.attempt + 1, rework_notes=list(s.rework_notes),
                                         reason=f"failed: {error}"[:500]))
    else:
        events.append(TaskDeadlettered(reason=f"failed on the last attempt: {error}"[:500], attempt=s.attempt))
    return events


def decide_release(s: TaskState, who: Holder, reason: str = "") -> list[TaskEvent]:
    """The holder gives the claim back: pending again, the same attempt."""
    check_lease(s, who, tuple(LEASED), "release")
    return [TaskReleased(worker=who.worker, node=s.node, attempt=s.attempt, reason=reason)]


def decide_lease_expired(s: TaskState, lease_id: str) -> list[TaskEvent]:
    if s.state not in LEASED or s.lease_id != lease_id:
        return []
    if s.attempt < s.max_attempts:
        return [TaskLeaseExpired(lease_id=lease_id, attempt=s.attempt, worker=s.worker,
                                 next_attempt=s.attempt + 1)]
    return [
        TaskLeaseExpired(lease_id=lease_id, attempt=s.attempt, worker=s.worker, next_attempt=None),
        TaskDeadlettered(reason="lease expired on the last attempt", attempt=s.attempt),
    ]


def refuse_expired_lease(s: TaskState, who: Holder, expires_at: datetime | None, now: datetime) -> None:
    """A lease past its deadline no longer holds the task, even before the sweeper runs."""
    if s.lease_id is not None and who.lease_id == s.lease_id and expires_at is not None and expires_at < now:
        raise LeaseMismatch(f"the lease on task {s.id} has expired", task_id=s.id)


def decide_reassign(s: TaskState, assignee: str | None, by: str) -> list[TaskEvent]:
    """Seed 003's fallback for directed work nobody answers: another worker, or anyone."""
    if s.task_type == "verify" or s.is_parent or s.state != "pending":
        raise InvalidTransition(f"only a pending task can be reassigned; {s.id} is {s.state}", state=s.state)
    if assignee == s.assignee:
        raise InvalidTransition(f"task {s.id} is already assigned to {assignee}", state=s.state)
    return [TaskReassigned(assignee=assignee, previous=s.assignee, by=by)]


CANCELLABLE: Final[frozenset[StateName]] = frozenset({
    "pending", "claimed", "running", "verifying", "rejected", "blocked", "failed",
    "in_progress", "round_review",
})


def decide_cancel(s: TaskState, reason: str, by: str | None) -> list[TaskEvent]:
    if s.state not in CANCELLABLE:
        raise InvalidTransition(f"task {s.id} is {s.state} and cannot be cancelled", state=s.state)
    return [TaskCancelled(reason=reason, by=by)]


def decide_collect(s: TaskState, by: str) -> list[TaskEvent]:
    if s.task_type == "verify" or s.state not in ("completed", "verified") or s.is_parent:
        raise InvalidTransition(f"task {s.id} is not ready to collect", state=s.state)
    return [TaskCollected(by=by)]


def escalate_at(s: TaskState) -> datetime | None:
    """When a task nobody took (or a review nobody did) escalates, if it will."""
    if s.escalated or s.state not in ("pending", "round_review") or s.ready_at is None:
        return None
    if (s.state == "pending" and s.is_parent) or not s.escalate_after_seconds:
        return None
    return datetime.fromisoformat(s.ready_at.replace("Z", "+00:00")) + timedelta(seconds=s.escalate_after_seconds)


def decide_escalate(s: TaskState, now: datetime) -> list[TaskEvent]:
    due = escalate_at(s)
    if due is None or due > now or s.ready_at is None:
        return []
    ready = datetime.fromisoformat(s.ready_at.replace("Z", "+00:00"))
    what = "nobody claimed it" if s.state == "pending" else "its round review is waiting"
    return [TaskEscalated(state=s.state, waited_seconds=int((now - ready).total_seconds()),
                          reason=f"{what} within {s.escalate_after_seconds}s")]
