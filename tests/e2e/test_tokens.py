"""Tokens: ids, expiry, listing without secrets, revocation felt everywhere within a second."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ADMIN_TOKEN, ROOT, AppHarness, ServerProcess


async def _create(h: AppHarness, **body: Any) -> dict[str, Any]:
    body = {"role": "reader", "name": "t", **body}
    r = await h.admin.post("/tokens", body)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


async def test_a_new_token_answers_its_id_and_the_list_never_shows_a_secret(harness: AppHarness) -> None:
    made = await _create(harness, role="worker", name="w1", node="n1", expires_in_seconds=3600)
    assert set(made) >= {"id", "token", "name", "role", "node", "expires_at"}
    assert made["expires_at"] is not None
    listed = (await harness.admin.get("/tokens")).json()["tokens"]
    mine = next(t for t in listed if t["id"] == made["id"])
    assert mine == {"id": made["id"], "name": "w1", "role": "worker", "node": "n1",
                    "created_at": mine["created_at"], "expires_at": mine["expires_at"], "revoked_at": None}
    text = (await harness.admin.get("/tokens")).text
    assert made["token"] not in text and "token_hash" not in text
    reader = await harness.client("reader")
    assert (await reader.get("/tokens")).status_code == 403
    assert (await reader.http.delete(f"/tokens/{made['id']}", headers=reader.headers)).status_code == 403


async def test_a_revoked_token_is_refused_at_once_with_www_authenticate(harness: AppHarness) -> None:
    made = await _create(harness)
    headers = {"Authorization": f"Bearer {made['token']}"}
    assert (await harness.http.get("/events", headers=headers)).status_code == 200  # now cached
    r = await harness.http.delete(f"/tokens/{made['id']}", headers=harness.admin.headers)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    await asyncio.sleep(1.0)
    r = await harness.http.get("/events", headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    again = await harness.http.delete(f"/tokens/{made['id']}", headers=harness.admin.headers)
    assert again.json()["revoked_at"] == r.json().get("revoked_at", again.json()["revoked_at"])
    missing = await harness.http.delete("/tokens/999999", headers=harness.admin.headers)
    assert missing.status_code == 404 and missing.json()["code"] == "token_not_found"


async def test_an_expired_token_is_refused_even_from_the_cache(harness: AppHarness) -> None:
    made = await _create(harness, expires_in_seconds=1)
    headers = {"Authorization": f"Bearer {made['token']}"}
    assert (await harness.http.get("/events", headers=headers)).status_code == 200
    await asyncio.sleep(1.2)
    assert (await harness.http.get("/events", headers=headers)).status_code == 401


async def test_401s_count_as_401_in_the_metrics(harness: AppHarness) -> None:
    await harness.anonymous().get("/events")
    text = (await harness.anonymous().get("/metrics")).text
    lines = [ln for ln in text.splitlines() if ln.startswith("taskledger_http_requests_total{")]
    assert any('status="401"' in ln for ln in lines), lines
    assert not any('status="500"' in ln for ln in lines), lines


def test_a_revocation_reaches_every_replica_within_a_second_and_ends_its_streams(db_url: str) -> None:
    a, b = ServerProcess(db_url).start(), ServerProcess(db_url).start()
    try:
        secret = a.token("reader")
        with a.client() as admin:
            tid = next(t["id"] for t in admin.get("/tokens").json()["tokens"] if t["revoked_at"] is None
                       and t["role"] == "reader")
        headers = {"Authorization": f"Bearer {secret}"}
        for s in (a, b):
            assert httpx.get(s.base + "/events", headers=headers).status_code == 200
        ended: list[float] = []

        def follow() -> None:
            with httpx.stream("GET", b.base + "/stream", headers=headers, params={"since_seq": 0},
                              timeout=30) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
            ended.append(time.monotonic())

        import threading

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        time.sleep(0.5)
        revoked_at = time.monotonic()
        with a.client() as admin:
            assert admin.delete(f"/tokens/{tid}").status_code == 200
        refused = {}
        deadline = time.monotonic() + 5
        while len(refused) < 2 and time.monotonic() < deadline:
            for s in (a, b):
                if s.base not in refused and httpx.get(s.base + "/events", headers=headers).status_code == 401:
                    refused[s.base] = time.monotonic() - revoked_at
            time.sleep(0.05)
        assert len(refused) == 2 and max(refused.values()) < 1.0, refused
        t.join(timeout=15)  # one keep-alive is 15 s; the revalidation ends it far sooner
        assert ended and ended[0] - revoked_at < 3.0
        other = a.token("reader")
        with a.client() as admin:
            oid = next(t["id"] for t in admin.get("/tokens").json()["tokens"] if t["revoked_at"] is None)
        out = subprocess.run([sys.executable, "-m", "taskledger.service.cli", "token", "revoke", oid, "--database-url",
                              db_url], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0 and f"revoked token {oid}" in out.stdout, out.stderr
        listed = subprocess.run([sys.executable, "-m", "taskledger.service.cli", "token", "list", "--json",
                                 "--database-url", db_url], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                check=False)
        assert listed.returncode == 0 and secret not in listed.stdout and other not in listed.stdout
        rows = [json.loads(ln) for ln in listed.stdout.splitlines()]
        assert {r["id"] for r in rows} == {tid, oid} and all(r["revoked_at"] for r in rows)
        time.sleep(1.0)
        assert httpx.get(b.base + "/events", headers={"Authorization": f"Bearer {other}"}).status_code == 401
    finally:
        a.stop()
        b.stop()


def test_the_reference_worker_and_runner_hide_taskledger_credentials_from_commands(
    server: ServerProcess, tmp_path: Path
) -> None:
    worker = server.token("worker", node="n1")
    seen_by_spec, seen_by_job = tmp_path / "spec.env", tmp_path / "job.env"
    with server.client() as c:
        r = c.post("/tasks", json={"id": "leak", "project": "env", "title": "t", "verification": None,
                                   "spec": f"env > {seen_by_spec}"})
        assert r.status_code == 201, r.text
        r = c.post("/jobs", json={"project": "env", "commands": [f"env > {seen_by_job}"]})
        assert r.status_code == 201, r.text
    env = dict(os.environ, TASKLEDGER_URL=server.base, TASKLEDGER_TOKEN=worker,
               TASKLEDGER_DATABASE_URL="postgresql://secret@db/x", TASKLEDGER_ADMIN_TOKEN=ADMIN_TOKEN)
    for prog in ("worker", "runner"):
        out = subprocess.run([sys.executable, "-m", "taskledger.service.cli", prog, "--once"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
    for seen in (seen_by_spec, seen_by_job):
        text = seen.read_text()
        assert "PATH=" in text  # the command did run with an environment
        assert worker not in text and ADMIN_TOKEN not in text and "secret@db" not in text
    assert "TASKLEDGER_TASK_ID=leak" in seen_by_spec.read_text()


async def test_concurrent_worker_tokens_with_one_name_on_different_nodes_admit_exactly_one(
        harness: AppHarness) -> None:
    rs = await asyncio.gather(*[
        harness.admin.post("/tokens", {"role": "worker", "name": "racer", "node": f"node-{i}"})
        for i in range(8)])
    assert sorted(r.status_code for r in rs) == [201] + [409] * 7
    # an expired or revoked twin no longer holds the name
    await _create(harness, role="worker", name="short", node="n-a", expires_in_seconds=1)
    assert (await harness.admin.post("/tokens", {"role": "worker", "name": "short", "node": "n-b"})).status_code == 409
    await asyncio.sleep(1.2)
    assert (await harness.admin.post("/tokens", {"role": "worker", "name": "short", "node": "n-b"})).status_code == 201
