"""The decision core's rules over HTTP, against real PostgreSQL (one test per rule at least)."""

from __future__ import annotations

from typing import Any

from tests.conftest import AppHarness, Client
from tests.flows import claim, complete_impl, complete_verify, create_task, make, project, start, types_of, view

ANSWERS = {"goal_clear": True, "coverage": "R1 covered", "next_round": "nothing"}


async def _events(api: Client, task_id: str) -> list[dict[str, Any]]:
    return list((await api.ok(await api.get(f"/tasks/{task_id}/events")))["events"])


async def _refused(r: Any, status: int, code: str) -> None:
    assert r.status_code == status and r.json()["code"] == code, r.text


# ------------------------------------------------------------ rule 1


async def test_a_lease_belongs_to_the_claiming_token_and_its_id_is_shown_only_to_it(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    holder = await harness.client("worker", node="node-a", name="alice")
    twin = await harness.client("worker", node="node-a", name="alice")  # same name and node, another token
    other = await harness.client("worker", node="node-b")
    task = await create_task(producer, proj)
    t = await claim(holder, proj, ["implement"])
    assert t is not None and t["lease_id"]
    before = await _events(producer, task["id"])
    for thief in (twin, other):
        for action in ("start", "heartbeat", "fail", "release"):
            await _refused(await thief.post(f"/tasks/{task['id']}/{action}", {"lease_id": t["lease_id"]}),
                           409, "lease_mismatch")
    assert await _events(producer, task["id"]) == before
    seen = await view(producer, task["id"])
    assert seen["lease_id"] is None and (seen["worker"], seen["node"]) == ("alice", "node-a")
    listed = (await producer.ok(await producer.get("/tasks", params={"project": proj})))["tasks"]
    assert listed[0]["lease_id"] is None and listed[0]["worker"] == "alice"
    assert (await view(twin, task["id"]))["lease_id"] is None
    assert (await view(holder, task["id"]))["lease_id"] == t["lease_id"]
    assert (await view(harness.admin, task["id"]))["lease_id"] == t["lease_id"]
    await start(holder, t)


async def test_a_worker_name_lives_on_one_node(harness: AppHarness) -> None:
    await harness.client("worker", node="node-a", name="bob")
    r = await harness.admin.post("/tokens", {"role": "worker", "name": "bob", "node": "node-b"})
    await _refused(r, 409, "already_exists")
    await harness.client("worker", node="node-a", name="bob")


# ------------------------------------------------------------ rules 2, 3, 4


async def test_a_pass_that_skips_a_requirement_is_refused_and_writes_nothing(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, requirements=[{"id": "R1"}, {"id": "R2"}])
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await start(checker, v)
    before = await _events(producer, done["id"])
    r = await checker.post(f"/tasks/{v['id']}/complete", {"lease_id": v["lease_id"], "outcome": "PASS", "verdicts": [
        {"requirement_id": "R1", "verdict": "PASS"}]})
    await _refused(r, 400, "validation_error")
    assert "R2" in r.json()["detail"] and await _events(producer, done["id"]) == before
    await checker.ok(await checker.post(f"/tasks/{v['id']}/complete", {
        "lease_id": v["lease_id"], "outcome": "PASS", "verdicts": [{"requirement_id": "R1", "verdict": "PASS"},
                                                                   {"requirement_id": "R2", "verdict": "PASS"}]}))
    assert (await view(producer, done["id"]))["state"] == "verified"


async def test_a_blocked_environment_beside_a_fail_blocks_with_every_checkers_word(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, verification={"checkers": ["tests", "env"]})
    for _ in range(2):
        v = await claim(checker, proj, ["verify"])
        assert v is not None
        if v["checker"] == "tests":
            await complete_verify(checker, v, "FAIL", verdicts=[{"requirement_id": "R1", "verdict": "FAIL",
                                                                  "reason": "crashes"}])
        else:
            await start(checker, v)
            await checker.ok(await checker.post(f"/tasks/{v['id']}/complete", {
                "lease_id": v["lease_id"], "outcome": "BLOCKED", "category": "environment",
                "reason": "no database on this node"}))
    s = await view(producer, done["id"])
    assert s["state"] == "blocked"
    (b,) = (await producer.ok(await producer.get("/blockers", params={"task_id": done["id"]})))["blockers"]
    assert b["category"] == "environment" and b["unmet_requirements"][0]["requirement_id"] == "R1"
    assert {(x["checker"], x["outcome"], x["reason"]) for x in b["reports"]} == {
        ("tests", "FAIL", "R1 FAIL: crashes"), ("env", "BLOCKED", "no database on this node")}


async def test_a_reverification_keeps_the_pass_and_verified_names_every_checker(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, verification={"checkers": ["a", "b"]})
    for _ in range(2):
        v = await claim(checker, proj, ["verify"])
        assert v is not None
        await complete_verify(checker, v, "PASS" if v["checker"] == "a" else "BLOCKED",
                              category=None if v["checker"] == "a" else "infrastructure")
    s = await view(producer, done["id"])
    assert s["state"] == "verifying" and [r["checker"] for r in s["verdicts"]] == ["a"]
    v = await claim(checker, proj, ["verify"])
    assert v is not None and v["checker"] == "b"
    await complete_verify(checker, v, "PASS")
    s = await view(producer, done["id"])
    assert s["state"] == "verified" and sorted(r["checker"] for r in s["verdicts"]) == ["a", "b"]
    verified = [e for e in await _events(producer, done["id"]) if e["type"] == "task.verified"]
    assert sorted(verified[0]["data"]["checkers"]) == ["a", "b"]


# ------------------------------------------------------------ rule 5


async def test_unblock_hands_the_rework_and_the_notes_to_whoever_claims_next(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, retry_predecessor=False)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL", verdicts=[{"requirement_id": "R1", "verdict": "FAIL",
                                                          "reason": "wrong output"}])
    assert (await view(producer, done["id"]))["state"] == "blocked"
    await producer.ok(await producer.post(f"/tasks/{done['id']}/unblock", {"action": "retry",
                                                                           "notes": "use UTF-8"}))
    t = await claim(maker, proj, ["implement"])
    assert t is not None and t["operator_notes"] == "use UTF-8"
    assert [(n["requirement_id"], n["reason"]) for n in t["rework_notes"]] == [("R1", "wrong output")]
    await complete_impl(maker, t)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "BLOCKED", category="info_missing", verdicts=[])
    await producer.ok(await producer.post(f"/tasks/{done['id']}/unblock", {"action": "reverify",
                                                                           "notes": "the key is in vault"}))
    v = await claim(checker, proj, ["verify"])
    assert v is not None and v["operator_notes"] == "the key is in vault"


