"""Projections: named, versioned folds of the log into tables, with a checkpoint.

A projection is a `Projection`: a name, a version, the tables it owns, the
streams it reads (a prefix such as ``task:``), whether it is inline, and a
`Fold` — the pure step from events to rows, with the reading and writing of
one page of rows at its edges. The projections taskledger keeps are listed in
`projections.catalog`; everything here takes them as arguments, so this module
imports no projection.

Checkpoints
-----------
`projection_checkpoints.seq` is the last log position a projection's rows
reflect, and it always moves in the same transaction as the rows:

* inline projections (tasks, blockers, jobs) write their rows in the writer's
  batch transaction, and `taskledger.log.LogTx.finish` moves every inline
  checkpoint to the new head in the statement that moves the head;
* an async projection folds pages from its checkpoint (`advance`) and writes
  its rows and its checkpoint in one transaction per page.

So a rebuild is "fold the log from 0 into fresh tables, swap them in" and a
check is "fold the log, compare". Both use the same machinery here.

Rebuild without downtime — read this before changing the order
--------------------------------------------------------------
1. Shadow tables ``<table>__rebuild`` are created with the live tables' columns,
   defaults and constraints (keys named ``<constraint>__rebuild``), without
   secondary indexes, and the log is folded into them in pages of seqs, each
   page its own short transaction. Nothing is locked: the service keeps
   reading and writing the live tables.
2. The pass repeats until the shadow is within `CATCH_UP_UNDER_LOCK` events of
   the head; then the secondary indexes are built (``<index>__rebuild``) and
   the shadow tables are analysed.
3. One transaction takes the log's head lock (`taskledger.log.lock_head`).
   That stops every appender on every replica — and inline projections only
   change with an append — so the live tables and the log
   stand still. It folds the last events, takes ACCESS EXCLUSIVE on the live
   tables (readers finish first; `lock_timeout` bounds the wait), drops them,
   renames the shadows, their constraints and indexes to the live names, sets
   the checkpoint to the head and the projection's version, and commits.
   Writers then resume against the new tables: PostgreSQL re-resolves table
   names on their cached plans.
   If that transaction fails (a lock timeout), it rolls back whole, the fold's
   caches are dropped (they reload from the shadow tables) and step 3 runs
   again.

Task leases, job leases and idempotency keys are operational tables, not
projections: they are never rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import asyncpg
import msgspec

from taskledger import log as store

CATCH_UP_UNDER_LOCK: Final = 2_000
"""Fold at most about this many events while holding the head lock."""

PAGE_SEQS: Final = 10_000
"""Seqs per page read from the log."""

SWAP_LOCK_TIMEOUT: Final = "5s"
SWAP_ATTEMPTS: Final = 5

@dataclass(frozen=True)
class Table:
    name: str
    key: str
    """The primary key column: rows are compared by it."""


class Fold(Protocol):
    """A fold over one projection's events.

    `apply` folds one page (events in seq order, already filtered to the
    projection's streams) and upserts the changed rows into `tables` (logical
    table name -> physical name). It may keep a cache between pages; `reset`
    drops it (the rows written so far stay the truth).
    """

    async def apply(self, conn: Any, page: Sequence[Any], tables: Mapping[str, str]) -> None: ...

    def reset(self) -> None: ...


# A fold may also hold rows back between pages and write them later, with
# `async def flush(self) -> None` (write them all and wait: `settle`) and
# `async def idle(self) -> None` (wait for a write left running on `conn`).


@dataclass(frozen=True)
class Projection:
    name: str
    version: int
    tables: tuple[Table, ...]
    streams: str
    """Stream prefix this projection folds, e.g. ``task:``."""
    new_fold: Callable[[], Fold]
    inline: bool = True
    types: tuple[str, ...] = ()
    """The event types the fold reads (empty: every type); the read leaves the others in the server."""
    as_of: Callable[[Any, str, int], Awaitable[Any]] | None = None
    """`as_of(conn, key, seq)`: one entity's state after `seq`, folded from the log."""


def select(projections: Sequence[Projection], names: Sequence[str] | None) -> list[Projection]:
    """The named ones of `projections` (all when `names` is empty), or KeyError for an unknown one."""
    by_name = {p.name: p for p in projections}
    if not names:
        return list(projections)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise KeyError(", ".join(missing))
    return [by_name[n] for n in names]


