"""The service's operations, each a function that builds a `Call`; `Operations`
binds every one of them as a method of both `Client` and `AsyncClient`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import quote

from taskledger.client._call import Call, Op
from taskledger.client.models import (
    BlockerList,
    Cancel,
    Category,
    Claim,
    ClaimBatch,
    Claimed,
    ClaimJob,
    Collect,
    Collected,
    Complete,
    CompleteBatch,
    CompleteEntry,
    CreateBatch,
    CreateJob,
    CreateTask,
    CreateToken,
    CreateWebhook,
    DeliveryList,
    EventPage,
    Fail,
    Heartbeat,
    Job,
    JobReport,
    Lease,
    Outcome,
    Reassign,
    Release,
    RoundReview,
    StartBatch,
    StartEntry,
    StreamPage,
    Subtask,
    Task,
    TaskBatch,
    TaskPage,
    TaskType,
    TokenCreated,
    Unblock,
    Verdict,
    Webhook,
    WebhookList,
)


def _p(value: str) -> str:
    return quote(value, safe="")


def create_task(task: CreateTask) -> Call[Task]:
    """Create a task (producer). The answer is its view; `seq` is where it landed in the log."""
    return Call("POST", "/tasks", Task, body=task)


def create_tasks(tasks: Sequence[CreateTask]) -> Call[TaskBatch]:
    """Create up to 1,000 tasks in one transaction, all or none (producer), answered
    in order; a refused task raises with its `index` and nothing is written."""
    return Call("POST", "/tasks/batch", TaskBatch, body=CreateBatch(tasks=list(tasks)))


def get_task(task_id: str, *, as_of_seq: int | None = None) -> Call[Task]:
    """A task's current view, or as it stood after global seq `as_of_seq`."""
    return Call("GET", f"/tasks/{_p(task_id)}", Task, params={"as_of_seq": as_of_seq})


def list_tasks(*, state: str | None = None, project: str | None = None, parent_task_id: str | None = None,
               task_type: TaskType | None = None, limit: int = 100, after: str | None = None) -> Call[TaskPage]:
    """Tasks in creation order; pass `next_after` back as `after` for the next page."""
    return Call("GET", "/tasks", TaskPage, params={
        "state": state, "project": project, "parent_task_id": parent_task_id, "task_type": task_type,
        "limit": limit, "after": after})


def task_events(task_id: str, *, since_seq: int = 0, limit: int = 1000) -> Call[StreamPage]:
    """A task's own stream after `since_seq` (a `stream_seq`)."""
    return Call("GET", f"/tasks/{_p(task_id)}/events", StreamPage, params={"since_seq": since_seq, "limit": limit})


def claim(*, task_types: list[TaskType] | None = None, projects: list[str] | None = None,
          lease_seconds: int = 60, idempotent: bool = True) -> Call[Task | None]:
    """Claim the next task this worker may take (None when there is none). The
    answer carries the `lease_id` every later report needs.

    `idempotent=False` sends no Idempotency-Key, for a loop that polls: a claim
    that finds nothing then takes the service's read-only path instead of a
    write batch, but a claim whose answer is lost leaves its task leased, unworked,
    until the lease runs out."""
    body = Claim(projects=projects, lease_seconds=lease_seconds)
    if task_types is not None:
        body.task_types = list(task_types)
    return Call("POST", "/tasks/claim", Task | None, body=body, empty_is_none=True, idempotent=idempotent)


def claim_batch(max: int, *, task_types: list[TaskType] | None = None, projects: list[str] | None = None,
                lease_seconds: int = 60, start: bool = False, idempotent: bool = True) -> Call[Claimed]:
    """Claim up to `max` tasks in one call, each with a lease of its own (none when
    there is nothing); with `start=True` each is started too, answered running
    (`task.claimed` then `task.started`, as `claim` and `start` log them);
    `idempotent` as for `claim`."""
    body = ClaimBatch(projects=projects, lease_seconds=lease_seconds, max=max, start=start)
    if task_types is not None:
        body.task_types = list(task_types)
    return Call("POST", "/tasks/claim/batch", Claimed, body=body, idempotent=idempotent)


def start(task_id: str, lease_id: str) -> Call[Task]:
    """Report a claimed task running (lease holder)."""
    return Call("POST", f"/tasks/{_p(task_id)}/start", Task, body=Lease(lease_id=lease_id))


def start_batch(tasks: Sequence[StartEntry]) -> Call[TaskBatch]:
    """`start` for up to 1,000 claimed tasks in one transaction, each by its own lease,
    all or none: a refused entry raises with its `index` and nothing is written."""
    return Call("POST", "/tasks/start/batch", TaskBatch, body=StartBatch(tasks=list(tasks)))


