"""The stream path's own cost, in one process: CPU per delivery and memory per open stream.

    python -m bench.sse_delivery_path [--subscribers 4000] [--events 100] [--repeat 3]
                                      [--serve-root [LABEL=]PATH ...]

No server, no sockets, no database: N real stream responses (the route's
`_EventSource` over `_events` and the hub's `follow`, each run as the ASGI app
`_Stream`) subscribe to one `Hub`, and the bench hands the hub one page of one
event at a time (`_publish`, as the tailer does) and waits until every
subscriber has sent it. Each response's `send` passes three wrappers like the
ones Litestar's exception middlewares and the request middleware put around
it, and ends in a `send` that does nothing. So the figure is the Python path
from the tailer's page to the server's `send` — what the server's own I/O and
the kernel add comes on top (bench.sse_capacity measures the whole). On a
shared machine CPU time (not wall time) is what is reported, and the best of
--repeat runs.

Each --serve-root (a checkout with its own .venv, e.g. a worktree of the code
before a change) runs in its own interpreter, so the old and the new path are
measured in one run; the script copes with both shapes of the stream module.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


async def _measure(n: int, events: int) -> dict[str, float]:
    import anyio

    from taskledger.service.http.live import Filter, Hub, frame
    from taskledger.service.http.routes import streams

    hub = Hub("postgresql://unused", None)  # type: ignore[arg-type]  # no catch-up: every stream starts at the cursor
    sent = 0

    async def server_send(_message: Any) -> None:
        nonlocal sent
        sent += 1

    def wrapper(send: Any) -> Any:
        started = False

        async def wrapped(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)
        return wrapped

    never = asyncio.Event()

    async def receive() -> Any:
        await never.wait()

    stop_class = getattr(streams, "StreamStop", None)
    server_send_key = getattr(streams, "SERVER_SEND", None)
    gc.collect()
    rss0 = _rss_kib()
    tracemalloc.start()
    heap0 = tracemalloc.get_traced_memory()[0]
    tasks = []
    for _ in range(n):
        stop = stop_class() if stop_class is not None else anyio.Event()
        response = streams._EventSource(
            streams._events(hub, Filter(project="feed"), 0, False, stop), ping=15,
            headers={"Cache-Control": "no-store"}, shutdown_event=stop, shutdown_grace_period=2.0, stall_seconds=30)
        app = streams._Stream(response, hub, "bench")
        hub.acquire_stream("bench", n)
        scope: dict[str, Any] = {"type": "http", "method": "GET"}
        if server_send_key is not None:
            scope[server_send_key] = server_send
        tasks.append(asyncio.create_task(app(scope, receive, wrapper(wrapper(wrapper(server_send))))))  # type: ignore[arg-type]
    while hub.subscribers < n:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    gc.collect()
    heap = (tracemalloc.get_traced_memory()[0] - heap0) / n
    tracemalloc.stop()
    rss = (_rss_kib() - rss0) / n
    per_stream_tasks = (len(asyncio.all_tasks()) - 1) / n
    gc.freeze()
    sent = 0
    cpu0 = time.process_time()
    for k in range(events):
        seq = hub.cursor + 1
        data = json.dumps({"seq": seq, "stream": "task:bench", "type": "task.note", "data": {"k": k}})
        hub._publish([(seq, k + 1, "task.note", data, "task:bench", "feed",
                       frame(seq, "task.note", data).encode())])
        hub.cursor = seq
        while sent < n * (k + 1):
            await asyncio.sleep(0)
    cpu = time.process_time() - cpu0
    hub.end_streams()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"us": cpu / (n * events) * 1e6, "heap_kib": heap / 1024, "rss_kib": rss, "tasks": per_stream_tasks}


def _rss_kib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def _child(n: int, events: int) -> None:
    import uvloop

    print(json.dumps(uvloop.run(_measure(n, events))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subscribers", type=int, default=4000)
    ap.add_argument("--events", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--serve-root", action="append", default=[], metavar="[LABEL=]PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.subscribers, args.events)
        return
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; load average {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join(['python -m bench.sse_delivery_path', *sys.argv[1:]])}")
    print("| code | subscribers | µs CPU per delivery (best of runs) | all runs | heap KiB per stream | "
          "RSS KiB per stream | tasks per stream |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.serve_root or [str(ROOT)]:
        label, _, path = spec.rpartition("=")
        root = Path(path).resolve()
        python = root / ".venv" / "bin" / "python"
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run(
                [str(python) if python.exists() else sys.executable, "-P", str(Path(__file__).resolve()), "--child",
                 "--subscribers", str(args.subscribers), "--events", str(args.events)],
                cwd=root, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        best = min(runs, key=lambda r: r["us"])
        every = ", ".join(f"{r['us']:.2f}" for r in runs)
        print(f"| {label or root.name} | {args.subscribers:,} | {best['us']:.2f} | "
              f"{every} | {best['heap_kib']:.1f} | {best['rss_kib']:.1f} | "
              f"{best['tasks']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
