"""The pure task model run in memory: changes folded as the service folds them,
and the reactions of `REACTIONS` settled with neighbours found among the states."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from taskledger.events.lease import Holder
from taskledger.events.task.events import (
    Requirement,
    RequirementVerdict,
    TaskEvent,
    Verification,
    decode,
    event_type,
    payload,
)
from taskledger.events.task.panel import Verdict, decide_complete, decide_verifier_complete
from taskledger.events.task.reactions import REACTIONS, Around, Reaction, children_of
from taskledger.events.task.rounds import in_round
from taskledger.events.task.rules import Changes, Claim, NewTask, decide_claim, decide_create, decide_start
from taskledger.events.task.state import TaskState, evolve

NOW = datetime(2026, 11, 22, tzinfo=UTC)
AT = "2026-11-22T00:00:00.000000Z"


def who(worker: str, node: str, lease_id: str | None = None, token: str | None = None) -> Holder:
    return Holder(worker=worker, node=node, token_id=token or f"tok-{worker}@{node}", lease_id=lease_id)


def holder_of(s: TaskState) -> Holder:
    assert s.worker is not None and s.node is not None
    return Holder(worker=s.worker, node=s.node, token_id=s.token_id, lease_id=s.lease_id)


class World:
    def __init__(self) -> None:
        self.states: dict[str, TaskState] = {}
        self.log: list[tuple[str, TaskEvent]] = []
        self.seq = 0

    def apply(self, changes: Changes) -> list[str]:
        touched: list[str] = []
        for tid, events in changes:
            for ev in events:
                self.seq += 1
                # every event survives a round trip through its stored form
                stored = msgspec.json.encode(payload(ev))
                assert decode(event_type(ev), stored) == ev
                assert decode(event_type(ev), msgspec.json.decode(stored)) == ev
                s = self.states.get(tid)
                self.states[tid] = evolve(s, ev, seq=self.seq, version=(s.version + 1) if s else 1, at=AT)
                self.log.append((tid, ev))
            if events and tid not in touched:
                touched.append(tid)
        return touched

    def around(self, s: TaskState, r: Reaction) -> Around:
        everyone = list(self.states.values())
        if r.needs == "children":
            return Around(others=children_of(s, everyone))
        parent = self.states.get(s.parent_task_id) if s.parent_task_id else None
        if r.needs == "parent" or parent is None:
            return Around(parent=parent)
        return Around(parent=parent, others=in_round(parent, everyone))

    def run(self, changes: Changes) -> list[tuple[str, TaskEvent]]:
        """Apply and settle, as the service does; returns the events appended."""
        start = len(self.log)
        queue = self.apply(changes)
        while queue:
            s = self.states[queue.pop(0)]
            for r in REACTIONS:
                if r.when(s):
                    more = r.react(s, self.around(s, r))
                    if more:
                        queue.extend(self.apply(more))
                        s = self.states[s.id]
        return self.log[start:]

    def new(self, tid: str = "T1", **kw: Any) -> TaskState:
        kw.setdefault("requirements", [Requirement(id="R1")])
        self.run(decide_create(None, NewTask(id=tid, project="p", title="t", **kw),
                               self.states.get(kw.get("parent_task_id") or ""), default_escalation=60))
        return self.states[tid]

    def claim(self, tid: str, worker: str, node: str) -> TaskState:
        self.run([(tid, decide_claim(self.states[tid], Claim(holder=who(worker, node, f"L{self.seq}")), NOW))])
        return self.states[tid]

    def make(self, tid: str = "T1", worker: str = "maker", node: str = "n1") -> TaskState:
        """Claim, start and complete an implement task."""
        s = self.claim(tid, worker, node)
        self.run([(tid, decide_start(s, holder_of(s)))])
        self.run(decide_complete(self.states[tid], holder_of(s), None))
        return self.states[tid]

    def check(self, vid: str, outcome: str, category: str | None = None, worker: str = "checker",
              node: str = "n2", verdicts: list[RequirementVerdict] | None = None) -> list[tuple[str, TaskEvent]]:
        """Claim, start and complete a verifier with `outcome`."""
        v = self.claim(vid, worker, node)
        self.run([(vid, decide_start(v, holder_of(v)))])
        v = self.states[vid]
        if verdicts is None:
            verdicts = [RequirementVerdict(requirement_id="R1", verdict="FAIL" if outcome == "FAIL" else "PASS",
                                           reason=f"{outcome.lower()} by {worker}")]
        maker = self.states.get(v.parent_task_id or "")
        return self.run(decide_verifier_complete(v, maker, holder_of(v), Verdict(
            outcome=outcome, category=category, verdicts=verdicts)))  # type: ignore[arg-type]


def panel(checkers: list[str], **kw: Any) -> dict[str, Any]:
    return {"verification": Verification(checkers=checkers), **kw}


def types(events: list[tuple[str, TaskEvent]], stream: str | None = None) -> list[str]:
    return [event_type(e) for t, e in events if stream is None or t == stream]
