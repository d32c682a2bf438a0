"""Bearer tokens: stored as sha256, cached briefly in process, checked by role."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any, Final

import asyncpg
import msgspec
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult

from events.errors import AlreadyExists

ROLES: Final = ("admin", "producer", "worker", "reviewer", "reader")


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    node: str | None
    token_hash: str
    token_id: str = ""  # str(tokens.id); "env-admin" for TASKLEDGER_ADMIN_TOKEN; "" for the service itself

    def meta(self) -> dict[str, Any]:
        return {"actor": self.name, "role": self.role, "node": self.node}


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_token_secret() -> str:
    return "tl_" + secrets.token_urlsafe(32)


async def create_token(
    conn: asyncpg.Connection | asyncpg.Pool, *, role: str, name: str, node: str | None
) -> str:
    if role == "worker" and node is not None:
        # A worker is its token: one live worker name runs on one node.
        other = await conn.fetchval(
            "SELECT node FROM tokens WHERE name = $1 AND role = 'worker' AND revoked_at IS NULL "
            "AND node IS DISTINCT FROM $2 LIMIT 1", name, node)
        if other is not None:
            raise AlreadyExists(f"a live worker token named {name!r} runs on node {other}", name=name)
    secret = new_token_secret()
    await conn.execute(
        "INSERT INTO tokens (name, role, node, token_hash) VALUES ($1, $2, $3, $4)",
        name, role, node, hash_token(secret),
    )
    return secret


class TokenStore:
    """Looks tokens up by hash, with a short positive cache."""

    TTL = 30.0

    def __init__(self, pool: asyncpg.Pool, admin_token: str | None) -> None:
        self._pool = pool
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._admin_hash = hash_token(admin_token) if admin_token else None

    async def lookup(self, secret: str) -> Principal | None:
        h = hash_token(secret)
        if self._admin_hash is not None and hmac.compare_digest(h, self._admin_hash):
            return Principal(name="admin", role="admin", node=None, token_hash=h, token_id="env-admin")  # noqa: S106 (an id, not a secret)
        hit = self._cache.get(h)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            return hit[1]
        row = await self._pool.fetchrow(
            "SELECT id, name, role, node FROM tokens WHERE token_hash = $1 AND revoked_at IS NULL", h
        )
        if row is None:
            self._cache.pop(h, None)
            return None
        p = Principal(name=row["name"], role=row["role"], node=row["node"], token_hash=h,
                      token_id=str(row["id"]))
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[h] = (now + self.TTL, p)
        return p


PUBLIC_PATHS: Final = ("/healthz", "/readyz", "/metrics", "/schema", "/favicon.ico")


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return None


class AuthMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(
        self, connection: ASGIConnection[Any, Any, Any, Any]
    ) -> AuthenticationResult:
        store: TokenStore = connection.app.state.tokens
        secret = bearer(connection)
        if secret is None:
            extra = connection.app.state.get("extra_authenticators", ())
            for fn in extra:
                p = await fn(connection)
                if p is not None:
                    return AuthenticationResult(user=p, auth=None)
            raise NotAuthorizedException("a bearer token is required")
        p = await store.lookup(secret)
        if p is None:
            raise NotAuthorizedException("unknown or revoked token")
        return AuthenticationResult(user=p, auth=secret)


def requires(*roles: str) -> Any:
    """A guard: the caller's role must be one of `roles` (admin always passes)."""

    allowed = frozenset(roles) | {"admin"}

    # async on purpose: Litestar runs a sync guard in a worker thread.
    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        user = connection.scope.get("user")
        if not isinstance(user, Principal):
            raise NotAuthorizedException("a bearer token is required")
        if user.role not in allowed:
            raise PermissionDeniedException(
                f"role {user.role!r} may not do this (needs one of {sorted(allowed)})"
            )

    return guard
