"""The job's decisions: `decide_*(state, command, now)` returns the events to append.

`now` is the database's timestamp for the batch (an aware `datetime`), as for
tasks; the facts record it as epoch seconds (`at`), as they always have.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import msgspec

from taskledger.events.errors import InvalidTransition, JobAlreadyCancelled, ValidationFailed
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
)
from taskledger.events.job.state import ACTIVE, STAGES, JobState, elapsed, epoch, eta, rounded
from taskledger.events.lease import Holder, Lease, check_holder

FinishStatus = Literal["completed", "failed", "cancelled"]


class CreateJob(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    commands: list[str]
    project: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []
    command_timeout_seconds: float | None = None
    created_by: Actor | None = None


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    holder: Holder  # the claiming token, with the new lease id
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
    output: str | None = None
    output_truncated: bool = False
    timed_out: bool = False


def decide_create(cmd: CreateJob, now: datetime) -> list[AnyJobEvent]:
    if not cmd.commands:
        raise ValidationFailed("commands: at least one command is needed")
    for c in cmd.commands:
        if not c.strip():
            raise ValidationFailed("commands: a command may not be blank")
    if cmd.command_timeout_seconds is not None and not cmd.command_timeout_seconds > 0:
        raise ValidationFailed("command_timeout_seconds: must be more than 0")
    return [
        JobCreated(
            job_id=cmd.job_id,
            commands=list(cmd.commands),
            project=cmd.project,
            parallel=cmd.parallel,
            fail_fast=cmd.fail_fast,
            labels=list(cmd.labels),
            at=epoch(now),
            command_timeout_seconds=cmd.command_timeout_seconds,
            created_by=cmd.created_by,
        )
    ]


def decide_claim(state: JobState, claim: Claim, now: datetime) -> list[AnyJobEvent]:
    if state.state != "pending":
        raise InvalidTransition(f"job {state.job_id} is {state.state}, not pending", job_id=state.job_id)
    if claim.holder.lease_id is None:
        raise InvalidTransition(f"job {state.job_id} cannot be claimed without a lease id", job_id=state.job_id)
    return [
        JobStarted(
            node=claim.holder.node,
            worker=claim.holder.worker,
            token_id=claim.holder.token_id,
            lease_id=claim.holder.lease_id,
            lease_seconds=claim.lease_seconds,
            attempt=state.attempt + 1,
            at=epoch(now),
        )
    ]


def decide_cancel(state: JobState, now: datetime, reason: str | None = None) -> list[AnyJobEvent]:
    """pending → cancelled; running → cancelling; cancelling: nothing new;
    cancelled → 409 job_already_cancelled; completed or failed: nothing (the
    caller answers with the final status)."""
    match state.state:
        case "pending":
            return [JobCancelled(reason=reason or "cancelled before it started", at=epoch(now))]
        case "running":
            return [JobCancelRequested(reason=reason, at=epoch(now))]
        case "cancelled":
            raise JobAlreadyCancelled(f"job {state.job_id} is already cancelled", job_id=state.job_id)
        case _:
            return []


def lease_of(state: JobState) -> Lease:
    return Lease(lease_id=state.lease_id, worker=state.worker, node=state.node, token_id=state.token_id)


def check_lease(state: JobState, who: Holder) -> None:
    """Only the token that claimed the job, on its node, may report on it.

    Unlike a task's, the job's state is checked first (a report on a job that
    is not running is `invalid_transition` whoever sends it). A report may omit
    the lease id, as runners could from the start: the token and node then hold
    the lease alone; a lease id that is sent must be the lease's.
    """
    if state.state not in ACTIVE:
        if state.state == "pending":
            raise InvalidTransition(f"job {state.job_id} has not been claimed", job_id=state.job_id)
        raise InvalidTransition(
            f"job {state.job_id} is already {state.state}", job_id=state.job_id, state=state.state
        )
    if who.lease_id is None:
        who = msgspec.structs.replace(who, lease_id=state.lease_id)
    check_holder(lease_of(state), who, what=f"job {state.job_id}", job_id=state.job_id)


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


def decide_report(state: JobState, who: Holder, r: Report, now: datetime) -> list[AnyJobEvent]:
    check_lease(state, who)
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
            if r.timed_out and r.exit_code == 0:
                raise ValidationFailed("command_completed: a command that timed out cannot exit 0")
            # A runner that never said it started the command may still report its end.
            i = _resolve_index(state, r, frozenset({"running", "pending"}))
            return [
                JobCommandCompleted(
                    command=state.commands[i].command,
                    exit_code=r.exit_code,
                    duration=r.duration,
                    index=i,
                    output=r.output,
                    output_truncated=r.output_truncated,
                    timed_out=r.timed_out,
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


def decide_finish(state: JobState, r: Report, now: datetime) -> list[AnyJobEvent]:
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
                at=epoch(now),
            )
        ]
    match r.status:
        case "completed":
            return [
                JobCompleted(exit_code=0 if r.exit_code is None else r.exit_code, result=r.result, at=epoch(now))
            ]
        case "failed":
            return [
                JobFailed(exit_code=r.exit_code, error=r.error, reason="runner", result=r.result, at=epoch(now))
            ]
        case "cancelled":
            return [
                JobCancelled(
                    reason=r.error or "cancelled by the runner",
                    exit_code=r.exit_code,
                    runner_status="cancelled",
                    result=r.result,
                    at=epoch(now),
                )
            ]
    raise ValidationFailed(f"finish: unknown status {r.status!r}")  # pragma: no cover


def decide_lease_expired(state: JobState, now: datetime, deadline: datetime) -> list[AnyJobEvent]:
    """The runner stopped heartbeating: the job fails (a cancelling job ends cancelled).

    Not re-queued: a runner that went silent may still be running the
    commands (a partition, a stopped clock), and they are not known to be safe
    to run twice. See docs/JOBS.md.
    """
    if state.state not in ACTIVE:
        return []
    silent = max(0.0, (now - deadline).total_seconds()) + (state.lease_seconds or 0)
    msg = (
        f"runner {state.worker} on node {state.node} stopped heartbeating: "
        f"no report for {silent:.0f} s (lease of {state.lease_seconds} s expired)"
    )
    if state.state == "cancelling":
        return [JobCancelled(reason=msg, at=epoch(now))]
    return [JobFailed(error=msg, reason="heartbeat_timeout", at=epoch(now))]
