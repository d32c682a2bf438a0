"""The reference worker at --concurrency above 1, a real process against a real
server: it claims and starts in one request, reports completions (and verdicts)
in batches, keeps every result when a batch is refused, and keeps heartbeating
the tasks that run long."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, ServerProcess
from tests.e2e.test_metrics import Samples, scrape
from tests.e2e.test_reference_worker import run_worker


def _project() -> str:
    return "wb-" + uuid.uuid4().hex[:8]


def requests(samples: Samples, route: str, status: str | None = None) -> int:
    """POSTs the service answered on `route` (a route template), with `status` if given."""
    return int(sum(v for lbl, v in samples.get("taskledger_http_requests_total", [])
                   if lbl["method"] == "POST" and lbl["route"] == route and status in (None, lbl["status"])))


def _create(server: ServerProcess, token: str, tasks: list[dict[str, Any]]) -> None:
    with server.client(token) as c:
        r = c.post("/tasks/batch", json={"tasks": tasks})
        assert r.status_code == 201, r.text


def _views(server: ServerProcess, token: str, ids: list[str]) -> list[dict[str, Any]]:
    with server.client(token) as c:
        return [c.get(f"/tasks/{i}").json() for i in ids]


def _types(server: ServerProcess, token: str, task_id: str) -> list[str]:
    with server.client(token) as c:
        return [e["type"] for e in c.get(f"/tasks/{task_id}/events").json()["events"]]


def _lines(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_at_concurrency_8_every_task_ends_completed_with_its_result_through_batch_requests(
        server: ServerProcess) -> None:
    proj = _project()
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    ids = [f"{proj}-{i}" for i in range(20)]
    _create(server, producer, [{"id": i, "project": proj, "title": "t", "spec": "echo out-$TASKLEDGER_TASK_ID",
                                "verification": None} for i in ids])
    log = run_worker(server, maker, "--projects", proj, "--concurrency", "8")
    views = _views(server, producer, ids)
    assert [v["state"] for v in views] == ["completed"] * 20, log
    assert [v["result"]["output"].strip() for v in views] == [f"out-{i}" for i in ids]
    assert all(v["result"]["exit_code"] == 0 and v["attempt"] == 1 for v in views)
    for i in ids:  # each task's log as the single routes write it
        assert _types(server, producer, i) == ["task.created", "task.claimed", "task.started", "task.completed"]
    assert sorted(x["task"] for x in _lines(log) if x.get("event") == "completed" and x["status"] == 200) == sorted(ids)

    samples, _ = scrape(server.base)
    assert requests(samples, "/tasks/claim/batch", "200") >= 3  # 8 slots, 20 tasks
    assert requests(samples, "/tasks/claim") == 0
    assert requests(samples, "/tasks/{task_id}/start") == 0  # the claims started them
    batches = requests(samples, "/tasks/complete/batch", "200")
    singles = requests(samples, "/tasks/{task_id}/complete", "200")
    assert batches >= 1 and batches + singles < 20, (batches, singles)  # fewer reports than tasks
    assert requests(samples, "/tasks/complete/batch") == batches  # none refused


def test_checkers_at_concurrency_8_report_their_verdicts_in_batches(server: ServerProcess, tmp_path: Path) -> None:
    proj = _project()
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    checker = server.token("worker", node="node-b")
    ids = [f"{proj}-{i}" for i in range(10)]
    failing = set(ids[3:5])
    _create(server, producer, [{
        "id": i, "project": proj, "title": "t", "spec": f"touch {tmp_path}/$TASKLEDGER_TASK_ID",
        "requirements": [{"id": "R1", "text": "built", "check": f"test -f {tmp_path}/{i}"},
                         {"id": "R2", "text": "right", "check": "exit 3" if i in failing else "true"}]}
        for i in ids])
    run_worker(server, maker, "--projects", proj, "--types", "implement", "--concurrency", "8")
    assert [v["state"] for v in _views(server, producer, ids)] == ["verifying"] * 10
    made, _ = scrape(server.base)

    log = run_worker(server, checker, "--projects", proj, "--types", "verify", "--concurrency", "8")
    views = _views(server, producer, ids)
    assert [v["state"] for v in views if v["id"] not in failing] == ["verified"] * 8, log
    for v in views:
        if v["id"] in failing:  # sent back with the failing check's reason
            assert v["state"] == "pending" and v["attempt"] == 2
            assert [n["requirement_id"] for n in v["rework_notes"]] == ["R2"]
            assert "exited 3" in v["rework_notes"][0]["reason"]
        else:
            [record] = v["verdicts"]
            assert record["outcome"] == "PASS"
            assert {(d["requirement_id"], d["verdict"]) for d in record["verdicts"]} == {("R1", "PASS"), ("R2", "PASS")}
    checked, _ = scrape(server.base)
    batches = requests(checked, "/tasks/complete/batch", "200") - requests(made, "/tasks/complete/batch", "200")
    singles = (requests(checked, "/tasks/{task_id}/complete", "200")
               - requests(made, "/tasks/{task_id}/complete", "200"))
    assert batches >= 1 and batches + singles < 10, (batches, singles)
    assert requests(checked, "/tasks/{task_id}/start") == 0
    outcomes = sorted(x["outcome"] for x in _lines(log) if x.get("event") == "verified" and x["status"] == 200)
    assert outcomes == ["FAIL"] * 2 + ["PASS"] * 8


def test_a_refused_batch_loses_no_result_and_leaves_no_lease_behind(server: ServerProcess, tmp_path: Path) -> None:
    # Eight tasks wait for one file, so all eight finish together and go in one
    # batch (a long window, and the batch is sent once all eight have finished);
    # one of them is cancelled while it runs, so the service refuses that batch.
    proj = _project()
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    go = tmp_path / "go"
    ids = [f"{proj}-{i}" for i in range(8)]
    _create(server, producer, [{
        "id": i, "project": proj, "title": "t", "verification": None,
        "spec": f"while [ ! -e {go} ]; do sleep 0.05; done; echo done-$TASKLEDGER_TASK_ID"} for i in ids])
    env = dict(os.environ, TASKLEDGER_URL=server.base, TASKLEDGER_TOKEN=maker)
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskledger.service.cli", "worker", "--once", "--projects", proj,
         "--concurrency", "8", "--lease-seconds", "60", "--report-window", "10"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while [v["state"] for v in _views(server, producer, ids)] != ["running"] * 8:
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never started all eight"
            time.sleep(0.1)
        victim = ids[5]
        with server.client(producer) as c:
            r = c.post(f"/tasks/{victim}/cancel", json={"reason": "changed my mind"})
            assert r.status_code == 200, r.text
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err

    views = {v["id"]: v for v in _views(server, producer, ids)}
    assert views.pop(victim)["state"] == "cancelled"
    assert [v["state"] for v in views.values()] == ["completed"] * 7, out
    assert [v["result"]["output"].strip() for v in views.values()] == [f"done-{i}" for i in views]
    with server.client(producer) as c:  # nothing still held: no lease left running
        held = [t["id"] for s in ("claimed", "running") for t in
                c.get("/tasks", params={"project": proj, "state": s}).json()["tasks"]]
    assert held == []

    [refused] = [x for x in _lines(out) if x.get("event") == "batch_refused"]
    assert sorted(refused["tasks"]) == sorted(ids) and refused["status"] == 409
    assert refused["tasks"][refused["index"]] == victim
    samples, _ = scrape(server.base)
    assert requests(samples, "/tasks/complete/batch", "409") == 1
    assert requests(samples, "/tasks/complete/batch", "200") == 0
    assert requests(samples, "/tasks/{task_id}/complete", "200") == 7  # the others, one by one
    assert requests(samples, "/tasks/{task_id}/complete", "409") == 1  # and the victim's own refusal
    reports = {x["task"]: x["status"] for x in _lines(out) if x.get("event") == "completed"}
    assert reports == {**dict.fromkeys(views, 200), victim: 409}


def test_heartbeats_keep_a_slow_task_while_the_quick_ones_report_in_a_batch(server: ServerProcess) -> None:
    proj = _project()
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    quick = [f"{proj}-q{i}" for i in range(4)]
    slow = f"{proj}-slow"
    _create(server, producer, [
        {"id": slow, "project": proj, "title": "t", "spec": "sleep 7", "verification": None, "priority": 1},
        *({"id": i, "project": proj, "title": "t", "spec": "true", "verification": None} for i in quick)])
    # the lease is 5 s and the sweeper expires a lapsed one within 0.2 s: the
    # slow task outlives its lease unless the worker heartbeats it
    log = run_worker(server, maker, "--projects", proj, "--concurrency", "8", "--lease-seconds", "5")
    views = _views(server, producer, [slow, *quick])
    assert [(v["state"], v["attempt"]) for v in views] == [("completed", 1)] * 5, log
    assert "task.lease_expired" not in _types(server, producer, slow)
    samples, _ = scrape(server.base)
    assert requests(samples, "/tasks/{task_id}/heartbeat", "200") >= 3
    assert requests(samples, "/tasks/complete/batch", "200") >= 1  # the quick ones did not wait for the slow one
    lines = [x for x in _lines(log) if x.get("event") == "completed"]
    assert lines[-1]["task"] == slow and len(lines) == 5
