"""The blocker rebuild's fold — only the events that touch a blocker, read filtered
(`projections.tasks.fold_blocker_page`) — gives exactly the blockers the full fold gives
(`fold_one` over every event, as the command path folds), over random valid histories:
the command sequences of `test_task_machine`, a page per step."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from taskledger.events.task.events import (
    TaskBlocked,
    TaskCancelled,
    TaskCreated,
    TaskEvent,
    TaskUnblocked,
    event_type,
    payload,
)
from taskledger.events.task.state import TaskState
from taskledger.log import LogEvent
from taskledger.projections import tasks as task_rows
from taskledger.projections.tasks import BLOCKER_EVENTS, Blocker, fold_blocker_page, fold_one
from tests.task_world import AT
from tests.unit.test_task_machine import TaskMachine


def _full_fold(log: list[tuple[str, TaskEvent]]) -> dict[str, Blocker]:
    states: dict[str, TaskState] = {}
    blockers: dict[str, Blocker] = {}
    for seq, (tid, ev) in enumerate(log, start=1):
        s = states.get(tid)
        b = blockers.get(s.blocker_id) if s is not None and s.blocker_id else None
        states[tid], nb = fold_one(s, b, ev, seq=seq, version=seq, at=f"{AT}#{seq}")
        if nb is not None:
            blockers[nb.id] = nb
    return blockers


class BlockerFoldMachine(TaskMachine):
    """The task machine, with its log folded again after every step the way the blocker rebuild folds it."""

    latest: dict[str, Blocker | None]
    projects: dict[str, str]
    folded_blockers: dict[str, Blocker]
    folded: int

    @invariant()
    def the_filtered_blocker_fold_equals_the_full_fold(self) -> None:
        if not hasattr(self, "w"):
            return
        if not hasattr(self, "latest"):
            self.latest, self.projects, self.folded_blockers, self.folded = {}, {}, {}, 0
        page = []
        for seq, (tid, ev) in enumerate(self.w.log[self.folded:], start=self.folded + 1):
            if isinstance(ev, TaskCreated):
                self.projects[tid] = ev.project
            if event_type(ev) in task_rows.BLOCKER_EVENTS:
                self.latest.setdefault(tid, None)
                page.append(LogEvent(seq, f"task:{tid}", 0, event_type(ev),
                                     msgspec.json.encode(payload(ev)).decode(), f"{AT}#{seq}"))
        self.folded = len(self.w.log)
        self.folded_blockers.update(task_rows.fold_blocker_page(self.latest, self.projects, page))
        assert self.folded_blockers == _full_fold(self.w.log)


test_the_filtered_blocker_fold_equals_the_full_fold_over_random_histories = BlockerFoldMachine.TestCase


def test_the_ci_profile_finds_a_filter_that_leaves_out_an_event_type(monkeypatch: pytest.MonkeyPatch) -> None:
    # a read that forgot task.cancelled: a blocked task cancelled keeps its blocker open
    monkeypatch.setattr(task_rows, "BLOCKER_EVENTS", ("task.blocked", "task.unblocked"))
    quick = settings(settings.get_profile("ci"), phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(BlockerFoldMachine, settings=quick)


def test_a_cancel_closes_only_an_open_blocker_and_a_second_block_opens_a_new_one() -> None:
    created = TaskCreated(id="T", project="p", title="t")
    log: list[tuple[str, TaskEvent]] = [
        ("T", created), ("T", TaskBlocked(blocker_id="B1", reason="r")),
        ("T", TaskUnblocked(blocker_id="B1", action="retry", notes="n")),
        ("T", TaskBlocked(blocker_id="B2", reason="r2")), ("T", TaskCancelled(reason="stop")),
        ("T", TaskCancelled(reason="again")),
    ]
    latest: dict[str, Blocker | None] = {"T": None}
    page = [LogEvent(seq, "task:T", 0, event_type(ev), msgspec.json.encode(payload(ev)).decode(), f"{AT}#{seq}")
            for seq, (_, ev) in enumerate(log, start=1) if event_type(ev) in BLOCKER_EVENTS]
    got = fold_blocker_page(latest, {"T": "p"}, page)
    assert got == _full_fold(log)
    assert [(b.id, b.open, b.resolution, b.project) for b in got.values()] == [
        ("B1", False, "retry", "p"), ("B2", False, "cancelled", "p")]
