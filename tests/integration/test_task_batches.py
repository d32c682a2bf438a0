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


# ---------------------------------------------------------------------------
# POST /tasks/start/batch, POST /tasks/complete/batch, claim/batch with "start"


def shape(events: list[dict[str, Any]], names: dict[str, str]) -> list[tuple[Any, ...]]:
    """A stream's events with the ids, leases and clocks of one run named by their role,
    so two runs of the same work compare equal field by field."""
    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()
                    if k not in ("lease_expires_at", "request_id", "lease_id", "token_id")}
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, str):
            for real, role in names.items():
                v = v.replace(real, role)
        return v
    return [(e["stream_seq"], e["type"], norm(e["data"]), sorted(e["meta"]), "lease_id" in e["data"],
             "token_id" in e["data"]) for e in events]


async def stream(api: Client, task_id: str) -> list[dict[str, Any]]:
    return list((await api.ok(await api.get(f"/tasks/{task_id}/events", params={"since_seq": 0})))["events"])


async def pending_in(api: Client, proj: str, n: int, **fields: Any) -> list[dict[str, Any]]:
    tasks = [body(proj, **fields) for _ in range(n)]
    return list((await api.ok(await api.post("/tasks/batch", {"tasks": tasks}), 201))["tasks"])


def leases(ts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"tasks": [{"task_id": t["id"], "lease_id": t["lease_id"], **extra} for t in ts]}


async def test_batched_reports_log_what_the_single_routes_log_task_by_task(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a", name="maker")
    checker = await harness.client("worker", node="node-b", name="checker")
    panel = {"verification": {"checkers": ["tests", "review"]},
             "requirements": [{"id": "R1", "text": "works"}]}
    verdicts = [{"requirement_id": "R1", "verdict": "PASS", "reason": "ok"}]
    runs = []
    for batched in (False, True):
        proj = project()
        made = await pending_in(producer, proj, 3, **panel)
        if batched:
            got = (await maker.ok(await maker.post("/tasks/claim/batch", {"projects": [proj], "max": 3})))["tasks"]
            await maker.ok(await maker.post("/tasks/start/batch", leases(got)))
            done = await maker.ok(await maker.post("/tasks/complete/batch", leases(got, result={"n": 1})))
            assert [t["state"] for t in done["tasks"]] == ["verifying"] * 3
            vs = (await checker.ok(await checker.post("/tasks/claim/batch", {
                "task_types": ["verify"], "projects": [proj], "max": 10})))["tasks"]
            assert len(vs) == 6
            await checker.ok(await checker.post("/tasks/start/batch", leases(vs)))
            out = await checker.ok(await checker.post("/tasks/complete/batch", leases(
                vs, result={"n": 2}, outcome="PASS", verdicts=verdicts)))
            assert [t["id"] for t in out["tasks"]] == [v["id"] for v in vs]
        else:
            for _ in made:
                t = await claim(maker, proj, ["implement"])
                assert t is not None
                await start(maker, t)
                await maker.ok(await maker.post(f"/tasks/{t['id']}/complete",
                                                {"lease_id": t["lease_id"], "result": {"n": 1}}))
            while (v := await claim(checker, proj, ["verify"])) is not None:
                await start(checker, v)
                await checker.ok(await checker.post(f"/tasks/{v['id']}/complete", {
                    "lease_id": v["lease_id"], "result": {"n": 2}, "outcome": "PASS", "verdicts": verdicts}))
        names = {t["id"]: f"task{i}" for i, t in enumerate(made)} | {proj: "proj"}
        run = {}
        for i, t in enumerate(made):
            assert (await view(producer, t["id"]))["state"] == "verified"
            run[f"task{i}"] = shape(await stream(producer, t["id"]), names)
            for c in ("tests", "review"):
                run[f"V{i}-{c}"] = shape(await stream(producer, f"V-{t['id']}-a1-{c}"), names)
        runs.append(run)
    single, batched = runs
    assert batched == single
    assert [e[1] for e in single["task0"]] == [
        "task.created", "task.claimed", "task.started", "task.completed", "task.verifying",
        "task.verdict", "task.verdict", "task.verified"]
    assert [e[1] for e in single["V0-tests"]] == ["task.created", "task.claimed", "task.started", "task.completed"]


async def test_claim_with_start_logs_claimed_then_started_for_each_task(harness: AppHarness) -> None:
    proj, other = project(), project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    made = await pending_in(producer, proj, 4)
    await pending_in(producer, other, 1)
    got = (await worker.ok(await worker.post("/tasks/claim/batch", {
        "projects": [proj], "max": 10, "start": True})))["tasks"]
    assert [t["id"] for t in got] == [t["id"] for t in made]
    assert all(t["state"] == "running" for t in got) and len({t["lease_id"] for t in got}) == 4
    for t in got:
        events = await stream(worker, t["id"])
        assert [e["type"] for e in events] == ["task.created", "task.claimed", "task.started"]
        assert events[1]["data"]["lease_id"] == t["lease_id"]
    done = await worker.ok(await worker.post("/tasks/complete/batch", leases(got)))
    assert [t["state"] for t in done["tasks"]] == ["completed"] * 4
    # without "start" a claim stays a claim
    plain = (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [other]})))["tasks"]
    assert [t["state"] for t in plain] == ["claimed"]
    assert [e["type"] for e in await stream(worker, plain[0]["id"])] == ["task.created", "task.claimed"]


