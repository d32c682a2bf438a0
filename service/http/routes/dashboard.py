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
* For GET and HEAD the cookie stands for the `reader` role, whatever the
  token's role was.
* It stands for the token's own role only on the few routes a person acts on
  from the page (`SESSION_ACTIONS`: unblock, cancel, reassign, round review,
  and the chain check), and only with the session's CSRF token in the
  `X-CSRF-Token` header (an HMAC of the token hash under the same key, handed
  out with the session, never in a cookie) and no foreign `Origin`. The
  route's own guard then applies the API's rules unchanged: a reader's session
  acting gets the API's 403. Every other write still needs
  `Authorization: Bearer`.
* `DELETE /ui/session` signs out (clears the cookie).

`/`, `/static/*` and `/ui/*` are outside the bearer middleware; the session
routes check the cookie themselves. The page's read routes (`/dashboard/*`:
the board as of a seq, the seq at a time, the trust figures) are ordinary
API reads, open to a bearer token or a session.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated, Any, Final

import asyncpg
import msgspec
from litestar import Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.exceptions import NotAuthorizedException
from litestar.params import FromPath, JSONBody, QueryParameter

from taskledger import log as store
from taskledger.events.errors import Forbidden, NotFound, ValidationFailed
from taskledger.events.job import events as job_events
from taskledger.events.task import events as task_events
from taskledger.events.task.state import TaskState
from taskledger.log import audit as stored_audit
from taskledger.projections import catalog, framework
from taskledger.projections import tasks as views
from taskledger.service.http.deps import MetricsDep, PoolDep, SessionsDep
from taskledger.service.http.sessions import Sessions
from taskledger.service.metrics import Metrics
from taskledger.service.tokens import Principal, hash_token

COOKIE: Final = "tl_session"
READ_METHODS: Final = frozenset({"GET", "HEAD"})

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
    root = resources.files("taskledger.service.http") / "static"
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



class CsrfRefused(Forbidden):
    code = "csrf_failed"
    title = "CSRF check failed"


CSRF_HEADER: Final = "x-csrf-token"

# Where a session stands for its token's own role (with the CSRF header); the
# route's guard decides, exactly as for a bearer token.
SESSION_ACTIONS: Final = (
    ("POST", re.compile(r"^/tasks/[A-Za-z0-9._:-]{1,128}/(?:unblock|cancel|reassign|round-review)$")),
    ("GET", re.compile(r"^/audit/verify$")),
)

# What the page offers each role (the buttons it draws); the routes' guards are the rule.
_OFFERS: Final = {
    "admin": ["unblock", "cancel", "reassign", "round-review"],
    "producer": ["unblock", "cancel", "reassign"],
    "reviewer": ["round-review"],
}


def _is_session_action(method: str, path: str) -> bool:
    return any(m == method and rx.match(path) for m, rx in SESSION_ACTIONS)


