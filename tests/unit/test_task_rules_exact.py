"""The task rules, exactly: every refusal by its class, detail and `extra`, every
decision by its whole event list, every fold by its whole state (pure model, no database)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import msgspec
import pytest

from taskledger.events.errors import AlreadyExists, DomainError, InvalidTransition, LeaseMismatch, ValidationFailed
from taskledger.events.lease import Holder
from taskledger.events.task.events import (
    CheckerReport,
    Requirement,
    RequirementVerdict,
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
from taskledger.events.task.panel import (
    Verdict,
    decide_complete,
    decide_unblock,
    decide_verifier_complete,
    synthesized_blocked_verdict,
    validate_verdict,
    verifier_ids,
    verifier_tasks,
)
from taskledger.events.task.reactions import (
    Around,
    cancelled_task_cancels_its_open_verifiers_and_subtasks,
    children_of,
    dead_verifier_counts_as_blocked_infrastructure,
    last_terminal_subtask_opens_the_review,
    reopened_subtask_reopens_its_round,
)
from taskledger.events.task.rounds import (
    Review,
    decide_round_check,
    decide_round_reopen,
    decide_round_review,
    in_round,
    round_outcome,
    validate_review,
)
from taskledger.events.task.rules import (
    Claim,
    NewTask,
    check_heartbeat,
    claimable_by,
    decide_cancel,
    decide_claim,
    decide_collect,
    decide_create,
    decide_escalate,
    decide_fail,
    decide_lease_expired,
    decide_reassign,
    decide_release,
    decide_start,
    escalate_at,
    validate_new_task,
)
from taskledger.events.task.state import TaskState, evolve
from tests.task_world import AT, NOW, World, holder_of, panel


@contextmanager
def refused(err: type[DomainError], detail: str, **extra: Any) -> Iterator[None]:
    """The exact refusal: its class (so its code and status), its detail and its extra fields."""
    with pytest.raises(DomainError) as e:
        yield
    assert (type(e.value), e.value.detail, e.value.extra) == (err, detail, extra)


def _new(tid: str = "T1", **kw: Any) -> NewTask:
    return NewTask(id=tid, project="p", title="t", **kw)


# ------------------------------------------------------------ create: what a new task may be


@pytest.mark.parametrize(("task", "detail"), [
    (_new(task_type="verify"), "verify tasks are created by the service when an implement task completes"),
    (_new(requirements=[Requirement(id="R1"), Requirement(id="R1")]), "requirement ids must be unique"),
    (_new(verification=Verification(checkers=[])), "verification.checkers must name at least one checker"),
    (_new(verification=Verification(checkers=["a", "a"])), "verification.checkers must be unique"),
    (_new(max_attempts=0), "max_attempts must be at least 1"),
    (_new(parent_task_id="T1"), "a task cannot be its own parent"),
])
def test_a_new_task_that_breaks_a_rule_is_refused_with_the_rule(task: NewTask, detail: str) -> None:
    with refused(ValidationFailed, detail):
        validate_new_task(task)
    with refused(ValidationFailed, detail):
        decide_create(None, task, None, default_escalation=60)


def test_a_new_task_at_the_limits_is_accepted() -> None:
    validate_new_task(_new(max_attempts=1, verification=None, requirements=[Requirement(id="R1"),
                                                                            Requirement(id="R2")]))
    validate_new_task(_new(verification=Verification(checkers=["a", "b"]), parent_task_id="P"))


def test_a_created_task_carries_every_field_of_its_command() -> None:
    t = _new(spec="s", priority=4, estimated_minutes=9, requirements=[Requirement(id="R1", text="x")],
             verification=Verification(checkers=["a"]), max_attempts=2, retry_predecessor=False, assignee="al",
             labels=["l"], node_blacklist=["n7"], escalate_after_seconds=5)
    assert decide_create(None, t, None, default_escalation=60) == [("T1", [TaskCreated(
        id="T1", project="p", title="t", spec="s", priority=4, estimated_minutes=9,
        requirements=[Requirement(id="R1", text="x")], verification=Verification(checkers=["a"]), max_attempts=2,
        retry_predecessor=False, assignee="al", labels=["l"], node_blacklist=["n7"], escalate_after_seconds=5)])]
    assert decide_create(None, _new(), None, default_escalation=60) == [("T1", [TaskCreated(
        id="T1", project="p", title="t", verification=Verification(), escalate_after_seconds=60)])]
    assert decide_create(None, _new(escalate_after_seconds=0), None, default_escalation=60)[0][1][0] == TaskCreated(
        id="T1", project="p", title="t", verification=Verification(), escalate_after_seconds=0)


def test_a_task_id_is_created_once() -> None:
    w = World()
    s = w.new()
    with refused(AlreadyExists, "task T1 already exists", task_id="T1"):
        decide_create(s, _new(), None, default_escalation=60)


def test_a_sub_task_goes_under_a_pending_task_or_a_running_round() -> None:
    w = World()
    with refused(ValidationFailed, "parent task P does not exist"):
        decide_create(None, _new("S1", parent_task_id="P"), None, default_escalation=60)
    p = w.new("P", verification=None)
    assert decide_create(None, _new("S1", parent_task_id="P"), p, default_escalation=7) == [
        ("S1", [TaskCreated(id="S1", project="p", title="t", parent_task_id="P", verification=Verification(),
                            escalate_after_seconds=7, round=1)]),
        ("P", [TaskSubtaskAdded(subtask_id="S1", round=1)])]
    w.new("S1", parent_task_id="P")
    p = w.states["P"]
    assert decide_create(None, _new("S2", parent_task_id="P"), msgspec.structs.replace(p, round=3),
                         default_escalation=7)[1] == ("P", [TaskSubtaskAdded(subtask_id="S2", round=3)])
    assert decide_create(None, _new("S2", parent_task_id="P"), msgspec.structs.replace(p, round=None),
                         default_escalation=7)[1] == ("P", [TaskSubtaskAdded(subtask_id="S2", round=1)])
    for state in ("round_review", "done", "pending"):
        detail = ("sub-tasks can be added to a pending task or a parent whose round is running; "
                  f"P is {state}" + (" (use round-review NEW_ROUND)" if state == "round_review" else ""))
        with refused(InvalidTransition, detail, state=state):
            decide_create(None, _new("S2", parent_task_id="P"), msgspec.structs.replace(p, state=state),
                          default_escalation=7)
    plain = w.new("Q", verification=None)
    with refused(InvalidTransition, "sub-tasks can be added to a pending task or a parent whose round is running; "
                 "Q is claimed", state="claimed"):
        decide_create(None, _new("S3", parent_task_id="Q"), msgspec.structs.replace(plain, state="claimed"),
                      default_escalation=7)
    w.new("T9")
    w.make("T9")
    with refused(InvalidTransition, "a verify task cannot have sub-tasks"):
        decide_create(None, _new("S4", parent_task_id="V-T9"), w.states["V-T9"], default_escalation=7)


# ------------------------------------------------------------ claim: who may take a task


def _claim(worker: str = "w", node: str | None = "n1", **kw: Any) -> Claim:
    return Claim(holder=Holder(worker=worker, node=node, token_id="tk", lease_id="L1"), **kw)


def test_who_may_claim_an_implement_task() -> None:
    s = TaskState(id="T", project="p", title="t", assignee="al", node_blacklist=["bad"])
    assert claimable_by(s, _claim("al"))
    assert not claimable_by(s, _claim("bo"))
    assert not claimable_by(s, _claim("al", "bad"))
    assert claimable_by(s, _claim("al", None))
    assert not claimable_by(msgspec.structs.replace(s, state="claimed"), _claim("al"))
    assert not claimable_by(msgspec.structs.replace(s, is_parent=True), _claim("al"))
    assert not claimable_by(s, _claim("al", task_types=("verify",)))
    assert claimable_by(s, _claim("al", projects=["p"]))
    assert not claimable_by(s, _claim("al", projects=["q"]))
    assert claimable_by(msgspec.structs.replace(s, assignee=None), _claim("anyone"))


def test_a_verifier_is_claimed_from_another_node_by_another_worker_only() -> None:
    v = TaskState(id="V", project="p", title="t", task_type="verify", maker_node="n1", maker_worker="mk")
    assert claimable_by(v, _claim("ch", "n2"))
    assert not claimable_by(v, _claim("ch", None))
    assert not claimable_by(v, _claim("ch", "n1"))
    assert not claimable_by(v, _claim("mk", "n2"))
    assert not claimable_by(v, _claim("ch", "n2", task_types=("implement",)))


def test_a_claim_records_the_whole_lease() -> None:
    s = TaskState(id="T", project="p", title="t", attempt=2)
    assert decide_claim(s, _claim("w", "n1", lease_seconds=90), NOW) == [TaskClaimed(
        node="n1", worker="w", token_id="tk", lease_id="L1", lease_expires_at="2026-11-22T00:01:30.000000Z",
        attempt=2)]
    assert decide_claim(s, _claim("w", "n1"), NOW)[0].lease_expires_at == "2026-11-22T00:01:00.000000Z"  # type: ignore[attr-defined]
    with refused(InvalidTransition, "task T cannot be claimed by w now", state="pending"):
        decide_claim(s, Claim(holder=Holder(worker="w", node="n1")), NOW)
    with refused(InvalidTransition, "task T cannot be claimed by w now", state="running"):
        decide_claim(msgspec.structs.replace(s, state="running"), _claim("w"), NOW)


# ------------------------------------------------------------ the lease: who holds it, and when it acts


def _held() -> tuple[World, TaskState]:
    w = World()
    w.new()
    return w, w.claim("T1", "alice", "n1")


def test_each_lease_refusal_says_what_is_wrong() -> None:
    _, s = _held()
    mine = holder_of(s)
    lid = s.lease_id
    assert lid is not None
    with refused(LeaseMismatch, "lease 'other' does not hold task T1", task_id="T1"):
        decide_start(s, msgspec.structs.replace(mine, lease_id="other"))
    with refused(LeaseMismatch, "lease None does not hold task T1", task_id="T1"):
        decide_start(s, msgspec.structs.replace(mine, lease_id=None))
    with refused(LeaseMismatch, "lease None does not hold task T1", task_id="T1"):
        decide_start(msgspec.structs.replace(s, lease_id=None), msgspec.structs.replace(mine, lease_id=None))
    with refused(LeaseMismatch, "task T1 is leased to another token", task_id="T1"):
        decide_start(s, msgspec.structs.replace(mine, token_id="x"))
    with refused(LeaseMismatch, "task T1 is leased to alice on node n1", task_id="T1"):
        decide_start(s, msgspec.structs.replace(mine, worker="bob"))
    with refused(LeaseMismatch, "task T1 is leased to alice on node n1", task_id="T1"):
        decide_start(s, msgspec.structs.replace(mine, node="n2"))
    old = msgspec.structs.replace(s, token_id=None)
    with refused(LeaseMismatch, "task T1 is leased to alice on node n1", task_id="T1"):
        decide_start(old, Holder(worker="alice", node="n2", token_id=None, lease_id=lid))
    assert decide_start(old, Holder(worker="alice", node="n1", token_id=None, lease_id=lid))


def test_each_lease_action_is_refused_outside_its_states() -> None:
    _, s = _held()
    h = holder_of(s)
    running = msgspec.structs.replace(s, state="running")
    with refused(InvalidTransition, "cannot start task T1: it is running", state="running"):
        decide_start(running, h)
    check_heartbeat(s, h)
    check_heartbeat(running, h)
    for state in ("completed", "pending", "verifying"):
        other = msgspec.structs.replace(s, state=state)
        with refused(InvalidTransition, f"cannot heartbeat task T1: it is {state}", state=state):
            check_heartbeat(other, h)
        with refused(InvalidTransition, f"cannot fail task T1: it is {state}", state=state):
            decide_fail(other, h, "x")
        with refused(InvalidTransition, f"cannot release task T1: it is {state}", state=state):
            decide_release(other, h)
    with refused(InvalidTransition, "cannot complete task T1: it is claimed", state="claimed"):
        decide_complete(s, h, None)
    with refused(LeaseMismatch, "task T1 is leased to alice on node n1", task_id="T1"):
        check_heartbeat(s, msgspec.structs.replace(h, worker="eve"))


def test_start_records_the_worker_node_and_attempt() -> None:
    _, s = _held()
    s = msgspec.structs.replace(s, attempt=2)
    assert decide_start(s, holder_of(s)) == [TaskStarted(worker="alice", node="n1", attempt=2)]


def test_a_failure_retries_with_the_rework_notes_until_the_last_attempt() -> None:
    _, s = _held()
    notes = [Unmet(requirement_id="R1", reason="r", checker="c")]
    s = msgspec.structs.replace(s, state="running", max_attempts=2, rework_notes=notes)
    h = holder_of(s)
    assert decide_fail(s, h, "boom") == [
        TaskFailed(attempt=1, error="boom", worker="alice"),
        TaskRetryScheduled(attempt=2, rework_notes=notes, reason="failed: boom")]
    last = msgspec.structs.replace(s, attempt=2)
    assert decide_fail(last, h, "boom") == [
        TaskFailed(attempt=2, error="boom", worker="alice"),
        TaskDeadlettered(reason="failed on the last attempt: boom", attempt=2)]
    long = "e" * 600
    assert decide_fail(s, h, long)[1] == TaskRetryScheduled(attempt=2, rework_notes=notes,
                                                            reason=("failed: " + long)[:500])
    assert decide_fail(last, h, long)[1] == TaskDeadlettered(
        reason=("failed on the last attempt: " + long)[:500], attempt=2)


def test_a_failure_folds_into_failed_then_pending_with_the_next_attempt() -> None:
    w, s = _held()
    w.run([("T1", decide_start(s, holder_of(s)))])
    before = w.states["T1"]
    w.run([("T1", decide_fail(before, holder_of(before), "boom"))])
    after = w.states["T1"]
    assert after == msgspec.structs.replace(
        before, state="pending", error="boom", attempt=2, node=None, worker=None, token_id=None, lease_id=None,
        lease_expires_at=None, ready_at=AT, escalated=False, version=before.version + 2, seq=before.seq + 2)


# ------------------------------------------------------------ reassign, cancel, collect, escalate


def test_reassign_refusals_name_the_task_and_state() -> None:
    w = World()
    s = w.new(assignee="al")
    with refused(InvalidTransition, "task T1 is already assigned to al", state="pending"):
        decide_reassign(s, "al", "p")
    for bad in (msgspec.structs.replace(s, state="claimed"), msgspec.structs.replace(s, is_parent=True),
                msgspec.structs.replace(s, task_type="verify")):
        with refused(InvalidTransition, f"only a pending task can be reassigned; T1 is {bad.state}", state=bad.state):
            decide_reassign(bad, "bo", "p")


def test_cancel_and_collect_refusals_name_the_task_and_state() -> None:
    s = TaskState(id="T", project="p", title="t", state="done")
    with refused(InvalidTransition, "task T is done and cannot be cancelled", state="done"):
        decide_cancel(s, "r", None)
    with refused(InvalidTransition, "task T is not ready to collect", state="done"):
        decide_collect(s, "p")
    for ok in ("completed", "verified"):
        decide_collect(msgspec.structs.replace(s, state=ok), "p")
        with refused(InvalidTransition, "task T is not ready to collect", state=ok):
            decide_collect(msgspec.structs.replace(s, state=ok, is_parent=True), "p")


def test_escalation_is_due_after_its_window_from_when_the_task_was_ready() -> None:
    s = TaskState(id="T", project="p", title="t", ready_at=AT, escalate_after_seconds=30)
    due = NOW + timedelta(seconds=30)
    assert escalate_at(s) == due
    assert decide_escalate(s, due) == [TaskEscalated(state="pending", waited_seconds=30,
                                                     reason="nobody claimed it within 30s")]
    review = msgspec.structs.replace(s, state="round_review", is_parent=True)
    assert escalate_at(review) == due
    assert decide_escalate(review, due + timedelta(seconds=5)) == [TaskEscalated(
        state="round_review", waited_seconds=35, reason="its round review is waiting within 30s")]
    for never in (msgspec.structs.replace(s, escalated=True), msgspec.structs.replace(s, state="claimed"),
                  msgspec.structs.replace(s, ready_at=None), msgspec.structs.replace(s, is_parent=True),
                  msgspec.structs.replace(s, escalate_after_seconds=0),
                  msgspec.structs.replace(s, escalate_after_seconds=None)):
        assert escalate_at(never) is None
        assert decide_escalate(never, NOW + timedelta(days=9)) == []


# ------------------------------------------------------------ completion opens the panel


def test_a_completion_opens_a_panel_of_verifiers_exactly() -> None:
    w = World()
    w.new(spec="do it", labels=["x"], node_blacklist=["n8"], max_attempts=2, escalate_after_seconds=40,
          verification=Verification(checkers=["a", "b"]), requirements=[Requirement(id="R1")])
    s = w.claim("T1", "mk", "n1")
    w.run([("T1", decide_start(s, holder_of(s)))])
    s = w.states["T1"]
    out = decide_complete(s, holder_of(s), {"ok": 1})
    common = dict(project="p", spec="do it", task_type="verify", parent_task_id="T1", priority=0,
                  estimated_minutes=10, requirements=[Requirement(id="R1")], verification=None, max_attempts=2,
                  retry_predecessor=False, labels=["x"], node_blacklist=["n1", "n8"], escalate_after_seconds=40,
                  maker_attempt=1, maker_node="n1", maker_worker="mk")
    assert out == [
        ("T1", [TaskCompleted(worker="mk", node="n1", attempt=1, result={"ok": 1}),
                TaskVerifying(attempt=1, checkers=["a", "b"], verifier_task_ids=["V-T1-a1-a", "V-T1-a1-b"],
                              maker_node="n1", maker_worker="mk")]),
        ("V-T1-a1-a", [TaskCreated(id="V-T1-a1-a", title="Verify (a): t", checker="a", **common)]),  # type: ignore[arg-type]
        ("V-T1-a1-b", [TaskCreated(id="V-T1-a1-b", title="Verify (b): t", checker="b", **common)])]  # type: ignore[arg-type]
    with refused(ValidationFailed, "a verify task is completed with an outcome and verdicts"):
        decide_complete(msgspec.structs.replace(s, task_type="verify"), holder_of(s), None)
    plain = msgspec.structs.replace(s, verification=None)
    assert decide_complete(plain, holder_of(s), None) == [
        ("T1", [TaskCompleted(worker="mk", node="n1", attempt=1)])]


def test_a_completion_folds_into_a_verifying_maker_and_pending_verifiers() -> None:
    w = World()
    w.new(verification=Verification(checkers=["a"], priority=3, estimated_minutes=4))
    s = w.claim("T1", "mk", "n1")
    w.run([("T1", decide_start(s, holder_of(s)))])
    before = w.states["T1"]
    w.run(decide_complete(before, holder_of(before), 5))
    assert w.states["T1"] == msgspec.structs.replace(
        before, state="verifying", result=5, lease_id=None, lease_expires_at=None, maker_node="n1",
        maker_worker="mk", verifier_task_ids=["V-T1-a1-a"], all_verifier_task_ids=["V-T1-a1-a"],
        version=before.version + 2, seq=before.seq + 2)
    assert w.states["V-T1-a1-a"] == TaskState(
        id="V-T1-a1-a", project="p", title="Verify (a): t", task_type="verify", parent_task_id="T1", priority=3,
        estimated_minutes=4, requirements=[Requirement(id="R1")], max_attempts=3, retry_predecessor=False,
        node_blacklist=["n1"], escalate_after_seconds=60, checker="a", maker_attempt=1, maker_node="n1",
        maker_worker="mk", ready_at=AT, created_at=AT, updated_at=AT, version=1, seq=before.seq + 3)


# ------------------------------------------------------------ verdicts: what a checker may say


def _running_verifier(**kw: Any) -> tuple[World, TaskState]:
    w = World()
    w.new(requirements=[Requirement(id="R1"), Requirement(id="R2")], **kw)
    w.make()
    v = w.claim("V-T1", "checker", "n2")
    w.run([("V-T1", decide_start(v, holder_of(v)))])
    return w, w.states["V-T1"]


def _rv(rid: str, verdict: str = "PASS", reason: str = "") -> RequirementVerdict:
    return RequirementVerdict(requirement_id=rid, verdict=verdict, reason=reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(("outcome", "verdicts", "category", "detail"), [
    ("BLOCKED", [], None, "a BLOCKED outcome needs a category"),
    ("PASS", [_rv("R1"), _rv("R2")], "code", "category is only for BLOCKED outcomes"),
    ("FAIL", [_rv("R1", "FAIL")], "code", "category is only for BLOCKED outcomes"),
    ("PASS", [_rv("R1", "FAIL"), _rv("R2", "FAIL")], None, "outcome PASS with FAIL verdicts: R1, R2"),
    ("FAIL", [_rv("R1")], None, "outcome FAIL needs at least one FAIL verdict naming the unmet requirement"),
    ("FAIL", [_rv("R1", "FAIL"), _rv("R1")], None, "one verdict per requirement"),
    ("FAIL", [_rv("R9", "FAIL"), _rv("R8")], None, "unknown requirement ids: R9, R8"),
    ("PASS", [], None, "a PASS judges every requirement; missing: R1, R2"),
    ("PASS", [_rv("R2")], None, "a PASS judges every requirement; missing: R1"),
])
def test_a_verdict_that_breaks_a_rule_is_refused_with_the_rule(
    outcome: str, verdicts: list[RequirementVerdict], category: str | None, detail: str,
) -> None:
    w, v = _running_verifier()
    verdict = Verdict(outcome=outcome, verdicts=verdicts, category=category)  # type: ignore[arg-type]
    with refused(ValidationFailed, detail):
        validate_verdict(w.states["T1"], verdict)
    with refused(ValidationFailed, detail):
        decide_verifier_complete(v, w.states["T1"], holder_of(v), verdict)


def test_a_verdict_without_known_requirements_is_checked_for_its_own_shape_only() -> None:
    w, _ = _running_verifier()
    validate_verdict(None, Verdict(outcome="FAIL", verdicts=[_rv("R9", "FAIL")]))
    validate_verdict(msgspec.structs.replace(w.states["T1"], requirements=[]),
                     Verdict(outcome="PASS", verdicts=[]))
    with refused(ValidationFailed, "one verdict per requirement"):
        validate_verdict(None, Verdict(outcome="PASS", verdicts=[_rv("R9"), _rv("R9")]))


def test_only_a_running_verifier_held_by_its_checker_reports() -> None:
    w, v = _running_verifier()
    verdict = Verdict(outcome="PASS", verdicts=[_rv("R1"), _rv("R2")])
    with refused(ValidationFailed, "outcome and verdicts are for verify tasks"):
        decide_verifier_complete(w.states["T1"], None, holder_of(v), verdict)
    with refused(InvalidTransition, "cannot complete task V-T1: it is claimed", state="claimed"):
        decide_verifier_complete(msgspec.structs.replace(v, state="claimed"), w.states["T1"], holder_of(v), verdict)
    with refused(LeaseMismatch, "task V-T1 is leased to another token", task_id="V-T1"):
        decide_verifier_complete(v, w.states["T1"], msgspec.structs.replace(holder_of(v), token_id="x"), verdict)


# ------------------------------------------------------------ unblock and review refusals


def test_unblock_refusals_name_the_task_its_state_and_its_round() -> None:
    w = World()
    s = w.new()
    with refused(InvalidTransition, "task T1 is pending, not blocked", state="pending"):
        decide_unblock(s, "retry", None)
    with refused(InvalidTransition, "task T1 is blocked, not blocked", state="blocked"):
        decide_unblock(msgspec.structs.replace(s, state="blocked"), "retry", None)
    blocked = msgspec.structs.replace(s, state="blocked", blocker_id="B-T1-1", parent_task_id="P")
    for state in ("done", "cancelled"):
        parent = TaskState(id="P", project="p", title="t", state=state, is_parent=True)
        with refused(InvalidTransition, f"task T1 belongs to P, which is {state}", state="blocked"):
            decide_unblock(blocked, "retry", None, parent)
    parent = TaskState(id="P", project="p", title="t", state="in_progress", is_parent=True, round=2)
    with refused(InvalidTransition, "task T1 belongs to round 1 of P; round 1 was reviewed", state="blocked"):
        decide_unblock(blocked, "retry", None, parent)
    with refused(InvalidTransition, "task T1 belongs to round 2 of P; round 2 was reviewed", state="blocked"):
        decide_unblock(msgspec.structs.replace(blocked, subtask_round=2), "retry", None,
                       msgspec.structs.replace(parent, round=3))
    assert decide_unblock(msgspec.structs.replace(blocked, subtask_round=2), "retry", None, parent)
    assert decide_unblock(blocked, "retry", None, msgspec.structs.replace(parent, round=None))
    assert decide_unblock(blocked, "retry", None, msgspec.structs.replace(parent, round=1))
    with refused(InvalidTransition, "task T1 has no completed work to verify again", state="blocked"):
        decide_unblock(blocked, "reverify", None)
    with refused(InvalidTransition, "task T1 has no completed work to verify again", state="blocked"):
        decide_unblock(msgspec.structs.replace(blocked, verification=None, maker_node="n1"), "reverify", None)
    assert decide_unblock(msgspec.structs.replace(blocked, maker_worker="mk"), "reverify", None)
    assert decide_unblock(msgspec.structs.replace(blocked, maker_node="n1"), "reverify", None)


ANSWERS: dict[str, Any] = {"goal_clear": True, "coverage": "all", "next_round": "none"}


@pytest.mark.parametrize(("review", "detail"), [
    (Review(decision="GOAL_ACHIEVED", goal_clear=None, coverage="", next_round=" "),
     "a round review answers the three questions; missing: goal_clear, coverage, next_round"),
    (Review(decision="GOAL_ACHIEVED", goal_clear="", coverage="c", next_round=None),
     "a round review answers the three questions; missing: goal_clear, next_round"),
    (Review(decision="GOAL_ACHIEVED", new_subtasks=[_new("S9")], **ANSWERS), "GOAL_ACHIEVED takes no new_subtasks"),
    (Review(decision="NEW_ROUND", **ANSWERS), "NEW_ROUND needs new_subtasks"),
    (Review(decision="NEW_ROUND", new_subtasks=[_new("S9"), _new("S9")], **ANSWERS),
     "new_subtasks ids must be unique"),
    (Review(decision="NEW_ROUND", new_subtasks=[_new("S9", max_attempts=0)], **ANSWERS),
     "max_attempts must be at least 1"),
])
def test_a_review_that_breaks_a_rule_is_refused_with_the_rule(review: Review, detail: str) -> None:
    with refused(ValidationFailed, detail):
        validate_review(review)


def test_a_review_accepts_false_and_text_as_answers() -> None:
    validate_review(Review(decision="GOAL_ACHIEVED", goal_clear=False, coverage="c", next_round="n"))
    validate_review(Review(decision="GOAL_ACHIEVED", goal_clear="yes", coverage="c", next_round="n"))


def test_a_review_is_refused_outside_round_review_and_over_open_or_taken_sub_tasks() -> None:
    w = World()
    w.new("P", verification=None)
    w.new("S1", parent_task_id="P", verification=None)
    w.new("S2", parent_task_id="P", verification=None)
    done = Review(decision="GOAL_ACHIEVED", **ANSWERS)
    with refused(InvalidTransition, "task P is in_progress, not in round review", state="in_progress"):
        decide_round_review(w.states["P"], done, list(w.states.values()), existing_ids=set(), default_escalation=1)
    leaf = w.states["S1"]
    with refused(InvalidTransition, "task S1 is round_review, not in round review", state="round_review"):
        decide_round_review(msgspec.structs.replace(leaf, state="round_review"), done, [], existing_ids=set(),
                            default_escalation=1)
    w.make("S1")
    w.make("S2")
    p = w.states["P"]
    racing = [msgspec.structs.replace(w.states["S1"], state="pending"),
              msgspec.structs.replace(w.states["S2"], state="running")]
    with refused(InvalidTransition, "sub-tasks of the round are still open: S1, S2", state="round_review"):
        decide_round_review(p, done, racing, existing_ids=set(), default_escalation=1)
    again = Review(decision="NEW_ROUND", new_subtasks=[_new("S1"), _new("S3"), _new("S2")], **ANSWERS)
    with refused(AlreadyExists, "tasks already exist: S1, S2"):
        decide_round_review(p, again, list(w.states.values()), existing_ids={"S1", "S2", "P"}, default_escalation=1)


# ------------------------------------------------------------ the panel decides: whole events


def _half_judged(max_attempts: int = 3, retry_predecessor: bool = True,
                 first: tuple[str, str | None] = ("PASS", None)) -> tuple[World, TaskState, Holder]:
    """Checker a has reported `first`; checker b's verifier runs, held by cb on n3."""
    w = World()
    w.new(**panel(["a", "b"]), requirements=[Requirement(id="R1"), Requirement(id="R2")],
          max_attempts=max_attempts, retry_predecessor=retry_predecessor)
    w.make()
    va, vb = w.states["T1"].verifier_task_ids
    outcome, category = first
    w.check(va, outcome, category, verdicts=[_rv("R1", "FAIL" if outcome == "FAIL" else "PASS", "r1 says a"),
                                             _rv("R2")] if outcome != "BLOCKED" else [])
    v = w.claim(vb, "cb", "n3")
    w.run([(vb, decide_start(v, holder_of(v)))])
    return w, w.states[vb], holder_of(v)


