"""Jobs over HTTP against a real PostgreSQL: lifecycle, progress and ETA, per-job
events, the cancel answers of the seed's failure-mode table, leases, validation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from taskledger.projections import jobs as projection
from tests.conftest import AppHarness, Client


async def _head(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT seq FROM log_head WHERE id = 1"))


async def _new_job(producer: Client, commands: list[str], **more: Any) -> str:
    body = await producer.ok(
        await producer.post("/jobs", {"commands": commands, "project": "p", **more}), 201
    )
    return str(body["job_id"])


def _reporter(runner: Client, job_id: str) -> Any:
    async def rep(ev: dict[str, Any], *codes: int) -> Any:
        return await runner.ok(await runner.post(f"/jobs/{job_id}/report", ev), *(codes or (200,)))

    return rep


async def _assert_view_is_fold_of_log(pool: asyncpg.Pool, job_id: str) -> None:
    async with pool.acquire() as c:
        stored = await projection.load(c, job_id)
        folded = await projection.replay(c, job_id)
    assert stored == folded


async def test_full_lifecycle_reports_stage_progress_eta_and_result(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["ruff check .", "pytest -q", "mypy ."])
    st = await producer.ok(await producer.get(f"/jobs/{jid}"))
    assert st["state"] == "pending" and st["stage"] == "init" and st["progress"] == 0
    assert st["eta_sec"] is None and st["elapsed_sec"] == 0 and st["total_commands"] == 3
    assert st["version"] == 1 and st["seq"] >= 1

    claimed = await runner.ok(await runner.post("/jobs/claim", {"lease_seconds": 60}), 200)
    assert claimed["job_id"] == jid and claimed["state"] == "running" and claimed["node"] == "n1"
    assert claimed["lease_id"] and claimed["lease_expires_at"] and claimed["attempt"] == 1
    rep = _reporter(runner, jid)
    await rep({"event": "stage", "stage": "sequential"})
    await rep({"event": "command_started", "command": "ruff check .", "index": 0, "total": 3})
    st = await rep({"event": "heartbeat"})
    assert (
        st["current_command"] == "ruff check ." and st["eta_sec"] is None and st["cancel_requested"] is False
    )
    await asyncio.sleep(0.3)
    st = await rep({"event": "command_completed", "command": "ruff check .", "exit_code": 0, "duration": 0.3})
    assert st["completed_commands"] == 1 and st["progress"] == 33.33 and st["current_command"] is None
    # eta = elapsed / completed x remaining
    assert st["eta_sec"] == pytest.approx(st["elapsed_sec"] * 2, abs=0.05) and st["eta_sec"] >= 0.5
    await rep({"event": "cache_hit", "command": "pytest -q"})
    await rep({"event": "command_started", "command": "mypy .", "index": 2})
    await rep({"event": "error", "error": "mypy: cache corrupt", "command": "mypy ."})
    await rep(
        {"event": "command_completed", "command": "mypy .", "exit_code": 1, "duration": 0.5, "index": 2}
    )
    await rep({"event": "stage", "stage": "completing"})
    end = await rep({"event": "finish", "status": "failed", "exit_code": 1, "result": {"log": "tail"}})
    assert end["state"] == "failed" and end["progress"] == 100 and end["eta_sec"] == 0
    assert end["result"] == {
        "status": "failed",
        "exit_code": 1,
        "completed_commands": 3,
        "failed_commands": ["mypy ."],
        "output": {"log": "tail"},
    }
    assert [c["state"] for c in end["commands"]] == ["succeeded", "cached", "failed"]
    assert end["error"] == "mypy .: mypy: cache corrupt"
    assert end["lease_expires_at"] is None
    elapsed = end["elapsed_sec"]
    await asyncio.sleep(0.2)
    assert (await producer.ok(await producer.get(f"/jobs/{jid}")))[
        "elapsed_sec"
    ] == elapsed  # frozen at the end

    evs = (await producer.ok(await producer.get(f"/jobs/{jid}/events", params={"since_seq": 0})))["events"]
    assert [e["stream_seq"] for e in evs] == list(range(1, len(evs) + 1))
    assert [e["type"] for e in evs] == [
        "job.created",
        "job.started",
        "job.stage",
        "job.command_started",
        "job.heartbeat",
        "job.command_completed",
        "job.cache_hit",
        "job.command_started",
        "job.error",
        "job.command_completed",
        "job.stage",
        "job.failed",
    ]
    assert all(e["stream"] == f"job:{jid}" and e["meta"]["project"] == "p" for e in evs)
    page = await producer.ok(await producer.get(f"/jobs/{jid}/events", params={"since_seq": 10}))
    assert [e["stream_seq"] for e in page["events"]] == [11, 12] and page["next_seq"] == 12
    assert (await producer.ok(await producer.get(f"/jobs/{jid}/events", params={"since_seq": 99})))[
        "events"
    ] == []
    assert (await pool.fetchval("SELECT count(*) FROM job_leases")) == 0
    await _assert_view_is_fold_of_log(pool, jid)


async def test_claim_is_fifo_once_each_and_204_when_none(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    a = await harness.client("worker", node="n1")
    b = await harness.client("worker", node="n2")
    first = await _new_job(producer, ["true"])
    second = await _new_job(producer, ["true"], project="other")
    third = await _new_job(producer, ["true"])
    got = await asyncio.gather(*(w.post("/jobs/claim", {"lease_seconds": 30}) for w in (a, b, a, b)))
    ids = sorted(r.json()["job_id"] for r in got if r.status_code == 200)
    assert ids == sorted([first, second, third]) and sorted(r.status_code for r in got) == [
        200,
        200,
        200,
        204,
    ]
    later = await _new_job(producer, ["true"], project="x")
    assert (await a.post("/jobs/claim", {"projects": ["y"]})).status_code == 204
    assert (await a.ok(await a.post("/jobs/claim", {"projects": ["x", "y"]})))["job_id"] == later


async def test_job_not_found_is_404_everywhere(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    for r in (
        await producer.get("/jobs/nope"),
        await producer.get("/jobs/nope/events"),
        await producer.post("/jobs/nope/cancel"),
        await runner.post("/jobs/nope/report", {"event": "heartbeat"}),
    ):
        assert r.status_code == 404 and r.json()["code"] == "job_not_found", r.text


async def test_cancel_answers_follow_the_failure_mode_table(harness: AppHarness, pool: asyncpg.Pool) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    # pending → cancelled at once; again → 409 job_already_cancelled
    pending = await _new_job(producer, ["true"])
    st = await producer.ok(await producer.post(f"/jobs/{pending}/cancel"), 200)
    assert st["state"] == "cancelled" and st["cancel_requested"] is True
    before = await _head(pool)
    r = await producer.post(f"/jobs/{pending}/cancel")
    assert r.status_code == 409 and r.json()["code"] == "job_already_cancelled"
    assert await _head(pool) == before
    # a cancelled job is never claimed
    assert (await runner.post("/jobs/claim", {})).status_code == 204

    # running → cancelling until the runner confirms; a second cancel changes nothing
    jid = await _new_job(producer, ["sleep 5", "true"])
    await runner.ok(await runner.post("/jobs/claim", {}), 200)
    rep = _reporter(runner, jid)
    await rep({"event": "command_started", "command": "sleep 5", "index": 0, "total": 2})
    st = await producer.ok(await producer.post(f"/jobs/{jid}/cancel"))
    assert st["state"] == "cancelling" and st["cancel_requested"] is True
    before = await _head(pool)
    assert (await producer.ok(await producer.post(f"/jobs/{jid}/cancel")))["state"] == "cancelling"
    assert await _head(pool) == before
    hb = await rep({"event": "heartbeat"})
    assert hb["state"] == "cancelling" and hb["cancel_requested"] is True
    end = await rep({"event": "finish", "status": "cancelled", "exit_code": -15})
    assert end["state"] == "cancelled" and end["commands"][0]["state"] == "interrupted"
    r = await producer.post(f"/jobs/{jid}/cancel")
    assert r.status_code == 409 and r.json()["code"] == "job_already_cancelled"
    # reports after the end are refused and write nothing
    before = await _head(pool)
    r = await runner.post(f"/jobs/{jid}/report", {"event": "heartbeat"})
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"
    assert await _head(pool) == before

    # finished → 200 with the final status, nothing written
    for status in ("completed", "failed"):
        done = await _new_job(producer, ["true"])
        await runner.ok(await runner.post("/jobs/claim", {}), 200)
        await _reporter(runner, done)(
            {"event": "finish", "status": status, "exit_code": 0 if status == "completed" else 2}
        )
        before = await _head(pool)
        again = await producer.post(f"/jobs/{done}/cancel")
        assert again.status_code == 200 and again.json()["state"] == status
        assert await _head(pool) == before


async def test_cancel_during_completion_ends_cancelled_and_keeps_what_the_runner_did(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["true"])
    await runner.ok(await runner.post("/jobs/claim", {}), 200)
    rep = _reporter(runner, jid)
    await rep({"event": "command_completed", "command": "true", "exit_code": 0, "duration": 0.01})
    await rep({"event": "stage", "stage": "completing"})
    assert (await producer.ok(await producer.post(f"/jobs/{jid}/cancel")))["state"] == "cancelling"
    end = await rep({"event": "finish", "status": "completed", "exit_code": 0})
    assert end["state"] == "cancelled" and end["progress"] == 100 and end["completed_commands"] == 1
    evs = (await producer.ok(await producer.get(f"/jobs/{jid}/events")))["events"]
    assert evs[-1]["type"] == "job.cancelled" and evs[-1]["data"]["runner_status"] == "completed"
    await _assert_view_is_fold_of_log(pool, jid)


async def test_only_the_lease_holder_may_report(harness: AppHarness, pool: asyncpg.Pool) -> None:
    producer = await harness.client("producer")
    holder = await harness.client("worker", node="n1")
    other_node = await harness.client("worker", node="n2")
    jid = await _new_job(producer, ["true"])
    r = await holder.post(f"/jobs/{jid}/report", {"event": "heartbeat"})
    assert r.status_code == 409 and r.json()["code"] == "invalid_transition"  # not claimed yet
    claimed = await holder.ok(await holder.post("/jobs/claim", {}), 200)
    before = await _head(pool)
    r = await other_node.post(f"/jobs/{jid}/report", {"event": "finish", "status": "completed"})
    assert r.status_code == 409 and r.json()["code"] == "lease_mismatch"
    r = await holder.post(f"/jobs/{jid}/report", {"event": "heartbeat", "lease_id": "not-the-lease"})
    assert r.status_code == 409 and r.json()["code"] == "lease_mismatch"
    r = await producer.post(f"/jobs/{jid}/report", {"event": "heartbeat"})
    assert r.status_code == 403
    assert await _head(pool) == before
    await _reporter(holder, jid)({"event": "heartbeat", "lease_id": claimed["lease_id"]})


async def test_a_job_lease_belongs_to_the_claiming_token_even_with_the_right_lease_id(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer = await harness.client("producer")
    holder = await harness.client("worker", node="n1", name="runner-a")
    twin = await harness.client("worker", node="n1", name="runner-a")  # same name and node, another token
    jid = await _new_job(producer, ["true"])
    claimed = await holder.ok(await holder.post("/jobs/claim", {}), 200)
    before = await _head(pool)
    for body in ({"event": "heartbeat", "lease_id": claimed["lease_id"]}, {"event": "heartbeat"},
                 {"event": "finish", "status": "completed", "lease_id": claimed["lease_id"]}):
        r = await twin.post(f"/jobs/{jid}/report", body)
        assert r.status_code == 409 and r.json()["code"] == "lease_mismatch", r.text
    assert await _head(pool) == before
    done = await _reporter(holder, jid)({"event": "finish", "status": "completed", "lease_id": claimed["lease_id"]})
    assert done["state"] == "completed"
    started = (await producer.ok(await producer.get(f"/jobs/{jid}/events")))["events"][1]
    assert started["type"] == "job.started" and started["data"]["token_id"]
    await _assert_view_is_fold_of_log(pool, jid)


async def test_a_jobs_times_are_the_logs_timestamps_and_it_ages_by_the_database_clock(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["sleep 1"])
    claimed = await runner.ok(await runner.post("/jobs/claim", {}), 200)
    events = (await producer.ok(await producer.get(f"/jobs/{jid}/events")))["events"]
    assert [e["type"] for e in events] == ["job.created", "job.started"]
    assert claimed["created_at"] == events[0]["recorded_at"]
    assert claimed["started_at"] == events[1]["recorded_at"]
    # Move the start back by an hour in the row only: a view computed from the
    # database's clock then reads an hour of elapsed time, whatever the app's clock says.
    await pool.execute(
        "UPDATE jobs SET body = jsonb_set(body, '{started_at}', to_jsonb((body->>'started_at')::float8 - 3600)) "
        "WHERE id = $1", jid,
    )
    db_now, started = await pool.fetchrow(
        "SELECT extract(epoch FROM statement_timestamp())::float8, (body->>'started_at')::float8 FROM jobs "
        "WHERE id = $1", jid,
    )
    seen = await producer.ok(await producer.get(f"/jobs/{jid}"))
    assert 3600 <= seen["elapsed_sec"] <= db_now - started + 5
    listed = (await producer.ok(await producer.get("/jobs", params={"project": "p"})))["jobs"]
    assert next(j for j in listed if j["job_id"] == jid)["elapsed_sec"] >= 3600


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"commands": []},
        {"commands": [""]},
        {"commands": ["   "]},
        {"commands": "true"},
        {"commands": [1]},
        {"commands": ["true"], "extra": 1},
        {"commands": ["x" * 8193]},
        {"commands": ["true"] * 1001},
        {"commands": ["true"], "project": ""},
        {"commands": ["true"], "job_id": "has space"},
        {"commands": ["true"], "parallel": "yes"},
        {"commands": ["true"], "command_timeout_seconds": 0},
        {"commands": ["true"], "command_timeout_seconds": -5},
        {"commands": ["true"], "command_timeout_seconds": "soon"},
        {"commands": ["true"], "command_timeout_seconds": 7 * 24 * 3600 + 1},
    ],
)
async def test_invalid_jobs_are_400_and_write_nothing(
    harness: AppHarness, pool: asyncpg.Pool, body: Any
) -> None:
    producer = await harness.client("producer")
    before = await _head(pool)
    r = await producer.post("/jobs", body)
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    assert await _head(pool) == before


@pytest.mark.parametrize(
    "report",
    [
        {"event": "nope"},
        {"event": "stage", "stage": "lunch"},
        {"event": "stage"},
        {"event": "command_started"},
        {"event": "command_started", "command": "not a command of this job"},
        {"event": "command_started", "command": "b", "index": 0},
        {"event": "command_started", "command": "a", "index": 7},
        {"event": "command_started", "command": "a", "total": 9},
        {"event": "command_completed", "command": "a", "exit_code": 0},
        {"event": "command_completed", "command": "a", "duration": 1},
        {"event": "command_completed", "command": "a", "exit_code": 0, "duration": -1},
        {"event": "heartbeat", "exit_code": 1},
        {"event": "heartbeat", "surprise": 1},
        {"event": "heartbeat", "output": "x"},
        {"event": "finish", "status": "completed", "timed_out": True},
        {"event": "command_completed", "command": "a", "exit_code": 0, "duration": 1, "timed_out": True},
        {"event": "command_completed", "command": "a", "exit_code": 1, "duration": 1, "output": "x" * 16385},
        {"event": "command_completed", "command": "a", "exit_code": 1, "duration": 1, "timed_out": "yes"},
        {"event": "error"},
        {"event": "finish"},
        {"event": "finish", "status": "exploded"},
    ],
)
async def test_invalid_reports_are_400_and_write_nothing(
    harness: AppHarness, pool: asyncpg.Pool, report: Any
) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["a", "b"])
    await runner.ok(await runner.post("/jobs/claim", {}), 200)
    before = await _head(pool)
    r = await runner.post(f"/jobs/{jid}/report", report)
    assert r.status_code == 400 and r.json()["code"] == "validation_error", r.text
    assert await _head(pool) == before


async def test_bad_ids_cursors_and_claims_are_400(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    assert (await producer.get("/jobs/" + "x" * 129)).status_code == 400
    assert (await producer.post("/jobs/a%20b/cancel")).status_code == 400
    jid = await _new_job(producer, ["true"])
    for bad in ("-1", "abc", "1.5"):
        assert (await producer.get(f"/jobs/{jid}/events", params={"since_seq": bad})).status_code == 400
    for body in (
        {"lease_seconds": 0},
        {"lease_seconds": 3601},
        {"lease_seconds": "x"},
        {"nope": 1},
        {"projects": []},
    ):
        r = await runner.post("/jobs/claim", body)
        assert r.status_code == 400, (body, r.text)
    assert (
        await producer.post("/jobs", {"commands": ["true"]}, params={"timeout": "-1", "wait": "true"})
    ).status_code == 400
    assert (
        await producer.post("/jobs", {"commands": ["true"]}, params={"timeout": "301", "wait": "true"})
    ).status_code == 400


async def test_client_chosen_id_conflicts_and_idempotency_key(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    await producer.ok(await producer.post("/jobs", {"commands": ["true"], "job_id": "J-1"}), 201)
    r = await producer.post("/jobs", {"commands": ["true"], "job_id": "J-1"})
    assert r.status_code == 409 and r.json()["code"] == "already_exists"
    key = {"Idempotency-Key": "create-once"}
    one = await producer.ok(await producer.post("/jobs", {"commands": ["true"]}, headers=key), 201)
    two = await producer.ok(await producer.post("/jobs", {"commands": ["true"]}, headers=key), 201)
    assert one["job_id"] == two["job_id"]


async def test_roles(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    reader = await harness.client("reader")
    runner = await harness.client("worker", node="n1")
    assert (await reader.post("/jobs", {"commands": ["true"]})).status_code == 403
    jid = await _new_job(producer, ["true"])
    assert (await reader.post(f"/jobs/{jid}/cancel")).status_code == 403
    assert (await runner.post(f"/jobs/{jid}/cancel")).status_code == 403  # starting one is not cancelling
    assert (await producer.post("/jobs/claim", {})).status_code == 403
    assert (await reader.ok(await reader.get(f"/jobs/{jid}")))["job_id"] == jid
    listed = await reader.ok(await reader.get("/jobs", params={"state": "pending"}))
    assert [j["job_id"] for j in listed["jobs"]] == [jid]


async def test_wait_true_answers_with_the_current_status_at_the_timeout(harness: AppHarness) -> None:
    # (waiting for the end is tested against a real server: tests/e2e/test_jobs_runner.py)
    producer = await harness.client("producer")
    t0 = time.monotonic()
    r = await producer.post("/jobs", {"commands": ["true"]}, params={"wait": "true", "timeout": "0.5"})
    assert r.status_code == 201 and r.json()["state"] == "pending"
    assert 0.5 <= time.monotonic() - t0 < 3


async def test_runner_that_stops_heartbeating_fails_the_job(harness: AppHarness, pool: asyncpg.Pool) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["sleep 100"])
    await runner.ok(await runner.post("/jobs/claim", {"lease_seconds": 1}), 200)
    rep = _reporter(runner, jid)
    await rep({"event": "command_started", "command": "sleep 100"})
    await asyncio.sleep(0.6)
    await rep({"event": "heartbeat"})  # renews the lease
    await asyncio.sleep(0.6)
    assert (await producer.ok(await producer.get(f"/jobs/{jid}")))["state"] == "running"
    # the app's own sweeper (every 0.2 s in tests) ends it once the lease lapses
    deadline = time.monotonic() + 10
    while (st := await producer.ok(await producer.get(f"/jobs/{jid}")))["state"] == "running":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert st["state"] == "failed" and "stopped heartbeating" in st["error"]
    assert st["commands"][0]["state"] == "interrupted"
    evs = (await producer.ok(await producer.get(f"/jobs/{jid}/events")))["events"]
    assert evs[-1]["type"] == "job.failed" and evs[-1]["data"]["reason"] == "heartbeat_timeout"
    assert evs[-1]["meta"]["actor"] == "taskledger-sweeper"
    assert [e["type"] for e in evs].count("job.failed") == 1
    r = await runner.post(f"/jobs/{jid}/report", {"event": "heartbeat"})
    assert r.status_code == 409  # the runner learns its job is gone
    assert (await pool.fetchval("SELECT count(*) FROM job_leases")) == 0


async def test_cancelling_job_whose_runner_vanished_ends_cancelled(harness: AppHarness) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["sleep 100"])
    await runner.ok(await runner.post("/jobs/claim", {"lease_seconds": 1}), 200)
    await producer.ok(await producer.post(f"/jobs/{jid}/cancel"))
    deadline = time.monotonic() + 10
    while (st := await producer.ok(await producer.get(f"/jobs/{jid}")))["state"] == "cancelling":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert st["state"] == "cancelled" and "stopped heartbeating" in st["error"]


async def test_a_worker_may_start_a_job_and_the_job_records_who_did(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    # seed 001: a checker starts its own asynchronous verification run
    checker = await harness.client("worker", node="check-node", name="checker-7")
    created = await checker.ok(await checker.post("/jobs", {"commands": ["pytest -q"], "project": "p"}), 201)
    assert created["state"] == "pending"
    assert created["created_by"] == {"name": "checker-7", "role": "worker", "node": "check-node"}
    producer = await harness.client("producer", name="orchestrator")
    by_producer = await _new_job(producer, ["true"])
    seen = await producer.ok(await producer.get(f"/jobs/{by_producer}"))
    assert seen["created_by"] == {"name": "orchestrator", "role": "producer", "node": None}
    evs = (await checker.ok(await checker.get(f"/jobs/{created['job_id']}/events")))["events"]
    assert evs[0]["data"]["created_by"] == created["created_by"]
    assert evs[0]["meta"]["actor"] == "checker-7" and evs[0]["meta"]["role"] == "worker"
    await _assert_view_is_fold_of_log(pool, created["job_id"])


async def test_command_output_and_timeout_reach_the_event_and_the_view(
    harness: AppHarness, pool: asyncpg.Pool
) -> None:
    producer = await harness.client("producer")
    runner = await harness.client("worker", node="n1")
    jid = await _new_job(producer, ["make test", "sleep 999", "true"], command_timeout_seconds=1.5, fail_fast=True)
    claimed = await runner.ok(await runner.post("/jobs/claim", {}), 200)
    assert claimed["job_id"] == jid and claimed["command_timeout_seconds"] == 1.5
    rep = _reporter(runner, jid)
    await rep({"event": "command_completed", "command": "make test", "exit_code": 0, "duration": 0.2,
               "output": "ok: 12 passed\n", "output_truncated": False})
    st = await rep({"event": "command_completed", "command": "sleep 999", "exit_code": 124, "duration": 1.5,
                    "output": "", "timed_out": True})
    assert [(c["state"], c["exit_code"], c["output"], c["timed_out"]) for c in st["commands"]] == [
        ("succeeded", 0, "ok: 12 passed\n", False),
        ("failed", 124, "", True),
        ("pending", None, None, False),
    ]
    await rep({"event": "command_skipped", "command": "true", "reason": "fail_fast"})
    end = await rep({"event": "finish", "status": "failed", "exit_code": 124})
    assert end["result"]["timed_out_commands"] == ["sleep 999"] and end["exit_code"] == 124
    done = [e["data"] for e in (await producer.ok(await producer.get(f"/jobs/{jid}/events")))["events"]
            if e["type"] == "job.command_completed"]
    assert done[0]["output"] == "ok: 12 passed\n" and done[0]["timed_out"] is False
    assert done[1]["timed_out"] is True and done[1]["exit_code"] == 124
    await _assert_view_is_fold_of_log(pool, jid)
