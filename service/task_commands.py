"""Task commands: load states, ask the pure model, append, fold, save the views.

Each public function here is a writer command (it runs inside a batch
transaction through a UnitOfWork) and returns the view(s) after the command.
Rules that span tasks (a verifier's verdict deciding its maker, a sub-task
closing its parent's round, a cancelled parent cancelling its sub-tasks) run in
`_settle`, in the same transaction as the change that triggered them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Literal

from events.canonical import format_ts
from events.errors import Forbidden, InvalidTransition, LeaseMismatch, TaskNotFound, ValidationFailed
from events.store import NewEvent
from events.tasks import (
    CANCELLABLE,
    TERMINAL_FOR_ROUND,
    Category,
    Changes,
    NewTask,
    Outcome,
    RequirementVerdict,
    TaskCancelled,
    TaskState,
    check_heartbeat,
    decide_cancel,
    decide_claim,
    decide_collect,
    decide_complete,
    decide_create,
    decide_escalate,
    decide_fail,
    decide_lease_expired,
    decide_round_check,
    decide_round_review,
    decide_start,
    decide_unblock,
    decide_verifier_complete,
    event_data,
    event_type,
    evolve,
    synthesized_blocked_verdict,
)
from projections import tasks as views
from service.commands import Ctx
from service.writer import Batch, UnitOfWork


class _Pending:
    """Task view writes buffered for the batch, written at its next flush."""

    def __init__(self) -> None:
        self.views: dict[str, TaskState] = {}
        self.created: dict[str, int] = {}
        self.blockers: dict[str, views.Blocker] = {}
        self.leases_gone: set[str] = set()

    async def flush(self, conn: Any) -> None:
        if self.views:
            states, self.views = list(self.views.values()), {}
            created, self.created = self.created, {}
            await views.save(conn, states, created)
        if self.blockers:
            blockers, self.blockers = list(self.blockers.values()), {}
            await views.save_blockers(conn, blockers)
        if self.leases_gone:
            gone, self.leases_gone = sorted(self.leases_gone), set()
            await conn.execute("DELETE FROM task_leases WHERE task_id = ANY($1::text[])", gone)


def _pending(batch: Batch) -> _Pending:
    cache = batch.kind("task_writes")
    p = cache.get("pending")
    if p is None:
        p = cache["pending"] = _Pending()
        batch.on_flush(p.flush)
    assert isinstance(p, _Pending)
    return p


async def prefetch_tasks(batch: Batch, ids: list[str]) -> None:
    """Load the tasks a batch's commands will need, in one query."""
    cache = batch.kind("tasks")
    missing = [i for i in ids if i not in cache]
    if not missing:
        return
    rows = await batch.conn.fetch(
        """SELECT t.id, t.body::text AS body, l.expires_at FROM tasks t
           LEFT JOIN task_leases l ON l.task_id = t.id WHERE t.id = ANY($1::text[])""", missing)
    found = {r["id"]: r for r in rows}
    expiry = batch.kind("lease_expiry")
    for i in missing:
        r = found.get(i)
        cache[i] = views.decode_state(r["body"]) if r is not None else None
        expiry[i] = r["expires_at"] if r is not None else None


