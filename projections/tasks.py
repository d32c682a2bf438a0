"""The task and blocker views: rows folded from task events, written inline.

Each task row keeps the whole folded `TaskState` as `body` plus the columns
that queries filter and order on. Blockers are folded from `task.blocked`,
`task.unblocked` and `task.cancelled`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

import asyncpg
import msgspec

from taskledger import log as store
from taskledger.events.task import events as task_events
from taskledger.events.task.events import (
    CheckerReport,
    TaskBlocked,
    TaskCancelled,
    TaskCreated,
    TaskEvent,
    TaskUnblocked,
    Unmet,
)
from taskledger.events.task.rules import escalate_at
from taskledger.events.task.state import TaskState, evolve, evolve_owned
from taskledger.log import RecordedEvent
from taskledger.projections.where import where

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
    reports: list[CheckerReport] = []


_dec_blocker = msgspec.json.Decoder(Blocker)


def evolve_blocker(
    b: Blocker | None, task_id: str, project: str, ev: TaskEvent, *, seq: int, at: str
) -> Blocker | None:
    """The blocker `ev` touches on the task `task_id` of `project`, if any; `b` is the task's
    blocker before the event (the one its `blocker_id` names)."""
    match ev:
        case TaskBlocked():
            return Blocker(
                id=ev.blocker_id, task_id=task_id, project=project, reason=ev.reason,
                unmet_requirements=list(ev.unmet_requirements), category=ev.category,
                attempt=ev.attempt, opened_seq=seq, opened_at=at, reports=list(ev.reports),
            )
        case TaskUnblocked() if b is not None and b.open:
            return msgspec.structs.replace(b, open=False, resolved_seq=seq, resolved_at=at,
                                           resolution=ev.action, notes=ev.notes)
        case TaskCancelled() if b is not None and b.open:
            return msgspec.structs.replace(b, open=False, resolved_seq=seq, resolved_at=at,
                                           resolution="cancelled", notes=ev.reason)
    return None


def fold_one(
    s: TaskState | None, b: Blocker | None, ev: TaskEvent, *, seq: int, version: int, at: str
) -> tuple[TaskState, Blocker | None]:
    """The one fold of a task event into its task row and the blocker it touches
    (`b`: the open blocker `s` names, if any). The command path and the rebuild
    both fold through here."""
    nb = evolve_blocker(b, s.id, s.project, ev, seq=seq, at=at) if s is not None else None
    return evolve(s, ev, seq=seq, version=version, at=at), nb


def created_seq(s: TaskState, known: dict[str, int]) -> int:
    return known.get(s.id, s.seq)


_UPSERT = """
INSERT INTO {table} (id, project, task_type, state, parent_task_id, subtask_round, is_parent, priority,
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


_UPSERT_TASKS = _UPSERT.format(table="tasks")


async def save(conn: Any, states: Iterable[TaskState], created: dict[str, int] | None = None,
               *, table: str = "tasks") -> None:
    """Upsert task rows. `created` maps new task ids to the seq of their task.created.

    `table` is another table of the same shape (a rebuild's shadow)."""
    states = list(states)
    if not states:
        return
    sql, args = save_statement(states, created, table=table)
    await conn.execute(sql, *args)


def save_statement(states: Sequence[TaskState], created: dict[str, int] | None = None,
                   *, table: str = "tasks") -> tuple[str, list[Any]]:
    """`save`'s statement and its arguments, for a caller that runs it with others."""
    sql = _UPSERT_TASKS if table == "tasks" else _UPSERT.format(table=table)
    return sql, row_args(states, created or {})


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


async def save_blockers(conn: Any, blockers: Iterable[Blocker], *, table: str = "blockers") -> None:
    rows = [
        (b.id, b.task_id, b.project, b.open, b.opened_seq, b.resolved_seq, _enc.encode(b).decode())
        for b in blockers
    ]
    if not rows:
        return
    await conn.executemany(
        f"""INSERT INTO {table} (id, task_id, project, open, opened_seq, resolved_seq, body)
           VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb)
           ON CONFLICT (id) DO UPDATE SET open = EXCLUDED.open, resolved_seq = EXCLUDED.resolved_seq,
               body = EXCLUDED.body""",
        rows,
    )


def blocker_view(b: Blocker) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(b)
    return d


# The view a client sees: the folded state, with the live lease deadline (which
# heartbeats extend without an event) laid over it, and the lease id shown only
# to the token that holds it. `view_sql(n)` takes the viewer's token id as
# parameter $n (NULL for an admin, who sees every lease id).
def view_sql(viewer: int) -> str:
    return f"""
SELECT (CASE WHEN ${viewer}::text IS NULL OR v.b->>'token_id' = ${viewer}::text OR v.b->'lease_id' = 'null'::jsonb
             THEN v.b ELSE jsonb_set(v.b, '{{lease_id}}', 'null'::jsonb) END)::text AS body
FROM tasks t LEFT JOIN task_leases l ON l.task_id = t.id
CROSS JOIN LATERAL (SELECT CASE WHEN l.task_id IS NULL THEN t.body
            ELSE jsonb_set(t.body, '{{lease_expires_at}}',
                 to_jsonb(to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')))
       END AS b) v
"""


def visible_to(s: TaskState, viewer: str | None) -> TaskState:
    """The view as `viewer` (a token id; None for an admin) may see it: a lease id
    is shown only to its holder; everyone sees the holder's worker and node."""
    if viewer is None or s.lease_id is None or (s.token_id is not None and s.token_id == viewer):
        return s
    return msgspec.structs.replace(s, lease_id=None)


# ---------------------------------------------------------------- reads for the routes
#
# What the HTTP routes ask of the tasks and blockers views, answered here so the
# view tables are named by this module alone.

Conn = asyncpg.Connection | asyncpg.Pool


class TaskFilter(msgspec.Struct, frozen=True, kw_only=True):
    """The list filters a client may combine (each None = any)."""

    state: str | None = None
    project: str | None = None
    parent_task_id: str | None = None
    task_type: str | None = None
    assignee: str | None = None
    worker: str | None = None
    node: str | None = None
    label: str | None = None
    escalated: bool | None = None


_FILTER_SQL: Final = (
    ("state", "t.state ="), ("project", "t.project ="), ("parent_task_id", "t.parent_task_id ="),
    ("task_type", "t.task_type ="), ("assignee", "t.assignee ="), ("worker", "t.body->>'worker' ="),
    ("node", "t.body->>'node' ="), ("label", "t.body->'labels' ?"), ("escalated", "(t.body->>'escalated')::boolean ="),
)


class TaskRow(NamedTuple):
    id: str
    seq: int
    body: str


async def created_seq_of(conn: Conn, task_id: str) -> int | None:
    """The seq of the task's `task.created`: the position list pages continue after."""
    found = await conn.fetchval("SELECT created_seq FROM tasks WHERE id = $1", task_id)
    return None if found is None else int(found)


async def project_of(conn: Conn, task_id: str) -> str | None:
    project: str | None = await conn.fetchval("SELECT project FROM tasks WHERE id = $1", task_id)
    return project


async def list_views(conn: Conn, flt: TaskFilter, *, viewer: str | None, after_created_seq: int | None,
                     limit: int) -> list[str]:
    """Up to `limit` task views (JSON, as `view_sql` lays them out for `viewer`) matching
    `flt`, in creation order, created after `after_created_seq`."""
    args: list[Any] = []
    cond = where([(sql, getattr(flt, field)) for field, sql in _FILTER_SQL] + [("t.created_seq >", after_created_seq)],
                 args)
    args.append(viewer)
    rows = await conn.fetch(f"{view_sql(len(args))} {cond} ORDER BY t.created_seq LIMIT {int(limit)}", *args)
    return [r["body"] for r in rows]


async def rows_created_by(conn: Conn, as_of_seq: int, *, after_created_seq: int, limit: int) -> list[TaskRow]:
    """Up to `limit` task rows created after `after_created_seq` and by `as_of_seq`, in
    creation order; a row whose `seq` is past `as_of_seq` has changed since."""
    rows = await conn.fetch(
        "SELECT id, seq, body::text AS body FROM tasks WHERE created_seq > $1 AND created_seq <= $2 "
        f"ORDER BY created_seq LIMIT {int(limit)}", after_created_seq, as_of_seq)
    return [TaskRow(r["id"], r["seq"], r["body"]) for r in rows]


async def list_blockers(conn: Conn, *, open: bool | None, project: str | None, task_id: str | None,
                        limit: int) -> list[str]:
    """Up to `limit` blocker records (JSON) matching the filters, oldest first."""
    args: list[Any] = []
    cond = where([("open =", open), ("project =", project), ("task_id =", task_id)], args)
    rows = await conn.fetch(
        f"SELECT body::text AS body FROM blockers {cond} ORDER BY opened_seq LIMIT {int(limit)}", *args)
    return [r["body"] for r in rows]


async def blockers_open_at(conn: Conn, as_of_seq: int, *, limit: int = 1000) -> list[Blocker]:
    """The blockers open after `as_of_seq` (as their rows stand now), oldest first."""
    rows = await conn.fetch(
        "SELECT body::text AS body FROM blockers WHERE opened_seq <= $1 "
        f"AND (resolved_seq IS NULL OR resolved_seq > $1) ORDER BY opened_seq LIMIT {int(limit)}", as_of_seq)
    return [_dec_blocker.decode(r["body"]) for r in rows]


async def count_by_state(conn: Conn) -> dict[str, int]:
    return {r["state"]: int(r["n"]) for r in await conn.fetch("SELECT state, count(*) AS n FROM tasks GROUP BY state")}


# ---------------------------------------------------------------- folding the log
#
# The rebuild and the check fold stored events into the same rows the command
# path writes (`service.writer.session.Session.apply`): a task row is `evolve`
# over its stream; a blocker is `evolve_blocker` over the stream of its task,
# given the task's state before each event. Rounds live inside the parent's
# task row (`TaskState.rounds`), so they are folded with it.

class StoredEvent(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def stream(self) -> str: ...
    @property
    def stream_seq(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def data(self) -> str: ...
    @property
    def recorded_at(self) -> str: ...


def task_id_of(stream: str) -> str:
    return stream[5:] if stream.startswith("task:") else stream


def fold_page(states: dict[str, TaskState], page: Sequence[StoredEvent]) -> tuple[list[str], dict[str, int]]:
    """Pure: fold `page` into `states`, in place.

    Returns the changed task ids and the seq of each task.created seen. `states`
    must hold the state of every stream in `page` that began before it. The
    states are folded in place (`evolve_owned`): they belong to the caller's
    fold, and a state handed on must be out of `states` before the next page (as
    `TaskFold` does) or be copied. Blockers are folded apart (`fold_blocker_page`).
    """
    changed: dict[str, None] = {}
    created: dict[str, int] = {}
    decode = task_events.decode
    for e in page:
        stream = e.stream
        tid = stream[5:] if stream.startswith("task:") else stream
        s = states.get(tid)
        if s is None:
            created[tid] = e.seq
        states[tid] = evolve_owned(s, decode(e.type, e.data), seq=e.seq, version=e.stream_seq, at=e.recorded_at)
        changed[tid] = None
    return list(changed), created


_COLUMNS = ["id", "project", "task_type", "state", "parent_task_id", "subtask_round", "is_parent", "priority",
            "assignee", "node_blacklist", "maker_node", "maker_worker", "created_seq", "version", "seq",
            "escalate_at", "body"]


_NULL: Final = "\\N"
_COPY_ESCAPES: Final = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(v: str | None) -> str:
    """A text value as COPY's text format writes it (None as NULL)."""
    if v is None:
        return _NULL
    if "\\" in v or "\t" in v or "\n" in v or "\r" in v:
        return v.translate(_COPY_ESCAPES)
    return v


def copy_lines(states: Iterable[TaskState], created: dict[str, int]) -> Iterator[bytes]:
    """Rows in COPY's text format for a table of the tasks shape (`_COLUMNS`), for rows not there yet.

    Written by hand rather than handed to asyncpg as tuples for binary COPY: its
    per-column encoding cost twice what formatting the line does (the `body` goes
    as JSON text either way; PostgreSQL parses it into jsonb the same)."""
    t, enc = _copy_text, _enc.encode
    for s in states:
        ea = escalate_at(s)
        blacklist = "{" + ",".join(_pg_text(n) for n in s.node_blacklist) + "}" if s.node_blacklist else "{}"
        yield (f"{t(s.id)}\t{t(s.project)}\t{t(s.task_type)}\t{t(s.state)}\t{t(s.parent_task_id)}\t"
               f"{_NULL if s.subtask_round is None else s.subtask_round}\t{'t' if s.is_parent else 'f'}\t"
               f"{s.priority}\t{t(s.assignee)}\t{t(blacklist)}\t{t(s.maker_node)}\t{t(s.maker_worker)}\t"
               f"{created[s.id]}\t{s.version}\t{s.seq}\t{_NULL if ea is None else ea.isoformat()}\t"
               ).encode() + enc(s).replace(b"\\", b"\\\\") + b"\n"


async def _chunks(lines: Iterable[bytes], size: int = 256 * 1024) -> AsyncIterator[bytes]:
    """`lines` joined into chunks of about `size` bytes, made as COPY sends them: PostgreSQL
    parses the first rows while the next are formatted."""
    buf: list[bytes] = []
    n = 0
    for line in lines:
        buf.append(line)
        n += len(line)
        if n >= size:
            yield b"".join(buf)
            buf, n = [], 0
    if buf:
        yield b"".join(buf)


class TaskFold:
    """The fold of `task:` streams into task rows.

    Task states are cached between pages, at most `cache_max` of them; an
    evicted one reloads from the rows being written.

    Task rows are written once each where possible: a changed state stays in
    the cache until it is evicted or the fold is flushed, then rows new to the
    table go in with COPY and the others with an upsert. A full cache evicts
    the tasks the last page did not touch (a task's events mostly come close
    together, so few of them are needed again), and their write runs on the
    connection while the next pages are read and folded: only a page that
    must reload an evicted task waits for it. The cache's states are folded in
    place (`fold_page`); a state leaves the cache before its row is written.
    """

    def __init__(self, *, cache_max: int = 50_000) -> None:
        self.cache_max = cache_max
        self.states: dict[str, TaskState] = {}
        self._dirty: dict[str, None] = {}
        self._born: dict[str, int] = {}
        # ids that may have a row: an upsert is right for them, COPY would collide.
        # Kept across reset(): a rolled-back row is simply inserted by the upsert.
        self._written: set[str] = set()
        self._writing: asyncio.Task[None] | None = None
        self._table = ""
        self._conn: Any = None

    def reset(self) -> None:
        self.states.clear()
        self._dirty.clear()
        self._born.clear()
        if self._writing is not None:
            w, self._writing = self._writing, None
            w.cancel()
            w.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def idle(self) -> None:
        """Wait for the eviction's write still running on the connection."""
        if self._writing is not None:
            w, self._writing = self._writing, None
            await w

    async def flush(self) -> None:
        """Write every changed row (and wait for the eviction's write)."""
        await self.idle()
        if self._dirty:
            await self._write_dirty()

    def _take_dirty(self, ids: Iterable[str] | None = None) -> tuple[list[TaskState], list[TaskState],
                                                                  dict[str, int]]:
        """The changed states among `ids` (all when None), split into rows new to the table and the rest."""
        take = list(self._dirty) if ids is None else [i for i in ids if i in self._dirty]
        fresh = [self.states[i] for i in take if i not in self._written]
        again = [self.states[i] for i in take if i in self._written]
        born = {s.id: self._born.pop(s.id) for s in fresh}
        self._written.update(take)
        for i in take:
            del self._dirty[i]
        return fresh, again, born

    async def _write(self, fresh: list[TaskState], again: list[TaskState], born: dict[str, int]) -> None:
        if fresh:
            await self._conn.copy_to_table(self._table, source=_chunks(copy_lines(fresh, born)),
                                           columns=_COLUMNS, format="text")
        if again:
            await save(self._conn, again, {}, table=self._table)

    async def _write_dirty(self) -> None:
        await self._write(*self._take_dirty())

    async def apply(self, conn: Any, page: Sequence[StoredEvent], tables: Any) -> None:
        first: dict[str, StoredEvent] = {}
        for e in page:
            first.setdefault(e.stream, e)
        missing = [task_id_of(s) for s, e in first.items()
                   if e.stream_seq > 1 and task_id_of(s) not in self.states]
        if missing:
            await self.idle()  # the rows being written may be the ones to reload; `conn` is theirs
            await self._load(conn, missing, tables)
        self._conn, self._table = conn, tables["tasks"]
        changed, created = fold_page(self.states, page)
        self._dirty.update(dict.fromkeys(changed))
        self._born.update(created)
        if len(self.states) > self.cache_max:
            # evict what this page left alone (reloaded from its row if needed again), writing what changed
            keep = dict.fromkeys(changed)
            gone = [i for i in self.states if i not in keep]
            await self.idle()  # one write at a time on `conn`
            self._writing = asyncio.ensure_future(self._write(*self._take_dirty(gone)))
            for i in gone:
                del self.states[i]

    async def _load(self, conn: Any, ids: list[str], tables: Any) -> None:
        rows = await conn.fetch(
            f"SELECT body::text AS body FROM {tables['tasks']} WHERE id = ANY($1::text[])", ids)
        for r in rows:
            s = _dec_state.decode(r["body"])
            self.states[s.id] = s


BLOCKER_EVENTS: Final = ("task.blocked", "task.unblocked", "task.cancelled")
"""The task events that open or close a blocker: the blocker fold reads no others."""


def fold_blocker_page(
    latest: dict[str, Blocker | None], projects: Mapping[str, str], page: Sequence[StoredEvent],
) -> dict[str, Blocker]:
    """Pure: fold the `BLOCKER_EVENTS` of `page` into `latest` (task id -> the task's latest
    blocker, None for none; it must hold every task of `page`), returning the changed blockers.

    The same rows as folding every event of the task through `fold_one`: a task's
    `blocker_id` is set by `task.blocked` and cleared by `task.unblocked` alone, so the
    blocker it names is the task's latest one while that is open, and an unblock or a
    cancel changes only an open blocker. `projects` gives the project of each task that
    is blocked in `page` without an earlier blocker (a task's project never changes).
    """
    changed: dict[str, Blocker] = {}
    decode = task_events.decode
    for e in page:
        tid = task_id_of(e.stream)
        b = latest[tid]
        nb = evolve_blocker(b, tid, b.project if b is not None else projects.get(tid, ""),
                            decode(e.type, e.data), seq=e.seq, at=e.recorded_at)
        if nb is not None:
            latest[tid] = changed[nb.id] = nb
    return changed


class BlockerFold:
    """The fold of `task:` streams into blocker rows, from `BLOCKER_EVENTS` alone (the read
    filters the rest out in the server: most task events touch no blocker).

    Each task's latest blocker is cached, at most `cache_max` tasks; a task not
    cached is looked up in the rows being written, and a task blocked for the first
    time finds its project in its stream's first event (`task.created`).
    """

    def __init__(self, *, cache_max: int = 50_000) -> None:
        self.cache_max = cache_max
        self.latest: dict[str, Blocker | None] = {}

    def reset(self) -> None:
        self.latest.clear()

    async def apply(self, conn: Any, page: Sequence[StoredEvent], tables: Any) -> None:
        table = tables["blockers"]
        missing = list(dict.fromkeys(t for e in page if (t := task_id_of(e.stream)) not in self.latest))
        if missing:
            found = {b.task_id: b for b in (_dec_blocker.decode(r["body"]) for r in await conn.fetch(
                f"SELECT DISTINCT ON (task_id) body::text AS body FROM {table} WHERE task_id = ANY($1::text[]) "
                "ORDER BY task_id, opened_seq DESC", missing))}
            for t in missing:
                self.latest[t] = found.get(t)
        first_blocked = [t for t in dict.fromkeys(task_id_of(e.stream) for e in page if e.type == "task.blocked")
                         if self.latest[t] is None]
        projects: dict[str, str] = {}
        if first_blocked:
            for e in await store.read_stream_firsts(conn, [f"task:{t}" for t in first_blocked]):
                if isinstance(ev := task_events.decode(e.type, e.data), TaskCreated):
                    projects[task_id_of(e.stream)] = ev.project
        changed = fold_blocker_page(self.latest, projects, page)
        await save_blockers(conn, changed.values(), table=table)
        if len(self.latest) > self.cache_max:
            self.latest.clear()


async def history(
    conn: Any, task_id: str, to_seq: int | None = None
) -> list[tuple[RecordedEvent, TaskState]]:
    """Each event of the task's stream (up to global seq `to_seq`) with the state after it."""
    out: list[tuple[RecordedEvent, TaskState]] = []
    s: TaskState | None = None
    since = 0
    while True:
        batch = await store.read_stream(conn, f"task:{task_id}", since_stream_seq=since, to_seq=to_seq)
        for e in batch:
            s = evolve(s, task_events.decode(e.type, e.data), seq=e.seq, version=e.stream_seq, at=e.recorded_at)
            out.append((e, s))
        if len(batch) < 1000:
            return out
        since = batch[-1].stream_seq


async def state_as_of(conn: Any, task_id: str, as_of_seq: int) -> TaskState | None:
    """The task as it stood after global seq `as_of_seq`, folded from the log."""
    s: TaskState | None = None
    since = 0
    while True:
        batch = await store.read_stream(conn, f"task:{task_id}", since_stream_seq=since, to_seq=as_of_seq)
        for e in batch:
            s = evolve(s, task_events.decode(e.type, e.data), seq=e.seq, version=e.stream_seq, at=e.recorded_at)
        if len(batch) < 1000:
            return s
        since = batch[-1].stream_seq
