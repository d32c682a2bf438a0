"""Load for the fault drills: writers and SSE followers through the proxy, and the checks.

A `Writer` creates tasks one after another with an Idempotency-Key each; with
`retry` it sends a refused or broken request again with the same key until it
is acknowledged (so "acknowledged" is exact, and a retry can never make a
second task). A `Follower` reads the global feed the way a browser's
EventSource does: when the stream ends or breaks it reconnects with
`Last-Event-ID`, through the proxy, to whichever replica it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from typing import Any

import httpx
from httpx_sse import aconnect_sse

REPLICA_HEADER = "x-taskledger-replica"


class Writer:
    def __init__(self, base: str, token: str, name: str, *, retry: bool) -> None:
        self.base = base
        self.token = token
        self.name = name
        self.retry = retry
        self.acked: dict[str, int] = {}  # task id -> seq of its task.created
        self.ack_times: list[float] = []
        self.failures: list[str] = []
        self.replicas: Counter[str] = Counter()

    async def run(self, stop: asyncio.Event, *, give_up_after: float = 60) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(base_url=self.base, headers=headers, timeout=15) as c:
            i = 0
            while not stop.is_set():
                tid = f"{self.name}-{i}"
                i += 1
                deadline = time.monotonic() + give_up_after
                while time.monotonic() < deadline:
                    try:
                        r = await c.post("/tasks", json={"id": tid, "project": "drill", "title": tid},
                                         headers={"Idempotency-Key": tid})
                    except httpx.HTTPError as e:
                        self.failures.append(f"{tid}: {e!r}")
                    else:
                        if r.status_code == 201:
                            self.acked[tid] = int(r.json()["seq"])
                            self.ack_times.append(time.monotonic())
                            self.replicas[r.headers.get(REPLICA_HEADER, "?")] += 1
                            break
                        self.failures.append(f"{tid}: {r.status_code} {r.text[:200]}")
                    if not self.retry:
                        break
                    await asyncio.sleep(0.05)


class Follower:
    def __init__(self, base: str, token: str, since_seq: int) -> None:
        self.base = base
        self.token = token
        self.since_seq = since_seq
        self.last = since_seq
        self.seqs: list[int] = []
        self.replicas: list[str] = []  # one entry per connection, in order
        self.clean_ends = 0  # the server ended the stream (a draining replica does)
        self.broken = 0  # the connection broke (a killed replica)
        self.refused: list[int] = []  # status codes of connections that got no stream
        self.target: int | None = None
        self.reached = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(15, read=60)) as c:
            while True:
                headers = {"Authorization": f"Bearer {self.token}", "Last-Event-ID": str(self.last)}
                try:
                    async with aconnect_sse(c, "GET", "/stream", headers=headers) as es:
                        if es.response.status_code != 200:
                            self.refused.append(es.response.status_code)
                        else:
                            self.replicas.append(es.response.headers.get(REPLICA_HEADER, "?"))
                            async for ev in es.aiter_sse():
                                if not ev.id:
                                    continue
                                seq = int(ev.id)
                                self.seqs.append(seq)
                                self.last = seq
                                if self.target is not None and seq >= self.target:
                                    self.reached.set()
                            self.clean_ends += 1
                except httpx.HTTPError:
                    self.broken += 1
                await asyncio.sleep(0.1)

    async def until(self, head: int) -> None:
        self.target = head
        if self.last >= head:
            self.reached.set()
        await self.reached.wait()

    def gapless(self, head: int) -> bool:
        """Every seq after the starting cursor up to `head`, each once, in order."""
        return self.seqs[: head - self.since_seq] == list(range(self.since_seq + 1, head + 1))


async def head_seq(base: str, token: str) -> int:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=15) as c:
        r = await c.get("/events", params={"limit": 1})
        r.raise_for_status()
        return int(r.json()["head_seq"])


async def read_log(base: str, token: str, since_seq: int = 0) -> list[dict[str, Any]]:
    """Every event after `since_seq`, through the API."""
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        while True:
            r = await c.get("/events", params={"since_seq": since_seq, "limit": 5000})
            r.raise_for_status()
            page = r.json()
            out.extend(page["events"])
            if not page["events"] or page["next_seq"] >= page["head_seq"]:
                return out
            since_seq = page["next_seq"]


def longest_pause(times: list[float], start: float, end: float) -> float:
    """The longest stretch in [start, end] with no acknowledgement: the unavailability window."""
    marks = [start, *sorted(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(marks))


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
