"""The dashboard's read routes: the board as of a seq, blockers as of a seq, the seq at a time, trust figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from taskledger import log as store
from tests.conftest import AppHarness, Client
from tests.flows import claim, complete_verify, create_task, make, project


async def _board(api: Client, as_of_seq: int, limit: int = 1000) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"as_of_seq": as_of_seq, "limit": limit}
        if after:
            params["after"] = after
        page = await api.ok(await api.get("/dashboard/tasks", params=params))
        assert page["as_of_seq"] == as_of_seq
        out.extend(page["tasks"])
        after = page["next_after"]
        if after is None:
            return out


async def _history(harness: AppHarness) -> tuple[Client, str]:
    """A small history with every kind of step: retries, verifiers, a blocker opened and resolved."""
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    await make(producer, maker, proj, id="a")                     # a: verifying
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL")                     # a: retry, attempt 2
    await make(producer, maker, proj + "-b", id="b", retry_predecessor=False)
    v = await claim(checker, proj + "-b", ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL")                     # b: blocked
    await producer.ok(await producer.post("/tasks/b/unblock", {"action": "retry", "notes": "fixed the env"}))
    await create_task(producer, proj, id="c")
    await producer.ok(await producer.post("/tasks/c/cancel", {"reason": "not needed"}))
    return producer, proj


async def test_the_board_as_of_every_seq_is_exactly_what_the_replay_api_gives(harness: AppHarness) -> None:
    producer, _ = await _history(harness)
    head = (await producer.ok(await producer.get("/events", params={"limit": 1})))["head_seq"]
    assert head > 15
    for seq in range(0, head + 1):
        board = await _board(producer, seq, limit=2)  # pages of two: the cursor is exercised too
        ids = [t["id"] for t in board]
        assert len(ids) == len(set(ids))
        existed = {e["stream"][5:] for e in (await producer.ok(await producer.get(
            "/events", params={"since_seq": 0, "limit": seq or 1})))["events"]
            if e["seq"] <= seq and e["type"] == "task.created"}
        assert set(ids) == existed, seq
        for t in board:
            replayed = await producer.ok(await producer.get(f"/tasks/{t['id']}", params={"as_of_seq": seq}))
            assert t == replayed, (seq, t["id"])
    # at the head it is the current view (bar the live lease deadline, laid over the view)
    now = {t["id"]: t for t in (await producer.ok(await producer.get("/tasks", params={"limit": 1000})))["tasks"]}
    for t in await _board(producer, head):
        assert t["state"] == now[t["id"]]["state"] and t["seq"] == now[t["id"]]["seq"]


async def test_board_as_of_refuses_bad_input(harness: AppHarness) -> None:
    producer, _ = await _history(harness)
    head = (await producer.ok(await producer.get("/events", params={"limit": 1})))["head_seq"]
    for params in ({"as_of_seq": head + 1}, {"as_of_seq": -1}, {}, {"as_of_seq": 3, "after": "nope"},
                   {"as_of_seq": 3, "limit": 0}):
        r = await producer.get("/dashboard/tasks", params=params)
        assert r.status_code == 400, (params, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    assert (await harness.anonymous().get("/dashboard/tasks", params={"as_of_seq": 1})).status_code == 401


async def test_blockers_as_of_a_seq_are_those_open_then(harness: AppHarness) -> None:
    producer, _ = await _history(harness)
    events = (await producer.ok(await producer.get("/tasks/b/events")))["events"]
    opened = next(e["seq"] for e in events if e["type"] == "task.blocked")
    resolved = next(e["seq"] for e in events if e["type"] == "task.unblocked")

    async def at(seq: int) -> list[dict[str, Any]]:
        body = await producer.ok(await producer.get("/dashboard/blockers", params={"as_of_seq": seq}))
        return body["blockers"]  # type: ignore[no-any-return]

    assert await at(opened - 1) == []
    for seq in (opened, resolved - 1):
        (b,) = await at(seq)
        assert b["task_id"] == "b" and b["open"] is True and b["resolved_seq"] is None and b["notes"] is None
    assert await at(resolved) == []
    now = (await producer.ok(await producer.get("/blockers", params={"task_id": "b"})))["blockers"]
    assert now[0]["open"] is False and now[0]["notes"] == "fixed the env"


async def test_seq_at_a_time_is_the_last_event_recorded_by_then(harness: AppHarness) -> None:
    producer, _ = await _history(harness)
    events = (await producer.ok(await producer.get("/events", params={"since_seq": 0})))["events"]
    head = events[-1]["seq"]

    async def seq_at(when: str) -> dict[str, Any]:
        return await producer.ok(await producer.get("/dashboard/seq-at", params={"at": when}))  # type: ignore[no-any-return]

    for e in events:
        got = await seq_at(e["recorded_at"])
        # events recorded in the same microsecond share a time: the answer is the last of them
        same = [x["seq"] for x in events if x["recorded_at"] == e["recorded_at"]]
        assert got["seq"] == max(same) and got["recorded_at"] == e["recorded_at"] and got["head_seq"] == head
    first = datetime.fromisoformat(events[0]["recorded_at"].replace("Z", "+00:00"))
    assert (await seq_at((first - timedelta(seconds=1)).isoformat()))["seq"] == 0
    assert (await seq_at((first - timedelta(seconds=1)).isoformat()))["recorded_at"] is None
    assert (await seq_at((datetime.now(UTC) + timedelta(days=1)).isoformat()))["seq"] == head
    for bad in ("yesterday", "2026-01-01T00:00:00", ""):
        r = await producer.get("/dashboard/seq-at", params={"at": bad})
        assert r.status_code == 400, (bad, r.text)


async def test_status_shows_the_last_signed_checkpoint_when_there_is_one(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    reader = await harness.client("reader")
    producer, _ = await _history(harness)
    st = await reader.ok(await reader.get("/dashboard/status"))
    head = (await producer.ok(await producer.get("/events", params={"limit": 1})))["head_seq"]
    assert st["head_seq"] == head and len(st["head_hash"]) == 64
    assert st["last_checkpoint"] is None and st["checkpoints"] == 0
    assert {p["name"] for p in st["projections"]} >= {"tasks"}
    assert all(p["lag"] == 0 for p in st["projections"] if p["name"] == "tasks")
    proc = st["process"]
    assert proc["writer_commits"] > 0 and proc["writer_commands"] >= proc["writer_commits"]
    assert proc["writer_mean_batch"] >= 1
    assert proc["writer_queue_depth"] == 0

    # two checkpoints in the log: the later one shows, with its signature fields as stored
    for n in (1, 2):
        async with pool.acquire() as conn, conn.transaction():
            h, hh = await store.head(conn)
            await store.append(conn, "audit", [store.NewEvent(type="audit.checkpoint", data={
                "covers_seq": h, "covers_hash": hh, "key_id": "k1", "signature": f"sig-{n}"})],
                meta={"actor": "taskledger", "role": "system"})
    st = await reader.ok(await reader.get("/dashboard/status"))
    cp = st["last_checkpoint"]
    assert st["checkpoints"] == 2
    assert cp["type"] == "audit.checkpoint" and cp["stream"] == "audit" and cp["data"]["signature"] == "sig-2"
    assert cp["data"]["covers_seq"] == cp["seq"] - 1 and cp["seq"] == st["head_seq"]
