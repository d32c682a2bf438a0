"""`taskledger job watch ID`: follow a job with a live progress bar, printing
its commands as they start and end, and exit with its outcome (0 completed,
1 failed, 3 cancelled; 2 when it cannot be read)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from taskledger.client import AsyncClient, Event, Job, TaskledgerError
from taskledger.service.cli.common import add_client_flags, async_client

TERMINAL = ("completed", "failed", "cancelled")


def _fmt_secs(x: float | None) -> str:
    if x is None:
        return "--:--"
    x = round(x)
    h, rem = divmod(x, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def describe(ev: Event) -> str | None:
    """One line for an event worth printing above the bar."""
    d = ev.data
    match ev.type:
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


async def follow(client: AsyncClient, job_id: str, on_event: Callable[[Event], None]) -> None:
    """Follow the job's events over SSE; by polling its events when the service
    has no stream for it (an older service)."""
    since = 0
    try:
        async for ev in client.follow_job(job_id):
            since = ev.stream_seq
            on_event(ev)
    except TaskledgerError:
        pass
    while True:
        with contextlib.suppress(TaskledgerError):
            for ev in (await client.job_events(job_id, since_seq=since)).events:
                since = max(since, ev.stream_seq)
                on_event(ev)
        await asyncio.sleep(0.5)


async def watch(client: AsyncClient, job_id: str) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

    console = Console()
    try:
        st = await client.get_job(job_id)
    except TaskledgerError as e:
        console.print(f"[red]{e.status or e.code}[/] {e.detail}")
        return 2
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

    def on_event(ev: Event) -> None:
        line = describe(ev)
        if line:
            progress.console.print(line)
        wake.set()

    def show(task: Any, s: Job) -> None:
        progress.update(
            task,
            total=s.total_commands,
            completed=s.completed_commands,
            state=s.state,
            stage=s.stage,
            elapsed=_fmt_secs(s.elapsed_sec),
            eta=_fmt_secs(s.eta_sec),
            cmd=s.current_command or "",
        )

    with progress:
        task = progress.add_task(
            job_id, total=st.total_commands, state="", stage="", elapsed="", eta="", cmd=""
        )
        follower = asyncio.create_task(follow(client, job_id, on_event))
        try:
            while True:
                show(task, st)
                if st.state in TERMINAL:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)
                wake.clear()
                with contextlib.suppress(TaskledgerError):
                    st = await client.get_job(job_id)
            await asyncio.sleep(0.6)  # let the last events print
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, TaskledgerError):
                await follower
    colour = {"completed": "green", "failed": "red", "cancelled": "yellow"}[st.state]
    result = st.result or {}
    console.print(
        f"[bold {colour}]job {job_id} {st.state}[/] after {st.elapsed_sec or 0:.2f}s: "
        f"{st.completed_commands}/{st.total_commands} commands, exit code {result.get('exit_code')}"
    )
    if result.get("failed_commands"):
        console.print("failed: " + ", ".join(result["failed_commands"]))
    if st.error:
        console.print(f"error: {st.error}")
    return {"completed": 0, "failed": 1, "cancelled": 3}[st.state]


def cmd_watch(args: argparse.Namespace) -> int:
    if not args.token:
        raise SystemExit("a token is needed: --token or TASKLEDGER_TOKEN")

    async def main() -> int:
        async with async_client(args) as client:
            return await watch(client, args.job_id)

    return asyncio.run(main())


def register(sub: Any) -> None:
    j = sub.add_parser("job", help="jobs")
    jsub = j.add_subparsers(dest="job_command", required=True)
    w = jsub.add_parser("watch", help="follow a job with a live progress bar")
    w.add_argument("job_id")
    add_client_flags(w)
    w.set_defaults(func=cmd_watch)
