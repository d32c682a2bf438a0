"""Replicas behind HAProxy, and PostgreSQL failover: what they cost and how long writes stop.

    .venv/bin/python -m bench.cluster                     # both parts, about 3 minutes
    .venv/bin/python -m bench.cluster --part failover --runs 5
    .venv/bin/python -m bench.cluster --part appends --seconds 10 --writers 32

Everything runs on this machine through `deploy.cluster` (HAProxy, `taskledger
serve` replicas, PostgreSQL servers built from the stock binaries) and the drill
load of `deploy.drill` (asyncio httpx clients in this process, each creating
tasks one after another with an Idempotency-Key).

appends: acknowledged `POST /tasks` per second through the proxy for 1 replica on
one PostgreSQL (the baseline), 3 replicas on one PostgreSQL, and 3 replicas on a
primary with a synchronous standby (every commit waits for the standby's flush).

failover: 2 replicas on a primary + synchronous standby, writers retrying with
their keys; the primary is crashed (`pg_ctl stop -m immediate`), the standby
promoted after `--promote-after` seconds (0: at once, as a failover manager that
has already decided would), and the window is the longest stretch with no
acknowledged write. Every run also checks the drill's invariants (every
acknowledged write present once, followers gapless) and the hash chain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx

from bench.harness import describe, machine
from deploy.cluster import Cluster
from deploy.drill import Load, longest_pause


async def appends(replicas: int, standby: bool, seconds: float, writers: int) -> float:
    c = Cluster(replicas=replicas, standby=standby)
    await asyncio.to_thread(c.start)
    try:
        async with Load(c.url, c.admin_token, writers=writers, followers=0, retry=False) as load:
            await asyncio.sleep(2)  # warm-up
            n0, t0 = len(load.acked), time.monotonic()
            await asyncio.sleep(seconds)
            rate = (len(load.acked) - n0) / (time.monotonic() - t0)
            head = await load.finish()
            problems = await load.problems(head)
            failures = sum(len(w.failures) for w in load.writers)
            if problems or failures:
                raise SystemExit(f"appends run broke an invariant: {problems[:3]} {failures} failures")
            return rate
    finally:
        await asyncio.to_thread(c.stop)


async def failover(promote_after: float, writers: int) -> tuple[float, float]:
    c = Cluster(replicas=2, standby=True, drain_seconds=0.5, check_ms=100)
    await asyncio.to_thread(c.start)
    try:
        primary, standby = c.servers
        async with Load(c.url, c.admin_token, writers=writers, followers=2, retry=True) as load:
            await asyncio.sleep(2)
            before = len(load.acked)
            crashed = time.monotonic()
            await asyncio.to_thread(primary.stop, "immediate")
            await asyncio.sleep(promote_after)
            await asyncio.to_thread(standby.promote)
            promoted = time.monotonic() - crashed
            while len(load.acked) < before + 100:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1)
            head = await load.finish()
            window = longest_pause(load.ack_times, crashed - 1, time.monotonic())
            problems = await load.problems(head)
        async with httpx.AsyncClient(base_url=c.url, timeout=60,
                                     headers={"Authorization": f"Bearer {c.admin_token}"}) as h:
            v = (await h.get("/audit/verify")).json()
        if problems or not v["ok"]:
            raise SystemExit(f"failover broke an invariant: {problems[:3]} {v}")
        return promoted, window
    finally:
        await asyncio.to_thread(c.stop)


async def main_async(args: argparse.Namespace) -> None:
    info = machine()
    print(f"machine: {describe(info)}; {info['date']}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.part in ("all", "appends"):
        print(f"\nappends through HAProxy, {args.writers} writers, {args.seconds:.0f} s each", flush=True)
        print("| topology | acknowledged appends/s |\n|---|---|", flush=True)
        for replicas, standby, label in ((1, False, "1 replica, one PostgreSQL (baseline)"),
                                         (3, False, "3 replicas, one PostgreSQL"),
                                         (3, True, "3 replicas, primary + synchronous standby")):
            rate = await appends(replicas, standby, args.seconds, args.writers)
            print(f"| {label} | {rate:,.0f} |", flush=True)
    if args.part in ("all", "failover"):
        print(f"\nfailover, {args.writers} writers, standby promoted {args.promote_after:.1f} s after the crash",
              flush=True)
        print("| run | crash → promoted | no write acknowledged for |\n|---|---|---|", flush=True)
        windows = []
        for i in range(args.runs):
            promoted, window = await failover(args.promote_after, args.writers)
            windows.append(window)
            print(f"| {i + 1} | {promoted:.2f} s | {window:.2f} s |", flush=True)
        print(f"median window {statistics.median(windows):.2f} s, max {max(windows):.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "appends", "failover"], default="all")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--promote-after", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--writers", type=int, default=32)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
