"""Helpers that speak the worker protocol through the in-process client."""

from __future__ import annotations

import uuid
from typing import Any

from tests.conftest import Client


def project() -> str:
    return "p-" + uuid.uuid4().hex[:10]


def new_id(prefix: str = "T") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def create_task(producer: Client, proj: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": new_id(), "project": proj, "title": "t", "spec": "do it",
                            "task_type": "implement", "requirements": [{"id": "R1", "text": "works"}]}
    body.update(fields)
    return await producer.ok(await producer.post("/tasks", json=body), 201)


async def claim(worker: Client, proj: str, task_types: list[str]) -> dict[str, Any] | None:
    r = await worker.post("/tasks/claim", {"task_types": task_types, "projects": [proj], "lease_seconds": 60})
    if r.status_code == 204:
        return None
    return await worker.ok(r, 200)


async def start(worker: Client, t: dict[str, Any]) -> dict[str, Any]:
    return await worker.ok(await worker.post(f"/tasks/{t['id']}/start", {"lease_id": t["lease_id"]}))


async def complete_impl(worker: Client, t: dict[str, Any]) -> dict[str, Any]:
    await start(worker, t)
    return await worker.ok(await worker.post(
        f"/tasks/{t['id']}/complete", {"lease_id": t["lease_id"], "result": {"ok": True}}))


async def complete_verify(worker: Client, t: dict[str, Any], outcome: str = "PASS", category: str | None = None,
                          verdicts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    await start(worker, t)
    if verdicts is None:
        verdicts = [{"requirement_id": "R1", "verdict": "FAIL" if outcome == "FAIL" else "PASS", "reason": "checked"}]
    body: dict[str, Any] = {"lease_id": t["lease_id"], "outcome": outcome, "verdicts": verdicts}
    if category:
        body["category"] = category
    return await worker.ok(await worker.post(f"/tasks/{t['id']}/complete", body))


async def make(producer: Client, maker: Client, proj: str, **fields: Any) -> dict[str, Any]:
    task = await create_task(producer, proj, **fields)
    t = await claim(maker, proj, ["implement"])
    assert t is not None and t["id"] == task["id"], f"maker could not claim {task['id']}: {t}"
    return await complete_impl(maker, t)


async def view(api: Client, task_id: str, **params: Any) -> dict[str, Any]:
    return await api.ok(await api.get(f"/tasks/{task_id}", params=params))


async def types_of(api: Client, task_id: str) -> list[str]:
    body = await api.ok(await api.get(f"/tasks/{task_id}/events", params={"since_seq": 0}))
    return [e["type"] for e in body["events"]]