def _verdict(outcome: str, verdicts: list[RequirementVerdict], category: str | None = None,
             reason: str = "") -> TaskVerdict:
    return TaskVerdict(checker="b", verifier_task_id="V-T1-a1-b", outcome=outcome, verdicts=verdicts,  # type: ignore[arg-type]
                       category=category, attempt=1, node="n3", worker="cb", reason=reason,  # type: ignore[arg-type]
                       token_id="tok-cb@n3")


def _completed(outcome: str, verdicts: list[RequirementVerdict], category: str | None = None,
               reason: str = "", result: Any = None) -> TaskCompleted:
    return TaskCompleted(worker="cb", node="n3", attempt=1, result=result, outcome=outcome,  # type: ignore[arg-type]
                         verdicts=verdicts, category=category, reason=reason)  # type: ignore[arg-type]


A_PASS = CheckerReport(checker="a", outcome="PASS", reason="R1 PASS: r1 says a")


def test_the_first_verdict_of_a_panel_lands_on_the_maker_and_waits_for_the_others() -> None:
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, _ = w.states["T1"].verifier_task_ids
    v = w.claim(va, "ca", "n2")
    w.run([(va, decide_start(v, holder_of(v)))])
    v = w.states[va]
    ok = [_rv("R1")]
    assert decide_verifier_complete(v, w.states["T1"], holder_of(v), Verdict(outcome="PASS", verdicts=ok,
                                                                            reason="fine", result=3)) == [
        (va, [TaskCompleted(worker="ca", node="n2", attempt=1, result=3, outcome="PASS", verdicts=ok,
                            reason="fine")]),
        ("T1", [TaskVerdict(checker="a", verifier_task_id=va, outcome="PASS", verdicts=ok, attempt=1, node="n2",
                            worker="ca", reason="fine", token_id=v.token_id)])]


