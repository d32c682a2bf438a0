"""Tasks: create, claim, report, verify, collect, unblock, round reviews, blockers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, JSONBody, QueryParameter

from taskledger import log as store
from taskledger.events.errors import TaskNotFound, ValidationFailed
from taskledger.events.task.events import Requirement, RequirementVerdict, Verification
from taskledger.events.task.panel import Verdict
from taskledger.events.task.rounds import Review
from taskledger.events.task.rules import NewTask
from taskledger.events.task.state import StateName, TaskState
from taskledger.projections import tasks as views
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import CommandRunnerDep, PoolDep, SettingsDep
from taskledger.service.http.routes.common import ID_PATTERN, StreamSinceSeq, check_id, known_query_only, respond
from taskledger.service.settings import Settings
from taskledger.service.writer import tasks as cmds
from taskledger.service.writer.commands import Ctx, ctx_of
from taskledger.service.writer.engine import UnitOfWork

log = logging.getLogger("taskledger.tasks")

Str128 = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
IdStr = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
Checker = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Text = Annotated[str, msgspec.Meta(max_length=100_000)]
ShortText = Annotated[str, msgspec.Meta(max_length=10_000)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
Node = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]


class RequirementBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: IdStr
    text: ShortText = ""
    check: ShortText | None = None


class VerificationBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    checkers: Annotated[list[Checker], msgspec.Meta(min_length=1, max_length=16)] = msgspec.field(
        default_factory=lambda: ["verifier"])
    priority: Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)] | None = None
    estimated_minutes: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | None = None


class TaskFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    title: Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]
    id: IdStr | None = None
    project: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")] | None = None
    spec: Text = ""
    task_type: Literal["implement", "verify"] = "implement"
    priority: Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)] = 0
    estimated_minutes: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | None = None
    requirements: Annotated[list[RequirementBody], msgspec.Meta(max_length=200)] = []
    verification: VerificationBody | msgspec.UnsetType | None = msgspec.UNSET
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    retry_predecessor: bool = True
    assignee: Str128 | None = None
    labels: Annotated[list[Label], msgspec.Meta(max_length=50)] = []
    node_blacklist: Annotated[list[Node], msgspec.Meta(max_length=100)] = []
    escalate_after_seconds: Annotated[int, msgspec.Meta(ge=1, le=31_536_000)] | None = None


class CreateTask(TaskFields, forbid_unknown_fields=True, kw_only=True):
    parent_task_id: IdStr | None = None


def to_new_task(b: TaskFields, *, parent_task_id: str | None, project: str | None = None) -> NewTask:
    proj = b.project or project
    if proj is None:
        raise ValidationFailed("project is required")
    verification = (
        Verification() if b.verification is msgspec.UNSET
        else None if b.verification is None
        else Verification(checkers=list(b.verification.checkers), priority=b.verification.priority,
                          estimated_minutes=b.verification.estimated_minutes)
    )
    return NewTask(
        id=b.id or f"T-{uuid.uuid4().hex[:16]}", project=proj, title=b.title, spec=b.spec,
        task_type=b.task_type, parent_task_id=parent_task_id, priority=b.priority,
        estimated_minutes=b.estimated_minutes,
        requirements=[Requirement(id=r.id, text=r.text, check=r.check) for r in b.requirements],
        verification=verification, max_attempts=b.max_attempts, retry_predecessor=b.retry_predecessor,
        assignee=b.assignee, labels=list(b.labels), node_blacklist=list(b.node_blacklist),
        escalate_after_seconds=b.escalate_after_seconds,
    )


class ClaimBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    task_types: Annotated[list[Literal["implement", "verify"]], msgspec.Meta(min_length=1, max_length=2)] = (
        msgspec.field(default_factory=lambda: ["implement", "verify"]))
    projects: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=128)]],
                        msgspec.Meta(min_length=1, max_length=100)] | None = None
    lease_seconds: Annotated[int, msgspec.Meta(ge=5, le=86_400)] = 60


class LeaseBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lease_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class HeartbeatBody(LeaseBody, forbid_unknown_fields=True, kw_only=True):
    lease_seconds: Annotated[int, msgspec.Meta(ge=5, le=86_400)] | None = None


class VerdictBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requirement_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    verdict: Literal["PASS", "FAIL"]
    reason: ShortText = ""


class CompleteBody(LeaseBody, forbid_unknown_fields=True, kw_only=True):
    result: Any = None
    outcome: Literal["PASS", "FAIL", "BLOCKED"] | None = None
    verdicts: Annotated[list[VerdictBody], msgspec.Meta(max_length=500)] = []
    category: Literal["code", "environment", "info_missing", "infrastructure"] | None = None
    reason: ShortText = ""

    def verdict(self) -> Verdict | None:
        if self.outcome is None:
            if self.verdicts or self.category is not None or self.reason:
                raise ValidationFailed("verdicts, category and reason go with an outcome, on verify tasks")
            return None
        return Verdict(outcome=self.outcome, category=self.category, reason=self.reason, verdicts=[
            RequirementVerdict(requirement_id=v.requirement_id, verdict=v.verdict, reason=v.reason)
            for v in self.verdicts])


class ReleaseBody(LeaseBody, forbid_unknown_fields=True, kw_only=True):
    reason: ShortText = ""


class ReassignBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    assignee: Str128 | None


class FailBody(LeaseBody, forbid_unknown_fields=True, kw_only=True):
    error: ShortText = ""


class CancelBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    reason: ShortText = ""


class UnblockBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    action: Literal["retry", "reverify"] = "retry"
    notes: ShortText | None = None


class SubtaskBody(TaskFields, forbid_unknown_fields=True, kw_only=True):
    pass


class RoundReviewBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"]
    notes: ShortText = ""
    goal_clear: bool | ShortText | None = None
    coverage: ShortText | None = None
    next_round: ShortText | None = None
    new_subtasks: Annotated[list[SubtaskBody], msgspec.Meta(max_length=500)] = []


class CollectBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    project: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100


class TaskList(msgspec.Struct, kw_only=True):
    tasks: list[Any]
    next_after: str | None


class CollectResult(msgspec.Struct, kw_only=True):
    tasks: list[TaskState]


class StreamPage(msgspec.Struct, kw_only=True):
    events: list[Any]
    next_seq: int


class BlockerList(msgspec.Struct, kw_only=True):
    blockers: list[Any]


def default_escalation(settings: Settings) -> int:
    return int(settings.escalate_after_seconds)


def viewer(ctx: Ctx) -> str | None:
    """Whose lease ids a caller may see: its own token's (None: an admin, every one)."""
    return None if ctx.principal.role == "admin" else ctx.principal.token_id


