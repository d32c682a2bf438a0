"""The job aggregate: events, state, and the pure rules of its lifecycle.

States: ``pending → running → completed | failed | cancelled`` and
``running → cancelling → cancelled``. A job's events live on the stream
``job:{id}``; the view is ``fold(evolve, events)`` and nothing else, so a
rebuild or an ``as_of_seq`` read can recompute it from the log alone.

Time: the facts that the status needs a clock for (created, started, ended)
carry their own ``at`` (epoch seconds, the writer's clock when the command was
decided), so folding needs no access to ``recorded_at``. What keeps changing
without a fact (the lease deadline a heartbeat pushes out) is not state: it is
kept beside the view, in ``job_leases``.

This module imports neither asyncpg nor Litestar.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Literal

import msgspec

from events.errors import (
    InvalidTransition,
    JobAlreadyCancelled,
    LeaseMismatch,
    ValidationFailed,
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
FinishStatus = Literal["completed", "failed", "cancelled"]

# Commands that count as done for progress: they will not run (again) in this job.
_DONE: Final = frozenset({"succeeded", "failed", "cached", "skipped"})
_MAX_ERRORS_KEPT: Final = 20


# --------------------------------------------------------------------------- events


class JobEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of the job's facts. Tags are the stored `type`: never change one."""


class JobCreated(JobEvent, tag="job.created", frozen=True, kw_only=True):
    job_id: str
    commands: list[str]
    project: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []
    at: float = 0.0


class JobStarted(JobEvent, tag="job.started", frozen=True, kw_only=True):
    """A runner claimed the job: the claim is the start."""

    node: str | None = None
    worker: str
    lease_id: str
    lease_seconds: int
    attempt: int = 1
    at: float = 0.0


class JobStageChanged(JobEvent, tag="job.stage", frozen=True, kw_only=True):
    stage: str


class JobCommandStarted(JobEvent, tag="job.command_started", frozen=True, kw_only=True):
    command: str
    index: int
    total: int


class JobCommandCompleted(JobEvent, tag="job.command_completed", frozen=True, kw_only=True):
    command: str
    exit_code: int
    duration: float
    index: int


class JobCacheHit(JobEvent, tag="job.cache_hit", frozen=True, kw_only=True):
    command: str
    index: int


class JobCommandSkipped(JobEvent, tag="job.command_skipped", frozen=True, kw_only=True):
    command: str
    index: int
    reason: str | None = None


class JobHeartbeat(JobEvent, tag="job.heartbeat", frozen=True, kw_only=True):
    elapsed_sec: float | None = None
    eta_sec: float | None = None


class JobErrorReported(JobEvent, tag="job.error", frozen=True, kw_only=True):
    error: str
    command: str | None = None


class JobCancelRequested(JobEvent, tag="job.cancel_requested", frozen=True, kw_only=True):
    reason: str | None = None
    at: float = 0.0


class JobCancelled(JobEvent, tag="job.cancelled", frozen=True, kw_only=True):
    reason: str | None = None
    exit_code: int | None = None
    # What the runner said when it finished after a cancel was requested.
    runner_status: str | None = None
    result: Any = None
    at: float = 0.0


class JobCompleted(JobEvent, tag="job.completed", frozen=True, kw_only=True):
    exit_code: int = 0
    result: Any = None
    at: float = 0.0


class JobFailed(JobEvent, tag="job.failed", frozen=True, kw_only=True):
    exit_code: int | None = None
    error: str | None = None
    # "runner" when the runner reported it, "heartbeat_timeout" when the service did.
    reason: str = "runner"
    result: Any = None
    at: float = 0.0


AnyJobEvent = (
    JobCreated
    | JobStarted
    | JobStageChanged
    | JobCommandStarted
    | JobCommandCompleted
    | JobCacheHit
    | JobCommandSkipped
    | JobHeartbeat
    | JobErrorReported
    | JobCancelRequested
    | JobCancelled
    | JobCompleted
    | JobFailed
)

