"""Operators and auditors: projection status, rebuilds, and the log's hash chain."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import asyncpg
import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from litestar import Controller, Response, get, post
from litestar.params import JSONBody, QueryParameter

from taskledger.events import audit
from taskledger.events.errors import Conflict, ValidationFailed
from taskledger.log import audit as stored_audit
from taskledger.projections import catalog, framework
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import AuditKeyDep, BackgroundDep, PoolDep, RebuildsDep, SettingsDep
from taskledger.service.ops.rebuilds import RebuildRun, rebuild_all

log = logging.getLogger("taskledger.admin")


class RebuildRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    projection: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    wait: bool = False


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


class AdminController(Controller):
    path = "/admin"
    tags = ["admin"]

    @get("/projections", operation_id="listProjections")
    async def projections(self, pool: PoolDep, rebuilds: RebuildsDep) -> ProjectionList:
        stats = await framework.statuses(pool, catalog.PROJECTIONS)
        runs = rebuilds
        return ProjectionList(
            head_seq=stats[0].head_seq if stats else 0,
            projections=[ProjectionInfo(**msgspec.structs.asdict(s), rebuild=runs.get(s.name))
                         for s in stats],
        )

    @post("/rebuild", operation_id="rebuildProjections", guards=[requires("admin")], status_code=202)
    async def rebuild(
        self, settings: SettingsDep, rebuilds: RebuildsDep, background: BackgroundDep,
        data: JSONBody[RebuildRequest | None] = None,
    ) -> Response[RebuildAccepted]:
        body = data or RebuildRequest()
        try:
            chosen = catalog.select([body.projection] if body.projection else None)
        except KeyError as e:
            raise ValidationFailed(
                f"unknown projection {e.args[0]}; known: {', '.join(catalog.names())}") from e
        runs = rebuilds
        busy = [p.name for p in chosen if p.name in runs and runs[p.name].state in ("queued", "running")]
        if busy:
            raise RebuildInProgress(f"a rebuild of {', '.join(busy)} is already running")
        for p in chosen:
            runs[p.name] = RebuildRun(projection=p.name, state="queued")
        assert settings.database_url is not None
        task = asyncio.create_task(rebuild_all(settings.database_url, chosen, runs), name="taskledger-rebuild")
        background.append(task)
        task.add_done_callback(lambda t: background.remove(t) if t in background else None)
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
    settings: SettingsDep, audit_key: AuditKeyDep,
    from_seq: Annotated[int | None, QueryParameter(ge=1, le=2**62)] = None,
    to_seq: Annotated[int | None, QueryParameter(ge=1, le=2**62)] = None,
) -> audit.VerifyResult:
    """Recompute the hash chain, and check every signed checkpoint on the way."""
    if from_seq is not None and to_seq is not None and to_seq < from_seq:
        raise ValidationFailed("to_seq must not be below from_seq")
    assert settings.database_url is not None
    return await _verify_in_thread(settings.database_url, from_seq or 1, to_seq, audit_key.public_key())


class AuditKey(msgspec.Struct, kw_only=True):
    algorithm: str
    public_key: str
    key_id: str


@get("/audit/key", operation_id="getAuditKey", tags=["audit"])
async def audit_key(audit_key: AuditKeyDep) -> AuditKey:
    """The public key that signs `audit.checkpoint` events (base64 of the raw 32
    bytes): what `taskledger audit verify --public-key` takes."""
    pub = audit_key.public_key()
    return AuditKey(algorithm="Ed25519", public_key=audit.public_key_text(pub), key_id=audit.key_id(pub))


ROUTES = [AdminController, verify_audit, audit_key]

