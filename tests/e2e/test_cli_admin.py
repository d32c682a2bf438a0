"""rebuild, check and replay from the command line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from taskledger.service.cli.main import main as cli
from tests.conftest import ROOT, AppHarness, Client, ServerProcess
from tests.flows import claim, complete_verify, make, project


async def test_rebuild_from_the_cli_reports_its_speed_and_check_then_passes(
    harness: AppHarness, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    await make(producer, maker, project())
    assert await asyncio.to_thread(cli, ["rebuild", "--database-url", db_url, "--projection", "tasks"]) == 0
    out = capsys.readouterr()
    assert "tasks: rebuilt to seq" in out.out and "events/s" in out.out
    assert await asyncio.to_thread(cli, ["check", "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert "tasks: ok" in out and "blockers: ok" in out and "jobs: ok" in out and "hash chain ok" in out
    assert await asyncio.to_thread(cli, ["rebuild", "--database-url", db_url, "--projection", "nope"]) == 2


async def test_replay_prints_each_event_with_the_state_after_it(
    harness: AppHarness, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    done = await make(producer, maker, proj)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "PASS")
    assert await asyncio.to_thread(
        cli, ["replay", "--task", done["id"], "--database-url", db_url, "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["type"], r["state"]["state"]) for r in rows] == [
        ("task.created", "pending"), ("task.claimed", "claimed"), ("task.started", "running"),
        ("task.completed", "completed"), ("task.verifying", "verifying"), ("task.verdict", "verifying"),
        ("task.verified", "verified")]
    assert rows[-1]["state"]["verdicts"] == ["verifier:PASS"] and rows[1]["state"]["node"] == "node-a"

    cut = rows[2]["seq"]
    assert await asyncio.to_thread(cli, ["replay", "--task", done["id"], "--database-url", db_url,
                                         "--as-of-seq", str(cut)]) == 0
    table = capsys.readouterr().out
    assert "task.started" in table and "task.completed" not in table and "running" in table


def test_replay_reads_the_http_api_with_a_token(server: ServerProcess) -> None:
    proj = project()

    async def seed() -> str:
        async with httpx.AsyncClient(base_url=server.base, timeout=30) as http:
            producer = Client(http, server.token("producer"))  # type: ignore[arg-type]
            maker = Client(http, server.token("worker", node="node-a"))  # type: ignore[arg-type]
            return str((await make(producer, maker, proj))["id"])

    task_id = asyncio.run(seed())
    env = {"PATH": "/usr/bin:/bin", "TASKLEDGER_URL": server.base, "TASKLEDGER_TOKEN": server.token("reader")}
    r = subprocess.run([sys.executable, "-m", "taskledger.service.cli", "replay", "--task", task_id], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    for word in ("task.created", "task.claimed", "task.verifying", "verifying", "node-a"):
        assert word in r.stdout
