"""The service's own actions: loops every process runs beside its HTTP routes.

- task sweep: leases whose holders stopped heartbeating, and escalations of
  tasks nobody took (`service.writer.tasks.sweep`);
- job sweep: jobs whose runner stopped heartbeating;
- audit checkpoints: a signed `audit.checkpoint` when one is due;
- idempotency keys past their TTL are forgotten (no event).

Each appends through the writer as `SYSTEM`, the one identity of automatic
actions (taskledger.events.actor). On several replicas each runs everywhere:
a due item is re-checked under the writer's head lock, so it is acted on once.
The app's lifespan starts them (`start`) and cancels them at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from taskledger.events import audit
from taskledger.events.actor import SYSTEM_ACTOR, SYSTEM_ROLE
from taskledger.log import audit as stored_audit
from taskledger.service.settings import Settings
from taskledger.service.tokens import Principal
from taskledger.service.writer import jobs as job_commands
from taskledger.service.writer import tasks as task_commands
from taskledger.service.writer.commands import Ctx
from taskledger.service.writer.engine import UnitOfWork, Writer, WriterUnavailable

log = logging.getLogger("taskledger.sweepers")

SYSTEM: Final = Principal(name=SYSTEM_ACTOR, role=SYSTEM_ROLE, node=None, token_hash="")


def system_ctx() -> Ctx:
    """The context of one automatic action (one sweep pass): the system, a fresh request id."""
    return Ctx(principal=SYSTEM, request_id=uuid.uuid4().hex)


async def sweep_tasks_once(pool: asyncpg.Pool, writer: Writer) -> int:
    """Expire lapsed leases and escalate waiting tasks; how many tasks changed."""
    if not await task_commands.due_for_sweep(pool):
        return 0
    ctx = system_ctx()
    return await writer.submit(lambda u: task_commands.sweep(u, ctx))


async def sweep_jobs_once(pool: asyncpg.Pool, writer: Writer, limit: int = 100) -> int:
    """Submit an expiry command for each job whose lease has run out; how many ended."""
    rows = await pool.fetch(
        "SELECT job_id FROM job_leases WHERE expires_at < now() ORDER BY expires_at LIMIT $1", limit
    )
    ctx = system_ctx()
    ended = 0
    for r in rows:
        if await writer.submit(job_commands.expire_lease(r["job_id"], ctx)) is not None:
            ended += 1
    return ended


async def task_sweeper(pool: asyncpg.Pool, writer: Writer, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweep_tasks_once(pool, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("task sweep failed")


async def job_sweeper(pool: asyncpg.Pool, writer: Writer, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            n = await sweep_jobs_once(pool, writer)
            if n:
                log.warning("ended %d job(s) whose runner stopped heartbeating", n)
        except asyncio.CancelledError:
            raise
        except WriterUnavailable:
            return
        except Exception:
            log.exception("job sweeper pass failed")


async def audit_checkpointer(pool: asyncpg.Pool, writer: Writer, key: Ed25519PrivateKey, settings: Settings,
                             commit_listeners: list[Callable[[int], None]]) -> None:
    """Append a signed checkpoint when one is due. The look is cheap and outside
    the head lock; the writer's command looks again under the lock, so replicas
    that find it due together still append one checkpoint between them. This
    process's commits wake it as soon as `every_events` have passed; other
    replicas' commits are seen at the next tick."""
    every_events, every_seconds = settings.audit_checkpoint_every_events, settings.audit_checkpoint_every_seconds
    tick = min(1.0, every_seconds) if every_seconds else 1.0
    started_at = datetime.now(UTC)
    wake = asyncio.Event()
    last_seen = [0]

    def on_commit(head: int) -> None:
        if every_events and head - last_seen[0] >= every_events:
            wake.set()

    commit_listeners.append(on_commit)

    async def command(uow: UnitOfWork) -> None:
        await stored_audit.append_checkpoint(uow.log, key, every_events=every_events, every_seconds=every_seconds,
                                      started_at=started_at)

    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), tick)
        wake.clear()
        try:
            head, last_seq, last_at = await stored_audit.checkpoint_look(pool)
            last_seen[0] = int(last_seq or 0)
            if audit.checkpoint_due(head, last_seq, last_at, datetime.now(UTC),
                                    every_events, every_seconds, started_at):
                await writer.submit(command)
                last_seen[0] = head
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the database is down, the writer busy: the next pass retries
            log.warning("audit checkpoint failed: %r", e)


async def forget_old_idempotency_keys(pool: asyncpg.Pool, ttl: float) -> None:
    """Delete idempotency keys past their TTL (lookups ignore them already), a
    bounded batch at a time, so the table stays the size of a day's writes."""
    while True:
        try:
            n = await pool.fetchval(
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


def start(pool: asyncpg.Pool, writer: Writer, settings: Settings, audit_key: Ed25519PrivateKey,
          commit_listeners: list[Callable[[int], None]]) -> list[asyncio.Task[Any]]:
    """Start this process's sweepers; the caller cancels the tasks at shutdown."""
    interval = float(settings.sweep_interval_seconds)
    loops = [
        (forget_old_idempotency_keys(pool, float(settings.idempotency_ttl_seconds)), "taskledger-idempotency-ttl"),
        (task_sweeper(pool, writer, interval), "taskledger-task-sweeper"),
        (job_sweeper(pool, writer, interval), "taskledger-jobs-sweeper"),
    ]
    if settings.audit_checkpoint_every_events or settings.audit_checkpoint_every_seconds:
        loops.append((audit_checkpointer(pool, writer, audit_key, settings, commit_listeners),
                      "taskledger-audit-checkpoints"))
    return [asyncio.create_task(coro, name=name) for coro, name in loops]