def test_every_pass_verifies_naming_every_checker() -> None:
    w, v, h = _half_judged()
    ok = [_rv("R1"), _rv("R2")]
    assert decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="PASS", verdicts=ok)) == [
        ("V-T1-a1-b", [_completed("PASS", ok)]),
        ("T1", [_verdict("PASS", ok), TaskVerified(attempt=1, checkers=["a", "b"])])]


def test_a_fail_rejects_and_retries_with_every_unmet_requirement() -> None:
    w, v, h = _half_judged(first=("FAIL", None))
    bad = [_rv("R1", "FAIL", "still broken"), _rv("R2", "FAIL")]
    missing = [Unmet(requirement_id="R1", reason="r1 says a", checker="a"),
               Unmet(requirement_id="R1", reason="still broken", checker="b"),
               Unmet(requirement_id="R2", reason="", checker="b")]
    assert decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="FAIL", verdicts=bad)) == [
        ("V-T1-a1-b", [_completed("FAIL", bad)]),
        ("T1", [_verdict("FAIL", bad), TaskRejected(attempt=1, unmet_requirements=missing, reason="a: FAIL, b: FAIL"),
                TaskRetryScheduled(attempt=2, rework_notes=missing, reason="rejected")])]


def test_a_blocked_code_rejects_with_the_checkers_reason_as_the_unmet_requirement() -> None:
    w, v, h = _half_judged()
    missing = [Unmet(requirement_id="-", reason="b reported BLOCKED/code: does not build", checker="b")]
    out = decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="BLOCKED", category="code",
                                                                 reason="does not build"))
    assert out[1] == ("T1", [_verdict("BLOCKED", [], "code", "does not build"),
                             TaskRejected(attempt=1, unmet_requirements=missing, reason="b: BLOCKED"),
                             TaskRetryScheduled(attempt=2, rework_notes=missing, reason="rejected")])
    out = decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="BLOCKED", category="code"))
    assert out[1][1][1] == TaskRejected(attempt=1, reason="b: BLOCKED", unmet_requirements=[
        Unmet(requirement_id="-", reason="b reported BLOCKED/code", checker="b")])


