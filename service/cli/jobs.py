"""`taskledger runner` (the reference job runner) and `taskledger job watch ID`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from taskledger.service.cli.main import command_env

TERMINAL = ("completed", "failed", "cancelled")
# The exit code reported for a command killed after the job's command_timeout_seconds
# (the one GNU `timeout` uses), with `timed_out: true`.
TIMEOUT_EXIT_CODE = 124
MAX_OUTPUT_TAIL_BYTES = 16384  # what the service accepts in one report


def register(sub: Any) -> None:
    from taskledger.service.cli.main import add_client_flags

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

    j = sub.add_parser("job", help="jobs")
    jsub = j.add_subparsers(dest="job_command", required=True)
    w = jsub.add_parser("watch", help="follow a job with a live progress bar")
    w.add_argument("job_id")
    add_client_flags(w)
    w.set_defaults(func=cmd_watch)


def _tail_bytes(text: str) -> int:
    n = int(text)
    if not 0 <= n <= MAX_OUTPUT_TAIL_BYTES:
        raise argparse.ArgumentTypeError(f"must be 0-{MAX_OUTPUT_TAIL_BYTES}")
    return n


def _client(args: argparse.Namespace, timeout: float = 30.0) -> httpx.AsyncClient:
    if not args.token:
        raise SystemExit("a token is needed: --token or TASKLEDGER_TOKEN")
    return httpx.AsyncClient(
        base_url=args.url.rstrip("/"), timeout=timeout, headers={"Authorization": f"Bearer {args.token}"}
    )


def _log(msg: str) -> None:
    print(f"[runner] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- runner


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

    def __init__(self, runner: Runner, job: dict[str, Any]) -> None:
        self.runner = runner
        self.http = runner.http
        self.job_id: str = job["job_id"]
        self.lease_id: str = job["lease_id"]
        self.commands: list[str] = [c["command"] for c in job["commands"]]
        self.parallel: bool = bool(job.get("parallel"))
        self.fail_fast: bool = bool(job.get("fail_fast"))
        timeout = job.get("command_timeout_seconds")
        self.command_timeout: float | None = float(timeout) if timeout is not None else None
        self.stop = asyncio.Event()
        self.why: str | None = None  # "cancel", "lost", "interrupted"
        self.killed_exit: int | None = None

    def halt(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.stop.set()

    async def report(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """POST a report, retrying transport errors and 5xx for a while."""
        body = {**event, "lease_id": self.lease_id}
        delay = 0.25
        for attempt in range(8):
            try:
                r = await self.http.post(f"/jobs/{self.job_id}/report", json=body)
            except httpx.HTTPError as e:
                _log(f"report {event['event']} failed ({e!r}); retrying")
            else:
                if r.status_code == 200:
                    view: dict[str, Any] = r.json()
                    if view.get("cancel_requested") or view.get("state") == "cancelling":
                        self.halt("cancel")
                    return view
                if r.status_code in (404, 409):
                    raise LeaseLost(r.text)
                if r.status_code < 500:
                    _log(f"report {event['event']} refused: {r.status_code} {r.text[:300]}")
                    return None
                _log(f"report {event['event']} got {r.status_code}; retrying")
            if attempt < 7:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise LeaseLost("the service did not answer")

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
                    r = await self.http.get(f"/jobs/{self.job_id}")
                    if r.status_code == 200:
                        view = r.json()
                        if view.get("cancel_requested"):
                            self.halt("cancel")
                        elif view.get("state") in TERMINAL or view.get("lease_id") != self.lease_id:
                            self.halt("lost")
            except LeaseLost:
                self.halt("lost")
            except httpx.HTTPError as e:
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
    def __init__(self, http: httpx.AsyncClient, args: argparse.Namespace) -> None:
        self.http = http
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

    async def claim(self) -> dict[str, Any] | None:
        body: dict[str, Any] = {"lease_seconds": self.lease_seconds}
        if self.projects:
            body["projects"] = self.projects
        r = await self.http.post("/jobs/claim", json=body)
        if r.status_code == 204:
            return None
        if r.status_code != 200:
            raise RuntimeError(f"claim refused: {r.status_code} {r.text[:300]}")
        job: dict[str, Any] = r.json()
        return job

    async def run(self) -> int:
        while not self.interrupted.is_set():
            try:
                job = await self.claim()
            except httpx.HTTPError as e:
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
            _log(f"claimed job {job['job_id']} ({job['total_commands']} commands)")
            self.current = JobRun(self, job)
            try:
                await self.current.run()
            finally:
                self.current = None
        return 130


def cmd_runner(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with _client(args) as http:
            runner = Runner(http, args)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, runner.interrupt)
            return await runner.run()

    return asyncio.run(main())


# ----------------------------------------------------------------------------- watch


def _fmt_secs(x: float | None) -> str:
    if x is None:
        return "--:--"
    x = round(x)
    h, rem = divmod(x, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def describe(ev: dict[str, Any]) -> str | None:
    """One line for an event worth printing above the bar."""
    d = ev.get("data") or {}
    t = ev.get("type", "")
    match t:
        case "job.started":
            return f"claimed by {d.get('worker')} on {d.get('node')}"
        case "job.stage":
            return f"stage: {d.get('stage')}"
        case "job.command_started":
            return f"[cyan]>[/] {d.get('command')}"
        case "job.command_completed":
            ok = d.get("exit_code") == 0
            mark = "[green]ok[/]" if ok else f"[red]exit {d.get('exit_code')}[/]"
            return f"{mark} {d.get('command')} ({float(d.get('duration') or 0):.2f}s)"
        case "job.cache_hit":
            return f"[green]cached[/] {d.get('command')}"
        case "job.command_skipped":
            return f"[yellow]skipped[/] {d.get('command')}: {d.get('reason') or ''}"
        case "job.error":
            return f"[red]error[/] {d.get('error')}"
        case "job.cancel_requested":
            return "[yellow]cancel requested[/]"
        case "job.completed" | "job.failed" | "job.cancelled":
            return None
    return None


class _NoStream(Exception):
    pass


async def follow(http: httpx.AsyncClient, job_id: str, on_event: Callable[[dict[str, Any]], None]) -> None:
    """Follow the job's events: over SSE, or by polling when the stream endpoint is absent."""
    from httpx_sse import aconnect_sse

    since = 0
    failures = 0
    while failures < 5:
        try:
            async with aconnect_sse(
                http,
                "GET",
                f"/jobs/{job_id}/stream",
                params={"since_seq": since},
                timeout=httpx.Timeout(30.0, read=60.0),
            ) as es:
                if es.response.status_code in (404, 405):
                    raise _NoStream
                if es.response.status_code != 200:
                    raise httpx.HTTPStatusError(
                        "stream refused", request=es.response.request, response=es.response
                    )
                failures = 0
                async for sse in es.aiter_sse():
                    if not sse.data:
                        continue
                    ev = json.loads(sse.data)
                    since = max(since, int(ev.get("stream_seq") or 0))
                    on_event(ev)
        except _NoStream:
            break
        except (httpx.HTTPError, ValueError):
            failures += 1
            await asyncio.sleep(min(2.0, 0.2 * 2**failures))
    while True:
        r = await http.get(f"/jobs/{job_id}/events", params={"since_seq": since})
        if r.status_code == 200:
            for ev in r.json()["events"]:
                since = max(since, int(ev["stream_seq"]))
                on_event(ev)
        await asyncio.sleep(0.5)


