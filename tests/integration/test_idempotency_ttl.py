"""Idempotency keys are remembered for a configurable TTL, then forgotten and swept."""

from __future__ import annotations

import asyncio

import asyncpg
from litestar.testing import AsyncTestClient

from taskledger.service.http.app import create_app
from taskledger.service.settings import Settings
from tests.conftest import AppHarness, settings_for


def test_the_default_ttl_is_a_day() -> None:
    assert Settings().idempotency_ttl_seconds == 24 * 3600
    assert Settings.from_env({"TASKLEDGER_IDEMPOTENCY_TTL_SECONDS": "60"}).idempotency_ttl_seconds == 60


async def test_a_key_past_its_ttl_is_forgotten_and_its_row_swept(db_url: str, pool: asyncpg.Pool) -> None:
    app = create_app(settings_for(db_url, idempotency_ttl_seconds=1))
    async with AsyncTestClient(app=app, timeout=30) as http:
        admin = AppHarness(http, app).admin
        key = {"Idempotency-Key": "once"}
        first = await admin.post("/tasks", {"id": "K1", "project": "p", "title": "t", "verification": None},
                                 headers=key)
        again = await admin.post("/tasks", {"id": "K1", "project": "p", "title": "t", "verification": None},
                                 headers=key)
        assert first.status_code == again.status_code == 201 and first.json() == again.json()
        other = await admin.post("/tasks", {"id": "K2", "project": "p", "title": "t", "verification": None},
                                 headers=key)
        assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
        await asyncio.sleep(1.3)
        later = await admin.post("/tasks", {"id": "K2", "project": "p", "title": "t", "verification": None},
                                 headers=key)
        assert later.status_code == 201 and later.json()["id"] == "K2"  # a new request, run anew
        await admin.post("/tasks", {"id": "K3", "project": "p", "title": "t", "verification": None},
                         headers={"Idempotency-Key": "another"})
        for _ in range(50):
            if await pool.fetchval("SELECT count(*) FROM idempotency_keys") == 0:
                break
            await asyncio.sleep(0.1)
        assert await pool.fetchval("SELECT count(*) FROM idempotency_keys") == 0
