"""Fault drills with their figures: how long writes were refused, and proof that
nothing acknowledged was lost.

    .venv/bin/python -m bench.fault_drills [--drill NAME]... [--writers 4]

Each drill (tests/drills.py) runs on its own embedded PostgreSQL: `--writers`
threads create tasks with an Idempotency-Key, retrying on 503 or a lost
connection; an SSE follower reads /stream from seq 0 and resumes with
Last-Event-ID. After a few seconds the fault is injected; the drill reports the
acknowledged writes, the attempts, what was refused (status x count; conn = no
answer), acknowledged writes missing from the log, task ids created twice,
whether the follower's ids are exactly 1..head, how long the fault lasted
(injection until PostgreSQL or the service was back), the recovery time (from
then until the next acknowledged write) and the longest gap between two
acknowledged writes (the outage as the writers saw it). The baseline is the same load with no fault.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.harness import describe, machine
from tests.drills import DRILLS, run_drill

HEADER = ("| drill | acked | attempts | refused | missing | doubled | follower contiguous | fault s | "
          "recovery s | longest write gap s |\n|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drill", action="append", choices=[*DRILLS, "baseline"], default=None)
    ap.add_argument("--writers", type=int, default=4)
    args = ap.parse_args()
    drills = args.drill or ["baseline", *DRILLS]
    info = machine()
    print(f"{info['date']}, {describe(info)}, writers={args.writers}")
    print(HEADER)
    for d in drills:
        with tempfile.TemporaryDirectory(prefix="tl-drill-") as root:
            res = run_drill(d, Path(root), writers=args.writers)
        print(res.row(), flush=True)


if __name__ == "__main__":
    main()
