"""Liveness, readiness, metrics, tokens and the global event log."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import JSONBody, Parameter, QueryParameter

from taskledger import log as store
from taskledger.events.errors import NotFound, ValidationFailed
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import DrainingDep, MetricsDep, PoolDep, WriterDep
from taskledger.service.http.routes.common import SinceSeq, known_query_only, split_types
from taskledger.service.tokens import Principal, TokenInfo, create_token, list_tokens, revoke_token

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
    async def readyz(self, pool: PoolDep, writer: WriterDep, draining: DrainingDep) -> Response[dict[str, Any]]:
        if draining:
            # Told to stop: out of the balancer's rotation first, still serving.
            return Response({"status": "draining"}, status_code=503)
        try:
            head = (await store.head(pool)).seq
        except Exception as e:  # readiness reports, never raises
            # the driver's text names hosts, sockets and users: the log has it
            log.warning("readiness check: the database is not reachable: %r", e)
            return Response({"status": "unavailable", "detail": "the database is not reachable"},
                            status_code=503, headers={"Retry-After": "1"})
        if not writer.alive:
            return Response({"status": "unavailable", "detail": "writer stopped"}, status_code=503,
                            headers={"Retry-After": "1"})
        return Response({"status": "ready", "head_seq": head}, status_code=200)

    @get("/metrics", operation_id="metrics", tags=["system"], media_type="text/plain; version=0.0.4")
    async def metrics(self, pool: PoolDep, metrics: MetricsDep) -> str:
        text: bytes = await metrics.render(pool)
        return text.decode()

    @post("/tokens", operation_id="createToken", tags=["auth"], guards=[requires("admin")], status_code=201)
    async def create(self, pool: PoolDep, data: JSONBody[TokenRequest]) -> TokenResponse:
        if data.role == "worker" and data.node is None:
            raise ValidationFailed("a worker token needs a node")
        new = await create_token(pool, role=data.role, name=data.name, node=data.node,
                                 expires_in_seconds=data.expires_in_seconds)
        return TokenResponse(id=new.id, token=new.token, name=data.name, role=data.role, node=data.node,
                             expires_at=new.expires_at)

    @get("/tokens", operation_id="listTokens", tags=["auth"], guards=[requires("admin")])
    async def list_tokens(self, pool: PoolDep) -> TokenList:
        return TokenList(tokens=await list_tokens(pool))

    @delete("/tokens/{token_id:int}", operation_id="revokeToken", tags=["auth"], guards=[requires("admin")],
            status_code=200)
    async def revoke(
        self, pool: PoolDep,
        token_id: Annotated[int, Parameter(ge=1, le=2**62)],
    ) -> TokenInfo:
        """Revoke a token: every replica refuses it within a second, and its open
        streams end. Revoking again answers the same record."""
        info = await revoke_token(pool, token_id)
        if info is None:
            raise TokenNotFound(f"token {token_id} does not exist")
        return info

    @get("/events", operation_id="listEvents", tags=["events"], guards=[known_query_only])
    async def events(
        self,
        request: Request[Any, Any, Any],
        pool: PoolDep,
        since_seq: SinceSeq = None,
        limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 1000,
        types: Annotated[str | None, QueryParameter(max_length=4000)] = None,
        stream: Annotated[str | None, QueryParameter(max_length=200)] = None,
        project: Annotated[str | None, QueryParameter(max_length=200)] = None,
    ) -> EventPage:
        assert isinstance(request.user, Principal)
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