def heartbeat(task_id: str, lease_id: str, *, lease_seconds: int | None = None) -> Call[Task]:
    """Extend the lease (lease holder)."""
    return Call("POST", f"/tasks/{_p(task_id)}/heartbeat", Task,
                body=Heartbeat(lease_id=lease_id, lease_seconds=lease_seconds))


def complete(task_id: str, lease_id: str, *, result: Any = None, outcome: Outcome | None = None,
             verdicts: list[Verdict] | None = None, category: Category | None = None) -> Call[Task]:
    """Report a task done (lease holder). For a verify task: the `outcome`, one
    verdict per requirement, and a `category` when BLOCKED."""
    return Call("POST", f"/tasks/{_p(task_id)}/complete", Task, body=Complete(
        lease_id=lease_id, result=result, outcome=outcome, verdicts=list(verdicts or []), category=category))


def complete_batch(tasks: Sequence[CompleteEntry]) -> Call[TaskBatch]:
    """`complete` for up to 1,000 running tasks in one transaction, each entry that
    call's fields plus `task_id`, decided in order; all or none: a refused entry
    raises with its `index` and nothing is written."""
    return Call("POST", "/tasks/complete/batch", TaskBatch, body=CompleteBatch(tasks=list(tasks)))


def fail(task_id: str, lease_id: str, *, error: str = "") -> Call[Task]:
    """Report that the work failed (lease holder); retried while attempts remain."""
    return Call("POST", f"/tasks/{_p(task_id)}/fail", Task, body=Fail(lease_id=lease_id, error=error))


def release(task_id: str, lease_id: str, *, reason: str = "") -> Call[Task]:
    """Give a claim back without spending an attempt (lease holder)."""
    return Call("POST", f"/tasks/{_p(task_id)}/release", Task, body=Release(lease_id=lease_id, reason=reason))


def reassign(task_id: str, assignee: str | None) -> Call[Task]:
    """Direct a task to one worker, or to anyone with None (producer)."""
    return Call("POST", f"/tasks/{_p(task_id)}/reassign", Task, body=Reassign(assignee=assignee))


def cancel_task(task_id: str, *, reason: str = "") -> Call[Task]:
    """Cancel a task (producer); a parent cancels its open sub-tasks."""
    return Call("POST", f"/tasks/{_p(task_id)}/cancel", Task, body=Cancel(reason=reason))


def unblock(task_id: str, *, action: Literal["retry", "reverify"] = "retry", notes: str | None = None) -> Call[Task]:
    """Resolve a blocker (producer): `retry` the work with fresh attempts, or `reverify` it."""
    return Call("POST", f"/tasks/{_p(task_id)}/unblock", Task, body=Unblock(action=action, notes=notes))


def review_round(task_id: str, decision: Literal["GOAL_ACHIEVED", "NEW_ROUND"], *, notes: str = "",
                 goal_clear: bool | str | None = None, coverage: str | None = None, next_round: str | None = None,
                 new_subtasks: list[Subtask] | None = None) -> Call[Task]:
    """Decide a parent's ended round (reviewer): close it, or start a new round of sub-tasks."""
    return Call("POST", f"/tasks/{_p(task_id)}/round-review", Task, body=RoundReview(
        decision=decision, notes=notes, goal_clear=goal_clear, coverage=coverage, next_round=next_round,
        new_subtasks=list(new_subtasks or [])))


def collect(*, project: str | None = None, limit: int = 100) -> Call[Collected]:
    """Take finished tasks (completed without verification, or verified), once each (producer)."""
    return Call("POST", "/tasks/collect", Collected, body=Collect(project=project, limit=limit))


def blockers(*, open: bool | None = None, project: str | None = None, task_id: str | None = None,
             limit: int = 100) -> Call[BlockerList]:
    """Blocker records: tasks waiting for a human."""
    return Call("GET", "/blockers", BlockerList,
                params={"open": None if open is None else str(open).lower(), "project": project,
                        "task_id": task_id, "limit": limit})


def events(*, since_seq: int = 0, limit: int = 1000, types: list[str] | None = None, stream: str | None = None,
           project: str | None = None) -> Call[EventPage]:
    """A page of the global log after `since_seq`; `types` entries ending in '.' are prefixes."""
    return Call("GET", "/events", EventPage, params={
        "since_seq": since_seq, "limit": limit, "types": types, "stream": stream, "project": project})