async def test_every_entry_must_hold_its_own_lease_or_nothing_is_written(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    me = await harness.client("worker", node="n1", name="me")
    other = await harness.client("worker", node="n2", name="other")
    await pending_in(producer, proj, 4)
    mine = (await me.ok(await me.post("/tasks/claim/batch", {"projects": [proj], "max": 3})))["tasks"]
    theirs = (await other.ok(await other.post("/tasks/claim/batch", {"projects": [proj], "max": 3})))["tasks"]
    assert len(mine) == 3 and len(theirs) == 1
    cases = [
        # another task's lease
        [{"task_id": mine[0]["id"], "lease_id": mine[0]["lease_id"]},
         {"task_id": mine[1]["id"], "lease_id": mine[2]["lease_id"]}],
        # the right lease id, but held by another token on another node
        [{"task_id": mine[0]["id"], "lease_id": mine[0]["lease_id"]},
         {"task_id": theirs[0]["id"], "lease_id": theirs[0]["lease_id"]}],
    ]
    for route, state in (("/tasks/start/batch", "claimed"), ("/tasks/complete/batch", "running")):
        for entries in cases:
            before = await head(producer)
            r = await me.post(route, {"tasks": entries})
            assert r.status_code == 409 and r.json()["code"] == "lease_mismatch", r.text
            assert r.json()["errors"][0]["index"] == 1 and r.json()["detail"].startswith("tasks[1]: ")
            assert await head(producer) == before
        assert [(await view(me, t["id"]))["state"] for t in mine] == [state] * 3
        # and the holders' own batches go through
        ok = await me.ok(await me.post(route, leases(mine)))
        await other.ok(await other.post(route, leases(theirs)))
        assert [t["state"] for t in ok["tasks"]] == ["running" if state == "claimed" else "completed"] * 3


async def test_a_refused_entry_refuses_the_whole_batch_naming_its_index(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    await pending_in(producer, proj, 3)
    got = (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 3})))["tasks"]
    await start(worker, got[2])
    before = await head(producer)
    cases = [
        ("/tasks/start/batch", leases(got), 409, "invalid_transition", 2),  # tasks[2] already runs
        ("/tasks/complete/batch", leases(got), 409, "invalid_transition", 0),  # tasks[0] is only claimed
        ("/tasks/start/batch", {"tasks": [*leases(got[:2])["tasks"], {"task_id": "nope", "lease_id": "L"}]},
         404, "task_not_found", 2),
        ("/tasks/start/batch", {"tasks": [*leases(got[:2])["tasks"], leases(got[:1])["tasks"][0]]},
         400, "validation_error", 2),  # the same task twice
        ("/tasks/complete/batch", leases(got[2:], outcome="PASS"), 400, "validation_error", 0),  # not a verify task
        ("/tasks/complete/batch", leases(got[2:], verdicts=[{"requirement_id": "R1", "verdict": "PASS"}]),
         400, "validation_error", 0),  # verdicts without an outcome
    ]
    for route, payload, status, code, index in cases:
        r = await worker.post(route, payload)
        assert r.status_code == status and r.json()["code"] == code, (route, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert [e["index"] for e in r.json()["errors"]] == [index], r.text
        assert await head(producer) == before
    assert [(await view(worker, t["id"]))["state"] for t in got] == ["claimed", "claimed", "running"]


async def test_report_batches_hold_one_to_a_thousand_entries_of_a_workers_schema(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    reader = await harness.client("reader")
    for route in ("/tasks/start/batch", "/tasks/complete/batch"):
        assert (await worker.post(route, {"tasks": []})).status_code == 400
        many = {"tasks": [{"task_id": f"t{i}", "lease_id": "L"} for i in range(1001)]}
        assert (await worker.post(route, many)).status_code == 400
        assert (await producer.post(route, {"tasks": [{"task_id": "t", "lease_id": "L"}]})).status_code == 403
        bad_id = [{"task_id": "t", "lease_id": "L"}, {"task_id": "t 2", "lease_id": "L"}]
        r = await worker.post(route, {"tasks": bad_id})
        assert r.status_code == 400 and [e["index"] for e in r.json()["errors"]] == [1], r.text
        r = await worker.post(route, {"tasks": [{"task_id": "t", "lease_id": "L", "what": 1}]})
        assert r.status_code == 400 and r.json()["errors"][0]["index"] == 0, r.text
    await pending_in(producer, proj, 1)
    t = (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj]})))["tasks"][0]
    assert (await reader.post("/tasks/start/batch", leases([t]))).status_code == 403
    # a thousand at once
    for _ in range(10):
        await pending_in(producer, proj, 100)
    got: list[dict[str, Any]] = [t]
    while len(got) < 1000:
        got += (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 100})))["tasks"]
    started = await worker.ok(await worker.post("/tasks/start/batch", leases(got[:1000])))
    assert len(started["tasks"]) == 1000 and {t["state"] for t in started["tasks"]} == {"running"}


