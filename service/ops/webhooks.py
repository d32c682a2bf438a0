"""Webhook delivery: every replica runs one `Deliverer`; each webhook is
delivered by exactly one of them at a time.

Read this before changing the ownership or the checkpoint:

- Ownership is a session-level advisory lock, `(LOCK_CLASS, hashtext(id))`,
  held on a connection of its own. A replica that dies or loses that connection
  loses its locks at once, and another replica's next round (every
  `webhook_poll_seconds`) takes the webhook over. When this replica sees its
  lock connection end it cancels its delivery loops before anything else.
- A delivery loop reads the log after the webhook's checkpoint, up to a head it
  read first (seq order is commit order, so nothing below that head can appear
  later), and POSTs one event at a time. The checkpoint moves past an event only
  after its receiver answered 2xx, in the transaction that records the attempt,
  and only from the value this loop last wrote (compare and set): a loop that
  lost its webhook cannot move it. So events arrive in order and at least once;
  a receiver sees an event twice only when an answer is lost or a replica loses
  its lock mid-POST. `X-Taskledger-Delivery` (`{webhook}:{seq}`) is the same on
  every attempt, for receivers that drop repeats.
- A failing event is retried with backoff until it is accepted: later events
  wait behind it (order is the promise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from typing import Any, Final

import asyncpg
import httpx
import msgspec

from taskledger import log as store
from taskledger.events.task.state import TaskState
from taskledger.projections import tasks as task_views
from taskledger.service.background import cancel_all
from taskledger.service.settings import Settings

log = logging.getLogger("taskledger.webhooks")

LOCK_CLASS: Final = 0x746C77  # advisory lock namespace "tlw"; the object is hashtext(webhook id)
SIGNATURE_HEADER: Final = "X-Taskledger-Signature-256"
USER_AGENT: Final = "taskledger-webhooks/0.1"
PAGE: Final = 100
KEEP_ATTEMPTS: Final = 1000  # per webhook; older attempts are pruned
ISSUE_TYPES: Final = ("task.blocked",)


class Hook(msgspec.Struct, kw_only=True):
    id: str
    url: str
    types: list[str]
    format: str
    secret: str
    checkpoint: int


class Attempt(msgspec.Struct, kw_only=True):
    ok: bool
    status_code: int | None
    error: str | None
    duration_ms: float


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: HMAC-SHA256 of the raw body, as GitHub and Stripe sign."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def backoff(attempt: int, base: float, cap: float) -> float:
    return float(min(cap, base * 2.0 ** min(attempt - 1, 30)))


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def issue_for(task: TaskState | None, task_id: str, data: dict[str, Any], seq: int) -> dict[str, Any]:
    """A `task.blocked` event as an issue a tracker accepts as it is: GitHub's
    `POST /repos/{owner}/{repo}/issues` takes `title`, `body` and `labels` (names)."""
    title = task.title if task is not None else task_id
    texts = {r.id: r.text for r in task.requirements} if task is not None else {}
    unmet = data.get("unmet_requirements") or []
    category = data.get("category")
    lines = [f"Task `{task_id}` is blocked and needs a person."]
    if task is not None:
        lines.append(f"Project `{task.project}`, attempt {data.get('attempt', task.attempt)} of {task.max_attempts}.")
    lines += ["", f"**Reason:** {data.get('reason') or 'not given'}"]
    if category:
        lines.append(f"**Category:** `{category}`")
    if unmet:
        lines += ["", "### Unmet requirements", ""]
        for u in unmet:
            rid = str(u.get("requirement_id", "?"))
            text = texts.get(rid, "")
            lines.append(f"- **{rid}**" + (f": {text}" if text else ""))
            who = u.get("checker") or "checker"
            if u.get("reason"):
                lines.append(f"  - {who}: {u['reason']}")
    if task is not None and task.spec:
        lines += ["", "### Task", "", _clip(task.spec, 4000)]
    lines += ["", "---",
              f"Blocker `{data.get('blocker_id', '?')}` at seq {seq}. Resolve it with "
              f"`POST /tasks/{task_id}/unblock` (`retry` or `reverify`)."]
    labels = ["taskledger", "blocked"]
    if category:
        labels.append(_clip(f"blocked:{category}", 50))
    if task is not None:
        labels.append(_clip(f"project:{task.project}", 50))
    return {"title": _clip(f"Blocked: {title} ({task_id})", 256), "body": "\n".join(lines), "labels": labels}


class Deliverer:
    """This replica's delivery worker: claims webhooks, runs one loop per claim."""

    def __init__(self, dsn: str, pool: asyncpg.Pool, settings: Settings,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._dsn = dsn
        self._pool = pool
        self._poll = settings.webhook_poll_seconds
        self._retry = (settings.webhook_retry_base_seconds, settings.webhook_retry_max_seconds)
        self._http = httpx.AsyncClient(timeout=settings.webhook_timeout_seconds, follow_redirects=False,
                                       transport=transport)
        self._lock: asyncpg.Connection | None = None
        self._owned: dict[str, asyncio.Task[None]] = {}
        self._wakes: set[asyncio.Event] = set()
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name="taskledger-webhooks")

    async def stop(self) -> None:
        # The supervisor ends its round rather than being cancelled in a query.
        self._stopping.set()
        if self._supervisor is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._supervisor, 10)
        await self._release_all()
        await self._http.aclose()

    def wake(self, _head: int = 0) -> None:
        """A commit on this replica: look for new events now, not at the next poll."""
        for w in self._wakes:
            w.set()

    # ---------------------------------------------------------------- ownership

    async def _supervise(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("webhook ownership round failed (retrying): %r", e)
                await self._release_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._poll)

    async def _round(self) -> None:
        if self._lock is None or self._lock.is_closed():
            self._lock = await asyncpg.connect(self._dsn)
            self._lock.add_termination_listener(self._lost)
        ids = {r["id"] for r in await self._pool.fetch("SELECT id FROM webhooks")}
        for hid, task in list(self._owned.items()):
            if hid not in ids or task.done():
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.warning("delivery to webhook %s stopped: %r", hid, task.exception())
                await self._release(hid)
        for hid in sorted(ids - self._owned.keys()):
            if await self._lock.fetchval("SELECT pg_try_advisory_lock($1, hashtext($2))", LOCK_CLASS, hid):
                self._owned[hid] = asyncio.create_task(self._deliver(hid), name=f"taskledger-webhook-{hid}")

    def _lost(self, _conn: Any) -> None:
        """The lock connection ended: the locks are gone, so stop delivering now."""
        for task in self._owned.values():
            task.cancel()
        self._owned.clear()

    async def _release(self, hid: str) -> None:
        await cancel_all([self._owned.pop(hid)])
        if self._lock is not None and not self._lock.is_closed():
            await self._lock.execute("SELECT pg_advisory_unlock($1, hashtext($2))", LOCK_CLASS, hid)

    async def _release_all(self) -> None:
        tasks = list(self._owned.values())
        self._owned.clear()
        await cancel_all(tasks)
        if self._lock is not None:
            self._lock.terminate()  # ends the session, and with it every lock it held
            self._lock = None

    # ---------------------------------------------------------------- delivery

    async def _deliver(self, hid: str) -> None:
        row = await self._pool.fetchrow(
            "SELECT id, url, types, format, secret, checkpoint FROM webhooks WHERE id = $1", hid)
        if row is None:
            return
        hook = Hook(id=row["id"], url=row["url"], types=list(row["types"]), format=row["format"],
                    secret=row["secret"], checkpoint=row["checkpoint"])
        wake = asyncio.Event()
        self._wakes.add(wake)
        try:
            while True:
                wake.clear()
                head, _ = await store.head(self._pool)
                rows = await store.read_json(self._pool, since_seq=hook.checkpoint, limit=PAGE,
                                             types=hook.types, to_seq=head)
                if not rows:
                    if head > hook.checkpoint and not await self._advance(hook, head):
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self._poll)
                    continue
                for seq, type_, text in rows:
                    if not await self._deliver_one(hook, seq, type_, text):
                        return
        finally:
            self._wakes.discard(wake)

    async def _deliver_one(self, hook: Hook, seq: int, type_: str, text: str) -> bool:
        """POST one event until its receiver accepts it; False when the webhook is gone."""
        body = await self._render(hook, seq, type_, text)
        attempt = 0
        while True:
            attempt += 1
            result = await self._post(hook, seq, type_, body)
            if not await self._record(hook, seq, type_, attempt, result):
                return False
            if result.ok:
                return True
            await asyncio.sleep(backoff(attempt, *self._retry))

    async def _render(self, hook: Hook, seq: int, type_: str, text: str) -> bytes:
        if hook.format != "issue":
            return text.encode()
        event = msgspec.json.decode(text)
        task_id = task_views.task_id_of(event["stream"])
        task = await task_views.state_as_of(self._pool, task_id, seq)
        return msgspec.json.encode(issue_for(task, task_id, event["data"], seq))

    async def _post(self, hook: Hook, seq: int, type_: str, body: bytes) -> Attempt:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Taskledger-Event": type_,
            "X-Taskledger-Delivery": f"{hook.id}:{seq}",
            "X-Taskledger-Webhook-Id": hook.id,
            SIGNATURE_HEADER: sign(hook.secret, body),
        }
        start = time.perf_counter()
        try:
            r = await self._http.post(hook.url, content=body, headers=headers)
        except httpx.HTTPError as e:
            return Attempt(ok=False, status_code=None, error=_clip(f"{type(e).__name__}: {e}", 1000),
                           duration_ms=(time.perf_counter() - start) * 1000)
        ms = (time.perf_counter() - start) * 1000
        if 200 <= r.status_code < 300:
            return Attempt(ok=True, status_code=r.status_code, error=None, duration_ms=ms)
        return Attempt(ok=False, status_code=r.status_code, error=_clip(r.text, 1000) or None, duration_ms=ms)

    async def _record(self, hook: Hook, seq: int, type_: str, attempt: int, result: Attempt) -> bool:
        """Record the attempt and, when it was accepted, move the checkpoint past `seq`
        (in one transaction). False when the webhook was deleted or taken over."""
        try:
            async with self._pool.acquire() as c, c.transaction():
                did = await c.fetchval(
                    "INSERT INTO webhook_deliveries (webhook_id, seq, event_type, attempt, ok, status_code, error, "
                    "duration_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id",
                    hook.id, seq, type_, attempt, result.ok, result.status_code, result.error, result.duration_ms)
                if did % 100 == 0:
                    await c.execute(
                        "DELETE FROM webhook_deliveries WHERE webhook_id = $1 AND id < (SELECT id FROM "
                        "webhook_deliveries WHERE webhook_id = $1 ORDER BY id DESC OFFSET $2 LIMIT 1)",
                        hook.id, KEEP_ATTEMPTS)
                if result.ok and not await self._advance(hook, seq, c):
                    return False
        except asyncpg.ForeignKeyViolationError:
            return False
        return True

    async def _advance(self, hook: Hook, seq: int, conn: Any = None) -> bool:
        status = await (conn or self._pool).execute(
            "UPDATE webhooks SET checkpoint = $3 WHERE id = $1 AND checkpoint = $2", hook.id, hook.checkpoint, seq)
        if status != "UPDATE 1":
            return False
        hook.checkpoint = seq
        return True