Progress = Callable[[str, int, int], None]
"""progress(projection name, seq folded up to, seq aimed at)."""


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while folding.

    A fold keeps tens of thousands of task states (each with lists and nested
    structs) in its cache and allocates more for every event; each full
    collection walks all of them. Folds create no reference cycles, so nothing
    is lost by collecting once afterwards: measured, this alone takes the tasks
    rebuild from 33,000 to 54,000 events/s.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def settle(fold: Fold, conn: Any) -> None:
    """Have the fold write every row it holds back, and wait for it: after this,
    the tables reflect everything folded and nothing runs on `conn`."""
    flush = getattr(fold, "flush", None)
    if flush is not None:
        await flush()


async def _idle(fold: Fold) -> None:
    """Wait for a write the fold left running on `conn` (it may hold more rows back)."""
    idle = getattr(fold, "idle", None)
    if idle is not None:
        await idle()


async def fold_range(
    conn: asyncpg.Connection, p: Projection, fold: Fold, tables: Mapping[str, str],
    after: int, upto: int, progress: Progress | None = None, page_seqs: int = PAGE_SEQS,
    reader: asyncpg.Connection | None = None,
) -> int:
    """Fold (after, upto] into `tables`, a page of seqs per call to the fold.

    With a `reader` (a second connection, outside any transaction) the next
    page is read there while the fold works on this one and writes the one
    before on `conn`: PostgreSQL and Python then work at the same time.
    Only for committed seqs, i.e. up to a head read before.
    """
    pos = after
    ahead: asyncio.Future[list[store.LogEvent]] | None = None
    with _no_gc():
        try:
            while pos < upto:
                end = min(pos + page_seqs, upto)
                if ahead is not None:
                    page, ahead = await ahead, None
                else:
                    if reader is None:
                        await _idle(fold)
                    page = await store.read_page(reader or conn, p.streams, pos, end, p.types)
                if reader is not None and end < upto:
                    ahead = asyncio.ensure_future(
                        store.read_page(reader, p.streams, end, min(end + page_seqs, upto), p.types))
                if page:
                    await fold.apply(conn, page, tables)
                pos = end
                if progress is not None:
                    progress(p.name, pos, upto)
        finally:
            if ahead is not None:
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead
            await settle(fold, conn)
    return pos


async def checkpoint(conn: Any, name: str) -> int | None:
    v = await conn.fetchval("SELECT seq FROM projection_checkpoints WHERE name = $1", name)
    return None if v is None else int(v)


_SET_CHECKPOINT: Final = """
INSERT INTO projection_checkpoints (name, version, seq, inline, updated_at) VALUES ($1, $2, $3, $4, now())
ON CONFLICT (name) DO UPDATE SET version = EXCLUDED.version, seq = EXCLUDED.seq,
    inline = EXCLUDED.inline, updated_at = now()
"""


async def set_checkpoint(conn: Any, p: Projection, seq: int) -> None:
    await conn.execute(_SET_CHECKPOINT, p.name, p.version, seq, p.inline)


# ------------------------------------------------------------------ shadow tables

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_INDEXDEF = re.compile(r"^(CREATE (?:UNIQUE )?INDEX) (\S+) ON (?:ONLY )?(\S+) (USING .*)$", re.S)


def _ident(name: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"unexpected identifier {name!r}")
    return name


@dataclass
class Shadow:
    """A fresh copy of one live table, and how to swap it in."""

    live: str
    name: str
    temp: bool
    constraints: list[str] = field(default_factory=list)  # live names of key constraints
    indexes: list[tuple[str, str]] = field(default_factory=list)  # (live name, CREATE INDEX for the shadow)

    @property
    def suffix(self) -> str:
        return self.name[len(self.live):]