async def test_verdicts_in_one_batch_decide_the_panel_as_one_by_one(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    reqs = [{"id": "R1", "text": "works"}, {"id": "R2", "text": "fast"}]
    made = await pending_in(producer, proj, 2, requirements=reqs, verification={"checkers": ["a", "b"]})
    got = (await maker.ok(await maker.post("/tasks/claim/batch", {"projects": [proj], "start": True})))["tasks"]
    await maker.ok(await maker.post("/tasks/complete/batch", leases(got)))
    vs = (await checker.ok(await checker.post("/tasks/claim/batch", {
        "task_types": ["verify"], "projects": [proj], "start": True})))["tasks"]
    by_id = {v["id"]: v for v in vs}
    good, bad, fail = made[0]["id"], made[1]["id"], made[1]["id"]
    pass_all = [{"requirement_id": r["id"], "verdict": "PASS"} for r in reqs]

    def entry(vid: str, **fields: Any) -> dict[str, Any]:
        return {"task_id": vid, "lease_id": by_id[vid]["lease_id"], **fields}

    # a PASS that skips a requirement is refused like the single route refuses it
    r = await checker.post("/tasks/complete/batch", {"tasks": [
        entry(f"V-{good}-a1-a", outcome="PASS", verdicts=pass_all),
        entry(f"V-{good}-a1-b", outcome="PASS", verdicts=pass_all[:1])]})
    assert r.status_code == 400 and r.json()["errors"][0]["index"] == 1, r.text
    assert (await view(producer, good))["verdicts"] == []
    out = await checker.ok(await checker.post("/tasks/complete/batch", {"tasks": [
        entry(f"V-{good}-a1-a", outcome="PASS", verdicts=pass_all),
        entry(f"V-{bad}-a1-a", outcome="PASS", verdicts=pass_all),
        entry(f"V-{good}-a1-b", outcome="PASS", verdicts=pass_all),
        entry(f"V-{fail}-a1-b", outcome="FAIL",
              verdicts=[{"requirement_id": "R2", "verdict": "FAIL", "reason": "slow"}])]}))
    assert [t["state"] for t in out["tasks"]] == ["completed"] * 4
    assert (await view(producer, good))["state"] == "verified"
    retried = await view(producer, bad)
    assert retried["state"] == "pending" and retried["attempt"] == 2
    assert (await types_of(producer, bad))[-4:] == [
        "task.verdict", "task.verdict", "task.rejected", "task.retry_scheduled"]
    # the verdict that ended the panel is the batch's last: the maker saw both, in order
    verdict_events = [e for e in await stream(producer, bad) if e["type"] == "task.verdict"]
    assert [e["data"]["checker"] for e in verdict_events] == ["a", "b"]


async def test_the_idempotency_key_covers_a_report_batch(harness: AppHarness) -> None:
    proj = project()
    producer = await harness.client("producer")
    worker = await harness.client("worker", node="n1")
    await pending_in(producer, proj, 3)
    got = (await worker.ok(await worker.post("/tasks/claim/batch", {"projects": [proj], "max": 3})))["tasks"]
    key = {"Idempotency-Key": new_id("K")}
    first = await worker.ok(await worker.post("/tasks/start/batch", leases(got), headers=key))
    before = await head(producer)
    again = await worker.post("/tasks/start/batch", leases(got), headers=key)
    assert again.status_code == 200 and again.json() == first
    assert await head(producer) == before
    other = await worker.post("/tasks/start/batch", leases(got[:2]), headers=key)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
