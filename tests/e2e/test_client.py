"""taskledger.client against a real `taskledger serve` process: the maker-checker
loop, typed errors, retries that apply a write once, and follow() across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import msgspec
import pytest

from taskledger.client import (
    AsyncClient,
    Client,
    Conflict,
    CreateTask,
    Event,
    Forbidden,
    InvalidTransition,
    Job,
    JobReport,
    LeaseMismatch,
    NotFound,
    Requirement,
    Retry,
    TaskledgerError,
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

    def __init__(self, upstream_port: int, fault: str, *, times: int = 1, retry_after: int = 1,
                 status: int = 503) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.fault = fault
        self.status = status
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
            body = b'{"status":%d,"code":"unavailable","title":"Service unavailable","detail":"busy"}' % self.status
            client.sendall(b"HTTP/1.1 %d Busy\r\ncontent-type: application/problem+json\r\n" % self.status
                           + b"retry-after: " + str(self.retry_after).encode() + b"\r\n"
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


def test_a_502_or_504_from_a_proxy_in_front_is_retried_like_a_503(server: ServerProcess) -> None:
    token = server.token("producer")
    for status in (502, 504):
        with FaultyProxy(server.port, "busy", status=status, retry_after=0) as proxy, Client(
                f"http://127.0.0.1:{proxy.port}", token, retry=FAST) as c:
            created = c.create_task(_task("gateway"))
            assert proxy.connections == 2
        assert _count(server, created.id, "task.created") == 1


def test_a_500_is_not_retried_unless_the_policy_says_so(server: ServerProcess) -> None:
    for policy, connections in ((FAST, 1), (Retry(attempts=3, backoff=0.01, statuses=frozenset({500})), 2)):
        with FaultyProxy(server.port, "busy", status=500, retry_after=0) as proxy, Client(
                f"http://127.0.0.1:{proxy.port}", ADMIN_TOKEN, retry=policy) as c:
            if connections == 1:
                with pytest.raises(TaskledgerError) as e:
                    c.get_task("absent")
                assert e.value.status == 500
            else:
                with pytest.raises(TaskNotFound):
                    c.get_task("absent")
            assert proxy.connections == connections


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


def test_a_stream_refused_for_now_is_retried_and_on_retry_hears_of_it(server: ServerProcess) -> None:
    with Client(server.base, server.token("producer")) as p:
        first = p.create_task(_task("busy-feed"))
    heard: list[TaskledgerError] = []
    with FaultyProxy(server.port, "busy", retry_after=0) as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", ADMIN_TOKEN, retry=FAST) as c:
        feed = c.follow(since_seq=first.seq - 1, on_retry=heard.append)
        ev = next(feed)
        feed.close()
    assert ev.seq == first.seq and ev.stream == f"task:{first.id}"
    assert [type(e) for e in heard] == [Unavailable] and proxy.connections == 2


def test_follow_without_reconnect_raises_what_refused_it(server: ServerProcess) -> None:
    with FaultyProxy(server.port, "busy", retry_after=0) as proxy, Client(
            f"http://127.0.0.1:{proxy.port}", ADMIN_TOKEN, retry=FAST) as c:
        with pytest.raises(Unavailable):
            next(c.follow(since_seq=0, reconnect=False))
        assert proxy.connections == 1


def test_follow_without_reconnect_ends_with_its_connection(db_url: str) -> None:
    server = ServerProcess(db_url).start()
    try:
        with Client(server.base, server.token("producer")) as p:
            p.create_task(_task("one-connection"))
        seen: list[str] = []
        ended: list[BaseException | None] = []

        def follow() -> None:
            with Client(server.base, ADMIN_TOKEN, retry=FAST) as c:
                try:
                    seen.extend(c.follow_json(since_seq=0, reconnect=False))
                    ended.append(None)
                except TransportError as e:  # the connection broke rather than ended
                    ended.append(e)

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen
        server.stop()
        t.join(20)
        assert not t.is_alive() and len(ended) == 1  # it did not reconnect
    finally:
        server.stop()


def test_follow_json_is_each_event_as_the_service_sent_it(server: ServerProcess) -> None:
    with Client(server.base, server.token("producer")) as p:
        made = [p.create_task(_task("raw")) for _ in range(3)]
    with server.client() as http:
        page = http.get("/events", params={"since_seq": 0, "types": "task.created"}).json()["events"]
    with Client(server.base, ADMIN_TOKEN) as c:
        texts = c.follow_json(since_seq=0, types=["task.created"])
        raw = [next(texts) for _ in made]
        texts.close()
        events = c.follow(since_seq=0, types=["task.created"])
        decoded = [next(events) for _ in made]
        events.close()
    assert [json.loads(t) for t in raw] == page
    assert [e.seq for e in decoded] == [m.seq for m in made]
    assert [msgspec.to_builtins(e) for e in decoded] == page


def test_follow_task_and_follow_job_read_one_stream_by_stream_seq(server: ServerProcess) -> None:
    with (Client(server.base, server.token("producer")) as producer,
          Client(server.base, server.token("worker", node="n1")) as worker):
        t = producer.create_task(_task("one-stream", verification=None))
        producer.create_task(_task("one-stream"))  # another stream, not followed
        job = producer.create_job(["true"], project="one-stream")
        claimed = worker.claim(projects=["one-stream"])
        assert claimed is not None and claimed.id == t.id
        events = worker.follow_task(t.id)
        first = [next(events) for _ in range(2)]
        events.close()
        assert [(e.stream, e.stream_seq, e.type) for e in first] == [
            (f"task:{t.id}", 1, "task.created"), (f"task:{t.id}", 2, "task.claimed")]
        later = worker.follow_task(t.id, since_seq=1)
        assert next(later).type == "task.claimed"
        later.close()
        jobs = producer.follow_job(job.job_id)
        assert (next(jobs).type, job.seq) == ("job.created", job.seq)
        jobs.close()
        with pytest.raises(NotFound):
            next(producer.follow_job("no-such-job"))


def test_a_runner_claims_reports_and_hears_of_a_cancel_through_the_client(server: ServerProcess) -> None:
    with (Client(server.base, server.token("producer")) as producer,
          Client(server.base, server.token("worker", node="runner-1")) as runner):
        assert runner.claim_job(projects=["runner-loop"]) is None
        made = producer.create_job(["make test", "make lint"], project="runner-loop", fail_fast=True,
                                   command_timeout_seconds=30)
        job = runner.claim_job(projects=["runner-loop"], lease_seconds=30)
        assert isinstance(job, Job) and job.job_id == made.job_id and job.lease_id
        assert [c.command for c in job.commands] == ["make test", "make lint"]
        assert job.fail_fast and not job.parallel and job.command_timeout_seconds == 30
        assert job.node == "runner-1" and job.state == "running"
        lease = job.lease_id
        runner.report_job(job.job_id, JobReport(event="stage", stage="sequential", lease_id=lease))
        runner.report_job(job.job_id, JobReport(event="command_started", command="make test", index=0, total=2,
                                                lease_id=lease))
        done = runner.report_job(job.job_id, JobReport(
            event="command_completed", command="make test", index=0, exit_code=0, duration=0.5,
            output="ok\n", output_truncated=False, lease_id=lease))
        assert done.completed_commands == 1 and done.commands[0].output == "ok\n" and not done.cancel_requested
        assert producer.cancel_job(job.job_id).state == "cancelling"
        beat = runner.report_job(job.job_id, JobReport(event="heartbeat", lease_id=lease))
        assert beat.cancel_requested and beat.state == "cancelling"
        end = runner.report_job(job.job_id, JobReport(event="finish", status="cancelled", lease_id=lease))
        assert end.state == "cancelled"
        with pytest.raises(Conflict):
            runner.report_job(job.job_id, JobReport(event="heartbeat", lease_id=lease))
        with pytest.raises(ValidationError):  # a field the event does not take
            runner.report_job(made.job_id, JobReport(event="heartbeat", exit_code=1, lease_id=lease))


def test_claim_batch_takes_several_tasks_each_with_a_lease_of_its_own(server: ServerProcess) -> None:
    with (Client(server.base, server.token("producer")) as producer,
          Client(server.base, server.token("worker", node="n1")) as worker):
        made = [producer.create_task(_task("batch-claim")) for _ in range(3)]
        got = worker.claim_batch(2, projects=["batch-claim"], task_types=["implement"])
        assert [t.id for t in got.tasks] == [m.id for m in made[:2]]
        assert len({t.lease_id for t in got.tasks}) == 2 and all(t.state == "claimed" for t in got.tasks)
        rest = worker.claim_batch(5, projects=["batch-claim"])
        assert [t.id for t in rest.tasks] == [made[2].id]
        assert worker.claim_batch(5, projects=["batch-claim"]).tasks == []
        worker.start(got.tasks[0].id, got.tasks[0].lease_id or "")


def test_a_polling_claim_sends_no_idempotency_key_and_an_empty_one_records_nothing(
        server: ServerProcess, db_url: str) -> None:
    async def recorded() -> int:
        conn = await asyncpg.connect(db_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM idempotency_keys"))
        finally:
            await conn.close()

    with Client(server.base, server.token("worker", node="poller")) as w:
        before = asyncio.run(recorded())
        assert w.claim(projects=["idle"], idempotent=False) is None
        assert w.claim_batch(3, projects=["idle"], idempotent=False).tasks == []
        assert w.claim_job(projects=["idle"], idempotent=False) is None
        assert asyncio.run(recorded()) == before
        assert w.claim(projects=["idle"]) is None  # the default: the answer is kept for a retry
        assert w.claim_job(projects=["idle"]) is None
        assert asyncio.run(recorded()) == before + 2


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
