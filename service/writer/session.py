"""The task states a writer command works with, and the writes they leave.

A `Session` loads task states into the batch's cache (so a command sees what
earlier commands of the same batch did), appends each change's events, folds
them, and buffers the changed views, blockers and leases; the buffer is written
at the batch's next flush, in the statement that appends its events
(`LogTx.flush`). `settle` runs the reactions of `events.task.reactions` in the
same transaction until nothing more follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from taskledger.events.errors import Forbidden, TaskNotFound
from taskledger.events.lease import Holder
from taskledger.events.task import events as codec
from taskledger.events.task.reactions import REACTIONS, Around, Reaction, children_of
from taskledger.events.task.rounds import in_round
from taskledger.events.task.rules import Changes
from taskledger.events.task.state import TaskState
from taskledger.log import NewEvent, Write
from taskledger.projections import tasks as views
from taskledger.service.writer.commands import Ctx
from taskledger.service.writer.engine import Batch, UnitOfWork

_LEASES_UPSERT = """INSERT INTO task_leases (task_id, lease_id, worker, node, token_id, lease_seconds, expires_at)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[], $7::timestamptz[])
ON CONFLICT (task_id) DO UPDATE SET lease_id = EXCLUDED.lease_id, worker = EXCLUDED.worker,
    node = EXCLUDED.node, token_id = EXCLUDED.token_id, lease_seconds = EXCLUDED.lease_seconds,
    expires_at = EXCLUDED.expires_at"""
_LEASES_DELETE = "DELETE FROM task_leases WHERE task_id = ANY($1::text[])"


class _Pending:
    """Task view and lease writes buffered for the batch, written at its next
    flush in the statement that appends the batch's events (`LogTx.flush`)."""

    def __init__(self) -> None:
        self.views: dict[str, TaskState] = {}
        self.created: dict[str, int] = {}
        self.blockers: dict[str, views.Blocker] = {}
        # task id -> its new lease row, or None for a lease that ended: one entry
        # per task, so the upsert and the delete of one flush never meet on a row
        self.leases: dict[str, tuple[Any, ...] | None] = {}

    async def flush(self, conn: Any) -> list[Write]:
        writes: list[Write] = []
        if self.views:
            states, self.views = list(self.views.values()), {}
            created, self.created = self.created, {}
            writes.append(Write(*views.save_statement(states, created)))
        if self.blockers:
            blockers, self.blockers = list(self.blockers.values()), {}
            await views.save_blockers(conn, blockers)
        if self.leases:
            leases, self.leases = self.leases, {}
            new = [row for row in leases.values() if row is not None]
            gone = sorted(t for t, row in leases.items() if row is None)
            if new:
                writes.append(Write(_LEASES_UPSERT, [list(col) for col in zip(*new, strict=True)]))
            if gone:
                writes.append(Write(_LEASES_DELETE, [gone]))
        return writes


def pending(batch: Batch) -> _Pending:
    """The batch's buffered task writes (created with the batch's first command)."""
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


def holder(ctx: Ctx, lease_id: str | None = None) -> Holder:
    """The caller as a lease holder: its token, its name, its node."""
    p = ctx.principal
    if p.node is None:
        raise Forbidden("claiming and reporting work needs a worker token bound to a node")
    return Holder(worker=p.name, node=p.node, token_id=p.token_id or None, lease_id=lease_id)


