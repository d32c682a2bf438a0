"""Rebuild speed over a large log, beside the raw read speed of the same rows.

    .venv/bin/python -m bench.rebuild [--events 1000000] [--database-url URL] [--no-check]

Seeds a fresh database with task streams that the pure model produced
(`events.task` deciders): each maker task is created, claimed, started,
completed, verified by a checker on another node and collected — 12 events over
two streams. One such lifecycle is generated with a placeholder id, then
instantiated with fresh ids and interleaved (many tasks in flight at once), its
hash chain computed per event and checked against `events.canonical.event_hash`
for the first events, and written with COPY. Then, in the same run:

* raw read: a plain `SELECT ... ORDER BY seq` over the whole log through
  asyncpg (a server-side cursor), and the paged read the rebuild itself uses;
* the fold alone, in memory, over the first `--fold-events` events: µs per
  event of the payload decode, of `evolve` and of the rebuild's `fold_page`;
* rebuild of each projection (tasks, blockers, jobs) through
  `projections.framework.rebuild`, i.e. shadow tables and the atomic swap (the
  seeded log has no blocker or job events: those two read none of its rows);
* a check of the tasks projection (fold again, compare row by row).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from bench.harness import Database, Postgres, describe, machine
from taskledger import log as store
from taskledger.events.canonical import GENESIS_HASH, canonical_json, event_hash, format_ts
from taskledger.events.lease import Holder
from taskledger.events.task import events as task_events
from taskledger.events.task.events import Requirement, RequirementVerdict, event_type, payload
from taskledger.events.task.panel import Verdict, decide_complete, decide_verifier_complete
from taskledger.events.task.rules import Claim, NewTask, decide_claim, decide_collect, decide_create, decide_start
from taskledger.events.task.state import TaskState, evolve, evolve_owned
from taskledger.projections import catalog, framework
from taskledger.projections import tasks as task_rows

PH = "XQXIDXQX"
_enc = msgspec.json.Encoder()


def lifecycle() -> list[tuple[str, str, bytes, bytes]]:
    """One maker-checker lifecycle as (task id, type, data JSON, canonical data JSON), ids as PH."""
    states: dict[str, Any] = {}
    out: list[tuple[str, str, bytes, bytes]] = []
    at = "2026-01-01T00:00:00.000000Z"
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def apply(changes: Any) -> None:
        for tid, evs in changes:
            for ev in evs:
                states[tid] = evolve(states.get(tid), ev, seq=1, version=1, at=at)
                data = payload(ev)
                out.append((tid, event_type(ev), _enc.encode(data), canonical_json(data)))

    t = NewTask(id=PH, project="bench", title="bench task", spec="make it so",
                requirements=[Requirement(id="R1", text="it works"), Requirement(id="R2", text="it is fast")])
    apply(decide_create(None, t, None, default_escalation=3600))
    maker = Holder(worker="maker", node="node-a", token_id="1", lease_id=f"L-{PH}")
    apply([(PH, decide_claim(states[PH], Claim(holder=maker, lease_seconds=60), now))])
    apply([(PH, decide_start(states[PH], maker))])
    apply(decide_complete(states[PH], maker, {"ok": True, "lines": 42}))
    vid = f"V-{PH}"
    checker = Holder(worker="checker", node="node-b", token_id="2", lease_id=f"L-{vid}")
    apply([(vid, decide_claim(states[vid], Claim(holder=checker, lease_seconds=60), now))])
    apply([(vid, decide_start(states[vid], checker))])
    apply(decide_verifier_complete(states[vid], states[PH], checker, Verdict(outcome="PASS", verdicts=[
        RequirementVerdict(requirement_id="R1", verdict="PASS", reason="tests pass"),
        RequirementVerdict(requirement_id="R2", verdict="PASS", reason="fast enough")])))
    apply([(PH, decide_collect(states[PH], by="producer"))])
    return out


async def seed(conn: asyncpg.Connection, n_events: int, in_flight: int = 500) -> tuple[int, float]:
    tmpl = lifecycle()
    per = len(tmpl)
    meta = {"actor": "bench", "role": "admin", "node": None, "request_id": "bench", "project": "bench"}
    meta_text = _enc.encode(meta).decode()
    meta_canon = canonical_json(meta)
    base = datetime(2026, 1, 1, tzinfo=UTC)
    prev = GENESIS_HASH
    seq = 0
    rows: list[tuple[Any, ...]] = []
    t0 = time.perf_counter()
    n_tasks = 0
    checked = 0
    while seq < n_events:
        ids = [f"b{n_tasks + i:07d}" for i in range(in_flight)]
        n_tasks += in_flight
        versions: dict[str, int] = {}
        # step k of every task in flight before step k + 1: streams interleave as under load
        for tid_t, typ, data_t, canon_t in tmpl:
            for iid in ids:
                if seq >= n_events:
                    break
                seq += 1
                tid = tid_t.replace(PH, iid)
                stream = f"task:{tid}"
                ss = versions[stream] = versions.get(stream, 0) + 1
                data = data_t.replace(PH.encode(), iid.encode())
                canon = canon_t.replace(PH.encode(), iid.encode())
                ts = base + timedelta(microseconds=seq * 37)
                rec = format_ts(ts)
                body = (b'{"data":' + canon + b',"meta":' + meta_canon + b',"recorded_at":"' + rec.encode()
                        + b'","seq":' + str(seq).encode() + b',"stream":"' + stream.encode()
                        + b'","stream_seq":' + str(ss).encode() + b',"type":"' + typ.encode() + b'"}')
                h = hashlib.sha256(prev.encode() + body).hexdigest()
                if checked < 200:
                    assert h == event_hash(prev, seq=seq, stream=stream, stream_seq=ss, type=typ,
                                           data=msgspec.json.decode(data), meta=meta, recorded_at=rec)
                    checked += 1
                rows.append((seq, stream, ss, typ, data.decode(), meta_text, ts, h))
                prev = h
        if len(rows) >= 50_000 or seq >= n_events:
            await conn.copy_records_to_table(
                "events", records=rows,
                columns=["seq", "stream", "stream_seq", "type", "data", "meta", "recorded_at", "hash"])
            rows = []
    await conn.execute("UPDATE log_head SET seq = $1, hash = $2 WHERE id = 1", seq, prev)
    await conn.execute("UPDATE projection_checkpoints SET seq = 0")
    await conn.execute("ANALYZE events")
    del per
    return seq, time.perf_counter() - t0


async def raw_reads(conn: asyncpg.Connection, head: int) -> dict[str, float]:
    out = {}
    t0 = time.perf_counter()
    n = 0
    async with conn.transaction():
        cur = conn.cursor(
            "SELECT seq, stream, stream_seq, type, data::text, recorded_at FROM events ORDER BY seq",
                          prefetch=10_000)
        async for _ in cur:
            n += 1
    out["plain SELECT ... ORDER BY seq (cursor)"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    pos = n = 0
    while pos < head:
        page = await store.read_page(conn, "task:", pos, min(pos + framework.PAGE_SEQS, head))
        n += len(page)
        pos += framework.PAGE_SEQS
    out["the rebuild's paged read (10,000 seqs a page)"] = n / (time.perf_counter() - t0)
    return out


async def fold_in_memory(conn: asyncpg.Connection, n_events: int) -> dict[str, float]:
    """µs per event of the fold alone, the first `n_events` of the log already read into memory
    (best of three): the payload decode; `evolve`, a new state per event as the command path
    folds, against `evolve_owned`, in place, over the same decoded events; and the rebuild's
    whole `fold_page` (decode, `evolve_owned`, its bookkeeping). All give the same states."""
    page: list[store.LogEvent] = []
    pos = 0
    while pos < n_events:
        page += await store.read_page(conn, "task:", pos, min(pos + framework.PAGE_SEQS, n_events))
        pos += framework.PAGE_SEQS
    events = [(e.stream[5:], task_events.decode(e.type, e.data), e) for e in page]

    def by(fold: Callable[..., TaskState]) -> Callable[[], dict[str, TaskState]]:
        def run() -> dict[str, TaskState]:
            states: dict[str, TaskState] = {}
            for tid, ev, e in events:
                states[tid] = fold(states.get(tid), ev, seq=e.seq, version=e.stream_seq, at=e.recorded_at)
            return states
        return run

    def rebuild_fold() -> dict[str, TaskState]:
        states: dict[str, TaskState] = {}
        task_rows.fold_page(states, page)
        return states

    steps: dict[str, Callable[[], Any]] = {
        "payload decode": lambda: [task_events.decode(e.type, e.data) for e in page],
        "evolve (a new state per event)": by(evolve),
        "evolve_owned (in place)": by(evolve_owned),
        "fold_page (decode + evolve_owned)": rebuild_fold,
    }
    out: dict[str, float] = {}
    gc.disable()
    try:
        for label, step in steps.items():
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t0)
            out[label] = best * 1e6 / len(page)
    finally:
        gc.enable()
    assert by(evolve)() == by(evolve_owned)() == rebuild_fold()
    return out


def _cpu_seconds(pids: list[int]) -> list[float]:
    """CPU seconds used so far by these PostgreSQL backends (empty when the server is not local):
    on a shared machine the CPU a rebuild costs moves less than its wall time."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return []
        out.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


