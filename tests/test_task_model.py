"""The pure task model, with no database: rules, and invariants under random commands."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from events.errors import DomainError, InvalidTransition, LeaseMismatch, ValidationFailed
from events.tasks import (
    STATES,
    Changes,
    NewTask,
    Requirement,
    RequirementVerdict,
    TaskCompleted,
    TaskCreated,
    TaskEvent,
    TaskState,
    TaskVerdict,
    Verification,
    decide_cancel,
    decide_claim,
    decide_complete,
    decide_create,
    decide_fail,
    decide_lease_expired,
    decide_start,
    decide_unblock,
    decide_verifier_complete,
    decode_event,
    event_data,
    event_type,
    evolve,
)


class World:
    """Folds Changes into states the way the service does, minus the database."""

    def __init__(self) -> None:
        self.states: dict[str, TaskState] = {}
        self.log: list[tuple[str, TaskEvent]] = []
        self.seq = 0

    def apply(self, changes: Changes) -> None:
        for tid, events in changes:
            for ev in events:
                self.seq += 1
                # every event survives a round trip through its stored form
                assert decode_event(event_type(ev), msgspec.json.decode(msgspec.json.encode(event_data(ev)))) == ev
                s = self.states.get(tid)
                self.states[tid] = evolve(s, ev, seq=self.seq, version=(s.version + 1) if s else 1,
                                          at="2026-11-22T00:00:00.000000Z")
                self.log.append((tid, ev))


def new(world: World, tid: str = "T1", **kw: Any) -> TaskState:
    t = NewTask(id=tid, project="p", title="t", **kw)
    world.apply(decide_create(None, t, None, default_escalation=60))
    return world.states[tid]


def claim(world: World, tid: str, node: str, worker: str) -> TaskState:
    s = world.states[tid]
    world.apply([(tid, list(decide_claim(s, node=node, worker=worker, lease_id=f"L{world.seq}",
                                         lease_expires_at="x", task_types=["implement", "verify"],
                                         projects=None)))])
    return world.states[tid]


def test_an_implement_completion_creates_its_verifier_with_the_maker_node_blacklisted() -> None:
    w = World()
    new(w, requirements=[])
    s = claim(w, "T1", "n1", "alice")
    w.apply([("T1", list(decide_start(s, lease_id=s.lease_id or "", worker="alice")))])
    w.apply(decide_complete(w.states["T1"], lease_id=s.lease_id or "", worker="alice", result=None))
    assert w.states["T1"].state == "verifying"
    v = w.states["V-T1"]
    assert v.task_type == "verify" and v.node_blacklist == ["n1"] and v.maker_worker == "alice"
    with pytest.raises(InvalidTransition):
        decide_claim(v, node="n1", worker="bob", lease_id="x", lease_expires_at="x",
                     task_types=["verify"], projects=None)
    with pytest.raises(InvalidTransition):
        decide_claim(v, node="n2", worker="alice", lease_id="x", lease_expires_at="x",
                     task_types=["verify"], projects=None)


def test_reports_without_the_lease_are_refused() -> None:
    w = World()
    new(w)
    s = claim(w, "T1", "n1", "alice")
    with pytest.raises(LeaseMismatch):
        decide_start(s, lease_id="other", worker="alice")
    with pytest.raises(LeaseMismatch):
        decide_start(s, lease_id=s.lease_id or "", worker="mallory")


def test_verdicts_must_agree_with_their_outcome() -> None:
    w = World()
    new(w, requirements=[Requirement(id="R1")])
    s = claim(w, "T1", "n1", "a")
    w.apply([("T1", list(decide_start(s, lease_id=s.lease_id or "", worker="a")))])
    w.apply(decide_complete(w.states["T1"], lease_id=s.lease_id or "", worker="a", result=None))
    v = claim(w, "V-T1", "n2", "b")
    w.apply([("V-T1", list(decide_start(v, lease_id=v.lease_id or "", worker="b")))])
    v = w.states["V-T1"]
    fail = [RequirementVerdict(requirement_id="R1", verdict="FAIL", reason="no")]
    ok = [RequirementVerdict(requirement_id="R1", verdict="PASS")]
    for outcome, verdicts, category in (("PASS", fail, None), ("FAIL", ok, None), ("BLOCKED", [], None),
                                        ("PASS", [RequirementVerdict(requirement_id="R9", verdict="PASS")], None),
                                        ("PASS", ok, "code")):
        with pytest.raises(ValidationFailed):
            decide_verifier_complete(v, w.states["T1"], lease_id=v.lease_id or "", worker="b",
                                     outcome=outcome, verdicts=verdicts, category=category,  # type: ignore[arg-type]
                                     result=None, default_escalation=60)


def test_events_recorded_by_earlier_versions_still_decode() -> None:
    # payloads as version 0.1.0 stored them; new fields must keep defaults
    old_created = {"id": "T1", "project": "p", "title": "t"}
    ev = decode_event("task.created", old_created)
    assert isinstance(ev, TaskCreated) and ev.max_attempts == 3 and ev.verification is None
    old_verdict = {"checker": "verifier", "verifier_task_id": "V-T1", "outcome": "PASS"}
    v = decode_event("task.verdict", old_verdict)
    assert isinstance(v, TaskVerdict) and v.verdicts == [] and v.synthesized is False
    done = decode_event("task.completed", {"worker": "w"})
    assert isinstance(done, TaskCompleted) and done.result is None


# ------------------------------------------------------------ property test

NODES = ["n1", "n2", "n3"]
WORKERS = ["w1", "w2", "w3", "w4"]


class TaskMachine(RuleBasedStateMachine):
    """Random command sequences against one maker task and the verifiers it spawns.

    Each rule picks a task whose state could accept it (so sequences reach
    verdicts, retries, re-verification and blocks); refusals are allowed, and
    after every step the invariants must hold.
    """

    @initialize(
        checkers=st.sampled_from([["verifier"], ["a", "b"], ["test_runner", "requirements", "anti_cheat"]]),
        max_attempts=st.integers(min_value=1, max_value=3),
        retry=st.booleans(),
    )
    def create(self, checkers: list[str], max_attempts: int, retry: bool) -> None:
        self.w = World()
        new(self.w, requirements=[Requirement(id="R1")], verification=Verification(checkers=checkers),
            max_attempts=max_attempts, retry_predecessor=retry)

    def _pick(self, data: st.DataObject, states: set[str]) -> TaskState | None:
        ids = sorted(i for i, s in self.w.states.items() if s.state in states)
        return self.w.states[data.draw(st.sampled_from(ids))] if ids else None

    def _run(self, fn: Any) -> None:
        with contextlib.suppress(DomainError):
            self.w.apply(fn())

    @rule(data=st.data(), node=st.sampled_from(NODES), worker=st.sampled_from(WORKERS))
    def claim(self, data: st.DataObject, node: str, worker: str) -> None:
        s = self._pick(data, {"pending"})
        if s is not None:
            self._run(lambda: [(s.id, list(decide_claim(
                s, node=node, worker=worker, lease_id=f"L{self.w.seq}", lease_expires_at="x",
                task_types=["implement", "verify"], projects=None)))])

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        s = self._pick(data, {"claimed"})
        if s is not None:
            self._run(lambda: [(s.id, list(decide_start(s, lease_id=s.lease_id or "", worker=s.worker or "")))])

    @rule(data=st.data(), outcome=st.sampled_from(["PASS", "PASS", "FAIL", "BLOCKED"]),
          category=st.sampled_from(["code", "environment", "info_missing", "infrastructure"]))
    def complete(self, data: st.DataObject, outcome: str, category: str) -> None:
        s = self._pick(data, {"running"})
        if s is None:
            return
        if s.task_type == "implement":
            self._run(lambda: decide_complete(s, lease_id=s.lease_id or "", worker=s.worker or "", result=None))
            return
        verdicts = [RequirementVerdict(requirement_id="R1", verdict="FAIL" if outcome == "FAIL" else "PASS")]
        self._run(lambda: decide_verifier_complete(
            s, self.w.states.get(s.parent_task_id or ""), lease_id=s.lease_id or "", worker=s.worker or "",
            outcome=outcome, verdicts=[] if outcome == "BLOCKED" else verdicts,  # type: ignore[arg-type]
            category=category if outcome == "BLOCKED" else None,  # type: ignore[arg-type]
            result=None, default_escalation=60))

    @rule(data=st.data(), really=st.integers(min_value=0, max_value=3))
    def fail(self, data: st.DataObject, really: int) -> None:
        s = self._pick(data, {"claimed", "running"})
        if s is not None and really == 0:
            self._run(lambda: [(s.id, list(decide_fail(s, lease_id=s.lease_id or "", worker=s.worker or "",
                                                        error="e")))])

    @rule(data=st.data(), really=st.integers(min_value=0, max_value=3))
    def expire(self, data: st.DataObject, really: int) -> None:
        s = self._pick(data, {"claimed", "running"})
        if s is not None and really == 0:
            self._run(lambda: [(s.id, list(decide_lease_expired(s, lease_id=s.lease_id or "")))])

    @rule(data=st.data(), action=st.sampled_from(["retry", "reverify"]))
    def unblock(self, data: st.DataObject, action: str) -> None:
        s = self._pick(data, {"blocked"})
        if s is not None:
            self._run(lambda: decide_unblock(s, action=action, notes=None))  # type: ignore[arg-type]

    @rule(data=st.data(), really=st.integers(min_value=0, max_value=9))
    def cancel(self, data: st.DataObject, really: int) -> None:
        s = self._pick(data, set(STATES))
        if s is not None and really == 0:  # rarely, or nothing else would ever finish
            self._run(lambda: [(s.id, list(decide_cancel(s, reason="", by="p")))])

    @invariant()
    def holds(self) -> None:
        if hasattr(self, "w"):
            check_invariants(self.w)


def check_invariants(w: World) -> None:
    maker = w.states["T1"]
    for s in w.states.values():
        assert s.state in STATES
        assert 1 <= s.attempt <= s.max_attempts
    if maker.state == "verified":
        checkers = set(maker.verification.checkers if maker.verification else [])
        assert {r.checker for r in maker.verdicts} == checkers, (maker.verdicts, checkers)
        assert all(r.outcome == "PASS" for r in maker.verdicts), maker.verdicts
        for r in maker.verdicts:
            assert r.node is not None and r.node != maker.maker_node
            assert r.worker != maker.maker_worker
    for tid, ev in w.log:
        if isinstance(ev, TaskVerdict):
            assert w.states[ev.verifier_task_id].parent_task_id == tid


TaskMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_random_command_sequences_never_break_an_invariant = TaskMachine.TestCase


def _to_verdict(w: World, outcome: str) -> None:
    """Drive T1 through one attempt and have every checker report `outcome`."""
    s = claim(w, "T1", "n1", "maker")
    w.apply([("T1", list(decide_start(s, lease_id=s.lease_id or "", worker="maker")))])
    w.apply(decide_complete(w.states["T1"], lease_id=s.lease_id or "", worker="maker", result=None))
    for vid in w.states["T1"].verifier_task_ids:
        v = claim(w, vid, "n2", "checker")
        w.apply([(vid, list(decide_start(v, lease_id=v.lease_id or "", worker="checker")))])
        v = w.states[vid]
        w.apply(decide_verifier_complete(
            v, w.states["T1"], lease_id=v.lease_id or "", worker="checker", outcome=outcome,  # type: ignore[arg-type]
            verdicts=[RequirementVerdict(requirement_id="R1", verdict="FAIL" if outcome == "FAIL" else "PASS")],
            category=None, result=None, default_escalation=60))


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
def test_the_last_allowed_attempt_blocks_instead_of_retrying(max_attempts: int) -> None:
    w = World()
    new(w, requirements=[Requirement(id="R1")], max_attempts=max_attempts)
    for attempt in range(1, max_attempts + 1):
        assert w.states["T1"].attempt == attempt
        _to_verdict(w, "FAIL")
    assert w.states["T1"].state == "blocked" and w.states["T1"].attempt == max_attempts
