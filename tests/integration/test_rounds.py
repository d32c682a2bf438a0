"""Parent tasks run in rounds of sub-tasks, with a review at the end of each round."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from tests.conftest import AppHarness, Client
from tests.flows import claim, complete_impl, create_task, project, types_of, view

ANSWERS = {"goal_clear": True, "coverage": "every requirement has a result", "next_round": "none"}


async def _finish(worker: Client, proj: str) -> dict[str, Any]:
    t = await claim(worker, proj, ["implement"])
    assert t is not None
    return await complete_impl(worker, t)


async def test_first_sub_task_makes_a_parent_that_is_never_claimed(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    parent = await create_task(producer, proj, id="goal", verification=None)
    await create_task(producer, proj, id="goal-1", parent_task_id="goal", verification=None)
    p = await view(producer, "goal")
    assert p["state"] == "in_progress" and p["is_parent"] and p["round"] == 1
    assert p["rounds"][0]["subtask_ids"] == ["goal-1"]
    t = await claim(worker, proj, ["implement"])
    assert t is not None and t["id"] == "goal-1"
    assert await claim(worker, proj, ["implement"]) is None
    assert "task.subtask_added" in await types_of(producer, parent["id"])
    subs = (await producer.ok(await producer.get("/tasks", params={"parent_task_id": "goal"})))["tasks"]
    assert [s["id"] for s in subs] == ["goal-1"]


async def test_verify_tasks_are_checkers_not_sub_tasks(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="n1")
    await create_task(producer, proj, id="solo")
    await _finish(maker, proj)
    v = await view(producer, "solo")
    assert v["state"] == "verifying" and not v["is_parent"] and v["round"] is None


async def test_round_review_opens_once_with_a_summary_and_new_round_then_goal_achieved(
    harness: AppHarness,
) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    reviewer = await harness.client("reviewer")
    await create_task(producer, proj, id="g", verification=None)
    await create_task(producer, proj, id="g-1", parent_task_id="g", verification=None)
    await create_task(producer, proj, id="g-2", parent_task_id="g", verification=None, max_attempts=1)
    await create_task(producer, proj, id="g-3", parent_task_id="g", verification=None)
    await _finish(worker, proj)
    t = await claim(worker, proj, ["implement"])
    assert t is not None
    await worker.ok(await worker.post(f"/tasks/{t['id']}/fail", {"lease_id": t["lease_id"], "error": "x"}))
    assert (await view(producer, "g"))["state"] == "in_progress"
    await producer.ok(await producer.post("/tasks/g-3/cancel", {"reason": "not needed"}))
    p = await view(producer, "g")
    assert p["state"] == "round_review"
    r1 = p["rounds"][0]
    assert (r1["total"], r1["done"], r1["failed"], r1["cancelled"]) == (3, 1, 1, 1)
    review = [e for e in (await producer.ok(await producer.get("/tasks/g/events")))["events"]
              if e["type"] == "task.round_review"]
    assert len(review) == 1 and review[0]["data"] == {"round": 1, "total": 3, "done": 1, "failed": 1,
                                                       "cancelled": 1}

    r = await producer.post("/tasks/g/round-review", {**ANSWERS, "decision": "GOAL_ACHIEVED"})
    assert r.status_code == 403
    r = await reviewer.post("/tasks/g/round-review", {**ANSWERS,
        "decision": "NEW_ROUND", "notes": "g-2 failed, redo it smaller", "goal_clear": True,
        "coverage": "R1 covered, R2 not", "next_round": "split g-2",
        "new_subtasks": [{"id": "g-4", "title": "part a", "verification": None},
                         {"id": "g-5", "title": "part b", "verification": None}]})
    p = await reviewer.ok(r)
    assert p["state"] == "in_progress" and p["round"] == 2
    assert (await view(producer, "g-4"))["project"] == proj
    await _finish(worker, proj)
    await _finish(worker, proj)
    p = await view(producer, "g")
    assert p["state"] == "round_review" and p["rounds"][1]["done"] == 2
    p = await reviewer.ok(await reviewer.post("/tasks/g/round-review", {**ANSWERS,
        "decision": "GOAL_ACHIEVED", "notes": "done", "goal_clear": True, "coverage": "all",
        "next_round": "none"}))
    assert p["state"] == "done"
    assert [r["decision"] for r in p["rounds"]] == ["NEW_ROUND", "GOAL_ACHIEVED"]
    types = await types_of(producer, "g")
    assert types.count("task.round_review") == 2 and types[-2:] == ["task.round_reviewed", "task.closed"]
    reviewed = next(e for e in (await producer.ok(await producer.get("/tasks/g/events")))["events"]
                    if e["type"] == "task.round_reviewed")
    assert reviewed["data"]["coverage"] == "R1 covered, R2 not" and reviewed["data"]["goal_clear"] is True


async def test_a_blocked_sub_task_counts_as_failed(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="n1")
    checker = await harness.client("worker", node="n2")
    await create_task(producer, proj, id="b", verification=None)
    await create_task(producer, proj, id="b-1", parent_task_id="b", retry_predecessor=False)
    await _finish(maker, proj)
    t = await claim(checker, proj, ["verify"])
    assert t is not None
    await checker.ok(await checker.post(f"/tasks/{t['id']}/start", {"lease_id": t["lease_id"]}))
    await checker.ok(await checker.post(f"/tasks/{t['id']}/complete", {
        "lease_id": t["lease_id"], "outcome": "FAIL",
        "verdicts": [{"requirement_id": "R1", "verdict": "FAIL", "reason": "no"}]}))
    assert (await view(producer, "b-1"))["state"] == "blocked"
    p = await view(producer, "b")
    assert p["state"] == "round_review" and p["rounds"][0]["failed"] == 1


async def test_decisions_out_of_turn_are_refused(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    reviewer = await harness.client("reviewer")
    await create_task(producer, proj, id="o", verification=None)
    r = await reviewer.post("/tasks/o/round-review", {**ANSWERS, "decision": "GOAL_ACHIEVED"})
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"
    await create_task(producer, proj, id="o-1", parent_task_id="o", verification=None)
    r = await reviewer.post("/tasks/o/round-review", {**ANSWERS, "decision": "GOAL_ACHIEVED"})
    assert r.status_code == 409
    r = await reviewer.post("/tasks/missing/round-review", {**ANSWERS, "decision": "GOAL_ACHIEVED"})
    assert r.status_code == 404 and r.json()["code"] == "task_not_found"
    r = await reviewer.post("/tasks/o/round-review", {**ANSWERS, "decision": "MAYBE"})
    assert r.status_code == 400


async def test_new_round_needs_sub_tasks_and_adding_during_review_is_refused(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    reviewer = await harness.client("reviewer")
    await create_task(producer, proj, id="q", verification=None)
    await create_task(producer, proj, id="q-1", parent_task_id="q", verification=None)
    await _finish(worker, proj)
    assert (await view(producer, "q"))["state"] == "round_review"
    r = await producer.post("/tasks", {"id": "q-2", "project": proj, "title": "late", "parent_task_id": "q"})
    assert r.status_code == 409
    r = await reviewer.post("/tasks/q/round-review", {**ANSWERS, "decision": "NEW_ROUND", "new_subtasks": []})
    assert r.status_code == 400
    r = await reviewer.post("/tasks/q/round-review", {**ANSWERS, "decision": "NEW_ROUND",
                                                       "new_subtasks": [{"id": "q-1", "title": "dup"}]})
    assert r.status_code == 409
    assert (await view(producer, "q"))["state"] == "round_review"


async def test_two_sub_tasks_finishing_concurrently_open_exactly_one_review(harness: AppHarness) -> None:
    for attempt in range(3):
        proj = project()
        producer = await harness.client("producer")
        w1 = await harness.client("worker", node="n1")
        w2 = await harness.client("worker", node="n2")
        pid = f"c{attempt}"
        await create_task(producer, proj, id=pid, verification=None)
        await create_task(producer, proj, id=f"{pid}-1", parent_task_id=pid, verification=None)
        await create_task(producer, proj, id=f"{pid}-2", parent_task_id=pid, verification=None)
        a = await claim(w1, proj, ["implement"])
        b = await claim(w2, proj, ["implement"])
        assert a and b
        for w, t in ((w1, a), (w2, b)):
            await w.ok(await w.post(f"/tasks/{t['id']}/start", {"lease_id": t["lease_id"]}))
        await asyncio.gather(
            w1.post(f"/tasks/{a['id']}/complete", {"lease_id": a["lease_id"]}),
            w2.post(f"/tasks/{b['id']}/complete", {"lease_id": b["lease_id"]}),
        )
        assert (await types_of(producer, pid)).count("task.round_review") == 1


async def test_a_pending_task_nobody_claims_escalates_once(harness: AppHarness, pool: asyncpg.Pool) -> None:
    proj = project()
    producer = await harness.client("producer")
    await create_task(producer, proj, id="slow", escalate_after_seconds=1)
    for _ in range(100):
        v = await view(producer, "slow")
        if v["escalated"]:
            break
        await asyncio.sleep(0.1)
    assert v["escalated"] and v["state"] == "pending"
    await asyncio.sleep(0.6)
    assert (await types_of(producer, "slow")).count("task.escalated") == 1


async def test_a_parent_waiting_in_review_escalates(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    await create_task(producer, proj, id="r", verification=None, escalate_after_seconds=1)
    await create_task(producer, proj, id="r-1", parent_task_id="r", verification=None)
    await _finish(worker, proj)
    for _ in range(100):
        v = await view(producer, "r")
        if v["escalated"]:
            break
        await asyncio.sleep(0.1)
    assert v["escalated"] and v["state"] == "round_review"
    esc = [e for e in (await producer.ok(await producer.get("/tasks/r/events")))["events"]
           if e["type"] == "task.escalated"]
    assert len(esc) == 1 and esc[0]["data"]["state"] == "round_review"
