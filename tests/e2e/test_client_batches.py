"""The client's batch operations against a real `taskledger serve` process: the
whole cycle in batches, the log they leave, a refused entry named by its index
with nothing written, and a retried batch applied once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from taskledger.client import (
    AsyncClient,
    Client,
    CompleteEntry,
    Conflict,
    CreateTask,
    InvalidTransition,
    LeaseMismatch,
    Requirement,
    StartEntry,
    Task,
    TaskNotFound,
    ValidationError,
    Verdict,
)
from tests.conftest import ServerProcess
from tests.e2e.test_client import FAST, FaultyProxy


def _project() -> str:
    return "b-" + uuid.uuid4().hex[:8]


def _tasks(project: str, n: int, **kw: Any) -> list[CreateTask]:
    return [CreateTask(id=f"{project}-{i}", project=project, title=f"task {i}", spec="true",
                       requirements=[Requirement(id="R1", text="it works")], **kw) for i in range(n)]


def _starts(tasks: list[Task]) -> list[StartEntry]:
    return [StartEntry(task_id=t.id, lease_id=t.lease_id or "") for t in tasks]


def _history(c: Client, task_id: str) -> list[tuple[str, Any]]:
    """A task's events as (type, who recorded it)."""
    return [(e.type, (e.meta.get("actor"), e.meta.get("role"), e.meta.get("node")))
            for e in c.task_events(task_id).events]


def _head(c: Client) -> int:
    return c.events(limit=1).head_seq


def test_the_whole_cycle_runs_in_batches_and_logs_what_the_single_calls_log(server: ServerProcess) -> None:
    proj = _project()
    with (Client(server.base, server.token("producer")) as producer,
          Client(server.base, server.token("worker", node="node-a", name="maker")) as maker,
          Client(server.base, server.token("worker", node="node-b", name="checker")) as checker):
        made = producer.create_tasks(_tasks(proj, 4))
        assert [t.id for t in made.tasks] == [f"{proj}-{i}" for i in range(4)]
        assert all(t.state == "pending" for t in made.tasks)

        # one task through the single calls: the yardstick
        one = maker.claim(task_types=["implement"], projects=[proj])
        assert one is not None and one.lease_id
        maker.start(one.id, one.lease_id)
        maker.complete(one.id, one.lease_id, result={"n": 0})

        # the other three in batches: claim, then start, then complete
        claimed = maker.claim_batch(3, task_types=["implement"], projects=[proj])
        assert [t.state for t in claimed.tasks] == ["claimed"] * 3
        started = maker.start_batch(_starts(claimed.tasks))
        assert [t.id for t in started.tasks] == [t.id for t in claimed.tasks]
        assert [t.state for t in started.tasks] == ["running"] * 3
        done = maker.complete_batch([CompleteEntry(task_id=t.id, lease_id=t.lease_id or "", result={"n": i + 1})
                                     for i, t in enumerate(claimed.tasks)])
        assert [t.state for t in done.tasks] == ["verifying"] * 3
        assert [t.result for t in done.tasks] == [{"n": 1}, {"n": 2}, {"n": 3}]

        # the checker claims and starts in one call, and reports every verdict in one
        verifiers = checker.claim_batch(10, task_types=["verify"], projects=[proj], start=True)
        assert len(verifiers.tasks) == 4 and [v.state for v in verifiers.tasks] == ["running"] * 4
        checked = checker.complete_batch([
            CompleteEntry(task_id=v.id, lease_id=v.lease_id or "", outcome="PASS",
                          verdicts=[Verdict(requirement_id="R1", verdict="PASS", reason="ran it")])
            for v in verifiers.tasks])
        assert [v.state for v in checked.tasks] == ["completed"] * 4

        finals = [producer.get_task(t.id) for t in made.tasks]
        assert [f.state for f in finals] == ["verified"] * 4
        assert [f.result for f in finals] == [{"n": i} for i in range(4)]
        # task by task, the log of the batched ones reads like the one done call by call
        yardstick = _history(producer, one.id)
        assert [t for t, _ in yardstick][:5] == [
            "task.created", "task.claimed", "task.started", "task.completed", "task.verifying"]
        for t in made.tasks[1:]:
            assert _history(producer, t.id) == yardstick
        histories = [_history(producer, v.id) for v in verifiers.tasks]
        assert all(h == histories[0] for h in histories)
        assert [t for t, _ in histories[0]][1:4] == ["task.claimed", "task.started", "task.completed"]


