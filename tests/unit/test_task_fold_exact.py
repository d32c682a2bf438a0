"""`evolve`, exactly: each task event changes exactly the fields the rules say, and no other
(pure model, no database). The state before each event is a busy one, so a field the fold
forgets to set, or sets when it must not, shows."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from taskledger.events.task.events import (
    RequirementVerdict,
    RoundRecord,
    TaskBlocked,
    TaskCancelled,
    TaskClaimed,
    TaskClosed,
    TaskCollected,
    TaskCompleted,
    TaskCreated,
    TaskDeadlettered,
    TaskEscalated,
    TaskEvent,
    TaskFailed,
    TaskLeaseExpired,
    TaskReassigned,
    TaskRejected,
    TaskReleased,
    TaskRetryScheduled,
    TaskReverifyScheduled,
    TaskRoundReopened,
    TaskRoundReview,
    TaskRoundReviewed,
    TaskStarted,
    TaskSubtaskAdded,
    TaskUnblocked,
    TaskVerdict,
    TaskVerified,
    TaskVerifying,
    Unmet,
    VerdictRecord,
    Verification,
)
from taskledger.events.task.state import TaskState, evolve

THEN = "2026-11-23T00:00:00.000000Z"
PASS = VerdictRecord(checker="a", verifier_task_id="Va", outcome="PASS", node="n2", worker="w2", token_id="t2")
FAIL = VerdictRecord(checker="b", verifier_task_id="Vb", outcome="FAIL",
                     verdicts=[RequirementVerdict(requirement_id="R1", verdict="FAIL", reason="no")])
OLD = VerdictRecord(checker="z", verifier_task_id="Vz", outcome="FAIL")
NOTE = Unmet(requirement_id="R1", reason="no", checker="b")

BUSY = TaskState(
    id="T", project="p", title="t", state="running", attempt=2, max_attempts=3, node="n1", worker="w1",
    token_id="tok", lease_id="L", lease_expires_at="2026-11-22T00:01:00.000000Z", result="r0", error="e0",
    verification=Verification(checkers=["a", "b"]), verifier_task_ids=["Va", "Vb"],
    all_verifier_task_ids=["V0", "Va", "Vb"], verdicts=[PASS, FAIL], previous_verdicts=[OLD],
    reverify_count=1, maker_node="n0", maker_worker="w0", rework_notes=[NOTE], operator_notes="op",
    blocker_id="B-T-1", blockers_opened=1, assignee="w1", escalated=True, ready_at="2026-11-21T00:00:00.000000Z",
    rounds=[RoundRecord(round=1, subtask_ids=["S1"]), RoundRecord(round=2, subtask_ids=["S2"])], round=2,
    is_parent=False, cancel_reason=None, created_at="c", updated_at="u", version=7, seq=70,
)
UNHELD: dict[str, Any] = {"node": None, "worker": None, "token_id": None, "lease_id": None,
                          "lease_expires_at": None}
NO_LEASE: dict[str, Any] = {"lease_id": None, "lease_expires_at": None}
READY: dict[str, Any] = {"ready_at": THEN, "escalated": False}


def _folds(s: TaskState, ev: TaskEvent, **changed: Any) -> None:
    assert evolve(s, ev, seq=99, version=s.version + 1, at=THEN) == msgspec.structs.replace(
        s, **changed, seq=99, version=s.version + 1, updated_at=THEN)


@pytest.mark.parametrize(("ev", "changed"), [
    (TaskClaimed(node="n5", worker="w5", token_id="t5", lease_id="L5", lease_expires_at="x", attempt=3),
     {"state": "claimed", "node": "n5", "worker": "w5", "token_id": "t5", "lease_id": "L5",
      "lease_expires_at": "x", "attempt": 3, "escalated": False, "ready_at": None}),
    (TaskStarted(worker="w1"), {"state": "running"}),
    (TaskVerified(attempt=2, checkers=["a", "b"]), {"state": "verified"}),
    (TaskRejected(attempt=2, unmet_requirements=[]), {"state": "rejected"}),
    (TaskRetryScheduled(attempt=3, rework_notes=[Unmet(requirement_id="R2")]),
     {"state": "pending", "attempt": 3, "rework_notes": [Unmet(requirement_id="R2")], "verifier_task_ids": [],
      "verdicts": [], "previous_verdicts": [PASS, FAIL], **UNHELD, **READY}),
    (TaskBlocked(blocker_id="B-T-2", reason="r"),
     {"state": "blocked", "blocker_id": "B-T-2", "blockers_opened": 2, **NO_LEASE}),
    (TaskReverifyScheduled(attempt=2, verifier_task_ids=["Vb2"], kept_verifier_task_ids=["Va"]),
     {"state": "verifying", "verifier_task_ids": ["Va", "Vb2"], "all_verifier_task_ids": ["V0", "Va", "Vb", "Vb2"],
      "verdicts": [PASS], "reverify_count": 2}),
    (TaskUnblocked(blocker_id="B-T-1", action="retry", notes="n", attempt=1, rework_notes=[NOTE]),
     {"state": "pending", "attempt": 1, "blocker_id": None, "rework_notes": [NOTE], "operator_notes": "n",
      "verifier_task_ids": [], "verdicts": [], "previous_verdicts": [PASS, FAIL], **UNHELD, **READY}),
    (TaskUnblocked(blocker_id="B-T-1", action="reverify", notes="n", attempt=2, verifier_task_ids=["Vb2"],
                   kept_verifier_task_ids=["Va"]),
     {"state": "verifying", "verifier_task_ids": ["Va", "Vb2"], "all_verifier_task_ids": ["V0", "Va", "Vb", "Vb2"],
      "verdicts": [PASS], "blocker_id": None, "reverify_count": 0, "operator_notes": "n"}),
    (TaskFailed(attempt=2, error="boom"), {"state": "failed", "error": "boom", **NO_LEASE}),
    (TaskLeaseExpired(lease_id="L", attempt=2, next_attempt=None), NO_LEASE),
    (TaskLeaseExpired(lease_id="L", attempt=2, next_attempt=3),
     {"state": "pending", "attempt": 3, **UNHELD, **READY}),
    (TaskReleased(worker="w1"), {"state": "pending", **UNHELD, **READY}),
    (TaskReassigned(assignee="w9"), {"assignee": "w9"}),
    (TaskDeadlettered(reason="r"), {"state": "deadletter", **NO_LEASE}),
    (TaskCancelled(reason="stop"), {"state": "cancelled", "cancel_reason": "stop", **NO_LEASE}),
    (TaskCollected(), {"state": "collected", "collected": True}),
    (TaskEscalated(state="pending", waited_seconds=1), {"escalated": True}),
    (TaskRoundReopened(round=2, subtask_id="S2"), {"state": "in_progress", "ready_at": None, "escalated": False}),
    (TaskClosed(round=2), {"state": "done", "ready_at": None}),
])
def test_each_event_changes_exactly_its_fields(ev: TaskEvent, changed: dict[str, Any]) -> None:
    _folds(BUSY, ev, **changed)


def test_a_retry_after_a_panel_without_verdicts_keeps_the_previous_verdicts() -> None:
    s = msgspec.structs.replace(BUSY, verdicts=[])
    _folds(s, TaskRetryScheduled(attempt=3), state="pending", attempt=3, rework_notes=[], verifier_task_ids=[],
           verdicts=[], previous_verdicts=[OLD], **UNHELD, **READY)
    _folds(s, TaskUnblocked(blocker_id="B", action="retry"), state="pending", attempt=1, blocker_id=None,
           rework_notes=[], operator_notes=None, verifier_task_ids=[], verdicts=[], previous_verdicts=[OLD],
           **UNHELD, **READY)


def test_a_reassign_restarts_the_wait_only_of_a_pending_task() -> None:
    _folds(msgspec.structs.replace(BUSY, state="pending"), TaskReassigned(assignee=None), assignee=None, **READY)


def test_a_completion_records_the_maker_or_the_checkers_word() -> None:
    verdicts = [RequirementVerdict(requirement_id="R1", verdict="PASS")]
    done = TaskCompleted(worker="w1", result="r1", outcome="PASS", verdicts=verdicts, category=None)
    _folds(BUSY, done, state="completed", result="r1", maker_node="n1", maker_worker="w1", **NO_LEASE)
    v = msgspec.structs.replace(BUSY, task_type="verify")
    _folds(v, TaskCompleted(worker="w1", result="r1", outcome="BLOCKED", verdicts=verdicts, category="code"),
           state="completed", result="r1", outcome="BLOCKED", verify_verdicts=verdicts, category="code", **NO_LEASE)


def test_a_verification_starts_a_fresh_panel() -> None:
    _folds(BUSY, TaskVerifying(attempt=2, checkers=["a"], verifier_task_ids=["Vn"], maker_node="n1",
                               maker_worker="w1"),
           state="verifying", verifier_task_ids=["Vn"], all_verifier_task_ids=["V0", "Va", "Vb", "Vn"], verdicts=[],
           reverify_count=0, maker_node="n1", maker_worker="w1")


def test_a_verdict_is_recorded_whole() -> None:
    rv = [RequirementVerdict(requirement_id="R1", verdict="PASS", reason="ok")]
    ev = TaskVerdict(checker="c", verifier_task_id="Vc", outcome="BLOCKED", verdicts=rv, category="code",
                     attempt=2, node="n3", worker="w3", reason="why", token_id="t3", synthesized=True)
    _folds(BUSY, ev, verdicts=[PASS, FAIL, VerdictRecord(
        checker="c", verifier_task_id="Vc", outcome="BLOCKED", verdicts=rv, category="code", node="n3",
        worker="w3", reason="why", token_id="t3")])


def test_sub_tasks_make_a_parent_and_fill_its_rounds() -> None:
    leaf = msgspec.structs.replace(BUSY, state="pending", rounds=[], round=None)
    _folds(leaf, TaskSubtaskAdded(subtask_id="S1", round=1), is_parent=True, round=1, state="in_progress",
           ready_at=None, escalated=False, rounds=[RoundRecord(round=1, subtask_ids=["S1"])])
    parent = msgspec.structs.replace(BUSY, state="in_progress", is_parent=True)
    _folds(parent, TaskSubtaskAdded(subtask_id="S3", round=2), rounds=[
        RoundRecord(round=1, subtask_ids=["S1"]), RoundRecord(round=2, subtask_ids=["S2", "S3"])])
    _folds(parent, TaskSubtaskAdded(subtask_id="S4", round=3), rounds=[
        RoundRecord(round=1, subtask_ids=["S1"]), RoundRecord(round=2, subtask_ids=["S2"]),
        RoundRecord(round=3, subtask_ids=["S4"])])


def test_a_round_review_and_its_answers_land_on_their_round() -> None:
    parent = msgspec.structs.replace(BUSY, state="in_progress", is_parent=True)
    _folds(parent, TaskRoundReview(round=2, total=4, done=1, failed=2, cancelled=1), state="round_review",
           **READY, rounds=[RoundRecord(round=1, subtask_ids=["S1"]),
                            RoundRecord(round=2, subtask_ids=["S2"], total=4, done=1, failed=2, cancelled=1)])
    answers: dict[str, Any] = {"notes": "n", "goal_clear": True, "coverage": "c", "next_round": "x"}
    _folds(parent, TaskRoundReviewed(round=2, decision="GOAL_ACHIEVED", reviewer="r", **answers), rounds=[
        RoundRecord(round=1, subtask_ids=["S1"]),
        RoundRecord(round=2, subtask_ids=["S2"], decision="GOAL_ACHIEVED", reviewed_by="r", **answers)])
    _folds(parent, TaskRoundReviewed(round=2, decision="NEW_ROUND", reviewer="r", **answers), rounds=[
        RoundRecord(round=1, subtask_ids=["S1"]),
        RoundRecord(round=2, subtask_ids=["S2"], decision="NEW_ROUND", reviewed_by="r", **answers)],
        round=3, state="in_progress", ready_at=None, escalated=False)


def test_a_stream_starts_with_its_creation_and_only_once() -> None:
    ev = TaskCreated(id="V", project="p", title="t", spec="s", task_type="verify", parent_task_id="T", priority=2,
                     estimated_minutes=5, verification=Verification(), max_attempts=4, retry_predecessor=False,
                     assignee="a", labels=["l"], node_blacklist=["n1"], escalate_after_seconds=9, round=2,
                     checker="c", maker_attempt=3, maker_node="n1", maker_worker="w", notes="op")
    assert evolve(None, ev, seq=5, version=1, at=THEN) == TaskState(
        id="V", project="p", title="t", spec="s", task_type="verify", parent_task_id="T", priority=2,
        estimated_minutes=5, verification=Verification(), max_attempts=4, retry_predecessor=False, assignee="a",
        labels=["l"], node_blacklist=["n1"], escalate_after_seconds=9, subtask_round=2, checker="c",
        maker_attempt=3, maker_node="n1", maker_worker="w", operator_notes="op", ready_at=THEN, created_at=THEN,
        updated_at=THEN, version=1, seq=5)
    with pytest.raises(ValueError, match=r"^task\.created on an existing stream$"):
        evolve(BUSY, ev, seq=1, version=1, at=THEN)
    with pytest.raises(ValueError, match=r"^a task stream must start with task\.created, not task\.started$"):
        evolve(None, TaskStarted(worker="w"), seq=1, version=1, at=THEN)


def test_every_event_of_the_union_has_its_change_and_no_other_class_has_one() -> None:
    from taskledger.events.task import state as task_state
    from taskledger.events.task.events import AnyTaskEvent

    assert set(task_state._CHANGES) == set(AnyTaskEvent.__args__)
    with pytest.raises(ValueError, match="unknown task event"):
        evolve(BUSY, VerdictRecord(checker="a", verifier_task_id="V", outcome="PASS"),  # type: ignore[arg-type]
               seq=1, version=1, at=THEN)
