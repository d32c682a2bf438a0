"""POST /tasks/batch and POST /tasks/claim/batch through HTTP, against real PostgreSQL."""

from __future__ import annotations

from typing import Any

from tests.conftest import AppHarness, Client
from tests.flows import claim, create_task, new_id, project, start, types_of, view


def body(proj: str, **fields: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"id": new_id(), "project": proj, "title": "t", "verification": None}
    b.update(fields)
    return b


async def head(api: Client) -> int:
    return int((await api.ok(await api.get("/events", params={"since_seq": 0, "limit": 1})))["head_seq"])


async def test_a_batch_creates_every_task_in_order_in_one_transaction(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    tasks = [body(proj, priority=i) for i in range(250)]
    before = await head(producer)
    r = await producer.post("/tasks/batch", {"tasks": tasks})
    got = await producer.ok(r, 201)
    assert [t["id"] for t in got["tasks"]] == [t["id"] for t in tasks]
    assert all(t["state"] == "pending" and t["project"] == proj for t in got["tasks"])
    assert [t["priority"] for t in got["tasks"]] == list(range(250))
    assert await head(producer) == before + 250
    page = await producer.ok(await producer.get("/events", params={"since_seq": before, "limit": 1000}))
    assert [e["data"]["id"] for e in page["events"]] == [t["id"] for t in tasks]
    # one writer transaction: every event of the batch has the same commit time
    assert len({e["recorded_at"] for e in page["events"]}) == 1
    assert (await view(producer, tasks[-1]["id"]))["state"] == "pending"


async def test_a_schema_error_in_one_task_names_its_index_and_writes_nothing(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    tasks = [body(proj) for _ in range(5)]
    tasks[3]["priority"] = "high"
    before = await head(producer)
    r = await producer.post("/tasks/batch", {"tasks": tasks})
    assert r.status_code == 400, r.text
    p = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert [e["index"] for e in p["errors"]] == [3]
    assert "tasks[3]" in p["detail"]
    assert await head(producer) == before
    assert (await producer.get(f"/tasks/{tasks[0]['id']}")).status_code == 404


async def test_a_rule_broken_by_a_later_task_names_its_index_and_writes_nothing(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    busy = await create_task(producer, proj)
    assert (await claim(worker, proj, ["implement"]))["id"] == busy["id"]  # type: ignore[index]
    before = await head(producer)
    # the first two would be created; the third adds a sub-task to a claimed task
    tasks = [body(proj), body(proj), body(proj, parent_task_id=busy["id"])]
    r = await producer.post("/tasks/batch", {"tasks": tasks})
    assert r.status_code == 409, r.text
    assert r.json()["errors"][0]["index"] == 2 and r.json()["code"] == "invalid_transition"
    assert await head(producer) == before
    for t in tasks:
        assert (await producer.get(f"/tasks/{t['id']}")).status_code == 404


async def test_an_existing_or_repeated_id_is_refused_with_its_index(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    old = await create_task(producer, proj)
    twice = body(proj)
    for tasks, index in (([body(proj), body(proj, id=old["id"])], 1), ([twice, body(proj), twice], 2)):
        before = await head(producer)
        r = await producer.post("/tasks/batch", {"tasks": tasks})
        assert r.status_code == 409 and r.json()["code"] == "already_exists", r.text
        assert r.json()["errors"][0]["index"] == index
        assert await head(producer) == before


async def test_a_batch_is_between_one_and_a_thousand_tasks_and_needs_a_producer(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    assert (await producer.post("/tasks/batch", {"tasks": []})).status_code == 400
    r = await producer.post("/tasks/batch", {"tasks": [body(proj) for _ in range(1001)]})
    assert r.status_code == 400, r.text
    assert (await worker.post("/tasks/batch", {"tasks": [body(proj)]})).status_code == 403
    ok = await producer.ok(await producer.post("/tasks/batch", {"tasks": [body(proj) for _ in range(1000)]}), 201)
    assert len(ok["tasks"]) == 1000


async def test_the_idempotency_key_covers_the_whole_batch(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    tasks = [body(proj) for _ in range(3)]
    key = {"Idempotency-Key": new_id("K")}
    first = await producer.ok(await producer.post("/tasks/batch", {"tasks": tasks}, headers=key), 201)
    before = await head(producer)
    again = await producer.post("/tasks/batch", {"tasks": tasks}, headers=key)
    assert again.status_code == 201 and again.json() == first
    assert await head(producer) == before
    other = await producer.post("/tasks/batch", {"tasks": tasks[:2]}, headers=key)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"


async def test_subtasks_of_one_parent_in_one_batch_are_one_round(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    parent = body(proj)
    subs = [body(proj, parent_task_id=parent["id"]) for _ in range(4)]
    got = await producer.ok(await producer.post("/tasks/batch", {"tasks": [parent, *subs]}), 201)
    assert [t["subtask_round"] for t in got["tasks"][1:]] == [1, 1, 1, 1]
    p = await view(producer, parent["id"])
    assert p["is_parent"] and p["state"] == "in_progress" and p["round"] == 1
    assert await types_of(producer, parent["id"]) == ["task.created"] + ["task.subtask_added"] * 4
    # and to a parent that already exists, another batch joins its running round
    more = [body(proj, parent_task_id=parent["id"]) for _ in range(2)]
    got = await producer.ok(await producer.post("/tasks/batch", {"tasks": more}), 201)
    assert [t["subtask_round"] for t in got["tasks"]] == [1, 1]


async def test_a_batch_claim_gives_each_task_its_own_lease(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    await producer.ok(await producer.post("/tasks/batch", {"tasks": [body(proj, priority=i) for i in range(7)]}),
                      201)
    r = await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 5, "lease_seconds": 30})
    got = (await worker.ok(r, 200))["tasks"]
    assert len(got) == 5
    assert [t["priority"] for t in got] == [6, 5, 4, 3, 2]  # claim order: priority first
    assert len({t["lease_id"] for t in got}) == 5 and all(t["state"] == "claimed" for t in got)
    # each lease is its own: one task's lease does not start another
    wrong = await worker.post(f"/tasks/{got[0]['id']}/start", {"lease_id": got[1]["lease_id"]})
    assert wrong.status_code == 409
    for t in got:
        assert (await start(worker, t))["state"] == "running"
    rest = (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 5})))["tasks"]
    assert len(rest) == 2
    assert (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 5}))) == {
        "tasks": []}


async def test_a_batch_claim_keeps_verifiers_off_the_makers_node(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    await producer.ok(await producer.post("/tasks/batch", {"tasks": [
        body(proj, verification={"checkers": ["verifier"]}) for _ in range(3)]}), 201)
    mine = (await maker.ok(await maker.post("/tasks/claim/batch", {"projects": [proj], "max": 10})))["tasks"]
    assert len(mine) == 3
    for t in mine:
        await start(maker, t)
        await maker.ok(await maker.post(f"/tasks/{t['id']}/complete", {"lease_id": t["lease_id"]}))
    again = await maker.ok(await maker.post("/tasks/claim/batch", {"projects": [proj], "max": 10}))
    assert again == {"tasks": []}
    checks = (await checker.ok(await checker.post("/tasks/claim/batch", {"projects": [proj], "max": 10})))["tasks"]
    assert sorted(t["id"] for t in checks) == sorted(f"V-{t['id']}" for t in mine)


async def test_a_batch_claim_takes_at_most_a_hundred(harness: AppHarness) -> None:
    worker = await harness.client("worker", node="n1")
    for bad in (0, 101):
        r = await worker.post("/tasks/claim/batch", {"max": bad})
        assert r.status_code == 400, r.text