def test_a_rejection_on_the_last_attempt_or_without_retries_blocks_with_every_checkers_word() -> None:
    bad = [_rv("R2", "FAIL", "no")]
    missing = [Unmet(requirement_id="R2", reason="no", checker="b")]
    reports = [A_PASS, CheckerReport(checker="b", outcome="FAIL", reason="R2 FAIL: no")]
    for kw, why in (({"max_attempts": 1}, "retries exhausted"),
                    ({"retry_predecessor": False}, "rejected and retry_predecessor is false")):
        w, v, h = _half_judged(**kw)
        assert decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="FAIL", verdicts=bad))[1] == ("T1", [
            _verdict("FAIL", bad), TaskRejected(attempt=1, unmet_requirements=missing, reason="b: FAIL"),
            TaskBlocked(blocker_id="B-T1-1", reason=why, unmet_requirements=missing, attempt=1, reports=reports)])


def test_a_human_blocker_names_every_human_category_and_opens_the_next_blocker_id() -> None:
    w, v, h = _half_judged(first=("BLOCKED", "info_missing"))
    maker = msgspec.structs.replace(w.states["T1"], blockers_opened=2)
    out = decide_verifier_complete(v, maker, h, Verdict(outcome="BLOCKED", category="environment", reason="db"))
    assert out[1] == ("T1", [_verdict("BLOCKED", [], "environment", "db"), TaskBlocked(
        blocker_id="B-T1-3", reason="checker reported BLOCKED/environment, BLOCKED/info_missing",
        category="environment", attempt=1, reports=[
            CheckerReport(checker="a", outcome="BLOCKED", category="info_missing"),
            CheckerReport(checker="b", outcome="BLOCKED", category="environment", reason="db")])])


