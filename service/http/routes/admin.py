"""Operators and auditors: projection status, rebuilds, and the log's hash chain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from litestar import Controller, Request, Response, get, post
from litestar.params import JSONBody, QueryParameter

from taskledger.events import audit
from taskledger.events.errors import Conflict, ValidationFailed
from taskledger.log import audit as stored_audit
from taskledger.projections import catalog, framework
from taskledger.service.http.auth import requires
from taskledger.service.ops.audit_key import load_or_create

log = logging.getLogger("taskledger.admin")


class RebuildRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    projection: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    wait: bool = False


class RebuildRun(msgspec.Struct, kw_only=True):
    projection: str
    state: str  # queued | running | done | failed
    folded_seq: int = 0
    target_seq: int = 0
    events_per_second: float | None = None
    seconds: float | None = None
    swap_ms: float | None = None
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None


class RebuildAccepted(msgspec.Struct, kw_only=True):
    rebuilds: list[RebuildRun]


class ProjectionInfo(framework.ProjectionStatus, kw_only=True):
    rebuild: RebuildRun | None


class ProjectionList(msgspec.Struct, kw_only=True):
    projections: list[ProjectionInfo]
    head_seq: int


class RebuildInProgress(Conflict):
    code = "rebuild_in_progress"
    title = "A rebuild is already running"


def _runs(request: Request[Any, Any, Any]) -> dict[str, RebuildRun]:
    runs: dict[str, RebuildRun] = request.app.state.rebuilds
    return runs


async def _rebuild_all(
    dsn: str, projections: list[framework.Projection], runs: dict[str, RebuildRun]
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for p in projections:
            run = runs[p.name]
            run.state, run.started_at = "running", time.time()

            def progress(_: str, done: int, target: int, run: RebuildRun = run) -> None:
                run.folded_seq, run.target_seq = done, target

            try:
                res = await framework.rebuild(conn, p, progress=progress)
            except asyncio.CancelledError:
                run.state, run.error, run.finished_at = "failed", "cancelled", time.time()
                raise
            except Exception as e:
                log.exception("rebuild of %s failed", p.name)
                run.state, run.error, run.finished_at = "failed", f"{type(e).__name__}: {e}", time.time()
                continue
            run.state, run.finished_at = "done", time.time()
            run.folded_seq = run.target_seq = res.seq
            run.seconds, run.swap_ms = round(res.seconds, 3), round(res.swap_ms, 3)
            run.events_per_second = round(res.events_per_second, 1)
    finally:
        await conn.close()


class AdminController(Controller):
    path = "/admin"
    tags = ["admin"]

    @get("/projections", operation_id="listProjections")
    async def projections(self, request: Request[Any, Any, Any]) -> ProjectionList:
        stats = await framework.statuses(request.app.state.pool, catalog.PROJECTIONS)
        runs = _runs(request)
        return ProjectionList(
            head_seq=stats[0].head_seq if stats else 0,
            projections=[ProjectionInfo(**msgspec.structs.asdict(s), rebuild=runs.get(s.name))
                         for s in stats],
        )

    @post("/rebuild", operation_id="rebuildProjections", guards=[requires("admin")], status_code=202)
    async def rebuild(
        self, request: Request[Any, Any, Any], data: JSONBody[RebuildRequest | None] = None
    ) -> Response[RebuildAccepted]:
        body = data or RebuildRequest()
        try:
            chosen = catalog.select([body.projection] if body.projection else None)
        except KeyError as e:
            raise ValidationFailed(
                f"unknown projection {e.args[0]}; known: {', '.join(catalog.names())}") from e
        runs = _runs(request)
        busy = [p.name for p in chosen if p.name in runs and runs[p.name].state in ("queued", "running")]
        if busy:
            raise RebuildInProgress(f"a rebuild of {', '.join(busy)} is already running")
        for p in chosen:
            runs[p.name] = RebuildRun(projection=p.name, state="queued")
        state = request.app.state
        task = asyncio.create_task(_rebuild_all(state.settings.database_url, chosen, runs),
                                   name="taskledger-rebuild")
        state.background.append(task)
        task.add_done_callback(lambda t: state.background.remove(t) if t in state.background else None)
        if body.wait:
            await asyncio.shield(task)
            return Response(RebuildAccepted(rebuilds=[runs[p.name] for p in chosen]), status_code=200)
        return Response(RebuildAccepted(rebuilds=[runs[p.name] for p in chosen]), status_code=202)


async def _verify_in_thread(dsn: str, from_seq: int, to_seq: int | None,
                            key: Ed25519PublicKey) -> audit.VerifyResult:
    """Hashing the whole log is CPU work: it runs on its own loop in a worker
    thread, with its own connection, so the service's loop keeps serving."""

    async def go() -> audit.VerifyResult:
        conn = await asyncpg.connect(dsn)
        try:
            return await stored_audit.verify_table(conn, from_seq, to_seq, public_key=key)
        finally:
            await conn.close()

    return await asyncio.to_thread(asyncio.run, go())