class Session:
    """The task states a command works with. They live in the batch's cache, so
    a command sees what earlier commands of the same batch did; changed views
    and blockers are written when the batch flushes."""

    def __init__(self, uow: UnitOfWork, ctx: Ctx) -> None:
        self.uow = uow
        self.ctx = ctx
        self.states: dict[str, TaskState | None] = uow.batch.kind("tasks")
        self._pending = pending(uow.batch)

    async def get(self, task_id: str) -> TaskState | None:
        if task_id not in self.states:
            self.states[task_id] = await views.load_one(self.uow.conn, task_id)
        return self.states[task_id]

    async def need(self, task_id: str) -> TaskState:
        s = await self.get(task_id)
        if s is None:
            raise TaskNotFound(f"task {task_id} does not exist", task_id=task_id)
        return s

    async def many(self, ids: Sequence[str]) -> list[TaskState]:
        missing = [i for i in ids if i not in self.states]
        if missing:
            found = await views.load(self.uow.conn, missing)
            for i in missing:
                self.states[i] = found.get(i)
        return [s for i in ids if (s := self.states[i]) is not None]

    def state(self, task_id: str) -> TaskState:
        s = self.states[task_id]
        assert s is not None
        return s

    def adopt(self, s: TaskState) -> TaskState:
        """A state read by a query: the batch's own copy wins, if it has one."""
        s = self.states.get(s.id) or s
        self.states[s.id] = s
        return s

    async def lease_expiry(self, task_id: str) -> datetime | None:
        known = self.uow.batch.kind("lease_expiry")
        if task_id not in known:
            known[task_id] = await self.uow.fetchval("SELECT expires_at FROM task_leases WHERE task_id = $1", task_id)
        expires: datetime | None = known[task_id]
        return expires

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
                [NewEvent(type=codec.event_type(e), data=codec.payload(e)) for e in events],
                expected_version=s.version if s is not None else 0,
                meta=self.ctx.meta(project=project),
            )
            for ev, rec in zip(events, recorded, strict=True):
                if s is None:
                    pending.created[task_id] = rec.seq
                b = await self._blocker(s.blocker_id) if s is not None and s.blocker_id else None
                s, nb = views.fold_one(s, b, ev, seq=rec.seq, version=rec.stream_seq, at=rec.recorded_at)
                if nb is not None:
                    pending.blockers[nb.id] = nb
            assert s is not None
            self.states[task_id] = pending.views[task_id] = s
            if before is not None and before.lease_id is not None and s.lease_id is None:
                pending.leases[task_id] = None
                self.uow.batch.kind("lease_expiry")[task_id] = None
            if task_id not in touched:
                touched.append(task_id)
        return touched

    async def _blocker(self, bid: str) -> views.Blocker | None:
        b = self._pending.blockers.get(bid)
        if b is None:
            await self.uow.flush()
            b = (await views.load_blockers(self.uow.conn, [bid])).get(bid)
        return b

    async def apply_and_settle(self, changes: Changes) -> list[str]:
        touched = await self.apply(changes)
        await self.settle(touched)
        return touched

    async def settle(self, touched: Sequence[str]) -> None:
        """Run the reactions for every changed task until nothing more follows."""
        queue = list(touched)
        for _ in range(10_000):
            if not queue:
                return
            s = self.state(queue.pop(0))
            for reaction in REACTIONS:
                if reaction.when(s):
                    changes = reaction.react(s, await self.around(s, reaction))
                    if changes:
                        queue.extend(await self.apply(changes))
                        s = self.state(s.id)
        raise RuntimeError("task reactions did not settle")

    async def around(self, s: TaskState, reaction: Reaction) -> Around:
        """Load the neighbours a reaction needs."""
        if reaction.needs == "children":
            ids = list(s.verifier_task_ids)
            if s.is_parent:
                ids += [r["id"] for r in await self.uow.fetch(
                    "SELECT id FROM tasks WHERE parent_task_id = $1 AND task_type <> 'verify'", s.id)]
            return Around(others=children_of(s, await self.many(ids)))
        parent = await self.get(s.parent_task_id) if s.parent_task_id else None
        if reaction.needs == "parent" or parent is None:
            return Around(parent=parent)
        return Around(parent=parent, others=await self.round_of(parent))

    async def round_of(self, parent: TaskState) -> list[TaskState]:
        rows = await self.uow.fetch(
            "SELECT id FROM tasks WHERE parent_task_id = $1 AND subtask_round = $2 AND task_type <> 'verify'",
            parent.id, parent.round or 1)
        known = [i for i, t in self.states.items() if t is not None and t.parent_task_id == parent.id]
        return in_round(parent, await self.many(list(dict.fromkeys([*(r["id"] for r in rows), *known]))))
