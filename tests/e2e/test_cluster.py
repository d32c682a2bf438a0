"""Three `taskledger serve` replicas behind HAProxy on one PostgreSQL (deploy.cluster).

The drills share one cluster (module scope) and leave it whole: a killed or
restarted replica is back in rotation before the next drill starts.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from deploy.cluster import Cluster
from deploy.drill import Load, head_seq, read_log, token
from taskledger.service.ops.embedded import with_database
from tests.conftest import _drop, _run, fresh_database

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(pg_url: str, template_db: str) -> Iterator[Cluster]:
    name = fresh_database(pg_url, template_db)
    env = {"TASKLEDGER_SWEEP_INTERVAL_SECONDS": "0.2", "TASKLEDGER_MIGRATE_ON_START": "false"}
    c = Cluster(replicas=3, database_url=with_database(pg_url, name), drain_seconds=1.5, check_ms=100, env=env)
    with c:
        yield c
    _run(_drop(pg_url, name))


async def test_writers_and_subscribers_over_three_replicas_see_one_gapless_order(cluster: Cluster) -> None:
    async with Load(cluster.url, cluster.admin_token, writers=6, followers=6, retry=False) as load:
        await asyncio.sleep(3)
        head = await load.finish()
        assert all(not w.failures for w in load.writers), [w.failures[:3] for w in load.writers]
        assert await load.problems(head) == []
        # the proxy spread both kinds of client over every replica
        served = Counter[str]()
        for w in load.writers:
            served.update(w.replicas)
        assert set(served) == {"r1", "r2", "r3"}, served
        assert {f.replicas[0] for f in load.followers} == {"r1", "r2", "r3"}


async def test_kill_9_of_a_replica_under_load_loses_no_acknowledged_write(cluster: Cluster) -> None:
    victim = cluster.replica("r2")
    async with Load(cluster.url, cluster.admin_token, writers=6, followers=6, retry=True) as load:
        await asyncio.sleep(1.5)
        on_victim = [f for f in load.followers if f.replicas and f.replicas[-1] == victim.name]
        assert on_victim, [f.replicas for f in load.followers]
        await asyncio.to_thread(victim.kill)
        await asyncio.sleep(2)
        assert cluster.proxy is not None
        await asyncio.to_thread(cluster.proxy.wait_state, victim.name, "DOWN", 10)
        head = await load.finish()
        assert await load.problems(head) == []
        for f in on_victim:  # cut off, then back through the proxy on a live replica
            assert f.broken >= 1 and len(f.replicas) >= 2 and f.replicas[-1] != victim.name, (
                f.broken, f.replicas)
    await asyncio.to_thread(victim.start)
    await asyncio.to_thread(cluster.proxy.wait_state, victim.name, "UP", 30)


async def test_rolling_restart_under_load_fails_no_request(cluster: Cluster) -> None:
    async with Load(cluster.url, cluster.admin_token, writers=6, followers=6, retry=False) as load:
        await asyncio.sleep(1)
        drained = [await asyncio.to_thread(cluster.restart, r) for r in cluster.replicas]
        # each replica left the proxy's rotation (its /readyz said 503) before it stopped serving
        assert drained == [True, True, True]
        await asyncio.sleep(1)
        head = await load.finish()
        failures = [f for w in load.writers for f in w.failures]
        assert failures == [], failures[:10]
        assert await load.problems(head) == []
        for f in load.followers:
            # every follower was moved at least once, each time by a clean end of stream
            assert f.broken == 0 and f.clean_ends >= 1 and f.refused == [], (f.broken, f.clean_ends, f.refused)
        served = Counter[str]()
        for w in load.writers:
            served.update(w.replicas)
        assert sum(served.values()) == len(load.acked) > 0


async def test_sweepers_on_three_replicas_act_once_per_due_item(cluster: Cluster) -> None:
    """Each replica sweeps every 0.2 s; the head lock makes each expiry and escalation happen once."""
    base = cluster.url
    producer = {"Authorization": f"Bearer {token(cluster.url, cluster.admin_token, 'producer')}"}
    worker = {"Authorization": f"Bearer {token(cluster.url, cluster.admin_token, 'worker', node='n1')}"}
    reader = token(cluster.url, cluster.admin_token, "reader")
    run = uuid.uuid4().hex[:6]
    start = await head_seq(base, reader)
    async with httpx.AsyncClient(base_url=base, timeout=15) as c:
        escalating = [f"esc-{run}-{i}" for i in range(20)]
        for t in escalating:
            r = await c.post("/tasks", headers=producer, json={
                "id": t, "project": f"esc-{run}", "title": t, "escalate_after_seconds": 1})
            assert r.status_code == 201, r.text
        leased = [f"lease-{run}-{i}" for i in range(8)]
        for t in leased:
            r = await c.post("/tasks", headers=producer, json={"id": t, "project": f"lease-{run}", "title": t})
            assert r.status_code == 201, r.text
            r = await c.post("/tasks/claim", headers=worker, json={"projects": [f"lease-{run}"], "lease_seconds": 5})
            assert r.status_code == 200, r.text
        jobs = []
        for _ in range(6):
            r = await c.post("/jobs", headers=producer, json={"commands": ["true"], "project": f"job-{run}"})
            assert r.status_code == 201, r.text
            jobs.append(r.json()["job_id"])
            r = await c.post("/jobs/claim", headers=worker, json={"projects": [f"job-{run}"], "lease_seconds": 1})
            assert r.status_code == 200, r.text
        # the runner and the worker fall silent: every lease runs out, no task is taken
        expected = ({("task.escalated", f"task:{t}") for t in escalating}
                    | {("task.lease_expired", f"task:{t}") for t in leased}
                    | {("job.failed", f"job:{j}") for j in jobs})
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            events = await read_log(base, reader, start)
            seen = Counter((e["type"], e["stream"]) for e in events if (e["type"], e["stream"]) in expected)
            if set(seen) == expected or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.5)  # several more sweeps on every replica
        events = await read_log(base, reader, start)
    seen = Counter((e["type"], e["stream"]) for e in events if (e["type"], e["stream"]) in expected)
    assert set(seen) == expected
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n != 1]
