"""Task commands: load states, ask the pure model, append, fold, save the views.

Each public function here is a writer command (it runs inside a batch
transaction through a UnitOfWork) and returns the view(s) after the command.
Nothing here decides: the rules are in `events.task`; the rules that span tasks
are the reactions of `events.task.reactions.REACTIONS`, which `Session.settle`
runs in the same transaction as the change that triggered them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

import msgspec

from taskledger.events.canonical import format_ts
from taskledger.events.errors import (
    AlreadyExists,
    DomainError,
    InvalidTransition,
    LeaseMismatch,
    TaskNotFound,
    ValidationFailed,
)
from taskledger.events.lease import Holder
from taskledger.events.task.events import TaskType, UnblockAction
from taskledger.events.task.panel import Verdict, decide_complete, decide_unblock, decide_verifier_complete
from taskledger.events.task.rounds import Review, decide_round_review
from taskledger.events.task.rules import (
    Changes,
    Claim,
    NewTask,
    check_heartbeat,
    decide_cancel,
    decide_claim,
    decide_collect,
    decide_create,
    decide_escalate,
    decide_fail,
    decide_lease_expired,
    decide_reassign,
    decide_release,
    decide_start,
    refuse_expired_lease,
    validate_new_task,
)
from taskledger.events.task.state import TaskState
from taskledger.projections import tasks as views
from taskledger.service.writer.commands import Ctx
from taskledger.service.writer.engine import UnitOfWork
from taskledger.service.writer.session import Session, holder, pending


async def create(uow: UnitOfWork, ctx: Ctx, t: NewTask, *, default_escalation: int) -> TaskState:
    return (await create_many(uow, ctx, [t], default_escalation=default_escalation))[0]


def at_index(i: int, e: DomainError) -> DomainError:
    """The same refusal, naming the batch entry it is about (`errors[0].index`)."""
    return type(e)(f"tasks[{i}]: {e.detail}", **{
        **e.extra, "errors": [{"index": i, "code": e.code, "detail": e.detail}]})


async def create_many(
    uow: UnitOfWork, ctx: Ctx, ts: Sequence[NewTask], *, default_escalation: int, indexed: bool = False,
) -> list[TaskState]:
    """Create `ts` in order, all or nothing; with `indexed`, a refusal names the
    index of the task it is about. What can be refused without writing is checked for every
    task first, so a bad batch usually costs no write at all; a refusal found
    later (a parent that cannot take sub-tasks) rolls the whole writer batch
    back like any command that refuses after writing."""
    ses = Session(uow, ctx)
    seen: set[str] = set()
    for i, t in enumerate(ts):
        try:
            validate_new_task(t)
            if t.id in seen or await ses.get(t.id) is not None:
                raise AlreadyExists(f"task {t.id} already exists", task_id=t.id)
            if t.parent_task_id is not None and t.parent_task_id not in seen \
                    and await ses.get(t.parent_task_id) is None:
                raise ValidationFailed(f"parent task {t.parent_task_id} does not exist")
        except DomainError as e:
            raise (at_index(i, e) if indexed else e) from None
        seen.add(t.id)
    out = []
    for i, t in enumerate(ts):
        parent = await ses.get(t.parent_task_id) if t.parent_task_id else None
        try:
            changes = decide_create(None, t, parent, default_escalation=default_escalation)
        except DomainError as e:
            raise (at_index(i, e) if indexed else e) from None
        await ses.apply_and_settle(changes)
        out.append(ses.state(t.id))
    return out


def _claim_sql(projects: Sequence[str] | None, *, select: str = "body::text AS body", limit: int = 16) -> str:
    """The claim query. With one project it says `project = ...` rather than
    `= ANY(...)`, so PostgreSQL walks `tasks_claimable_by_project` in claim order
    and stops at `limit`; `= ANY` would read every pending task of the project
    and sort them (seconds for a 40,000-task backlog, inside the writer).

    With projects it drops `$2 IS NULL OR`: once a prepared statement goes to
    its generic plan, that OR keeps the project out of the index condition, and
    the claim walked `tasks_claimable` through every other project's backlog
    (80 ms a claim behind 130,000 pending tasks elsewhere). With one project,
    `project` leads the ORDER BY (one value: the same order) so that only
    tasks_claimable_by_project serves it: a generic plan for the LIMIT 1 of
    anything_to_claim otherwise took tasks_claimable too (60 ms a poll).
    That alone did not hold once the table had statistics: PostgreSQL drops a
    sort key fixed to one value, so both indexes gave claim order and the
    plan took tasks_claimable again. Its predicate now carries
    `created_seq > 0` (sql/011_claim_index_for_any_project.sql), which only
    the other claims state, so a one-project claim cannot use it at all."""
    order = "priority DESC, created_seq"
    if projects is None:
        project = "$2::text[] IS NULL AND created_seq > 0"
    elif len(projects) > 1:
        project = "project = ANY($2::text[]) AND created_seq > 0"
    else:
        project, order = "project = ($2::text[])[1]", "project, priority DESC, created_seq"
    return f"""
