"""The real `taskledger runner` and `taskledger job watch` against a real `taskledger serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, ServerProcess

TERMINAL = ("completed", "failed", "cancelled")


class Api:
    def __init__(self, server: ServerProcess, token: str) -> None:
        self.token = token
        self.http = httpx.Client(
            base_url=server.base, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )

    def create(self, commands: list[str], **more: Any) -> str:
        r = self.http.post("/jobs", json={"commands": commands, "project": "rt", **more})
        assert r.status_code == 201, r.text
        return str(r.json()["job_id"])

    def get(self, job_id: str) -> dict[str, Any]:
        r = self.http.get(f"/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.http.get(f"/jobs/{job_id}/events").json()["events"])

    def wait_for(self, job_id: str, pred: Any, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.get(job_id)
            if pred(st):
                return st
            assert time.monotonic() < deadline, st
            time.sleep(0.05)


class RunnerProcess:
    def __init__(self, server: ServerProcess, token: str, *extra: str, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "taskledger.service.cli",
                    "runner",
                    "--url",
                    server.base,
                    "--token",
                    token,
                    *extra,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def producer(server: ServerProcess) -> Iterator[Api]:
    api = Api(server, server.token("producer"))
    yield api
    api.http.close()


@pytest.fixture
def runner(server: ServerProcess, tmp_path: Path) -> Iterator[RunnerProcess]:
    r = RunnerProcess(
        server,
        server.token("worker", node="runner-node"),
        "--poll-seconds",
        "0.1",
        "--cancel-poll-seconds",
        "0.2",
        log=tmp_path / "runner.log",
    )
    yield r
    r.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runner_runs_the_commands_in_order_and_fails_when_one_fails(
    server: ServerProcess, producer: Api, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    jid = producer.create([f"touch {marker}", "exit 3", f"echo after >> {marker}"])
    tok = server.token("worker", node="once-node")
    out = subprocess.run(
        [sys.executable, "-m", "taskledger.service.cli", "runner", "--url", server.base, "--token", tok, "--once"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    st = producer.get(jid)
    assert st["state"] == "failed" and st["completed_commands"] == 3 and st["progress"] == 100, st
    assert marker.read_text() == "after\n"  # kept going after the failure, in order
    assert [c["exit_code"] for c in st["commands"]] == [0, 3, 0]
    assert st["result"]["failed_commands"] == ["exit 3"] and st["exit_code"] == 3
    assert st["node"] == "once-node"
    types = [e["type"] for e in producer.events(jid)]
    assert types == [
        "job.created",
        "job.started",
        "job.stage",
        *["job.command_started", "job.command_completed"] * 3,
        "job.stage",
        "job.failed",
    ]
    durations = [e["data"]["duration"] for e in producer.events(jid) if e["type"] == "job.command_completed"]
    assert all(0 <= d < 10 for d in durations)


def test_cancelling_a_running_sleep_kills_it_quickly(
    producer: Api, runner: RunnerProcess, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    jid = producer.create([f"echo $$ > {pidfile}; exec sleep 60", "true"])
    producer.wait_for(jid, lambda s: s["current_command"] is not None, timeout=30)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert _alive(pid)
    t0 = time.monotonic()
    r = producer.http.post(f"/jobs/{jid}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelling"
    st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL, timeout=15)
    took = time.monotonic() - t0
    assert st["state"] == "cancelled", (st, runner.output())
    assert took < 5, took
    assert not _alive(pid)
    assert st["commands"][0]["state"] == "interrupted" and st["commands"][1]["state"] == "pending"
    assert producer.events(jid)[-1]["type"] == "job.cancelled"
    # the runner carries on with the next job
    nxt = producer.create(["true"])
    assert producer.wait_for(nxt, lambda s: s["state"] in TERMINAL)["state"] == "completed"


def test_parallel_jobs_run_their_commands_at_once(producer: Api, runner: RunnerProcess) -> None:
    jid = producer.create(["sleep 1", "sleep 1", "sleep 1"], parallel=True)
    st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL)
    assert st["state"] == "completed" and st["progress"] == 100, runner.output()
    assert st["elapsed_sec"] < 2.8, st
    assert any(e["type"] == "job.stage" and e["data"]["stage"] == "parallel" for e in producer.events(jid))


def test_fail_fast_skips_the_rest(producer: Api, runner: RunnerProcess, tmp_path: Path) -> None:
    marker = tmp_path / "never"
    jid = producer.create(["false", f"touch {marker}"], fail_fast=True)
    st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL)
    assert st["state"] == "failed" and not marker.exists()
    assert [c["state"] for c in st["commands"]] == ["failed", "skipped"] and st["progress"] == 100


def test_wait_true_answers_when_the_job_ends(producer: Api, runner: RunnerProcess) -> None:
    t0 = time.monotonic()
    r = producer.http.post(
        "/jobs", params={"wait": "true", "timeout": "30"}, json={"commands": ["sleep 0.5", "true"]}
    )
    assert r.status_code == 201 and r.json()["state"] == "completed", r.text
    assert r.json()["completed_commands"] == 2 and time.monotonic() - t0 < 20


def test_a_runner_killed_mid_job_leaves_it_failed_by_the_sweeper(
    server: ServerProcess, producer: Api, tmp_path: Path
) -> None:
    jid = producer.create(["sleep 60"])
    r = RunnerProcess(
        server,
        server.token("worker", node="doomed"),
        "--lease-seconds",
        "2",
        "--poll-seconds",
        "0.1",
        log=tmp_path / "doomed.log",
    )
    try:
        producer.wait_for(jid, lambda s: s["current_command"] == "sleep 60")
        os.killpg(r.proc.pid, signal.SIGKILL)  # the runner and its command: no goodbye
        r.proc.wait()
        st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL, timeout=20)
    finally:
        r.stop()
    assert st["state"] == "failed" and "stopped heartbeating" in st["error"], st
    assert producer.events(jid)[-1]["data"]["reason"] == "heartbeat_timeout"


def test_job_watch_draws_progress_and_ends_with_the_result(
    server: ServerProcess, producer: Api, runner: RunnerProcess
) -> None:
    jid = producer.create(["sleep 0.8", "exit 4"], project="watch")
    reader = server.token("reader")
    out: dict[str, Any] = {}

    def watch() -> None:
        out["p"] = subprocess.run(
            [
                sys.executable,
                "-m",
                "taskledger.service.cli",
                "job",
                "watch",
                jid,
                "--url",
                server.base,
                "--token",
                reader,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=dict(os.environ, COLUMNS="160"),
        )

    t = threading.Thread(target=watch)
    t.start()
    t.join(70)
    p = out["p"]
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"job {jid} failed" in p.stdout and "2/2 commands, exit code 4" in p.stdout, p.stdout
    assert "sleep 0.8" in p.stdout and "exit 4" in p.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "taskledger.service.cli",
            "job",
            "watch",
            "no-such-job",
            "--url",
            server.base,
            "--token",
            reader,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "not exist" in r.stdout


def test_the_runner_reports_the_tail_of_each_commands_output(
    server: ServerProcess, producer: Api, tmp_path: Path
) -> None:
    jid = producer.create(
        [
            "echo to-stdout; echo to-stderr >&2; exit 5",
            "for i in $(seq 1 2000); do echo line-$i; done",
            "true",
        ]
    )
    r = RunnerProcess(
        server,
        server.token("worker", node="tail-node"),
        "--poll-seconds",
        "0.1",
        "--output-tail-bytes",
        "64",
        log=tmp_path / "tail.log",
    )
    try:
        st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL)
    finally:
        r.stop()
    first, second, third = st["commands"]
    assert first["output"] == "to-stdout\nto-stderr\n" and first["output_truncated"] is False, st
    assert first["exit_code"] == 5 and first["timed_out"] is False
    assert second["output_truncated"] is True and second["output"].endswith("line-1999\nline-2000\n")
    assert len(second["output"].encode()) <= 64 and "line-1\n" not in second["output"]
    assert third["output"] == "" and third["output_truncated"] is False
    done = [e["data"] for e in producer.events(jid) if e["type"] == "job.command_completed"]
    assert [d["output"] for d in done] == [first["output"], second["output"], third["output"]]
    assert "to-stderr" in r.output()  # still copied to the runner's own log


def test_the_runner_kills_a_command_past_its_timeout_and_fails_fast(
    producer: Api, runner: RunnerProcess, tmp_path: Path
) -> None:
    pidfile = tmp_path / "pid"
    marker = tmp_path / "never"
    jid = producer.create(
        [f"echo started; echo $$ > {pidfile}; exec sleep 60", f"touch {marker}"],
        command_timeout_seconds=1,
        fail_fast=True,
    )
    t0 = time.monotonic()
    st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL)
    assert time.monotonic() - t0 < 15, st
    assert st["state"] == "failed" and st["exit_code"] == 124, (st, runner.output())
    first, second = st["commands"]
    assert first["timed_out"] is True and first["exit_code"] == 124 and first["state"] == "failed"
    assert first["output"] == "started\n" and 1 <= first["duration"] < 10
    assert second["state"] == "skipped" and not marker.exists()
    assert st["result"]["timed_out_commands"] == [first["command"]]
    assert not _alive(int(pidfile.read_text()))
    done = next(e["data"] for e in producer.events(jid) if e["type"] == "job.command_completed")
    assert done["timed_out"] is True and done["exit_code"] == 124


def test_without_fail_fast_the_commands_after_a_timeout_still_run(
    producer: Api, runner: RunnerProcess, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    jid = producer.create(["sleep 60", f"touch {marker}"], command_timeout_seconds=0.5)
    st = producer.wait_for(jid, lambda s: s["state"] in TERMINAL)
    assert st["state"] == "failed" and marker.exists(), (st, runner.output())
    assert [(c["state"], c["timed_out"]) for c in st["commands"]] == [("failed", True), ("succeeded", False)]