async def create_shadow(conn: asyncpg.Connection, live: str, suffix: str, *, temp: bool = False) -> Shadow:
    """Create `<live><suffix>`: the live table's columns, defaults and key constraints, no data."""
    live = _ident(live)
    name = _ident(live + suffix)
    sh = Shadow(live=live, name=name, temp=temp)
    await conn.execute(f"DROP TABLE IF EXISTS {'pg_temp.' if temp else ''}{name}")
    await conn.execute(
        f"CREATE {'TEMP ' if temp else ''}TABLE {name} (LIKE {live} INCLUDING DEFAULTS "
        "INCLUDING CONSTRAINTS INCLUDING GENERATED INCLUDING IDENTITY INCLUDING STORAGE)"
    )
    if not temp:  # the swapped-in table keeps the live one's owner (the app role: sql/ and docs/SECURITY.md)
        await conn.execute(f"DO $$ BEGIN EXECUTE format('ALTER TABLE {name} OWNER TO %I', "
                           f"(SELECT tableowner FROM pg_tables WHERE tablename = '{live}' "
                           f"AND schemaname = current_schema())); END $$")
    rows = await conn.fetch(
        """SELECT c.conname, pg_get_constraintdef(c.oid) AS def, c.conindid
           FROM pg_constraint c WHERE c.conrelid = $1::regclass AND c.contype IN ('p', 'u', 'x')
           ORDER BY c.conname""",
        live,
    )
    constraint_indexes = set()
    for r in rows:
        await conn.execute(f"ALTER TABLE {name} ADD CONSTRAINT {_ident(r['conname'] + suffix)} {r['def']}")
        sh.constraints.append(r["conname"])
        constraint_indexes.add(r["conindid"])
    for r in await conn.fetch(
        """SELECT i.indexrelid, c.relname, pg_get_indexdef(i.indexrelid) AS def
           FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
           WHERE i.indrelid = $1::regclass ORDER BY c.relname""",
        live,
    ):
        if r["indexrelid"] in constraint_indexes:
            continue
        m = _INDEXDEF.match(r["def"])
        if m is None:
            raise RuntimeError(f"cannot copy index {r['relname']}: {r['def']}")
        ddl = f"{m.group(1)} {_ident(r['relname'] + suffix)} ON {name} {m.group(4)}"
        sh.indexes.append((r["relname"], ddl))
    return sh


async def build_indexes(conn: asyncpg.Connection, sh: Shadow, other: asyncpg.Connection | None = None) -> None:
    """Build the shadow's secondary indexes, after its rows are in (one sort per
    index instead of an insert per row), and analyse it.

    With `other`, a second idle connection, two indexes are built at a time:
    each build scans the whole table, and a second backend works on the second
    core.
    """
    ddls = [ddl for _, ddl in sh.indexes]
    conns = [conn] if other is None else [conn, other]

    async def build(c: asyncpg.Connection, share: list[str]) -> None:
        for ddl in share:
            await c.execute(ddl)

    await asyncio.gather(*(build(c, ddls[i::len(conns)]) for i, c in enumerate(conns)))
    await conn.execute(f"ANALYZE {sh.name}")


async def swap_in(conn: asyncpg.Connection, sh: Shadow) -> None:
    """Inside the caller's transaction: replace the live table by the shadow, names and all."""
    await conn.execute(f"LOCK TABLE {sh.live} IN ACCESS EXCLUSIVE MODE")
    await conn.execute(f"DROP TABLE {sh.live}")
    await conn.execute(f"ALTER TABLE {sh.name} RENAME TO {sh.live}")
    for c in sh.constraints:
        await conn.execute(f"ALTER TABLE {sh.live} RENAME CONSTRAINT {c + sh.suffix} TO {c}")
    for idx, _ in sh.indexes:
        await conn.execute(f"ALTER INDEX {idx + sh.suffix} RENAME TO {idx}")


async def drop_shadow(conn: asyncpg.Connection, sh: Shadow) -> None:
    await conn.execute(f"DROP TABLE IF EXISTS {'pg_temp.' if sh.temp else ''}{sh.name}")


# ------------------------------------------------------------------ rebuild


class RebuildBusy(Exception):
    pass


@dataclass
class RebuildResult:
    projection: str
    version: int
    seq: int
    events: int
    seconds: float
    swap_ms: float

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


def _lock_key(name: str) -> str:
    return f"taskledger:rebuild:{name}"


