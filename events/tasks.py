"""The task aggregate: its events, its state, and the pure rules between them.

Nothing here does I/O. `evolve` folds one event into a state; the `decide_*`
functions take states (the task, and where a rule spans tasks, the others it
needs: a verifier's maker, a sub-task's parent and siblings) and return the
events to append, as a `Changes` list of (task_id, events). The service loads
the states, calls these, appends, and folds the result into the views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from events.errors import (
    AlreadyExists,
    Forbidden,
    InvalidTransition,
    LeaseMismatch,
    ValidationFailed,
)

# ---------------------------------------------------------------- value types

Outcome = Literal["PASS", "FAIL", "BLOCKED"]
Category = Literal["code", "environment", "info_missing", "infrastructure"]
TaskType = Literal["implement", "verify"]

DEFAULT_CHECKER: Final = "verifier"

DONE_STATES: Final = frozenset({"verified", "completed", "collected", "done"})
FAILED_STATES: Final = frozenset({"blocked", "deadletter"})
CANCELLED_STATES: Final = frozenset({"cancelled"})
TERMINAL_FOR_ROUND: Final = DONE_STATES | FAILED_STATES | CANCELLED_STATES

STATES: Final = frozenset({
    "pending", "claimed", "running", "completed", "verifying", "verified", "collected",
    "rejected", "blocked", "failed", "deadletter", "cancelled",
    "in_progress", "round_review", "done",
})


class Requirement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: str
    text: str = ""
    check: str | None = None


class Verification(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    checkers: list[str] = msgspec.field(default_factory=lambda: [DEFAULT_CHECKER])


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


# ---------------------------------------------------------------- events
# Stored events are forever: add fields with defaults, never change a type.


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


class TaskClaimed(TaskEvent, frozen=True, kw_only=True, tag="task.claimed"):
    node: str | None
    worker: str
    lease_id: str
    lease_expires_at: str
    attempt: int


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


class TaskReverifyScheduled(TaskEvent, frozen=True, kw_only=True, tag="task.reverify_scheduled"):
    attempt: int
    verifier_task_ids: list[str]
    reason: str = ""


class TaskUnblocked(TaskEvent, frozen=True, kw_only=True, tag="task.unblocked"):
    blocker_id: str
    action: Literal["retry", "reverify"]
    notes: str | None = None
    attempt: int = 1
    verifier_task_ids: list[str] = []


class TaskFailed(TaskEvent, frozen=True, kw_only=True, tag="task.failed"):
    attempt: int
    error: str = ""
    worker: str | None = None


class TaskLeaseExpired(TaskEvent, frozen=True, kw_only=True, tag="task.lease_expired"):
    lease_id: str
    attempt: int
    worker: str | None = None
    next_attempt: int | None = None


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


class TaskRoundReviewed(TaskEvent, frozen=True, kw_only=True, tag="task.round_reviewed"):
    round: int
    decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"]
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
    | TaskUnblocked | TaskFailed | TaskLeaseExpired | TaskDeadlettered | TaskCancelled
    | TaskCollected | TaskEscalated | TaskSubtaskAdded | TaskRoundReview | TaskRoundReviewed
    | TaskClosed
)

EVENT_TYPES: Final = tuple(
    t.__struct_config__.tag for t in AnyTaskEvent.__args__
)


def decode_event(type_: str, data: dict[str, Any]) -> AnyTaskEvent:
    """A stored (type, data) pair back into its event Struct."""
    ev: AnyTaskEvent = msgspec.convert({**data, "type": type_}, AnyTaskEvent)
    return ev


def event_data(ev: TaskEvent) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(ev)
    d.pop("type", None)
    return d


def event_type(ev: TaskEvent) -> str:
    return str(ev.__struct_config__.tag)


# ---------------------------------------------------------------- state


class TaskState(msgspec.Struct, kw_only=True):
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
    escalate_after_seconds: int | None = None
    attempt: int = 1
    node: str | None = None
    worker: str | None = None
    lease_id: str | None = None
    lease_expires_at: str | None = None
    result: Any = None
    error: str | None = None
    verifier_task_ids: list[str] = []
    all_verifier_task_ids: list[str] = []
    verdicts: list[VerdictRecord] = []
    reverify_count: int = 0
    maker_node: str | None = None
    maker_worker: str | None = None
    rework_notes: list[Unmet] = []
    blocker_id: str | None = None
    blockers_opened: int = 0
    # verifier tasks
    checker: str | None = None
    maker_attempt: int | None = None
    outcome: Outcome | None = None
    verify_verdicts: list[RequirementVerdict] = []
    category: Category | None = None
    # parents and sub-tasks
    is_parent: bool = False
    round: int | None = None
    subtask_round: int | None = None
    rounds: list[RoundRecord] = []
    # escalation
    escalated: bool = False
    ready_at: str | None = None
    collected: bool = False
    cancel_reason: str | None = None
    created_at: str = ""
    updated_at: str = ""
    version: int = 0
    seq: int = 0


def evolve(s: TaskState | None, ev: TaskEvent, *, seq: int, version: int, at: str) -> TaskState:
    """Fold one event into the task's state (a new TaskState; inputs are not changed)."""
    if s is None:
        if not isinstance(ev, TaskCreated):
            raise ValueError(f"a task stream must start with task.created, not {event_type(ev)}")
        s = TaskState(
            id=ev.id, project=ev.project, title=ev.title, spec=ev.spec, task_type=ev.task_type,
            parent_task_id=ev.parent_task_id, priority=ev.priority,
            estimated_minutes=ev.estimated_minutes, requirements=list(ev.requirements),
            verification=ev.verification, max_attempts=ev.max_attempts,
            retry_predecessor=ev.retry_predecessor, assignee=ev.assignee, labels=list(ev.labels),
            node_blacklist=list(ev.node_blacklist), escalate_after_seconds=ev.escalate_after_seconds,
            checker=ev.checker, maker_attempt=ev.maker_attempt, maker_node=ev.maker_node,
            maker_worker=ev.maker_worker, subtask_round=ev.round, state="pending",
            ready_at=at, created_at=at,
        )
    else:
        s = msgspec.structs.replace(s)
        match ev:
            case TaskCreated():
                raise ValueError("task.created on an existing stream")
            case TaskClaimed(node=node, worker=worker, lease_id=lease_id,
                             lease_expires_at=exp, attempt=attempt):
                s.state, s.node, s.worker = "claimed", node, worker
                s.lease_id, s.lease_expires_at, s.attempt = lease_id, exp, attempt
                s.escalated, s.ready_at = False, None
            case TaskStarted():
                s.state = "running"
            case TaskCompleted(result=result, outcome=outcome, verdicts=verdicts, category=category):
                s.state, s.result = "completed", result
                s.lease_id = s.lease_expires_at = None
                if s.task_type == "verify":
                    s.outcome, s.verify_verdicts, s.category = outcome, list(verdicts), category
                else:
                    s.maker_node, s.maker_worker = s.node, s.worker
            case TaskVerifying(verifier_task_ids=ids, maker_node=mn, maker_worker=mw):
                s.state = "verifying"
                s.verifier_task_ids = list(ids)
                s.all_verifier_task_ids = [*s.all_verifier_task_ids, *ids]
                s.verdicts = []
                s.reverify_count = 0
                s.maker_node, s.maker_worker = mn, mw
            case TaskVerdict():
                s.verdicts = [*s.verdicts, VerdictRecord(
                    checker=ev.checker, verifier_task_id=ev.verifier_task_id, outcome=ev.outcome,
                    verdicts=list(ev.verdicts), category=ev.category, node=ev.node, worker=ev.worker,
                )]
            case TaskVerified():
                s.state = "verified"
            case TaskRejected():
                s.state = "rejected"
            case TaskRetryScheduled(attempt=attempt, rework_notes=notes):
                s.state, s.attempt, s.rework_notes = "pending", attempt, list(notes)
                s.lease_id = s.lease_expires_at = None
                s.node = s.worker = None
                s.ready_at, s.escalated = at, False
            case TaskBlocked(blocker_id=bid):
                s.state, s.blocker_id = "blocked", bid
                s.blockers_opened += 1
                s.lease_id = s.lease_expires_at = None
            case TaskReverifyScheduled(verifier_task_ids=ids):
                s.state = "verifying"
                s.verifier_task_ids = list(ids)
                s.all_verifier_task_ids = [*s.all_verifier_task_ids, *ids]
                s.verdicts = []
                s.reverify_count += 1
            case TaskUnblocked(action=action, attempt=attempt, verifier_task_ids=ids):
                s.blocker_id = None
                if action == "retry":
                    s.state, s.attempt = "pending", attempt
                    s.node = s.worker = None
                    s.verifier_task_ids, s.verdicts = [], []
                    s.ready_at, s.escalated = at, False
                else:
                    s.state = "verifying"
                    s.verifier_task_ids = list(ids)
                    s.all_verifier_task_ids = [*s.all_verifier_task_ids, *ids]
                    s.verdicts = []
                    s.reverify_count = 0
            case TaskFailed(error=error):
                s.state, s.error = "failed", error
                s.lease_id = s.lease_expires_at = None
            case TaskLeaseExpired(next_attempt=nxt):
                s.lease_id = s.lease_expires_at = None
                if nxt is not None:
                    s.state, s.attempt = "pending", nxt
                    s.node = s.worker = None
                    s.ready_at, s.escalated = at, False
            case TaskDeadlettered():
                s.state = "deadletter"
                s.lease_id = s.lease_expires_at = None
            case TaskCancelled(reason=reason):
                s.state, s.cancel_reason = "cancelled", reason
                s.lease_id = s.lease_expires_at = None
            case TaskCollected():
                s.state, s.collected = "collected", True
            case TaskEscalated():
                s.escalated = True
            case TaskSubtaskAdded(subtask_id=sid, round=rnd):
                if not s.is_parent:
                    s.is_parent, s.round, s.state = True, rnd, "in_progress"
                    s.ready_at, s.escalated = None, False
                rounds = list(s.rounds)
                if not rounds or rounds[-1].round != rnd:
                    rounds.append(RoundRecord(round=rnd, subtask_ids=[sid]))
                else:
                    last = rounds[-1]
                    rounds[-1] = msgspec.structs.replace(last, subtask_ids=[*last.subtask_ids, sid])
                s.rounds = rounds
            case TaskRoundReview(round=rnd, total=total, done=done, failed=failed, cancelled=cancelled):
                s.state, s.ready_at, s.escalated = "round_review", at, False
                s.rounds = [
                    msgspec.structs.replace(r, total=total, done=done, failed=failed, cancelled=cancelled)
                    if r.round == rnd else r
                    for r in s.rounds
                ]
            case TaskRoundReviewed():
                s.rounds = [
                    msgspec.structs.replace(
                        r, decision=ev.decision, notes=ev.notes, goal_clear=ev.goal_clear,
                        coverage=ev.coverage, next_round=ev.next_round, reviewed_by=ev.reviewer,
                    )
                    if r.round == ev.round else r
                    for r in s.rounds
                ]
                if ev.decision == "NEW_ROUND":
                    s.round = ev.round + 1
                    s.state, s.ready_at, s.escalated = "in_progress", None, False
            case TaskClosed():
                s.state, s.ready_at = "done", None
            case _:
                raise ValueError(f"unknown task event {ev!r}")
    s.version, s.seq, s.updated_at = version, seq, at
    return s


