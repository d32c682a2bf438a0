"""`taskledger mcp` end to end, through the MCP SDK's own client over stdio:
agents on two nodes make and verify a task against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from mcp import Client, StdioServerParameters
from mcp_types import CallToolResult, TextResourceContents

from tests.conftest import ROOT, ServerProcess, free_port

TOOLS = {"claim_task", "start_task", "heartbeat", "complete_task", "report_verdict", "fail_task", "release_task",
         "get_task", "list_tasks", "create_task", "review_round", "unblock_task", "start_job", "job_status"}


def agent(server: ServerProcess, token: str) -> Client:
    return Client(StdioServerParameters(
        command=sys.executable, args=["-m", "taskledger.service.cli", "mcp", "--url", server.base, "--token", token],
        cwd=str(ROOT), env={"PATH": os.environ["PATH"]}))


async def call(c: Client, tool: str, **args: Any) -> dict[str, Any]:
    r = await c.call_tool(tool, args)
    assert isinstance(r, CallToolResult)
    assert not r.is_error, r.content
    assert r.structured_content is not None
    return r.structured_content


async def refused(c: Client, tool: str, **args: Any) -> str:
    r = await c.call_tool(tool, args)
    assert isinstance(r, CallToolResult) and r.is_error
    return " ".join(getattr(b, "text", "") for b in r.content)


def _tokens(server: ServerProcess) -> tuple[str, str, str]:
    return server.token("producer"), server.token("worker", node="node-a"), server.token("worker", node="node-b")


async def test_an_agent_makes_a_task_and_another_on_another_node_verifies_it(server: ServerProcess) -> None:
    p_tok, a_tok, b_tok = _tokens(server)
    proj = "mcp-" + uuid.uuid4().hex[:6]
    async with agent(server, p_tok) as producer, agent(server, a_tok) as maker, agent(server, b_tok) as checker:
        tools = (await maker.list_tools()).tools
        assert {t.name for t in tools} == TOOLS
        for t in tools:
            assert t.description and len(t.description) > 40, t.name
            assert t.input_schema["type"] == "object"
        verdict_doc = next(t.description for t in tools if t.name == "report_verdict")
        for must in ("exactly one PASS verdict per requirement", "infrastructure", "info_missing", "environment"):
            assert must in verdict_doc

        created = await call(producer, "create_task", title="Add /healthz", project=proj, spec="answer 200",
                             requirements=[{"id": "R1", "text": "GET /healthz answers 200"},
                                           {"id": "R2", "text": "it is documented", "check": "true"}])
        # the maker: claim, start, heartbeat, complete
        t = await call(maker, "claim_task", task_types=["implement"], projects=[proj])
        assert t["id"] == created["id"] and t["lease_id"]
        await call(maker, "start_task", task_id=t["id"], lease_id=t["lease_id"])
        await call(maker, "heartbeat", task_id=t["id"], lease_id=t["lease_id"])
        done = await call(maker, "complete_task", task_id=t["id"], lease_id=t["lease_id"],
                          result={"commit": "abc123", "summary": "added the route"})
        assert done["state"] == "verifying"
        assert await call(maker, "claim_task", task_types=["verify"], projects=[proj]) == {"task": None}

        # the checker reads what to judge, then judges every requirement
        v = await call(checker, "claim_task", task_types=["verify"], projects=[proj])
        assert v["parent_task_id"] == created["id"]
        spec = await checker.read_resource(f"taskledger://tasks/{created['id']}/spec")
        text = spec.contents[0]
        assert isinstance(text, TextResourceContents)
        assert "**R1**: GET /healthz answers 200" in text.text and "check: `true`" in text.text
        await call(checker, "start_task", task_id=v["id"], lease_id=v["lease_id"])
        await call(checker, "report_verdict", task_id=v["id"], lease_id=v["lease_id"], outcome="PASS", verdicts=[
            {"requirement_id": "R1", "verdict": "PASS", "reason": "curl -i answered 200"},
            {"requirement_id": "R2", "verdict": "PASS", "reason": "`true` exited 0; README lists it"}])

        final = await call(producer, "get_task", task_id=created["id"])
        assert final["state"] == "verified"
        assert final["verdicts"][0]["outcome"] == "PASS" and final["verdicts"][0]["node"] == "node-b"
        history = await producer.read_resource(f"taskledger://tasks/{created['id']}/history")
        body = history.contents[0]
        assert isinstance(body, TextResourceContents)
        assert [e["type"] for e in json.loads(body.text)][-1] == "task.verified"


async def test_refusals_reach_the_agent_as_tool_errors_with_the_code_and_what_to_do(server: ServerProcess) -> None:
    p_tok, a_tok, _ = _tokens(server)
    proj = "mcp-" + uuid.uuid4().hex[:6]
    async with agent(server, p_tok) as producer, agent(server, a_tok) as maker:
        await call(producer, "create_task", title="t", project=proj, requirements=[{"id": "R1", "text": "x"}])
        t = await call(maker, "claim_task", projects=[proj])
        msg = await refused(maker, "start_task", task_id=t["id"], lease_id="someone-elses")
        assert "lease_mismatch" in msg and "claim again" in msg
        msg = await refused(maker, "create_task", title="t", project=proj)
        assert "403 forbidden" in msg
        msg = await refused(producer, "get_task", task_id="nope")
        assert "task_not_found" in msg
        msg = await refused(maker, "report_verdict", task_id=t["id"], lease_id=t["lease_id"], outcome="MAYBE",
                            verdicts=[])
        assert "outcome" in msg  # refused by the tool's schema before reaching the service


async def test_jobs_and_blockers_through_the_tools(server: ServerProcess) -> None:
    p_tok, a_tok, b_tok = _tokens(server)
    proj = "mcp-" + uuid.uuid4().hex[:6]
    async with agent(server, p_tok) as producer, agent(server, a_tok) as maker, agent(server, b_tok) as checker:
        job = await call(producer, "start_job", commands=["true", "true"], project=proj)
        status = await call(producer, "job_status", job_id=job["job_id"])
        assert status["state"] == "pending" and status["total_commands"] == 2
        created = await call(producer, "create_task", title="t", project=proj, retry_predecessor=False,
                             requirements=[{"id": "R1", "text": "x"}])
        t = await call(maker, "claim_task", projects=[proj])
        await call(maker, "start_task", task_id=t["id"], lease_id=t["lease_id"])
        await call(maker, "complete_task", task_id=t["id"], lease_id=t["lease_id"])
        v = await call(checker, "claim_task", projects=[proj])
        await call(checker, "start_task", task_id=v["id"], lease_id=v["lease_id"])
        await call(checker, "report_verdict", task_id=v["id"], lease_id=v["lease_id"], outcome="BLOCKED",
                   category="environment", verdicts=[])
        assert (await call(producer, "get_task", task_id=created["id"]))["state"] == "blocked"
        back = await call(producer, "unblock_task", task_id=created["id"], action="retry", notes="db is back")
        assert back["state"] == "pending"
        listed = await call(producer, "list_tasks", project=proj, task_type="implement")
        assert [x["id"] for x in listed["tasks"]] == [created["id"]]


async def test_release_task_gives_a_claim_back_without_spending_an_attempt(server: ServerProcess) -> None:
    p_tok, a_tok, _ = _tokens(server)
    proj = "mcp-" + uuid.uuid4().hex[:6]
    async with agent(server, p_tok) as producer, agent(server, a_tok) as maker:
        created = await call(producer, "create_task", title="t", project=proj, requirements=[{"id": "R1", "text": "x"}])
        t = await call(maker, "claim_task", projects=[proj])
        back = await call(maker, "release_task", task_id=t["id"], lease_id=t["lease_id"], reason="not my area")
        assert back["state"] == "pending" and back["attempt"] == created["attempt"]


def test_mcp_over_streamable_http(server: ServerProcess) -> None:
    import asyncio

    port = free_port()
    token = server.token("reader")
    proc = subprocess.Popen([sys.executable, "-m", "taskledger.service.cli", "mcp", "--http", "--port", str(port),
                             "--url", server.base, "--token", token], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    async def go() -> set[str]:
        deadline = time.monotonic() + 30
        while True:
            try:
                async with Client(f"http://127.0.0.1:{port}/mcp") as c:
                    names = {t.name for t in (await c.list_tools()).tools}
                    assert "task_not_found" in await refused(c, "get_task", task_id="nope")
                    return names
            except (OSError, RuntimeError, ExceptionGroup):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)

    try:
        assert asyncio.run(go()) == TOOLS
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_mcp_without_a_token_says_what_it_needs() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TASKLEDGER_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "taskledger.service.cli", "mcp"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "TASKLEDGER_TOKEN" in out.stderr
