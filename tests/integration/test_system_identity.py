"""Everything the service does on its own is recorded under one identity."""

from __future__ import annotations

import asyncio
import json
import time

import asyncpg
from litestar.testing import AsyncTestClient

from taskledger.events.actor import SYSTEM_ACTOR, SYSTEM_ROLE
from taskledger.service.http.app import create_app
from taskledger.service.ops.sweepers import SYSTEM
from tests.conftest import AppHarness, settings_for
from tests.flows import create_task, project

# One of each automatic action: a lapsed task lease, an escalation, a job whose
# runner went quiet, a signed checkpoint.
AUTOMATIC = {"task.lease_expired", "task.escalated", "job.failed", "audit.checkpoint"}


async def test_every_automatic_action_records_the_one_system_identity(db_url: str, pool: asyncpg.Pool) -> None:
    app = create_app(settings_for(db_url, audit_checkpoint_every_events=4, audit_checkpoint_every_seconds=0))
    async with AsyncTestClient(app=app, timeout=30) as http:
        h = AppHarness(http, app)
        proj = project()
        producer = await h.client("producer")
        worker = await h.client("worker", node="node-a")
        await create_task(producer, proj + "-wait", escalate_after_seconds=1)
        leased = await create_task(producer, proj, verification=None)
        r = await worker.post("/tasks/claim", {"task_types": ["implement"], "projects": [proj], "lease_seconds": 60})
        assert (await worker.ok(r))["id"] == leased["id"]
        await pool.execute(
            "UPDATE task_leases SET expires_at = now() - interval '1 second' WHERE task_id = $1", leased["id"])
        job = await producer.ok(await producer.post("/jobs", {"commands": ["sleep 100"]}))
        await worker.ok(await worker.post("/jobs/claim", {"lease_seconds": 1}), 200)

        deadline = time.monotonic() + 30
        while True:
            rows = await pool.fetch("SELECT seq, stream, type, meta::text AS meta FROM events ORDER BY seq")
            if {r["type"] for r in rows} >= AUTOMATIC:
                break
            assert time.monotonic() < deadline, sorted({r["type"] for r in rows})
            await asyncio.sleep(0.1)

    callers = {(m["actor"], m["role"]) for m in (json.loads(r["meta"]) for r in rows)
               if m["actor"] != SYSTEM_ACTOR}
    assert {role for _, role in callers} <= {"producer", "worker"}, callers
    system = [(r["seq"], r["stream"], r["type"]) for r in rows if json.loads(r["meta"])["actor"] == SYSTEM_ACTOR]
    assert {t for _, _, t in system} >= AUTOMATIC
    assert f"job:{job['job_id']}" in {s for _, s, t in system if t == "job.failed"}
    for r in rows:
        meta = json.loads(r["meta"])
        if r["type"] in AUTOMATIC or meta["actor"] == SYSTEM_ACTOR:
            assert (meta["actor"], meta["role"], meta.get("node")) == (SYSTEM_ACTOR, SYSTEM_ROLE, None), dict(r)
    assert (SYSTEM.name, SYSTEM.role, SYSTEM.node) == (SYSTEM_ACTOR, SYSTEM_ROLE, None)