def test_an_infrastructure_blocker_asks_that_checker_again_once_then_blocks() -> None:
    w, v, h = _half_judged()
    out = decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="BLOCKED", category="infrastructure"))
    assert out[1:] == [
        ("T1", [_verdict("BLOCKED", [], "infrastructure"),
                TaskReverifyScheduled(attempt=1, verifier_task_ids=["V-T1-a1-b-r2"],
                                      kept_verifier_task_ids=["V-T1-a1-a"],
                                      reason="BLOCKED/infrastructure: verifying again")]),
        ("V-T1-a1-b-r2", [TaskCreated(
            id="V-T1-a1-b-r2", project="p", title="Verify (b): t", task_type="verify", parent_task_id="T1",
            priority=0, estimated_minutes=10, requirements=[Requirement(id="R1"), Requirement(id="R2")],
            verification=None, max_attempts=3, retry_predecessor=False, node_blacklist=["n1"],
            escalate_after_seconds=60, checker="b", maker_attempt=1, maker_node="n1", maker_worker="maker")])]
    again = msgspec.structs.replace(w.states["T1"], reverify_count=1)
    assert decide_verifier_complete(v, again, h, Verdict(outcome="BLOCKED", category="infrastructure"))[1] == (
        "T1", [_verdict("BLOCKED", [], "infrastructure"), TaskBlocked(
            blocker_id="B-T1-1", reason="BLOCKED/infrastructure twice in a row", category="infrastructure",
            attempt=1, reports=[A_PASS, CheckerReport(checker="b", outcome="BLOCKED", category="infrastructure")])])


