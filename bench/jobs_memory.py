"""Jobs: memory over 200 jobs.

Starts an embedded PostgreSQL, one `taskledger serve` process and one
`taskledger runner`, warms up with 20 jobs, then runs 200 jobs (3 commands
each, with a status read and an events read per job, and every tenth job
cancelled while pending) and records the server's resident memory (VmRSS of
the serve process and its worker children, from /proc) after warm-up and after
every 50 jobs.

    .venv/bin/python -m bench.jobs_memory [--jobs 200] [--warmup 20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ROOT, Postgres, Server, describe, machine

TERMINAL = ("completed", "failed", "cancelled")


def run_jobs(api: httpx.Client, n: int, tag: str) -> float:
    t0 = time.monotonic()
    ids = []
    for i in range(n):
        r = api.post("/jobs", json={"project": tag, "commands": ["true", "echo job > /dev/null", "exit 0"]})
        r.raise_for_status()
        jid = r.json()["job_id"]
        if i % 10 == 9:
            api.post(f"/jobs/{jid}/cancel")  # pending or running: either way it ends
        ids.append(jid)
    for jid in ids:
        while True:
            st = api.get(f"/jobs/{jid}").json()
            if st["state"] in TERMINAL:
                break
            time.sleep(0.05)
        api.get(f"/jobs/{jid}/events", params={"since_seq": 0}).raise_for_status()
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--step", type=int, default=50)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tl-bench-jobs-"))
    with (Postgres() as pg, pg.database("tl_bench_jobs_") as db,
          Server(db.url, log_dir=tmp) as serve):
        worker = serve.token("worker", node="bench-runner")
        with (tmp / "runner.log").open("ab") as log:
            runner = subprocess.Popen(
                [sys.executable, "-m", "taskledger.service.cli", "runner", "--url", serve.base, "--token", worker,
                 "--poll-seconds", "0.05", "--cancel-poll-seconds", "0.5"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            report = measure(args, serve, serve.token("producer"))
        finally:
            os.killpg(runner.pid, signal.SIGTERM)
            try:
                runner.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(runner.pid, signal.SIGKILL)
                runner.wait()
        report["machine"] = describe(machine(pg.version))
    print(json.dumps(report, indent=2))
    return 0


def measure(args: argparse.Namespace, serve: Server, producer: str) -> dict[str, Any]:
    api = httpx.Client(base_url=serve.base, headers={"Authorization": f"Bearer {producer}"}, timeout=60)

    def snapshot(label: str, done: int) -> dict[str, Any]:
        per = serve.rss_by_pid()
        return {
            "label": label,
            "jobs_done": done,
            "rss_kib_total": sum(per.values()),
            "rss_kib_per_process": per,
        }

    samples = [snapshot("start", 0)]
    warm = run_jobs(api, args.warmup, "warmup")
    time.sleep(1)
    samples.append(snapshot("after warm-up", 0))
    done, spent = 0, 0.0
    while done < args.jobs:
        n = min(args.step, args.jobs - done)
        spent += run_jobs(api, n, "bench")
        done += n
        time.sleep(1)
        samples.append(snapshot(f"after {done} jobs", done))
    api.close()
    base_rss = samples[1]["rss_kib_total"]
    final = samples[-1]["rss_kib_total"]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "jobs": args.jobs,
        "warmup_jobs": args.warmup,
        "warmup_seconds": round(warm, 1),
        "seconds_for_jobs": round(spent, 1),
        "baseline_rss_kib": base_rss,
        "final_rss_kib": final,
        "growth_kib": final - base_rss,
        "growth_pct": round((final - base_rss) / base_rss * 100, 2),
        "samples": samples,
    }


if __name__ == "__main__":
    sys.exit(main())
