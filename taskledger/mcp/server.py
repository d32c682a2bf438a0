"""The MCP server: one tool per worker, producer and reviewer command, each
described so an agent can act on it, plus resources for a task's spec and history.

Every call acts as the token the server was started with: its role and node
decide what the service allows (a verify task is never given to the node that
made the work). Built on `taskledger.client.AsyncClient`, so calls retry 503s
and dropped connections, and writes are applied once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

import anyio
import msgspec
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field
from typing_extensions import TypedDict

from taskledger.client import AsyncClient, CreateTask, Requirement, Subtask, TaskledgerError, Verdict
from taskledger.client.models import Verification

INSTRUCTIONS = """\
taskledger is a maker-checker work queue. A maker claims an `implement` task,
starts it, does the work its `spec` describes, and completes it. A checker on
another node then claims the `verify` task created for it and judges every
requirement (acceptance criterion) with report_verdict. Work counts only when
every checker passes it. Hold a claim by calling heartbeat before the lease
runs out; if you cannot finish, release_task (no attempt spent) or fail_task.
The task's spec and history are resources: taskledger://tasks/{task_id}/spec
and taskledger://tasks/{task_id}/history."""

VERDICT_RULES = """\
A verify task names the task it checks in `parent_task_id`; read that task's
requirements (get_task, or the spec resource). Each requirement has an `id`,
a `text` (what must hold) and maybe a `check` (a shell command whose exit 0
means it holds). Judge each requirement on the evidence, not on the maker's word.
- PASS: every requirement holds. Send exactly one PASS verdict per requirement,
  each with the evidence as `reason` (what you ran, what you saw).
- FAIL: one or more requirements do not hold. Send a FAIL verdict with a concrete
  reason for each unmet requirement (PASS verdicts for the rest are welcome):
  the task goes back to its maker with your reasons as rework notes, while
  attempts remain; after that it is blocked for a human.
- BLOCKED: you could not judge. Say why with `category`:
  `code` - the work itself prevents judging (does not build, crashes): back to
  the maker for rework, like a FAIL;
  `environment` - something outside the work is missing or broken (a service,
  a credential, a tool): a person must fix it, the task is blocked;
  `info_missing` - the spec or requirements are too unclear to judge: a person
  must clarify, the task is blocked;
  `infrastructure` - a transient failure of the checking machinery (runner
  died, network flake): the work is verified again once; a second time, blocked."""

_HINTS = {
    "lease_mismatch": "Your lease on this task is gone (expired, released or never yours): stop working on it "
                      "and claim again.",
    "invalid_transition": "The task is not in a state that allows this; call get_task to see its state.",
    "forbidden": "This server's token has a role that may not do this.",
    "unauthorized": "This server's token is unknown or revoked.",
    "task_not_found": "No task has this id; list_tasks shows the existing ones.",
    "job_not_found": "No job has this id.",
    "validation_error": "The arguments were refused; correct them and call again.",
}

TaskId = Annotated[str, Field(description="The task's id.", min_length=1, max_length=128)]
LeaseId = Annotated[str, Field(description="The lease_id returned by claim_task for this task.")]
TaskTypes = Annotated[list[Literal["implement", "verify"]], Field(
    description="Which kinds to take: 'implement' (make) and/or 'verify' (check).")]


class VerdictInput(TypedDict):
    requirement_id: Annotated[str, Field(description="The id of the requirement judged.")]
    verdict: Annotated[Literal["PASS", "FAIL"], Field(description="PASS if it holds, FAIL if not.")]
    reason: Annotated[str, Field(description="The evidence: what you ran or read, and what you saw.")]


class RequirementInput(TypedDict):
    id: Annotated[str, Field(description="A short id, unique in the task, e.g. R1.")]
    text: Annotated[str, Field(description="What must hold, checkable by someone else.")]
    check: NotRequired[Annotated[str, Field(description="Optional shell command; exit 0 means it holds.")]]


class SubtaskInput(TypedDict):
    title: str
    spec: NotRequired[str]
    requirements: NotRequired[list[RequirementInput]]
    id: NotRequired[str]


