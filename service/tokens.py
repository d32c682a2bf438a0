"""Tokens and the `Principal` who holds one, shared by the HTTP app, the writer
and the CLI. Bearer tokens are stored as sha256 and cached briefly in process.

Revocation and expiry reach every replica by revalidation, not by messages: a
process trusts a token it looked up for at most `TokenStore.TTL` seconds, and
every `TTL` it asks the database once about all tokens that hold open streams,
ending the streams of those that died. No channel to lose, no replica that
missed a notification while its LISTEN connection was down; the cost is one
indexed lookup per active token per TTL and process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, Final, Protocol

import asyncpg
import msgspec

from taskledger.events.errors import AlreadyExists

log = logging.getLogger("taskledger.auth")

ROLES: Final = ("admin", "producer", "worker", "reviewer", "reader")

# A token that is revoked or past its expiry matches nothing here.
LIVE_BEARER_SQL: Final = (
    "SELECT id, name, role, node, expires_at FROM tokens WHERE token_hash = $1 "
    "AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())")


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


class NewToken(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    token: str
    expires_at: datetime | None


async def create_token(
    db: asyncpg.Connection | asyncpg.Pool, *, role: str, name: str, node: str | None,
    expires_in_seconds: int | None = None,
) -> NewToken:
    secret = new_token_secret()
    async with _connection(db) as conn, conn.transaction():
        if role == "worker" and node is not None:
            # A worker is its token: one live worker name runs on one node. The
            # lock on the name makes the check and the insert one step, so two
            # concurrent creations cannot both pass it.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('taskledger.worker:' || $1))", name)
            other = await conn.fetchval(
                "SELECT node FROM tokens WHERE name = $1 AND role = 'worker' AND revoked_at IS NULL "
                "AND (expires_at IS NULL OR expires_at > now()) AND node IS DISTINCT FROM $2 LIMIT 1",
                name, node)
            if other is not None:
                raise AlreadyExists(f"a live worker token named {name!r} runs on node {other}", name=name)
        row = await conn.fetchrow(
            "INSERT INTO tokens (name, role, node, token_hash, expires_at) "
            "VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5)) RETURNING id, expires_at",
            name, role, node, hash_token(secret), expires_in_seconds,
        )
    assert row is not None
    return NewToken(id=str(row["id"]), token=secret, expires_at=row["expires_at"])


@asynccontextmanager
async def _connection(db: asyncpg.Connection | asyncpg.Pool) -> AsyncIterator[Any]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


class TokenInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A token as an operator sees it: never its secret, nor its hash."""

    id: str
    name: str
    role: str
    node: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


_INFO_COLUMNS: Final = "id::text AS id, name, role, node, created_at, expires_at, revoked_at"


async def list_tokens(conn: asyncpg.Connection | asyncpg.Pool) -> list[TokenInfo]:
    rows = await conn.fetch(f"SELECT {_INFO_COLUMNS} FROM tokens ORDER BY id")
    return [TokenInfo(**dict(r)) for r in rows]


async def revoke_token(conn: asyncpg.Connection | asyncpg.Pool, token_id: int) -> TokenInfo | None:
    """Revoke a token (again is a no-op); None when there is no such token."""
    row = await conn.fetchrow(
        f"UPDATE tokens SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING {_INFO_COLUMNS}",
        token_id)
    return None if row is None else TokenInfo(**dict(row))


class Stoppable(Protocol):
    def set(self) -> None: ...


class TokenStore:
    """Looks tokens up by hash, trusting an answer for at most TTL seconds, and
    ends the streams of tokens that were revoked or expired (see the module
    docstring)."""

    TTL = 0.5

    def __init__(self, pool: asyncpg.Pool, admin_token: str | None) -> None:
        self._pool = pool
        # hash -> (trusted until (monotonic), principal, expiry (epoch seconds) or None)
        self._cache: dict[str, tuple[float, Principal, float | None]] = {}
        self._admin_hash = hash_token(admin_token) if admin_token else None
        self._watched: dict[str, weakref.WeakSet[Any]] = {}

    def is_env_admin(self, token_hash: str) -> bool:
        return self._admin_hash is not None and hmac.compare_digest(token_hash, self._admin_hash)

    async def lookup(self, secret: str) -> Principal | None:
        return await self.by_hash(hash_token(secret))

    async def by_hash(self, h: str) -> Principal | None:
        if self.is_env_admin(h):
            return Principal(name="admin", role="admin", node=None, token_hash=h, token_id="env-admin")  # noqa: S106 (an id, not a secret)
        hit = self._cache.get(h)
        now = time.monotonic()
        if hit is not None and hit[0] > now and (hit[2] is None or hit[2] > time.time()):
            return hit[1]
        row = await self._pool.fetchrow(LIVE_BEARER_SQL, h)
        if row is None:
            self._cache.pop(h, None)
            return None
        p = Principal(name=row["name"], role=row["role"], node=row["node"], token_hash=h,
                      token_id=str(row["id"]))
        if len(self._cache) > 10_000:
            self._cache.clear()
        expires = row["expires_at"].timestamp() if row["expires_at"] is not None else None
        self._cache[h] = (now + self.TTL, p, expires)
        return p

    def watch(self, user: Any, stop: Stoppable) -> None:
        """Set `stop` once `user`'s token is revoked or expires (held weakly: a
        stream that ended on its own needs no unregistering)."""
        if not isinstance(user, Principal) or not user.token_hash or self.is_env_admin(user.token_hash):
            return
        self._watched.setdefault(user.token_hash, weakref.WeakSet()).add(stop)

    async def revalidate(self) -> int:
        """One pass over the watched tokens; returns how many were found dead."""
        for h in [h for h, ws in self._watched.items() if not ws]:
            del self._watched[h]
        if not self._watched:
            return 0
        hashes = list(self._watched)
        live = {r["token_hash"] for r in await self._pool.fetch(
            "SELECT token_hash FROM tokens WHERE token_hash = ANY($1::text[]) AND revoked_at IS NULL "
            "AND (expires_at IS NULL OR expires_at > now())", hashes)}
        dead = [h for h in hashes if h not in live]
        for h in dead:
            self._cache.pop(h, None)
            for stop in list(self._watched.pop(h, ())):
                stop.set()
        return len(dead)

    async def run(self) -> None:
        """Revalidate every TTL until cancelled."""
        while True:
            await asyncio.sleep(self.TTL)
            try:
                await self.revalidate()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database is down: the next pass retries
                log.warning("token revalidation failed: %r", e)