async def rebuild(
    conn: asyncpg.Connection, p: Projection, *, progress: Progress | None = None,
    page_seqs: int = PAGE_SEQS, catch_up_under_lock: int = CATCH_UP_UNDER_LOCK,
    reader: asyncpg.Connection | None = None,
) -> RebuildResult:
    """Rebuild `p` from the log and swap it in (see the module docstring).

    `conn` must not be in a transaction; it is used for the whole rebuild.
    `reader`, a second connection, reads pages ahead outside the head lock.
    Raises RebuildBusy when another rebuild of `p` runs (on any replica).
    """
    key = _lock_key(p.name)
    if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))", key):
        raise RebuildBusy(f"a rebuild of {p.name} is already running")
    started = time.perf_counter()
    shadows: list[Shadow] = []
    try:
        shadows = [await create_shadow(conn, t.name, "__rebuild") for t in p.tables]
        tables = {sh.live: sh.name for sh in shadows}
        fold = p.new_fold()
        pos, passes, last_gap = 0, 0, None
        while True:
            head = (await store.head(conn)).seq
            gap = head - pos
            # Catch up until close to the head; under a write rate the fold
            # cannot outrun, stop chasing once the gap no longer shrinks.
            if gap <= catch_up_under_lock or (passes >= 3 and last_gap is not None and gap >= last_gap):
                break
            pos = await fold_range(conn, p, fold, tables, pos, head, progress, page_seqs, reader)
            passes, last_gap = passes + 1, gap
        for sh in shadows:
            await build_indexes(conn, sh, reader)
        swap_ms = 0.0
        for attempt in range(1, SWAP_ATTEMPTS + 1):
            t0 = time.perf_counter()
            try:
                async with conn.transaction():
                    await conn.execute(f"SET LOCAL lock_timeout = '{SWAP_LOCK_TIMEOUT}'")
                    head = (await store.lock_head(conn))[0].seq
                    end = await fold_range(conn, p, fold, tables, pos, head, progress, page_seqs)
                    for sh in shadows:
                        await swap_in(conn, sh)
                    await set_checkpoint(conn, p, end)
            except asyncpg.LockNotAvailableError:
                # Everything since the head lock rolled back; the caches may
                # hold state from the rolled-back pages.
                fold.reset()
                if attempt == SWAP_ATTEMPTS:
                    raise
                await asyncio.sleep(0.2 * attempt)
                pos = await fold_range(conn, p, fold, tables, pos, (await store.head(conn)).seq, progress, page_seqs)
                continue
            swap_ms = (time.perf_counter() - t0) * 1000
            pos = end
            break
        shadows = []
        return RebuildResult(projection=p.name, version=p.version, seq=pos, events=pos,
                             seconds=time.perf_counter() - started, swap_ms=swap_ms)
    finally:
        try:
            for sh in shadows:
                await drop_shadow(conn, sh)
        finally:
            await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", key)


# ------------------------------------------------------------------ check


class Difference(msgspec.Struct, kw_only=True):
    projection: str
    table: str
    key: str
    field: str
    live: Any = None
    folded: Any = None

    def describe(self) -> str:
        return (f"{self.projection}: {self.table}[{self.key}].{self.field}: "
                f"live={_short(self.live)} folded={_short(self.folded)}")


def _short(v: Any) -> str:
    s = msgspec.json.encode(v).decode()
    return s if len(s) <= 80 else s[:77] + "..."


def diff_values(prefix: str, live: Any, folded: Any) -> list[tuple[str, Any, Any]]:
    """Field paths (`body.state`, `body.verdicts[0]`) where two JSON values differ."""
    if live == folded:
        return []
    if isinstance(live, dict) and isinstance(folded, dict):
        out: list[tuple[str, Any, Any]] = []
        for k in sorted(set(live) | set(folded)):
            out += diff_values(f"{prefix}.{k}" if prefix else k, live.get(k), folded.get(k))
        return out
    if isinstance(live, list) and isinstance(folded, list) and len(live) == len(folded):
        out = []
        for i, (a, b) in enumerate(zip(live, folded, strict=True)):
            out += diff_values(f"{prefix}[{i}]", a, b)
        return out
    return [(prefix, live, folded)]


async def compare(conn: asyncpg.Connection, p: Projection, table: Table, shadow: str,
                  limit: int = 1000) -> list[Difference]:
    rows = await conn.fetch(
        f"""SELECT coalesce(l.{_ident(table.key)}::text, c.{_ident(table.key)}::text) AS key,
                   to_jsonb(l)::text AS live, to_jsonb(c)::text AS folded
            FROM {_ident(table.name)} l FULL JOIN {_ident(shadow)} c
                 ON l.{_ident(table.key)} = c.{_ident(table.key)}
            WHERE to_jsonb(l) IS DISTINCT FROM to_jsonb(c)
            ORDER BY 1 LIMIT {int(limit)}"""
    )
    out: list[Difference] = []
    for r in rows:
        live = msgspec.json.decode(r["live"]) if r["live"] is not None else None
        folded = msgspec.json.decode(r["folded"]) if r["folded"] is not None else None
        if live is None:
            out.append(Difference(projection=p.name, table=table.name, key=r["key"], field="(row)",
                                  live=None, folded="missing from the live table"))
        elif folded is None:
            out.append(Difference(projection=p.name, table=table.name, key=r["key"], field="(row)",
                                  live="not in the log", folded=None))
        else:
            for path, a, b in diff_values("", live, folded):
                out.append(Difference(projection=p.name, table=table.name, key=r["key"], field=path,
                                      live=a, folded=b))
    return out


