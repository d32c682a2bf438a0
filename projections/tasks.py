"""The task and blocker views: rows folded from task events, written inline.

Each task row keeps the whole folded `TaskState` as `body` plus the columns
that queries filter and order on. Blockers are folded from `task.blocked`,
`task.unblocked` and `task.cancelled`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from events.tasks import (
    TaskBlocked,
    TaskCancelled,
    TaskEvent,
    TaskState,
    TaskUnblocked,
    Unmet,
)

NAME = "tasks"
VERSION = 1

_enc = msgspec.json.Encoder()
_dec_state = msgspec.json.Decoder(TaskState)


class Blocker(msgspec.Struct, kw_only=True):
    id: str
    task_id: str
    project: str
    reason: str
    unmet_requirements: list[Unmet]
    category: str | None
    attempt: int
    opened_seq: int
    opened_at: str
    resolved_seq: int | None = None
    resolved_at: str | None = None
    resolution: str | None = None
    notes: str | None = None
    open: bool = True


_dec_blocker = msgspec.json.Decoder(Blocker)


def evolve_blocker(
    b: Blocker | None, task: TaskState, ev: TaskEvent, *, seq: int, at: str
) -> Blocker | None:
    """The blocker touched by `ev` on `task` (state before the event), if any."""
    match ev:
        case TaskBlocked():
            return Blocker(
                id=ev.blocker_id, task_id=task.id, project=task.project, reason=ev.reason,
                unmet_requirements=list(ev.unmet_requirements), category=ev.category,
                attempt=ev.attempt, opened_seq=seq, opened_at=at,
            )
        case TaskUnblocked() if b is not None and b.open:
            return msgspec.structs.replace(b, open=False, resolved_seq=seq, resolved_at=at,
                                           resolution=ev.action, notes=ev.notes)
        case TaskCancelled() if b is not None and b.open:
            return msgspec.structs.replace(b, open=False, resolved_seq=seq, resolved_at=at,
                                           resolution="cancelled", notes=ev.reason)
    return None


def escalate_at(s: TaskState) -> datetime | None:
    if s.escalated or s.state not in ("pending", "round_review") or s.ready_at is None:
        return None
    if s.state == "pending" and s.is_parent:
        return None
    if not s.escalate_after_seconds:
        return None
    ready = datetime.fromisoformat(s.ready_at.replace("Z", "+00:00"))
    return ready + timedelta(seconds=s.escalate_after_seconds)


def created_seq(s: TaskState, known: dict[str, int]) -> int:
    return known.get(s.id, s.seq)


_UPSERT = """
INSERT INTO tasks (id, project, task_type, state, parent_task_id, subtask_round, is_parent, priority,
                   assignee, node_blacklist, maker_node, maker_worker, created_seq, version, seq,
                   escalate_at, body)
SELECT id, project, task_type, state, parent_task_id, subtask_round, is_parent, priority, assignee,
       node_blacklist::text[], maker_node, maker_worker, created_seq, version, seq, escalate_at, body
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[],
                     $7::bool[], $8::int[], $9::text[], $10::text[], $11::text[], $12::text[],
                     $13::bigint[], $14::int[], $15::bigint[], $16::timestamptz[], $17::jsonb[])
    AS u(id, project, task_type, state, parent_task_id, subtask_round, is_parent, priority,
         assignee, node_blacklist, maker_node, maker_worker, created_seq, version, seq,
         escalate_at, body)
ON CONFLICT (id) DO UPDATE SET
    state = EXCLUDED.state, is_parent = EXCLUDED.is_parent, priority = EXCLUDED.priority,
    assignee = EXCLUDED.assignee, node_blacklist = EXCLUDED.node_blacklist,
    maker_node = EXCLUDED.maker_node, maker_worker = EXCLUDED.maker_worker,
    version = EXCLUDED.version, seq = EXCLUDED.seq, escalate_at = EXCLUDED.escalate_at,
    body = EXCLUDED.body
"""


def row_args(states: Sequence[TaskState], created: dict[str, int]) -> list[Any]:
    cols: list[list[Any]] = [[] for _ in range(17)]
    for s in states:
        vals = (
            s.id, s.project, s.task_type, s.state, s.parent_task_id, s.subtask_round, s.is_parent,
            s.priority, s.assignee, "{" + ",".join(_pg_text(n) for n in s.node_blacklist) + "}",
            s.maker_node, s.maker_worker, created_seq(s, created), s.version, s.seq, escalate_at(s),
            _enc.encode(s).decode(),
        )
        for c, v in zip(cols, vals, strict=True):
            c.append(v)
    return cols


def _pg_text(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


async def save(conn: Any, states: Iterable[TaskState], created: dict[str, int] | None = None) -> None:
    """Upsert task rows. `created` maps new task ids to the seq of their task.created."""
    states = list(states)
    if not states:
        return
    await conn.execute(_UPSERT, *row_args(states, created or {}))


async def load(conn: asyncpg.Connection | asyncpg.Pool, ids: Sequence[str]) -> dict[str, TaskState]:
    if not ids:
        return {}
    rows = await conn.fetch("SELECT body::text AS body FROM tasks WHERE id = ANY($1::text[])", list(ids))
    out = {}
    for r in rows:
        s = _dec_state.decode(r["body"])
        out[s.id] = s
    return out


async def load_one(conn: asyncpg.Connection | asyncpg.Pool, task_id: str) -> TaskState | None:
    return (await load(conn, [task_id])).get(task_id)


def decode_state(body: str | bytes) -> TaskState:
    return _dec_state.decode(body)


async def load_blockers(conn: Any, ids: Sequence[str]) -> dict[str, Blocker]:
    if not ids:
        return {}
    rows = await conn.fetch("SELECT body::text AS body FROM blockers WHERE id = ANY($1::text[])", list(ids))
    return {b.id: b for b in (_dec_blocker.decode(r["body"]) for r in rows)}


async def save_blockers(conn: Any, blockers: Iterable[Blocker]) -> None:
    rows = [
        (b.id, b.task_id, b.project, b.open, b.opened_seq, b.resolved_seq, _enc.encode(b).decode())
        for b in blockers
    ]
    if not rows:
        return
    await conn.executemany(
        """INSERT INTO blockers (id, task_id, project, open, opened_seq, resolved_seq, body)
           VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)
           ON CONFLICT (id) DO UPDATE SET open = EXCLUDED.open, resolved_seq = EXCLUDED.resolved_seq,
               body = EXCLUDED.body""",
        rows,
    )


def blocker_view(b: Blocker) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(b)
    return d


# The view a client sees: the folded state, with the live lease deadline (which
# heartbeats extend without an event) laid over it.
VIEW_SQL = """
SELECT CASE WHEN l.task_id IS NULL THEN t.body
            ELSE jsonb_set(t.body, '{lease_expires_at}',
                 to_jsonb(to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')))
       END::text AS body
FROM tasks t LEFT JOIN task_leases l ON l.task_id = t.id
"""
