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
import uuid
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


def token(base: str, admin_token: str, role: str, node: str | None = None) -> str:
    body: dict[str, Any] = {"role": role, "name": f"{role}-{uuid.uuid4().hex[:6]}"}
    if node:
        body["node"] = node
    r = httpx.post(base + "/tokens", json=body, timeout=10, headers={"Authorization": f"Bearer {admin_token}"})
    r.raise_for_status()
    return str(r.json()["token"])


class Load:
    """Writers and followers through the proxy, started together (an async context)."""

    def __init__(self, base: str, admin_token: str, *, writers: int, followers: int, retry: bool) -> None:
        self.base = base
        self.producer = token(base, admin_token, "producer")
        self.reader = token(base, admin_token, "reader")
        run_id = uuid.uuid4().hex[:6]
        self.writers = [Writer(base, self.producer, f"w{i}-{run_id}", retry=retry) for i in range(writers)]
        self.n_followers = followers
        self.followers: list[Follower] = []
        self.stop = asyncio.Event()
        self.reading: list[asyncio.Task[Any]] = []
        self.writing: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> Load:
        start = await head_seq(self.base, self.reader)
        self.followers = [Follower(self.base, self.reader, start) for _ in range(self.n_followers)]
        self.reading = [asyncio.create_task(f.run()) for f in self.followers]
        self.writing = [asyncio.create_task(w.run(self.stop)) for w in self.writers]
        await asyncio.sleep(0.5)
        return self

    async def finish(self) -> int:
        """Stop writing; wait (90 s at most) until every follower has the head; return the head."""
        self.stop.set()
        async with asyncio.timeout(90):
            await asyncio.gather(*self.writing)
            head = await head_seq(self.base, self.reader)
            await asyncio.gather(*(f.until(head) for f in self.followers))
        return head

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await cancel(self.reading + self.writing)

    @property
    def acked(self) -> dict[str, int]:
        return {k: v for w in self.writers for k, v in w.acked.items()}

    @property
    def ack_times(self) -> list[float]:
        return sorted(t for w in self.writers for t in w.ack_times)

    async def problems(self, head: int) -> list[str]:
        """What breaks one gapless order: the log must be 1..head; each acknowledged task
        created once, at the seq it was acknowledged with; every follower given exactly
        the log after its starting cursor, in order."""
        out: list[str] = []
        events = await read_log(self.base, self.reader)
        if [e["seq"] for e in events] != list(range(1, head + 1)):
            out.append(f"the log is not 1..{head}")
        created = Counter(e["stream"] for e in events if e["type"] == "task.created")
        seq_of = {e["stream"]: e["seq"] for e in events if e["type"] == "task.created"}
        if not self.acked:
            out.append("no write was acknowledged")
        for t, s in self.acked.items():
            if created[f"task:{t}"] != 1 or seq_of[f"task:{t}"] != s:
                out.append(f"acknowledged task {t} (seq {s}) is created {created[f'task:{t}']} times")
        for i, f in enumerate(self.followers):
            if not f.gapless(head):
                out.append(f"follower {i} from {f.since_seq}: {len(f.seqs)} events, not {head - f.since_seq} in order")
        return out