class Session:
    """The task states a command works with. They live in the batch's cache, so
    a command sees what earlier commands of the same batch did; changed views
    and blockers are written when the batch flushes."""

    def __init__(self, uow: UnitOfWork, ctx: Ctx) -> None:
        self.uow = uow
        self.ctx = ctx
        self.states: dict[str, TaskState | None] = uow.batch.kind("tasks")
        self._pending = _pending(uow.batch)

    async def get(self, task_id: str) -> TaskState | None:
        if task_id in self.states:
            return self.states[task_id]
        s = await views.load_one(self.uow.conn, task_id)
        self.states[task_id] = s
        return s

    async def need(self, task_id: str) -> TaskState:
        s = await self.get(task_id)
        if s is None:
            raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
        return s

    def state(self, task_id: str) -> TaskState:
        s = self.states[task_id]
        assert s is not None
        return s

    async def apply(self, changes: Changes) -> list[str]:
        """Append each (task, events) group, fold it, and buffer the changed views."""
        touched: list[str] = []
        pending = self._pending
        for task_id, events in changes:
            if not events:
                continue
            s = self.states.get(task_id)
            before = s
            project = s.project if s is not None else getattr(events[0], "project", None)
            recorded = await self.uow.append(
                f"task:{task_id}",
                [NewEvent(type=event_type(e), data=event_data(e)) for e in events],
                expected_version=s.version if s is not None else 0,
                meta=self.ctx.meta(project=project),
            )
            for ev, rec in zip(events, recorded, strict=True):
                if s is not None:
                    b = None
                    if s.blocker_id is not None:
                        bid = s.blocker_id
                        b = pending.blockers.get(bid)
                        if b is None:
                            await self.uow.flush()
                            b = (await views.load_blockers(self.uow.conn, [bid])).get(bid)
                    nb = views.evolve_blocker(b, s, ev, seq=rec.seq, at=rec.recorded_at)
                    if nb is not None:
                        pending.blockers[nb.id] = nb
                else:
                    pending.created[task_id] = rec.seq
                s = evolve(s, ev, seq=rec.seq, version=rec.stream_seq, at=rec.recorded_at)
            assert s is not None
            self.states[task_id] = s
            pending.views[task_id] = s
            if before is not None and before.lease_id is not None and s.lease_id is None:
                pending.leases_gone.add(task_id)
                self.uow.batch.kind("lease_expiry")[task_id] = None
            if task_id not in touched:
                touched.append(task_id)
        return touched

    async def apply_and_settle(self, changes: Changes) -> list[str]:
        touched = await self.apply(changes)
        await self._settle(touched)
        return touched

    async def _settle(self, touched: Sequence[str]) -> None:
        queue = list(touched)
        guard = 0
        while queue:
            guard += 1
            if guard > 10_000:
                raise RuntimeError("task rules did not settle")
            tid = queue.pop(0)
            s = self.state(tid)
            changes: Changes = []
            if s.task_type == "verify" and s.parent_task_id and s.state in ("deadletter", "cancelled"):
                maker = await self.get(s.parent_task_id)
                if maker is not None:
                    changes += synthesized_blocked_verdict(
                        s, maker, f"verifier {s.id} is {s.state}")
            if s.task_type != "verify" and s.state == "cancelled":
                changes += await self._cascade_cancel(s)
            if s.task_type != "verify" and s.parent_task_id and s.state in TERMINAL_FOR_ROUND:
                parent = await self.get(s.parent_task_id)
                if parent is not None and parent.is_parent and parent.state == "in_progress":
                    rows = await self.uow.fetch(
                        "SELECT id, state FROM tasks WHERE parent_task_id = $1 AND subtask_round = $2 "
                        "AND task_type <> 'verify'",
                        parent.id, parent.round or 1,
                    )
                    sts = [cached.state if (cached := self.states.get(r["id"])) is not None else r["state"]
                           for r in rows]
                    ev = decide_round_check(parent, sts)
                    if ev:
                        changes.append((parent.id, list(ev)))
            if changes:
                queue.extend(await self.apply(changes))

    async def _cascade_cancel(self, s: TaskState) -> Changes:
        out: Changes = []
        ids: list[str] = list(s.verifier_task_ids)
        if s.is_parent:
            rows = await self.uow.fetch(
                "SELECT id FROM tasks WHERE parent_task_id = $1 AND task_type <> 'verify'", s.id)
            ids += [r["id"] for r in rows]
        for cid in ids:
            c = await self.get(cid)
            if c is None or c.state not in CANCELLABLE:
                continue
            out.append((cid, [TaskCancelled(reason=f"{s.id} was cancelled", by=self.ctx.principal.name)]))
        return out


def _worker_node(ctx: Ctx) -> tuple[str, str]:
    p = ctx.principal
    if p.node is None:
        raise Forbidden("claiming and reporting work needs a worker token bound to a node")
    return p.name, p.node


async def create(uow: UnitOfWork, ctx: Ctx, t: NewTask, *, default_escalation: int) -> TaskState:
    ses = Session(uow, ctx)
    existing = await ses.get(t.id)
    parent = await ses.get(t.parent_task_id) if t.parent_task_id else None
    changes = decide_create(existing, t, parent, default_escalation=default_escalation)
    await ses.apply_and_settle(changes)
    return ses.state(t.id)


async def create_many(
    uow: UnitOfWork, ctx: Ctx, ts: Sequence[NewTask], *, default_escalation: int
) -> list[TaskState]:
    ses = Session(uow, ctx)
    out = []
    for t in ts:
        existing = await ses.get(t.id)
        parent = await ses.get(t.parent_task_id) if t.parent_task_id else None
        await ses.apply_and_settle(decide_create(existing, t, parent, default_escalation=default_escalation))
        out.append(ses.state(t.id))
    return out


_CLAIM_SQL = """
SELECT body::text AS body FROM tasks
WHERE state = 'pending' AND NOT is_parent
  AND task_type = ANY($1::text[])
  AND ($2::text[] IS NULL OR project = ANY($2::text[]))
  AND (assignee IS NULL OR assignee = $3)
  AND NOT ($4 = ANY(node_blacklist))
  AND (task_type <> 'verify'
       OR (maker_worker IS DISTINCT FROM $3 AND maker_node IS DISTINCT FROM $4))
ORDER BY priority DESC, created_seq
LIMIT 16
"""


