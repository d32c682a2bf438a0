"""The speed of a queue: batches, claims and the whole loop, each beside its baseline.

    .venv/bin/python -m bench.queue                   # about 3 minutes
    .venv/bin/python -m bench.queue --quick           # 3 s per step, to check the script
    .venv/bin/python -m bench.queue --steps pgbench,batch,single

One run, one throw-away embedded PostgreSQL (or `--database-url`'s server),
one `taskledger serve` (granian, one worker), every step back to back:

- `pgbench`: the naive transition, one transaction per event (insert the event
  with seq from a sequence + upsert its view row; no ordering guarantee), 32
  clients — the baseline of the two create figures. Run first and last; the
  ratio uses the mean of the two.
- `single`: `POST /tasks`, 32 connections (wrk).
- `batch`: `POST /tasks/batch`, 100 tasks a request, 32 connections (wrk).
- `loop`: the whole maker-checker loop driven by wrk, one connection per wrk
  thread so each thread's Lua state is one connection's: create → claim →
  start → complete → verifier claim → start → complete PASS → collect, each
  request built from the previous answer (project per connection, so a
  connection claims what it created). Loops/s and the CPU split.
- `routes`: serve CPU per request (µs) for `GET /healthz`, `GET /tasks/{id}`,
  `POST /tasks`, `POST /tasks/batch` (per task) at 32 connections, and per
  claim->complete cycle (single routes; batch routes where the checkout has
  them) at 8 connections. `--compare-root DIR` runs this step first on another
  checkout's code (e.g. `git worktree add --detach ../base main`), then on
  this one, each on a database of its own: before/after in one run
  (`--compare-steps routes,loop,pgqueuer` runs those steps on it too; PgQueuer
  itself runs once). (`--serve-root DIR` serves another checkout for every step.)
- `pgqueuer`: taskledger's `POST /tasks/batch` (B a request, C connections)
  fills its queue; PgQueuer (the `bench` extra) on the same server then
  enqueues as many jobs (batches of B, C connections; the same depth); each
  side's tables are then ANALYZEd (`--no-analyze` leaves it to autovacuum:
  PgQueuer's dequeue ran 9x slower on a table autovacuum had not reached); then
  dequeues B + acks (log_jobs) from C connections; then taskledger's
  claim->complete cycles over C wrk connections, one shape per `--drains`
  entry: `batch` (claim/batch max B, start/batch, complete/batch),
  `claim-start` (claim/batch with "start": true, complete/batch), `single`
  (claim/batch, then start and complete per task).

Every wrk step checks the log afterwards (seq 1..head with no hole); the hash
chain of the whole log is verified at the end. Results: a markdown table on
stdout and `bench/results/queue-<time>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench.append_http import CpuMeter, _verify_chain, bench_pgbench, cpu_text, log, postmaster_pid, wrk
from bench.harness import ROOT, Postgres, Server, create_database, describe, drop_database, machine

_DONE = r"""
function done(summary, latency, requests)
  local f = assert(io.open(os.getenv("BENCH_OUT"), "w"))
  local sums = {}
  for _, t in ipairs(threads) do
    for _, k in ipairs(COUNTERS) do sums[k] = (sums[k] or 0) + (t:get(k) or 0) end
  end
  f:write('{"duration_us":', summary.duration, ',"requests":', summary.requests,
          ',"errors":{"connect":', summary.errors.connect, ',"read":', summary.errors.read,
          ',"write":', summary.errors.write, ',"status":', summary.errors.status,
          ',"timeout":', summary.errors.timeout, '}',
          ',"p50_us":', latency:percentile(50), ',"p99_us":', latency:percentile(99))
  for _, k in ipairs(COUNTERS) do f:write(',"', k, '":', sums[k]) end
  f:write('}')
  f:close()
end
"""

_SETUP = r"""
threads = {}
function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end
"""

# POST /tasks (per = 0) or POST /tasks/batch with `per` tasks a request.
CREATE_LUA = _SETUP + r"""
COUNTERS = {"created", "bad"}
function init(args)
  prefix, per = args[1], tonumber(args[3])
  wrk.headers["Authorization"] = "Bearer " .. args[2]
  wrk.headers["Content-Type"] = "application/json"
  n, created, bad = 0, 0, 0