EVENT_TYPES: Final = tuple(c.__struct_config__.tag for c in AnyJobEvent.__args__)

_decoder: Final = msgspec.json.Decoder(AnyJobEvent)
_encoder: Final = msgspec.json.Encoder()


def decode(type_: str, data: bytes | str) -> AnyJobEvent:
    """Decode a stored payload (the `data` JSON object) of event `type_`.

    The stored `data` has no `type` key (the table has a column for it), so the
    tag is spliced in front of the object's members before the one decoder runs.
    """
    raw = data.encode() if isinstance(data, str) else data
    body = raw.strip()
    if not body.startswith(b"{"):
        raise ValidationFailed(f"{type_}: payload is not an object")
    rest = body[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    event: AnyJobEvent = _decoder.decode(b'{"type":' + _encoder.encode(type_) + sep + rest)
    return event


def payload(event: JobEvent) -> dict[str, Any]:
    """The event as stored in `data`: its fields, without the tag."""
    out = msgspec.to_builtins(event)
    out.pop("type", None)
    return out  # type: ignore[no-any-return]


def event_type(event: JobEvent) -> str:
    return str(event.__struct_config__.tag)


# --------------------------------------------------------------------------- state


class CommandRun(msgspec.Struct, frozen=True, kw_only=True):
    command: str
    state: CommandStateName = "pending"
    exit_code: int | None = None
    duration: float | None = None
    reason: str | None = None


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    project: str | None = None
    state: JobStateName = "pending"
    stage: str = "init"
    commands: tuple[CommandRun, ...] = ()
    parallel: bool = False
    fail_fast: bool = False
    labels: tuple[str, ...] = ()
    current_command: str | None = None
    completed_commands: int = 0
    failed_commands: int = 0
    cancel_requested: bool = False
    node: str | None = None
    worker: str | None = None
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
                state="succeeded" if event.exit_code == 0 else "failed",
                exit_code=event.exit_code,
                duration=event.duration,
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


def _round(x: float, nd: int = 2) -> float:
    return round(x + 0.0, nd)


def elapsed(state: JobState, now: float) -> float:
    """Seconds the job has been running (claim to end, or to now); 0 before it starts."""
    if state.started_at is None:
        return 0.0
    end = state.ended_at if state.ended_at is not None else now
    return max(0.0, end - state.started_at)


def progress(state: JobState) -> float:
    if not state.commands:
        return 0.0
    return _round(state.completed_commands / len(state.commands) * 100)


def eta(state: JobState, now: float) -> float | None:
    """elapsed / completed x remaining; null before the first command completes.

    A finished job has nothing left to wait for: 0.
    """
    if state.terminal:
        return 0.0
    if state.completed_commands == 0:
        return None
    remaining = len(state.commands) - state.completed_commands
    return _round(elapsed(state, now) / state.completed_commands * remaining)


def iso(ts: float | None) -> str | None:
    if ts is None or ts == 0:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def status(state: JobState, now: float) -> dict[str, Any]:
    """The contract's status (§4) and the rest of the view, as of `now`."""
    return {
        "job_id": state.job_id,
        "state": state.state,
        "stage": state.stage,
        "progress": progress(state),
        "elapsed_sec": _round(elapsed(state, now)),
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


# --------------------------------------------------------------------------- decisions


class CreateJob(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    commands: list[str]
    project: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    node: str | None
    worker: str
    lease_id: str
    lease_seconds: int


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """Who sends a report: the token's node and name, and the lease id if given."""

    node: str | None
    worker: str
    lease_id: str | None = None


ReportEvent = Literal[
    "stage",
    "command_started",
    "command_completed",
    "cache_hit",
    "command_skipped",
    "heartbeat",
    "error",
    "finish",
]


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """One runner report, already shape-checked at the edge."""

    event: ReportEvent
    stage: str | None = None
    command: str | None = None
    index: int | None = None
    total: int | None = None
    exit_code: int | None = None
    duration: float | None = None
    reason: str | None = None
    error: str | None = None
    status: FinishStatus | None = None
    result: Any = None


def decide_create(cmd: CreateJob, now: float) -> list[AnyJobEvent]:
    if not cmd.commands:
        raise ValidationFailed("commands: at least one command is needed")
    for c in cmd.commands:
        if not c.strip():
            raise ValidationFailed("commands: a command may not be blank")
    return [
        JobCreated(
            job_id=cmd.job_id,
            commands=list(cmd.commands),
            project=cmd.project,
            parallel=cmd.parallel,
            fail_fast=cmd.fail_fast,
            labels=list(cmd.labels),
            at=now,
        )
    ]


def decide_claim(state: JobState, claim: Claim, now: float) -> list[AnyJobEvent]:
    if state.state != "pending":
        raise InvalidTransition(f"job {state.job_id} is {state.state}, not pending", job_id=state.job_id)
    return [
        JobStarted(
            node=claim.node,
            worker=claim.worker,
            lease_id=claim.lease_id,
            lease_seconds=claim.lease_seconds,
            attempt=state.attempt + 1,
            at=now,
        )
    ]


def decide_cancel(state: JobState, now: float, reason: str | None = None) -> list[AnyJobEvent]:
    """pending → cancelled; running → cancelling; cancelling: nothing new;
    cancelled → 409 job_already_cancelled; completed or failed: nothing (the
    caller answers with the final status)."""
    match state.state:
        case "pending":
            return [JobCancelled(reason=reason or "cancelled before it started", at=now)]
        case "running":
            return [JobCancelRequested(reason=reason, at=now)]
        case "cancelled":
            raise JobAlreadyCancelled(f"job {state.job_id} is already cancelled", job_id=state.job_id)
        case _:
            return []


def _check_holder(state: JobState, who: Holder) -> None:
    if state.state not in ACTIVE:
        if state.state == "pending":
            raise InvalidTransition(f"job {state.job_id} has not been claimed", job_id=state.job_id)
        raise InvalidTransition(
            f"job {state.job_id} is already {state.state}", job_id=state.job_id, state=state.state
        )
    if who.lease_id is not None and who.lease_id != state.lease_id:
        raise LeaseMismatch(f"lease {who.lease_id} does not hold job {state.job_id}", job_id=state.job_id)
    if who.node != state.node or who.worker != state.worker:
        raise LeaseMismatch(
            f"job {state.job_id} is leased to {state.worker} on node {state.node}",
            job_id=state.job_id,
        )


def _resolve_index(state: JobState, r: Report, allowed: frozenset[str]) -> int:
    """The command a report is about: by index (which must name that command) or
    the first command of that text whose state allows the report."""
    if r.command is None:
        raise ValidationFailed(f"{r.event}: command is required")
    if r.total is not None and r.total != len(state.commands):
        raise ValidationFailed(
            f"{r.event}: total is {r.total}, but the job has {len(state.commands)} commands"
        )
    if r.index is not None:
        if not 0 <= r.index < len(state.commands):
            raise ValidationFailed(f"{r.event}: index {r.index} is out of range 0..{len(state.commands) - 1}")
        if state.commands[r.index].command != r.command:
            raise ValidationFailed(f"{r.event}: command {r.index} is not {r.command!r}")
        i = r.index
    else:
        candidates = [i for i, c in enumerate(state.commands) if c.command == r.command]
        if not candidates:
            raise ValidationFailed(f"{r.event}: {r.command!r} is not one of the job's commands")
        fit = [i for i in candidates if state.commands[i].state in allowed]
        i = fit[0] if fit else candidates[0]
    current = state.commands[i].state
    if current not in allowed:
        raise InvalidTransition(
            f"{r.event}: command {i} ({r.command!r}) is {current}",
            job_id=state.job_id,
            index=i,
        )
    return i


def decide_report(state: JobState, who: Holder, r: Report, now: float) -> list[AnyJobEvent]:
    _check_holder(state, who)
    match r.event:
        case "stage":
            if r.stage not in STAGES:
                raise ValidationFailed(f"stage must be one of {', '.join(STAGES)}")
            return [] if r.stage == state.stage else [JobStageChanged(stage=r.stage)]
        case "command_started":
            i = _resolve_index(state, r, frozenset({"pending"}))
            return [JobCommandStarted(command=state.commands[i].command, index=i, total=len(state.commands))]
        case "command_completed":
            if r.exit_code is None:
                raise ValidationFailed("command_completed: exit_code is required")
            if r.duration is None:
                raise ValidationFailed("command_completed: duration is required")
            # A runner that never said it started the command may still report its end.
            i = _resolve_index(state, r, frozenset({"running", "pending"}))
            return [
                JobCommandCompleted(
                    command=state.commands[i].command, exit_code=r.exit_code, duration=r.duration, index=i
                )
            ]
        case "cache_hit":
            i = _resolve_index(state, r, frozenset({"pending", "running"}))
            return [JobCacheHit(command=state.commands[i].command, index=i)]
        case "command_skipped":
            i = _resolve_index(state, r, frozenset({"pending", "running"}))
            return [JobCommandSkipped(command=state.commands[i].command, index=i, reason=r.reason)]
        case "heartbeat":
            return [JobHeartbeat(elapsed_sec=_round(elapsed(state, now)), eta_sec=eta(state, now))]
        case "error":
            if not r.error:
                raise ValidationFailed("error: error (the message) is required")
            return [JobErrorReported(error=r.error, command=r.command)]
        case "finish":
            return decide_finish(state, r, now)
    raise ValidationFailed(f"unknown report {r.event!r}")  # pragma: no cover


def decide_finish(state: JobState, r: Report, now: float) -> list[AnyJobEvent]:
    if r.status is None:
        raise ValidationFailed("finish: status is required (completed, failed or cancelled)")
    if state.state == "cancelling":
        # running → cancelling → cancelled: once a cancel was asked for, the job
        # ends cancelled whatever the runner managed (a cancel that arrives
        # while the job is completing lets it finish gracefully); what the
        # runner reported is kept on the event.
        return [
            JobCancelled(
                reason="cancel requested",
                exit_code=r.exit_code,
                runner_status=r.status,
                result=r.result,
                at=now,
            )
        ]
    match r.status:
        case "completed":
            return [
                JobCompleted(exit_code=0 if r.exit_code is None else r.exit_code, result=r.result, at=now)
            ]
        case "failed":
            return [JobFailed(exit_code=r.exit_code, error=r.error, reason="runner", result=r.result, at=now)]
        case "cancelled":
            return [
                JobCancelled(
                    reason=r.error or "cancelled by the runner",
                    exit_code=r.exit_code,
                    runner_status="cancelled",
                    result=r.result,
                    at=now,
                )
            ]
    raise ValidationFailed(f"finish: unknown status {r.status!r}")  # pragma: no cover


def decide_lease_expired(state: JobState, now: float, deadline: float) -> list[AnyJobEvent]:
    """The runner stopped heartbeating: the job fails (a cancelling job ends cancelled).

    Not re-queued: a runner that went silent may still be running the
    commands (a partition, a stopped clock), and they are not known to be safe
    to run twice. See docs/JOBS.md.
    """
    if state.state not in ACTIVE:
        return []
    silent = max(0.0, now - deadline) + (state.lease_seconds or 0)
    msg = (
        f"runner {state.worker} on node {state.node} stopped heartbeating: "
        f"no report for {silent:.0f} s (lease of {state.lease_seconds} s expired)"
    )
    if state.state == "cancelling":
        return [JobCancelled(reason=msg, at=now)]
    return [JobFailed(error=msg, reason="heartbeat_timeout", at=now)]