async def anything_to_claim(
    pool: Any, ctx: Ctx, *, task_types: Sequence[str], projects: Sequence[str] | None
) -> bool:
    """A read outside the writer: is there a task this worker could claim now?

    An idle worker polling for work then costs one indexed read instead of a
    place in a write batch. A task that appears just after this read is found
    by the worker's next poll; the claim itself always decides in the writer.
    """
    worker, node = _worker_node(ctx)
    row = await pool.fetchval(
        _CLAIM_SQL.replace("SELECT body::text AS body", "SELECT 1").replace("LIMIT 16", "LIMIT 1"),
        list(task_types), list(projects) if projects is not None else None, worker, node,
    )
    return row is not None


async def claim(
    uow: UnitOfWork, ctx: Ctx, *, task_types: Sequence[str], projects: Sequence[str] | None,
    lease_seconds: int,
) -> TaskState | None:
    worker, node = _worker_node(ctx)
    rows = await uow.fetch(_CLAIM_SQL, list(task_types), list(projects) if projects is not None else None,
                           worker, node)
    ses = Session(uow, ctx)
    expires = uow.now + timedelta(seconds=lease_seconds)
    for r in rows:
        s = views.decode_state(r["body"])
        s = ses.states.get(s.id) or s
        try:
            events = decide_claim(
                s, node=node, worker=worker, lease_id="L-" + uuid.uuid4().hex,
                lease_expires_at=format_ts(expires), task_types=task_types, projects=projects,
            )
        except InvalidTransition:
            continue
        ses.states[s.id] = s
        await ses.apply([(s.id, list(events))])
        claimed = ses.state(s.id)
        await uow.execute(
            """INSERT INTO task_leases (task_id, lease_id, worker, node, lease_seconds, expires_at)
               VALUES ($1, $2, $3, $4, $5, $6)
               ON CONFLICT (task_id) DO UPDATE SET lease_id = EXCLUDED.lease_id, worker = EXCLUDED.worker,
                   node = EXCLUDED.node, lease_seconds = EXCLUDED.lease_seconds,
                   expires_at = EXCLUDED.expires_at""",
            s.id, claimed.lease_id, worker, node, lease_seconds, expires,
        )
        uow.batch.kind("lease_expiry")[s.id] = expires
        return claimed
    return None


async def start(uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str) -> TaskState:
    worker, _ = _worker_node(ctx)
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await _check_live_lease(uow, s, lease_id)
    await ses.apply([(task_id, list(decide_start(s, lease_id=lease_id, worker=worker)))])
    return ses.state(task_id)


async def _check_live_lease(uow: UnitOfWork, s: TaskState, lease_id: str) -> None:
    """A lease past its deadline no longer holds the task, even before the sweeper runs."""
    if s.lease_id is None or s.lease_id != lease_id:
        return  # the pure rule reports the mismatch
    known = uow.batch.kind("lease_expiry")
    if s.id in known:
        expires = known[s.id]
    else:
        expires = await uow.fetchval("SELECT expires_at FROM task_leases WHERE task_id = $1", s.id)
    if expires is not None and expires < uow.now:
        raise LeaseMismatch(f"the lease on task {s.id} has expired", task_id=s.id)


async def complete(
    uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str, result: Any, outcome: Outcome | None,
    verdicts: Sequence[RequirementVerdict], category: Category | None, default_escalation: int,
) -> TaskState:
    worker, _ = _worker_node(ctx)
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await _check_live_lease(uow, s, lease_id)
    if s.task_type == "verify":
        if outcome is None:
            raise ValidationFailed("completing a verify task needs an outcome (PASS, FAIL or BLOCKED)")
        maker = await ses.get(s.parent_task_id) if s.parent_task_id else None
        changes = decide_verifier_complete(
            s, maker, lease_id=lease_id, worker=worker, outcome=outcome, verdicts=verdicts,
            category=category, result=result, default_escalation=default_escalation,
        )
    else:
        if outcome is not None or verdicts or category is not None:
            raise ValidationFailed("outcome, verdicts and category are for verify tasks")
        changes = decide_complete(s, lease_id=lease_id, worker=worker, result=result)
    await ses.apply_and_settle(changes)
    return ses.state(task_id)


async def fail(uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str, error: str) -> TaskState:
    worker, _ = _worker_node(ctx)
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await _check_live_lease(uow, s, lease_id)
    await ses.apply_and_settle([(task_id, list(decide_fail(s, lease_id=lease_id, worker=worker, error=error)))])
    return ses.state(task_id)