SELECT {select} FROM tasks
WHERE state = 'pending' AND NOT is_parent
  AND task_type = ANY($1::text[])
  AND {project}
  AND (assignee IS NULL OR assignee = $3)
  AND NOT ($4 = ANY(node_blacklist))
  AND (task_type <> 'verify'
       OR (maker_worker IS DISTINCT FROM $3 AND maker_node IS DISTINCT FROM $4))
ORDER BY {order}
LIMIT {int(limit)}
"""


async def anything_to_claim(
    pool: Any, ctx: Ctx, *, task_types: Sequence[str], projects: Sequence[str] | None
) -> bool:
    """A read outside the writer: is there a task this worker could claim now?

    An idle worker polling for work then costs one indexed read instead of a
    place in a write batch. A task that appears just after this read is found
    by the worker's next poll; the claim itself always decides in the writer.
    """
    who = holder(ctx)
    row = await pool.fetchval(
        _claim_sql(projects, select="1", limit=1), list(task_types),
        list(projects) if projects is not None else None, who.worker, who.node,
    )
    return row is not None


async def claim(
    uow: UnitOfWork, ctx: Ctx, *, task_types: Sequence[TaskType], projects: Sequence[str] | None,
    lease_seconds: int,
) -> TaskState | None:
    got = await claim_many(uow, ctx, task_types=task_types, projects=projects, lease_seconds=lease_seconds,
                           limit=1)
    return got[0] if got else None


async def claim_many(
    uow: UnitOfWork, ctx: Ctx, *, task_types: Sequence[TaskType], projects: Sequence[str] | None,
    lease_seconds: int, limit: int, start: bool = False,
) -> list[TaskState]:
    """Claim up to `limit` tasks, in claim order, each with a lease of its own;
    with `start`, each is also started by its new lease (its own task.claimed
    then task.started, as a claim and a start sent one after the other)."""
    who = holder(ctx)
    rows = await uow.fetch(_claim_sql(projects, limit=limit + 15), list(task_types),
                           list(projects) if projects is not None else None, who.worker, who.node)
    ses = Session(uow, ctx)
    claimed: list[TaskState] = []
    for r in rows:
        if len(claimed) >= limit:
            break
        s = ses.adopt(views.decode_state(r["body"]))
        mine = msgspec.structs.replace(who, lease_id="L-" + uuid.uuid4().hex)
        cmd = Claim(holder=mine, lease_seconds=lease_seconds, task_types=task_types, projects=projects)
        try:
            events = decide_claim(s, cmd, uow.now)
        except InvalidTransition:
            continue
        await ses.apply([(s.id, events)])
        if start:
            await ses.apply([(s.id, decide_start(ses.state(s.id), mine))])
        claimed.append(ses.state(s.id))
    if not claimed:
        return []
    expiry = uow.batch.kind("lease_expiry")
    leases = pending(uow.batch).leases
    for c in claimed:
        expires = datetime.fromisoformat((c.lease_expires_at or "").replace("Z", "+00:00"))
        expiry[c.id] = expires
        leases[c.id] = (c.id, c.lease_id, who.worker, who.node, who.token_id, lease_seconds, expires)
    return claimed


async def _leased(ses: Session, task_id: str, who: Holder) -> TaskState:
    s = await ses.need(task_id)
    refuse_expired_lease(s, who, await ses.lease_expiry(task_id), ses.uow.now)
    return s


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """A lease holder's report on one task: start (task and lease), or complete
    (and the result, with the checker's verdict on a verify task)."""

    task_id: str
    lease_id: str
    result: Any = None
    verdict: Verdict | None = None


async def _decide_start(ses: Session, r: Report) -> Changes:
    who = holder(ses.ctx, r.lease_id)
    s = await _leased(ses, r.task_id, who)
    return [(r.task_id, decide_start(s, who))]


async def _decide_complete(ses: Session, r: Report) -> Changes:
    who = holder(ses.ctx, r.lease_id)
    s = await _leased(ses, r.task_id, who)
    if s.task_type == "verify":
        if r.verdict is None:
            raise ValidationFailed("completing a verify task needs an outcome (PASS, FAIL or BLOCKED)")
        maker = await ses.get(s.parent_task_id) if s.parent_task_id else None
        return decide_verifier_complete(s, maker, who, msgspec.structs.replace(r.verdict, result=r.result))
    if r.verdict is not None:
        raise ValidationFailed("outcome, verdicts and category are for verify tasks")
    return decide_complete(s, who, r.result)


async def _report_many(
    uow: UnitOfWork, ctx: Ctx, reports: Sequence[Report], decide: Callable[[Session, Report], Awaitable[Changes]],
    *, settle: bool, indexed: bool,
) -> list[TaskState]:
    """Run `decide` for each report in order, all or nothing, and answer the views.

    Each report is decided against the states the earlier ones left (a verdict
    sees the panel as the previous verdict of the batch left it), exactly as
    the same reports sent one by one. Before anything is written, every report
    is decided once against the states as they are: a batch with a report the
    rules refuse is then refused without a write, naming its index. A refusal
    that only follows from an earlier report of the batch (a panel the batch
    itself has ended) rolls the writer batch back, like any command that
    refuses after writing."""
    ses = Session(uow, ctx)
    first: dict[str, int] = {}
    for i, r in enumerate(reports):
        j = first.setdefault(r.task_id, i)
        if j != i:
            raise at_index(i, ValidationFailed(f"task {r.task_id} is already reported by tasks[{j}]"))
    found = await ses.many(list(first))
    makers = [s.parent_task_id for s in found if s.task_type == "verify" and s.parent_task_id]
    if makers:
        await ses.many(list(dict.fromkeys(makers)))

    def refusal(i: int, e: DomainError) -> DomainError:
        return at_index(i, e) if indexed else e

    if len(reports) > 1:
        for i, r in enumerate(reports):
            try:
                await decide(ses, r)
            except DomainError as e:
                raise refusal(i, e) from None
    out = []
    for i, r in enumerate(reports):
        try:
            changes = await decide(ses, r)
        except DomainError as e:
            raise refusal(i, e) from None
        await (ses.apply_and_settle(changes) if settle else ses.apply(changes))
        out.append(ses.state(r.task_id))
    return out


async def start_many(uow: UnitOfWork, ctx: Ctx, reports: Sequence[Report], *, indexed: bool = False
                     ) -> list[TaskState]:
    return await _report_many(uow, ctx, reports, _decide_start, settle=False, indexed=indexed)


async def complete_many(uow: UnitOfWork, ctx: Ctx, reports: Sequence[Report], *, indexed: bool = False
                        ) -> list[TaskState]:
    return await _report_many(uow, ctx, reports, _decide_complete, settle=True, indexed=indexed)


async def start(uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str) -> TaskState:
    return (await start_many(uow, ctx, [Report(task_id=task_id, lease_id=lease_id)]))[0]


async def complete(
    uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str, result: Any, verdict: Verdict | None,
) -> TaskState:
    return (await complete_many(uow, ctx, [Report(task_id=task_id, lease_id=lease_id, result=result,
                                                  verdict=verdict)]))[0]


async def fail(uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str, error: str) -> TaskState:
    ses, who = Session(uow, ctx), holder(ctx, lease_id)
    s = await _leased(ses, task_id, who)
    await ses.apply_and_settle([(task_id, decide_fail(s, who, error))])
    return ses.state(task_id)


async def release(uow: UnitOfWork, ctx: Ctx, task_id: str, *, lease_id: str, reason: str) -> TaskState:
    ses, who = Session(uow, ctx), holder(ctx, lease_id)
    s = await _leased(ses, task_id, who)
    await ses.apply_and_settle([(task_id, decide_release(s, who, reason))])
    return ses.state(task_id)


async def heartbeat(pool: Any, ctx: Ctx, task_id: str, *, lease_id: str, lease_seconds: int | None) -> TaskState:
    """Extends the lease without an event (a heartbeat changes no state)."""
    who = holder(ctx, lease_id)
    row = await pool.fetchrow(
        """UPDATE task_leases SET expires_at = clock_timestamp()
                                  + make_interval(secs => coalesce($4, lease_seconds))
           WHERE task_id = $1 AND lease_id = $2 AND worker = $3 AND node IS NOT DISTINCT FROM $5
             AND (token_id IS NULL OR token_id = $6) AND expires_at > clock_timestamp()
           RETURNING expires_at""",
        task_id, lease_id, who.worker, lease_seconds, who.node, who.token_id,
    )
    s = await views.load_one(pool, task_id)
    if s is None:
        raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
    if row is None:
        check_heartbeat(s, who)
        raise LeaseMismatch(f"the lease on task {task_id} has expired", task_id=task_id)
    return msgspec.structs.replace(s, lease_expires_at=format_ts(row["expires_at"]))


async def cancel(uow: UnitOfWork, ctx: Ctx, task_id: str, *, reason: str) -> TaskState:
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await ses.apply_and_settle([(task_id, decide_cancel(s, reason, ctx.principal.name))])
    return ses.state(task_id)


async def reassign(uow: UnitOfWork, ctx: Ctx, task_id: str, *, assignee: str | None) -> TaskState:
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    await ses.apply_and_settle([(task_id, decide_reassign(s, assignee, ctx.principal.name))])
    return ses.state(task_id)


async def unblock(uow: UnitOfWork, ctx: Ctx, task_id: str, *, action: UnblockAction, notes: str | None) -> TaskState:
    ses = Session(uow, ctx)
    s = await ses.need(task_id)
    parent = await ses.get(s.parent_task_id) if s.parent_task_id else None
    await ses.apply_and_settle(decide_unblock(s, action, notes, parent))
    return ses.state(task_id)


_COLLECTABLE = "state IN ('completed', 'verified') AND task_type <> 'verify' AND NOT is_parent"
_COLLECT_SQL = f"SELECT body::text AS body FROM tasks WHERE {_COLLECTABLE} AND project = $1 ORDER BY seq LIMIT $2"
_COLLECT_ANY_SQL = f"SELECT body::text AS body FROM tasks WHERE {_COLLECTABLE} ORDER BY seq LIMIT $1"


async def collect(uow: UnitOfWork, ctx: Ctx, *, project: str | None, limit: int) -> list[TaskState]:
    # Two statements rather than `($1 IS NULL OR project = $1)`: a prepared
    # statement's generic plan cannot use `tasks_collectable (project, seq)` for
    # that, and read every collectable task of every project, in seq order, to
    # find one project's (150 ms a collect with 30,000 waiting elsewhere).
    if project is None:
        rows = await uow.fetch(_COLLECT_ANY_SQL, limit)
    else:
        rows = await uow.fetch(_COLLECT_SQL, project, limit)
    ses = Session(uow, ctx)
    changes: Changes = [(s.id, decide_collect(s, ctx.principal.name))
                        for s in (ses.adopt(views.decode_state(r["body"])) for r in rows)]
    if not changes:
        return []
    await ses.apply_and_settle(changes)
    return [ses.state(tid) for tid, _ in changes]


async def round_review(
    uow: UnitOfWork, ctx: Ctx, task_id: str, review: Review, *, default_escalation: int,
) -> TaskState:
    ses = Session(uow, ctx)
    parent = await ses.need(task_id)
    ids = [t.id for t in review.new_subtasks]
    existing = {r["id"] for r in await uow.fetch("SELECT id FROM tasks WHERE id = ANY($1::text[])", ids)}
    changes = decide_round_review(
        parent, msgspec.structs.replace(review, reviewer=ctx.principal.name), await ses.round_of(parent),
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
        events = decide_lease_expired(s, r["lease_id"]) if s is not None else []
        if events:
            await ses.apply_and_settle([(r["task_id"], events)])
            n += 1
        else:
            await uow.execute("DELETE FROM task_leases WHERE task_id = $1 AND lease_id = $2",
                              r["task_id"], r["lease_id"])
    rows = await uow.fetch(
        "SELECT body::text AS body FROM tasks WHERE escalate_at <= $1 ORDER BY escalate_at LIMIT $2",
        uow.now, limit,
    )
    for r in rows:
        s = ses.adopt(views.decode_state(r["body"]))
        events = decide_escalate(s, uow.now)
        if events:
            await ses.apply([(s.id, events)])
            n += 1
    return n


# statement_timestamp(), not clock_timestamp(): a volatile function cannot be
# an index condition, so with clock_timestamp() PostgreSQL filtered every row of
# `tasks` (100 ms a poll, once a second, with 280,000 tasks) instead of looking
# at the start of `tasks_escalation` and `task_leases_expiry`.
DUE_FOR_SWEEP = """SELECT EXISTS (SELECT 1 FROM task_leases WHERE expires_at < statement_timestamp())
    OR EXISTS (SELECT 1 FROM tasks WHERE escalate_at <= statement_timestamp())"""


async def due_for_sweep(pool: Any) -> bool:
    """A cheap look, outside the writer, at whether a sweep has anything to do."""
    return bool(await pool.fetchval(DUE_FOR_SWEEP))
