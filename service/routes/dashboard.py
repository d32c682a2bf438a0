"""The browser dashboard: the page itself, its static files, and browser sessions.

A browser's `EventSource` cannot send an `Authorization` header, and a token in
a URL ends up in logs, histories and Referer headers. So the page trades a
token (sent once, in a JSON body) for a *session cookie*:

* `POST /ui/session {"token": ...}` checks the token and answers with an
  HttpOnly, SameSite=Strict cookie holding `v1.<expires>.<token hash>.<hmac>`.
  The HMAC key is one per deployment, kept in the database (`ui_secrets`), so
  any replica accepts a cookie that another replica issued, and a restarted
  process accepts the cookies it issued before.
* The cookie is good for `stream_token_ttl_seconds`; the page renews it
  (`POST /ui/session/renew`) well before then. A revoked token's sessions stop
  working within the token cache's lifetime, and can never be renewed.
* The cookie only ever grants *read* access: the authenticator added to
  `app.state.extra_authenticators` accepts it for GET and HEAD only, and the
  principal it yields has the `reader` role whatever the token's role was.
  Everything else still needs `Authorization: Bearer`.
* `DELETE /ui/session` signs out (clears the cookie).

`/`, `/static/*` and `/ui/*` are outside the bearer middleware; the session
routes check the cookie themselves.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import secrets
import time
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Final

import asyncpg
import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.exceptions import NotAuthorizedException
from litestar.params import FromPath, JSONBody

from events import jobs as job_events
from events import tasks as task_events
from events.errors import NotFound, ValidationFailed
from service.auth import LIVE_BEARER_SQL, Principal, TokenStore, hash_token
from service.settings import Settings

COOKIE: Final = "tl_session"
READ_METHODS: Final = frozenset({"GET", "HEAD"})
_VERSION: Final = "v1"
_HASH_LEN: Final = 64  # sha256 hex

CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_TYPES: Final = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}


# ------------------------------------------------------------------ static files


class _Asset(msgspec.Struct, frozen=True):
    body: bytes
    media_type: str
    etag: str


def _load_assets() -> dict[str, _Asset]:
    out: dict[str, _Asset] = {}
    root = resources.files("service") / "static"
    for entry in root.iterdir():
        name = entry.name
        ext = name[name.rfind("."):] if "." in name else ""
        if not entry.is_file() or ext not in _TYPES:
            continue
        body = entry.read_bytes()
        out[name] = _Asset(body, _TYPES[ext], '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return out


_ASSETS: Final = _load_assets()


def _asset_response(request: Request[Any, Any, Any], name: str, extra: dict[str, str] | None = None
                    ) -> Response[bytes]:
    asset = _ASSETS.get(name)
    if asset is None:
        raise NotFound(f"no static file {name!r}")
    headers = {"Cache-Control": "no-cache", "ETag": asset.etag, "X-Content-Type-Options": "nosniff",
               **(extra or {})}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(content=b"", status_code=304, headers=headers)
    return Response(content=asset.body, media_type=asset.media_type, headers=headers)


@get("/", operation_id="getDashboard", include_in_schema=False, tags=["dashboard"])
async def index(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The dashboard page (public: it holds no data; it signs in and fetches)."""
    return _asset_response(request, "index.html", _PAGE_HEADERS)