def fold(events: Sequence[tuple[TaskEvent, int, int, str]]) -> TaskState | None:
    s: TaskState | None = None
    for ev, seq, version, at in events:
        s = evolve(s, ev, seq=seq, version=version, at=at)
    return s


# ---------------------------------------------------------------- commands

Changes = list[tuple[str, list[TaskEvent]]]


class NewTask(msgspec.Struct, kw_only=True, frozen=True):
    """A validated create command (the HTTP layer checks sizes and patterns)."""

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


def _created(t: NewTask, *, default_escalation: int, round_: int | None) -> TaskCreated:
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
        raise ValidationFailed(
            "verify tasks are created by the service when an implement task completes"
        )
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
    changes: Changes = []
    if t.parent_task_id is not None:
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
        changes.append((t.id, [_created(t, default_escalation=default_escalation, round_=rnd)]))
        changes.append((parent.id, [TaskSubtaskAdded(subtask_id=t.id, round=rnd)]))
    else:
        changes.append((t.id, [_created(t, default_escalation=default_escalation, round_=None)]))
    return changes


def claimable_by(
    s: TaskState, *, node: str | None, worker: str, task_types: Sequence[str],
    projects: Sequence[str] | None,
) -> bool:
    """The rule a claim must satisfy (the SQL query pre-filters; this decides)."""
    if s.state != "pending" or s.is_parent:
        return False
    if s.task_type not in task_types:
        return False
    if projects is not None and s.project not in projects:
        return False
    if s.assignee is not None and s.assignee != worker:
        return False
    if node is not None and node in s.node_blacklist:
        return False
    if s.task_type == "verify":
        if node is None or node == s.maker_node:
            return False
        if worker == s.maker_worker:
            return False
    return True