async def main_async(args: argparse.Namespace, pg: Postgres) -> None:
    async with Database(pg.url, "tl_bench_rebuild_") as db:
        conn = await asyncpg.connect(db.url)
        head, secs = await seed(conn, args.events)
        print(f"seeded {head:,} events in {secs:.1f}s ({head / secs:,.0f} events/s)", flush=True)
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('events'))")
        print(f"events table: {size}", flush=True)
        raw = await raw_reads(conn, head)
        for label, rate in raw.items():
            print(f"raw read, {label}: {rate:,.0f} events/s", flush=True)
        cursor, paged = raw.values()
        if args.fold_events:
            for label, us in (await fold_in_memory(conn, min(head, args.fold_events))).items():
                print(f"fold in memory, {label}: {us:.2f} µs/event", flush=True)
        reader = await asyncpg.connect(db.url)
        backends = [await c.fetchval("SELECT pg_backend_pid()") for c in (conn, reader)]
        for p in catalog.PROJECTIONS:
            py, cpu_pg = time.process_time(), _cpu_seconds(backends)
            res = await framework.rebuild(conn, p, reader=reader)
            py = time.process_time() - py
            cpu_pg = [b - a for a, b in zip(cpu_pg, _cpu_seconds(backends), strict=True)]
            rows = await conn.fetchval(f"SELECT count(*) FROM {p.tables[0].name}")
            rate = res.events_per_second
            cpu = f"CPU: Python {py:.2f}s" + (
                f", PostgreSQL {cpu_pg[0]:.2f}s + {cpu_pg[1]:.2f}s (reader)" if cpu_pg else "")
            print(f"rebuild {p.name}: {res.seconds:.1f}s, {rate:,.0f} log events/s "
                  f"({rate / cursor:.2f}x the cursor read, {rate / paged:.2f}x the paged read), "
                  f"{rows:,} rows, head lock held {res.swap_ms:.1f} ms; {cpu}", flush=True)
        if not args.no_check:
            t0 = time.perf_counter()
            diffs = await framework.check(conn, [catalog.TASKS])
            el = time.perf_counter() - t0
            print(f"check tasks: {el:.1f}s, {head / el:,.0f} events/s, {len(diffs)} differences", flush=True)
        await reader.close()
        await conn.close()
        info = machine(pg.version)
        print(f"machine: {describe(info)}; {info['date']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--fold-events", type=int, default=200_000, help="events folded in memory, timed alone (0: none)")
    args = ap.parse_args()
    with Postgres(args.database_url) as pg:
        asyncio.run(main_async(args, pg))


if __name__ == "__main__":
    main()
