"""The job's decisions: `decide_*(state, command, now)` returns the events to append."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from events.errors import InvalidTransition, JobAlreadyCancelled, LeaseMismatch, ValidationFailed
from events.job.events import (
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
)
from events.job.state import ACTIVE, STAGES, JobState, elapsed, eta, rounded
from events.lease import Holder

FinishStatus = Literal["completed", "failed", "cancelled"]



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
            return [JobHeartbeat(elapsed_sec=rounded(elapsed(state, now)), eta_sec=eta(state, now))]
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
