"""Liveness, readiness, metrics, tokens and the global event log."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Litestar, Request, Response, delete, get, post
from litestar.params import JSONBody, Parameter, QueryParameter

from taskledger import log as store
from taskledger.events.errors import NotFound, ValidationFailed
from taskledger.service.http import server_signals
from taskledger.service.http.auth import Principal, TokenInfo, create_token, list_tokens, requires, revoke_token
from taskledger.service.http.routes.common import SinceSeq, known_query_only, split_types

log = logging.getLogger("taskledger.system")


class TokenRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["admin", "producer", "worker", "reviewer", "reader"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@ -]+$")]
    node: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    expires_in_seconds: Annotated[int, msgspec.Meta(ge=1, le=10 * 366 * 86400)] | None = None


class TokenResponse(msgspec.Struct, kw_only=True):
    id: str
    token: str
    name: str
    role: str
    node: str | None
    expires_at: datetime | None


class TokenList(msgspec.Struct, kw_only=True):
    tokens: list[TokenInfo]


class TokenNotFound(NotFound):
    code = "token_not_found"
    title = "Token not found"


class EventPage(msgspec.Struct, kw_only=True):
    events: list[Any]
    next_seq: int
    head_seq: int


class SystemController(Controller):
    @get("/healthz", operation_id="healthz", tags=["system"])
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/readyz", operation_id="readyz", tags=["system"])
    async def readyz(self, request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        state = request.app.state
        if state.draining:
            # Told to stop: out of the balancer's rotation first, still serving.
            return Response({"status": "draining"}, status_code=503)
        try:
            head = (await store.head(state.pool)).seq
        except Exception as e:  # readiness reports, never raises
            # the driver's text names hosts, sockets and users: the log has it
            log.warning("readiness check: the database is not reachable: %r", e)
            return Response({"status": "unavailable", "detail": "the database is not reachable"},
                            status_code=503, headers={"Retry-After": "1"})
        if not state.writer.alive:
            return Response({"status": "unavailable", "detail": "writer stopped"}, status_code=503,
                            headers={"Retry-After": "1"})
        return Response({"status": "ready", "head_seq": head}, status_code=200)

    @get("/metrics", operation_id="metrics", tags=["system"], media_type="text/plain; version=0.0.4")
    async def metrics(self, request: Request[Any, Any, Any]) -> str:
        state = request.app.state
        text: bytes = await state.metrics.render(state.pool)
        return text.decode()

    @post("/tokens", operation_id="createToken", tags=["auth"], guards=[requires("admin")], status_code=201)
    async def create(self, request: Request[Any, Any, Any], data: JSONBody[TokenRequest]) -> TokenResponse:
        if data.role == "worker" and data.node is None:
            raise ValidationFailed("a worker token needs a node")
        new = await create_token(request.app.state.pool, role=data.role, name=data.name, node=data.node,
                                 expires_in_seconds=data.expires_in_seconds)
        return TokenResponse(id=new.id, token=new.token, name=data.name, role=data.role, node=data.node,
                             expires_at=new.expires_at)

    @get("/tokens", operation_id="listTokens", tags=["auth"], guards=[requires("admin")])
    async def list_tokens(self, request: Request[Any, Any, Any]) -> TokenList:
        return TokenList(tokens=await list_tokens(request.app.state.pool))

    @delete("/tokens/{token_id:int}", operation_id="revokeToken", tags=["auth"], guards=[requires("admin")],
            status_code=200)
    async def revoke(
        self, request: Request[Any, Any, Any],
        token_id: Annotated[int, Parameter(ge=1, le=2**62)],
    ) -> TokenInfo:
        """Revoke a token: every replica refuses it within a second, and its open
        streams end. Revoking again answers the same record."""
        info = await revoke_token(request.app.state.pool, token_id)
        if info is None:
            raise TokenNotFound(f"token {token_id} does not exist")
        return info

    @get("/events", operation_id="listEvents", tags=["events"], guards=[known_query_only])
    async def events(
        self,
        request: Request[Any, Any, Any],
        since_seq: SinceSeq = None,
        limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 1000,
        types: Annotated[str | None, QueryParameter(max_length=4000)] = None,
        stream: Annotated[str | None, QueryParameter(max_length=200)] = None,
        project: Annotated[str | None, QueryParameter(max_length=200)] = None,
    ) -> EventPage:
        assert isinstance(request.user, Principal)
        pool = request.app.state.pool
        head_seq, _ = await store.head(pool)
        since = since_seq or 0
        if since > head_seq:
            raise ValidationFailed(f"since_seq {since} is beyond the head of the log ({head_seq})")
        rows = await store.read_json(
            pool, since_seq=since, limit=limit, types=split_types(types), stream=stream, project=project
        )
        # A short page means every match up to the head we read first was
        # returned, so the cursor may skip ahead to that head.
        last = rows[-1][0] if rows else since
        next_seq = last if len(rows) == limit else max(last, head_seq)
        return EventPage(
            events=[msgspec.Raw(j.encode()) for _, _, j in rows],
            next_seq=next_seq,
            head_seq=head_seq,
        )
ROUTES = [SystemController]


async def _forget_old_idempotency_keys(app: Any) -> None:
    """Delete idempotency keys past their TTL (lookups ignore them already), a
    bounded batch at a time, so the table stays the size of a day's writes."""
    state = app.state
    ttl = float(state.settings.idempotency_ttl_seconds)
    while True:
        try:
            n = await state.pool.fetchval(
                "WITH old AS (SELECT token_hash, key FROM idempotency_keys "
                "WHERE created_at < now() - make_interval(secs => $1) LIMIT 10000), "
                "gone AS (DELETE FROM idempotency_keys i USING old "
                "WHERE i.token_hash = old.token_hash AND i.key = old.key RETURNING 1) "
                "SELECT count(*) FROM gone", ttl)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the database is down: try again later
            log.warning("forgetting old idempotency keys failed: %r", e)
            n = 0
        await asyncio.sleep(1 if n else min(60.0, max(ttl / 10, 1.0)))


def startup(app: Litestar) -> None:
    state = app.state
    state.draining = False

    def drain() -> None:
        state.draining = True

    server_signals.on_drain(drain)
    app.state.background.append(
        asyncio.create_task(_forget_old_idempotency_keys(app), name="taskledger-idempotency-ttl"))
