"""Tasks in bulk: a producer creates up to 1,000 in one request, a worker claims
up to 100 in one call.

A batch is one writer command, so it is one transaction: all of it is appended
or none of it. A refusal names the entry it is about: `errors: [{"index", ...}]`
in the problem+json, whether the entry failed the schema (400) or a rule
(its own status: 400, or 409 for an id that exists).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.exceptions import ValidationException
from litestar.params import JSONBody

from taskledger.events.task.state import TaskState
from taskledger.projections import tasks as views
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import CommandRunnerDep, PoolDep, SettingsDep
from taskledger.service.http.problems import problem
from taskledger.service.http.routes.common import known_query_only, respond
from taskledger.service.http.routes.tasks import ClaimBody, CreateTask, default_escalation, to_new_task, viewer
from taskledger.service.writer import tasks as cmds
from taskledger.service.writer.commands import ctx_of

MAX_BATCH = 1000
MAX_CLAIM = 100


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tasks: Annotated[list[CreateTask], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class ClaimBatch(ClaimBody, forbid_unknown_fields=True, kw_only=True):
    max: Annotated[int, msgspec.Meta(ge=1, le=MAX_CLAIM)] = 10


class TaskBatch(msgspec.Struct, kw_only=True):
    tasks: list[TaskState]


_ENTRY = re.compile(r"^tasks\[(\d+)\]")


def _indexed_validation(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    """A schema error in the body, with the index of the entry it is in."""
    errors = []
    for e in exc.extra if isinstance(exc.extra, list) else []:
        m = _ENTRY.match(str(e.get("key", ""))) if isinstance(e, dict) else None
        errors.append({**e, "index": int(m.group(1))} if m else e)
    first = next((e for e in errors if "index" in e), None)
    detail = (f"tasks[{first['index']}]: {first.get('message', 'invalid')} ({first.get('key')})" if first
              else str(exc.detail))
    return problem(400, "validation_error", "Invalid request", detail, errors=errors)


class TaskBatchController(Controller):
    path = "/tasks"
    tags = ["tasks"]
    guards = [known_query_only]

    @post("/batch", operation_id="createTasks", guards=[requires("producer")], status_code=201,
          exception_handlers={ValidationException: _indexed_validation})
    async def create_batch(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, settings: SettingsDep,
        data: JSONBody[CreateBatch],
    ) -> Response[Any]:
        """Create up to 1,000 tasks in one transaction, answered in order. `Idempotency-Key`
        covers the whole batch. Sub-tasks of one parent in one batch join one round."""
        ctx = ctx_of(request)
        ts = [to_new_task(b, parent_task_id=b.parent_task_id) for b in data.tasks]
        esc, who = default_escalation(settings), viewer(ctx)

        async def fn(u: Any) -> TaskBatch:
            made = await cmds.create_many(u, ctx, ts, default_escalation=esc, indexed=True)
            return TaskBatch(tasks=[views.visible_to(s, who) for s in made])

        ids = {i: None for t in ts for i in (t.id, t.parent_task_id) if i}
        return respond(
            await command_runner.run(request, ctx, fn, status=201, prefetch=[("tasks", i) for i in ids]), 201)

    @post("/claim/batch", operation_id="claimTasks", guards=[requires("worker")], status_code=200)
    async def claim_batch(
        self, request: Request[Any, Any, Any], pool: PoolDep, command_runner: CommandRunnerDep,
        data: JSONBody[ClaimBatch],
    ) -> Response[Any]:
        """Claim up to `max` tasks at once, each with a lease of its own; `{"tasks": []}`
        when there is nothing to claim."""
        ctx = ctx_of(request)
        types = list(dict.fromkeys(data.task_types))
        if ctx.idempotency_key is None and not await cmds.anything_to_claim(
                pool, ctx, task_types=types, projects=data.projects):
            return respond(TaskBatch(tasks=[]))

        async def fn(u: Any) -> TaskBatch:
            return TaskBatch(tasks=await cmds.claim_many(
                u, ctx, task_types=types, projects=data.projects, lease_seconds=data.lease_seconds,
                limit=data.max))

        return respond(await command_runner.run(request, ctx, fn))


ROUTES = [TaskBatchController]