async def heartbeat(pool: Any, ctx: Ctx, task_id: str, *, lease_id: str, lease_seconds: int | None) -> TaskState:
    """Extends the lease without an event (a heartbeat changes no state)."""
    worker, _ = _worker_node(ctx)
    row = await pool.fetchrow(
        """UPDATE task_leases SET expires_at = clock_timestamp()
                                  + make_interval(secs => coalesce($4, lease_seconds))
           WHERE task_id = $1 AND lease_id = $2 AND worker = $3 AND expires_at > clock_timestamp()
           RETURNING expires_at""",
        task_id, lease_id, worker, lease_seconds,
    )
    s = await views.load_one(pool, task_id)
    if s is None:
        raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
    if row is None:
        check_heartbeat(s, lease_id=lease_id, worker=worker)
        raise LeaseMismatch(f"the lease on task {task_id} has expired", task_id=task_id)
    s.lease_expires_at = format_ts(row["expires_at"])
    return s


async def cancel(uow: UnitOfWork, ctx: Ctx, task_id: str, *, reason: str) -> TaskState:
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await ses.apply_and_settle([(task_id, list(decide_cancel(s, reason=reason, by=ctx.principal.name)))])
    return ses.state(task_id)


async def unblock(
    uow: UnitOfWork, ctx: Ctx, task_id: str, *, action: Literal["retry", "reverify"], notes: str | None
) -> TaskState:
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await ses.apply_and_settle(decide_unblock(s, action=action, notes=notes))
    return ses.state(task_id)


async def collect(uow: UnitOfWork, ctx: Ctx, *, project: str | None, limit: int) -> list[TaskState]:
    rows = await uow.fetch(
        """SELECT body::text AS body FROM tasks
           WHERE state IN ('completed', 'verified') AND task_type <> 'verify' AND NOT is_parent
             AND ($1::text IS NULL OR project = $1)
           ORDER BY seq LIMIT $2""",
        project, limit,
    )
    ses = Session(uow, ctx)
    changes: Changes = []
    for r in rows:
        s = views.decode_state(r["body"])
        s = ses.states.get(s.id) or s
        ses.states[s.id] = s
        changes.append((s.id, list(decide_collect(s, by=ctx.principal.name))))
    if not changes:
        return []
    await ses.apply_and_settle(changes)
    return [ses.state(tid) for tid, _ in changes]


async def round_review(
    uow: UnitOfWork, ctx: Ctx, task_id: str, *, decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"],
    notes: str, goal_clear: bool | str | None, coverage: str | None, next_round: str | None,
    new_subtasks: Sequence[NewTask], default_escalation: int,
) -> TaskState:
    ses = Session(uow, ctx)
    parent = await ses.need(task_id)
    ids = [t.id for t in new_subtasks]
    existing = {r["id"] for r in await uow.fetch("SELECT id FROM tasks WHERE id = ANY($1::text[])", ids)}
    changes = decide_round_review(
        parent, decision=decision, notes=notes, goal_clear=goal_clear, coverage=coverage,
        next_round=next_round, new_subtasks=new_subtasks, reviewer=ctx.principal.name,
        existing_ids=existing, default_escalation=default_escalation,
    )
    await ses.apply_and_settle(changes)
    return ses.state(task_id)


async def sweep(uow: UnitOfWork, ctx: Ctx, *, limit: int = 200) -> int:
    """Expire leases whose holders stopped heartbeating; escalate tasks nobody took."""
    ses = Session(uow, ctx)
    n = 0
    rows = await uow.fetch(
        """SELECT task_id, lease_id FROM task_leases WHERE expires_at < $1
           ORDER BY expires_at LIMIT $2 FOR UPDATE""",
        uow.now, limit,
    )
    for r in rows:
        s = await ses.get(r["task_id"])
        if s is None:
            continue
        events = decide_lease_expired(s, lease_id=r["lease_id"])
        if events:
            await ses.apply_and_settle([(s.id, list(events))])
            n += 1
        else:
            await uow.execute("DELETE FROM task_leases WHERE task_id = $1 AND lease_id = $2",
                              r["task_id"], r["lease_id"])
    rows = await uow.fetch(
        "SELECT body::text AS body FROM tasks WHERE escalate_at <= $1 ORDER BY escalate_at LIMIT $2",
        uow.now, limit,
    )
    for r in rows:
        s = views.decode_state(r["body"])
        s = ses.states.get(s.id) or s
        ses.states[s.id] = s
        ready = datetime.fromisoformat((s.ready_at or s.updated_at).replace("Z", "+00:00"))
        waited = int((uow.now - ready).total_seconds())
        events = decide_escalate(s, waited_seconds=waited)
        if events:
            await ses.apply([(s.id, list(events))])
            n += 1
    return n


async def due_for_sweep(pool: Any) -> bool:
    """A cheap look, outside the writer, at whether a sweep has anything to do."""
    return bool(await pool.fetchval(
        """SELECT EXISTS (SELECT 1 FROM task_leases WHERE expires_at < clock_timestamp())
               OR EXISTS (SELECT 1 FROM tasks WHERE escalate_at <= clock_timestamp())"""
    ))
