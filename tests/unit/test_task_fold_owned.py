"""The rebuild's fold — task states changed in place (`evolve_owned`, through
`projections.tasks.fold_page`) — gives exactly the states `evolve` gives, over
random valid histories: the command sequences of `test_task_machine`, their
events stored and read back as a rebuild reads the log, a page per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from taskledger.events.task.events import (
    Requirement,
    TaskCreated,
    TaskEvent,
    TaskReleased,
    TaskRetryScheduled,
    TaskStarted,
    VerdictRecord,
    event_type,
    payload,
)
from taskledger.events.task.state import TaskState, evolve, evolve_owned
from taskledger.log import LogEvent
from taskledger.projections import tasks as task_rows
from tests.task_world import AT
from tests.unit.test_task_machine import TaskMachine


class FoldInPlaceMachine(TaskMachine):
    """The task machine, with the log folded again after every step the way a rebuild folds it."""

    owned: dict[str, TaskState]
    folded: int

    @invariant()
    def the_rebuild_fold_equals_evolve(self) -> None:
        if not hasattr(self, "w"):
            return
        if not hasattr(self, "owned"):
            self.owned, self.folded = {}, 0
        versions: dict[str, int] = {s.id: s.version for s in self.owned.values()}
        page = []
        for seq, (tid, ev) in enumerate(self.w.log[self.folded:], start=self.folded + 1):
            versions[tid] = versions.get(tid, 0) + 1
            page.append(LogEvent(seq, f"task:{tid}", versions[tid], event_type(ev),
                                           msgspec.json.encode(payload(ev)).decode(), AT))
        self.folded = len(self.w.log)
        task_rows.fold_page(self.owned, page)
        assert self.owned == self.w.states
        assert not any(self.owned[t] is s for t, s in self.w.states.items())


test_the_rebuild_fold_equals_evolve_over_random_histories = FoldInPlaceMachine.TestCase


def _release_keeps_the_worker(real: Callable[..., TaskState]) -> Callable[..., TaskState]:
    """A fold that forgets one field of one event: a released task keeps its worker."""
    def fold(s: TaskState | None, ev: TaskEvent, **kw: Any) -> TaskState:
        worker = None if s is None else s.worker
        out = real(s, ev, **kw)
        if isinstance(ev, TaskReleased):
            msgspec.structs.force_setattr(out, "worker", worker)
        return out
    return fold


def test_the_ci_profile_finds_a_fold_that_forgets_a_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(task_rows, "evolve_owned", _release_keeps_the_worker(evolve_owned))
    quick = settings(settings.get_profile("ci"), phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(FoldInPlaceMachine, settings=quick)


def test_a_state_folded_in_place_is_the_one_given_and_every_value_is_computed_before_any_is_set() -> None:
    created = TaskCreated(id="T", project="p", title="t", requirements=[Requirement(id="R1")])
    s = evolve_owned(None, created, seq=1, version=1, at="a")
    assert s == evolve(None, created, seq=1, version=1, at="a")
    # a retry moves the verdicts to previous_verdicts and clears them: set one by one
    # against the changing state, previous_verdicts would read the cleared list
    judged = msgspec.structs.replace(s, state="rejected", verdicts=[VerdictRecord(
        checker="c", verifier_task_id="V", outcome="FAIL")])
    retry = TaskRetryScheduled(attempt=2)
    expected = evolve(judged, retry, seq=9, version=5, at="b")
    owned = msgspec.structs.replace(judged)
    assert evolve_owned(owned, retry, seq=9, version=5, at="b") is owned
    assert owned == expected
    assert owned.previous_verdicts == judged.verdicts and owned.verdicts == []
    with pytest.raises(ValueError, match=r"^a task stream must start with task\.created, not task\.started$"):
        evolve_owned(None, TaskStarted(worker="w"), seq=1, version=1, at="a")
