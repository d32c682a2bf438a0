"""Job commands for the writer: read, decide (events.job.rules), then append and project.

Each factory returns an `async def fn(uow)` that refuses (raises a DomainError)
before it writes anything, and returns the job's view after the command.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from taskledger.events import lease
from taskledger.events.errors import AlreadyExists, JobNotFound
from taskledger.events.job import events as job_events
from taskledger.events.job import rules as job_rules
from taskledger.events.job import state as job_state
from taskledger.log import NewEvent
from taskledger.projections import jobs as projection
from taskledger.service.writer.commands import Ctx
from taskledger.service.writer.engine import UnitOfWork

View = dict[str, Any]
JobCommand = Callable[[UnitOfWork], Awaitable[View]]

def view(state: job_state.JobState, now: datetime, lease_expires_at: datetime | None = None) -> View:
    """The job's status (§4) plus the rest of the view and, while it runs, its lease."""
    out = job_state.status(state, now)
    if state.state in job_state.ACTIVE:
        out["lease_seconds"] = state.lease_seconds
        out["lease_expires_at"] = (
            lease_expires_at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
            if lease_expires_at is not None else None
        )
    else:
        out["lease_seconds"] = None
        out["lease_expires_at"] = None
    return out


def holder(ctx: Ctx, lease_id: str | None = None) -> lease.Holder:
    """The caller as a lease holder: its token, its name, its node."""
    p = ctx.principal
    return lease.Holder(worker=p.name, node=p.node, token_id=p.token_id or None, lease_id=lease_id)


async def _load(uow: UnitOfWork, job_id: str) -> job_state.JobState:
    state = await projection.load(uow, job_id)
    if state is None:
        raise JobNotFound(f"job {job_id} does not exist", job_id=job_id)
    return state


async def _write(
    uow: UnitOfWork, ctx: Ctx, state: job_state.JobState | None, job_id: str,
    events: Sequence[job_events.AnyJobEvent],
) -> job_state.JobState:
    """Append `events` (refusing if the stream moved on) and upsert the view."""
    project = state.project if state is not None else getattr(events[0], "project", None)
    recorded = await uow.append(
        projection.stream_of(job_id),
        [NewEvent(type=job_events.event_type(e), data=job_events.payload(e)) for e in events],
        expected_version=state.version if state is not None else 0,
        meta=ctx.meta(project=project),
    )
    new = projection.apply(state, events, recorded)
    await projection.save(uow, new)
    uow.batch.kind("jobs")[job_id] = new  # the writer's metrics read job durations here
    return new


def create(ctx: Ctx, cmd: job_rules.CreateJob) -> JobCommand:
    async def fn(uow: UnitOfWork) -> View:
        events = job_rules.decide_create(cmd, uow.now)
        if await uow.fetchval("SELECT 1 FROM jobs WHERE id = $1", cmd.job_id):
            raise AlreadyExists(f"job {cmd.job_id} already exists", job_id=cmd.job_id)
        state = await _write(uow, ctx, None, cmd.job_id, events)
        return view(state, uow.now)

    return fn


def claim(ctx: Ctx, *, lease_seconds: int, projects: Sequence[str] | None) -> Callable[
        [UnitOfWork], Awaitable[View | None]]:
    """The oldest pending job (of `projects`, if given), or None.

    Claims are serialised by the log's head lock (every batch holds it), and a
    claim earlier in the same batch has already moved its row out of 'pending',
    so two runners never get the same job.
    """
    async def fn(uow: UnitOfWork) -> View | None:
        if projects:
            row = await uow.fetchrow(
                "SELECT body::text AS body FROM jobs WHERE state = 'pending' AND project = ANY($1::text[]) "
                "ORDER BY created_seq LIMIT 1",
                list(projects),
            )
        else:
            row = await uow.fetchrow(
                "SELECT body::text AS body FROM jobs WHERE state = 'pending' ORDER BY created_seq LIMIT 1"
            )
        if row is None:
            return None
        state = projection.decode_state(row["body"])
        who = holder(ctx, uuid.uuid4().hex)
        events = job_rules.decide_claim(state, job_rules.Claim(holder=who, lease_seconds=lease_seconds), uow.now)
        new = await _write(uow, ctx, state, state.job_id, events)
        expires = uow.now + timedelta(seconds=lease_seconds)
        await uow.execute(
            "INSERT INTO job_leases (job_id, lease_id, node, worker, lease_seconds, expires_at, last_report_at) "
            "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (job_id) DO UPDATE SET "
            "lease_id = EXCLUDED.lease_id, node = EXCLUDED.node, worker = EXCLUDED.worker, "
            "lease_seconds = EXCLUDED.lease_seconds, expires_at = EXCLUDED.expires_at, "
            "last_report_at = EXCLUDED.last_report_at",
            new.job_id, who.lease_id, who.node, who.worker, lease_seconds, expires, uow.now,
        )
        return view(new, uow.now, expires)

    return fn


