"""Webhooks (admin): register a URL for a set of event types, list, delete, and
see the delivery attempts. Delivery itself is `taskledger.service.ops.webhooks`."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, JSONBody, QueryParameter

from taskledger import log as store
from taskledger.events.errors import NotFound, ValidationFailed
from taskledger.service.http.auth import requires
from taskledger.service.http.deps import PoolDep
from taskledger.service.http.routes.common import check_id
from taskledger.service.ops.webhooks import ISSUE_TYPES
from taskledger.service.tokens import Principal

Url = Annotated[str, msgspec.Meta(min_length=8, max_length=2000, pattern=r"^https?://[^\s/?#]+[^\s]*$")]
EventType = Annotated[str, msgspec.Meta(min_length=1, max_length=100, pattern=r"^[a-z_]+(\.[a-z_]*)?$")]


class WebhookNotFound(NotFound):
    code = "webhook_not_found"
    title = "Webhook not found"


class CreateWebhook(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: Url
    secret: Annotated[str, msgspec.Meta(min_length=16, max_length=256)]
    types: Annotated[list[EventType], msgspec.Meta(max_length=50)] | None = None
    format: Literal["event", "issue"] = "event"
    since_seq: Annotated[int, msgspec.Meta(ge=0, le=2**62)] | None = None


class WebhookView(msgspec.Struct, kw_only=True):
    id: str
    url: str
    types: list[str]
    format: Literal["event", "issue"]
    checkpoint_seq: int
    created_at: str


class WebhookList(msgspec.Struct, kw_only=True):
    webhooks: list[WebhookView]


class DeliveryView(msgspec.Struct, kw_only=True):
    id: int
    seq: int
    event_type: str
    attempt: int
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: float
    attempted_at: str


class DeliveryList(msgspec.Struct, kw_only=True):
    deliveries: list[DeliveryView]


def _iso(ts: Any) -> str:
    return str(ts.isoformat().replace("+00:00", "Z"))


_COLUMNS = "id, url, types, format, checkpoint, created_at"


def _view(r: Any) -> WebhookView:
    return WebhookView(id=r["id"], url=r["url"], types=list(r["types"]), format=r["format"],
                       checkpoint_seq=r["checkpoint"], created_at=_iso(r["created_at"]))


class WebhookController(Controller):
    path = "/webhooks"
    tags = ["webhooks"]
    guards = [requires("admin")]

    @post("/", operation_id="createWebhook", status_code=201)
    async def create(
        self, request: Request[Any, Any, Any], pool: PoolDep, data: JSONBody[CreateWebhook]
    ) -> WebhookView:
        """Events after `since_seq` (default: from now) that match `types` (empty: all)
        are POSTed to `url` in order, signed with `secret`. `format: "issue"` sends
        each `task.blocked` as a tracker issue (`title`, `body`, `labels`)."""
        types = list(dict.fromkeys(data.types or []))
        if data.format == "issue":
            types = types or list(ISSUE_TYPES)
            if any(t not in ISSUE_TYPES for t in types):
                raise ValidationFailed(f"an issue webhook takes only {', '.join(ISSUE_TYPES)}")
        head, _ = await store.head(pool)
        since = head if data.since_seq is None else data.since_seq
        if since > head:
            raise ValidationFailed(f"since_seq {since} is beyond the head of the log ({head})")
        user = request.user
        assert isinstance(user, Principal)
        row = await pool.fetchrow(
            f"INSERT INTO webhooks (id, url, types, format, secret, checkpoint, created_by) "
            f"VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {_COLUMNS}",
            "wh-" + uuid.uuid4().hex[:16], data.url, types, data.format, data.secret, since, user.name)
        return _view(row)

    @get("/", operation_id="listWebhooks")
    async def list_webhooks(self, pool: PoolDep) -> WebhookList:
        rows = await pool.fetch(f"SELECT {_COLUMNS} FROM webhooks ORDER BY created_at, id")
        return WebhookList(webhooks=[_view(r) for r in rows])

    @delete("/{webhook_id:str}", operation_id="deleteWebhook", status_code=204)
    async def remove(self, pool: PoolDep, webhook_id: FromPath[str]) -> Response[None]:
        """Stop delivering and forget the webhook with its attempts."""
        check_id(webhook_id, "webhook id")
        status = await pool.execute("DELETE FROM webhooks WHERE id = $1", webhook_id)
        if status != "DELETE 1":
            raise WebhookNotFound(f"webhook {webhook_id} does not exist")
        return Response(content=None, status_code=204)

    @get("/{webhook_id:str}/deliveries", operation_id="listWebhookDeliveries")
    async def deliveries(
        self, pool: PoolDep, webhook_id: FromPath[str],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
    ) -> DeliveryList:
        """The latest delivery attempts, newest first."""
        check_id(webhook_id, "webhook id")
        async with pool.acquire() as c, c.transaction(isolation="repeatable_read", readonly=True):
            if not await c.fetchval("SELECT 1 FROM webhooks WHERE id = $1", webhook_id):
                raise WebhookNotFound(f"webhook {webhook_id} does not exist")
            rows = await c.fetch(
                "SELECT id, seq, event_type, attempt, ok, status_code, error, duration_ms, attempted_at "
                f"FROM webhook_deliveries WHERE webhook_id = $1 ORDER BY id DESC LIMIT {int(limit)}", webhook_id)
        return DeliveryList(deliveries=[
            DeliveryView(id=r["id"], seq=r["seq"], event_type=r["event_type"], attempt=r["attempt"], ok=r["ok"],
                         status_code=r["status_code"], error=r["error"], duration_ms=r["duration_ms"],
                         attempted_at=_iso(r["attempted_at"])) for r in rows])


ROUTES = [WebhookController]

