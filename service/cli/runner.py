"""`taskledger runner`: the reference job runner. It claims jobs, runs their
commands with the shell, reports each start and completion with the tail of
its output, heartbeats, and kills the running command on cancellation or past
the job's command timeout."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any

from taskledger.client import AsyncClient, Conflict, Job, JobReport, NotFound, Retry, TaskledgerError, TransportError
from taskledger.service.cli.common import add_client_flags, async_client, command_env

TERMINAL = ("completed", "failed", "cancelled")
# The exit code reported for a command killed after the job's command_timeout_seconds
# (the one GNU `timeout` uses), with `timed_out: true`.
TIMEOUT_EXIT_CODE = 124
MAX_OUTPUT_TAIL_BYTES = 16384  # what the service accepts in one report


def register(sub: Any) -> None:
    p = sub.add_parser("runner", help="reference job runner: claims jobs and runs their commands")
    add_client_flags(p)
    p.add_argument("--once", action="store_true", help="exit when nothing is left to claim")
    p.add_argument(
        "--parallel",
        type=int,
        default=os.cpu_count() or 2,
        metavar="N",
        help="at most N commands at once, for jobs created with parallel=true",
    )
    p.add_argument(
        "--lease-seconds", type=int, default=60, help="the job fails if no report arrives for this long"
    )
    p.add_argument("--heartbeat-seconds", type=float, default=10.0)
    p.add_argument(
        "--cancel-poll-seconds",
        type=float,
        default=1.0,
        help="how often to look for a cancel request between reports",
    )
    p.add_argument(
        "--output-tail-bytes",
        type=_tail_bytes,
        default=4096,
        metavar="N",
        help=f"report the last N bytes of each command's output (stdout and stderr), 0-{MAX_OUTPUT_TAIL_BYTES}",
    )
    p.add_argument("--poll-seconds", type=float, default=1.0, help="wait between empty claims")
    p.add_argument("--project", action="append", dest="projects", help="claim only jobs of this project")
    p.set_defaults(func=cmd_runner)


def _tail_bytes(text: str) -> int:
    n = int(text)
    if not 0 <= n <= MAX_OUTPUT_TAIL_BYTES:
        raise argparse.ArgumentTypeError(f"must be 0-{MAX_OUTPUT_TAIL_BYTES}")
    return n


# A report is retried for a while on a broken connection or any 5xx (the old
# runner's schedule: 8 tries, 0.25 s doubling to 5 s); its Idempotency-Key makes
# a repeated report count once.
REPORT_RETRY = Retry(attempts=8, backoff=0.25, max_backoff=5.0, statuses=frozenset({500, 502, 503, 504}))


def _log(msg: str) -> None:
    print(f"[runner] {msg}", file=sys.stderr, flush=True)


class LeaseLost(Exception):
    """The service no longer lets us report on this job (it ended, or the lease moved)."""


class OutputTail:
    """The last `limit` bytes of a command's output, read as it comes and copied to our stderr."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.truncated = False

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]
            self.truncated = True

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(65536):
            self.feed(chunk)
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()

    def text(self) -> str:
        data = bytes(self.buf)
        if self.truncated:  # the cut may have split a UTF-8 character: drop its continuation bytes
            data = data.lstrip(bytes(range(0x80, 0xC0)))
        return data.decode(errors="replace")