@get("/static/{name:str}", operation_id="getStaticAsset", include_in_schema=False, tags=["dashboard"])
async def static_asset(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
    return _asset_response(request, name)


# ------------------------------------------------------------------ sessions


def _b64(raw: bytes) -> str:
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
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def issue(self, token_hash: str, now: float | None = None) -> tuple[str, int]:
        # whole seconds, rounded up: a cookie is good for at least `ttl` seconds
        exp = math.ceil((now if now is not None else time.time()) + self.ttl)
        body = f"{_VERSION}.{exp}.{token_hash}"
        return f"{body}.{self._sig(body)}", exp

    def check(self, value: str | None, now: float | None = None) -> tuple[str, int] | None:
        """(token hash, expiry) of a well-signed, unexpired cookie value; else None."""
        if not value or len(value) > 256:
            return None
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != _VERSION:
            return None
        _, exp_s, token_hash, sig = parts
        if not hmac.compare_digest(self._sig(f"{_VERSION}.{exp_s}.{token_hash}"), sig):
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


async def _secret(pool: asyncpg.Pool) -> bytes:
    await pool.execute("INSERT INTO ui_secrets (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
                       secrets.token_bytes(32))
    return bytes(await pool.fetchval("SELECT secret FROM ui_secrets WHERE id = 1"))


def _sessions(app: Litestar | Any) -> Sessions:
    return app.state.ui_sessions  # type: ignore[no-any-return]


async def cookie_authenticator(connection: ASGIConnection[Any, Any, Any, Any]) -> Principal | None:
    """`extra_authenticators` entry: a session cookie, for reads only."""
    if connection.scope.get("method", "GET") not in READ_METHODS:
        return None
    value = connection.cookies.get(COOKIE)
    if not value:
        return None
    found = await _sessions(connection.app).principal(value)
    return found[0] if found else None


# ------------------------------------------------------------------ session routes


class SessionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    token: str


class SessionView(msgspec.Struct, kw_only=True):
    name: str
    role: str
    token_role: str
    node: str | None
    access: str
    expires_at: str
    ttl_seconds: int
    renew_after_seconds: int
    event_types: list[str]


EVENT_TYPES: Final = sorted({*task_events.EVENT_TYPES, *job_events.EVENT_TYPES})


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def _view(holder: Principal, exp: int, ttl: int) -> SessionView:
    return SessionView(
        name=holder.name, role="reader", token_role=holder.role, node=holder.node, access="read",
        expires_at=_iso(exp), ttl_seconds=ttl, renew_after_seconds=max(1, ttl // 2),
        event_types=EVENT_TYPES,
    )


def _secure(request: Request[Any, Any, Any]) -> bool:
    proto = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or proto == "https"


def _cookie(request: Request[Any, Any, Any], value: str, max_age: int) -> Cookie:
    return Cookie(key=COOKIE, value=value, path="/", httponly=True, samesite="strict",
                  secure=_secure(request), max_age=max_age)


def _no_token_in_url(request: Request[Any, Any, Any]) -> None:
    if any(k.lower() in ("token", "access_token", "auth", "authorization") for k in request.query_params):
        raise ValidationFailed("never put a token in a URL: send it in the JSON body")


_NO_STORE: Final = {"Cache-Control": "no-store"}


@post("/ui/session", operation_id="createUiSession", tags=["dashboard"], status_code=200,
      security=[{}], summary="Trade a token for a read-only browser session cookie")
async def create_session(
    request: Request[Any, Any, Any], data: JSONBody[SessionBody]
) -> Response[SessionView]:
    _no_token_in_url(request)
    if not data.token or len(data.token) > 512:
        raise NotAuthorizedException("unknown or revoked token")
    sessions = _sessions(request.app)
    holder = await sessions.holder(hash_token(data.token), cached=False)
    if holder is None:
        raise NotAuthorizedException("unknown or revoked token")
    value, exp = sessions.issue(holder.token_hash)
    return Response(content=_view(holder, exp, sessions.ttl), headers=_NO_STORE,
                    cookies=[_cookie(request, value, sessions.ttl)])


async def _current(request: Request[Any, Any, Any], *, cached: bool) -> tuple[Principal, int]:
    sessions = _sessions(request.app)
    checked = sessions.check(request.cookies.get(COOKIE))
    if checked is None:
        raise NotAuthorizedException("no valid session: sign in with a token")
    holder = await sessions.holder(checked[0], cached=cached)
    if holder is None:
        raise NotAuthorizedException("the session's token was revoked: sign in again")
    return holder, checked[1]


@get("/ui/session", operation_id="getUiSession", tags=["dashboard"], security=[{}],
     summary="The current browser session (401 when there is none)")
async def get_session(request: Request[Any, Any, Any]) -> Response[SessionView]:
    holder, exp = await _current(request, cached=True)
    return Response(content=_view(holder, exp, _sessions(request.app).ttl), headers=_NO_STORE)


@post("/ui/session/renew", operation_id="renewUiSession", tags=["dashboard"], status_code=200,
      security=[{}], summary="A fresh cookie for a still-valid session (its token must still be valid)")
async def renew_session(request: Request[Any, Any, Any]) -> Response[SessionView]:
    holder, _ = await _current(request, cached=False)
    sessions = _sessions(request.app)
    value, exp = sessions.issue(holder.token_hash)
    return Response(content=_view(holder, exp, sessions.ttl), headers=_NO_STORE,
                    cookies=[_cookie(request, value, sessions.ttl)])


@delete("/ui/session", operation_id="deleteUiSession", tags=["dashboard"], status_code=204, security=[{}],
        summary="Sign out: clear the session cookie")
async def delete_session(request: Request[Any, Any, Any]) -> Response[None]:
    return Response(content=None, status_code=204, headers=_NO_STORE,
                    cookies=[Cookie(key=COOKIE, value="", path="/", httponly=True, samesite="strict",
                                    secure=_secure(request), max_age=0, expires=0)])


ROUTES = [index, static_asset, create_session, get_session, renew_session, delete_session]


async def startup(app: Litestar) -> None:
    settings: Settings = app.state.settings
    app.state.ui_sessions = Sessions(
        app.state.pool, await _secret(app.state.pool),
        ttl=settings.stream_token_ttl_seconds, admin_token=settings.admin_token)
    app.state.extra_authenticators.append(cookie_authenticator)
