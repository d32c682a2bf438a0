"""The reference worker runs the whole maker-checker loop on one machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, ServerProcess


def run_worker(server: ServerProcess, token: str, *extra: str) -> str:
    env = dict(os.environ, TASKLEDGER_URL=server.base, TASKLEDGER_TOKEN=token)
    out = subprocess.run([sys.executable, "-m", "taskledger.service.cli", "worker", "--once", *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_maker_on_one_node_and_a_checker_on_another_verify_real_work(server: ServerProcess, tmp_path: Path) -> None:
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    checker = server.token("worker", node="node-b")
    target = tmp_path / "built.txt"
    with server.client(producer) as c:
        r = c.post("/tasks", json={
            "id": "build-1", "project": "demo", "title": "write a file",
            "spec": f"echo hello > {target}",
            "requirements": [{"id": "R1", "text": "the file exists", "check": f"test -f {target}"},
                             {"id": "R2", "text": "it says hello", "check": f"grep -q hello {target}"}],
        })
        assert r.status_code == 201, r.text
    log = run_worker(server, maker)
    assert '"event": "completed"' in log
    assert target.read_text().strip() == "hello"
    # the maker finds nothing more to do: it may not check its own work
    assert "verified" not in run_worker(server, maker)
    log = run_worker(server, checker)
    assert '"outcome": "PASS"' in log
    with server.client(producer) as c:
        v = c.get("/tasks/build-1").json()
    assert v["state"] == "verified"
    assert {d["requirement_id"] for d in v["verdicts"][0]["verdicts"]} == {"R1", "R2"}


def test_a_failing_check_sends_the_work_back_with_its_reason(server: ServerProcess, tmp_path: Path) -> None:
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    checker = server.token("worker", node="node-b")
    with server.client(producer) as c:
        c.post("/tasks", json={"id": "build-2", "project": "demo2", "title": "t", "spec": "true",
                               "requirements": [{"id": "R1", "text": "never", "check": "exit 3"}]})
    run_worker(server, maker, "--projects", "demo2")
    log = run_worker(server, checker, "--projects", "demo2", "--types", "verify")
    assert "FAIL" in log and "\"status\": 200" in log, log
    with server.client(producer) as c:
        v = c.get("/tasks/build-2").json()
    assert v["state"] == "pending" and v["attempt"] == 2
    assert "exited 3" in v["rework_notes"][0]["reason"]


def test_a_failing_spec_is_reported_as_a_failure(server: ServerProcess) -> None:
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    with server.client(producer) as c:
        c.post("/tasks", json={"id": "build-3", "project": "demo3", "title": "t", "spec": "exit 7",
                               "max_attempts": 1})
    run_worker(server, maker, "--projects", "demo3")
    with server.client(producer) as c:
        v = c.get("/tasks/build-3").json()
    assert v["state"] == "deadletter" and "exit 7" in v["error"]


def test_a_panels_checks_learn_their_checker_task_type_and_maker(server: ServerProcess, tmp_path: Path) -> None:
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    checker = server.token("worker", node="node-b")
    seen = tmp_path / "seen"
    seen.mkdir()
    check = f'echo "$TASKLEDGER_TASK_TYPE $TASKLEDGER_PARENT_TASK_ID" > {seen}/"$TASKLEDGER_CHECKER"'
    with server.client(producer) as c:
        r = c.post("/tasks", json={"id": "build-4", "project": "demo4", "title": "t", "spec": "true",
                                   "verification": {"checkers": ["lint", "tests"]},
                                   "requirements": [{"id": "R1", "text": "checked", "check": check}]})
        assert r.status_code == 201, r.text
    run_worker(server, maker, "--projects", "demo4")
    run_worker(server, checker, "--projects", "demo4", "--types", "verify")
    assert sorted(p.name for p in seen.iterdir()) == ["lint", "tests"]
    assert {p.read_text().strip() for p in seen.iterdir()} == {"verify build-4"}
    with server.client(producer) as c:
        v = c.get("/tasks/build-4").json()
    assert v["state"] == "verified" and sorted(r["checker"] for r in v["verdicts"]) == ["lint", "tests"]


def test_concurrency_works_on_several_claimed_tasks_at_once(server: ServerProcess, tmp_path: Path) -> None:
    # Each task's spec waits until all four have started: with one task at a
    # time the first would wait in vain and fail after 10 s.
    producer = server.token("producer")
    maker = server.token("worker", node="node-a")
    spec = (f"touch {tmp_path}/$TASKLEDGER_TASK_ID; for i in $(seq 100); do "
            f"[ $(ls {tmp_path} | wc -l) -ge 4 ] && exit 0; sleep 0.1; done; exit 1")
    ids = [f"conc-{i}" for i in range(4)]
    with server.client(producer) as c:
        r = c.post("/tasks/batch", json={"tasks": [
            {"id": i, "project": "conc", "title": "t", "spec": spec, "verification": None, "max_attempts": 1}
            for i in ids]})
        assert r.status_code == 201, r.text
    log = run_worker(server, maker, "--projects", "conc", "--concurrency", "4")
    assert log.count('"event": "claimed"') == 4, log
    with server.client(producer) as c:
        states = [c.get(f"/tasks/{i}").json()["state"] for i in ids]
    assert states == ["completed"] * 4, log
