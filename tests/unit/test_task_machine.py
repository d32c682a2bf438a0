"""Random command sequences against the pure task model, checked step by step
against an oracle: the rules restated as tables, written apart from the code
under test (`events/task/`). Nothing here imports the rules it checks, only the
deciders it drives.

Run derandomized (the `ci` profile in conftest.py) so a red CI is never luck;
`make deep` runs many more examples and keeps failures in the example database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from taskledger.events.errors import DomainError, InvalidTransition, LeaseMismatch
from taskledger.events.task import state as task_state
from taskledger.events.task.events import (
    Requirement,
    RequirementVerdict,
    TaskBlocked,
    TaskEvent,
    TaskRetryScheduled,
    TaskReverifyScheduled,
    TaskVerdict,
    TaskVerified,
    Verification,
    event_type,
)
from taskledger.events.task.panel import Verdict, decide_complete, decide_unblock, decide_verifier_complete
from taskledger.events.task.rounds import Review, decide_round_review
from taskledger.events.task.rules import (
    Claim,
    NewTask,
    check_heartbeat,
    decide_cancel,
    decide_claim,
    decide_fail,
    decide_lease_expired,
    decide_reassign,
    decide_release,
    decide_start,
)
from taskledger.events.task.state import TaskState
from tests.task_world import NOW, World, holder_of, who

NODES = ["n1", "n2", "n3"]
WORKERS = ["w1", "w2", "w3"]
REQS = ["R1", "R2"]

# ---------------------------------------------------------------- the oracle's tables
# CONTRACT §3 and the panel precedence, restated: which row a finished panel hits ...
HUMAN = {"environment", "info_missing"}
PRECEDENCE: list[tuple[str, Callable[[list[tuple[str, str | None]]], bool]]] = [
    ("blocked", lambda got: any(o == "BLOCKED" and c in HUMAN for o, c in got)),
    ("rejected", lambda got: any(o == "FAIL" or (o == "BLOCKED" and c == "code") for o, c in got)),
    ("reverify", lambda got: any(o == "BLOCKED" and c == "infrastructure" for o, c in got)),
    ("verified", lambda got: all(o == "PASS" for o, c in got)),
]


# ... and what each row does to the maker: (state, attempt, the events after its task.verdict)
def consequence(row: str, m: TaskState) -> tuple[str, int, list[str]]:
    if row == "verified":
        return "verified", m.attempt, ["task.verified"]
    if row == "blocked":
        return "blocked", m.attempt, ["task.blocked"]
    if row == "rejected" and m.retry_predecessor and m.attempt < m.max_attempts:
        return "pending", m.attempt + 1, ["task.rejected", "task.retry_scheduled"]
    if row == "rejected":
        return "blocked", m.attempt, ["task.rejected", "task.blocked"]
    if m.reverify_count == 0:
        return "verifying", m.attempt, ["task.reverify_scheduled"]
    return "blocked", m.attempt, ["task.blocked"]


ROUND_TERMINAL = {"verified", "completed", "collected", "done", "blocked", "deadletter", "cancelled"}
# what a cancelled task's sub-tasks and verifiers may no longer be (cancelling reaches them)
OPEN = {"pending", "claimed", "running", "verifying", "rejected", "blocked", "failed", "in_progress", "round_review"}


def may_claim(s: TaskState, worker: str, node: str) -> bool:
    """CONTRACT §3: who may take a task."""
    if s.state != "pending" or s.is_parent or s.assignee not in (None, worker) or node in s.node_blacklist:
        return False
    return s.task_type != "verify" or (node != s.maker_node and worker != s.maker_worker)


class TaskMachine(RuleBasedStateMachine):
    @initialize(
        checkers=st.sampled_from([["verifier"], ["a", "b"], ["tests", "reqs", "cheat"]]),
        max_attempts=st.integers(min_value=1, max_value=3),
        retry=st.booleans(),
        in_round=st.booleans(),
    )
    def create(self, checkers: list[str], max_attempts: int, retry: bool, in_round: bool) -> None:
        self.w = World()
        self.checkers = checkers
        self.maker_kw: dict[str, Any] = {"requirements": [Requirement(id=r) for r in REQS],
                                         "verification": Verification(checkers=checkers),
                                         "max_attempts": max_attempts, "retry_predecessor": retry}
        self.subtasks = 0
        if in_round:
            self.w.new("P", verification=None)
        self.w.new("T1", parent_task_id="P" if in_round else None, **self.maker_kw)

    # ------------------------------------------------------------ helpers

    def _any(self, ok: Callable[[TaskState], bool]) -> bool:
        return hasattr(self, "w") and any(ok(s) for s in self.w.states.values())

    def _pick(self, data: st.DataObject, ok: Callable[[TaskState], bool]) -> TaskState | None:
        ids = sorted(i for i, s in self.w.states.items() if ok(s))
        return self.w.states[data.draw(st.sampled_from(ids))] if ids else None

    def _step(self, fn: Callable[[], Any]) -> list[tuple[str, TaskEvent]] | DomainError:
        """Run a command; a refusal must leave every state as it was."""
        before = dict(self.w.states)
        try:
            return self.w.run(fn())
        except DomainError as e:
            assert self.w.states == before
            return e

    # ------------------------------------------------------------ rules

    @precondition(lambda self: self._any(lambda t: t.state == "pending" and not t.is_parent))
    @rule(data=st.data(), node=st.sampled_from(NODES), worker=st.sampled_from(WORKERS))
    def claim(self, data: st.DataObject, node: str, worker: str) -> None:
        s = self._pick(data, lambda t: t.state == "pending" and not t.is_parent)
        if s is None:
            return
        out = self._step(lambda: [(s.id, decide_claim(s, Claim(holder=who(worker, node, f"L{self.w.seq}")), NOW))])
        if may_claim(s, worker, node):
            after = self.w.states[s.id]
            assert (after.state, after.attempt, after.worker, after.node) == ("claimed", s.attempt, worker, node)
        else:
            assert isinstance(out, InvalidTransition)

    @precondition(lambda self: self._any(lambda t: t.state == "claimed"))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        s = self._pick(data, lambda t: t.state == "claimed")
        if s is not None:
            self._step(lambda: [(s.id, decide_start(s, holder_of(s)))])
            assert self.w.states[s.id].state == "running"

    @precondition(lambda self: self._any(lambda t: t.state in ("claimed", "running")))
    @rule(data=st.data(), act=st.sampled_from(["start", "heartbeat", "fail", "release", "complete"]),
          thief=st.sampled_from(["token", "node", "worker", "lease"]))
    def someone_else_uses_the_lease(self, data: st.DataObject, act: str, thief: str) -> None:
        s = self._pick(data, lambda t: t.state in ("claimed", "running"))
        if s is None:
            return
        h = holder_of(s)
        h = msgspec.structs.replace(h, **{"token": {"token_id": "stolen"}, "node": {"node": "elsewhere"},
                                          "worker": {"worker": "mallory"}, "lease": {"lease_id": "old"}}[thief])
        cmd: Callable[[], Any] = {
            "start": lambda: [(s.id, decide_start(s, h))],
            "heartbeat": lambda: check_heartbeat(s, h),
            "fail": lambda: [(s.id, decide_fail(s, h, "x"))],
            "release": lambda: [(s.id, decide_release(s, h))],
            "complete": lambda: decide_complete(s, h, None) if s.task_type == "implement" else
            decide_verifier_complete(s, None, h, Verdict(outcome="PASS")),
        }[act]
        assert isinstance(self._step(cmd), LeaseMismatch)

    @precondition(lambda self: self._any(lambda t: t.state == "running"))
    @rule(data=st.data(), outcome=st.sampled_from(["PASS", "PASS", "FAIL", "BLOCKED"]),
          category=st.sampled_from(["code", "environment", "info_missing", "infrastructure", "infrastructure"]))
    def complete(self, data: st.DataObject, outcome: str, category: str) -> None:
        s = self._pick(data, lambda t: t.state == "running")
        if s is not None:
            self._complete(s, outcome, category)

    @precondition(lambda self: self._any(lambda t: t.state == "pending" and not t.is_parent))
    @rule(data=st.data(), pair=st.integers(0, len(NODES) * len(WORKERS) - 1),
          outcome=st.sampled_from(["PASS", "PASS", "FAIL", "BLOCKED"]),
          category=st.sampled_from(["code", "environment", "info_missing", "infrastructure", "infrastructure"]))
    def work(self, data: st.DataObject, pair: int, outcome: str, category: str) -> None:
        """Claim, start and complete in one step, by someone allowed to: panels reach
        their decision in few steps, so a short run explores what follows them."""
        s = self._pick(data, lambda t: t.state == "pending" and not t.is_parent)
        if s is None:
            return
        pairs = [(w, n) for n in NODES for w in WORKERS]
        allowed = [p for p in pairs[pair:] + pairs[:pair] if may_claim(s, *p)]
        if not allowed:
            return
        worker, node = allowed[0]
        self._step(lambda: [(s.id, decide_claim(s, Claim(holder=who(worker, node, f"L{self.w.seq}")), NOW))])
        claimed = self.w.states[s.id]
        assert (claimed.state, claimed.worker, claimed.node) == ("claimed", worker, node)
        self._step(lambda: [(s.id, decide_start(claimed, holder_of(claimed)))])
        self._complete(self.w.states[s.id], outcome, category)

    def _complete(self, s: TaskState, outcome: str, category: str) -> None:
        assert s.state == "running"
        if s.task_type == "implement":
            out = self._step(lambda: decide_complete(s, holder_of(s), None))
            assert not isinstance(out, DomainError)
            m = self.w.states[s.id]
            assert m.state == "verifying" and len(m.verifier_task_ids) == len(self.checkers)
            assert {self.w.states[v].checker for v in m.verifier_task_ids} == set(self.checkers)
            assert all(self.w.states[v].node_blacklist == [s.node] for v in m.verifier_task_ids)
            return
        cat = category if outcome == "BLOCKED" else None
        verdicts = [RequirementVerdict(requirement_id=r, verdict="FAIL" if outcome == "FAIL" else "PASS")
                    for r in (REQS if outcome != "BLOCKED" else REQS[:1])]
        maker = self.w.states[s.parent_task_id or ""]
        out = self._step(lambda: decide_verifier_complete(s, maker, holder_of(s), Verdict(
            outcome=outcome, verdicts=verdicts, category=cat)))  # type: ignore[arg-type]
        assert not isinstance(out, DomainError), out
        self._check_panel(maker, s, outcome, cat, out)

    def _check_panel(self, m: TaskState, v: TaskState, outcome: str, cat: str | None,
                     out: list[tuple[str, TaskEvent]]) -> None:
        on_maker = [event_type(e) for t, e in out if t == m.id]
        after = self.w.states[m.id]
        if m.state != "verifying" or v.id not in m.verifier_task_ids:
            assert on_maker == [] and after == m, "a stale verifier's verdict counted"
            return
        got = {r.verifier_task_id: (r.outcome, r.category) for r in m.verdicts}
        got[v.id] = (outcome, cat)
        if set(m.verifier_task_ids) - set(got):
            assert on_maker == ["task.verdict"] and after.state == "verifying"
            return
        row = next(name for name, hit in PRECEDENCE if hit(list(got.values())))
        state, attempt, tail = consequence(row, m)
        assert on_maker == ["task.verdict", *tail], (row, on_maker)
        assert (after.state, after.attempt) == (state, attempt), (row, after.state, after.attempt)
        if state == "verifying":  # re-verified: the PASSes stand, the BLOCKED checkers are asked again
            passed = {vid for vid, (o, _) in got.items() if o == "PASS"}
            assert {r.verifier_task_id for r in after.verdicts} == passed
            assert len(after.verifier_task_ids) == len(m.verifier_task_ids)
        if state == "verified":
            assert sorted(r.checker for r in after.verdicts) == sorted(self.checkers)
        if state == "pending":
            assert after.verdicts == [] and after.verifier_task_ids == []
            fail = any(o == "FAIL" for o, _ in got.values())
            assert {n.requirement_id for n in after.rework_notes} == (set(REQS) if fail else {"-"})
        if state == "blocked" and row == "blocked":
            blocker = out[-1][1] if out[-1][0] == m.id else next(e for t, e in out if isinstance(e, TaskBlocked))
            assert isinstance(blocker, TaskBlocked)
            assert {r.checker for r in blocker.reports} == {self.w.states[x].checker for x in got}

    @precondition(lambda self: self._any(lambda t: t.state in ("claimed", "running")))
    @rule(data=st.data(), how=st.sampled_from(["fail", "expire", "release"]), really=st.integers(0, 2))
    def give_up(self, data: st.DataObject, how: str, really: int) -> None:
        s = self._pick(data, lambda t: t.state in ("claimed", "running"))
        if s is None or really:
            return
        cmd = {"fail": lambda: [(s.id, decide_fail(s, holder_of(s), "e"))],
               "expire": lambda: [(s.id, decide_lease_expired(s, s.lease_id or ""))],
               "release": lambda: [(s.id, decide_release(s, holder_of(s)))]}[how]
        self._step(cmd)
        after = self.w.states[s.id]
        if how == "release":
            assert (after.state, after.attempt) == ("pending", s.attempt)
        elif s.attempt < s.max_attempts:
            assert (after.state, after.attempt) == ("pending", s.attempt + 1)
        else:
            assert after.state == "deadletter"
        assert after.lease_id is None

    @precondition(lambda self: self._any(lambda t: t.state == "blocked"))
    @rule(data=st.data(), action=st.sampled_from(["retry", "reverify"]))
    def unblock(self, data: st.DataObject, action: str) -> None:
        s = self._pick(data, lambda t: t.state == "blocked")
        if s is None:
            return
        parent = self.w.states.get(s.parent_task_id or "")
        out = self._step(lambda: decide_unblock(s, action, "notes", parent))  # type: ignore[arg-type]
        if parent is not None and (parent.state in ("done", "cancelled")
                                   or (s.subtask_round or 1) < (parent.round or 1)):
            assert isinstance(out, InvalidTransition), "a sub-task reopened after its round was judged"
            return
        assert not isinstance(out, DomainError)
        after = self.w.states[s.id]
        fails = {x.requirement_id for r in s.verdicts for x in r.verdicts if x.verdict == "FAIL"}
        if action == "retry":
            assert (after.state, after.attempt, after.verdicts) == ("pending", 1, [])
            assert {n.requirement_id for n in after.rework_notes} == fails
            return
        passed = {r.checker for r in s.verdicts if r.outcome == "PASS"}
        asked = {self.w.states[v].checker for v in after.verifier_task_ids if v not in s.verifier_task_ids}
        assert after.state == "verifying"
        assert asked == (set(self.checkers) - passed or set(self.checkers))
        assert all(self.w.states[v].operator_notes == "notes" for v in after.verifier_task_ids
                   if v not in s.verifier_task_ids)

    @rule(data=st.data(), to=st.sampled_from([None, "w1", "w2"]))
    def reassign(self, data: st.DataObject, to: str | None) -> None:
        s = self._pick(data, lambda t: t.state == "pending" and t.task_type == "implement" and not t.is_parent)
        if s is not None and s.assignee != to:
            self._step(lambda: [(s.id, decide_reassign(s, to, "p"))])
            assert self.w.states[s.id].assignee == to

    @precondition(lambda self: "P" in self.w.states and self.w.states["P"].state == "round_review")
    @rule(new_round=st.booleans())
    def review(self, new_round: bool) -> None:
        p = self.w.states["P"]
        subs: list[NewTask] = []
        if new_round:
            self.subtasks += 1
            subs = [NewTask(id=f"T{self.subtasks + 1}", project="p", title="t", **self.maker_kw)]
        out = self._step(lambda: decide_round_review(p, Review(
            decision="NEW_ROUND" if new_round else "GOAL_ACHIEVED", goal_clear=True, coverage="c",
            next_round="n", new_subtasks=subs), list(self.w.states.values()), existing_ids=set(self.w.states),
            default_escalation=60))
        assert not isinstance(out, DomainError)
        assert self.w.states["P"].state == ("in_progress" if new_round else "done")

    @rule(data=st.data(), really=st.integers(min_value=0, max_value=9))
    def cancel(self, data: st.DataObject, really: int) -> None:
        s = self._pick(data, lambda t: True)
        if s is not None and really == 0:  # rarely, or nothing else would ever finish
            self._step(lambda: [(s.id, decide_cancel(s, "", "p"))])

    # ------------------------------------------------------------ invariants

    @invariant()
    def holds(self) -> None:
        if hasattr(self, "w"):
            check_invariants(self.w)


def check_invariants(w: World) -> None:
    for s in w.states.values():
        assert 1 <= s.attempt <= s.max_attempts
        if s.task_type == "implement" and s.state == "verified":
            # a PASS from every checker of the panel for this attempt, none from the maker
            assert s.verification is not None
            assert sorted(r.checker for r in s.verdicts) == sorted(s.verification.checkers), s.verdicts
            for r in s.verdicts:
                assert r.outcome == "PASS"
                assert r.node is not None and r.node != s.maker_node and r.worker != s.maker_worker
                assert w.states[r.verifier_task_id].maker_attempt == s.attempt
        if s.is_parent and s.state == "done":
            open_ = [t.id for t in w.states.values() if t.parent_task_id == s.id and t.task_type != "verify"
                     and t.state not in ROUND_TERMINAL]
            assert not open_, f"{s.id} is done over open sub-tasks {open_}"
        if s.is_parent and s.state in ("in_progress", "round_review"):
            subs = [t.state for t in w.states.values() if t.parent_task_id == s.id and t.task_type != "verify"
                    and (t.subtask_round or 1) == s.round]
            ended = bool(subs) and all(x in ROUND_TERMINAL for x in subs)
            assert ended == (s.state == "round_review"), f"{s.id} is {s.state} with round sub-tasks {subs}"
        if s.task_type == "implement" and s.state == "verifying":
            # a dead verifier counts as BLOCKED/infrastructure: a maker never waits on one
            judged = {r.verifier_task_id for r in s.verdicts}
            dead = [v for v in s.verifier_task_ids if w.states[v].state in ("deadletter", "cancelled", "completed")
                    and v not in judged]
            assert not dead, f"{s.id} waits on verifiers that will never report: {dead}"
        if s.task_type != "verify" and s.state == "cancelled":
            left = [t.id for t in w.states.values() if t.state in OPEN and (
                (t.parent_task_id == s.id and t.task_type != "verify") or t.id in s.verifier_task_ids)]
            assert not left, f"{s.id} was cancelled but {left} are open"
    # every BLOCKED environment/info_missing verdict opens a blocker once its panel is in
    waiting: dict[str, bool] = {}
    for tid, ev in w.log:
        if isinstance(ev, TaskVerdict):
            assert w.states[ev.verifier_task_id].parent_task_id == tid
            if ev.outcome == "BLOCKED" and ev.category in HUMAN:
                waiting[tid] = True
        elif isinstance(ev, TaskBlocked):
            waiting[tid] = False
        elif isinstance(ev, TaskVerified | TaskRetryScheduled | TaskReverifyScheduled):
            assert not waiting.get(tid), f"{tid}: a BLOCKED verdict was ignored ({event_type(ev)})"
    for tid, open_ in waiting.items():
        assert not open_ or w.states[tid].state in ("verifying", "cancelled"), tid


test_random_command_sequences_follow_the_rules_step_by_step = TaskMachine.TestCase


def _reverification_drops_the_pass(real: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The defect the decision-core issue named, re-introduced: a re-verification
    forgets the kept verifiers, so their PASS no longer counts."""
    def changes(s: TaskState, ev: TaskEvent, at: str) -> dict[str, Any]:
        if isinstance(ev, TaskReverifyScheduled):
            ev = msgspec.structs.replace(ev, kept_verifier_task_ids=[])
        return real(s, ev, at)
    return changes


def test_the_ci_profile_finds_a_reverification_that_drops_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The derandomized `ci` run must fail on the known defect, every time: if the
    machine or the profile changes so that it no longer does, this fails."""
    monkeypatch.setattr(task_state, "_changes", _reverification_drops_the_pass(task_state._changes))
    quick = settings(settings.get_profile("ci"), phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(TaskMachine, settings=quick)