def decide_claim(
    s: TaskState, *, node: str | None, worker: str, lease_id: str, lease_expires_at: str,
    task_types: Sequence[str], projects: Sequence[str] | None,
) -> list[TaskEvent]:
    if not claimable_by(s, node=node, worker=worker, task_types=task_types, projects=projects):
        raise InvalidTransition(f"task {s.id} cannot be claimed by {worker} now", state=s.state)
    return [TaskClaimed(node=node, worker=worker, lease_id=lease_id,
                        lease_expires_at=lease_expires_at, attempt=s.attempt)]


def _check_lease(s: TaskState, lease_id: str, worker: str, states: Sequence[str], action: str) -> None:
    # The lease is checked first: a request that does not hold the task is told
    # so, whatever state the task is in.
    if s.lease_id is None or s.lease_id != lease_id:
        raise LeaseMismatch(f"lease {lease_id!r} does not hold task {s.id}", task_id=s.id, state=s.state)
    if s.worker != worker:
        raise LeaseMismatch(f"task {s.id} is leased to another worker", task_id=s.id)
    if s.state not in states:
        raise InvalidTransition(f"cannot {action} task {s.id}: it is {s.state}", state=s.state)


def decide_start(s: TaskState, *, lease_id: str, worker: str) -> list[TaskEvent]:
    _check_lease(s, lease_id, worker, ("claimed",), "start")
    return [TaskStarted(worker=worker, node=s.node, attempt=s.attempt)]


