"""A replica told to stop leaves a load balancer's rotation before it stops serving."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx

from tests.conftest import ServerProcess


def test_sigterm_turns_readyz_503_while_requests_and_streams_still_work(db_url: str) -> None:
    drain = 2.0
    s = ServerProcess(db_url, env={"TASKLEDGER_DRAIN_SECONDS": str(drain)}).start()
    try:
        producer = s.token("producer")
        stream_end: dict[str, Any] = {}
        opened = threading.Event()

        def follow() -> None:
            with httpx.stream("GET", s.base + "/stream?since_seq=0", timeout=30,
                              headers={"Authorization": f"Bearer {producer}"}) as r:
                opened.set()
                stream_end["status"] = r.status_code
                stream_end["body"] = b"".join(r.iter_bytes())  # ends cleanly, or raises
                stream_end["at"] = time.monotonic()

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        assert opened.wait(10)
        assert s.proc is not None
        os.killpg(s.proc.pid, signal.SIGTERM)
        told = time.monotonic()
        time.sleep(0.3)
        r = httpx.get(s.base + "/readyz", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert httpx.get(s.base + "/healthz", timeout=5).status_code == 200
        with httpx.Client(base_url=s.base, headers={"Authorization": f"Bearer {producer}"}, timeout=10) as c:
            made = c.post("/tasks", json={"id": "T-" + uuid.uuid4().hex[:8], "project": "p", "title": "t"})
        assert made.status_code == 201, made.text
        assert t.is_alive(), "the stream ended before the drain was over"
        t.join(drain + 10)
        assert stream_end["status"] == 200
        assert stream_end["at"] - told >= drain - 0.2
        assert s.proc.wait(timeout=15) == 0, s.log()
        # the drain ended with the stream sent whole: it carried the task made meanwhile
        assert b"event: task.created" in stream_end["body"]
    finally:
        s.kill()


def test_without_a_drain_delay_sigterm_stops_at_once(db_url: str) -> None:
    s = ServerProcess(db_url, env={"TASKLEDGER_DRAIN_SECONDS": "0"}).start()
    try:
        assert s.proc is not None
        t0 = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(timeout=15) == 0, s.log()
        assert time.monotonic() - t0 < 3
    finally:
        s.kill()
