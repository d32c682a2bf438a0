"""Running a command for an HTTP request: actor metadata and idempotency keys."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
from litestar import Request

from taskledger.events.canonical import canonical_json
from taskledger.events.errors import IdempotencyConflict, ValidationFailed
from taskledger.service.logs import REQUEST_ID
from taskledger.service.tokens import Principal
from taskledger.service.writer.engine import Prefetch, UnitOfWork, Writer

T = TypeVar("T")

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")
# Request and correlation ids land in every event's meta: printable, bounded.
_TRACE_ID = re.compile(r"^[\x20-\x7e]{1,200}$")


class Ctx(msgspec.Struct, kw_only=True):
    """What a command knows about who asked and why."""

    principal: Principal
    request_id: str
    idempotency_key: str | None = None
    correlation_id: str | None = None

    def meta(self, **more: Any) -> dict[str, Any]:
        m: dict[str, Any] = {
            "actor": self.principal.name,
            "role": self.principal.role,
            "node": self.principal.node,
            "request_id": self.request_id,
        }
        if self.idempotency_key is not None:
            m["idempotency_key"] = self.idempotency_key
        if self.correlation_id is not None:
            m["correlation_id"] = self.correlation_id
        m.update({k: v for k, v in more.items() if v is not None})
        return m


def ctx_of(request: Request[Any, Any, Any]) -> Ctx:
    p = request.user
    assert isinstance(p, Principal)
    key = request.headers.get("idempotency-key")
    if key is not None and not _IDEMPOTENCY_KEY.match(key):
        raise ValidationFailed("Idempotency-Key must be 1-200 printable ASCII characters")
    corr = request.headers.get("x-correlation-id")
    if corr and not _TRACE_ID.match(corr):
        raise ValidationFailed("X-Correlation-Id must be 1-200 printable ASCII characters")
    request_id = request.headers.get("x-request-id")
    if request_id and not _TRACE_ID.match(request_id):
        raise ValidationFailed("X-Request-Id must be 1-200 printable ASCII characters")
    return Ctx(
        principal=p,
        # the id the request middleware logs with, when the client sent none
        request_id=request_id or REQUEST_ID.get() or uuid.uuid4().hex,
        idempotency_key=key,
        correlation_id=corr,
    )


class Stored(msgspec.Struct):
    """An answer replayed from the idempotency table."""

    status: int
    body: msgspec.Raw


class CommandRunner:
    """The writer as a route handler uses it (the `command_runner` dependency)."""

    def __init__(self, writer: Writer, *, idempotency_ttl_seconds: float) -> None:
        self.writer = writer
        self.idempotency_ttl_seconds = float(idempotency_ttl_seconds)

    async def run(
        self,
        request: Request[Any, Any, Any],
        ctx: Ctx,
        fn: Callable[[UnitOfWork], Awaitable[T]],
        *,
        status: int = 200,
        prefetch: Sequence[Prefetch] = (),
    ) -> T | Stored:
        """Submit `fn` to the writer; honour the Idempotency-Key header.

        The lookup and the record of the first answer run in the same batch
        transaction as the command, so two retries racing each other (even on two
        replicas) still get one execution and the same answer.
        """
        writer = self.writer
        key = ctx.idempotency_key
        if key is None:
            return await writer.submit(fn, prefetch=prefetch)
        body = await request.body()
        try:
            parsed = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError:
            parsed = body.decode("utf-8", "replace")
        request_hash = hashlib.sha256(
            request.method.encode() + b" " + request.url.path.encode() + b" " + canonical_json(parsed)
        ).hexdigest()
        token = ctx.principal.token_hash
        ttl = self.idempotency_ttl_seconds

        async def with_key(uow: UnitOfWork) -> T | Stored:
            # A key older than the TTL is forgotten, whether or not the sweep has
            # deleted its row yet: the request then runs as new.
            row = await uow.fetchrow(
                "SELECT request_hash, status, response::text AS response FROM idempotency_keys "
                "WHERE token_hash = $1 AND key = $2 AND created_at > now() - make_interval(secs => $3)",
                token, key, ttl,
            )
            if row is not None:
                if row["request_hash"] != request_hash:
                    raise IdempotencyConflict(
                        "this Idempotency-Key was used with a different request"
                    )
                return Stored(status=row["status"], body=msgspec.Raw(row["response"].encode()))
            result = await fn(uow)
            await uow.execute(
                "INSERT INTO idempotency_keys (token_hash, key, request_hash, status, response) "
                "VALUES ($1, $2, $3, $4, $5::jsonb) ON CONFLICT (token_hash, key) DO UPDATE SET "
                "request_hash = EXCLUDED.request_hash, status = EXCLUDED.status, response = EXCLUDED.response, "
                "created_at = now()",
                token, key, request_hash, status, msgspec.json.encode(result).decode(),
            )
            return result

        return await writer.submit(with_key, prefetch=prefetch)