def check_heartbeat(s: TaskState, *, lease_id: str, worker: str) -> None:
    _check_lease(s, lease_id, worker, ("claimed", "running"), "heartbeat")


def verifier_ids(parent: TaskState, checkers: Sequence[str], attempt: int) -> list[str]:
    """Verifier ids per the contract (`V-{id}` for the first verification of attempt 1
    with the single default checker, else `V-{id}-a{attempt}-{checker}`), with a
    `-r{n}` suffix when a re-verification would reuse an id."""
    used = set(parent.all_verifier_task_ids)
    short = f"V-{parent.id}"
    out = []
    for c in checkers:
        if attempt == 1 and list(checkers) == [DEFAULT_CHECKER] and short not in used:
            base = short
        else:
            base = f"V-{parent.id}-a{attempt}-{c}"
        vid, k = base, 1
        while vid in used:
            k += 1
            vid = f"{base}-r{k}"
        used.add(vid)
        out.append(vid)
    return out


def _verifier_tasks(maker: TaskState, ids: Sequence[str], checkers: Sequence[str],
                    maker_node: str | None, maker_worker: str | None) -> Changes:
    out: Changes = []
    blacklist = sorted({*maker.node_blacklist, *([maker_node] if maker_node else [])})
    for vid, checker in zip(ids, checkers, strict=True):
        out.append((vid, [TaskCreated(
            id=vid, project=maker.project, title=f"Verify ({checker}): {maker.title}",
            spec=maker.spec, task_type="verify", parent_task_id=maker.id, priority=maker.priority,
            requirements=list(maker.requirements), verification=None, max_attempts=maker.max_attempts,
            retry_predecessor=False, labels=list(maker.labels), node_blacklist=blacklist,
            escalate_after_seconds=maker.escalate_after_seconds, checker=checker,
            maker_attempt=maker.attempt, maker_node=maker_node, maker_worker=maker_worker,
        )]))
    return out


def decide_complete(
    s: TaskState, *, lease_id: str, worker: str, result: Any,
) -> Changes:
    """An implement task's maker reports done: verification starts in the same transaction."""
    if s.task_type == "verify":
        raise ValidationFailed("a verify task is completed with an outcome and verdicts")
    _check_lease(s, lease_id, worker, ("running",), "complete")
    events: list[TaskEvent] = [TaskCompleted(worker=worker, node=s.node, attempt=s.attempt, result=result)]
    changes: Changes = [(s.id, events)]
    if s.verification is None:
        return changes
    checkers = list(s.verification.checkers)
    ids = verifier_ids(s, checkers, s.attempt)
    events.append(TaskVerifying(attempt=s.attempt, checkers=checkers, verifier_task_ids=ids,
                                maker_node=s.node, maker_worker=worker))
    changes.extend(_verifier_tasks(s, ids, checkers, s.node, worker))
    return changes