def test_a_verdict_for_another_panel_stays_on_the_verifier() -> None:
    w, v, h = _half_judged()
    ok = Verdict(outcome="PASS", verdicts=[_rv("R1"), _rv("R2")])
    only_v = [("V-T1-a1-b", [_completed("PASS", [_rv("R1"), _rv("R2")])])]
    assert decide_verifier_complete(v, None, h, ok) == only_v
    assert decide_verifier_complete(v, msgspec.structs.replace(w.states["T1"], state="blocked"), h, ok) == only_v
    assert decide_verifier_complete(v, msgspec.structs.replace(w.states["T1"], verifier_task_ids=["V-T1-a1-a"]),
                                    h, ok) == only_v


def test_a_dead_verifier_counts_once_and_only_for_its_own_panel() -> None:
    w, v, _ = _half_judged()
    maker = w.states["T1"]
    dead = msgspec.structs.replace(v, state="deadletter")
    assert synthesized_blocked_verdict(dead, maker)[0] == ("T1", [TaskVerdict(
        checker="b", verifier_task_id="V-T1-a1-b", outcome="BLOCKED", category="infrastructure", attempt=1,
        node="n3", worker="cb", synthesized=True, reason="verifier V-T1-a1-b is deadletter"),
        TaskReverifyScheduled(attempt=1, verifier_task_ids=["V-T1-a1-b-r2"], kept_verifier_task_ids=["V-T1-a1-a"],
                              reason="BLOCKED/infrastructure: verifying again")])
    unnamed = msgspec.structs.replace(dead, checker=None)
    assert synthesized_blocked_verdict(unnamed, maker)[0][1][0].checker == "verifier"  # type: ignore[attr-defined]
    assert synthesized_blocked_verdict(dead, msgspec.structs.replace(maker, state="blocked")) == []
    assert synthesized_blocked_verdict(dead, msgspec.structs.replace(maker, verifier_task_ids=["V-T1-a1-a"])) == []
    judged = msgspec.structs.replace(maker, verdicts=[*maker.verdicts, VerdictRecord(
        checker="b", verifier_task_id="V-T1-a1-b", outcome="PASS")])
    assert synthesized_blocked_verdict(dead, judged) == []
    assert dead_verifier_counts_as_blocked_infrastructure(dead, Around()) == []
    assert dead_verifier_counts_as_blocked_infrastructure(dead, Around(parent=maker)) == \
        synthesized_blocked_verdict(dead, maker)


def test_verifier_ids_follow_the_contract_and_never_repeat() -> None:
    s = TaskState(id="T", project="p", title="t")
    assert verifier_ids(s, ["verifier"], 1) == ["V-T"]
    assert verifier_ids(s, ["verifier"], 2) == ["V-T-a2-verifier"]
    assert verifier_ids(s, ["a"], 1) == ["V-T-a1-a"]
    assert verifier_ids(s, ["verifier", "a"], 1) == ["V-T-a1-verifier", "V-T-a1-a"]
    used = msgspec.structs.replace(s, all_verifier_task_ids=["V-T", "V-T-a1-verifier", "V-T-a1-verifier-r2"])
    assert verifier_ids(used, ["verifier"], 1) == ["V-T-a1-verifier-r3"]
    assert verifier_ids(used, ["a", "a"], 1) == ["V-T-a1-a", "V-T-a1-a-r2"]


