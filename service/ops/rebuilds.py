"""Projection rebuilds started over HTTP (`POST /admin/rebuild`): each run's
progress, kept in memory by the process that runs it (`GET /admin/projections`)."""

from __future__ import annotations

import asyncio
import logging
import time

import asyncpg
import msgspec

from taskledger.projections import framework

log = logging.getLogger("taskledger.admin")


class RebuildRun(msgspec.Struct, kw_only=True):
    projection: str
    state: str  # queued | running | done | failed
    folded_seq: int = 0
    target_seq: int = 0
    events_per_second: float | None = None
    seconds: float | None = None
    swap_ms: float | None = None
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None


async def rebuild_all(
    dsn: str, projections: list[framework.Projection], runs: dict[str, RebuildRun]
) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for p in projections:
            run = runs[p.name]
            run.state, run.started_at = "running", time.time()

            def progress(_: str, done: int, target: int, run: RebuildRun = run) -> None:
                run.folded_seq, run.target_seq = done, target

            try:
                res = await framework.rebuild(conn, p, progress=progress)
            except asyncio.CancelledError:
                run.state, run.error, run.finished_at = "failed", "cancelled", time.time()
                raise
            except Exception as e:
                log.exception("rebuild of %s failed", p.name)
                run.state, run.error, run.finished_at = "failed", f"{type(e).__name__}: {e}", time.time()
                continue
            run.state, run.finished_at = "done", time.time()
            run.folded_seq = run.target_seq = res.seq
            run.seconds, run.swap_ms = round(res.seconds, 3), round(res.swap_ms, 3)
            run.events_per_second = round(res.events_per_second, 1)
    finally:
        await conn.close()