def validate_verdict(
    maker: TaskState | None, outcome: Outcome, verdicts: Sequence[RequirementVerdict],
    category: Category | None,
) -> None:
    if outcome == "BLOCKED" and category is None:
        raise ValidationFailed("a BLOCKED outcome needs a category")
    if outcome != "BLOCKED" and category is not None:
        raise ValidationFailed("category is only for BLOCKED outcomes")
    fails = [v for v in verdicts if v.verdict == "FAIL"]
    if outcome == "PASS" and fails:
        raise ValidationFailed("outcome PASS with FAIL verdicts: " + ", ".join(v.requirement_id for v in fails))
    if outcome == "FAIL" and not fails:
        raise ValidationFailed("outcome FAIL needs at least one FAIL verdict naming the unmet requirement")
    ids = [v.requirement_id for v in verdicts]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("one verdict per requirement")
    if maker is not None and maker.requirements:
        known = {r.id for r in maker.requirements}
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise ValidationFailed(f"unknown requirement ids: {', '.join(unknown)}")


def decide_verifier_complete(
    v: TaskState, maker: TaskState | None, *, lease_id: str, worker: str, outcome: Outcome,
    verdicts: Sequence[RequirementVerdict], category: Category | None, result: Any,
    default_escalation: int,
) -> Changes:
    """A checker reports: its verdict lands on the maker's stream and, once every
    checker of the round has reported, the maker is verified, rejected, retried,
    blocked or re-verified."""
    if v.task_type != "verify":
        raise ValidationFailed("outcome and verdicts are for verify tasks")
    _check_lease(v, lease_id, worker, ("running",), "complete")
    validate_verdict(maker, outcome, verdicts, category)
    changes: Changes = [(v.id, [TaskCompleted(
        worker=worker, node=v.node, attempt=v.attempt, result=result, outcome=outcome,
        verdicts=list(verdicts), category=category,
    )])]
    if maker is None or maker.state != "verifying" or v.id not in maker.verifier_task_ids:
        return changes  # a verdict for a round that is over: kept on the verifier only
    verdict = TaskVerdict(
        checker=v.checker or DEFAULT_CHECKER, verifier_task_id=v.id, outcome=outcome,
        verdicts=list(verdicts), category=category, attempt=maker.attempt, node=v.node, worker=worker,
    )
    changes.extend(_after_verdict(maker, verdict))
    return changes


def synthesized_blocked_verdict(v: TaskState, maker: TaskState, reason: str) -> Changes:
    """A verifier that can no longer report (dead-lettered, cancelled) counts as
    BLOCKED/infrastructure for its maker, so the maker is never stuck verifying."""
    if maker.state != "verifying" or v.id not in maker.verifier_task_ids:
        return []
    if any(r.verifier_task_id == v.id for r in maker.verdicts):
        return []
    verdict = TaskVerdict(
        checker=v.checker or DEFAULT_CHECKER, verifier_task_id=v.id, outcome="BLOCKED",
        category="infrastructure", attempt=maker.attempt, node=v.node, worker=v.worker, synthesized=True,
    )
    return _after_verdict(maker, verdict)


def _unmet(records: Sequence[VerdictRecord]) -> list[Unmet]:
    out = []
    for r in records:
        for vd in r.verdicts:
            if vd.verdict == "FAIL":
                out.append(Unmet(requirement_id=vd.requirement_id, reason=vd.reason, checker=r.checker))
    return out


