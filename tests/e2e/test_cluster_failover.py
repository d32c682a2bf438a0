"""PostgreSQL fails over under load: a primary and a synchronous hot standby, the service
given both hosts with target_session_attrs=read-write (deploy.cluster --standby)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from deploy.cluster import Cluster
from deploy.drill import Load, longest_pause

pytestmark = pytest.mark.slow


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster(replicas=2, standby=True, drain_seconds=0.5, check_ms=100,
                env={"TASKLEDGER_SWEEP_INTERVAL_SECONDS": "0.5"})
    await asyncio.to_thread(c.start)
    try:
        yield c
    finally:
        await asyncio.to_thread(c.stop)


async def test_promoting_the_standby_under_load_keeps_every_acknowledged_write(cluster: Cluster) -> None:
    primary, standby = cluster.servers
    async with Load(cluster.url, cluster.admin_token, writers=6, followers=4, retry=True) as load:
        await asyncio.sleep(1.5)
        before = len(load.acked)
        crashed = time.monotonic()
        await asyncio.to_thread(primary.stop, "immediate")  # a crash: no shutdown checkpoint
        await asyncio.to_thread(standby.promote)
        promoted = time.monotonic()
        # the replicas find the new primary by themselves: nothing is restarted
        deadline = promoted + 30
        while len(load.acked) < before + 50 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)
        head = await load.finish()
        window = longest_pause(load.ack_times, crashed - 1, time.monotonic())
        print(f"failover: promote took {promoted - crashed:.2f}s; no write acknowledged for {window:.2f}s; "
              f"{len(load.acked)} writes, head {head}")
        # while there is no primary, the service answers 503 (and then the proxy, once
        # /readyz has taken both replicas out): never a 500, never a lost connection
        failures = [f for w in load.writers for f in w.failures]
        assert failures and all(": 503 " in f for f in failures), failures[:5]
        assert await load.problems(head) == []
        assert all(r.running for r in cluster.replicas)
        assert len(load.acked) >= before + 50
        assert window < 15
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60,
                                 headers={"Authorization": f"Bearer {cluster.admin_token}"}) as c:
        v = (await c.get("/audit/verify")).json()
        assert v["ok"] is True and v["head_seq"] == head and v["first_bad_seq"] is None, v
        # the log is on the promoted standby, which is now the one taking writes
        assert standby.psql("SELECT pg_is_in_recovery()", "taskledger").strip() == "f"
        assert int(standby.psql("SELECT max(seq) FROM events", "taskledger").strip()) == head