class JobRun:
    """One claimed job: runs its commands, reports, heartbeats, obeys cancellation."""

    def __init__(self, runner: Runner, job: Job) -> None:
        self.runner = runner
        self.client = runner.client
        self.job_id = job.job_id
        self.lease_id = job.lease_id or ""
        self.commands: list[str] = [c.command for c in job.commands]
        self.parallel = job.parallel
        self.fail_fast = job.fail_fast
        timeout = job.command_timeout_seconds
        self.command_timeout: float | None = float(timeout) if timeout is not None else None
        self.stop = asyncio.Event()
        self.why: str | None = None  # "cancel", "lost", "interrupted"
        self.killed_exit: int | None = None

    def halt(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.stop.set()

    async def report(self, event: dict[str, Any]) -> Job | None:
        """Report; None when refused for a reason other than a lost job or lease.
        The client retries a broken connection and a 5xx (REPORT_RETRY)."""
        try:
            view = await self.client.report_job(self.job_id, JobReport(**event, lease_id=self.lease_id))
        except (NotFound, Conflict) as e:
            raise LeaseLost(str(e)) from e
        except TransportError as e:
            raise LeaseLost(f"the service did not answer ({e})") from e
        except TaskledgerError as e:
            if e.status >= 500:
                raise LeaseLost(f"the service did not answer ({e})") from e
            _log(f"report {event['event']} refused: {e}")
            return None
        if view.cancel_requested or view.state == "cancelling":
            self.halt("cancel")
        return view

    async def _keepalive(self) -> None:
        """Heartbeat every N seconds; between heartbeats, look for a cancel request."""
        next_beat = time.monotonic() + self.runner.heartbeat
        while not self.stop.is_set():
            await asyncio.sleep(min(self.runner.cancel_poll, max(0.05, next_beat - time.monotonic())))
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.runner.heartbeat
                    await self.report({"event": "heartbeat"})
                else:
                    view = await self.client.get_job(self.job_id)
                    if view.cancel_requested:
                        self.halt("cancel")
                    elif view.state in TERMINAL or view.lease_id != self.lease_id:
                        self.halt("lost")
            except LeaseLost:
                self.halt("lost")
            except TaskledgerError as e:
                _log(f"checking job {self.job_id} failed: {e!r}")

    async def _run_command(self, index: int) -> int | None:
        """Run one command; its exit code, or None when it was stopped."""
        cmd = self.commands[index]
        await self.report(
            {"event": "command_started", "command": cmd, "index": index, "total": len(self.commands)}
        )
        _log(f"$ {cmd}")
        t0 = time.monotonic()
        # Its own session, so a cancel can kill the whole process group (the shell
        # and whatever it started), not just the shell.
        proc = await asyncio.create_subprocess_shell(
            cmd,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=command_env(),
        )
        tail = OutputTail(self.runner.output_tail_bytes)
        reader = asyncio.ensure_future(tail.drain(proc.stdout))
        waiter = asyncio.ensure_future(proc.wait())
        stopper = asyncio.ensure_future(self.stop.wait())
        timed_out = False
        try:
            await asyncio.wait(
                {waiter, stopper}, timeout=self.command_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not waiter.done():
                timed_out = not self.stop.is_set()
                await _kill_group(proc, waiter)
                if not timed_out:
                    self.killed_exit = proc.returncode
                    _log(f"killed {cmd!r} ({self.why})")
                    return None
                _log(f"killed {cmd!r}: still running after {self.command_timeout:g}s")
        finally:
            stopper.cancel()
            if not waiter.done():  # we are being cancelled ourselves
                await _kill_group(proc, waiter)
            # A background child may hold the pipe open after the shell exited: read on briefly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader, 1.0)
        code = TIMEOUT_EXIT_CODE if timed_out else proc.returncode if proc.returncode is not None else -1
        duration = round(time.monotonic() - t0, 3)
        _log(f"exit {code} in {duration:.2f}s: {cmd}")
        completed: dict[str, Any] = {
            "event": "command_completed",
            "command": cmd,
            "index": index,
            "exit_code": code,
            "duration": duration,
        }
        if self.runner.output_tail_bytes:
            completed.update(output=tail.text(), output_truncated=tail.truncated)
        if timed_out:
            completed["timed_out"] = True
        await self.report(completed)
        return code

    async def run(self) -> None:
        keepalive = asyncio.create_task(self._keepalive())
        codes: dict[int, int] = {}
        try:
            await self.report({"event": "stage", "stage": "parallel" if self.parallel else "sequential"})
            if self.parallel:
                gate = asyncio.Semaphore(max(1, self.runner.parallel))

                async def one(i: int) -> None:
                    async with gate:
                        if self.stop.is_set():
                            return
                        try:
                            code = await self._run_command(i)
                        except LeaseLost:
                            self.halt("lost")  # stops the siblings too
                            raise
                        if code is not None:
                            codes[i] = code
                            if code != 0 and self.fail_fast:
                                self.halt("fail_fast")

                outcomes = await asyncio.gather(
                    *(one(i) for i in range(len(self.commands))), return_exceptions=True
                )
                for o in outcomes:
                    if isinstance(o, BaseException):
                        raise o
            else:
                for i in range(len(self.commands)):
                    if self.stop.is_set():
                        break
                    code = await self._run_command(i)
                    if code is None:
                        break
                    codes[i] = code
                    if code != 0 and self.fail_fast:
                        self.halt("fail_fast")
            if self.why == "fail_fast":
                for i, cmd in enumerate(self.commands):
                    if i not in codes:
                        await self.report(
                            {
                                "event": "command_skipped",
                                "command": cmd,
                                "index": i,
                                "reason": "an earlier command failed (fail_fast)",
                            }
                        )
            await self.report({"event": "stage", "stage": "completing"})
            await self._finish(codes)
        except LeaseLost as e:
            _log(f"job {self.job_id}: the service no longer accepts our reports ({e}); giving up on it")
        finally:
            self.stop.set()
            keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive

    async def _finish(self, codes: dict[int, int]) -> None:
        failed = [self.commands[i] for i, c in sorted(codes.items()) if c != 0]
        first_bad = next((c for _, c in sorted(codes.items()) if c != 0), None)
        if self.why == "cancel":
            await self.report({"event": "finish", "status": "cancelled", "exit_code": self.killed_exit})
            _log(f"job {self.job_id} cancelled")
            return
        if self.why == "lost":
            raise LeaseLost("the job ended or moved while it ran")
        if self.why == "interrupted":
            await self.report({"event": "error", "error": "the runner was interrupted"})
            await self.report(
                {
                    "event": "finish",
                    "status": "failed",
                    "exit_code": self.killed_exit,
                    "error": "the runner was interrupted",
                }
            )
            return
        status = "failed" if failed else "completed"
        await self.report(
            {
                "event": "finish",
                "status": status,
                "exit_code": first_bad or 0,
                "result": {"failed": failed} if failed else None,
            }
        )
        _log(f"job {self.job_id} {status}")


async def _kill_group(
    proc: asyncio.subprocess.Process, waiter: asyncio.Future[int], grace: float = 3.0
) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), grace)
            return
        except TimeoutError:
            continue