def create_job(commands: list[str], *, project: str | None = None, job_id: str | None = None,
               parallel: bool = False, fail_fast: bool = False, labels: list[str] | None = None,
               command_timeout_seconds: float | None = None) -> Call[Job]:
    """Start an asynchronous verification job; a runner runs its commands, killing any past
    `command_timeout_seconds` (producer, or a worker starting its own verification run)."""
    return Call("POST", "/jobs", Job, body=CreateJob(
        commands=list(commands), project=project, job_id=job_id, parallel=parallel, fail_fast=fail_fast,
        labels=list(labels or []), command_timeout_seconds=command_timeout_seconds))


def get_job(job_id: str) -> Call[Job]:
    """A job's status: state, stage, progress, elapsed and eta."""
    return Call("GET", f"/jobs/{_p(job_id)}", Job)


def job_events(job_id: str, *, since_seq: int = 0, limit: int = 1000) -> Call[StreamPage]:
    """A job's own stream after `since_seq` (a `stream_seq`)."""
    return Call("GET", f"/jobs/{_p(job_id)}/events", StreamPage, params={"since_seq": since_seq, "limit": limit})


def cancel_job(job_id: str) -> Call[Job]:
    """Cancel a job (producer)."""
    return Call("POST", f"/jobs/{_p(job_id)}/cancel", Job)


def claim_job(*, lease_seconds: int | None = None, projects: list[str] | None = None,
              idempotent: bool = True) -> Call[Job | None]:
    """The oldest pending job (of `projects`), now running under a lease the
    caller holds (a runner: worker); None when there is none. `idempotent=False`:
    no Idempotency-Key, so an empty poll records no answer (see `claim`)."""
    return Call("POST", "/jobs/claim", Job | None, body=ClaimJob(lease_seconds=lease_seconds, projects=projects),
                empty_is_none=True, idempotent=idempotent)


def report_job(job_id: str, report: JobReport) -> Call[Job]:
    """A runner's report on the job it holds; every report renews the lease. The
    answer's `cancel_requested` tells the runner to stop."""
    return Call("POST", f"/jobs/{_p(job_id)}/report", Job, body=report)


def create_token(role: Literal["admin", "producer", "worker", "reviewer", "reader"], name: str, *,
                 node: str | None = None, expires_in_seconds: int | None = None) -> Call[TokenCreated]:
    """A new API token (admin); a worker token needs its node; it expires after `expires_in_seconds` if given."""
    return Call("POST", "/tokens", TokenCreated,
                body=CreateToken(role=role, name=name, node=node, expires_in_seconds=expires_in_seconds))


def create_webhook(url: str, secret: str, *, types: list[str] | None = None,
                   format: Literal["event", "issue"] = "event", since_seq: int | None = None) -> Call[Webhook]:
    """Register a webhook (admin): events after `since_seq` (default: from now) are
    POSTed to `url`, signed with `secret`."""
    return Call("POST", "/webhooks", Webhook, body=CreateWebhook(
        url=url, secret=secret, types=types, format=format, since_seq=since_seq))


def list_webhooks() -> Call[WebhookList]:
    """Registered webhooks (admin)."""
    return Call("GET", "/webhooks", WebhookList)


def delete_webhook(webhook_id: str) -> Call[None]:
    """Remove a webhook and its delivery history (admin)."""
    return Call("DELETE", f"/webhooks/{_p(webhook_id)}", None)


def webhook_deliveries(webhook_id: str, *, limit: int = 100) -> Call[DeliveryList]:
    """The latest delivery attempts of a webhook, newest first (admin)."""
    return Call("GET", f"/webhooks/{_p(webhook_id)}/deliveries", DeliveryList, params={"limit": limit})


class Operations:
    """Every operation of the service, as methods (sync or async by the client)."""

    create_task = Op(create_task)
    create_tasks = Op(create_tasks)
    get_task = Op(get_task)
    list_tasks = Op(list_tasks)
    task_events = Op(task_events)
    claim = Op(claim)
    claim_batch = Op(claim_batch)
    start = Op(start)
    start_batch = Op(start_batch)
    heartbeat = Op(heartbeat)
    complete = Op(complete)
    complete_batch = Op(complete_batch)
    fail = Op(fail)
    release = Op(release)
    reassign = Op(reassign)
    cancel_task = Op(cancel_task)
    unblock = Op(unblock)
    review_round = Op(review_round)
    collect = Op(collect)
    blockers = Op(blockers)
    events = Op(events)
    create_job = Op(create_job)
    get_job = Op(get_job)
    job_events = Op(job_events)
    cancel_job = Op(cancel_job)
    claim_job = Op(claim_job)
    report_job = Op(report_job)
    create_token = Op(create_token)
    create_webhook = Op(create_webhook)
    list_webhooks = Op(list_webhooks)
    delete_webhook = Op(delete_webhook)
    webhook_deliveries = Op(webhook_deliveries)