async def watch(http: httpx.AsyncClient, job_id: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

    console = Console()
    r = await http.get(f"/jobs/{job_id}")
    if r.status_code != 200:
        console.print(f"[red]{r.status_code}[/] {r.json().get('detail', r.text) if r.content else ''}")
        return 2
    st: dict[str, Any] = r.json()
    wake = asyncio.Event()
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[state]}[/] {task.fields[stage]}"),
        BarColumn(),
        TextColumn("{task.percentage:>6.2f}%"),
        MofNCompleteColumn(),
        TextColumn("elapsed {task.fields[elapsed]}  ETA {task.fields[eta]}"),
        TextColumn("[dim]{task.fields[cmd]}"),
        console=console,
    )

    def on_event(ev: dict[str, Any]) -> None:
        line = describe(ev)
        if line:
            progress.console.print(line)
        wake.set()

    def show(task: Any, s: dict[str, Any]) -> None:
        progress.update(
            task,
            total=s["total_commands"],
            completed=s["completed_commands"],
            state=s["state"],
            stage=s["stage"],
            elapsed=_fmt_secs(s["elapsed_sec"]),
            eta=_fmt_secs(s["eta_sec"]),
            cmd=s.get("current_command") or "",
        )

    with progress:
        task = progress.add_task(
            job_id, total=st["total_commands"], state="", stage="", elapsed="", eta="", cmd=""
        )
        follower = asyncio.create_task(follow(http, job_id, on_event))
        try:
            while True:
                show(task, st)
                if st["state"] in TERMINAL:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)
                wake.clear()
                r = await http.get(f"/jobs/{job_id}")
                if r.status_code == 200:
                    st = r.json()
            await asyncio.sleep(0.6)  # let the last events print
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await follower
    colour = {"completed": "green", "failed": "red", "cancelled": "yellow"}[st["state"]]
    result = st.get("result") or {}
    console.print(
        f"[bold {colour}]job {job_id} {st['state']}[/] after {st['elapsed_sec']:.2f}s: "
        f"{st['completed_commands']}/{st['total_commands']} commands, exit code {result.get('exit_code')}"
    )
    if result.get("failed_commands"):
        console.print("failed: " + ", ".join(result["failed_commands"]))
    if st.get("error"):
        console.print(f"error: {st['error']}")
    return {"completed": 0, "failed": 1, "cancelled": 3}[st["state"]]


def cmd_watch(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with _client(args) as http:
            return await watch(http, args.job_id)

    return asyncio.run(main())