def _view(value: Any) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(value)
    return out


def _requirements(items: list[RequirementInput] | None) -> list[Requirement]:
    return [Requirement(id=r["id"], text=r.get("text", ""), check=r.get("check")) for r in items or []]


async def _call(coro: Any) -> Any:
    """Await a client call; a refusal becomes a tool error the agent can act on."""
    try:
        return await coro
    except TaskledgerError as e:
        hint = _HINTS.get(e.code) or (_HINTS["task_not_found"] if e.status == 404 else "")
        raise ToolError(f"{e.status} {e.code}: {e.detail}" + (f" {hint}" if hint else "")) from e


def build_server(api: AsyncClient) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("taskledger", instructions=INSTRUCTIONS, log_level="WARNING")

    @server.tool(description=(
        "Claim the next task this token may take and hold it under a lease. Returns the task (with `lease_id`, "
        "needed by every later call on it, `spec` and `requirements`) or {\"task\": null} when there is none. "
        "A verify task is never given to the node that made the work. Call start_task next."))
    async def claim_task(
        task_types: TaskTypes = ["implement", "verify"],  # noqa: B006 - pydantic copies defaults
        projects: Annotated[list[str] | None, Field(description="Only these projects (default: any).")] = None,
        lease_seconds: Annotated[int, Field(ge=5, le=86400, description=(
            "How long the claim lasts without a heartbeat."))] = 300,
    ) -> dict[str, Any]:
        t = await _call(api.claim(task_types=list(task_types), projects=projects, lease_seconds=lease_seconds))
        return {"task": None} if t is None else _view(t)

    @server.tool(description="Report a claimed task running. Call it once, right after claim_task.")
    async def start_task(task_id: TaskId, lease_id: LeaseId) -> dict[str, Any]:
        return _view(await _call(api.start(task_id, lease_id)))

    @server.tool(description=(
        "Extend your lease on a task you are working on. Call it well before `lease_expires_at`; a lease that "
        "runs out gives the task to someone else and your later reports are refused (lease_mismatch)."))
    async def heartbeat(
        task_id: TaskId, lease_id: LeaseId,
        lease_seconds: Annotated[int | None, Field(ge=5, le=86400, description=(
            "New lease length (default: the claim's)."))] = None,
    ) -> dict[str, Any]:
        return _view(await _call(api.heartbeat(task_id, lease_id, lease_seconds=lease_seconds)))

    @server.tool(description=(
        "Report an implement task done (maker). `result` is what a checker and the producer should know: e.g. "
        "the commit, the files changed, how to try it. Independent checkers then verify each requirement; the "
        "work counts only once they pass it. For a verify task use report_verdict instead."))
    async def complete_task(
        task_id: TaskId, lease_id: LeaseId,
        result: Annotated[dict[str, Any] | str | None, Field(description="What you did (free JSON).")] = None,
    ) -> dict[str, Any]:
        return _view(await _call(api.complete(task_id, lease_id, result=result)))

    @server.tool(description="Report your judgement of a verify task (checker).\n" + VERDICT_RULES)
    async def report_verdict(
        task_id: Annotated[str, Field(description="The verify task's id (from claim_task).")],
        lease_id: LeaseId,
        outcome: Annotated[Literal["PASS", "FAIL", "BLOCKED"], Field(description="Your overall judgement.")],
        verdicts: Annotated[list[VerdictInput], Field(description=(
            "One verdict per requirement judged; for PASS exactly one PASS per requirement."))],
        category: Annotated[Literal["code", "environment", "info_missing", "infrastructure"] | None, Field(
            description="Why you could not judge; required with BLOCKED, omitted otherwise.")] = None,
        result: Annotated[dict[str, Any] | str | None, Field(description="Optional notes (free JSON).")] = None,
    ) -> dict[str, Any]:
        vs = [Verdict(requirement_id=v["requirement_id"], verdict=v["verdict"], reason=v.get("reason", ""))
              for v in verdicts]
        return _view(await _call(api.complete(task_id, lease_id, outcome=outcome, verdicts=vs, category=category,
                                              result=result)))

    @server.tool(description=(
        "Report that you could not do the work (the attempt is spent): the task is retried while attempts "
        "remain, then dead-lettered. To hand a task back without spending an attempt, use release_task."))
    async def fail_task(
        task_id: TaskId, lease_id: LeaseId,
        error: Annotated[str, Field(description="What went wrong, for whoever tries next.")] = "",
    ) -> dict[str, Any]:
        return _view(await _call(api.fail(task_id, lease_id, error=error)))

    @server.tool(description=(
        "Give a claimed task back without spending an attempt (e.g. it is outside what you can do); it becomes "
        "pending for another worker."))
    async def release_task(
        task_id: TaskId, lease_id: LeaseId,
        reason: Annotated[str, Field(description="Why, for the next taker.")] = "",
    ) -> dict[str, Any]:
        return _view(await _call(api.release(task_id, lease_id, reason=reason)))

    @server.tool(description=(
        "A task's current view: state, spec, requirements, attempt, lease, verdicts of the current attempt, "
        "rework_notes (the unmet requirements of the last rejection) and blocker."))
    async def get_task(task_id: TaskId) -> dict[str, Any]:
        return _view(await _call(api.get_task(task_id)))

    @server.tool(description="List tasks in creation order, filtered; pass `next_after` back as `after` to page.")
    async def list_tasks(
        state: Annotated[str | None, Field(description="e.g. pending, running, verifying, verified, blocked.")]
        = None,
        project: str | None = None,
        parent_task_id: str | None = None,
        task_type: Literal["implement", "verify"] | None = None,
        limit: Annotated[int, Field(ge=1, le=1000)] = 50,
        after: str | None = None,
    ) -> dict[str, Any]:
        return _view(await _call(api.list_tasks(state=state, project=project, parent_task_id=parent_task_id,
                                                task_type=task_type, limit=limit, after=after)))

    @server.tool(description=(
        "Create a task (producer). Give requirements a checker can judge one by one: each is what must hold "
        "when the work is done. By default one checker verifies the work; `checkers` names a panel, "
        "`verify=false` makes the maker's word final."))
    async def create_task(
        title: str,
        project: str,
        spec: Annotated[str, Field(description="What to do, in full.")] = "",
        requirements: list[RequirementInput] | None = None,
        id: Annotated[str | None, Field(description="Your id for it (default: generated).")] = None,
        parent_task_id: Annotated[str | None, Field(description="Makes it a sub-task of this task.")] = None,
        priority: int = 0,
        checkers: Annotated[list[str] | None, Field(description="Checker panel, e.g. ['tests', 'review'].")]
        = None,
        verify: Annotated[bool, Field(description="False: no verification.")] = True,
        max_attempts: Annotated[int, Field(ge=1, le=100)] = 3,
        retry_predecessor: Annotated[bool, Field(description="Send rejected work back for rework.")] = True,
        assignee: Annotated[str | None, Field(description="Only this worker may claim it.")] = None,
        labels: list[str] | None = None,
    ) -> dict[str, Any]:
        task = CreateTask(title=title, project=project, spec=spec, requirements=_requirements(requirements),
                          id=id, parent_task_id=parent_task_id, priority=priority, max_attempts=max_attempts,
                          retry_predecessor=retry_predecessor, assignee=assignee, labels=list(labels or []))
        if not verify:
            task.verification = None
        elif checkers:
            task.verification = Verification(checkers=list(checkers))
        return _view(await _call(api.create_task(task)))

    @server.tool(description=(
        "Decide a parent task's ended round (reviewer): GOAL_ACHIEVED closes it; NEW_ROUND starts the sub-tasks "
        "you give. Answer the three questions: is the goal clear, what do the done sub-tasks cover, what must "
        "the next round do."))
    async def review_round(
        task_id: TaskId,
        decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"],
        goal_clear: Annotated[bool | str, Field(description="Is the goal clear? (yes/no or a sentence)")],
        coverage: Annotated[str, Field(description="What the finished sub-tasks cover, and what they miss.")],
        next_round: Annotated[str | None, Field(description="What the next round must do (NEW_ROUND).")] = None,
        notes: str = "",
        new_subtasks: list[SubtaskInput] | None = None,
    ) -> dict[str, Any]:
        subs = [Subtask(title=s["title"], spec=s.get("spec", ""), id=s.get("id"),
                        requirements=_requirements(s.get("requirements"))) for s in new_subtasks or []]
        return _view(await _call(api.review_round(task_id, decision, notes=notes, goal_clear=goal_clear,
                                                  coverage=coverage, next_round=next_round, new_subtasks=subs)))

    @server.tool(description=(
        "Resolve a blocked task (producer) once its cause is fixed: `retry` sends the work back to a maker with "
        "fresh attempts; `reverify` has it checked again as it is (when the checking, not the work, was at fault)."))
    async def unblock_task(
        task_id: TaskId,
        action: Literal["retry", "reverify"] = "retry",
        notes: Annotated[str | None, Field(description="What was fixed, for the next maker or checker.")] = None,
    ) -> dict[str, Any]:
        return _view(await _call(api.unblock(task_id, action=action, notes=notes)))

    @server.tool(description=(
        "Start an asynchronous job that runs shell commands on a job runner (e.g. a long test suite), and "
        "return at once with its job_id. Poll job_status for progress instead of waiting on one long call."))
    async def start_job(
        commands: Annotated[list[str], Field(min_length=1, description="Shell commands, run in order.")],
        project: str | None = None,
        parallel: bool = False,
        fail_fast: bool = False,
        labels: list[str] | None = None,
        command_timeout_seconds: Annotated[float | None, Field(
            gt=0, description="Kill a command still running after this many seconds (it then counts as failed)."
        )] = None,
    ) -> dict[str, Any]:
        return _view(await _call(api.create_job(commands, project=project, parallel=parallel, fail_fast=fail_fast,
                                                labels=labels, command_timeout_seconds=command_timeout_seconds)))

    @server.tool(description=(
        "A job's status: state (pending, running, cancelling, completed, failed, cancelled), stage, progress "
        "(0-100), elapsed_sec, eta_sec, current_command, completed_commands of total_commands, result."))
    async def job_status(job_id: Annotated[str, Field(description="The job_id from start_job.")]) -> dict[str, Any]:
        return _view(await _call(api.get_job(job_id)))

    @server.resource("taskledger://tasks/{task_id}/spec", mime_type="text/markdown",
                     description="What a task asks for: title, spec and the requirements a checker judges.")
    async def task_spec(task_id: str) -> str:
        t = await _call(api.get_task(task_id))
        lines = [f"# {t.title}", "", f"Task `{t.id}` ({t.task_type}, project `{t.project}`, state {t.state})."]
        if t.parent_task_id:
            lines.append(f"Parent: `{t.parent_task_id}`.")
        lines += ["", t.spec or "(no spec)", "", "## Requirements", ""]
        lines += [f"- **{r.id}**: {r.text}" + (f" (check: `{r.check}`)" if r.check else "")
                  for r in t.requirements] or ["(none)"]
        if t.rework_notes:
            lines += ["", "## Rework notes from the last rejection", ""]
            lines += [f"- **{n.requirement_id}**: {n.reason}" for n in t.rework_notes]
        return "\n".join(lines)

    @server.resource("taskledger://tasks/{task_id}/history", mime_type="application/json",
                     description="Every event of a task, oldest first (the task's own stream).")
    async def task_history(task_id: str) -> str:
        events: list[Any] = []
        since = 0
        while True:
            page = await _call(api.task_events(task_id, since_seq=since))
            events.extend(page.events)
            if len(page.events) < 1000:
                return msgspec.json.encode(events).decode()
            since = page.next_seq

    return server


def serve(url: str, token: str, *, http: bool = False, host: str = "127.0.0.1", port: int = 8765) -> None:
    async def main() -> None:
        async with AsyncClient(url, token) as api:
            server = build_server(api)
            if http:
                await server.run_streamable_http_async(host=host, port=port)
            else:
                await server.run_stdio_async()

    anyio.run(main)