def test_unblock_retry_and_reverify_whole_events() -> None:
    w, v, h = _half_judged(first=("FAIL", None))
    w.run(decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="BLOCKED", category="environment")))
    s = w.states["T1"]
    assert s.state == "blocked"
    assert decide_unblock(s, "retry", "n") == [("T1", [TaskUnblocked(
        blocker_id="B-T1-1", action="retry", notes="n", attempt=1,
        rework_notes=[Unmet(requirement_id="R1", reason="r1 says a", checker="a")])])]
    out = decide_unblock(msgspec.structs.replace(s, attempt=2), "reverify", "use k")
    assert out[0] == ("T1", [TaskUnblocked(blocker_id="B-T1-1", action="reverify", notes="use k", attempt=2,
                                           verifier_task_ids=["V-T1-a2-a", "V-T1-a2-b"])])
    assert [(tid, e.checker, e.notes, e.maker_attempt) for tid, [e] in out[1:]] == [  # type: ignore[attr-defined]
        ("V-T1-a2-a", "a", "use k", 2), ("V-T1-a2-b", "b", "use k", 2)]
    all_pass = msgspec.structs.replace(s, verdicts=[VerdictRecord(checker=c, verifier_task_id=f"V{c}", outcome="PASS")
                                                    for c in ("b", "a")])
    assert decide_unblock(all_pass, "reverify", None)[0] == ("T1", [TaskUnblocked(
        blocker_id="B-T1-1", action="reverify", attempt=1, verifier_task_ids=["V-T1-a1-a-r2", "V-T1-a1-b-r2"])])
    one_pass = msgspec.structs.replace(s, verdicts=[VerdictRecord(checker="b", verifier_task_id="Vb", outcome="PASS")])
    assert decide_unblock(one_pass, "reverify", None)[0] == ("T1", [TaskUnblocked(
        blocker_id="B-T1-1", action="reverify", attempt=1, verifier_task_ids=["V-T1-a1-a-r2"],
        kept_verifier_task_ids=["Vb"])])


# ------------------------------------------------------------ rounds: whole events


def _sub(sid: str, state: str, rnd: int | None = 1, parent: str = "P", task_type: str = "implement") -> TaskState:
    return TaskState(id=sid, project="p", title="t", parent_task_id=parent, state=state,  # type: ignore[arg-type]
                     subtask_round=rnd, task_type=task_type)  # type: ignore[arg-type]


PARENT = TaskState(id="P", project="p", title="t", state="in_progress", is_parent=True, round=1)


def test_a_round_is_its_parents_own_current_sub_tasks() -> None:
    subs = [_sub("S1", "pending"), _sub("S2", "pending", None), _sub("S3", "pending", 2),
            _sub("S4", "pending", parent="Q"), _sub("V", "pending", task_type="verify")]
    assert [s.id for s in in_round(PARENT, subs)] == ["S1", "S2"]
    assert [s.id for s in in_round(msgspec.structs.replace(PARENT, round=None), subs)] == ["S1", "S2"]
    assert [s.id for s in in_round(msgspec.structs.replace(PARENT, round=2), subs)] == ["S3"]


def test_the_review_opens_with_the_rounds_tally_once_every_sub_task_is_terminal() -> None:
    subs = [_sub("S1", "verified"), _sub("S2", "collected"), _sub("S3", "blocked"), _sub("S4", "deadletter"),
            _sub("S5", "cancelled"), _sub("S6", "completed"), _sub("S7", "done")]
    assert round_outcome(subs) == (4, 2, 1)
    assert round_outcome([*subs, _sub("S8", "failed")]) is None
    assert round_outcome([]) == (0, 0, 0)
    assert decide_round_check(PARENT, subs) == [TaskRoundReview(round=1, total=7, done=4, failed=2, cancelled=1)]
    assert decide_round_check(msgspec.structs.replace(PARENT, round=None), subs)[0].round == 1  # type: ignore[attr-defined]
    assert decide_round_check(PARENT, [*subs, _sub("S8", "running")]) == []
    assert decide_round_check(PARENT, []) == []
    assert decide_round_check(msgspec.structs.replace(PARENT, state="round_review"), subs) == []
    assert decide_round_check(msgspec.structs.replace(PARENT, is_parent=False), subs) == []
    assert last_terminal_subtask_opens_the_review(subs[0], Around(parent=PARENT, others=subs)) == [
        ("P", [TaskRoundReview(round=1, total=7, done=4, failed=2, cancelled=1)])]
    assert last_terminal_subtask_opens_the_review(subs[0], Around(parent=None, others=subs)) == []
    assert last_terminal_subtask_opens_the_review(subs[0], Around(parent=PARENT, others=[])) == []


def test_a_sub_task_open_again_reopens_the_round_under_review_only() -> None:
    review = msgspec.structs.replace(PARENT, state="round_review", round=2)
    sub = _sub("S1", "pending", 2)
    assert decide_round_reopen(review, sub) == [TaskRoundReopened(round=2, subtask_id="S1",
                                                                  reason="S1 is pending again")]
    assert reopened_subtask_reopens_its_round(sub, Around(parent=review)) == [("P", decide_round_reopen(review, sub))]
    assert reopened_subtask_reopens_its_round(sub, Around()) == []
    assert decide_round_reopen(msgspec.structs.replace(review, round=None), _sub("S1", "running"))[0] == \
        TaskRoundReopened(round=1, subtask_id="S1", reason="S1 is running again")
    assert decide_round_reopen(msgspec.structs.replace(review, state="in_progress"), sub) == []
    assert decide_round_reopen(review, _sub("S1", "blocked", 2)) == []
    assert decide_round_reopen(review, _sub("S1", "pending", 1)) == []
    assert reopened_subtask_reopens_its_round(_sub("S1", "pending", 1), Around(parent=review)) == []


def test_a_new_round_creates_its_sub_tasks_under_the_parent() -> None:
    review = msgspec.structs.replace(PARENT, state="round_review", round=2)
    r = Review(decision="NEW_ROUND", notes="more", reviewer="rv", **ANSWERS,
               new_subtasks=[_new("S5", verification=None, priority=2), _new("S6", parent_task_id="X")])
    assert decide_round_review(review, r, [_sub("S1", "verified", 2)], existing_ids={"S1"}, default_escalation=8) == [
        ("P", [TaskRoundReviewed(round=2, decision="NEW_ROUND", notes="more", new_subtask_ids=["S5", "S6"],
                                 reviewer="rv", **ANSWERS),
               TaskSubtaskAdded(subtask_id="S5", round=3), TaskSubtaskAdded(subtask_id="S6", round=3)]),
        ("S5", [TaskCreated(id="S5", project="p", title="t", parent_task_id="P", priority=2,
                            escalate_after_seconds=8, round=3)]),
        ("S6", [TaskCreated(id="S6", project="p", title="t", parent_task_id="P", verification=Verification(),
                            escalate_after_seconds=8, round=3)])]
    done = Review(decision="GOAL_ACHIEVED", notes="ok", **ANSWERS)
    assert decide_round_review(msgspec.structs.replace(review, round=None), done, [], existing_ids=set(),
                               default_escalation=8) == [
        ("P", [TaskRoundReviewed(round=1, decision="GOAL_ACHIEVED", notes="ok", **ANSWERS), TaskClosed(round=1)])]


# ------------------------------------------------------------ reactions


