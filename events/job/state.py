"""The job's folded state, `evolve`, and its status as of a moment.

States: ``pending → running → completed | failed | cancelled`` and
``running → cancelling → cancelled``. A job's events live on the stream
``job:{id}``; the view is ``fold(evolve, events)`` and nothing else, so a
rebuild or an ``as_of_seq`` read can recompute it from the log alone.

Time: decisions and the status take ``now`` as the database's timestamp (an
aware ``datetime``), as a task's decisions do. The facts that the status needs a
clock for (created, started, ended) carry their own ``at`` (epoch seconds of
that timestamp: the stored field's type never changes), so folding needs no
access to ``recorded_at``. What keeps changing
without a fact (the lease deadline a heartbeat pushes out) is not state: it is
kept beside the view, in ``job_leases``.

This module imports neither asyncpg nor Litestar.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Literal

import msgspec

from taskledger.events.job.events import (
    Actor,
    AnyJobEvent,
    JobCacheHit,
    JobCancelled,
    JobCancelRequested,
    JobCommandCompleted,
    JobCommandSkipped,
    JobCommandStarted,
    JobCompleted,
    JobCreated,
    JobErrorReported,
    JobFailed,
    JobHeartbeat,
    JobStageChanged,
    JobStarted,
    event_type,
)

STAGES: Final = (
    "init",
    "load_cache",
    "select_cmds",
    "running",
    "parallel",
    "sequential",
    "completing",
    "cleanup",
)
TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
ACTIVE: Final = frozenset({"running", "cancelling"})

JobStateName = Literal["pending", "running", "cancelling", "completed", "failed", "cancelled"]
CommandStateName = Literal["pending", "running", "succeeded", "failed", "cached", "skipped", "interrupted"]

# Commands that count as done for progress: they will not run (again) in this job.
_DONE: Final = frozenset({"succeeded", "failed", "cached", "skipped"})
_MAX_ERRORS_KEPT: Final = 20


class CommandRun(msgspec.Struct, frozen=True, kw_only=True):
    command: str
    state: CommandStateName = "pending"
    exit_code: int | None = None
    duration: float | None = None
    reason: str | None = None
    output: str | None = None
    output_truncated: bool = False
    timed_out: bool = False


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    project: str | None = None
    state: JobStateName = "pending"
    stage: str = "init"
    commands: tuple[CommandRun, ...] = ()
    parallel: bool = False
    fail_fast: bool = False
    labels: tuple[str, ...] = ()
    command_timeout_seconds: float | None = None
    created_by: Actor | None = None
    current_command: str | None = None
    completed_commands: int = 0
    failed_commands: int = 0
    cancel_requested: bool = False
    node: str | None = None
    worker: str | None = None
    token_id: str | None = None
    lease_id: str | None = None
    lease_seconds: int | None = None
    attempt: int = 0
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    result: Any = None
    error: str | None = None
    errors: tuple[str, ...] = ()
    # Position in the log: set by the projection from the envelope, not by evolve.
    version: int = 0
    seq: int = 0
    created_seq: int = 0

    @property
    def total_commands(self) -> int:
        return len(self.commands)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def _replace_command(commands: tuple[CommandRun, ...], index: int, run: CommandRun) -> tuple[CommandRun, ...]:
    return (*commands[:index], run, *commands[index + 1 :])


def _counts(commands: Iterable[CommandRun]) -> tuple[int, int]:
    done = failed = 0
    for c in commands:
        if c.state in _DONE:
            done += 1
        if c.state == "failed":
            failed += 1
    return done, failed


def _current(commands: Sequence[CommandRun], preferred: str | None) -> str | None:
    running = [c.command for c in commands if c.state == "running"]
    if preferred is not None and preferred in running:
        return preferred
    return running[-1] if running else None


def _with_commands(state: JobState, commands: tuple[CommandRun, ...], current: str | None) -> JobState:
    done, failed = _counts(commands)
    return msgspec.structs.replace(
        state,
        commands=commands,
        completed_commands=done,
        failed_commands=failed,
        current_command=_current(commands, current),
    )


def _summary(state: JobState, status: str, exit_code: int | None, output: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "status": status,
        "exit_code": exit_code,
        "completed_commands": state.completed_commands,
        "failed_commands": [c.command for c in state.commands if c.state == "failed"],
    }
    timed_out = [c.command for c in state.commands if c.timed_out]
    if timed_out:
        out["timed_out_commands"] = timed_out
    if output is not None:
        out["output"] = output
    return out


def _ended(
    state: JobState, status: JobStateName, at: float, exit_code: int | None, output: Any, **more: Any
) -> JobState:
    # A command still running when the job ends was stopped with it.
    commands = tuple(
        msgspec.structs.replace(c, state="interrupted") if c.state == "running" else c for c in state.commands
    )
    ended = msgspec.structs.replace(
        state,
        state=status,
        ended_at=at or None,
        exit_code=exit_code,
        commands=commands,
        current_command=None,
        **more,
    )
    return msgspec.structs.replace(ended, result=_summary(ended, status, exit_code, output))


def evolve(state: JobState | None, event: AnyJobEvent) -> JobState:
    """The state after `event`. Total: every stored event applies, never raises."""
    if state is None:
        match event:
            case JobCreated():
                return JobState(
                    job_id=event.job_id,
                    project=event.project,
                    commands=tuple(CommandRun(command=c) for c in event.commands),
                    parallel=event.parallel,
                    fail_fast=event.fail_fast,
                    labels=tuple(event.labels),
                    command_timeout_seconds=event.command_timeout_seconds,
                    created_by=event.created_by,
                    created_at=event.at,
                )
            case _:
                raise ValueError(f"a job stream must begin with job.created, not {event_type(event)}")
    match event:
        case JobCreated():
            return state
        case JobStarted():
            return msgspec.structs.replace(
                state,
                state="running",
                node=event.node,
                worker=event.worker,
                token_id=event.token_id,
                lease_id=event.lease_id,
                lease_seconds=event.lease_seconds,
                attempt=event.attempt,
                started_at=event.at if state.started_at is None else state.started_at,
            )
        case JobStageChanged():
            return msgspec.structs.replace(state, stage=event.stage)
        case JobCommandStarted():
            if not 0 <= event.index < len(state.commands):
                return state
            run = CommandRun(command=state.commands[event.index].command, state="running")
            return _with_commands(state, _replace_command(state.commands, event.index, run), event.command)
        case JobCommandCompleted():
            if not 0 <= event.index < len(state.commands):
                return state
            run = CommandRun(
                command=state.commands[event.index].command,
                state="succeeded" if event.exit_code == 0 and not event.timed_out else "failed",
                exit_code=event.exit_code,
                duration=event.duration,
                output=event.output,
                output_truncated=event.output_truncated,
                timed_out=event.timed_out,
            )
            return _with_commands(
                state, _replace_command(state.commands, event.index, run), state.current_command
            )
        case JobCacheHit():
            if not 0 <= event.index < len(state.commands):
                return state
            run = CommandRun(command=state.commands[event.index].command, state="cached", exit_code=0)
            return _with_commands(
                state, _replace_command(state.commands, event.index, run), state.current_command
            )
        case JobCommandSkipped():
            if not 0 <= event.index < len(state.commands):
                return state
            run = CommandRun(
                command=state.commands[event.index].command, state="skipped", reason=event.reason
            )
            return _with_commands(
                state, _replace_command(state.commands, event.index, run), state.current_command
            )
        case JobHeartbeat():
            return state
        case JobErrorReported():
            text = event.error if event.command is None else f"{event.command}: {event.error}"
            return msgspec.structs.replace(
                state,
                error=text,
                errors=(*state.errors, text)[-_MAX_ERRORS_KEPT:],
            )
        case JobCancelRequested():
            if state.state == "pending":
                return msgspec.structs.replace(state, cancel_requested=True)
            return msgspec.structs.replace(state, state="cancelling", cancel_requested=True)
        case JobCancelled():
            out = _ended(state, "cancelled", event.at, event.exit_code, event.result, cancel_requested=True)
            if event.reason is not None:
                out = msgspec.structs.replace(out, error=event.reason)
            return out
        case JobCompleted():
            return _ended(state, "completed", event.at, event.exit_code, event.result)
        case JobFailed():
            out = _ended(state, "failed", event.at, event.exit_code, event.result)
            if event.error is not None:
                out = msgspec.structs.replace(
                    out,
                    error=event.error,
                    errors=(*out.errors, event.error)[-_MAX_ERRORS_KEPT:],
                )
            return out
    raise AssertionError(f"unhandled job event {event!r}")  # pragma: no cover


def fold(events: Iterable[AnyJobEvent], state: JobState | None = None) -> JobState | None:
    for e in events:
        state = evolve(state, e)
    return state


# --------------------------------------------------------------------------- status


def rounded(x: float, nd: int = 2) -> float:
    return round(x + 0.0, nd)


def epoch(now: datetime) -> float:
    """`now` (the database's timestamp) as the epoch seconds the facts record."""
    return now.timestamp()


def elapsed(state: JobState, now: datetime) -> float:
    """Seconds the job has been running (claim to end, or to now); 0 before it starts."""
    if state.started_at is None:
        return 0.0
    end = state.ended_at if state.ended_at is not None else epoch(now)
    return max(0.0, end - state.started_at)


def progress(state: JobState) -> float:
    if not state.commands:
        return 0.0
    return rounded(state.completed_commands / len(state.commands) * 100)


def eta(state: JobState, now: datetime) -> float | None:
    """elapsed / completed x remaining; null before the first command completes.

    A finished job has nothing left to wait for: 0.
    """
    if state.terminal:
        return 0.0
    if state.completed_commands == 0:
        return None
    remaining = len(state.commands) - state.completed_commands
    return rounded(elapsed(state, now) / state.completed_commands * remaining)


def iso(ts: float | None) -> str | None:
    if ts is None or ts == 0:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def status(state: JobState, now: datetime) -> dict[str, Any]:
    """The contract's status (§4) and the rest of the view, as of `now`."""
    return {
        "job_id": state.job_id,
        "state": state.state,
        "stage": state.stage,
        "progress": progress(state),
        "elapsed_sec": rounded(elapsed(state, now)),
        "eta_sec": eta(state, now),
        "current_command": state.current_command,
        "total_commands": len(state.commands),
        "completed_commands": state.completed_commands,
        "failed_commands": state.failed_commands,
        "result": state.result,
        "cancel_requested": state.cancel_requested,
        "project": state.project,
        "parallel": state.parallel,
        "fail_fast": state.fail_fast,
        "labels": list(state.labels),
        "command_timeout_seconds": state.command_timeout_seconds,
        "created_by": msgspec.to_builtins(state.created_by),
        "commands": [msgspec.to_builtins(c) for c in state.commands],
        "node": state.node,
        "worker": state.worker,
        "lease_id": state.lease_id,
        "attempt": state.attempt,
        "error": state.error,
        "errors": list(state.errors),
        "exit_code": state.exit_code,
        "created_at": iso(state.created_at),
        "started_at": iso(state.started_at),
        "ended_at": iso(state.ended_at),
        "version": state.version,
        "seq": state.seq,
    }


