"""The job aggregate's facts: one frozen tagged Struct per event, and their codec.

Stored events are forever: new fields get defaults, a tag never changes.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from taskledger.events.errors import ValidationFailed


class JobEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of the job's facts. Tags are the stored `type`: never change one."""


class Actor(msgspec.Struct, frozen=True, kw_only=True):
    """Who asked for something: the token's name, role and node."""

    name: str
    role: str
    node: str | None = None


class JobCreated(JobEvent, tag="job.created", frozen=True, kw_only=True):
    job_id: str
    commands: list[str]
    project: str | None = None
    parallel: bool = False
    fail_fast: bool = False
    labels: list[str] = []
    at: float = 0.0
    # A runner kills a command that runs longer than this (None: no limit).
    command_timeout_seconds: float | None = None
    # Who started the job (None in jobs recorded before it was kept here; meta has it too).
    created_by: Actor | None = None


class JobStarted(JobEvent, tag="job.started", frozen=True, kw_only=True):
    """A runner claimed the job: the claim is the start."""

    node: str | None = None
    worker: str
    # The claiming token's id (None in leases recorded before it was): only it may report.
    token_id: str | None = None
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
    # The tail of what the command wrote (stdout and stderr, interleaved), as the runner kept it.
    output: str | None = None
    # True when `output` is only the end of a longer output.
    output_truncated: bool = False
    # The runner killed the command after the job's command_timeout_seconds.
    timed_out: bool = False


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