def _foreign_origin(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    origin = connection.headers.get("origin")
    if origin is None:
        return False
    host = connection.headers.get("host", "")
    return origin.partition("://")[2].rstrip("/").lower() != host.lower()


async def cookie_authenticator(sessions: Sessions, connection: ASGIConnection[Any, Any, Any, Any]
                               ) -> Principal | None:
    """An authenticator (bound to the app's `sessions`): a session cookie (reads; acting with the CSRF header)."""
    value = connection.cookies.get(COOKIE)
    if not value:
        return None
    method = str(connection.scope.get("method", "GET"))
    if _is_session_action(method, connection.scope.get("path", "")):
        checked = sessions.check(value)
        if checked is None:
            return None
        sent = connection.headers.get(CSRF_HEADER)
        if method == "GET" and sent is None:
            found = await sessions.principal(value)  # a plain read, as a reader
            return found[0] if found else None
        if not sent or not hmac.compare_digest(sent, sessions.csrf(checked[0])) or _foreign_origin(connection):
            raise CsrfRefused("this session may act only from the dashboard: the X-CSRF-Token header "
                              "is missing or wrong, or the request came from another origin")
        return await sessions.holder(checked[0], cached=False)
    if method not in READ_METHODS:
        return None
    found = await sessions.principal(value)
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
    csrf_token: str
    actions: list[str]


CHECKPOINT_STREAM: Final = "audit"
CHECKPOINT_TYPE: Final = "audit.checkpoint"
EVENT_TYPES: Final = sorted({*task_events.EVENT_TYPES, *job_events.EVENT_TYPES, CHECKPOINT_TYPE})


def _iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def _view(holder: Principal, exp: int, sessions: Sessions) -> SessionView:
    actions = list(_OFFERS.get(holder.role, []))
    return SessionView(
        name=holder.name, role="reader", token_role=holder.role, node=holder.node,
        access="read, act" if actions else "read", expires_at=_iso(exp), ttl_seconds=sessions.ttl,
        renew_after_seconds=max(1, sessions.ttl // 2), event_types=EVENT_TYPES,
        csrf_token=sessions.csrf(holder.token_hash), actions=actions,
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
    request: Request[Any, Any, Any], sessions: SessionsDep, data: JSONBody[SessionBody]
) -> Response[SessionView]:
    _no_token_in_url(request)
    if not data.token or len(data.token) > 512:
        raise NotAuthorizedException("unknown or revoked token")
    holder = await sessions.holder(hash_token(data.token), cached=False)
    if holder is None:
        raise NotAuthorizedException("unknown or revoked token")
    value, exp = sessions.issue(holder.token_hash)
    return Response(content=_view(holder, exp, sessions), headers=_NO_STORE,
                    cookies=[_cookie(request, value, sessions.ttl)])


async def _current(request: Request[Any, Any, Any], sessions: Sessions, *, cached: bool) -> tuple[Principal, int]:
    checked = sessions.check(request.cookies.get(COOKIE))
    if checked is None:
        raise NotAuthorizedException("no valid session: sign in with a token")
    holder = await sessions.holder(checked[0], cached=cached)
    if holder is None:
        raise NotAuthorizedException("the session's token was revoked: sign in again")
    return holder, checked[1]


@get("/ui/session", operation_id="getUiSession", tags=["dashboard"], security=[{}],
     summary="The current browser session (401 when there is none)")
async def get_session(request: Request[Any, Any, Any], sessions: SessionsDep) -> Response[SessionView]:
    holder, exp = await _current(request, sessions, cached=True)
    return Response(content=_view(holder, exp, sessions), headers=_NO_STORE)


@post("/ui/session/renew", operation_id="renewUiSession", tags=["dashboard"], status_code=200,
      security=[{}], summary="A fresh cookie for a still-valid session (its token must still be valid)")
async def renew_session(request: Request[Any, Any, Any], sessions: SessionsDep) -> Response[SessionView]:
    holder, _ = await _current(request, sessions, cached=False)
    value, exp = sessions.issue(holder.token_hash)
    return Response(content=_view(holder, exp, sessions), headers=_NO_STORE,
                    cookies=[_cookie(request, value, sessions.ttl)])


@delete("/ui/session", operation_id="deleteUiSession", tags=["dashboard"], status_code=204, security=[{}],
        summary="Sign out: clear the session cookie")
async def delete_session(request: Request[Any, Any, Any]) -> Response[None]:
    return Response(content=None, status_code=204, headers=_NO_STORE,
                    cookies=[Cookie(key=COOKIE, value="", path="/", httponly=True, samesite="strict",
                                    secure=_secure(request), max_age=0, expires=0)])


# ------------------------------------------------------------------ the page's reads
#
# Time travel redraws the whole board as of a seq, which the list route cannot
# give (`GET /tasks/{id}?as_of_seq=` is one task). A task row whose last event
# is at or before the seq is already that state (the task view is written in
# the transaction that appends its events); the others are folded from their
# streams up to the seq, as the replay API folds one.


class BoardPage(msgspec.Struct, kw_only=True):
    as_of_seq: int
    head_seq: int
    tasks: list[Any]
    next_after: str | None


class BlockersAsOf(msgspec.Struct, kw_only=True):
    as_of_seq: int
    blockers: list[Any]


class SeqAt(msgspec.Struct, kw_only=True):
    at: str
    seq: int
    recorded_at: str | None
    head_seq: int


class ProcessFigures(msgspec.Struct, kw_only=True):
    sse_subscribers: int | None
    sse_tailer_lag_events: int | None
    writer_commits: int
    writer_commands: int
    writer_mean_batch: float | None
    writer_queue_depth: int | None


class ProjectionLag(msgspec.Struct, kw_only=True):
    name: str
    checkpoint_seq: int | None
    lag: int | None


class DashboardStatus(msgspec.Struct, kw_only=True):
    head_seq: int
    head_hash: str
    last_checkpoint: Any
    checkpoints: int
    projections: list[ProjectionLag]
    process: ProcessFigures


AsOfSeq = Annotated[int, QueryParameter(ge=0, le=2**62)]


async def _within_head(pool: asyncpg.Pool, as_of_seq: int) -> int:
    head, _ = await store.head(pool)
    if as_of_seq > head:
        raise ValidationFailed(f"as_of_seq {as_of_seq} is beyond the head of the log ({head})")
    return head


@get("/dashboard/tasks", operation_id="listTasksAsOf", tags=["dashboard"],
     summary="Every task as it stood after a seq (the board's time travel), oldest first, paged")
async def tasks_as_of(
    request: Request[Any, Any, Any], pool: PoolDep, as_of_seq: AsOfSeq,
    after: Annotated[str | None, QueryParameter(max_length=128)] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 1000,
) -> BoardPage:
    head = await _within_head(pool, as_of_seq)
    cursor = 0
    if after is not None:
        found = await views.created_seq_of(pool, after)
        if found is None:
            raise ValidationFailed(f"after: no task {after}")
        cursor = found
    rows = await views.rows_created_by(pool, as_of_seq, after_created_seq=cursor, limit=limit + 1)
    page = rows[:limit]
    states: dict[str, TaskState] = {}
    later = [f"task:{r.id}" for r in page if r.seq > as_of_seq]
    if later:
        views.fold_page(states, await store.read_stream_before(pool, later, as_of_seq + 1))
    user: Principal = request.user
    viewer = None if user.role == "admin" else user.token_id  # lease ids only to their holder
    out = [views.visible_to(states[r.id] if r.seq > as_of_seq else views.decode_state(r.body), viewer)
           for r in page]
    return BoardPage(as_of_seq=as_of_seq, head_seq=head, tasks=out,
                     next_after=page[-1].id if len(rows) > limit else None)


@get("/dashboard/blockers", operation_id="listBlockersAsOf", tags=["dashboard"],
     summary="The blockers open after a seq, as they stood then")
async def blockers_as_of(pool: PoolDep, as_of_seq: AsOfSeq) -> BlockersAsOf:
    await _within_head(pool, as_of_seq)
    out = [msgspec.structs.replace(b, open=True, resolved_seq=None, resolved_at=None, resolution=None, notes=None)
           for b in await views.blockers_open_at(pool, as_of_seq)]
    return BlockersAsOf(as_of_seq=as_of_seq, blockers=out)


@get("/dashboard/seq-at", operation_id="seqAtTime", tags=["dashboard"],
     summary="The last seq recorded at or before a time (0 before the first event)")
async def seq_at(
    pool: PoolDep, at: Annotated[str, QueryParameter(min_length=1, max_length=64)],
) -> SeqAt:
    try:
        when = datetime.fromisoformat(at.replace("Z", "+00:00"))
    except ValueError as e:
        raise ValidationFailed(f"at: not an ISO 8601 time: {at!r}") from e
    if when.tzinfo is None:
        raise ValidationFailed("at: give a time zone (say ...Z for UTC)")
    head, _ = await store.head(pool)
    async with pool.acquire() as conn:
        seq, recorded = await store.seq_at(conn, when, head)
    return SeqAt(at=at, seq=seq, recorded_at=recorded, head_seq=head)


def _gauge(metrics: Metrics, name: str) -> int | None:
    v = metrics.value(name)
    return None if v is None or math.isnan(v) else int(v)


@get("/dashboard/status", operation_id="getDashboardStatus", tags=["dashboard"],
     summary="Trust at a glance: the head, the last signed checkpoint, projection lag, this process's figures")
async def dashboard_status(pool: PoolDep, metrics: MetricsDep) -> DashboardStatus:
    head, head_hash = await store.head(pool)
    last, count = await stored_audit.last_checkpoint(pool)
    batches = metrics.value("writer_batch_size_count") or 0
    return DashboardStatus(
        head_seq=head, head_hash=head_hash,
        last_checkpoint=None if last is None else msgspec.Raw(last.encode()),
        checkpoints=int(count),
        projections=[ProjectionLag(name=p.name, checkpoint_seq=p.checkpoint_seq, lag=p.lag)
                     for p in await framework.statuses(pool, catalog.PROJECTIONS)],
        process=ProcessFigures(
            sse_subscribers=_gauge(metrics, "sse_subscribers"),
            sse_tailer_lag_events=_gauge(metrics, "sse_tailer_lag_events"),
            writer_commits=int(metrics.value("writer_commits_total") or 0),
            writer_commands=int(metrics.value("writer_commands_total") or 0),
            writer_mean_batch=round((metrics.value("writer_batch_size_sum") or 0.0) / batches, 2) if batches else None,
            writer_queue_depth=_gauge(metrics, "writer_queue_depth"),
        ),
    )


ROUTES = [index, static_asset, create_session, get_session, renew_session, delete_session,
          tasks_as_of, blockers_as_of, seq_at, dashboard_status]