# ------------------------------------------------------------ rule 6


async def test_an_unblocked_sub_task_reopens_the_round_and_the_review_needs_its_answers(
    harness: AppHarness,
) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    reviewer = await harness.client("reviewer")
    await create_task(producer, proj, id=f"{proj}-g", verification=None)
    sub = await create_task(producer, proj, id=f"{proj}-g1", parent_task_id=f"{proj}-g", retry_predecessor=False)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    await complete_impl(maker, t)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL")
    assert (await view(producer, f"{proj}-g"))["state"] == "round_review"
    r = await reviewer.post(f"/tasks/{proj}-g/round-review", {"decision": "GOAL_ACHIEVED", "goal_clear": True})
    await _refused(r, 400, "validation_error")
    assert "coverage" in r.json()["detail"] and "next_round" in r.json()["detail"]
    await producer.ok(await producer.post(f"/tasks/{sub['id']}/unblock", {"action": "retry"}))
    assert (await view(producer, f"{proj}-g"))["state"] == "in_progress"
    assert (await types_of(producer, f"{proj}-g"))[-1] == "task.round_reopened"
    r = await reviewer.post(f"/tasks/{proj}-g/round-review", {**ANSWERS, "decision": "GOAL_ACHIEVED"})
    await _refused(r, 409, "invalid_transition")
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    await complete_impl(maker, t)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "PASS")
    p = await reviewer.ok(await reviewer.post(f"/tasks/{proj}-g/round-review", {**ANSWERS,
                                                                                "decision": "GOAL_ACHIEVED"}))
    assert p["state"] == "done" and p["rounds"][0]["coverage"] == "R1 covered"


# ------------------------------------------------------------ rule 7