async def _settle_lease(uow: UnitOfWork, state: job_state.JobState) -> datetime | None:
    """After a command: drop the lease of an ended job, or push a live one out."""
    if state.terminal:
        await uow.execute("DELETE FROM job_leases WHERE job_id = $1", state.job_id)
        return None
    if state.state in job_state.ACTIVE:
        expires = uow.now + timedelta(seconds=state.lease_seconds or 60)
        await uow.execute(
            "UPDATE job_leases SET expires_at = $2, last_report_at = $3 WHERE job_id = $1",
            state.job_id, expires, uow.now,
        )
        return expires
    return None


def report(ctx: Ctx, job_id: str, r: job_rules.Report, lease_id: str | None) -> JobCommand:
    who = holder(ctx, lease_id)

    async def fn(uow: UnitOfWork) -> View:
        state = await _load(uow, job_id)
        events = job_rules.decide_report(state, who, r, uow.now)
        if events:
            state = await _write(uow, ctx, state, job_id, events)
        expires = await _settle_lease(uow, state)
        return view(state, uow.now, expires)

    return fn


def cancel(ctx: Ctx, job_id: str) -> JobCommand:
    async def fn(uow: UnitOfWork) -> View:
        state = await _load(uow, job_id)
        events = job_rules.decide_cancel(state, uow.now)
        if events:
            state = await _write(uow, ctx, state, job_id, events)
            if state.terminal:
                await uow.execute("DELETE FROM job_leases WHERE job_id = $1", job_id)
        expires = await uow.fetchval("SELECT expires_at FROM job_leases WHERE job_id = $1", job_id)
        return view(state, uow.now, expires)

    return fn


def expire_lease(job_id: str, ctx: Ctx) -> Callable[[UnitOfWork], Awaitable[View | None]]:
    """Fail (or, if cancelling, cancel) a job whose lease ran out; re-checked here,
    in the writer's transaction, since a report may have renewed it meanwhile."""

    async def fn(uow: UnitOfWork) -> View | None:
        row = await uow.fetchrow("SELECT expires_at FROM job_leases WHERE job_id = $1", job_id)
        if row is None or row["expires_at"] > uow.now:
            return None
        state = await projection.load(uow, job_id)
        if state is None:
            await uow.execute("DELETE FROM job_leases WHERE job_id = $1", job_id)
            return None
        events = job_rules.decide_lease_expired(state, uow.now, row["expires_at"])
        if events:
            state = await _write(uow, ctx, state, job_id, events)
        await uow.execute("DELETE FROM job_leases WHERE job_id = $1", job_id)
        return view(state, uow.now)

    return fn


async def read_view(conn: Any, job_id: str) -> View | None:
    """The job's view as of the database's clock (the one its decisions use)."""
    row = await conn.fetchrow(
        "SELECT j.body::text AS body, l.expires_at, statement_timestamp() AS now FROM jobs j "
        "LEFT JOIN job_leases l ON l.job_id = j.id WHERE j.id = $1",
        job_id,
    )
    if row is None:
        return None
    return view(projection.decode_state(row["body"]), row["now"], row["expires_at"])
