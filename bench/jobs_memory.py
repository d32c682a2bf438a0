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
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TERMINAL = ("completed", "failed", "cancelled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        todo.extend(int(k) for k in kids)
    return out


def rss_kib(pid: int) -> dict[int, int]:
    """VmRSS of `pid` and each of its descendants, in KiB."""
    found = {}
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[p] = int(line.split()[1])
        except OSError:
            pass
    return found


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

    from taskledger.service.ops.embedded import start_embedded

    tmp = Path(tempfile.mkdtemp(prefix="tl-bench-jobs-"))
    handle, url = start_embedded(tmp / "pg")
    admin = "bench-admin-" + uuid.uuid4().hex
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, TASKLEDGER_ADMIN_TOKEN=admin)
    env.pop("TASKLEDGER_DATABASE_URL", None)
    with (tmp / "serve.log").open("ab") as log:
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taskledger.service.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database-url",
                url,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    runner = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or serve.poll() is not None:
                raise SystemExit("serve did not start: " + (tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.1)
        hdr = {"Authorization": f"Bearer {admin}"}
        tokens = {}
        for role, node in (("producer", None), ("worker", "bench-runner")):
            r = httpx.post(
                base + "/tokens", headers=hdr, json={"role": role, "name": f"bench-{role}", "node": node}
            )
            r.raise_for_status()
            tokens[role] = r.json()["token"]
        with (tmp / "runner.log").open("ab") as log:
            runner = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "taskledger.service.cli",
                    "runner",
                    "--url",
                    base,
                    "--token",
                    tokens["worker"],
                    "--poll-seconds",
                    "0.05",
                    "--cancel-poll-seconds",
                    "0.5",
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        api = httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {tokens['producer']}"}, timeout=60
        )

        def snapshot(label: str, done: int) -> dict[str, Any]:
            per = rss_kib(serve.pid)
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
        base_rss = samples[1]["rss_kib_total"]
        final = samples[-1]["rss_kib_total"]
        report = {
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
            f"Python {platform.python_version()}",
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
        print(json.dumps(report, indent=2))
        api.close()
        return 0
    finally:
        for p in (runner, serve):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        del handle


if __name__ == "__main__":
    sys.exit(main())