def _after_verdict(maker: TaskState, verdict: TaskVerdict) -> Changes:
    events: list[TaskEvent] = [verdict]
    records = [*maker.verdicts, VerdictRecord(
        checker=verdict.checker, verifier_task_id=verdict.verifier_task_id, outcome=verdict.outcome,
        verdicts=verdict.verdicts, category=verdict.category, node=verdict.node, worker=verdict.worker,
    )]
    reported = {r.verifier_task_id for r in records}
    if not set(maker.verifier_task_ids) <= reported:
        return [(maker.id, events)]
    extra: Changes = []
    attempt = maker.attempt
    checkers = [r.checker for r in records]
    rework = [r for r in records if r.outcome == "FAIL" or (r.outcome == "BLOCKED" and r.category == "code")]
    human = [r for r in records if r.outcome == "BLOCKED" and r.category in ("environment", "info_missing")]
    infra = [r for r in records if r.outcome == "BLOCKED" and r.category == "infrastructure"]
    if not rework and not human and not infra:
        events.append(TaskVerified(attempt=attempt, checkers=checkers))
    elif rework:
        unmet = _unmet(rework) or [
            Unmet(requirement_id="-", reason=f"{r.checker} reported BLOCKED/code", checker=r.checker)
            for r in rework
        ]
        events.append(TaskRejected(attempt=attempt, unmet_requirements=unmet,
                                   reason=", ".join(f"{r.checker}: {r.outcome}" for r in rework)))
        if maker.retry_predecessor and attempt < maker.max_attempts:
            events.append(TaskRetryScheduled(attempt=attempt + 1, rework_notes=unmet, reason="rejected"))
        else:
            why = ("retries exhausted" if maker.retry_predecessor
                   else "rejected and retry_predecessor is false")
            events.append(_blocked(maker, why, unmet, None))
    elif human:
        cat = human[0].category
        events.append(_blocked(maker, f"checker reported BLOCKED/{cat}", _unmet(records), cat))
    elif maker.reverify_count == 0:
        checkers_now = [r.checker for r in infra]
        ids = verifier_ids(maker, checkers_now, attempt)
        events.append(TaskReverifyScheduled(attempt=attempt, verifier_task_ids=ids,
                                            reason="BLOCKED/infrastructure: verifying again"))
        # checkers that already passed keep their verdicts only for this round's
        # record; a re-verification asks again of those that could not run
        extra = _verifier_tasks(maker, ids, checkers_now, maker.maker_node, maker.maker_worker)
    else:
        events.append(_blocked(maker, "BLOCKED/infrastructure twice in a row",
                               _unmet(records), "infrastructure"))
    return [(maker.id, events), *extra]


def _blocked(maker: TaskState, reason: str, unmet: list[Unmet], category: Category | None) -> TaskBlocked:
    return TaskBlocked(
        blocker_id=f"B-{maker.id}-{maker.blockers_opened + 1}", reason=reason,
        unmet_requirements=unmet, category=category, attempt=maker.attempt,
    )


def decide_fail(s: TaskState, *, lease_id: str, worker: str, error: str) -> list[TaskEvent]:
    _check_lease(s, lease_id, worker, ("claimed", "running"), "fail")
    events: list[TaskEvent] = [TaskFailed(attempt=s.attempt, error=error, worker=worker)]
    if s.attempt < s.max_attempts:
        events.append(TaskRetryScheduled(attempt=s.attempt + 1, rework_notes=s.rework_notes,
                                         reason=f"failed: {error}"[:500]))
    else:
        events.append(TaskDeadlettered(reason=f"failed on the last attempt: {error}"[:500],
                                       attempt=s.attempt))
    return events


def decide_lease_expired(s: TaskState, *, lease_id: str) -> list[TaskEvent]:
    if s.state not in ("claimed", "running") or s.lease_id != lease_id:
        return []
    if s.attempt < s.max_attempts:
        return [TaskLeaseExpired(lease_id=lease_id, attempt=s.attempt, worker=s.worker,
                                 next_attempt=s.attempt + 1)]
    return [
        TaskLeaseExpired(lease_id=lease_id, attempt=s.attempt, worker=s.worker, next_attempt=None),
        TaskDeadlettered(reason="lease expired on the last attempt", attempt=s.attempt),
    ]


CANCELLABLE: Final = frozenset({
    "pending", "claimed", "running", "verifying", "rejected", "blocked", "failed",
    "in_progress", "round_review",
})


def decide_cancel(s: TaskState, *, reason: str, by: str) -> list[TaskEvent]:
    if s.state not in CANCELLABLE:
        raise InvalidTransition(f"task {s.id} is {s.state} and cannot be cancelled", state=s.state)
    return [TaskCancelled(reason=reason, by=by)]


