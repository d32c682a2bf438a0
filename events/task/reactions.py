"""Rules that span tasks, as named pure reactions dispatched from one table.

After every change the service settles: for each task whose state changed, each
reaction in `REACTIONS` whose `when` holds is given the task and the
neighbours it `needs` (loaded by the service), and returns more changes, which
settle in turn, in the same transaction. Read the table to know every rule
that reaches across tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, Literal, NamedTuple

from taskledger.events.task.events import TaskCancelled
from taskledger.events.task.panel import synthesized_blocked_verdict
from taskledger.events.task.rounds import decide_round_check, decide_round_reopen
from taskledger.events.task.rules import CANCELLABLE, Changes
from taskledger.events.task.state import TERMINAL_FOR_ROUND, TaskState

Needs = Literal["parent", "round", "children"]
"""What a reaction is given besides the task:
`parent`: the task's parent (a verifier's maker, a sub-task's parent);
`round`: the parent and the sub-tasks of the parent's current round;
`children`: the task's current verifiers and its sub-tasks."""


class Around(NamedTuple):
    parent: TaskState | None = None
    others: Sequence[TaskState] = ()


class Reaction(NamedTuple):
    name: str
    needs: Needs
    when: Callable[[TaskState], bool]
    react: Callable[[TaskState, Around], Changes]


def dead_verifier_counts_as_blocked_infrastructure(v: TaskState, around: Around) -> Changes:
    return synthesized_blocked_verdict(v, around.parent) if around.parent is not None else []


def cancelled_task_cancels_its_open_verifiers_and_subtasks(s: TaskState, around: Around) -> Changes:
    return [(c.id, [TaskCancelled(reason=f"{s.id} was cancelled")]) for c in around.others
            if c.state in CANCELLABLE]


def last_terminal_subtask_opens_the_review(s: TaskState, around: Around) -> Changes:
    p = around.parent
    return [(p.id, events)] if p is not None and (events := decide_round_check(p, around.others)) else []


def reopened_subtask_reopens_its_round(s: TaskState, around: Around) -> Changes:
    p = around.parent
    return [(p.id, events)] if p is not None and (events := decide_round_reopen(p, s)) else []


def _is_subtask(s: TaskState) -> bool:
    return s.task_type != "verify" and s.parent_task_id is not None


REACTIONS: Final[tuple[Reaction, ...]] = (
    Reaction("dead_verifier_counts_as_blocked_infrastructure", "parent",
             lambda s: s.task_type == "verify" and s.parent_task_id is not None
             and s.state in ("deadletter", "cancelled"),
             dead_verifier_counts_as_blocked_infrastructure),
    Reaction("cancelled_task_cancels_its_open_verifiers_and_subtasks", "children",
             lambda s: s.task_type != "verify" and s.state == "cancelled",
             cancelled_task_cancels_its_open_verifiers_and_subtasks),
    Reaction("last_terminal_subtask_opens_the_review", "round",
             lambda s: _is_subtask(s) and s.state in TERMINAL_FOR_ROUND,
             last_terminal_subtask_opens_the_review),
    Reaction("reopened_subtask_reopens_its_round", "parent",
             lambda s: _is_subtask(s) and s.state not in TERMINAL_FOR_ROUND,
             reopened_subtask_reopens_its_round),
)


def children_of(s: TaskState, tasks: Sequence[TaskState]) -> list[TaskState]:
    """The task's current verifiers and its sub-tasks, among `tasks`."""
    ids = set(s.verifier_task_ids)
    return [t for t in tasks if t.id in ids or (t.parent_task_id == s.id and t.task_type != "verify")]
