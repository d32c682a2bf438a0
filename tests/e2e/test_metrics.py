"""GET /metrics of a real server, parsed with prometheus-client's own parser."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from contextlib import ExitStack

import httpx
from prometheus_client.parser import text_string_to_metric_families

from taskledger.client import Client, CreateTask, Requirement, Verdict
from tests.conftest import ServerProcess

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(base: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by name, and every family's type."""
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    found = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def maker_checker_loop(server: ServerProcess, project: str, stack: ExitStack) -> None:
    producer = Client(server.base, server.token("producer"))
    maker = Client(server.base, server.token("worker", node="node-a"))
    checker = Client(server.base, server.token("worker", node="node-b"))
    for c in (producer, maker, checker):
        stack.callback(c.close)
    for n, outcome in enumerate(["PASS", "FAIL"]):
        producer.create_task(CreateTask(id=f"{project}-{n}", project=project, title="write hello",
                                        requirements=[Requirement(id="R1", text="the file says hello")]))
        t = maker.claim(task_types=["implement"], projects=[project])
        assert t is not None
        maker.start(t.id, t.lease_id)
        maker.complete(t.id, t.lease_id, result={"wrote": "hello.txt"})
        v = checker.claim(task_types=["verify"], projects=[project])
        assert v is not None
        checker.start(v.id, v.lease_id)
        checker.complete(v.id, v.lease_id, outcome=outcome,
                         verdicts=[Verdict(requirement_id="R1", verdict=outcome, reason="read it")])


def run_jobs(server: ServerProcess, project: str, stack: ExitStack) -> None:
    """One job completes after a second, one is cancelled while pending."""
    producer = stack.enter_context(server.client(server.token("producer")))
    runner = stack.enter_context(server.client(server.token("worker", node="node-r")))
    done = producer.post("/jobs", json={"commands": ["true"], "project": project})
    assert done.status_code == 201, done.text
    claimed = runner.post("/jobs/claim", json={"projects": [project]}).json()
    assert claimed["job_id"] == done.json()["job_id"]
    time.sleep(1.1)
    end = runner.post(f"/jobs/{claimed['job_id']}/report",
                      json={"event": "finish", "status": "completed", "exit_code": 0, "lease_id": claimed["lease_id"]})
    assert end.status_code == 200 and end.json()["state"] == "completed", end.text
    cancelled = producer.post("/jobs", json={"commands": ["true"], "project": project}).json()["job_id"]
    assert producer.post(f"/jobs/{cancelled}/cancel").json()["state"] == "cancelled"


def test_metrics_after_a_maker_checker_loop_count_requests_batches_verdicts_jobs_and_states(
    server: ServerProcess,
) -> None:
    project = "m-" + uuid.uuid4().hex[:8]
    with ExitStack() as stack:
        maker_checker_loop(server, project, stack)
        run_jobs(server, project, stack)
    assert httpx.get(server.base + "/tasks", timeout=5).status_code == 401
    samples, types = scrape(server.base)

    # HTTP, by route template and status; the 401 counted as 401
    assert types["taskledger_http_requests"] == "counter"
    assert types["taskledger_http_request_seconds"] == "histogram"
    assert value(samples, "taskledger_http_requests_total", method="POST", route="/tasks/claim", status="200") == 4
    assert value(samples, "taskledger_http_requests_total", method="GET", route="/tasks", status="401") == 1
    assert value(samples, "taskledger_http_request_seconds_count", method="POST", route="/tasks/claim") == 4
    routes = {lbl["route"] for lbl, _ in samples["taskledger_http_requests_total"]}
    assert "/tasks/{task_id}/complete" in routes and not any("-0" in r for r in routes), routes

    # the writer: every committed command in a batch, and its latency
    commands = value(samples, "taskledger_writer_commands_total")
    assert commands >= 2 * 7 + 5  # each task: create, 2 claims, 2 starts, 2 completes; the jobs: 5
    assert value(samples, "taskledger_writer_batch_size_sum") == commands
    commits = value(samples, "taskledger_writer_commits_total")
    assert value(samples, "taskledger_writer_batch_size_count") == commits
    assert value(samples, "taskledger_writer_batch_seconds_count") == commits
    assert value(samples, "taskledger_writer_batch_seconds_sum") > 0
    assert value(samples, "taskledger_writer_queue_depth") == 0

    # verdicts by checker, counted where task.verdict was appended
    assert value(samples, "taskledger_verdicts_total", checker="verifier", outcome="PASS") == 1
    assert value(samples, "taskledger_verdicts_total", checker="verifier", outcome="FAIL") == 1

    # jobs (seed 001): created, completed, cancelled, durations
    assert value(samples, "taskledger_jobs_created_total") == 2
    assert value(samples, "taskledger_jobs_completed_total") == 1
    assert value(samples, "taskledger_jobs_cancelled_total") == 1
    assert value(samples, "taskledger_jobs_failed_total") == 0
    assert types["taskledger_job_duration_seconds"] == "histogram"
    assert value(samples, "taskledger_job_duration_seconds_count", state="completed") == 1
    assert 1.0 <= value(samples, "taskledger_job_duration_seconds_sum", state="completed") < 30
    assert value(samples, "taskledger_job_duration_seconds_bucket", state="completed", le="1.0") == 0

    # tasks and jobs by state, as the projection has them
    with server.client() as admin:
        tasks = admin.get("/tasks", params={"limit": 500}).json()["tasks"]
    by_state = Counter(t["state"] for t in tasks)
    assert {lbl["state"]: v for lbl, v in samples["taskledger_tasks"]} == by_state
    assert by_state["verified"] == 1 and sum(by_state.values()) == 4  # 2 makers' tasks, 2 verifiers
    assert {lbl["state"]: v for lbl, v in samples["taskledger_jobs"]} == {"completed": 1, "cancelled": 1}

    # projection lag, SSE and the tailer
    lags = {lbl["projection"]: v for lbl, v in samples["taskledger_projection_lag_events"]}
    assert lags and all(v >= 0 for v in lags.values()), lags
    for name in ("taskledger_sse_subscribers", "taskledger_sse_streams_open", "taskledger_sse_tailer_lag_events",
                 "taskledger_sse_send_timeouts_total"):
        assert value(samples, name) >= 0
    assert value(samples, "taskledger_sse_streams_refused_total", reason="capacity") == 0


def test_tasks_by_state_are_cached_for_a_short_while(server: ServerProcess) -> None:
    """One read of the views serves scrapes within `metrics_cache_seconds` (5 s by default)."""
    before, _ = scrape(server.base)
    with Client(server.base, server.token("producer")) as producer:
        producer.create_task(CreateTask(id="c-" + uuid.uuid4().hex[:8], project="cache", title="t"))
    soon, _ = scrape(server.base)
    assert soon.get("taskledger_tasks") == before.get("taskledger_tasks")


def _pending(samples: Samples) -> float:
    return sum(v for lbl, v in samples.get("taskledger_tasks", []) if lbl["state"] == "pending")


def test_tasks_by_state_follow_the_projection_once_the_cache_expires(db_url: str) -> None:
    server = ServerProcess(db_url, env={"TASKLEDGER_METRICS_CACHE_SECONDS": "0"}).start()
    try:
        assert _pending(scrape(server.base)[0]) == 0
        with Client(server.base, server.token("producer")) as producer:
            for _ in range(3):
                producer.create_task(CreateTask(id="c-" + uuid.uuid4().hex[:8], project="cache", title="t"))
        assert _pending(scrape(server.base)[0]) == 3
    finally:
        server.stop()