def seen_by(ctx: Ctx, fn: Callable[[UnitOfWork], Awaitable[TaskState]]) -> Callable[[UnitOfWork], Awaitable[TaskState]]:
    """A command whose answer is the view as the caller may see it."""

    async def go(u: UnitOfWork) -> TaskState:
        return views.visible_to(await fn(u), viewer(ctx))

    return go


class TaskController(Controller):
    path = "/tasks"
    tags = ["tasks"]
    guards = [known_query_only]

    @post("/", operation_id="createTask", guards=[requires("producer")], status_code=201)
    async def create(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, settings: SettingsDep,
        data: JSONBody[CreateTask],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        t = to_new_task(data, parent_task_id=data.parent_task_id)
        esc = default_escalation(settings)
        ids = [t.id, t.parent_task_id] if t.parent_task_id else [t.id]
        return respond(await command_runner.run(
            request, ctx, seen_by(ctx, lambda u: cmds.create(u, ctx, t, default_escalation=esc)),
            status=201, prefetch=[("tasks", i) for i in ids]), 201)

    @get("/", operation_id="listTasks")
    async def list_tasks(
        self,
        request: Request[Any, Any, Any],
        pool: PoolDep,
        task_state: Annotated[StateName | None, QueryParameter(name="state")] = None,
        project: Annotated[str | None, QueryParameter(max_length=128)] = None,
        parent_task_id: Annotated[str | None, QueryParameter(max_length=128)] = None,
        task_type: Annotated[Literal["implement", "verify"] | None, QueryParameter()] = None,
        assignee: Annotated[str | None, QueryParameter(max_length=128)] = None,
        worker: Annotated[str | None, QueryParameter(max_length=128)] = None,
        node: Annotated[str | None, QueryParameter(max_length=128)] = None,
        label: Annotated[str | None, QueryParameter(max_length=100)] = None,
        escalated: Annotated[bool | None, QueryParameter()] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        after: Annotated[str | None, QueryParameter(max_length=128)] = None,
    ) -> TaskList:
        ctx = ctx_of(request)
        cursor = None
        if after is not None:
            check_id(after, "after")
            cursor = await views.created_seq_of(pool, after)
            if cursor is None:
                raise ValidationFailed(f"after: no task {after}")
        flt = views.TaskFilter(state=task_state, project=project, parent_task_id=parent_task_id,
                               task_type=task_type, assignee=assignee, worker=worker, node=node, label=label,
                               escalated=escalated)
        rows = await views.list_views(pool, flt, viewer=viewer(ctx), after_created_seq=cursor, limit=limit + 1)
        items = [msgspec.Raw(body.encode()) for body in rows[:limit]]
        next_after = None
        if len(rows) > limit:
            next_after = msgspec.json.decode(rows[limit - 1])["id"]
        return TaskList(tasks=items, next_after=next_after)

    @post("/claim", operation_id="claimTask", guards=[requires("worker")], status_code=200)
    async def claim(
        self, request: Request[Any, Any, Any], pool: PoolDep, command_runner: CommandRunnerDep,
        data: JSONBody[ClaimBody],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        types = list(dict.fromkeys(data.task_types))
        if ctx.idempotency_key is None and not await cmds.anything_to_claim(
                pool, ctx, task_types=types, projects=data.projects):
            return Response(content=b"", status_code=204)
        result = await command_runner.run(request, ctx, lambda u: cmds.claim(
            u, ctx, task_types=types, projects=data.projects, lease_seconds=data.lease_seconds))
        if result is None:
            return Response(content=b"", status_code=204)
        return respond(result)

    @post("/collect", operation_id="collectTasks", guards=[requires("producer")], status_code=200)
    async def collect(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, data: JSONBody[CollectBody]
    ) -> Response[Any]:
        ctx = ctx_of(request)

        async def fn(u: Any) -> CollectResult:
            return CollectResult(tasks=await cmds.collect(u, ctx, project=data.project, limit=data.limit))

        return respond(await command_runner.run(request, ctx, fn))

    @get("/{task_id:str}", operation_id="getTask")
    async def get_task(
        self, request: Request[Any, Any, Any], pool: PoolDep, task_id: FromPath[str],
        as_of_seq: Annotated[int | None, QueryParameter(ge=0, le=2**62)] = None,
    ) -> Response[Any]:
        check_id(task_id, "task id")
        if as_of_seq is not None:
            head, _ = await store.head(pool)
            if as_of_seq > head:
                raise ValidationFailed(f"as_of_seq {as_of_seq} is beyond the head of the log ({head})")
            s = await views.state_as_of(pool, task_id, as_of_seq)
            if s is None:
                raise TaskNotFound(f"task {task_id} did not exist at seq {as_of_seq}", task_id=task_id)
            return Response(content=views.visible_to(s, viewer(ctx_of(request))))
        row = await pool.fetchrow(f"{views.view_sql(2)} WHERE t.id = $1", task_id, viewer(ctx_of(request)))
        if row is None:
            raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
        return Response(content=msgspec.Raw(row["body"].encode()))

    @get("/{task_id:str}/events", operation_id="getTaskEvents")
    async def events(
        self, pool: PoolDep, task_id: FromPath[str], since_seq: StreamSinceSeq = None,
        limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 1000,
    ) -> StreamPage:
        check_id(task_id, "task id")
        stream = f"task:{task_id}"
        last = await store.stream_version(pool, stream)
        if last is None:
            raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
        since = since_seq or 0
        if since > last:
            raise ValidationFailed(f"since_seq {since} is beyond the stream's last event ({last})")
        rows = await store.stream_rows(pool, stream, since, limit)
        return StreamPage(events=[msgspec.Raw(store.event_json(r).encode()) for r in rows],
                          next_seq=rows[-1]["stream_seq"] if rows else since)

    @post("/{task_id:str}/start", operation_id="startTask", guards=[requires("worker")], status_code=200)
    async def start(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[LeaseBody],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        return respond(await command_runner.run(
            request, ctx, lambda u: cmds.start(u, ctx, task_id, lease_id=data.lease_id), prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/heartbeat", operation_id="heartbeatTask", guards=[requires("worker")],
          status_code=200)
    async def heartbeat(
        self, request: Request[Any, Any, Any], pool: PoolDep, task_id: FromPath[str], data: JSONBody[HeartbeatBody]
    ) -> TaskState:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        return await cmds.heartbeat(pool, ctx, task_id, lease_id=data.lease_id,
                                    lease_seconds=data.lease_seconds)

    @post("/{task_id:str}/complete", operation_id="completeTask", guards=[requires("worker")],
          status_code=200)
    async def complete(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[CompleteBody],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        verdict = data.verdict()
        return respond(await command_runner.run(request, ctx, lambda u: cmds.complete(
            u, ctx, task_id, lease_id=data.lease_id, result=data.result, verdict=verdict),
            prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/fail", operation_id="failTask", guards=[requires("worker")], status_code=200)
    async def fail(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[FailBody],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        return respond(await command_runner.run(request, ctx, lambda u: cmds.fail(
            u, ctx, task_id, lease_id=data.lease_id, error=data.error), prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/cancel", operation_id="cancelTask", guards=[requires("producer")], status_code=200)
    async def cancel(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[CancelBody | None] = None,
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        reason = data.reason if data is not None else ""
        return respond(await command_runner.run(
            request, ctx, seen_by(ctx, lambda u: cmds.cancel(u, ctx, task_id, reason=reason)),
            prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/release", operation_id="releaseTask", guards=[requires("worker")], status_code=200)
    async def release(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[ReleaseBody],
    ) -> Response[Any]:
        """The lease holder gives its claim back: pending again, no attempt spent."""
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        return respond(await command_runner.run(request, ctx, lambda u: cmds.release(
            u, ctx, task_id, lease_id=data.lease_id, reason=data.reason), prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/reassign", operation_id="reassignTask", guards=[requires("producer")], status_code=200)
    async def reassign(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[ReassignBody],
    ) -> Response[Any]:
        """Directed work nobody took: give it to another worker, or to anyone (`null`)."""
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        return respond(await command_runner.run(request, ctx, seen_by(ctx, lambda u: cmds.reassign(
            u, ctx, task_id, assignee=data.assignee)), prefetch=[("tasks", task_id)]))

    @post("/{task_id:str}/unblock", operation_id="unblockTask", guards=[requires("producer")], status_code=200)
    async def unblock(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, task_id: FromPath[str],
        data: JSONBody[UnblockBody | None] = None,
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        body = data or UnblockBody()
        return respond(await command_runner.run(request, ctx, seen_by(ctx, lambda u: cmds.unblock(
            u, ctx, task_id, action=body.action, notes=body.notes))))

    @post("/{task_id:str}/round-review", operation_id="reviewRound", guards=[requires("reviewer")],
          status_code=200)
    async def round_review(
        self, request: Request[Any, Any, Any], pool: PoolDep, command_runner: CommandRunnerDep, settings: SettingsDep,
        task_id: FromPath[str], data: JSONBody[RoundReviewBody],
    ) -> Response[Any]:
        ctx = ctx_of(request)
        check_id(task_id, "task id")
        parent_project = await views.project_of(pool, task_id)
        subs = [to_new_task(b, parent_task_id=task_id, project=parent_project) for b in data.new_subtasks]
        review = Review(decision=data.decision, notes=data.notes, goal_clear=data.goal_clear,
                        coverage=data.coverage, next_round=data.next_round, new_subtasks=subs)
        esc = default_escalation(settings)
        return respond(await command_runner.run(request, ctx, seen_by(ctx, lambda u: cmds.round_review(
            u, ctx, task_id, review, default_escalation=esc))))


@get("/blockers", operation_id="listBlockers", tags=["tasks"], guards=[known_query_only])
async def list_blockers(
    pool: PoolDep,
    open: Annotated[bool | None, QueryParameter()] = None,
    project: Annotated[str | None, QueryParameter(max_length=128)] = None,
    task_id: Annotated[str | None, QueryParameter(max_length=128)] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
) -> BlockerList:
    rows = await views.list_blockers(pool, open=open, project=project, task_id=task_id, limit=limit)
    return BlockerList(blockers=[msgspec.Raw(body.encode()) for body in rows])


ROUTES = [TaskController, list_blockers]