async def check(
    conn: asyncpg.Connection, projections: Sequence[Projection], *, progress: Progress | None = None,
    page_seqs: int = PAGE_SEQS,
) -> list[Difference]:
    """Fold the log into temporary tables and compare them with the live ones, row by row.

    The fold runs up to each projection's checkpoint; the last stretch and the
    comparison run in one REPEATABLE READ transaction, so live rows, log and
    checkpoint are read from one snapshot while the service keeps writing.
    """
    diffs: list[Difference] = []
    for p in projections:
        shadows = [await create_shadow(conn, t.name, "__check", temp=True) for t in p.tables]
        try:
            tables = {sh.live: sh.name for sh in shadows}
            fold = p.new_fold()
            pos = await fold_range(conn, p, fold, tables, 0, await checkpoint(conn, p.name) or 0,
                                   progress, page_seqs)
            async with conn.transaction(isolation="repeatable_read"):
                cp = await checkpoint(conn, p.name) or 0
                await fold_range(conn, p, fold, tables, pos, cp, progress, page_seqs)
                for t, sh in zip(p.tables, shadows, strict=True):
                    diffs += await compare(conn, p, t, sh.name)
        finally:
            for sh in shadows:
                await drop_shadow(conn, sh)
    return diffs


# ------------------------------------------------------------------ async projections


async def advance(conn: Any, p: Projection, fold: Fold, *, page_seqs: int = PAGE_SEQS) -> int:
    """Fold an async projection from its checkpoint to the head, one transaction per page
    holding the page's rows and the new checkpoint. Returns the checkpoint reached."""
    tables = {t.name: t.name for t in p.tables}
    pos = await checkpoint(conn, p.name)
    if pos is None:
        await set_checkpoint(conn, p, 0)
        pos = 0
    head = (await store.head(conn)).seq
    while pos < head:
        end = min(pos + page_seqs, head)
        try:
            async with conn.transaction():
                # the row lock on the checkpoint keeps two followers from folding one page twice
                cur = await conn.fetchval(
                    "SELECT seq FROM projection_checkpoints WHERE name = $1 FOR UPDATE", p.name)
                if cur != pos:
                    fold.reset()
                    pos = int(cur)
                    continue
                page = await store.read_page(conn, p.streams, pos, end, p.types)
                if page:
                    await fold.apply(conn, page, tables)
                    await settle(fold, conn)
                await set_checkpoint(conn, p, end)
        except BaseException:
            fold.reset()
            raise
        pos = end
    return pos


async def follow(
    pool: asyncpg.Pool, p: Projection, wake: asyncio.Event, *, idle_seconds: float = 1.0
) -> None:
    """Keep an async projection caught up: fold on every wake-up (or every `idle_seconds`)."""
    fold = p.new_fold()
    while True:
        async with pool.acquire() as conn:
            await advance(conn, p, fold)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), idle_seconds)
        wake.clear()


# ------------------------------------------------------------------ status


class ProjectionStatus(msgspec.Struct, kw_only=True):
    name: str
    version: int
    stored_version: int | None
    inline: bool
    tables: list[str]
    checkpoint_seq: int | None
    head_seq: int
    lag: int | None


async def statuses(conn: Any, projections: Sequence[Projection]) -> list[ProjectionStatus]:
    rows = {r["name"]: r for r in await conn.fetch(
        "SELECT name, version, seq FROM projection_checkpoints")}
    head = (await store.head(conn)).seq
    out = []
    for p in projections:
        r = rows.get(p.name)
        cp = None if r is None else int(r["seq"])
        out.append(ProjectionStatus(
            name=p.name, version=p.version, stored_version=None if r is None else r["version"],
            inline=p.inline, tables=[t.name for t in p.tables], checkpoint_seq=cp, head_seq=head,
            lag=None if cp is None else head - cp,
        ))
    return out
