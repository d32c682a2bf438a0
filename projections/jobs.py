"""The jobs view: one row per job, equal to the fold of its events.

`save` runs inside the command's transaction (an inline projection), so the
row and the events that produced it commit together. `replay` folds a job's
stream from the log, which is what a rebuild or a consistency check compares
the row with.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final, NamedTuple, Protocol

import msgspec

from taskledger import log as store
from taskledger.events.job import events as job_events
from taskledger.events.job import state as job_state
from taskledger.log import RecordedEvent
from taskledger.projections.where import where

NAME: Final = "jobs"
SCHEMA_VERSION: Final = 1

_state_decoder: Final = msgspec.json.Decoder(job_state.JobState)
_encoder: Final = msgspec.json.Encoder()


class Reader(Protocol):
    async def fetchrow(self, sql: str, *args: Any) -> Any: ...
    async def fetch(self, sql: str, *args: Any) -> Any: ...


class Writer(Protocol):
    async def execute(self, sql: str, *args: Any) -> str: ...


def stream_of(job_id: str) -> str:
    return f"job:{job_id}"


def decode_state(body: str | bytes) -> job_state.JobState:
    return _state_decoder.decode(body)


async def load(conn: Reader, job_id: str) -> job_state.JobState | None:
    row = await conn.fetchrow("SELECT body::text AS body FROM jobs WHERE id = $1", job_id)
    return None if row is None else decode_state(row["body"])


def apply(
    state: job_state.JobState | None, events: Sequence[job_events.AnyJobEvent], recorded: Sequence[RecordedEvent]
) -> job_state.JobState:
    """Evolve `state` by the events just appended and stamp the log position."""
    new = state is None
    for ev in events:
        state = job_state.evolve(state, ev)
    assert state is not None
    if recorded:
        last = recorded[-1]
        state = msgspec.structs.replace(state, version=last.stream_seq, seq=last.seq)
        if new:
            state = msgspec.structs.replace(state, created_seq=recorded[0].seq)
    return state


def _upsert(table: str) -> str:
    """The upsert of job rows into `table` (the live table, or a rebuild's shadow of it)."""
    return f"""
INSERT INTO {table} (id, version, seq, created_seq, state, project, node, worker, cancel_requested,
                  created_at, body)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::jsonb)
ON CONFLICT (id) DO UPDATE SET
    version = EXCLUDED.version, seq = EXCLUDED.seq, state = EXCLUDED.state,
    project = EXCLUDED.project, node = EXCLUDED.node, worker = EXCLUDED.worker,
    cancel_requested = EXCLUDED.cancel_requested, body = EXCLUDED.body
"""


_UPSERT: Final = _upsert("jobs")

_CHECKPOINT = """
INSERT INTO projection_checkpoints (name, version, seq, updated_at) VALUES ($1, $2, $3, now())
ON CONFLICT (name) DO UPDATE SET seq = GREATEST(projection_checkpoints.seq, EXCLUDED.seq),
    version = EXCLUDED.version, updated_at = now()
"""


async def save(uow: Writer, state: job_state.JobState) -> None:
    """Upsert the row for `state`, and the projection's checkpoint."""
    await uow.execute(
        _UPSERT,
        state.job_id,
        state.version,
        state.seq,
        state.created_seq,
        state.state,
        state.project,
        state.node,
        state.worker,
        state.cancel_requested,
        datetime.fromtimestamp(state.created_at, UTC),
        _encoder.encode(state).decode(),
    )
    await uow.execute(_CHECKPOINT, NAME, SCHEMA_VERSION, state.seq)


async def replay(conn: Reader, job_id: str, *, to_seq: int | None = None) -> job_state.JobState | None:
    """The job folded from the log (up to `to_seq`), with its position stamped."""
    rows = await store.stream_events(conn, stream_of(job_id), to_seq=to_seq)
    state: job_state.JobState | None = None
    for r in rows:
        state = job_state.evolve(state, job_events.decode(r.type, r.data))
    if state is not None and rows:
        state = msgspec.structs.replace(
            state,
            version=rows[-1].stream_seq,
            seq=rows[-1].seq,
            created_seq=rows[0].seq,
        )
    return state


# --------------------------------------------------------------------------- reads for the routes


class Query(Protocol):
    async def fetch(self, sql: str, *args: Any) -> Any: ...
    async def fetchval(self, sql: str, *args: Any) -> Any: ...


class JobListRow(NamedTuple):
    state: job_state.JobState
    created_seq: int
    lease_expires_at: datetime | None
    now: datetime  # the statement's time, to judge the lease by


async def exists(conn: Query, job_id: str) -> bool:
    return bool(await conn.fetchval("SELECT 1 FROM jobs WHERE id = $1", job_id))


async def list_page(conn: Query, *, after_created_seq: int, state: str | None, project: str | None,
                    limit: int) -> list[JobListRow]:
    """Up to `limit` jobs created after `after_created_seq`, in creation order, with their lease."""
    args: list[Any] = []
    cond = where([("j.created_seq >", after_created_seq), ("j.state =", state), ("j.project =", project)], args)
    rows = await conn.fetch(
        "SELECT j.body::text AS body, j.created_seq, l.expires_at, statement_timestamp() AS now FROM jobs j "
        "LEFT JOIN job_leases l ON l.job_id = j.id "
        f"{cond} ORDER BY created_seq LIMIT {int(limit)}",
        *args,
    )
    return [JobListRow(decode_state(r["body"]), r["created_seq"], r["expires_at"], r["now"]) for r in rows]


async def count_by_state(conn: Query) -> dict[str, int]:
    return {r["state"]: int(r["n"]) for r in await conn.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")}


# --------------------------------------------------------------------------- rebuild and check
# (added with the projection framework, projections/framework.py)


async def save_rows(conn: Any, states: Sequence[job_state.JobState], *, table: str = "jobs") -> None:
    """Upsert many rows into `table` (the live table, or a rebuild's shadow of it)."""
    if not states:
        return
    await conn.executemany(
        _UPSERT if table == "jobs" else _upsert(table),
        [(s.job_id, s.version, s.seq, s.created_seq, s.state, s.project, s.node, s.worker,
          s.cancel_requested, datetime.fromtimestamp(s.created_at, UTC), _encoder.encode(s).decode())
         for s in states],
    )


class JobFold:
    """The fold of `job:` streams into job rows; evicted states reload from the rows written."""

    def __init__(self, cache_max: int = 50_000) -> None:
        self.cache_max = cache_max
        self.states: dict[str, job_state.JobState] = {}

    def reset(self) -> None:
        self.states.clear()

    async def apply(self, conn: Any, page: Sequence[Any], tables: Any) -> None:
        table = tables["jobs"]
        missing = list({e.stream[4:] for e in page
                        if e.stream_seq > 1 and e.stream[4:] not in self.states})
        if missing:
            rows = await conn.fetch(f"SELECT body::text AS body FROM {table} WHERE id = ANY($1::text[])",
                                    missing)
            for r in rows:
                s = decode_state(r["body"])
                self.states[s.job_id] = s
        changed: dict[str, None] = {}
        for e in page:
            jid = e.stream[4:]
            prev = self.states.get(jid)
            s = job_state.evolve(prev, job_events.decode(e.type, e.data))
            s = msgspec.structs.replace(
                s, version=e.stream_seq, seq=e.seq,
                created_seq=e.seq if prev is None else prev.created_seq)
            self.states[jid] = s
            changed[jid] = None
        await save_rows(conn, [self.states[j] for j in changed], table=table)
        if len(self.states) > self.cache_max:
            self.reset()
