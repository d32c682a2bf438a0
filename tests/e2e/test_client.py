"""taskledger.client against a real `taskledger serve` process: the maker-checker
loop, typed errors, retries that apply a write once, and follow() across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from taskledger.client import (
    AsyncClient,
    Client,
    Conflict,
    CreateTask,
    Event,
    Forbidden,
    InvalidTransition,
    LeaseMismatch,
    NotFound,
    Requirement,
    Retry,
    TaskNotFound,
    TransportError,
    Unauthorized,
    Unavailable,
    ValidationError,
    Verdict,
)
from tests.conftest import ADMIN_TOKEN, ROOT, ServerProcess, free_port

FAST = Retry(attempts=6, backoff=0.05, max_backoff=0.5)


def _id(prefix: str = "T") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _task(project: str, **kw: Any) -> CreateTask:
    return CreateTask(id=kw.pop("id", _id()), project=project, title="add /healthz", spec="make it answer",
                      requirements=[Requirement(id="R1", text="GET /healthz answers 200"),
                                    Requirement(id="R2", text="it is documented")], **kw)


def test_the_maker_checker_loop_runs_through_the_client(server: ServerProcess) -> None:
    url = server.base
    with (Client(url, server.token("producer")) as producer,
          Client(url, server.token("worker", node="node-a")) as maker,
          Client(url, server.token("worker", node="node-b")) as checker):
        created = producer.create_task(_task("loop"))
        assert created.state == "pending" and created.seq > 0
        t = maker.claim(task_types=["implement"], projects=["loop"])
        assert t is not None and t.id == created.id and t.lease_id
        maker.start(t.id, t.lease_id)
        maker.heartbeat(t.id, t.lease_id)
        done = maker.complete(t.id, t.lease_id, result={"commit": "abc123"})
        assert done.state == "verifying" and done.verifier_task_ids
        assert maker.claim(task_types=["verify"], projects=["loop"]) is None  # not on the maker's node
        v = checker.claim(task_types=["verify"], projects=["loop"])
        assert v is not None and v.id in done.verifier_task_ids and v.lease_id
        checker.start(v.id, v.lease_id)
        checker.complete(v.id, v.lease_id, outcome="PASS", verdicts=[
            Verdict(requirement_id="R1", verdict="PASS", reason="curl answered 200"),
            Verdict(requirement_id="R2", verdict="PASS", reason="README has it")])
        final = producer.get_task(created.id)
        assert final.state == "verified"
        assert [r.outcome for r in final.verdicts] == ["PASS"]
        assert {d.requirement_id for d in final.verdicts[0].verdicts} == {"R1", "R2"}
        assert [c.id for c in producer.collect(project="loop").tasks] == [created.id]
        history = [e.type for e in producer.task_events(created.id).events]
        assert history[0] == "task.created" and history[-1] == "task.collected" and "task.verified" in history
        page = producer.list_tasks(project="loop", task_type="implement")
        assert [x.id for x in page.tasks] == [created.id]


async def test_the_async_client_runs_the_same_loop(server: ServerProcess) -> None:
    url = server.base
    tokens = await asyncio.to_thread(lambda: [server.token("producer"), server.token("worker", node="a"),
                                              server.token("worker", node="b")])
    async with (AsyncClient(url, tokens[0]) as producer, AsyncClient(url, tokens[1]) as maker,
                AsyncClient(url, tokens[2]) as checker):
        created = await producer.create_task(_task("aloop"))
        t = await maker.claim(task_types=["implement"], projects=["aloop"])
        assert t is not None and t.lease_id
        await maker.start(t.id, t.lease_id)
        await maker.complete(t.id, t.lease_id)
        v = await checker.claim(task_types=["verify"], projects=["aloop"])
        assert v is not None and v.lease_id
        await checker.start(v.id, v.lease_id)
        await checker.complete(v.id, v.lease_id, outcome="FAIL", verdicts=[
            Verdict(requirement_id="R1", verdict="FAIL", reason="404"),
            Verdict(requirement_id="R2", verdict="PASS")])
        back = await producer.get_task(created.id)
        assert back.state == "pending" and back.attempt == 2
        assert [(n.requirement_id, n.reason) for n in back.rework_notes] == [("R1", "404")]


def test_refusals_raise_typed_errors_that_carry_the_code(server: ServerProcess) -> None:
    url = server.base
    with (Client(url, server.token("producer")) as producer,
          Client(url, server.token("worker", node="n1")) as worker,
          Client(url, "tl_not_a_token", retry=FAST) as stranger):
        with pytest.raises(TaskNotFound) as missing:
            producer.get_task("no-such-task")
        assert isinstance(missing.value, NotFound)
        assert missing.value.code == "task_not_found" and missing.value.status == 404
        assert missing.value.problem["status"] == 404

        with pytest.raises(ValidationError) as bad:
            producer.create_task(CreateTask(title="", project="errs"))
        assert bad.value.code == "validation_error"

        with pytest.raises(Forbidden) as denied:
            worker.create_task(_task("errs"))
        assert denied.value.code == "forbidden"

        with pytest.raises(Unauthorized):
            stranger.get_task("x")

        created = producer.create_task(_task("errs"))
        t = worker.claim(projects=["errs"])
        assert t is not None and t.lease_id
        with pytest.raises(LeaseMismatch) as lease:
            worker.start(t.id, "not-the-lease")
        assert isinstance(lease.value, Conflict) and lease.value.code == "lease_mismatch"
        worker.start(t.id, t.lease_id)
        with pytest.raises(InvalidTransition) as twice:
            worker.start(t.id, t.lease_id)
        assert twice.value.code == "invalid_transition" and twice.value.status == 409
        assert producer.get_task(created.id).state == "running"


# ------------------------------------------------------------------ fault injection


class FaultyProxy:
    """A TCP proxy in front of the real server that spoils the first connection:
    `drop` forwards the request and closes the connection instead of answering
    (the answer is lost after the write happened); `busy` answers 503 with
    Retry-After without forwarding. Later connections pass through."""

    def __init__(self, upstream_port: int, fault: str, *, times: int = 1, retry_after: int = 1) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.fault = fault
        self.remaining = times
        self.retry_after = retry_after
        self.connections = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._handle(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _spoil(self) -> bool:
        with self.lock:
            self.connections += 1
            if self.remaining > 0:
                self.remaining -= 1
                return True
            return False

    def _handle(self, client: socket.socket) -> None:
        spoil = self._spoil()
        if spoil and self.fault == "busy":
            client.recv(65536)
            body = b'{"status":503,"code":"unavailable","title":"Service unavailable","detail":"busy"}'
            client.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n"
                           b"retry-after: " + str(self.retry_after).encode() + b"\r\n"
                           b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            client.close()
            return
        upstream = socket.create_connection(self.upstream)
        if spoil and self.fault == "drop":
            upstream.sendall(client.recv(65536))
            upstream.recv(65536)  # the service answered: the write is done
            upstream.close()
            client.close()  # ... and the answer never arrives
            return

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        upstream.close()
        client.close()

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _count(server: ServerProcess, task_id: str, type_: str) -> int:
    with server.client() as c:
        events = c.get(f"/tasks/{task_id}/events", params={"since_seq": 0}).json()["events"]
    return sum(1 for e in events if e["type"] == type_)


def test_a_write_whose_answer_was_lost_is_retried_and_applied_once(server: ServerProcess) -> None:
    token = server.token("producer")
    with FaultyProxy(server.port, "drop") as proxy, Client(f"http://127.0.0.1:{proxy.port}", token,
                                                           retry=FAST) as c:
        created = c.create_task(_task("idem"))
        assert proxy.connections == 2  # the lost answer, then the retry
    assert _count(server, created.id, "task.created") == 1
    with Client(server.base, token) as direct:
        assert direct.get_task(created.id).seq == created.seq  # the retry answered the first answer


def test_a_claim_whose_answer_was_lost_gets_the_same_task_back(server: ServerProcess) -> None:
    with Client(server.base, server.token("producer")) as p:
        first = p.create_task(_task("idem-claim"))
        p.create_task(_task("idem-claim"))
    with FaultyProxy(server.port, "drop") as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", server.token("worker", node="n"), retry=FAST) as w:
        t = w.claim(projects=["idem-claim"])
    assert t is not None and t.id == first.id
    assert _count(server, first.id, "task.claimed") == 1


def test_a_503_is_retried_after_its_retry_after(server: ServerProcess) -> None:
    with FaultyProxy(server.port, "busy", retry_after=1) as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", ADMIN_TOKEN, retry=FAST) as c:
        start = time.monotonic()
        with pytest.raises(TaskNotFound):
            c.get_task("absent")
        assert time.monotonic() - start >= 1.0
        assert proxy.connections == 2


def test_503s_beyond_the_retries_raise_unavailable(server: ServerProcess) -> None:
    with FaultyProxy(server.port, "busy", times=10, retry_after=0) as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", ADMIN_TOKEN, retry=Retry(attempts=3, backoff=0.01)) as c:
        with pytest.raises(Unavailable) as e:
            c.get_task("absent")
        assert e.value.code == "unavailable" and proxy.connections == 3


def test_an_unreachable_service_raises_a_transport_error_after_retrying() -> None:
    with (Client(f"http://127.0.0.1:{free_port()}", "t", retry=Retry(attempts=3, backoff=0.01)) as c,
          pytest.raises(TransportError)):
        c.get_task("x")


# ------------------------------------------------------------------ follow()


@pytest.fixture
def restartable(db_url: str) -> Iterator[ServerProcess]:
    s = ServerProcess(db_url).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
async def test_follow_resumes_across_a_server_restart_without_gap_or_duplicate(
        restartable: ServerProcess) -> None:
    server = restartable
    token = await asyncio.to_thread(server.token, "producer")
    seen: list[Event] = []

    async def follower() -> None:
        async with AsyncClient(server.base, ADMIN_TOKEN, retry=FAST) as c:
            async for ev in c.follow(since_seq=0):
                seen.append(ev)

    async def wait_for(n: int) -> None:
        for _ in range(600):
            if len(seen) >= n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"saw {len(seen)} events, expected {n}")

    async def create(n: int) -> int:
        async with AsyncClient(server.base, token, retry=FAST) as c:
            last = 0
            for _ in range(n):
                last = (await c.create_task(_task("follow"))).seq
            return last

    task = asyncio.create_task(follower())
    try:
        head = await create(5)
        await wait_for(head)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(0.5)  # the follower is reconnecting into a closed port
        await asyncio.to_thread(server.start)
        head = await create(5)
        await wait_for(head)
        await asyncio.sleep(0.3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    seqs = [e.seq for e in seen]
    assert seqs == list(range(1, head + 1))


def test_the_readme_loop_in_python_runs_as_written(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The loop in Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    env = {"URL": server.base, "PRODUCER": server.token("producer"),
           "MAKER": server.token("worker", node="node-a"), "CHECKER": server.token("worker", node="node-b")}
    try:
        exec(compile(code, "README.md", "exec"), env)  # the README's own example
    finally:
        for name in ("producer", "maker", "checker"):
            if isinstance(env.get(name), Client):
                env[name].close()  # a script ending closes them; this process goes on
    assert capsys.readouterr().out.strip() == "verified"