class Runner:
    def __init__(self, client: AsyncClient, args: argparse.Namespace) -> None:
        self.client = client
        self.once: bool = args.once
        self.parallel: int = args.parallel
        self.lease_seconds: int = args.lease_seconds
        self.heartbeat: float = args.heartbeat_seconds
        self.cancel_poll: float = args.cancel_poll_seconds
        self.poll: float = args.poll_seconds
        self.output_tail_bytes: int = args.output_tail_bytes
        self.projects: list[str] | None = args.projects
        self.interrupted = asyncio.Event()
        self.current: JobRun | None = None

    def interrupt(self) -> None:
        self.interrupted.set()
        if self.current is not None:
            self.current.halt("interrupted")

    async def claim(self) -> Job | None:
        try:
            # a poll: no Idempotency-Key, so an empty one leaves no answer behind
            return await self.client.claim_job(lease_seconds=self.lease_seconds, projects=self.projects,
                                               idempotent=False)
        except TransportError:
            raise
        except TaskledgerError as e:
            raise RuntimeError(f"claim refused: {e}") from e

    async def run(self) -> int:
        while not self.interrupted.is_set():
            try:
                job = await self.claim()
            except TransportError as e:
                _log(f"claim failed ({e!r}); retrying")
                job = None
                if self.once:
                    await asyncio.sleep(self.poll)
                    continue
            if job is None:
                if self.once:
                    return 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.interrupted.wait(), self.poll)
                continue
            _log(f"claimed job {job.job_id} ({job.total_commands} commands)")
            self.current = JobRun(self, job)
            try:
                await self.current.run()
            finally:
                self.current = None
        return 130


def cmd_runner(args: argparse.Namespace) -> int:
    if not args.token:
        raise SystemExit("a token is needed: --token or TASKLEDGER_TOKEN")

    async def main() -> int:
        async with async_client(args, retry=REPORT_RETRY) as client:
            runner = Runner(client, args)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, runner.interrupt)
            return await runner.run()

    return asyncio.run(main())
