"""A `kill -9` of the server loses no acknowledged write and leaves a gapless, chained log.

A 201 is sent only after the writer's batch has committed (synchronous_commit
on), so every task a client saw created must be there after the server dies
mid-stream and comes back. Tasks whose commit landed but whose answer was lost
with the process may exist too; nothing else may.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from typing import Any

import asyncpg
import httpx

from taskledger import log as store
from taskledger.events.canonical import verify_chain
from tests.conftest import ServerProcess

CLIENTS = 8


async def _log_and_view(db_url: str) -> tuple[list[dict[str, Any]], set[str], int]:
    conn = await asyncpg.connect(db_url)
    try:
        events: list[dict[str, Any]] = []
        since = 0
        while True:
            page = await store.read(conn, since_seq=since, limit=5000)
            if not page:
                break
            events += [e.as_dict() for e in page]
            since = page[-1].seq
        view = {r["id"] for r in await conn.fetch("SELECT id FROM tasks")}
        head = await conn.fetchval("SELECT seq FROM log_head WHERE id = 1")
        return events, view, head
    finally:
        await conn.close()


def test_tasks_acknowledged_before_a_kill_9_are_there_after_the_restart_and_the_log_stays_gapless(
    db_url: str,
) -> None:
    first = ServerProcess(db_url).start()
    token = first.token("producer")
    acked: list[str] = []
    sent: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        with httpx.Client(base_url=first.base, headers={"Authorization": f"Bearer {token}"},
                          timeout=10) as http:
            i = 0
            while True:
                i += 1
                task_id = f"D-{n}-{i}"
                with lock:
                    sent.append(task_id)
                try:
                    r = http.post("/tasks", json={"id": task_id, "project": "durability", "title": "t",
                                                  "verification": None})
                except httpx.HTTPError:
                    return  # the server is gone
                if r.status_code != 201:
                    return
                with lock:
                    acked.append(task_id)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 15
    while len(acked) < 300 and time.monotonic() < deadline:
        time.sleep(0.02)
    first.kill(signal.SIGKILL)  # the whole process group, mid-stream
    for t in threads:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in threads), "a client hung after the kill"
    assert len(acked) >= 50, f"only {len(acked)} tasks were created before the kill: {first.log()}"
    assert len(sent) > len(acked), "the kill did not land mid-stream"

    second = ServerProcess(db_url).start()
    try:
        with second.client() as http:
            missing = [tid for tid in acked if http.get(f"/tasks/{tid}").status_code != 200]
        assert missing == [], f"{len(missing)} acknowledged tasks are gone, e.g. {missing[:5]}"

        events, view, head = asyncio.run(_log_and_view(db_url))
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "seq has a hole"
        assert head == len(events)
        ok, first_bad, _ = verify_chain(events)
        assert ok, f"the hash chain breaks at seq {first_bad}"
        created = {e["stream"].removeprefix("task:") for e in events if e["type"] == "task.created"}
        assert created == view, "the task view and the log disagree"
        assert set(acked) <= created
        assert created <= set(sent), "the log holds a task no client asked for"
    finally:
        second.stop()