async def test_release_returns_the_claim_without_spending_an_attempt(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj)
    t = await claim(worker, proj, ["implement"])
    assert t is not None
    r = await worker.ok(await worker.post(f"/tasks/{task['id']}/release", {"lease_id": t["lease_id"],
                                                                           "reason": "going home"}))
    assert (r["state"], r["attempt"], r["lease_id"], r["worker"]) == ("pending", 1, None, None)
    await _refused(await worker.post(f"/tasks/{task['id']}/release", {"lease_id": t["lease_id"]}),
                   409, "lease_mismatch")
    again = await claim(worker, proj, ["implement"])
    assert again is not None and again["attempt"] == 1
    assert (await types_of(producer, task["id"]))[-2:] == ["task.released", "task.claimed"]


async def test_reassign_moves_directed_work_or_opens_it_to_anyone(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    bob = await harness.client("worker", node="node-a", name=f"bob-{proj}")
    carol = await harness.client("worker", node="node-b", name=f"carol-{proj}")
    task = await create_task(producer, proj, assignee="ghost")
    assert await claim(bob, proj, ["implement"]) is None
    r = await producer.ok(await producer.post(f"/tasks/{task['id']}/reassign", {"assignee": f"carol-{proj}"}))
    assert r["assignee"] == f"carol-{proj}"
    assert await claim(bob, proj, ["implement"]) is None
    await producer.ok(await producer.post(f"/tasks/{task['id']}/reassign", {"assignee": None}))
    t = await claim(bob, proj, ["implement"])
    assert t is not None and t["assignee"] is None
    assert await claim(carol, proj, ["implement"]) is None
    await _refused(await producer.post(f"/tasks/{task['id']}/reassign", {"assignee": "x"}), 409,
                   "invalid_transition")
    await _refused(await bob.post(f"/tasks/{task['id']}/reassign", {"assignee": None}), 403, "forbidden")
    assert (await _events(producer, task["id"]))[2]["data"] == {"assignee": None, "previous": f"carol-{proj}",
                                                                "by": (await _events(producer, task["id"]))[2][
                                                                    "data"]["by"]}


# ------------------------------------------------------------ rule 8


async def test_verifier_tasks_get_the_seed_priority_and_estimate_unless_told(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    a = await make(producer, maker, proj, priority=50)
    b = await make(producer, maker, proj, verification={"checkers": ["verifier"], "priority": 80,
                                                        "estimated_minutes": 2})
    va, vb = await view(producer, f"V-{a['id']}"), await view(producer, f"V-{b['id']}")
    assert (va["priority"], va["estimated_minutes"]) == (0, 10)
    assert (vb["priority"], vb["estimated_minutes"]) == (80, 2)


# ------------------------------------------------------------ rule 9


async def test_lists_refuse_what_they_do_not_filter_and_filter_what_they_say(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node=f"node-{proj}", name=f"w-{proj}")
    a = await create_task(producer, proj, labels=["ui"], assignee=f"w-{proj}")
    b = await create_task(producer, proj, labels=["api"])
    for path, params in (("/tasks", {"stat": "pending"}), ("/tasks", {"state": "nonsense"}),
                         ("/tasks", {"task_type": "build"}), ("/tasks", {"escalated": "maybe"}),
                         ("/blockers", {"opn": "true"}), ("/jobs", {"colour": "red"}),
                         ("/events", {"since": "0"}), (f"/tasks/{a['id']}/events", {"since": "1"}),
                         (f"/tasks/{a['id']}", {"as_of": "1"})):
        r = await producer.get(path, params=params)
        await _refused(r, 400, "validation_error")
    t = await claim(worker, proj, ["implement"])
    assert t is not None and t["id"] == a["id"]

    async def ids(**params: Any) -> list[str]:
        got = await producer.ok(await producer.get("/tasks", params={"project": proj, **params}))
        return [x["id"] for x in got["tasks"]]

    assert await ids(label="ui") == [a["id"]]
    assert await ids(label="api") == [b["id"]]
    assert await ids(assignee=f"w-{proj}") == [a["id"]]
    assert await ids(worker=f"w-{proj}") == [a["id"]]
    assert await ids(node=f"node-{proj}") == [a["id"]]
    assert await ids(escalated="false") == [a["id"], b["id"]]
    assert await ids(escalated="true") == []
    assert await ids(task_type="verify") == []
    assert await ids(state="claimed") == [a["id"]]