async def test_the_async_client_claims_started_and_completes_in_batches(server: ServerProcess) -> None:
    proj = _project()
    producer_token, worker_token = await asyncio.to_thread(
        lambda: (server.token("producer"), server.token("worker", node="n1")))
    async with AsyncClient(server.base, producer_token) as producer, AsyncClient(server.base, worker_token) as w:
        await producer.create_tasks(_tasks(proj, 3, verification=None))
        got = await w.claim_batch(3, projects=[proj], start=True)
        assert [t.state for t in got.tasks] == ["running"] * 3
        with pytest.raises(InvalidTransition) as again:
            await w.start_batch(_starts(got.tasks))  # already started by the claim
        assert again.value.index == 0
        done = await w.complete_batch([CompleteEntry(task_id=t.id, lease_id=t.lease_id or "", result=t.id)
                                       for t in got.tasks])
        assert [(t.state, t.result) for t in done.tasks] == [("completed", t.id) for t in got.tasks]


def test_one_refused_entry_raises_its_typed_error_with_its_index_and_writes_nothing(server: ServerProcess) -> None:
    proj = _project()
    with (Client(server.base, server.token("producer")) as producer,
          Client(server.base, server.token("worker", node="n1")) as w):
        producer.create_tasks(_tasks(proj, 3, verification=None))
        got = w.claim_batch(3, projects=[proj]).tasks
        before = _head(producer)
        with pytest.raises(LeaseMismatch) as lease:  # tasks[1] with tasks[2]'s lease
            w.start_batch([_starts(got)[0], StartEntry(task_id=got[1].id, lease_id=got[2].lease_id or ""),
                           _starts(got)[2]])
        assert lease.value.index == 1 and lease.value.code == "lease_mismatch" and lease.value.status == 409
        with pytest.raises(TaskNotFound) as missing:
            w.start_batch([*_starts(got[:2]), StartEntry(task_id=f"{proj}-none", lease_id="L")])
        assert missing.value.index == 2
        with pytest.raises(ValidationError) as invalid:  # the same task twice
            w.start_batch([*_starts(got), _starts(got)[0]])
        assert invalid.value.index == 3
        assert _head(producer) == before  # nothing written by any of them
        w.start(got[1].id, got[1].lease_id or "")
        before = _head(producer)
        with pytest.raises(ValidationError) as schema:  # an outcome is for a verify task
            w.complete_batch([CompleteEntry(task_id=got[1].id, lease_id=got[1].lease_id or "", outcome="PASS")])
        assert schema.value.index == 0
        with pytest.raises(InvalidTransition) as early:  # tasks[0] is only claimed
            w.complete_batch([CompleteEntry(task_id=t.id, lease_id=t.lease_id or "") for t in got[1::-1]])
        assert early.value.index == 1
        with pytest.raises(Conflict) as exists:
            producer.create_tasks([*_tasks(_project(), 2), *_tasks(proj, 1)])  # proj-0 exists
        assert exists.value.index == 2
        assert _head(producer) == before  # nothing written by any of them
        assert [producer.get_task(t.id).state for t in got] == ["claimed", "running", "claimed"]

        w.start_batch(_starts(got[::2]))  # the right batches go through
        w.complete_batch([CompleteEntry(task_id=t.id, lease_id=t.lease_id or "") for t in got])
        assert [producer.get_task(t.id).state for t in got] == ["completed"] * 3


def test_a_batch_whose_answer_was_lost_is_retried_and_applied_once(server: ServerProcess) -> None:
    proj = _project()
    producer_token, worker_token = server.token("producer"), server.token("worker", node="n1")
    with FaultyProxy(server.port, "drop") as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", producer_token, retry=FAST) as p:
        made = p.create_tasks(_tasks(proj, 3, verification=None))
        assert proxy.connections == 2  # the lost answer, then the retry
    with Client(server.base, worker_token) as w:
        got = w.claim_batch(3, projects=[proj], start=True).tasks
    assert [t.id for t in got] == [t.id for t in made.tasks]
    with FaultyProxy(server.port, "drop") as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", worker_token, retry=FAST) as w:
        done = w.complete_batch([CompleteEntry(task_id=t.id, lease_id=t.lease_id or "", result=i)
                                 for i, t in enumerate(got)])
        assert proxy.connections == 2
    assert [(t.state, t.result) for t in done.tasks] == [("completed", 0), ("completed", 1), ("completed", 2)]
    with Client(server.base, producer_token) as producer:
        for t in made.tasks:
            types = [e.type for e in producer.task_events(t.id).events]
            assert types == ["task.created", "task.claimed", "task.started", "task.completed"], types
