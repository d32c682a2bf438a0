"""Maker-checker through the HTTP API against real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg

from tests.conftest import AppHarness
from tests.flows import claim, complete_impl, complete_verify, create_task, make, project, types_of, view


async def test_completion_creates_a_verifier_on_another_node_and_pass_verifies(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    same_node = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")

    done = await make(producer, maker, proj)
    assert done["state"] == "verifying"
    vid = f"V-{done['id']}"
    assert done["verifier_task_ids"] == [vid]
    v = await view(producer, vid)
    assert v["task_type"] == "verify" and v["parent_task_id"] == done["id"] and v["state"] == "pending"
    assert v["node_blacklist"] == ["node-a"]

    assert await claim(maker, proj, ["verify"]) is None
    assert await claim(same_node, proj, ["verify"]) is None
    t = await claim(checker, proj, ["verify"])
    assert t is not None and t["id"] == vid
    await complete_verify(checker, t, "PASS")
    final = await view(producer, done["id"])
    assert final["state"] == "verified"
    assert [x["outcome"] for x in final["verdicts"]] == ["PASS"]
    types = await types_of(producer, done["id"])
    assert types == ["task.created", "task.claimed", "task.started", "task.completed", "task.verifying",
                     "task.verdict", "task.verified"]


async def test_the_maker_worker_never_checks_its_own_work_even_with_a_second_token(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a", name="same-worker")
    # a second live token of the same worker may only run on the same node
    r = await harness.admin.post("/tokens", {"role": "worker", "name": "same-worker", "node": "node-z"})
    assert r.status_code == 409 and r.json()["code"] == "already_exists", r.text
    twin = await harness.client("worker", node="node-a", name="same-worker")
    await make(producer, maker, proj)
    assert await claim(twin, proj, ["verify"]) is None


async def test_a_forged_node_in_the_claim_body_is_refused(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    done = await make(producer, maker, proj)
    r = await maker.post("/tasks/claim", {"task_types": ["verify"], "projects": [proj], "node": "node-z"})
    assert r.status_code == 400
    assert (await view(producer, f"V-{done['id']}"))["state"] == "pending"


async def test_fail_rejects_retries_with_rework_notes_then_blocks(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, max_attempts=2)
    t = await claim(checker, proj, ["verify"])
    assert t is not None
    await complete_verify(checker, t, "FAIL", verdicts=[{"requirement_id": "R1", "verdict": "FAIL",
                                                          "reason": "logs go to stdout"}])
    v = await view(producer, done["id"])
    assert v["state"] == "pending" and v["attempt"] == 2
    assert v["rework_notes"] == [{"requirement_id": "R1", "reason": "logs go to stdout", "checker": "verifier"}]

    t2 = await claim(maker, proj, ["implement"])
    assert t2 is not None and t2["id"] == done["id"] and t2["attempt"] == 2
    await complete_impl(maker, t2)
    t3 = await claim(checker, proj, ["verify"])
    assert t3 is not None and t3["id"] == f"V-{done['id']}-a2-verifier"
    await complete_verify(checker, t3, "FAIL")
    v = await view(producer, done["id"])
    assert v["state"] == "blocked" and v["blocker_id"]
    blockers = (await producer.ok(await producer.get("/blockers", params={"open": "true"})))["blockers"]
    mine = [b for b in blockers if b["task_id"] == done["id"]]
    assert len(mine) == 1 and mine[0]["open"] and mine[0]["unmet_requirements"][0]["requirement_id"] == "R1"
    assert mine[0]["opened_seq"] > 0 and mine[0]["resolved_seq"] is None
    types = await types_of(producer, done["id"])
    assert types.count("task.rejected") == 2 and types.count("task.retry_scheduled") == 1
    assert types[-1] == "task.blocked"


async def test_retry_predecessor_false_blocks_on_the_first_fail(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, retry_predecessor=False)
    t = await claim(checker, proj, ["verify"])
    assert t is not None
    await complete_verify(checker, t, "FAIL")
    assert (await view(producer, done["id"]))["state"] == "blocked"


async def test_a_panel_is_decided_only_when_every_checker_has_reported(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    panel = ["test_runner", "requirements", "anti_cheat", "edge_cases"]
    done = await make(producer, maker, proj, verification={"checkers": panel})
    assert done["verifier_task_ids"] == [f"V-{done['id']}-a1-{c}" for c in panel]
    for i in range(4):
        t = await claim(checker, proj, ["verify"])
        assert t is not None
        await complete_verify(checker, t, "PASS")
        state = (await view(producer, done["id"]))["state"]
        assert state == ("verified" if i == 3 else "verifying")


async def test_one_fail_in_a_panel_rejects(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, verification={"checkers": ["a", "b"]}, max_attempts=1)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "PASS")
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "FAIL")
    v = await view(producer, done["id"])
    assert v["state"] == "blocked"


async def test_blocked_infrastructure_reverifies_once_then_blocks(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "BLOCKED",
                          category="infrastructure", verdicts=[])
    v = await view(producer, done["id"])
    assert v["state"] == "verifying" and v["attempt"] == 1
    assert v["verifier_task_ids"] == [f"V-{done['id']}-a1-verifier"]
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "BLOCKED",
                          category="infrastructure", verdicts=[])
    v = await view(producer, done["id"])
    assert v["state"] == "blocked"
    types = await types_of(producer, done["id"])
    assert types.count("task.reverify_scheduled") == 1 and types[-1] == "task.blocked"


async def test_blocked_environment_goes_to_a_human_and_unblock_retry_resets_attempts(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "BLOCKED",
                          category="environment", verdicts=[])
    v = await view(producer, done["id"])
    assert v["state"] == "blocked"
    r = await producer.post(f"/tasks/{done['id']}/unblock", {"action": "retry", "notes": "disk freed"})
    u = await producer.ok(r)
    assert u["state"] == "pending" and u["attempt"] == 1 and u["blocker_id"] is None
    blockers = (await producer.ok(await producer.get("/blockers", params={"task_id": done["id"]})))["blockers"]
    assert blockers[0]["open"] is False and blockers[0]["resolution"] == "retry"
    assert blockers[0]["resolved_seq"] > blockers[0]["opened_seq"]
    # the next verification gets a fresh id
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    again = await complete_impl(maker, t)
    assert again["verifier_task_ids"] == [f"V-{done['id']}-a1-verifier"]


async def test_blocked_code_rejects_like_a_fail(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "BLOCKED",
                          category="code", verdicts=[])
    v = await view(producer, done["id"])
    assert v["state"] == "pending" and v["attempt"] == 2


async def test_unblock_reverify_creates_new_verifiers_for_the_same_attempt(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "BLOCKED",
                          category="info_missing", verdicts=[])
    u = await producer.ok(await producer.post(f"/tasks/{done['id']}/unblock", {"action": "reverify"}))
    assert u["state"] == "verifying" and u["attempt"] == 1
    t = await claim(checker, proj, ["verify"])
    assert t is not None and t["id"] in u["verifier_task_ids"]
    await complete_verify(checker, t, "PASS")
    assert (await view(producer, done["id"]))["state"] == "verified"


async def test_no_verification_completes_and_collect_hands_out_once(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    plain = await make(producer, maker, proj, verification=None)
    assert plain["state"] == "completed" and plain["verifier_task_ids"] == []
    checked = await make(producer, maker, proj)
    await complete_verify(checker, await claim(checker, proj, ["verify"]) or {}, "PASS")
    got = (await producer.ok(await producer.post("/tasks/collect", {"project": proj, "limit": 100})))["tasks"]
    assert sorted(t["id"] for t in got) == sorted([plain["id"], checked["id"]])
    assert all(t["state"] == "collected" for t in got)
    again = (await producer.ok(await producer.post("/tasks/collect", {"project": proj})))["tasks"]
    assert again == []


async def test_collect_without_a_project_hands_out_every_projects_tasks_in_log_order(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    a, b = project(), project()
    done = [await make(producer, maker, p, verification=None) for p in (a, b, a)]
    only_b = (await producer.ok(await producer.post("/tasks/collect", {"project": b, "limit": 2})))["tasks"]
    assert [t["id"] for t in only_b] == [done[1]["id"]]
    rest = (await producer.ok(await producer.post("/tasks/collect", {"limit": 100})))["tasks"]
    assert [t["id"] for t in rest] == [done[0]["id"], done[2]["id"]]
    assert (await producer.ok(await producer.post("/tasks/collect", {})))["tasks"] == []


async def test_only_the_lease_holder_may_report(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    other = await harness.client("worker", node="node-c")
    task = await create_task(producer, proj)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    for path in ("start", "heartbeat", "fail"):
        r = await other.post(f"/tasks/{task['id']}/{path}", {"lease_id": t["lease_id"]})
        assert r.status_code == 409 and r.json()["code"] == "lease_mismatch", (path, r.text)
    r = await maker.post(f"/tasks/{task['id']}/start", {"lease_id": "not-the-lease"})
    assert r.status_code == 409 and r.json()["code"] == "lease_mismatch"
    assert (await view(producer, task["id"]))["state"] == "claimed"


async def test_a_transition_the_state_does_not_allow_is_409_and_writes_nothing(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    head = (await producer.ok(await producer.get("/events")))["head_seq"]
    r = await maker.post(f"/tasks/{task['id']}/complete", {"lease_id": t["lease_id"]})
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"
    r = await producer.post(f"/tasks/{task['id']}/unblock", {"action": "retry"})
    assert r.status_code == 409
    assert (await producer.ok(await producer.get("/events")))["head_seq"] == head


async def test_heartbeat_extends_the_lease_without_an_event(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    before = len(await types_of(producer, task["id"]))
    hb = await maker.ok(await maker.post(f"/tasks/{task['id']}/heartbeat",
                                         {"lease_id": t["lease_id"], "lease_seconds": 600}))
    assert hb["lease_expires_at"] > t["lease_expires_at"]
    assert len(await types_of(producer, task["id"])) == before
    assert (await view(producer, task["id"]))["lease_expires_at"] == hb["lease_expires_at"]


async def test_an_expired_lease_returns_the_task_to_pending_then_dead_letters(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj, max_attempts=2)
    for attempt in (1, 2):
        r = await maker.post("/tasks/claim", {"task_types": ["implement"], "projects": [proj], "lease_seconds": 5})
        t = await maker.ok(r)
        assert t["attempt"] == attempt
        await pool.execute(
            "UPDATE task_leases SET expires_at = now() - interval '1 second' WHERE task_id = $1", task["id"])
        for _ in range(100):
            v = await view(producer, task["id"])
            if v["state"] in ("pending", "deadletter"):
                break
            await asyncio.sleep(0.05)
    assert v["state"] == "deadletter"
    types = await types_of(producer, task["id"])
    assert types.count("task.lease_expired") == 2 and types[-1] == "task.deadlettered"
    r = await maker.post(f"/tasks/{task['id']}/heartbeat", {"lease_id": t["lease_id"]})
    assert r.status_code == 409


async def test_worker_failure_retries_then_dead_letters(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj, max_attempts=2)
    for _ in range(2):
        t = await claim(maker, proj, ["implement"])
        assert t is not None
        await maker.ok(await maker.post(f"/tasks/{task['id']}/fail", {"lease_id": t["lease_id"], "error": "boom"}))
    v = await view(producer, task["id"])
    assert v["state"] == "deadletter" and v["error"] == "boom"


async def test_claims_honour_priority_assignee_and_blacklist(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    alice = await harness.client("worker", node="n1", name="alice")
    bob = await harness.client("worker", node="n2", name="bob")
    low = await create_task(producer, proj, priority=1)
    high = await create_task(producer, proj, priority=9)
    mine = await create_task(producer, proj, priority=50, assignee="alice")
    banned = await create_task(producer, proj, priority=100, node_blacklist=["n2"])
    got = await claim(bob, proj, ["implement"])
    assert got is not None and got["id"] == high["id"]
    got = await claim(alice, proj, ["implement"])
    assert got is not None and got["id"] == banned["id"]
    got = await claim(alice, proj, ["implement"])
    assert got is not None and got["id"] == mine["id"]
    got = await claim(bob, proj, ["implement"])
    assert got is not None and got["id"] == low["id"]


async def test_cancelling_a_verifying_task_cancels_its_checkers(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    done = await make(producer, maker, proj)
    c = await producer.ok(await producer.post(f"/tasks/{done['id']}/cancel", {"reason": "obsolete"}))
    assert c["state"] == "cancelled"
    assert (await view(producer, f"V-{done['id']}"))["state"] == "cancelled"
    r = await producer.post(f"/tasks/{done['id']}/cancel")
    assert r.status_code == 409


async def test_a_dead_lettered_verifier_counts_as_blocked_infrastructure(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj, max_attempts=1)
    t = await claim(checker, proj, ["verify"])
    assert t is not None
    await checker.ok(await checker.post(f"/tasks/{t['id']}/fail", {"lease_id": t["lease_id"], "error": "oom"}))
    v = await view(producer, done["id"])
    assert v["state"] == "verifying" and v["verdicts"] == []
    assert len(v["verifier_task_ids"]) == 1 and v["verifier_task_ids"][0] != t["id"]


async def test_idempotency_key_replays_the_first_answer(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    body = {"id": "T-idem", "project": "p", "title": "t"}
    r1 = await producer.post("/tasks", body, headers={"Idempotency-Key": "k1"})
    r2 = await producer.post("/tasks", body, headers={"Idempotency-Key": "k1"})
    assert r1.status_code == r2.status_code == 201 and r1.json() == r2.json()
    r3 = await producer.post("/tasks", {**body, "title": "other"}, headers={"Idempotency-Key": "k1"})
    assert r3.status_code == 409 and r3.json()["code"] == "idempotency_conflict"
    other = await harness.client("producer")
    r4 = await other.post("/tasks", body, headers={"Idempotency-Key": "k1"})
    assert r4.status_code == 409 and r4.json()["code"] == "already_exists"
    assert len(await types_of(producer, "T-idem")) == 1


async def test_bad_task_input_is_a_400_and_writes_nothing(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    bad = [
        {"project": "p"},
        {"project": "p", "title": "t", "id": "has space"},
        {"project": "p", "title": "t", "id": "x" * 129},
        {"project": "p", "title": "t", "state": "verified"},
        {"project": "p", "title": "t", "seq": 5},
        {"project": "p", "title": "t", "priority": "high"},
        {"project": "p", "title": "t", "max_attempts": 0},
        {"project": "p", "title": "t", "task_type": "verify"},
        {"project": "p", "title": "t", "verification": {"checkers": []}},
        {"project": "p", "title": "t", "requirements": [{"id": "R1"}, {"id": "R1"}]},
        {"project": "p", "title": "t", "parent_task_id": "nope"},
        {"project": "p", "title": "t" * 2000},
        [1, 2, 3],
    ]
    for body in bad:
        r = await producer.post("/tasks", body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    assert (await producer.ok(await producer.get("/events")))["head_seq"] == 0


async def test_ten_workers_racing_for_a_hundred_tasks_never_share_one(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    for i in range(120):
        await create_task(producer, proj, id=f"race-{i}", verification=None)
    workers = [await harness.client("worker", node=f"n{i}") for i in range(10)]
    got: list[str] = []

    async def work(w: object) -> None:
        while True:
            t = await claim(w, proj, ["implement"])  # type: ignore[arg-type]
            if t is None:
                return
            got.append(t["id"])

    await asyncio.gather(*(work(w) for w in workers))
    assert sorted(got) == sorted(f"race-{i}" for i in range(120))


async def test_view_as_of_seq_shows_the_past(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    task = await create_task(producer, proj)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    then = await view(producer, task["id"], as_of_seq=task["seq"])
    assert then["state"] == "pending"
    assert (await view(producer, task["id"]))["state"] == "claimed"
    r = await producer.get(f"/tasks/{task['id']}", params={"as_of_seq": 10**9})
    assert r.status_code == 400
