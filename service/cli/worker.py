"""`taskledger worker`: the reference worker.

It claims tasks with its token (the node is the token's), runs an implement
task's `spec` as a shell command, and for a verify task runs each requirement's
`check` command (exit 0 = PASS). While a command runs it heartbeats; if the
lease is lost it kills the command and reports nothing.

A requirement without a `check` cannot be judged by a program, so a verify
task with such a requirement (and no failing check) is reported BLOCKED with
category `info_missing`, never a PASS nobody checked.

With `--concurrency N` above 1 it claims in batches, each task started by the
claim itself (`"start": true`), and reports completions (a verify task's
verdicts too) in batches through `Reports`; a failure is reported alone. A
claim→complete cycle through the batch routes costs the service about a sixth
of its CPU through the single routes (docs/BENCHMARKS.md, "The speed of a queue").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from taskledger.client import (
    AsyncClient,
    CompleteEntry,
    Conflict,
    Task,
    TaskledgerError,
    TransportError,
    Verdict,
)
from taskledger.client.models import Category, Outcome
from taskledger.service.cli.common import add_client_flags, command_env

TAIL = 4000
MAX_CLAIM = 100  # what one POST /tasks/claim/batch may take
MAX_REPORT = 1000  # entries in one POST /tasks/complete/batch
# How long a finished task's report waits for others to share its request. Tasks
# claimed together and alike tend to finish together; 50 ms gathers those, and is
# nothing beside a lease (at least 5 s) or the command that just ran.
REPORT_WINDOW = 0.05

Answer = tuple[int, Task | None, str]  # the status, the view when 200, the refusal's problem


async def answer(call: Awaitable[Task]) -> Answer:
    """A report on a task we hold: 200 and the view, or the refusal's status, None
    and its problem. An unreachable service is no refusal: that error goes on up."""
    try:
        return 200, await call, ""
    except TransportError:
        raise
    except TaskledgerError as e:
        return e.status, None, _problem(e)


def _problem(e: TaskledgerError) -> str:
    return msgspec.json.encode(e.problem).decode() if e.problem else e.detail


def complete_alone(client: AsyncClient, e: CompleteEntry) -> Awaitable[Answer]:
    """`e` reported through the single route (`POST /tasks/{id}/complete`)."""
    return answer(client.complete(e.task_id, e.lease_id, result=e.result, outcome=e.outcome,
                                  verdicts=e.verdicts, category=e.category))


class Reports:
    """Completions that finish close together, sent as one `complete_batch`.

    A completion waits at most `window` seconds for others, and not at all once
    every task the worker holds has finished (none could join) or `MAX_REPORT`
    wait. A batch is all or nothing, so a refused one wrote nothing: its entries
    are then sent one by one, and each gets its own answer (the refused one its
    refusal, the others their views), as if never batched."""

    def __init__(self, client: AsyncClient, *, window: float, held: Callable[[], int],
                 say: Callable[..., None]) -> None:
        self.client = client
        self.window = window
        self.held = held
        self.say = say
        self.waiting: list[tuple[CompleteEntry, asyncio.Future[Answer]]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.sending: set[asyncio.Task[None]] = set()

    async def complete(self, entry: CompleteEntry) -> Answer:
        done: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.waiting.append((entry, done))
        if self.ready():
            self.flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.window, self.flush)
        return await done

    def ready(self) -> bool:
        return len(self.waiting) >= min(self.held(), MAX_REPORT)

    def check(self) -> None:
        """Send now if nothing more can join (also when a task left without a report)."""
        if self.waiting and self.ready():
            self.flush()

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.waiting = self.waiting, []
        if batch:
            sending = asyncio.create_task(self._send(batch))
            self.sending.add(sending)
            sending.add_done_callback(self.sending.discard)

    async def _send(self, batch: list[tuple[CompleteEntry, asyncio.Future[Answer]]]) -> None:
        entries = [e for e, _ in batch]
        try:
            answers = await self._report(entries)
            if len(answers) != len(batch):
                raise TaskledgerError(f"{len(answers)} answers to a batch of {len(batch)}")
        except Exception as e:  # the service is unreachable: every waiting task hears of it
            for _, done in batch:
                if not done.done():
                    done.set_exception(e)
            return
        for (_, done), a in zip(batch, answers, strict=True):
            if not done.done():
                done.set_result(a)

    async def _report(self, entries: list[CompleteEntry]) -> list[Answer]:
        if len(entries) > 1:
            try:
                views = (await self.client.complete_batch(entries)).tasks
                return [(200, v, "") for v in views]
            except TransportError:
                raise
            except TaskledgerError as e:
                self.say(event="batch_refused", tasks=[x.task_id for x in entries], status=e.status, index=e.index,
                         detail=_problem(e)[:300])
        return [await complete_alone(self.client, e) for e in entries]

    async def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for sending in self.sending:
            sending.cancel()
        await asyncio.gather(*self.sending, return_exceptions=True)


class LeaseLost(Exception):
    pass


class Worker:
    def __init__(self, url: str, token: str, *, task_types: list[str], projects: list[str] | None,
                 lease_seconds: int, command_timeout: float, concurrency: int = 1,
                 report_window: float = REPORT_WINDOW, out: Any = sys.stdout) -> None:
        self.client = AsyncClient(url, token)
        self.task_types: list[Any] = task_types
        self.projects = projects
        self.lease_seconds = lease_seconds
        self.command_timeout = command_timeout
        self.out = out
        self.held = 0  # tasks taken and not yet done with
        # One at a time, each task is claimed, started and reported on its own. A
        # report held for others is not heartbeated: it waits less than a beat.
        window = min(report_window, lease_seconds / 3)
        self.reports = Reports(self.client, window=window, held=lambda: self.held, say=self.say) \
            if concurrency > 1 else None

    def say(self, **fields: Any) -> None:
        print(json.dumps(fields), file=self.out, flush=True)

    async def close(self) -> None:
        if self.reports is not None:
            await self.reports.close()
        await self.client.aclose()

    async def claim_many(self, n: int) -> list[Task]:
        """Up to `n` tasks, each with its own lease. With more than one slot, in one
        call that starts them too. A poll that finds nothing is a read on the
        service: no Idempotency-Key."""
        if self.reports is None:
            one = await self.client.claim(task_types=self.task_types, projects=self.projects,
                                          lease_seconds=self.lease_seconds, idempotent=False)
            return [one] if one is not None else []
        return (await self.client.claim_batch(min(n, MAX_CLAIM), task_types=self.task_types,
                                              projects=self.projects, lease_seconds=self.lease_seconds,
                                              start=True, idempotent=False)).tasks

    def take(self, task: Task) -> asyncio.Task[None]:
        """Work on `task` from now on; it counts as held until its report is answered."""
        self.held += 1
        return asyncio.create_task(self.work_one(task))

    async def complete(self, task: Task, *, result: Any = None, outcome: Outcome | None = None,
                       verdicts: list[Verdict] | None = None, category: Category | None = None) -> Answer:
        """Report `task` done: on its own, or in a batch with others that finish close by."""
        entry = CompleteEntry(task_id=task.id, lease_id=task.lease_id or "", result=result, outcome=outcome,
                              verdicts=list(verdicts or []), category=category)
        if self.reports is not None:
            return await self.reports.complete(entry)
        return await complete_alone(self.client, entry)

    async def run_command(self, task: Task, command: str) -> tuple[int, str, float]:
        """Run `command` with the shell while heartbeating; returns (exit code, output tail, seconds)."""
        # A verifier's checks learn which checker of the panel they run for (so a
        # panel's checkers can differ) and whose work they judge.
        env = command_env(TASKLEDGER_TASK_ID=task.id, TASKLEDGER_ATTEMPT=str(task.attempt),
                          TASKLEDGER_TASK_TYPE=task.task_type or "implement",
                          TASKLEDGER_CHECKER=task.checker or "",
                          TASKLEDGER_PARENT_TASK_ID=task.parent_task_id or "",
                          TASKLEDGER_NOTES=task.operator_notes or "",
                          TASKLEDGER_REWORK_NOTES=json.dumps(msgspec.to_builtins(task.rework_notes)))
        start = time.monotonic()
        proc = await asyncio.create_subprocess_shell(
            command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True)
        beat = asyncio.create_task(self._heartbeat(task))
        done = asyncio.create_task(proc.communicate())
        try:
            finished, _ = await asyncio.wait({beat, done}, timeout=self.command_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            if done not in finished:
                _kill(proc)
                await done
                if beat in finished and beat.exception() is not None:
                    raise LeaseLost(str(beat.exception()))
                return 124, f"timed out after {self.command_timeout}s", time.monotonic() - start
            stdout, _ = done.result()
            text = (stdout or b"").decode("utf-8", "replace")[-TAIL:]
            return int(proc.returncode or 0), text, time.monotonic() - start
        finally:
            beat.cancel()
            if proc.returncode is None:
                _kill(proc)

    async def _heartbeat(self, task: Task) -> None:
        interval = max(1.0, self.lease_seconds / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.client.heartbeat(task.id, task.lease_id or "")
            except Conflict as e:
                raise LeaseLost(e.detail or "lease lost") from e
            except TransportError:
                raise
            except TaskledgerError:
                pass  # not a lost lease: keep working, and beat again

    async def work_one(self, task: Task) -> None:
        try:
            if task.state != "running":  # claimed without being started
                status, _, problem = await answer(self.client.start(task.id, task.lease_id or ""))
                if status != 200:
                    self.say(task=task.id, event="start_refused", status=status, detail=problem[:300])
                    return
            if task.task_type == "verify":
                await self._verify(task)
            else:
                await self._implement(task)
        except LeaseLost as e:
            self.say(task=task.id, event="lease_lost", detail=str(e))
        finally:
            self.held -= 1
            if self.reports is not None:
                self.reports.check()

    async def _implement(self, task: Task) -> None:
        lease = task.lease_id or ""
        spec = task.spec or ""
        if not spec.strip():
            status, _, _ = await answer(self.client.fail(task.id, lease, error="the task has no spec to run"))
            self.say(task=task.id, event="failed", reason="empty spec", status=status)
            return
        code, output, seconds = await self.run_command(task, spec)
        if code == 0:
            status, view, _ = await self.complete(
                task, result={"exit_code": 0, "output": output, "duration": round(seconds, 3)})
            self.say(task=task.id, event="completed", status=status, state=view.state if view else None)
        else:
            status, _, _ = await answer(self.client.fail(task.id, lease, error=f"exit {code}: {output[-1000:]}"))
            self.say(task=task.id, event="failed", exit_code=code, status=status)

    async def _verify(self, task: Task) -> None:
        verdicts: list[Verdict] = []
        unchecked: list[str] = []
        for req in task.requirements:
            if not req.check:
                unchecked.append(req.id)
                continue
            code, output, seconds = await self.run_command(task, req.check)
            verdicts.append(Verdict(
                requirement_id=req.id, verdict="PASS" if code == 0 else "FAIL",
                reason=f"`{req.check}` exited {code} in {seconds:.2f}s" + (f": {output[-500:]}" if code else ""),
            ))
        outcome: Outcome = "PASS"
        category: Category | None = None
        result: dict[str, Any] | None = None
        if any(v.verdict == "FAIL" for v in verdicts):
            outcome = "FAIL"
        elif unchecked or not task.requirements:
            outcome, category = "BLOCKED", "info_missing"
            result = {"unchecked_requirements": unchecked,
                      "reason": "requirements without a check command cannot be judged here"}
        status, _, _ = await self.complete(task, outcome=outcome, verdicts=verdicts, category=category, result=result)
        self.say(task=task.id, event="verified", outcome=outcome, status=status)


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_worker(args: argparse.Namespace) -> int:
    if not args.token:
        print("a token is needed: --token or TASKLEDGER_TOKEN", file=sys.stderr)
        return 2
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    projects = [p.strip() for p in args.projects.split(",") if p.strip()] if args.projects else None
    slots = max(1, args.concurrency)
    w = Worker(args.url, args.token, task_types=types, projects=projects, lease_seconds=args.lease_seconds,
               command_timeout=args.command_timeout, concurrency=slots, report_window=args.report_window)
    running: set[asyncio.Task[None]] = set()
    try:
        while True:
            claimed: list[Task] = []
            if len(running) < slots:
                try:
                    claimed = await w.claim_many(slots - len(running))
                except TaskledgerError as e:
                    if args.once and not running:
                        print(f"claim failed: {e}", file=sys.stderr)
                        return 1
            for task in claimed:
                w.say(task=task.id, event="claimed", task_type=task.task_type, attempt=task.attempt)
                running.add(w.take(task))
            if not running:
                if args.once:
                    return 0
                await asyncio.sleep(args.poll)
                continue
            if claimed and len(running) < slots:
                continue
            # every slot is busy, or nothing more to claim now: wait for a slot (or poll again)
            _, pending = await asyncio.wait(running, timeout=None if len(running) >= slots or args.once
                                            else args.poll, return_when=asyncio.FIRST_COMPLETED)
            for t in running - pending:
                t.result()
            running = set(pending)
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await w.close()


def cmd_worker(args: argparse.Namespace) -> int:
    return asyncio.run(run_worker(args))


def register(sub: Any) -> None:
    p = sub.add_parser("worker", help="reference worker: claim tasks and run their commands")
    add_client_flags(p)
    p.add_argument("--once", action="store_true", help="exit when nothing is left to claim")
    p.add_argument("--types", default="implement,verify", help="task types to claim (comma list)")
    p.add_argument("--projects", default=None, help="only these projects (comma list)")
    p.add_argument("--lease-seconds", type=int, default=60)
    p.add_argument("--command-timeout", type=float, default=3600.0)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between claims when idle")
    p.add_argument("--concurrency", type=int, default=1,
                   help="tasks worked on at once; more than 1 claims and starts them in batches "
                        "(POST /tasks/claim/batch with start) and reports completions in batches "
                        "(POST /tasks/complete/batch)")
    p.add_argument("--report-window", type=float, default=REPORT_WINDOW,
                   help="with --concurrency above 1: seconds a finished task's report waits for others "
                        "to share one request (none once every task held has finished; at most a third "
                        "of the lease)")
    p.set_defaults(func=cmd_worker)
