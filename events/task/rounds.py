"""Parents run in rounds of sub-tasks; a reviewer closes each round with three answers.

Seed 003, Phase 6: a round's review opens when every sub-task of the round is
terminal (done or failed), and the reviewer answers: is the goal still clear,
do the results cover it, what does the next round do.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from taskledger.events.errors import AlreadyExists, InvalidTransition, ValidationFailed
from taskledger.events.task.events import (
    Decision,
    TaskClosed,
    TaskEvent,
    TaskRoundReopened,
    TaskRoundReview,
    TaskRoundReviewed,
    TaskSubtaskAdded,
)
from taskledger.events.task.rules import Changes, NewTask, task_created, validate_new_task
from taskledger.events.task.state import CANCELLED_STATES, DONE_STATES, FAILED_STATES, TERMINAL_FOR_ROUND, TaskState


class Review(msgspec.Struct, frozen=True, kw_only=True):
    decision: Decision
    goal_clear: bool | str | None
    coverage: str | None
    next_round: str | None
    notes: str = ""
    new_subtasks: Sequence[NewTask] = ()
    reviewer: str | None = None


def round_outcome(subtasks: Sequence[TaskState]) -> tuple[int, int, int] | None:
    """(done, failed, cancelled) when every sub-task of a round is terminal, else None."""
    done = failed = cancelled = 0
    for s in subtasks:
        if s.state in DONE_STATES:
            done += 1
        elif s.state in FAILED_STATES:
            failed += 1
        elif s.state in CANCELLED_STATES:
            cancelled += 1
        else:
            return None
    return done, failed, cancelled


def in_round(parent: TaskState, subtasks: Sequence[TaskState]) -> list[TaskState]:
    """The sub-tasks of the parent's current round."""
    rnd = parent.round or 1
    return [s for s in subtasks if s.parent_task_id == parent.id and s.task_type != "verify"
            and (s.subtask_round or 1) == rnd]


def decide_round_check(parent: TaskState, subtasks: Sequence[TaskState]) -> list[TaskEvent]:
    """Open the review once every sub-task of the parent's current round is terminal."""
    subs = in_round(parent, subtasks)
    if not parent.is_parent or parent.state != "in_progress" or not subs:
        return []
    outcome = round_outcome(subs)
    if outcome is None:
        return []
    done, failed, cancelled = outcome
    return [TaskRoundReview(round=parent.round or 1, total=len(subs), done=done, failed=failed,
                            cancelled=cancelled)]


def decide_round_reopen(parent: TaskState, sub: TaskState) -> list[TaskEvent]:
    """A sub-task of the round under review is open again (unblocked, retried): the
    round runs on until it ends again."""
    if parent.state != "round_review" or sub.state in TERMINAL_FOR_ROUND or not in_round(parent, [sub]):
        return []
    return [TaskRoundReopened(round=parent.round or 1, subtask_id=sub.id, reason=f"{sub.id} is {sub.state} again")]


def _answered(v: bool | str | None) -> bool:
    return isinstance(v, bool) or (isinstance(v, str) and v.strip() != "")


def validate_review(r: Review) -> None:
    missing = [name for name, v in (("goal_clear", r.goal_clear), ("coverage", r.coverage),
                                    ("next_round", r.next_round)) if not _answered(v)]
    if missing:
        raise ValidationFailed("a round review answers the three questions; missing: " + ", ".join(missing))
    if r.decision == "GOAL_ACHIEVED" and r.new_subtasks:
        raise ValidationFailed("GOAL_ACHIEVED takes no new_subtasks")
    if r.decision == "NEW_ROUND" and not r.new_subtasks:
        raise ValidationFailed("NEW_ROUND needs new_subtasks")
    ids = [t.id for t in r.new_subtasks]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("new_subtasks ids must be unique")
    for t in r.new_subtasks:
        validate_new_task(t)


def decide_round_review(
    parent: TaskState, r: Review, subtasks: Sequence[TaskState], *, existing_ids: set[str],
    default_escalation: int,
) -> Changes:
    validate_review(r)
    if not parent.is_parent or parent.state != "round_review":
        raise InvalidTransition(f"task {parent.id} is {parent.state}, not in round review", state=parent.state)
    open_ = [s.id for s in in_round(parent, subtasks) if s.state not in TERMINAL_FOR_ROUND]
    if open_:
        raise InvalidTransition(f"sub-tasks of the round are still open: {', '.join(open_)}", state=parent.state)
    rnd = parent.round or 1
    reviewed = TaskRoundReviewed(round=rnd, decision=r.decision, notes=r.notes, goal_clear=r.goal_clear,
                                 coverage=r.coverage, next_round=r.next_round,
                                 new_subtask_ids=[t.id for t in r.new_subtasks], reviewer=r.reviewer)
    if r.decision == "GOAL_ACHIEVED":
        return [(parent.id, [reviewed, TaskClosed(round=rnd)])]
    taken = [t.id for t in r.new_subtasks if t.id in existing_ids]
    if taken:
        raise AlreadyExists(f"tasks already exist: {', '.join(taken)}")
    changes: Changes = [(t.id, [task_created(msgspec.structs.replace(t, parent_task_id=parent.id),
                                             default_escalation=default_escalation, round_=rnd + 1)])
                        for t in r.new_subtasks]
    return [(parent.id, [reviewed, *(TaskSubtaskAdded(subtask_id=t.id, round=rnd + 1) for t in r.new_subtasks)]),
            *changes]