end
local function one()
  n = n + 1
  return '{"id":"' .. prefix .. '-' .. tid .. '-' .. n .. '","project":"' .. args_project ..
         '","title":"t","verification":null}'
end
function request()
  args_project = prefix
  if per == 0 then return wrk.format("POST", "/tasks", nil, one()) end
  local parts = {}
  for k = 1, per do parts[k] = one() end
  return wrk.format("POST", "/tasks/batch", nil, '{"tasks":[' .. table.concat(parts, ",") .. ']}')
end
function response(status, headers, body)
  if status == 201 then created = created + math.max(per, 1) else bad = bad + 1 end
end
""" + _DONE

# The whole loop, one connection per thread (the thread's globals are its state).
LOOP_LUA = _SETUP + r"""
COUNTERS = {"loops", "requests_ok", "empty_claims", "bad"}
local function hdr(token)
  return {["Authorization"] = "Bearer " .. token, ["Content-Type"] = "application/json"}
end
function init(args)
  prefix = args[1]
  producer, maker, checker = hdr(args[2]), hdr(args[3]), hdr(args[4])
  project = prefix .. "-" .. tid
  step, n, id, lease = 1, 0, nil, nil
  loops, requests_ok, empty_claims, bad = 0, 0, 0, 0
end
local function claim(types, who)
  return wrk.format("POST", "/tasks/claim", who,
    '{"task_types":["' .. types .. '"],"projects":["' .. project .. '"],"lease_seconds":300}')
end
local function act(what, who, extra)
  return wrk.format("POST", "/tasks/" .. id .. "/" .. what, who,
    '{"lease_id":"' .. lease .. '"' .. (extra or "") .. '}')
end
function request()
  if step == 1 then
    n = n + 1
    return wrk.format("POST", "/tasks", producer,
      '{"id":"' .. project .. '-' .. n .. '","project":"' .. project .. '","title":"t"}')
  elseif step == 2 then return claim("implement", maker)
  elseif step == 3 then return act("start", maker)
  elseif step == 4 then return act("complete", maker, ',"result":{"ok":true}')
  elseif step == 5 then return claim("verify", checker)
  elseif step == 6 then return act("start", checker)
  elseif step == 7 then return act("complete", checker, ',"outcome":"PASS","verdicts":[]')
  else
    return wrk.format("POST", "/tasks/collect", producer, '{"project":"' .. project .. '","limit":10}')
  end
end
function response(status, headers, body)
  if (step == 2 or step == 5) and status == 204 then
    empty_claims = empty_claims + 1
    return
  end
  if status ~= 200 and status ~= 201 then
    bad = bad + 1
    step = 1
    return
  end
  requests_ok = requests_ok + 1
  if step == 2 or step == 5 then
    id = string.match(body, '"id":"([^"]+)"')
    lease = string.match(body, '"lease_id":"([^"]+)"')
  elseif step == 8 then
    local _, k = string.gsub(body, '"state":"collected"', "")
    loops = loops + k
    step = 0
  end
  step = step + 1
end
""" + _DONE

# Claim up to `max` at once, then start and complete each (one connection per thread).
DRAIN_LUA = _SETUP + r"""
COUNTERS = {"cycles", "claims", "empty_claims", "bad"}
function init(args)
  prefix, max = args[1], args[3]
  wrk.headers["Authorization"] = "Bearer " .. args[2]
  wrk.headers["Content-Type"] = "application/json"
  ids, leases, i, phase = {}, {}, 0, "claim"
  cycles, claims, empty_claims, bad = 0, 0, 0, 0
end
function request()
  if phase == "claim" then
    return wrk.format("POST", "/tasks/claim/batch", nil,
      '{"task_types":["implement"],"projects":["' .. prefix .. '"],"lease_seconds":300,"max":' .. max .. '}')
  end
  return wrk.format("POST", "/tasks/" .. ids[i] .. "/" .. phase, nil, '{"lease_id":"' .. leases[i] .. '"}')