@get("/audit/verify", operation_id="verifyAuditChain", tags=["audit"], guards=[requires("admin")])
async def verify_audit(
    request: Request[Any, Any, Any],
    from_seq: Annotated[int | None, QueryParameter(ge=1, le=2**62)] = None,
    to_seq: Annotated[int | None, QueryParameter(ge=1, le=2**62)] = None,
) -> audit.VerifyResult:
    """Recompute the hash chain, and check every signed checkpoint on the way."""
    if from_seq is not None and to_seq is not None and to_seq < from_seq:
        raise ValidationFailed("to_seq must not be below from_seq")
    state = request.app.state
    return await _verify_in_thread(state.settings.database_url, from_seq or 1, to_seq,
                                   state.audit_key.public_key())


class AuditKey(msgspec.Struct, kw_only=True):
    algorithm: str
    public_key: str
    key_id: str


@get("/audit/key", operation_id="getAuditKey", tags=["audit"])
async def audit_key(request: Request[Any, Any, Any]) -> AuditKey:
    """The public key that signs `audit.checkpoint` events (base64 of the raw 32
    bytes): what `taskledger audit verify --public-key` takes."""
    pub = request.app.state.audit_key.public_key()
    return AuditKey(algorithm="Ed25519", public_key=audit.public_key_text(pub), key_id=audit.key_id(pub))


ROUTES = [AdminController, verify_audit, audit_key]


async def _checkpointer(app: Any) -> None:
    """Append a signed checkpoint when one is due. The look is cheap and outside
    the head lock; the writer's command looks again under the lock, so replicas
    that find it due together still append one checkpoint between them. This
    process's commits wake it as soon as `every_events` have passed; other
    replicas' commits are seen at the next tick."""
    state = app.state
    settings = state.settings
    every_events, every_seconds = settings.audit_checkpoint_every_events, settings.audit_checkpoint_every_seconds
    tick = min(1.0, every_seconds) if every_seconds else 1.0
    key = state.audit_key
    started_at = datetime.now(UTC)
    wake = asyncio.Event()
    last_seen = [0]

    def on_commit(head: int) -> None:
        if every_events and head - last_seen[0] >= every_events:
            wake.set()

    state.commit_listeners.append(on_commit)

    async def command(uow: Any) -> None:
        await stored_audit.append_checkpoint(uow.log, key, every_events=every_events, every_seconds=every_seconds,
                                      started_at=started_at)

    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), tick)
        wake.clear()
        try:
            head, last_seq, last_at = await stored_audit.checkpoint_look(state.pool)
            last_seen[0] = int(last_seq or 0)
            if audit.checkpoint_due(head, last_seq, last_at, datetime.now(UTC),
                                    every_events, every_seconds, started_at):
                await state.writer.submit(command)
                last_seen[0] = head
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the database is down, the writer busy: the next pass retries
            log.warning("audit checkpoint failed: %r", e)


def startup(app: Any) -> None:
    app.state.rebuilds = {}
    app.state.audit_key = load_or_create(app.state.settings)
    settings = app.state.settings
    if settings.audit_checkpoint_every_events or settings.audit_checkpoint_every_seconds:
        app.state.background.append(asyncio.create_task(_checkpointer(app), name="taskledger-audit-checkpoints"))
