"""Webhooks against a local receiver: signed, in order, at least once, once per
event across two app instances, and task.blocked as a tracker issue."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from taskledger.events.task.events import Requirement
from taskledger.events.task.state import TaskState
from taskledger.service.http.app import create_app
from taskledger.service.ops.webhooks import backoff, issue_for, sign
from tests import flows
from tests.conftest import AppHarness, free_port, settings_for

SECRET = "s3cret-for-tests-0123456789"
FAST = {"webhook_poll_seconds": 0.1, "webhook_retry_base_seconds": 0.05, "webhook_retry_max_seconds": 0.3}


class Receiver:
    """A real HTTP server that records what it is sent and answers `status`;
    `up=False` leaves its port closed (connection refused)."""

    def __init__(self, *, up: bool = True, status: int = 204) -> None:
        self.port = free_port()
        self.status = status
        self.got: list[dict[str, Any]] = []  # every request, as received
        self.accepted: list[dict[str, Any]] = []  # those answered 2xx
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = f"http://127.0.0.1:{self.port}/hook"
        if up:
            self.start()

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                rec = {"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                with receiver.lock:
                    status = receiver.status
                    receiver.got.append(rec)
                    if 200 <= status < 300:
                        receiver.accepted.append(rec)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def seqs(self) -> list[int]:
        with self.lock:
            return [int(r["headers"]["x-taskledger-delivery"].rsplit(":", 1)[1]) for r in self.accepted]

    async def wait_for(self, n: int, seconds: float = 20) -> None:
        for _ in range(int(seconds / 0.05)):
            if len(self.accepted) >= n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"received {len(self.accepted)} of {n}: {self.seqs()}")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


async def _app(stack: AsyncExitStack, db_url: str) -> AppHarness:
    app = create_app(settings_for(db_url, **FAST))
    http = await stack.enter_async_context(AsyncTestClient(app=app, timeout=30))
    return AppHarness(http, app)


@pytest.fixture
async def app(db_url: str) -> AsyncIterator[AppHarness]:
    async with AsyncExitStack() as stack:
        yield await _app(stack, db_url)


async def _hook(h: AppHarness, url: str, **body: Any) -> dict[str, Any]:
    return await h.admin.ok(await h.admin.post("/webhooks", {"url": url, "secret": SECRET, **body}), 201)


async def _created_seqs(h: AppHarness, proj: str) -> list[int]:
    page = await h.admin.ok(await h.admin.get("/events", params={"types": "task.created", "project": proj}))
    return [e["seq"] for e in page["events"]]


async def test_webhooks_are_admin_only_and_never_show_their_secret(app: AppHarness) -> None:
    producer = await app.client("producer")
    r = await producer.post("/webhooks", {"url": "http://127.0.0.1:1/x", "secret": SECRET})
    assert r.status_code == 403
    assert (await producer.get("/webhooks")).status_code == 403
    hook = await _hook(app, "http://127.0.0.1:1/x", types=["task."])
    assert set(hook) == {"id", "url", "types", "format", "checkpoint_seq", "created_at"}
    listed = await app.admin.get("/webhooks")
    assert [w["id"] for w in listed.json()["webhooks"]] == [hook["id"]]
    assert SECRET not in listed.text and "secret" not in listed.text
    assert (await app.admin.post(f"/webhooks/{hook['id']}", {})).status_code == 405
    r = await app.admin.http.delete(f"/webhooks/{hook['id']}", headers=app.admin.headers)
    assert r.status_code == 204
    r = await app.admin.get(f"/webhooks/{hook['id']}/deliveries")
    assert r.status_code == 404 and r.json()["code"] == "webhook_not_found"


@pytest.mark.parametrize("body", [
    {"url": "ftp://example.com/x", "secret": SECRET},
    {"url": "http://example.com/x", "secret": "short"},
    {"url": "http://example.com/x", "secret": SECRET, "format": "issue", "types": ["task.created"]},
    {"url": "http://example.com/x", "secret": SECRET, "format": "tweet"},
    {"url": "http://example.com/x", "secret": SECRET, "since_seq": 10**9},
    {"url": "http://example.com/x", "secret": SECRET, "types": ["Robert'); DROP"]},
    {"url": "http://example.com/x", "secret": SECRET, "extra": 1},
])
async def test_a_bad_webhook_is_refused_and_nothing_is_stored(app: AppHarness, body: dict[str, Any]) -> None:
    r = await app.admin.post("/webhooks", body)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert (await app.admin.get("/webhooks")).json() == {"webhooks": []}


async def test_events_arrive_signed_in_order_once_each(app: AppHarness, receiver: Receiver) -> None:
    hook = await _hook(app, receiver.url, types=["task.created"])
    producer = await app.client("producer")
    proj = flows.project()
    for _ in range(5):
        await flows.create_task(producer, proj)
    expected = await _created_seqs(app, proj)
    await receiver.wait_for(5)
    await asyncio.sleep(0.3)  # anything more would be a repeat
    assert receiver.seqs() == expected
    for rec in receiver.accepted:
        body, headers = rec["body"], rec["headers"]
        mac = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["x-taskledger-signature-256"], "sha256=" + mac)
        event = json.loads(body)
        assert event["type"] == headers["x-taskledger-event"] == "task.created"
        assert set(event) == {"seq", "stream", "stream_seq", "type", "data", "meta", "recorded_at", "hash"}
    page = await app.admin.ok(await app.admin.get(f"/webhooks/{hook['id']}/deliveries"))
    assert [d["seq"] for d in page["deliveries"]] == expected[::-1]
    assert all(d["ok"] and d["attempt"] == 1 and d["status_code"] == 204 for d in page["deliveries"])
    listed = (await app.admin.get("/webhooks")).json()["webhooks"][0]
    assert listed["checkpoint_seq"] >= expected[-1]


def test_a_tampered_body_does_not_verify() -> None:
    body = b'{"seq":1}'
    good = sign(SECRET, body)
    assert good == "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert sign(SECRET, b'{"seq":2}') != good and sign("other-secret-0123456", body) != good


async def test_a_receiver_down_for_a_while_gets_every_event_in_order_afterwards(app: AppHarness) -> None:
    receiver = Receiver(up=False)
    try:
        hook = await _hook(app, receiver.url, types=["task.created"])
        producer = await app.client("producer")
        proj = flows.project()
        for _ in range(3):
            await flows.create_task(producer, proj)
        await asyncio.sleep(0.8)  # refused, retried with backoff
        failed = (await app.admin.get(f"/webhooks/{hook['id']}/deliveries")).json()["deliveries"]
        assert len(failed) >= 2 and not any(d["ok"] for d in failed)
        assert {d["seq"] for d in failed} == {(await _created_seqs(app, proj))[0]}  # later ones wait their turn
        receiver.status = 503
        receiver.start()
        for _ in range(2):
            await flows.create_task(producer, proj)
        await asyncio.sleep(0.5)
        assert receiver.accepted == [] and receiver.got  # answered 503: still not delivered
        receiver.status = 200
        await receiver.wait_for(5)
        await asyncio.sleep(0.3)
        assert receiver.seqs() == await _created_seqs(app, proj)
    finally:
        receiver.stop()


@pytest.mark.slow
async def test_two_app_instances_on_one_database_deliver_each_event_once(db_url: str, receiver: Receiver) -> None:
    async with AsyncExitStack() as stack:
        a = await _app(stack, db_url)
        b = await _app(stack, db_url)
        await _hook(a, receiver.url, types=["task.created"])
        pa, pb = await a.client("producer"), await b.client("producer")
        proj = flows.project()
        for i in range(12):
            await flows.create_task(pa if i % 2 else pb, proj)
            await asyncio.sleep(0.02)
        await receiver.wait_for(12)
        await asyncio.sleep(0.5)
        assert receiver.seqs() == await _created_seqs(a, proj)
        assert len(receiver.got) == 12  # no repeats, no second deliverer


async def test_a_blocked_task_arrives_as_an_issue_a_tracker_accepts(app: AppHarness, receiver: Receiver) -> None:
    await _hook(app, receiver.url, format="issue")
    producer = await app.client("producer")
    maker, checker = await app.client("worker", node="a"), await app.client("worker", node="b")
    proj = flows.project()
    await flows.make(producer, maker, proj, title="Add /healthz", retry_predecessor=False,
                     requirements=[{"id": "R1", "text": "GET /healthz answers 200"},
                                   {"id": "R2", "text": "it is documented"}])
    v = await flows.claim(checker, proj, ["verify"])
    assert v is not None
    await flows.complete_verify(checker, v, "FAIL", verdicts=[
        {"requirement_id": "R1", "verdict": "FAIL", "reason": "curl got 404"},
        {"requirement_id": "R2", "verdict": "PASS", "reason": "README"}])
    await receiver.wait_for(1)
    rec = receiver.accepted[0]
    issue = json.loads(rec["body"])
    assert rec["headers"]["x-taskledger-event"] == "task.blocked"
    assert set(issue) == {"title", "body", "labels"}  # what POST /repos/{owner}/{repo}/issues takes
    assert isinstance(issue["title"], str) and "Add /healthz" in issue["title"]
    assert "R1" in issue["body"] and "GET /healthz answers 200" in issue["body"] and "curl got 404" in issue["body"]
    assert "R2" not in issue["body"]
    assert all(isinstance(x, str) and 0 < len(x) <= 50 for x in issue["labels"]) and "blocked" in issue["labels"]
    assert hmac.compare_digest(rec["headers"]["x-taskledger-signature-256"], sign(SECRET, rec["body"]))


def test_the_issue_names_each_unmet_requirement_with_the_checkers_reason() -> None:
    task = TaskState(id="T-9", project="shop", title="Pay by card", spec="Stripe checkout", max_attempts=3,
                     requirements=[Requirement(id="R1", text="a card payment succeeds"),
                                   Requirement(id="R2", text="a refund works")])
    issue = issue_for(task, "T-9", {
        "blocker_id": "B-1", "reason": "retries exhausted", "category": None, "attempt": 3,
        "unmet_requirements": [{"requirement_id": "R2", "reason": "refund endpoint 500", "checker": "verifier"}]},
        seq=42)
    assert issue["title"] == "Blocked: Pay by card (T-9)"
    assert "- **R2**: a refund works\n  - verifier: refund endpoint 500" in issue["body"]
    assert "R1" not in issue["body"] and "attempt 3 of 3" in issue["body"] and "seq 42" in issue["body"]
    assert issue["labels"] == ["taskledger", "blocked", "project:shop"]


def test_retries_back_off_up_to_the_cap() -> None:
    assert [backoff(n, 1.0, 10.0) for n in (1, 2, 3, 4, 5, 60)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
