"""Jobs: create, read, cancel; the runner's claim and report (the lease sweeper is in service.ops.sweepers).

`GET /jobs/{id}/stream` (SSE) is served by the generic stream routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Annotated, Any, Final, Literal

import asyncpg
import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from taskledger import log as store
from taskledger.events.errors import JobNotFound, ValidationFailed
from taskledger.events.job import events as job_events
from taskledger.events.job import rules as job_rules
from taskledger.events.job import state as job_state
from taskledger.projections import jobs as job_views
from taskledger.projections.jobs import replay, stream_of
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import CommandRunnerDep, PoolDep, SettingsDep
from taskledger.service.http.routes.common import StreamSinceSeq, check_id, known_query_only, respond
from taskledger.service.writer import jobs as job_commands
from taskledger.service.writer.commands import Stored, ctx_of

log = logging.getLogger("taskledger.jobs")

MAX_COMMANDS: Final = 1000
MAX_COMMAND_CHARS: Final = 8192
WAIT_POLL_SECONDS: Final = 0.1
WAIT_MAX_SECONDS: Final = 300.0
# The most of a command's output a report may carry: runners keep a tail (4 KiB by default).
MAX_OUTPUT_CHARS: Final = 16384
MAX_COMMAND_TIMEOUT_SECONDS: Final = 7 * 24 * 3600.0

Project = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")]
CommandText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_COMMAND_CHARS)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:/=-]+$")]
JobId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
LeaseSeconds = Annotated[int, msgspec.Meta(ge=1, le=3600)]


class CreateJobRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    commands: Annotated[list[CommandText], msgspec.Meta(min_length=1, max_length=MAX_COMMANDS)]
    project: Project | None = None
    job_id: JobId | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: Annotated[list[Label], msgspec.Meta(max_length=32)] = []
    # A runner kills a command still running after this many seconds and reports it timed out.
    command_timeout_seconds: (
        Annotated[float, msgspec.Meta(gt=0, le=MAX_COMMAND_TIMEOUT_SECONDS)] | None
    ) = None


class ClaimRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lease_seconds: LeaseSeconds | None = None
    projects: Annotated[list[Project], msgspec.Meta(min_length=1, max_length=100)] | None = None


ReportEvent = job_rules.ReportEvent


class ReportRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    event: ReportEvent
    lease_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    stage: (
        Literal[
            "init", "load_cache", "select_cmds", "running", "parallel", "sequential", "completing", "cleanup"
        ]
        | None
    ) = None
    command: CommandText | None = None
    index: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMMANDS)] | None = None
    total: Annotated[int, msgspec.Meta(ge=1, le=MAX_COMMANDS)] | None = None
    exit_code: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    duration: Annotated[float, msgspec.Meta(ge=0, le=1e8)] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=4000)] | None = None
    error: Annotated[str, msgspec.Meta(min_length=1, max_length=16000)] | None = None
    status: Literal["completed", "failed", "cancelled"] | None = None
    result: Any = None
    # command_completed: the tail of the command's output, and whether it was killed for its timeout.
    output: Annotated[str, msgspec.Meta(max_length=MAX_OUTPUT_CHARS)] | None = None
    output_truncated: bool | None = None
    timed_out: bool | None = None
    # Sent by runners for their own display; the service measures time itself.
    elapsed_sec: Annotated[float, msgspec.Meta(ge=0)] | None = None
    eta_sec: Annotated[float, msgspec.Meta(ge=0)] | None = None
    state: Annotated[str, msgspec.Meta(max_length=32)] | None = None


# Which fields each report may carry (besides `event` and `lease_id`).
_REPORT_FIELDS: Final[dict[str, frozenset[str]]] = {
    "stage": frozenset({"stage"}),
    "command_started": frozenset({"command", "index", "total"}),
    "command_completed": frozenset(
        {"command", "index", "total", "exit_code", "duration", "output", "output_truncated", "timed_out"}
    ),
    "cache_hit": frozenset({"command", "index", "total"}),
    "command_skipped": frozenset({"command", "index", "total", "reason"}),
    "heartbeat": frozenset({"elapsed_sec", "eta_sec", "state"}),
    "error": frozenset({"error", "command"}),
    "finish": frozenset({"status", "exit_code", "result", "error"}),
}
_OPTIONAL: Final = frozenset({"event", "lease_id"})


def _to_report(data: ReportRequest) -> job_rules.Report:
    allowed = _REPORT_FIELDS[data.event] | _OPTIONAL
    extra = sorted(f for f in data.__struct_fields__ if f not in allowed and getattr(data, f) is not None)
    if extra:
        raise ValidationFailed(f"a {data.event} report does not take {', '.join(extra)}")
    return job_rules.Report(
        event=data.event,
        stage=data.stage,
        command=data.command,
        index=data.index,
        total=data.total,
        exit_code=data.exit_code,
        duration=data.duration,
        reason=data.reason,
        error=data.error,
        status=data.status,
        result=data.result,
        output=data.output,
        output_truncated=bool(data.output_truncated),
        timed_out=bool(data.timed_out),
    )


class EventsPage(msgspec.Struct, kw_only=True):
    events: list[Any]
    next_seq: int


async def _wait_for_end(pool: asyncpg.Pool, job_id: str, seconds: float) -> dict[str, Any]:
    """Poll the view (shared by every replica) until the job ends or `timeout` passes."""
    deadline = time.monotonic() + seconds
    while True:
        current = await job_commands.read_view(pool, job_id)
        if current is None:
            raise JobNotFound(f"job {job_id} does not exist", job_id=job_id)
        if current["state"] in job_state.TERMINAL or time.monotonic() >= deadline:
            return current
        await asyncio.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


class JobController(Controller):
    path = "/jobs"
    guards = [known_query_only]
    tags = ["jobs"]

    # A worker may start a job too: a checker starts its own verification run (seed 001).
    @post("/", operation_id="createJob", guards=[requires("producer", "worker")], status_code=201)
    async def create(
        self,
        request: Request[Any, Any, Any],
        pool: PoolDep,
        command_runner: CommandRunnerDep,
        data: JSONBody[CreateJobRequest],
        wait: FromQuery[bool] = False,
        wait_seconds: Annotated[float, QueryParameter(name="timeout", ge=0, le=WAIT_MAX_SECONDS)] = 30.0,
    ) -> Response[Any]:
        """Create a job (pending) and answer at once; `?wait=true` answers when it ends
        or, after `timeout` seconds, with its current status."""
        ctx = ctx_of(request)
        cmd = job_rules.CreateJob(
            job_id=data.job_id or "job-" + uuid.uuid4().hex,
            commands=list(data.commands),
            project=data.project,
            parallel=data.parallel,
            fail_fast=data.fail_fast,
            labels=list(data.labels),
            command_timeout_seconds=data.command_timeout_seconds,
            created_by=job_events.Actor(name=ctx.principal.name, role=ctx.principal.role, node=ctx.principal.node),
        )
        result = await command_runner.run(request, ctx, job_commands.create(ctx, cmd), status=201)
        if not wait:
            return respond(result, 201)
        job_id = cmd.job_id
        if isinstance(result, Stored):
            job_id = msgspec.json.decode(result.body)["job_id"]
        return Response(await _wait_for_end(pool, job_id, wait_seconds), status_code=201)

    @get("/", operation_id="listJobs")
    async def list_jobs(
        self,
        pool: PoolDep,
        job_state: Annotated[
            Literal["pending", "running", "cancelling", "completed", "failed", "cancelled"] | None,
            QueryParameter(name="state"),
        ] = None,
        project: Annotated[str | None, QueryParameter(max_length=128)] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        after: Annotated[int | None, QueryParameter(ge=0, le=2**62)] = None,
    ) -> dict[str, Any]:
        """Jobs in creation order; `after` is the `created_seq` of the last one seen."""
        rows = await job_views.list_page(pool, after_created_seq=after or 0, state=job_state, project=project,
                                         limit=limit)
        jobs = [job_commands.view(r.state, r.now, r.lease_expires_at) for r in rows]
        return {"jobs": jobs, "next_after": rows[-1].created_seq if rows else after or 0}

    @get("/{job_id:str}", operation_id="getJob")
    async def get_job(
        self, pool: PoolDep, job_id: FromPath[str],
        as_of_seq: Annotated[int | None, QueryParameter(ge=0, le=2**62)] = None,
    ) -> dict[str, Any]:
        check_id(job_id, "job id")
        if as_of_seq is not None:
            return await _job_as_of(pool, job_id, as_of_seq)
        out = await job_commands.read_view(pool, job_id)
        if out is None:
            raise JobNotFound(f"job {job_id} does not exist", job_id=job_id)
        return out

    @get("/{job_id:str}/events", operation_id="listJobEvents")
    async def events(
        self,
        pool: PoolDep,
        job_id: FromPath[str],
        since_seq: StreamSinceSeq = None,
        limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 1000,
    ) -> EventsPage:
        """The job's events after `since_seq`, a position in the job's own stream (1, 2, 3, …)."""
        check_id(job_id, "job id")
        since = since_seq or 0
        async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            if not await job_views.exists(conn, job_id):
                raise JobNotFound(f"job {job_id} does not exist", job_id=job_id)
            rows = await store.stream_rows(conn, stream_of(job_id), since, limit)
        return EventsPage(
            events=[msgspec.Raw(store.event_json(r).encode()) for r in rows],
            next_seq=rows[-1]["stream_seq"] if rows else since,
        )

    @post("/{job_id:str}/cancel", operation_id="cancelJob", guards=[requires("producer")], status_code=200)
    async def cancel(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, job_id: FromPath[str]
    ) -> Response[Any]:
        """pending → cancelled; running → cancelling (until the runner confirms);
        cancelled → 409 job_already_cancelled; completed or failed → 200, final status."""
        check_id(job_id, "job id")
        ctx = ctx_of(request)
        return respond(await command_runner.run(request, ctx, job_commands.cancel(ctx, job_id)), 200)

    @post("/claim", operation_id="claimJob", guards=[requires("worker")], status_code=200)
    async def claim(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, settings: SettingsDep,
        data: JSONBody[ClaimRequest],
    ) -> Response[Any]:
        """The oldest pending job, now running under a lease held by the caller; 204 when none."""
        ctx = ctx_of(request)
        lease = data.lease_seconds or settings.job_heartbeat_timeout_seconds
        result = await command_runner.run(
            request, ctx, job_commands.claim(ctx, lease_seconds=lease, projects=data.projects))
        if result is None:
            return Response(content=None, status_code=204)
        return respond(result, 200)

    @post("/{job_id:str}/report", operation_id="reportJob", guards=[requires("worker")], status_code=200)
    async def report(
        self, request: Request[Any, Any, Any], command_runner: CommandRunnerDep, job_id: FromPath[str],
        data: JSONBody[ReportRequest],
    ) -> Response[Any]:
        """A runner's report. Every report renews the lease; the answer is the job's
        view, whose `cancel_requested` (and `state: cancelling`) tells the runner to stop."""
        check_id(job_id, "job id")
        ctx = ctx_of(request)
        r = _to_report(data)
        return respond(await command_runner.run(request, ctx, job_commands.report(ctx, job_id, r, data.lease_id)), 200)


ROUTES = [JobController]


async def _job_as_of(pool: Any, job_id: str, as_of_seq: int) -> dict[str, Any]:
    """The job as it stood after global seq `as_of_seq`, timed as of that event."""
    head = (await store.head(pool)).seq
    if as_of_seq > head:
        raise ValidationFailed(f"as_of_seq {as_of_seq} is beyond the head of the log ({head})")
    state = await replay(pool, job_id, to_seq=as_of_seq)
    if state is None:
        raise JobNotFound(f"job {job_id} did not exist at seq {as_of_seq}", job_id=job_id)
    at = await store.recorded_at(pool, as_of_seq)
    assert at is not None  # as_of_seq is within the head, and the log has no gaps
    return job_commands.view(state, at)