end
function response(status, headers, body)
  if status ~= 200 then
    bad = bad + 1
  end
  if phase == "claim" then
    claims = claims + 1
    ids, leases, i = {}, {}, 1
    for x in string.gmatch(body, '"id":"([^"]+)"') do ids[#ids + 1] = x end
    for x in string.gmatch(body, '"lease_id":"([^"]+)"') do leases[#leases + 1] = x end
    if #ids == 0 then empty_claims = empty_claims + 1 else phase = "start" end
  elseif phase == "start" then
    phase = "complete"
  else
    if status == 200 then cycles = cycles + 1 end
    i = i + 1
    phase = (i > #ids) and "claim" or "start"
  end
end
""" + _DONE


# Report in batches: claim up to `max` (with "start": true when args[4] is "1",
# else then POST /tasks/start/batch), then POST /tasks/complete/batch, each task
# by its own lease (one connection per thread).
BATCH_DRAIN_LUA = _SETUP + r"""
COUNTERS = {"cycles", "claims", "empty_claims", "bad"}
function init(args)
  prefix, max, claim_starts = args[1], args[3], args[4] == "1"
  wrk.headers["Authorization"] = "Bearer " .. args[2]
  wrk.headers["Content-Type"] = "application/json"
  entries, phase = "", "claim"
  cycles, claims, empty_claims, bad = 0, 0, 0, 0
end
function request()
  if phase == "claim" then
    return wrk.format("POST", "/tasks/claim/batch", nil,
      '{"task_types":["implement"],"projects":["' .. prefix .. '"],"lease_seconds":300,"max":' .. max ..
      (claim_starts and ',"start":true' or '') .. '}')
  end
  return wrk.format("POST", "/tasks/" .. phase .. "/batch", nil, '{"tasks":[' .. entries .. ']}')
end
function response(status, headers, body)
  if status ~= 200 then
    bad = bad + 1
    phase = "claim"
    return
  end
  if phase == "claim" then
    claims = claims + 1
    local ids, parts = {}, {}
    for x in string.gmatch(body, '"id":"([^"]+)"') do ids[#ids + 1] = x end
    local k = 0
    for x in string.gmatch(body, '"lease_id":"([^"]+)"') do
      k = k + 1
      parts[k] = '{"task_id":"' .. ids[k] .. '","lease_id":"' .. x .. '"}'
    end
    entries = table.concat(parts, ",")
    if k == 0 then empty_claims = empty_claims + 1
    elseif claim_starts then phase = "complete"
    else phase = "start" end
  elseif phase == "start" then
    phase = "complete"
  else
    local _, n = string.gsub(body, '"state":"completed"', "")
    cycles = cycles + n
    phase = "claim"
  end
end
""" + _DONE


def run_wrk(url: str, lua: Path, connections: int, threads: int, seconds: float, args: list[str],
            tmp: Path) -> dict[str, Any]:
    data = wrk(url, lua, connections, seconds, args, tmp, threads=threads)
    data["seconds"] = data["duration_us"] / 1e6
    return data


class Autovacuum:
    """Counts, twice a second during a step, the autovacuum workers running on the
    server: their CPU is in the PostgreSQL column, and tables just filled by a
    step draw them into the next one."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self.busy = url, 0, 0
        self.tables: set[str] = set()
        self._stop = threading.Event()

    def __enter__(self) -> Autovacuum:
        self._t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    async def _run(self) -> None:
        c = await asyncpg.connect(self.url)
        try:
            while not self._stop.is_set():
                rows = await c.fetch("SELECT query FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'")
                self.samples += 1
                self.busy += bool(rows)
                self.tables |= {r["query"] for r in rows if r["query"]}
                await asyncio.sleep(0.5)
        finally:
            await c.close()

    def share(self) -> float:
        return self.busy / self.samples if self.samples else 0.0


async def _gapless(db_url: str) -> bool:
    c = await asyncpg.connect(db_url)
    try:
        for _ in range(50):  # requests in flight when wrk stopped
            a = await c.fetchval("SELECT seq FROM log_head WHERE id = 1")
            await asyncio.sleep(0.2)
            if a == await c.fetchval("SELECT seq FROM log_head WHERE id = 1"):
                break
        g = await c.fetchrow("SELECT count(*) AS n, coalesce(max(seq), 0) AS hi, "
                             "(SELECT seq FROM log_head WHERE id = 1) AS head FROM events")
        return bool(g["n"] == g["hi"] == g["head"])
    finally:
        await c.close()


class Steps:
    def __init__(self, srv: Server, db_url: str, pg_pid: int | None, tmp: Path, seconds: float,
                 tag: str = "") -> None:
        self.srv, self.db_url, self.pg_pid, self.tmp, self.seconds = srv, db_url, pg_pid, tmp, seconds
        self.tag = tag
        self.results: list[dict[str, Any]] = []
        for name, text in (("create", CREATE_LUA), ("loop", LOOP_LUA), ("drain", DRAIN_LUA),
                           ("batch_drain", BATCH_DRAIN_LUA)):
            (tmp / f"{name}.lua").write_text(text)

    def record(self, what: str, rate: float, unit: str, data: dict[str, Any], cpu: dict[str, float],
               **extra: Any) -> dict[str, Any]:
        what = f"{self.tag}{what}"
        r = {"what": what, "rate": rate, "unit": unit, "load": os.getloadavg()[0], "cpu": cpu,
             "p50_ms": data.get("p50_us", 0) / 1000, "p99_ms": data.get("p99_us", 0) / 1000,
             "gapless": asyncio.run(_gapless(self.db_url)) if "duration_us" in data else None,
             "errors": {k: v for k, v in data.get("errors", {}).items() if v}, **extra}
        self.results.append(r)
        log(f"  {what}: {rate:,.0f} {unit}, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"load {r['load']:.2f}, log gapless {r['gapless']}; CPU % of a core: {cpu_text(cpu)} "
            f"{r['errors'] or ''} {extra or ''}")
        return r

    def creates(self, what: str, per: int, connections: int, project: str, token: str,
                seconds: float | None = None) -> dict[str, Any]:
        lua = self.tmp / "create.lua"
        run_wrk(self.srv.base, lua, connections, 2, 1, [f"warm{uuid.uuid4().hex[:4]}", token, str(per)],
                self.tmp)
        with CpuMeter(self.srv.proc.pid, self.pg_pid) as cpu, Autovacuum(self.db_url) as av:
            d = run_wrk(self.srv.base, lua, connections, 2, seconds or self.seconds, [project, token, str(per)],
                        self.tmp)
        return self.record(what, d["created"] / d["seconds"], "tasks/s", d, cpu.result, bad=d["bad"],
                           requests_per_s=d["requests"] / d["seconds"], created=d["created"],
                           autovacuum=av.share(), vacuumed=sorted(av.tables))

    def loop(self, connections: int, producer: str, maker: str, checker: str) -> dict[str, Any]:
        lua = self.tmp / "loop.lua"
        with CpuMeter(self.srv.proc.pid, self.pg_pid) as cpu, Autovacuum(self.db_url) as av:
            d = run_wrk(self.srv.base, lua, connections, connections, self.seconds,
                        [f"L{uuid.uuid4().hex[:4]}", producer, maker, checker], self.tmp)
        return self.record(f"loop, wrk, {connections} connections", d["loops"] / d["seconds"], "loops/s", d,
                           cpu.result, http_per_s=d["requests_ok"] / d["seconds"], bad=d["bad"],
                           empty_claims=d["empty_claims"], autovacuum=av.share(), vacuumed=sorted(av.tables))

    def route_costs(self, token: str, worker: str, root: Path) -> None:
        """Serve CPU per request, route by route (µs of the serve process's CPU / answered requests)."""
        get_lua = self.tmp / "get.lua"
        from bench.append_http import GET_LUA
        get_lua.write_text(GET_LUA)
        one = self.creates("POST /tasks, 32 connections", 0, 32, "R1", token)
        some = f"R1-1-{max(1, int(one['created'] // 64))}"
        for label, path, args in (("GET /healthz", "/healthz", []), ("GET /tasks/{id}", f"/tasks/{some}", [token])):
            run_wrk(self.srv.base + path, get_lua, 32, 2, 1, args, self.tmp)
            with CpuMeter(self.srv.proc.pid, self.pg_pid) as cpu:
                d = run_wrk(self.srv.base + path, get_lua, 32, 2, self.seconds, args, self.tmp)
            ok = d["requests"] - d["errors"]["status"]
            self.record(f"{label}, 32 connections", ok / d["seconds"], "requests/s", d, cpu.result)
        try:
            self.creates("POST /tasks/batch x100, 32 connections", 100, 32, "R2", token)
        except RuntimeError:
            log("  (no POST /tasks/batch in this checkout)")
        # the worker's side: cycles over the tasks just created, 8 connections
        self.drain(100, 8, "R1", worker, "single")
        if _has_report_batches(root):
            self.drain(100, 8, "R2", worker, "batch")

    def drain(self, batch: int, connections: int, project: str, token: str, how: str = "batch",
              seconds: float | None = None) -> dict[str, Any]:
        """claim->complete cycles over `connections` wrk connections. `how`: `batch`
        (claim/batch, start/batch, complete/batch), `claim-start` (claim/batch with
        "start": true, complete/batch) or `single` (claim/batch, then start and
        complete each task by its own route)."""
        lua = self.tmp / ("drain.lua" if how == "single" else "batch_drain.lua")
        args = [project, token, str(batch)] + ([] if how == "single" else ["1" if how == "claim-start" else "0"])
        with CpuMeter(self.srv.proc.pid, self.pg_pid) as cpu, Autovacuum(self.db_url) as av:
            d = run_wrk(self.srv.base, lua, connections, connections, seconds or self.seconds, args, self.tmp)
        what = {"batch": f"claim/batch (max {batch}) + start/batch + complete/batch",
                "claim-start": f"claim/batch (max {batch}, start) + complete/batch",
                "single": f"claim/batch (max {batch}) + start + complete per task"}[how]
        return self.record(f"taskledger {what}, {connections} connections", d["cycles"] / d["seconds"],
                           "cycles/s", d, cpu.result, bad=d["bad"], claims=d["claims"],
                           empty_claims=d["empty_claims"], requests_per_s=d["requests"] / d["seconds"],
                           autovacuum=av.share(), vacuumed=sorted(av.tables))


# ---------------------------------------------------------------------------
# PgQueuer on the same server


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _pgqueuer(db_url: str, batch: int, connections: int, seconds: float, pg_pid: int | None,
                    depth: int | None = None, analyze: bool = True
                    ) -> list[tuple[str, float, dict[str, float], dict[str, Any]]]:
    from pgqueuer.adapters.persistence.queries import EntrypointExecutionParameter, Queries

    conns = [await asyncpg.connect(db_url) for _ in range(connections)]
    try:
        await Queries.from_asyncpg_connection(conns[0]).install()
        qs = [Queries.from_asyncpg_connection(c) for c in conns]
        out = []

        async def enqueue(q: Any, stop: float, counts: list[int]) -> None:
            # with `depth`, as many jobs as taskledger has tasks queued (the same depth), however long
            while counts[0] < depth if depth is not None else time.monotonic() < stop:
                await q.enqueue(["bench"] * batch, [b"{}"] * batch, [0] * batch)
                counts[0] += batch

        async def dequeue(q: Any, stop: float, counts: list[int]) -> None:
            qm_id = uuid.uuid4()
            eps = {"bench": EntrypointExecutionParameter(concurrency_limit=0)}
            while time.monotonic() < stop:
                jobs = await q.dequeue(batch, eps, qm_id, None, timedelta(seconds=300))
                if not jobs:  # its queue is empty: the rate is over the time it had work
                    counts[1] += 1
                    return
                await q.log_jobs([(j, "successful", None) for j in jobs])
                counts[0] += len(jobs)

        for what, fn in (("enqueue", enqueue), ("dequeue+ack", dequeue)):
            if what != "enqueue" and analyze:
                await conns[0].execute("ANALYZE")
            counts = [0, 0]
            me0 = _self_cpu()
            with CpuMeter(None, pg_pid) as cpu:
                t0 = time.monotonic()
                await asyncio.gather(*(fn(q, t0 + seconds, counts) for q in qs))
                el = time.monotonic() - t0
                me = 100 * (_self_cpu() - me0) / el
            # this process is PgQueuer's client: count it as the client
            cpu.result["client"] += me
            queued = out[0][3]["jobs"] if out else 0
            out.append((what, counts[0] / el, cpu.result, {"jobs": counts[0], "empty_dequeues": counts[1],
                                                           "queued_before": queued}))
        return out
    finally:
        for c in conns:
            await c.close()


def bench_pgqueuer(maint: str, batch: int, connections: int, seconds: float, pg_pid: int | None,
                   results: list[dict[str, Any]], depth: int | None = None, analyze: bool = True) -> None:
    name = f"bench_pgq_{uuid.uuid4().hex[:6]}"
    db_url = create_database(maint, name)
    try:
        for what, rate, cpu, extra in asyncio.run(_pgqueuer(db_url, batch, connections, seconds, pg_pid, depth,
                                                            analyze)):
            r = {"what": f"PgQueuer {what} (batch {batch}), {connections} connections", "rate": rate,
                 "unit": "jobs/s", "load": os.getloadavg()[0], "cpu": cpu, "p50_ms": 0.0, "p99_ms": 0.0,
                 "gapless": None, "errors": {}, **extra}
            results.append(r)
            log(f"  {r['what']}: {rate:,.0f} jobs/s, load {r['load']:.2f}; CPU % of a core: {cpu_text(cpu)} "
                f"(client: PgQueuer's Python process) {extra}")
    finally:
        drop_database(maint, name)


# ---------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| step | rate | p50 / p99 ms | load | log gapless | CPU % of a core: serve / pg / client / other "
             "| µs of CPU per unit: serve / pg |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["cpu"]
        per = (f"{1e4 * c['serve'] / r['rate']:,.0f} / {1e4 * c['postgres'] / r['rate']:,.0f}"
               if r["rate"] else "-")
        lines.append(f"| {r['what']} | {r['rate']:,.0f} {r['unit']} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | "
                     f"{r['load']:.2f} | {'-' if r['gapless'] is None else r['gapless']} | "
                     f"{c['serve']:.0f} / {c['postgres']:.0f} / {c['client']:.0f} / {c['other']:.0f} | {per} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", help="maintenance URL of a PostgreSQL server (default: embedded)")
    ap.add_argument("--steps", default="pgbench,routes,batch,loop,pgqueuer")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--loop-connections", type=int, default=32)
    ap.add_argument("--queue-batch", type=int, default=100, help="B for the PgQueuer comparison")
    ap.add_argument("--queue-connections", type=int, default=8, help="C for the PgQueuer comparison")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--serve-root", type=Path, default=ROOT,
                    help="checkout whose code serves (default: this one)")
    ap.add_argument("--compare-root", type=Path,
                    help="another checkout (e.g. the branch's base): the routes step runs on it too, "
                         "first, on a database of its own, for a before/after in one run")
    ap.add_argument("--compare-steps", default="routes",
                    help="the steps the --compare-root checkout runs too (routes, loop, pgqueuer: its "
                         "pgqueuer step fills and drains taskledger's queue; PgQueuer itself runs once)")
    ap.add_argument("--drains", default="batch,claim-start,single",
                    help="claim->complete shapes of the pgqueuer step: batch, claim-start, single")
    ap.add_argument("--no-analyze", dest="analyze", action="store_false",
                    help="do not ANALYZE each queue's tables once filled (autovacuum may or may not have)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds = 3.0
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install -y wrk", file=sys.stderr)
        return 2
    steps = set(args.steps.split(","))
    started = datetime.now(UTC)
    info = machine()
    log(f"machine: {describe(info)}")
    tmp = Path(tempfile.mkdtemp(prefix="tl-queue-"))
    pg = None
    results: list[dict[str, Any]] = []
    chain_ok = True
    try:
        pg = Postgres(args.database_url, tmp / "pg")
        maint = pg.url
        info["postgres"] = pg.version
        pg_pid = postmaster_pid(maint)

        def pgbench() -> None:
            for r in bench_pgbench(maint, [args.connections], args.seconds, tmp, pg_pid):
                if r.kind == "pgbench free":
                    results.append({"what": f"pgbench naive transition, {r.clients} clients (baseline)",
                                    "rate": r.rate, "unit": "tx/s", "load": os.getloadavg()[0],
                                    "cpu": r.extra["cpu"], "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
                                    "gapless": None, "errors": r.errors})

        if "pgbench" in steps:
            pgbench()
        before = steps & set(args.compare_steps.split(",")) & {"routes", "loop", "pgqueuer"}
        compare = bool(before) and args.compare_root is not None
        if compare:
            results += serve_steps(args, maint, pg_pid, tmp, before, args.compare_root, "[base] ",
                                   pgqueuer=False)
        results += serve_steps(args, maint, pg_pid, tmp, steps, args.serve_root, "[this] " if compare else "")
        chain_ok = all(r.get("chain_ok", True) for r in results)
        if "pgbench" in steps:
            pgbench()
    finally:
        if pg is not None:
            pg.close()
        shutil.rmtree(tmp, ignore_errors=True)
    base = [r["rate"] for r in results if r["what"].startswith("pgbench")]
    baseline = sum(base) / len(base) if base else None
    print(f"\nqueue, {started:%Y-%m-%d %H:%M} UTC, {info['nproc']} cpus ({info['cpu']}), "
          f"load before {info['loadavg'][0]:.2f} after {os.getloadavg()[0]:.2f}\n")
    print(table(results))
    if baseline:
        print(f"\nbaseline (mean of the pgbench runs): {baseline:,.0f} tx/s")
        for r in results:
            if r["unit"] == "tasks/s":
                print(f"  {r['what']}: {r['rate'] / baseline:.2f}x the naive transition rate")
    pq = next((r["rate"] for r in results if r["what"].startswith("PgQueuer dequeue")), None)
    if pq:
        for r in results:
            if r["unit"] == "cycles/s":
                print(f"  {r['what']} / PgQueuer dequeue+ack: {r['rate'] / pq:.2f}x")
    out = ROOT / "bench" / "results" / f"queue-{started:%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": started.isoformat(), "args": vars(args), "machine": info,
                               "baseline": baseline, "chain_ok": chain_ok, "results": results}, indent=2,
                              default=str))
    print(f"\nresults: {out}")
    return 0 if chain_ok and all(r["gapless"] in (None, True) for r in results) else 1


def serve_steps(args: argparse.Namespace, maint: str, pg_pid: int | None, tmp: Path, steps: set[str],
                root: Path, tag: str, *, pgqueuer: bool = True) -> list[dict[str, Any]]:
    """One `taskledger serve` of `root`'s code on a database of its own, through `steps`;
    the last result carries whether the hash chain of that database verified. Without
    `pgqueuer`, the pgqueuer step fills and drains taskledger's queue alone."""
    name = f"bench_queue_{uuid.uuid4().hex[:6]}"
    db_url = create_database(maint, name)
    srv = Server(db_url, "granian", args.workers, tmp, root=root).wait_ready()
    try:
        producer, c = srv.token("producer"), args.connections
        s = Steps(srv, db_url, pg_pid, tmp, args.seconds, tag)
        if "routes" in steps:
            s.route_costs(producer, _worker_token(srv, "router", "node-r"), root)
        if "single" in steps:
            s.creates(f"POST /tasks, {c} connections", 0, c, "S1", producer)
        if "batch" in steps:
            s.creates(f"POST /tasks/batch x100, {c} connections", 100, c, "B1", producer)
        if "loop" in steps:
            maker = _worker_token(srv, "maker", "node-m")
            checker = _worker_token(srv, "checker", "node-c")
            s.loop(args.loop_connections, producer, maker, checker)
        if "pgqueuer" in steps:
            qb, qc = args.queue_batch, args.queue_connections
            # taskledger's queue first; PgQueuer's then filled to the same depth
            made = s.creates(f"taskledger POST /tasks/batch x{qb}, {qc} connections", qb, qc, "Q", producer,
                             seconds=args.seconds * 1.5)
            if args.analyze:  # as autovacuum would within a minute or so; PgQueuer's table gets the same
                asyncio.run(_analyze(db_url))
            if pgqueuer:
                bench_pgqueuer(maint, qb, qc, args.seconds, pg_pid, s.results, depth=int(made["created"]),
                               analyze=args.analyze)
            for how in args.drains.split(","):
                if how != "single" and not _has_report_batches(root):
                    continue
                s.drain(qb, qc, "Q", _worker_token(srv, f"drainer-{how}", f"node-{how}"), how)
        ok, n = asyncio.run(_verify_chain(db_url))
        log(f"hash chain over {n} events: {'verifies' if ok else 'BROKEN'}")
        if s.results:
            s.results[-1]["chain_ok"] = ok
        return s.results
    finally:
        srv.stop()
        drop_database(maint, name)


async def _analyze(db_url: str) -> None:
    c = await asyncpg.connect(db_url)
    try:
        await c.execute("ANALYZE")
    finally:
        await c.close()


def _has_report_batches(root: Path) -> bool:
    f = root / "service" / "http" / "routes" / "task_batches.py"
    return f.exists() and '"/start/batch"' in f.read_text()


def _worker_token(srv: Server, name: str, node: str) -> str:
    return srv.token("worker", name, node)


if __name__ == "__main__":
    sys.exit(main())