def test_a_cancelled_task_cancels_exactly_its_cancellable_children() -> None:
    s = TaskState(id="P", project="p", title="t", state="cancelled")
    others = [_sub("S1", "pending"), _sub("S2", "done"), _sub("S3", "running"), _sub("S4", "cancelled")]
    assert cancelled_task_cancels_its_open_verifiers_and_subtasks(s, Around(others=others)) == [
        ("S1", [TaskCancelled(reason="P was cancelled")]), ("S3", [TaskCancelled(reason="P was cancelled")])]
    p = TaskState(id="P", project="p", title="t", verifier_task_ids=["V1"])
    tasks = [_sub("V1", "pending", parent="P", task_type="verify"), _sub("V0", "pending", parent="P",
                                                                        task_type="verify"),
             _sub("S1", "pending"), _sub("S9", "pending", parent="Q")]
    assert [t.id for t in children_of(p, tasks)] == ["V1", "S1"]


# ------------------------------------------------------------ later attempts carry their attempt number


def test_a_second_attempt_names_itself_in_every_event() -> None:
    w = World()
    w.new(**panel(["a", "b"]), requirements=[Requirement(id="R1")], max_attempts=2)
    w.make()
    for vid in w.states["T1"].verifier_task_ids:
        w.check(vid, "FAIL")
    assert w.states["T1"].attempt == 2
    s = w.claim("T1", "maker", "n1")
    assert decide_release(s, holder_of(s)) == [TaskReleased(worker="maker", node="n1", attempt=2)]
    w.run([("T1", decide_start(s, holder_of(s)))])
    s = w.states["T1"]
    assert decide_complete(s, holder_of(s), None)[0][1][0] == TaskCompleted(worker="maker", node="n1", attempt=2)
    w.run(decide_complete(s, holder_of(s), None))
    va, vb = w.states["T1"].verifier_task_ids
    v = w.claim(va, "ca", "n2")
    w.run([(va, decide_start(v, holder_of(v)))])
    v = w.states[va]
    assert v.attempt == 1 and w.states["T1"].attempt == 2
    out = decide_verifier_complete(v, w.states["T1"], holder_of(v), Verdict(outcome="BLOCKED", category="code",
                                                                            reason="needs X"))
    assert out == [
        (va, [TaskCompleted(worker="ca", node="n2", attempt=1, outcome="BLOCKED", category="code",
                            reason="needs X")]),
        ("T1", [TaskVerdict(checker="a", verifier_task_id=va, outcome="BLOCKED", category="code", attempt=2,
                            node="n2", worker="ca", reason="needs X", token_id=v.token_id)])]
    w.run(out)
    dead = msgspec.structs.replace(w.states[vb], state="deadletter", node="n4", worker="cz")
    missing = [Unmet(requirement_id="-", reason="a reported BLOCKED/code: needs X", checker="a")]
    assert synthesized_blocked_verdict(dead, w.states["T1"]) == [("T1", [
        TaskVerdict(checker="b", verifier_task_id=vb, outcome="BLOCKED", category="infrastructure", attempt=2,
                    node="n4", worker="cz", synthesized=True, reason=f"verifier {vb} is deadletter"),
        TaskRejected(attempt=2, unmet_requirements=missing, reason="a: BLOCKED"),
        TaskBlocked(blocker_id="B-T1-1", reason="retries exhausted", unmet_requirements=missing, attempt=2,
                    reports=[CheckerReport(checker="a", outcome="BLOCKED", category="code", reason="needs X"),
                             CheckerReport(checker="b", outcome="BLOCKED", category="infrastructure",
                                           reason=f"verifier {vb} is deadletter")])])]


def test_a_rejection_names_only_the_checkers_that_rejected() -> None:
    w, v, h = _half_judged(first=("FAIL", None))
    out = decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="BLOCKED", category="infrastructure"))
    assert out[1][1][1] == TaskRejected(attempt=1, reason="a: FAIL", unmet_requirements=[
        Unmet(requirement_id="R1", reason="r1 says a", checker="a")])


def test_a_checkers_reason_is_its_requirement_reasons_when_it_gives_none() -> None:
    w, v, h = _half_judged(max_attempts=1)
    bad = [_rv("R1", "FAIL", "one"), _rv("R2", "FAIL", "two")]
    out = decide_verifier_complete(v, w.states["T1"], h, Verdict(outcome="FAIL", verdicts=bad))
    assert out[1][1][-1].reports[-1] == CheckerReport(  # type: ignore[attr-defined]
        checker="b", outcome="FAIL", reason="R1 FAIL: one; R2 FAIL: two")


def test_collecting_and_releasing_record_who_and_why() -> None:
    w = World()
    w.new(verification=None)
    w.make()
    assert decide_collect(w.states["T1"], "pat") == [TaskCollected(by="pat")]
    s = w.new("T2")
    s = w.claim("T2", "al", "n1")
    assert decide_release(s, holder_of(s)) == [TaskReleased(worker="al", node="n1", attempt=1, reason="")]


def test_a_verifier_of_a_maker_without_a_node_blacklists_only_the_makers_own_list() -> None:
    maker = TaskState(id="T", project="p", title="t", node_blacklist=["n9", "n2"], maker_node=None)
    assert verifier_tasks(maker, ["V-T"], ["verifier"])[0][1][0].node_blacklist == ["n2", "n9"]  # type: ignore[attr-defined]
    bare = msgspec.structs.replace(maker, node_blacklist=[])
    assert verifier_tasks(bare, ["V-T"], ["verifier"])[0][1][0].node_blacklist == []  # type: ignore[attr-defined]


def test_two_cancelled_sub_tasks_count_two() -> None:
    assert round_outcome([_sub("S1", "cancelled"), _sub("S2", "cancelled")]) == (0, 0, 2)


def test_an_unknown_event_is_refused_by_the_fold() -> None:
    class Odd(TaskEvent, frozen=True, kw_only=True, tag="test.odd"):
        pass

    s = TaskState(id="T", project="p", title="t")
    with pytest.raises(ValueError, match=r"^unknown task event Odd\(\)$"):
        evolve(s, Odd(), seq=1, version=1, at=AT)


def test_a_verifier_on_its_second_lease_completes_on_its_own_attempt() -> None:
    w, v, _ = _half_judged()
    w.run([(v.id, decide_lease_expired(v, v.lease_id or ""))])
    v = w.claim(v.id, "cb", "n3")
    w.run([(v.id, decide_start(v, holder_of(v)))])
    v = w.states[v.id]
    ok = [_rv("R1"), _rv("R2")]
    out = decide_verifier_complete(v, w.states["T1"], holder_of(v), Verdict(outcome="PASS", verdicts=ok))
    assert out[0] == (v.id, [TaskCompleted(worker="cb", node="n3", attempt=2, outcome="PASS", verdicts=ok)])
    assert out[1][1][0] == TaskVerdict(checker="b", verifier_task_id=v.id, outcome="PASS", verdicts=ok, attempt=1,
                                       node="n3", worker="cb", token_id="tok-cb@n3")
