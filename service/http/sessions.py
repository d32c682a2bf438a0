"""Browser sessions: the signed cookie a token is traded for (the dashboard's
module docstring explains why), checked by any replica with the key kept in
the database."""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
import time
from typing import Final

import asyncpg

from taskledger.service.tokens import LIVE_BEARER_SQL, Principal, TokenStore, hash_token

VERSION: Final = "v1"
_HASH_LEN: Final = 64  # sha256 hex


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Sessions:
    """Issues and checks the signed session cookies; resolves them to a principal."""

    CACHE_TTL = TokenStore.TTL

    def __init__(self, pool: asyncpg.Pool, secret: bytes, *, ttl: int, admin_token: str | None) -> None:
        self._pool = pool
        self._secret = secret
        self.ttl = int(ttl)
        self._admin_hash = hash_token(admin_token) if admin_token else None
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    def _sig(self, body: str) -> str:
        return b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def csrf(self, token_hash: str) -> str:
        """The session's CSRF token: bound to the token (so it outlives renewals), unguessable
        without the key, and never in a cookie, so another origin can neither read nor send it."""
        return self._sig(f"csrf.{token_hash}")

    def issue(self, token_hash: str, now: float | None = None) -> tuple[str, int]:
        # whole seconds, rounded up: a cookie is good for at least `ttl` seconds
        exp = math.ceil((now if now is not None else time.time()) + self.ttl)
        body = f"{VERSION}.{exp}.{token_hash}"
        return f"{body}.{self._sig(body)}", exp

    def check(self, value: str | None, now: float | None = None) -> tuple[str, int] | None:
        """(token hash, expiry) of a well-signed, unexpired cookie value; else None."""
        if not value or len(value) > 256:
            return None
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != VERSION:
            return None
        _, exp_s, token_hash, sig = parts
        if not hmac.compare_digest(self._sig(f"{VERSION}.{exp_s}.{token_hash}"), sig):
            return None
        if not exp_s.isdigit() or len(token_hash) != _HASH_LEN:
            return None
        exp = int(exp_s)
        if exp <= (now if now is not None else time.time()):
            return None
        return token_hash, exp

    async def holder(self, token_hash: str, *, cached: bool = True) -> Principal | None:
        """The token's own principal, if it still exists and is not revoked."""
        if self._admin_hash is not None and hmac.compare_digest(token_hash, self._admin_hash):
            return Principal(name="admin", role="admin", node=None, token_hash=token_hash)
        now = time.monotonic()
        hit = self._cache.get(token_hash)
        if cached and hit is not None and hit[0] > now:
            return hit[1]
        row = await self._pool.fetchrow(LIVE_BEARER_SQL, token_hash)
        p = None if row is None else Principal(
            name=row["name"], role=row["role"], node=row["node"], token_hash=token_hash)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[token_hash] = (now + self.CACHE_TTL, p)
        return p

    async def principal(self, value: str | None, *, cached: bool = True) -> tuple[Principal, int] | None:
        """The read-only principal a cookie value stands for, and its expiry."""
        checked = self.check(value)
        if checked is None:
            return None
        holder = await self.holder(checked[0], cached=cached)
        if holder is None:
            return None
        return reader_of(holder), checked[1]


def reader_of(p: Principal) -> Principal:
    """The cookie's principal: the token's name and node, but only ever the reader role."""
    return Principal(name=p.name, role="reader", node=p.node, token_hash=p.token_hash)


async def deployment_secret(pool: asyncpg.Pool) -> bytes:
    await pool.execute("INSERT INTO ui_secrets (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
                       secrets.token_bytes(32))
    return bytes(await pool.fetchval("SELECT secret FROM ui_secrets WHERE id = 1"))