def decide_unblock(
    s: TaskState, *, action: Literal["retry", "reverify"], notes: str | None,
) -> Changes:
    if s.state != "blocked" or s.blocker_id is None:
        raise InvalidTransition(f"task {s.id} is {s.state}, not blocked", state=s.state)
    if action == "retry":
        return [(s.id, [TaskUnblocked(blocker_id=s.blocker_id, action="retry", notes=notes, attempt=1)])]
    if s.verification is None or (s.maker_node is None and s.maker_worker is None):
        raise InvalidTransition(f"task {s.id} has no completed work to verify again")
    checkers = list(s.verification.checkers)
    ids = verifier_ids(s, checkers, s.attempt)
    return [
        (s.id, [TaskUnblocked(blocker_id=s.blocker_id, action="reverify", notes=notes,
                              attempt=s.attempt, verifier_task_ids=ids)]),
        *_verifier_tasks(s, ids, checkers, s.maker_node, s.maker_worker),
    ]


def decide_collect(s: TaskState, *, by: str) -> list[TaskEvent]:
    if s.task_type == "verify" or s.state not in ("completed", "verified") or s.is_parent:
        raise InvalidTransition(f"task {s.id} is not ready to collect", state=s.state)
    return [TaskCollected(by=by)]


def decide_escalate(s: TaskState, *, waited_seconds: int) -> list[TaskEvent]:
    if s.escalated or s.state not in ("pending", "round_review"):
        return []
    what = "nobody claimed it" if s.state == "pending" else "its round review is waiting"
    return [TaskEscalated(state=s.state, waited_seconds=waited_seconds,
                          reason=f"{what} within {s.escalate_after_seconds}s")]


def round_outcome(states: Sequence[str]) -> tuple[int, int, int] | None:
    """(done, failed, cancelled) when every sub-task of a round is terminal, else None."""
    done = failed = cancelled = 0
    for st in states:
        if st in DONE_STATES:
            done += 1
        elif st in FAILED_STATES:
            failed += 1
        elif st in CANCELLED_STATES:
            cancelled += 1
        else:
            return None
    return done, failed, cancelled


def decide_round_check(parent: TaskState, subtask_states: Sequence[str]) -> list[TaskEvent]:
    """Open the review once every sub-task of the parent's current round is terminal."""
    if not parent.is_parent or parent.state != "in_progress" or not subtask_states:
        return []
    outcome = round_outcome(subtask_states)
    if outcome is None:
        return []
    done, failed, cancelled = outcome
    return [TaskRoundReview(round=parent.round or 1, total=len(subtask_states), done=done,
                            failed=failed, cancelled=cancelled)]


def decide_round_review(
    parent: TaskState, *, decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"], notes: str,
    goal_clear: bool | str | None, coverage: str | None, next_round: str | None,
    new_subtasks: Sequence[NewTask], reviewer: str, existing_ids: set[str], default_escalation: int,
) -> Changes:
    if not parent.is_parent or parent.state != "round_review":
        raise InvalidTransition(f"task {parent.id} is {parent.state}, not in round review",
                                state=parent.state)
    rnd = parent.round or 1
    if decision == "GOAL_ACHIEVED":
        if new_subtasks:
            raise ValidationFailed("GOAL_ACHIEVED takes no new_subtasks")
        return [(parent.id, [
            TaskRoundReviewed(round=rnd, decision=decision, notes=notes, goal_clear=goal_clear,
                              coverage=coverage, next_round=next_round, reviewer=reviewer),
            TaskClosed(round=rnd),
        ])]
    if not new_subtasks:
        raise ValidationFailed("NEW_ROUND needs new_subtasks")
    ids = [t.id for t in new_subtasks]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("new_subtasks ids must be unique")
    taken = [i for i in ids if i in existing_ids]
    if taken:
        raise AlreadyExists(f"tasks already exist: {', '.join(taken)}")
    for t in new_subtasks:
        validate_new_task(t)
    parent_events: list[TaskEvent] = [TaskRoundReviewed(
        round=rnd, decision=decision, notes=notes, goal_clear=goal_clear, coverage=coverage,
        next_round=next_round, new_subtask_ids=ids, reviewer=reviewer,
    )]
    changes: Changes = []
    for t in new_subtasks:
        t2 = msgspec.structs.replace(t, parent_task_id=parent.id)
        changes.append((t.id, [_created(t2, default_escalation=default_escalation, round_=rnd + 1)]))
        parent_events.append(TaskSubtaskAdded(subtask_id=t.id, round=rnd + 1))
    return [(parent.id, parent_events), *changes]


def require_role_node(node: str | None) -> str:
    if node is None:
        raise Forbidden("this token is not bound to a node")
    return node
