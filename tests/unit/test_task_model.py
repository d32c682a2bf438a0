"""The pure task model, with no database: each rule asserted by the exact events it appends."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest

from taskledger.events.errors import AlreadyExists, InvalidTransition, LeaseMismatch, ValidationFailed
from taskledger.events.lease import Holder
from taskledger.events.task.events import (
    CheckerReport,
    Requirement,
    RequirementVerdict,
    TaskBlocked,
    TaskCancelled,
    TaskClosed,
    TaskCompleted,
    TaskCreated,
    TaskDeadlettered,
    TaskEscalated,
    TaskLeaseExpired,
    TaskReassigned,
    TaskReleased,
    TaskReverifyScheduled,
    TaskRoundReopened,
    TaskRoundReview,
    TaskRoundReviewed,
    TaskSubtaskAdded,
    TaskUnblocked,
    TaskVerdict,
    TaskVerified,
    Unmet,
    Verification,
    decode,
)
from taskledger.events.task.panel import Verdict, decide_unblock, decide_verifier_complete, panel_outcome
from taskledger.events.task.rounds import Review, decide_round_check, decide_round_review
from taskledger.events.task.rules import (
    CANCELLABLE,
    NewTask,
    decide_cancel,
    decide_collect,
    decide_escalate,
    decide_fail,
    decide_lease_expired,
    decide_reassign,
    decide_release,
    decide_start,
    refuse_expired_lease,
)
from taskledger.events.task.state import STATES, TaskState, fold
from tests.task_world import NOW, World, holder_of, panel, types, who

R1 = [Requirement(id="R1")]
PASS_R1 = [RequirementVerdict(requirement_id="R1", verdict="PASS")]


# ------------------------------------------------------------ verification starts


def test_an_implement_completion_creates_its_verifier_with_the_maker_node_blacklisted() -> None:
    w = World()
    w.new()
    w.make()
    assert w.states["T1"].state == "verifying"
    v = w.states["V-T1"]
    assert v.task_type == "verify" and v.node_blacklist == ["n1"] and v.maker_worker == "maker"
    # seed 000: verifiers run first and are estimated at ten minutes
    assert (v.priority, v.estimated_minutes) == (0, 10)
    with pytest.raises(InvalidTransition):
        w.claim("V-T1", "bob", "n1")
    with pytest.raises(InvalidTransition):
        w.claim("V-T1", "maker", "n2")


def test_the_makers_verification_may_set_the_verifier_priority_and_estimate() -> None:
    w = World()
    w.new(priority=7, verification=Verification(checkers=["verifier"], priority=9, estimated_minutes=3))
    w.make()
    assert (w.states["V-T1"].priority, w.states["V-T1"].estimated_minutes) == (9, 3)


# ------------------------------------------------------------ rule 1: a worker is its token


def test_a_lease_action_from_another_token_node_or_lease_is_refused() -> None:
    w = World()
    w.new()
    s = w.claim("T1", "alice", "n1")
    mine = holder_of(s)
    for other in (msgspec.structs.replace(mine, token_id="stolen"),  # right lease id, wrong token
                  msgspec.structs.replace(mine, node="n9"),  # the node is checked on every action
                  msgspec.structs.replace(mine, worker="mallory"),
                  msgspec.structs.replace(mine, lease_id="other")):
        for act in (lambda h: decide_start(s, h), lambda h: decide_fail(s, h, "x"),
                    lambda h: decide_release(s, h)):
            with pytest.raises(LeaseMismatch):
                act(other)
    assert decide_start(s, mine)


def test_a_lease_recorded_before_tokens_were_named_is_held_by_name_and_node() -> None:
    w = World()
    w.new()
    s = msgspec.structs.replace(w.claim("T1", "alice", "n1"), token_id=None)
    assert decide_start(s, Holder(worker="alice", node="n1", token_id="any", lease_id=s.lease_id))
    with pytest.raises(LeaseMismatch):
        decide_start(s, Holder(worker="alice", node="n2", token_id="any", lease_id=s.lease_id))


def test_a_verifier_verdict_from_another_token_is_refused() -> None:
    w = World()
    w.new()
    w.make()
    v = w.claim("V-T1", "checker", "n2")
    w.run([("V-T1", decide_start(v, holder_of(v)))])
    v = w.states["V-T1"]
    with pytest.raises(LeaseMismatch):
        decide_verifier_complete(v, w.states["T1"], msgspec.structs.replace(holder_of(v), token_id="x"),
                                 Verdict(outcome="PASS", verdicts=PASS_R1))


# ------------------------------------------------------------ rule 2: a PASS judges every requirement


def _running_verifier(requirements: list[Requirement]) -> tuple[World, TaskState]:
    w = World()
    w.new(requirements=requirements)
    w.make()
    v = w.claim("V-T1", "checker", "n2")
    w.run([("V-T1", decide_start(v, holder_of(v)))])
    return w, w.states["V-T1"]


def _rv(rid: str, verdict: str = "PASS") -> RequirementVerdict:
    return RequirementVerdict(requirement_id=rid, verdict=verdict)  # type: ignore[arg-type]


@pytest.mark.parametrize(("outcome", "verdicts", "category"), [
    ("PASS", [_rv("R1")], None),  # R2 not judged
    ("PASS", [], None),
    ("PASS", [_rv("R1"), _rv("R2", "FAIL")], None),
    ("PASS", [_rv("R1"), _rv("R2"), _rv("R1")], None),
    ("PASS", [_rv("R1"), _rv("R2"), _rv("R9")], None),
    ("PASS", [_rv("R1"), _rv("R2")], "code"),
    ("FAIL", [_rv("R1"), _rv("R2")], None),
    ("FAIL", [_rv("R9", "FAIL")], None),
    ("BLOCKED", [], None),
    ("BLOCKED", [_rv("R9")], "environment"),
])
def test_verdicts_that_do_not_judge_what_they_must_are_refused(
    outcome: str, verdicts: list[RequirementVerdict], category: str | None,
) -> None:
    w, v = _running_verifier([Requirement(id="R1"), Requirement(id="R2")])
    with pytest.raises(ValidationFailed):
        decide_verifier_complete(v, w.states["T1"], holder_of(v), Verdict(
            outcome=outcome, verdicts=verdicts, category=category))  # type: ignore[arg-type]


@pytest.mark.parametrize(("outcome", "verdicts", "category"), [
    ("PASS", [_rv("R2"), _rv("R1")], None),
    ("FAIL", [_rv("R2", "FAIL")], None),
    ("BLOCKED", [], "infrastructure"),
    ("BLOCKED", [_rv("R1")], "environment"),
])
def test_fail_and_blocked_may_be_partial(
    outcome: str, verdicts: list[RequirementVerdict], category: str | None,
) -> None:
    w, v = _running_verifier([Requirement(id="R1"), Requirement(id="R2")])
    changes = decide_verifier_complete(v, w.states["T1"], holder_of(v), Verdict(
        outcome=outcome, verdicts=verdicts, category=category))  # type: ignore[arg-type]
    assert [c[0] for c in changes][:2] == ["V-T1", "T1"]


# ------------------------------------------------------------ rule 3: the panel precedence


def _panel_of(*reports: tuple[str, str | None]) -> tuple[World, list[str]]:
    w = World()
    checkers = [f"c{i}" for i in range(len(reports))]
    w.new(**panel(checkers))
    w.make()
    for vid, (outcome, cat) in zip(w.states["T1"].verifier_task_ids, reports, strict=True):
        w.check(vid, outcome, cat, worker=f"w-{vid}")
    return w, checkers


@pytest.mark.parametrize(("reports", "state", "last"), [
    ((("PASS", None), ("PASS", None)), "verified", "task.verified"),
    ((("FAIL", None), ("BLOCKED", "environment")), "blocked", "task.blocked"),
    ((("BLOCKED", "info_missing"), ("FAIL", None)), "blocked", "task.blocked"),
    ((("BLOCKED", "code"), ("PASS", None)), "pending", "task.retry_scheduled"),
    ((("FAIL", None), ("BLOCKED", "infrastructure")), "pending", "task.retry_scheduled"),
    ((("BLOCKED", "infrastructure"), ("PASS", None)), "verifying", "task.reverify_scheduled"),
    ((("BLOCKED", "environment"), ("BLOCKED", "infrastructure")), "blocked", "task.blocked"),
])
def test_the_panel_decides_by_the_written_precedence(
    reports: tuple[tuple[str, str | None], ...], state: str, last: str,
) -> None:
    w, _ = _panel_of(*reports)
    assert w.states["T1"].state == state
    assert types(w.log, "T1")[-1] == last


def test_no_blocked_verdict_is_ignored_even_beside_a_fail() -> None:
    w = World()
    w.new(**panel(["tests", "env"]), requirements=[Requirement(id="R1"), Requirement(id="R2")])
    w.make()
    t, e = w.states["T1"].verifier_task_ids
    w.check(t, "FAIL", verdicts=[_rv("R1", "FAIL"), _rv("R2")])
    w.check(e, "BLOCKED", "environment", verdicts=[])
    blocked = w.log[-1][1]
    assert blocked == TaskBlocked(
        blocker_id="B-T1-1", reason="checker reported BLOCKED/environment",
        unmet_requirements=[Unmet(requirement_id="R1", reason="", checker="tests")], category="environment",
        attempt=1, reports=[CheckerReport(checker="tests", outcome="FAIL"),
                            CheckerReport(checker="env", outcome="BLOCKED", category="environment")])


def test_panel_outcome_is_the_first_matching_row() -> None:
    from taskledger.events.task.events import VerdictRecord

    def r(o: str, c: str | None = None) -> VerdictRecord:
        return VerdictRecord(checker="x", verifier_task_id="v", outcome=o, category=c)  # type: ignore[arg-type]

    assert panel_outcome([r("PASS"), r("PASS")]) == "verified"
    assert panel_outcome([]) == "verified"
    assert panel_outcome([r("BLOCKED", "info_missing"), r("FAIL")]) == "blocked"
    assert panel_outcome([r("BLOCKED", "code")]) == "rejected"
    assert panel_outcome([r("BLOCKED", "infrastructure"), r("FAIL")]) == "rejected"
    assert panel_outcome([r("BLOCKED", "infrastructure"), r("PASS")]) == "reverify"


# ------------------------------------------------------------ rule 4: the record is complete


def test_a_reverification_keeps_the_other_checkers_pass_and_verified_lists_every_checker() -> None:
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, vb = w.states["T1"].verifier_task_ids
    w.check(va, "PASS")
    w.check(vb, "BLOCKED", "infrastructure", verdicts=[])
    assert w.log[-2][1] == TaskReverifyScheduled(attempt=1, verifier_task_ids=["V-T1-a1-b-r2"],
                                                 kept_verifier_task_ids=[va],
                                                 reason="BLOCKED/infrastructure: verifying again")
    s = w.states["T1"]
    assert s.verifier_task_ids == [va, "V-T1-a1-b-r2"] and [r.checker for r in s.verdicts] == ["a"]
    assert w.states["V-T1-a1-b-r2"].checker == "b"
    w.check("V-T1-a1-b-r2", "PASS")
    assert w.log[-1][1] == TaskVerified(attempt=1, checkers=["a", "b"])
    assert [(r.checker, r.outcome) for r in w.states["T1"].verdicts] == [("a", "PASS"), ("b", "PASS")]


def test_infrastructure_twice_in_a_row_blocks() -> None:
    w = World()
    w.new()
    w.make()
    w.check("V-T1", "BLOCKED", "infrastructure", verdicts=[])
    (again,) = w.states["T1"].verifier_task_ids
    w.check(again, "BLOCKED", "infrastructure", verdicts=[])
    ev = w.log[-1][1]
    assert isinstance(ev, TaskBlocked) and ev.category == "infrastructure"
    assert ev.reason == "BLOCKED/infrastructure twice in a row" and ev.blocker_id == "B-T1-1"


def test_after_a_retry_the_verdicts_start_empty() -> None:
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, vb = w.states["T1"].verifier_task_ids
    w.check(va, "PASS")
    w.check(vb, "FAIL")
    s = w.states["T1"]
    assert (s.state, s.attempt, s.verdicts, s.verifier_task_ids) == ("pending", 2, [], [])
    assert [r.checker for r in s.previous_verdicts] == ["a", "b"]
    assert s.rework_notes == [Unmet(requirement_id="R1", reason="fail by checker", checker="b")]


def test_a_stale_verifiers_verdict_never_counts() -> None:
    w = World()
    w.new(max_attempts=3)
    w.make()
    v = w.claim("V-T1", "checker", "n2")
    w.run([("V-T1", decide_start(v, holder_of(v)))])
    w.run([("V-T1", decide_cancel(w.states["V-T1"], "", "p"))])
    # the dead verifier counted as BLOCKED/infrastructure: a new panel was asked
    assert w.states["T1"].verifier_task_ids == ["V-T1-a1-verifier"]
    late = msgspec.structs.replace(w.states["V-T1"], state="running", lease_id=v.lease_id)
    before = len([e for t, e in w.log if t == "T1"])
    out = decide_verifier_complete(late, w.states["T1"], holder_of(v), Verdict(outcome="PASS", verdicts=PASS_R1))
    assert [tid for tid, _ in out] == ["V-T1"] and isinstance(out[0][1][0], TaskCompleted)
    assert len([e for t, e in w.log if t == "T1"]) == before


def test_a_dead_verifier_counts_as_blocked_infrastructure() -> None:
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, vb = w.states["T1"].verifier_task_ids
    w.check(va, "PASS")
    out = w.run([(vb, decide_cancel(w.states[vb], "gone", "p"))])
    verdict = next(e for t, e in out if isinstance(e, TaskVerdict))
    assert verdict == TaskVerdict(checker="b", verifier_task_id=vb, outcome="BLOCKED", category="infrastructure",
                                  attempt=1, synthesized=True, reason=f"verifier {vb} is cancelled")
    assert types(out, "T1") == ["task.verdict", "task.reverify_scheduled"]


# ------------------------------------------------------------ rule 5: rework after an operator's unblock


def _blocked_by_environment() -> World:
    w = World()
    w.new(**panel(["tests", "env"]))
    w.make()
    t, e = w.states["T1"].verifier_task_ids
    w.check(t, "FAIL")
    w.check(e, "BLOCKED", "environment", verdicts=[])
    assert w.states["T1"].state == "blocked"
    return w


def test_unblock_retry_hands_the_maker_the_unmet_requirements_and_the_notes() -> None:
    w = _blocked_by_environment()
    out = w.run(decide_unblock(w.states["T1"], "retry", "the db is back"))
    assert out == [("T1", TaskUnblocked(blocker_id="B-T1-1", action="retry", notes="the db is back", attempt=1,
                                        rework_notes=[Unmet(requirement_id="R1", reason="fail by checker",
                                                            checker="tests")]))]
    s = w.claim("T1", "maker", "n1")
    assert s.rework_notes[0].requirement_id == "R1" and s.operator_notes == "the db is back"
    assert (s.attempt, s.verdicts, s.blocker_id) == (1, [], None)


def test_unblock_reverify_asks_the_checkers_without_a_pass_and_hands_them_the_notes() -> None:
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, vb = w.states["T1"].verifier_task_ids
    w.check(va, "PASS")
    w.check(vb, "BLOCKED", "info_missing", verdicts=[])
    out = w.run(decide_unblock(w.states["T1"], "reverify", "use the staging key"))
    assert out[0] == ("T1", TaskUnblocked(blocker_id="B-T1-1", action="reverify", notes="use the staging key",
                                          attempt=1, verifier_task_ids=["V-T1-a1-b-r2"], kept_verifier_task_ids=[va]))
    assert types(out) == ["task.unblocked", "task.created"]
    nv = w.claim("V-T1-a1-b-r2", "checker", "n2")
    assert nv.operator_notes == "use the staging key" and nv.checker == "b"
    assert w.states["T1"].state == "verifying" and w.states["T1"].reverify_count == 0


def test_unblock_is_refused_unless_blocked_and_reverify_needs_completed_work() -> None:
    w = World()
    w.new()
    with pytest.raises(InvalidTransition):
        decide_unblock(w.states["T1"], "retry", None)
    fake = msgspec.structs.replace(w.states["T1"], state="blocked", blocker_id="B-T1-1")
    with pytest.raises(InvalidTransition):
        decide_unblock(fake, "reverify", None)
    assert decide_unblock(fake, "retry", None)[0][1][0] == TaskUnblocked(blocker_id="B-T1-1", action="retry", attempt=1)
    unverified = msgspec.structs.replace(fake, verification=None, maker_node="n1")
    with pytest.raises(InvalidTransition):
        decide_unblock(unverified, "reverify", None)


# ------------------------------------------------------------ retries, leases, cancel


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
def test_the_last_allowed_attempt_blocks_instead_of_retrying(max_attempts: int) -> None:
    w = World()
    w.new(max_attempts=max_attempts)
    for attempt in range(1, max_attempts + 1):
        assert w.states["T1"].attempt == attempt
        w.make()
        w.check(w.states["T1"].verifier_task_ids[0], "FAIL")
    s = w.states["T1"]
    assert s.state == "blocked" and s.attempt == max_attempts
    assert isinstance(w.log[-1][1], TaskBlocked) and w.log[-1][1].reason == "retries exhausted"


def test_retry_predecessor_false_blocks_on_the_first_rejection() -> None:
    w = World()
    w.new(retry_predecessor=False)
    w.make()
    w.check("V-T1", "FAIL")
    ev = w.log[-1][1]
    assert isinstance(ev, TaskBlocked) and ev.reason == "rejected and retry_predecessor is false"
    assert types(w.log, "T1")[-3:] == ["task.verdict", "task.rejected", "task.blocked"]


def test_lease_expiry_retries_then_deadletters() -> None:
    w = World()
    w.new(max_attempts=2)
    s = w.claim("T1", "a", "n1")
    assert decide_lease_expired(s, "other") == []
    assert decide_lease_expired(msgspec.structs.replace(s, state="pending"), s.lease_id or "") == []
    assert decide_lease_expired(s, s.lease_id or "") == [
        TaskLeaseExpired(lease_id=s.lease_id or "", attempt=1, worker="a", next_attempt=2)]
    w.run([("T1", decide_lease_expired(s, s.lease_id or ""))])
    s = w.claim("T1", "a", "n1")
    assert (s.attempt, s.state) == (2, "claimed")
    assert decide_lease_expired(s, s.lease_id or "") == [
        TaskLeaseExpired(lease_id=s.lease_id or "", attempt=2, worker="a", next_attempt=None),
        TaskDeadlettered(reason="lease expired on the last attempt", attempt=2)]
    w.run([("T1", decide_lease_expired(s, s.lease_id or ""))])
    assert w.states["T1"].state == "deadletter" and w.states["T1"].lease_id is None


@pytest.mark.parametrize("state", sorted(STATES))
def test_cancel_is_allowed_exactly_from_the_cancellable_states(state: str) -> None:
    s = TaskState(id="T", project="p", title="t", state=state)  # type: ignore[arg-type]
    if state in CANCELLABLE:
        assert decide_cancel(s, "why", "me") == [TaskCancelled(reason="why", by="me")]
    else:
        with pytest.raises(InvalidTransition):
            decide_cancel(s, "why", "me")


def test_cancelling_a_parent_cancels_its_open_sub_tasks_and_verifiers() -> None:
    w = World()
    w.new("P", verification=None)
    w.new("S1", parent_task_id="P")
    w.new("S2", parent_task_id="P", verification=None)
    w.make("S1")
    w.make("S2")
    out = w.run([("P", decide_cancel(w.states["P"], "stop", "p"))])
    assert {t for t, e in out if isinstance(e, TaskCancelled)} == {"P", "S1", "V-S1"}
    assert w.states["S2"].state == "completed"


# ------------------------------------------------------------ rule 7: release and reassign


def test_release_gives_the_claim_back_without_spending_an_attempt() -> None:
    w = World()
    w.new()
    s = w.claim("T1", "a", "n1")
    assert decide_release(s, holder_of(s), "busy") == [TaskReleased(worker="a", node="n1", attempt=1, reason="busy")]
    w.run([("T1", decide_release(s, holder_of(s), "busy"))])
    s = w.states["T1"]
    assert (s.state, s.attempt, s.lease_id, s.worker, s.token_id) == ("pending", 1, None, None, None)
    with pytest.raises(LeaseMismatch):
        decide_release(s, who("a", "n1", "L0"))


def test_reassign_moves_directed_work_and_restarts_its_escalation() -> None:
    w = World()
    w.new(assignee="ghost", escalate_after_seconds=10)
    w.run([("T1", [TaskEscalated(state="pending", waited_seconds=11)])])
    assert decide_reassign(w.states["T1"], "bob", "p") == [TaskReassigned(assignee="bob", previous="ghost", by="p")]
    w.run([("T1", decide_reassign(w.states["T1"], None, "p"))])
    s = w.states["T1"]
    assert s.assignee is None and not s.escalated
    assert w.claim("T1", "anyone", "n1").state == "claimed"
    with pytest.raises(InvalidTransition):
        decide_reassign(w.states["T1"], "bob", "p")
    with pytest.raises(InvalidTransition):
        decide_reassign(msgspec.structs.replace(s, assignee="x"), "x", "p")


def test_escalation_waits_for_its_window() -> None:
    w = World()
    s = w.new(escalate_after_seconds=30)
    assert decide_escalate(s, NOW + timedelta(seconds=29)) == []
    assert decide_escalate(s, NOW + timedelta(seconds=31)) == [TaskEscalated(
        state="pending", waited_seconds=31, reason="nobody claimed it within 30s")]
    assert decide_escalate(msgspec.structs.replace(s, escalated=True), NOW + timedelta(days=1)) == []


# ------------------------------------------------------------ rule 6: rounds


ANSWERS = {"goal_clear": True, "coverage": "R1 and R2 covered", "next_round": "none"}


def _round_with_blocked_subtask() -> World:
    w = World()
    w.new("P", verification=None)
    w.new("S1", parent_task_id="P", retry_predecessor=False)
    w.new("S2", parent_task_id="P", verification=None)
    w.make("S2")
    w.make("S1")
    out = w.check("V-S1", "FAIL")
    assert out[-1] == ("P", TaskRoundReview(round=1, total=2, done=1, failed=1, cancelled=0))
    return w


def test_unblocking_a_sub_task_reopens_its_parents_round() -> None:
    w = _round_with_blocked_subtask()
    out = w.run(decide_unblock(w.states["S1"], "retry", None))
    assert out[-1] == ("P", TaskRoundReopened(round=1, subtask_id="S1", reason="S1 is pending again"))
    assert w.states["P"].state == "in_progress"
    with pytest.raises(InvalidTransition):
        decide_round_review(w.states["P"], Review(decision="GOAL_ACHIEVED", **ANSWERS), list(w.states.values()),
                            existing_ids=set(), default_escalation=60)
    w.make("S1")
    w.check(w.states["S1"].verifier_task_ids[0], "PASS")
    assert w.states["P"].state == "round_review"
    assert w.log[-1] == ("P", TaskRoundReview(round=1, total=2, done=2, failed=0, cancelled=0))


def test_a_sub_task_of_a_closed_goal_stays_blocked() -> None:
    w = _round_with_blocked_subtask()
    w.run(decide_round_review(w.states["P"], Review(decision="GOAL_ACHIEVED", **ANSWERS), list(w.states.values()),
                              existing_ids=set(), default_escalation=60))
    with pytest.raises(InvalidTransition):
        decide_unblock(w.states["S1"], "retry", None, w.states["P"])
    assert decide_unblock(w.states["S1"], "retry", None, None)


def test_a_sub_task_of_a_reviewed_round_stays_as_its_round_left_it() -> None:
    # Found by the state machine's oracle: S1 blocked in round 1, the reviewer
    # started round 2 knowing it; unblocking S1 then let round 2's review close
    # the goal (`done`) over a pending S1.
    w = _round_with_blocked_subtask()
    w.run(decide_round_review(w.states["P"], Review(decision="NEW_ROUND", **ANSWERS, new_subtasks=[
        NewTask(id="S3", project="p", title="t", verification=None)]), list(w.states.values()),
        existing_ids=set(w.states), default_escalation=60))
    assert (w.states["P"].state, w.states["P"].round) == ("in_progress", 2)
    for action in ("retry", "reverify"):
        with pytest.raises(InvalidTransition, match="round 1 was reviewed"):
            decide_unblock(w.states["S1"], action, None, w.states["P"])  # type: ignore[arg-type]
    w.make("S3")
    assert w.states["P"].state == "round_review"
    with pytest.raises(InvalidTransition, match="round 1 was reviewed"):
        decide_unblock(w.states["S1"], "retry", None, w.states["P"])


def test_a_review_is_refused_while_a_sub_task_of_the_round_is_open() -> None:
    w = _round_with_blocked_subtask()
    p = w.states["P"]
    racing = [*w.states.values(), msgspec.structs.replace(w.states["S1"], state="pending")]
    with pytest.raises(InvalidTransition):
        decide_round_review(p, Review(decision="GOAL_ACHIEVED", **ANSWERS), racing[-1:],
                            existing_ids=set(), default_escalation=60)
    assert decide_round_check(p, racing[-1:]) == []


@pytest.mark.parametrize("missing", ["goal_clear", "coverage", "next_round"])
def test_a_review_answers_the_three_questions(missing: str) -> None:
    w = _round_with_blocked_subtask()
    answers = {**ANSWERS, missing: "  " if missing != "goal_clear" else None}
    with pytest.raises(ValidationFailed):
        decide_round_review(w.states["P"], Review(decision="GOAL_ACHIEVED", **answers),  # type: ignore[arg-type]
                            list(w.states.values()), existing_ids=set(), default_escalation=60)


def test_goal_achieved_closes_and_new_round_adds_sub_tasks() -> None:
    w = _round_with_blocked_subtask()
    subs = list(w.states.values())
    done = decide_round_review(w.states["P"], Review(decision="GOAL_ACHIEVED", reviewer="r", **ANSWERS), subs,
                               existing_ids=set(), default_escalation=60)
    assert done == [("P", [TaskRoundReviewed(round=1, decision="GOAL_ACHIEVED", reviewer="r", **ANSWERS),
                           TaskClosed(round=1)])]
    nxt = decide_round_review(w.states["P"], Review(decision="NEW_ROUND", new_subtasks=[
        NewTask(id="S3", project="p", title="again")], **ANSWERS), subs, existing_ids=set(), default_escalation=60)
    assert [(t, [type(e).__name__ for e in es]) for t, es in nxt] == [
        ("P", ["TaskRoundReviewed", "TaskSubtaskAdded"]), ("S3", ["TaskCreated"])]
    assert nxt[0][1][1] == TaskSubtaskAdded(subtask_id="S3", round=2)
    with pytest.raises(AlreadyExists):
        decide_round_review(w.states["P"], Review(decision="NEW_ROUND", new_subtasks=[
            NewTask(id="S1", project="p", title="again")], **ANSWERS), subs, existing_ids={"S1"},
            default_escalation=60)
    w.run(done)
    assert w.states["P"].state == "done"


# ------------------------------------------------------------ stored events are forever


def test_events_recorded_by_earlier_versions_still_decode() -> None:
    # payloads as version 0.1.0 stored them; new fields must keep defaults
    ev = decode("task.created", b'{"id": "T1", "project": "p", "title": "t"}')
    assert isinstance(ev, TaskCreated) and ev.max_attempts == 3 and ev.verification is None and ev.notes is None
    v = decode("task.verdict", {"checker": "verifier", "verifier_task_id": "V-T1", "outcome": "PASS"})
    assert isinstance(v, TaskVerdict) and v.verdicts == [] and v.synthesized is False and v.token_id is None
    done = decode("task.completed", '{"worker": "w"}')
    assert isinstance(done, TaskCompleted) and done.result is None and done.reason == ""
    claimed = decode("task.claimed", {"node": "n", "worker": "w", "lease_id": "L", "lease_expires_at": "x",
                                      "attempt": 1})
    assert claimed.token_id is None  # type: ignore[union-attr]
    rv = decode("task.reverify_scheduled", {"attempt": 1, "verifier_task_ids": ["V-2"]})
    assert isinstance(rv, TaskReverifyScheduled) and rv.kept_verifier_task_ids == []
    b = decode("task.blocked", {"blocker_id": "B", "reason": "r"})
    assert isinstance(b, TaskBlocked) and b.reports == []
    u = decode("task.unblocked", {"blocker_id": "B", "action": "retry"})
    assert isinstance(u, TaskUnblocked) and u.rework_notes == []
    c = decode("task.created", {"id": "T", "project": "p", "title": "t", "verification": {"checkers": ["a"]}})
    assert isinstance(c, TaskCreated) and c.verification == Verification(checkers=["a"])
    # an old re-verification (no kept verifiers) asked every checker again
    w = World()
    w.new(**panel(["a", "b"]))
    w.make()
    va, _ = w.states["T1"].verifier_task_ids
    w.check(va, "PASS")
    w.run([("T1", [rv])])
    assert w.states["T1"].verdicts == [] and w.states["T1"].verifier_task_ids == ["V-2"]


def test_only_finished_unverified_or_verified_work_is_collected() -> None:
    w = World()
    w.new("T1", verification=None)
    with pytest.raises(InvalidTransition, match="task T1 is not ready to collect"):
        decide_collect(w.states["T1"], "p")
    w.make("T1")
    assert w.states["T1"].state == "completed"
    w.run([("T1", decide_collect(w.states["T1"], "p"))])
    assert (w.states["T1"].state, w.states["T1"].collected) == ("collected", True)
    w.new("T2", **panel(["a"]))
    w.make("T2")
    [vid] = w.states["T2"].verifier_task_ids
    with pytest.raises(InvalidTransition):
        decide_collect(w.states[vid], "p")  # a verifier is never collected
    w.check(vid, "PASS", verdicts=[RequirementVerdict(requirement_id="R1", verdict="PASS")])
    with pytest.raises(InvalidTransition):
        decide_collect(w.states[vid], "p")
    assert decide_collect(w.states["T2"], "p")


def test_a_lease_past_its_deadline_no_longer_holds_the_task() -> None:
    w = World()
    w.new("T1")
    s = w.claim("T1", "w1", "n1")
    h = holder_of(s)
    refuse_expired_lease(s, h, NOW + timedelta(seconds=1), NOW)  # still live
    refuse_expired_lease(s, h, None, NOW)  # no deadline known
    refuse_expired_lease(s, msgspec.structs.replace(h, lease_id="other"), NOW - timedelta(seconds=1), NOW)
    refuse_expired_lease(s, h, NOW, NOW)  # the deadline itself still holds
    with pytest.raises(LeaseMismatch, match="the lease on task T1 has expired") as e:
        refuse_expired_lease(s, h, NOW - timedelta(microseconds=1), NOW)
    assert e.value.extra == {"task_id": "T1"}


def test_fold_replays_the_log_into_the_same_state() -> None:
    w = World()
    w.new("T1")
    w.make("T1")
    stream = []
    for seq, (tid, ev) in enumerate(w.log, start=1):
        if tid == "T1":
            stream.append((ev, seq, len(stream) + 1, "2026-11-22T00:00:00.000000Z"))
    assert fold(stream) == w.states["T1"]
    assert fold([]) is None
