"""The pure job model: no database, no HTTP."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import msgspec
import pytest

from taskledger.events import lease
from taskledger.events.errors import (
    DomainError,
    InvalidTransition,
    JobAlreadyCancelled,
    LeaseMismatch,
    ValidationFailed,
)
from taskledger.events.job import events as job_events
from taskledger.events.job import rules as job_rules
from taskledger.events.job import state as job_state

T0 = datetime.fromtimestamp(1_700_000_000, UTC)
HOLDER = lease.Holder(node="n1", worker="w1", token_id="tok-1")


def at(seconds: float) -> datetime:
    """T0 plus `seconds`: the database's clock, as decisions receive it."""
    return T0 + timedelta(seconds=seconds)


def _apply(state: job_state.JobState | None, events: list[job_events.AnyJobEvent]) -> job_state.JobState:
    out = job_state.fold(events, state)
    assert out is not None
    return out


def _created(commands: list[str] | None = None, **kw: object) -> job_state.JobState:
    cmd = job_rules.CreateJob(job_id="J", commands=commands or ["a", "b", "c"], project="p", **kw)  # type: ignore[arg-type]
    return _apply(None, job_rules.decide_create(cmd, T0))


def _running(commands: list[str] | None = None) -> job_state.JobState:
    s = _created(commands)
    claim = job_rules.Claim(holder=msgspec.structs.replace(HOLDER, lease_id="L"), lease_seconds=60)
    return _apply(s, job_rules.decide_claim(s, claim, at(10)))


def _report(s: job_state.JobState, now: datetime, **kw: object) -> job_state.JobState:
    return _apply(s, job_rules.decide_report(s, HOLDER, job_rules.Report(**kw), now))  # type: ignore[arg-type]


def test_a_new_job_is_pending_with_no_eta() -> None:
    s = _created()
    st = job_state.status(s, at(100))
    assert (st["state"], st["stage"], st["progress"], st["elapsed_sec"], st["eta_sec"]) == (
        "pending",
        "init",
        0.0,
        0.0,
        None,
    )
    assert st["total_commands"] == 3 and st["created_at"] == "2023-11-14T22:13:20.000000Z"


def test_progress_and_eta_follow_the_formula() -> None:
    s = _running()
    s = _report(s, at(11), event="command_started", command="a", index=0, total=3)
    assert job_state.eta(s, at(12)) is None  # nothing completed yet
    s = _report(s, at(16), event="command_completed", command="a", exit_code=0, duration=5.0)
    st = job_state.status(s, at(16))
    # elapsed 6 s since the claim, 1 of 3 done: eta = 6 / 1 x 2
    assert st["progress"] == 33.33 and st["elapsed_sec"] == 6.0 and st["eta_sec"] == 12.0
    s = _report(s, at(17), event="cache_hit", command="b")
    assert job_state.status(s, at(19))["eta_sec"] == pytest.approx(9 / 2 * 1)
    s = _report(s, at(20), event="finish", status="completed")
    st = job_state.status(s, at(500))
    assert st["state"] == "completed" and st["elapsed_sec"] == 10.0 and st["eta_sec"] == 0.0
    assert st["progress"] == 66.67  # honest: c never ran


def test_cancel_lifecycle() -> None:
    pending = _created()
    assert isinstance(job_rules.decide_cancel(pending, T0)[0], job_events.JobCancelled)
    cancelled = _apply(pending, job_rules.decide_cancel(pending, T0))
    with pytest.raises(JobAlreadyCancelled):
        job_rules.decide_cancel(cancelled, T0)

    running = _report(_running(), at(11), event="command_started", command="a")
    cancelling = _apply(running, job_rules.decide_cancel(running, at(12)))
    assert cancelling.state == "cancelling" and cancelling.cancel_requested
    assert job_rules.decide_cancel(cancelling, at(13)) == []
    done = _report(cancelling, at(14), event="finish", status="cancelled", exit_code=-15)
    assert done.state == "cancelled" and done.commands[0].state == "interrupted"
    assert done.current_command is None

    finished = _report(_running(), at(11), event="finish", status="failed", exit_code=2)
    assert job_rules.decide_cancel(finished, at(12)) == []


def test_a_finish_after_a_cancel_request_ends_cancelled() -> None:
    s = _running(["a"])
    s = _report(s, at(11), event="command_completed", command="a", exit_code=0, duration=1.0)
    s = _report(s, at(12), event="stage", stage="completing")
    s = _apply(s, job_rules.decide_cancel(s, at(12)))
    [ev] = job_rules.decide_report(s, HOLDER, job_rules.Report(event="finish", status="completed"), at(13))
    assert isinstance(ev, job_events.JobCancelled) and ev.runner_status == "completed"
    assert job_state.evolve(s, ev).state == "cancelled"


def test_reports_need_the_lease_holder_and_an_active_job() -> None:
    s = _created()
    with pytest.raises(InvalidTransition):
        job_rules.decide_report(s, HOLDER, job_rules.Report(event="heartbeat"), T0)
    s = _running()
    for who in (
        lease.Holder(node="n2", worker="w1", token_id="tok-1"),
        lease.Holder(node="n1", worker="w2", token_id="tok-1"),
        lease.Holder(node="n1", worker="w1", token_id="tok-1", lease_id="other"),
    ):
        with pytest.raises(LeaseMismatch):
            job_rules.decide_report(s, who, job_rules.Report(event="heartbeat"), T0)
    holder = lease.Holder(node="n1", worker="w1", token_id="tok-1", lease_id="L")
    assert job_rules.decide_report(s, holder, job_rules.Report(event="heartbeat"), T0)
    done = _report(s, at(1), event="finish", status="completed")
    with pytest.raises(InvalidTransition):
        job_rules.decide_report(done, HOLDER, job_rules.Report(event="heartbeat"), T0)


def test_a_job_lease_belongs_to_the_claiming_token_on_its_node() -> None:
    s = _running()
    assert (s.token_id, s.lease_id, s.node) == ("tok-1", "L", "n1")
    beat = job_rules.Report(event="heartbeat")
    twin = lease.Holder(node="n1", worker="w1", token_id="tok-2", lease_id="L")  # same name and node
    for thief in (twin, msgspec.structs.replace(twin, lease_id=None)):
        with pytest.raises(LeaseMismatch, match="another token"):
            job_rules.decide_report(s, thief, beat, at(11))
    moved = lease.Holder(node="n2", worker="w1", token_id="tok-1", lease_id="L")  # its token, another node
    with pytest.raises(LeaseMismatch, match="on node n1"):
        job_rules.decide_report(s, moved, beat, at(11))
    for who in (HOLDER, msgspec.structs.replace(HOLDER, lease_id="L")):
        [ev] = job_rules.decide_report(s, who, beat, at(11))
        assert isinstance(ev, job_events.JobHeartbeat)


def test_a_job_lease_recorded_before_tokens_were_named_is_held_by_name_and_node() -> None:
    old = _apply(_created(), [job_events.decode("job.started", b'{"worker":"w1","node":"n1","lease_id":"L",'
                                                                  b'"lease_seconds":60}')])
    assert old.token_id is None
    any_token = lease.Holder(node="n1", worker="w1", token_id="tok-9", lease_id="L")
    assert job_rules.decide_report(old, any_token, job_rules.Report(event="heartbeat"), at(11))
    with pytest.raises(LeaseMismatch):
        job_rules.decide_report(old, msgspec.structs.replace(any_token, node="n2"),
                                job_rules.Report(event="heartbeat"), at(11))


def test_a_claim_records_the_token_and_needs_a_lease_id() -> None:
    s = _created()
    [ev] = job_rules.decide_claim(s, job_rules.Claim(holder=msgspec.structs.replace(HOLDER, lease_id="L"),
                                                     lease_seconds=30), at(5))
    assert ev == job_events.JobStarted(node="n1", worker="w1", token_id="tok-1", lease_id="L",
                                       lease_seconds=30, attempt=1, at=at(5).timestamp())
    with pytest.raises(InvalidTransition):
        job_rules.decide_claim(s, job_rules.Claim(holder=HOLDER, lease_seconds=30), at(5))
    with pytest.raises(InvalidTransition):
        job_rules.decide_claim(_running(), job_rules.Claim(holder=msgspec.structs.replace(HOLDER, lease_id="M"),
                                                           lease_seconds=30), at(5))


def test_jobs_reckon_time_by_the_database_timestamp_like_tasks() -> None:
    # The clock a decision receives is an aware datetime; the facts keep epoch seconds.
    [created] = job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["a"]), at(0))
    assert isinstance(created, job_events.JobCreated) and created.at == 1_700_000_000.0
    s = _running(["a"])
    assert s.started_at == 1_700_000_010.0
    assert job_state.status(s, at(25))["elapsed_sec"] == 15.0
    later = T0.astimezone(timezone(timedelta(hours=5))) + timedelta(seconds=25)  # same instant, other zone
    assert job_state.status(s, later)["elapsed_sec"] == 15.0
    [failed] = job_rules.decide_lease_expired(s, at(100), at(70))
    assert isinstance(failed, job_events.JobFailed) and failed.at == 1_700_000_100.0
    assert "no report for 90 s" in (failed.error or "")


def test_commands_are_matched_by_index_or_text() -> None:
    s = _running(["x", "x", "y"])
    s = _report(s, at(11), event="command_started", command="x")
    s = _report(s, at(12), event="command_started", command="x")
    assert [c.state for c in s.commands] == ["running", "running", "pending"]
    with pytest.raises(InvalidTransition):
        job_rules.decide_report(s, HOLDER, job_rules.Report(event="command_started", command="x"), T0)
    for bad in (
        job_rules.Report(event="command_started", command="y", index=0),
        job_rules.Report(event="command_started", command="z"),
        job_rules.Report(event="command_started", command="y", total=4),
        job_rules.Report(event="stage", stage="lunch"),
        job_rules.Report(event="finish"),
    ):
        with pytest.raises(ValidationFailed):
            job_rules.decide_report(s, HOLDER, bad, T0)


def test_lease_expiry_fails_a_running_job_and_cancels_a_cancelling_one() -> None:
    s = _running()
    [ev] = job_rules.decide_lease_expired(s, at(100), at(70))
    assert isinstance(ev, job_events.JobFailed) and ev.reason == "heartbeat_timeout"
    assert "stopped heartbeating" in (job_state.evolve(s, ev).error or "")
    cancelling = _apply(s, job_rules.decide_cancel(s, at(11)))
    [ev] = job_rules.decide_lease_expired(cancelling, at(100), at(70))
    assert isinstance(ev, job_events.JobCancelled)
    assert job_rules.decide_lease_expired(_created(), T0, T0) == []


def test_creation_refuses_blank_commands() -> None:
    with pytest.raises(ValidationFailed):
        job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=[]), T0)
    with pytest.raises(ValidationFailed):
        job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["ok", "  "]), T0)


def test_every_event_round_trips_through_its_stored_payload() -> None:
    s = _running()
    evs: list[job_events.AnyJobEvent] = [
        *job_rules.decide_report(s, HOLDER, job_rules.Report(event="stage", stage="running"), T0),
        *job_rules.decide_report(s, HOLDER, job_rules.Report(event="error", error="boom", command="a"), T0),
        *job_rules.decide_report(s, HOLDER, job_rules.Report(event="heartbeat"), at(20)),
        *job_rules.decide_cancel(s, T0),
        *job_rules.decide_lease_expired(s, T0, T0),
    ]
    for ev in evs:
        again = job_events.decode(job_events.event_type(ev), msgspec.json.encode(job_events.payload(ev)))
        assert again == ev
    assert set(job_events.EVENT_TYPES) == {
        "job.created",
        "job.started",
        "job.stage",
        "job.command_started",
        "job.command_completed",
        "job.cache_hit",
        "job.command_skipped",
        "job.heartbeat",
        "job.error",
        "job.cancel_requested",
        "job.cancelled",
        "job.completed",
        "job.failed",
    }


def test_payloads_recorded_with_only_the_required_fields_still_decode() -> None:
    # What the first version wrote must always fold: new fields have defaults.
    stored = [
        ("job.created", b'{"job_id":"J","commands":["a"]}'),
        ("job.started", b'{"worker":"w","lease_id":"L","lease_seconds":60}'),
        ("job.stage", b'{"stage":"running"}'),
        ("job.command_started", b'{"command":"a","index":0,"total":1}'),
        ("job.command_completed", b'{"command":"a","exit_code":0,"duration":1.5,"index":0}'),
        ("job.heartbeat", b"{}"),
        ("job.error", b'{"error":"x"}'),
        ("job.cancel_requested", b"{}"),
        ("job.completed", b"{}"),
    ]
    s = job_state.fold(job_events.decode(t, d) for t, d in stored)
    assert s is not None and s.state == "completed" and job_state.progress(s) == 100.0
    assert s.command_timeout_seconds is None and s.created_by is None
    assert s.commands[0] == job_state.CommandRun(command="a", state="succeeded", exit_code=0, duration=1.5)
    for t in ("job.failed", "job.cancelled"):
        assert job_events.decode(t, b"{}").at == 0.0  # type: ignore[union-attr]
    with pytest.raises(msgspec.ValidationError):
        job_events.decode("job.unknown", b"{}")


# ------------------------------------------------------------ exact events and states


def _decide(s: job_state.JobState, now: float, **kw: object) -> list[job_events.AnyJobEvent]:
    return job_rules.decide_report(s, HOLDER, job_rules.Report(**kw), at(now))  # type: ignore[arg-type]


def test_each_report_decides_exactly_its_event() -> None:
    s = _running(["a", "b", "a"])
    assert _decide(s, 11, event="stage", stage="running") == [job_events.JobStageChanged(stage="running")]
    assert _decide(s, 11, event="stage", stage="init") == []  # already there
    assert _decide(s, 11, event="command_started", command="a") == [
        job_events.JobCommandStarted(command="a", index=0, total=3)]
    assert _decide(s, 11, event="command_started", command="a", index=2, total=3) == [
        job_events.JobCommandStarted(command="a", index=2, total=3)]
    assert _decide(s, 11, event="command_completed", command="b", exit_code=3, duration=1.5) == [
        job_events.JobCommandCompleted(command="b", exit_code=3, duration=1.5, index=1)]
    assert _decide(s, 11, event="cache_hit", command="b") == [job_events.JobCacheHit(command="b", index=1)]
    assert _decide(s, 11, event="command_skipped", command="b", reason="r") == [
        job_events.JobCommandSkipped(command="b", index=1, reason="r")]
    assert _decide(s, 11, event="error", error="boom") == [job_events.JobErrorReported(error="boom", command=None)]
    assert _decide(s, 11, event="error", error="boom", command="a") == [
        job_events.JobErrorReported(error="boom", command="a")]
    assert _decide(s, 14, event="heartbeat") == [job_events.JobHeartbeat(elapsed_sec=4.0, eta_sec=None)]
    done = _report(s, at(12), event="command_completed", command="a", exit_code=0, duration=1.0)
    assert _decide(done, 16, event="heartbeat") == [job_events.JobHeartbeat(elapsed_sec=6.0, eta_sec=12.0)]


def test_a_report_picks_the_first_command_of_that_text_whose_state_allows_it() -> None:
    s = _running(["a", "a"])
    s = _report(s, at(11), event="command_started", command="a")
    assert _decide(s, 12, event="command_started", command="a") == [
        job_events.JobCommandStarted(command="a", index=1, total=2)]
    s = _report(s, at(12), event="command_completed", command="a", exit_code=0, duration=1.0)
    assert [c.state for c in s.commands] == ["succeeded", "pending"]
    # a completion may come without a start; the running or pending one is taken, never a finished one
    assert _decide(s, 13, event="command_completed", command="a", exit_code=1, duration=0.5) == [
        job_events.JobCommandCompleted(command="a", exit_code=1, duration=0.5, index=1)]
    assert _decide(s, 13, event="cache_hit", command="a") == [job_events.JobCacheHit(command="a", index=1)]
    s = _report(s, at(13), event="cache_hit", command="a")
    with pytest.raises(InvalidTransition, match="command 0"):
        _decide(s, 14, event="command_skipped", command="a")
    with pytest.raises(InvalidTransition):
        _decide(s, 14, event="command_completed", command="a", index=1, exit_code=0, duration=1.0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"event": "command_started"}, "command_started: command is required"),
    ({"event": "command_started", "command": "a", "total": 2}, "total is 2, but the job has 3 commands"),
    ({"event": "command_started", "command": "a", "index": 3}, "index 3 is out of range 0..2"),
    ({"event": "command_started", "command": "a", "index": -1}, "index -1 is out of range 0..2"),
    ({"event": "command_started", "command": "b", "index": 0}, "command 0 is not 'b'"),
    ({"event": "cache_hit", "command": "z"}, "'z' is not one of the job's commands"),
    ({"event": "command_completed", "command": "a", "duration": 1.0}, "exit_code is required"),
    ({"event": "command_completed", "command": "a", "exit_code": 0}, "duration is required"),
    ({"event": "error"}, "error \\(the message\\) is required"),
    ({"event": "error", "error": ""}, "error \\(the message\\) is required"),
    ({"event": "stage", "stage": "lunch"}, "stage must be one of init, load_cache"),
    ({"event": "finish"}, "finish: status is required"),
])
def test_a_malformed_report_is_refused_with_what_is_wrong(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationFailed, match=message):
        _decide(_running(), 11, **fields)


def test_finish_decides_exactly_by_status_and_a_requested_cancel_wins() -> None:
    s = _running(["a"])
    assert _decide(s, 20, event="finish", status="completed", result={"k": 1}) == [
        job_events.JobCompleted(exit_code=0, result={"k": 1}, at=at(20).timestamp())]
    assert _decide(s, 20, event="finish", status="completed", exit_code=4) == [
        job_events.JobCompleted(exit_code=4, result=None, at=at(20).timestamp())]
    assert _decide(s, 20, event="finish", status="failed", exit_code=2, error="e", result=[1]) == [
        job_events.JobFailed(exit_code=2, error="e", reason="runner", result=[1], at=at(20).timestamp())]
    assert _decide(s, 20, event="finish", status="cancelled", exit_code=-15, result="r") == [
        job_events.JobCancelled(reason="cancelled by the runner", exit_code=-15, runner_status="cancelled",
                                result="r", at=at(20).timestamp())]
    assert _decide(s, 20, event="finish", status="cancelled", error="stopped") == [
        job_events.JobCancelled(reason="stopped", exit_code=None, runner_status="cancelled", result=None,
                                at=at(20).timestamp())]
    cancelling = _apply(s, job_rules.decide_cancel(s, at(15)))
    for status in ("completed", "failed", "cancelled"):
        assert _decide(cancelling, 21, event="finish", status=status, exit_code=1, result="x") == [
            job_events.JobCancelled(reason="cancel requested", exit_code=1, runner_status=status, result="x",
                                    at=at(21).timestamp())]


def test_create_claim_cancel_and_expiry_decide_exactly() -> None:
    cmd = job_rules.CreateJob(job_id="J", commands=["a", "b"], project="p", parallel=True, fail_fast=True,
                              labels=["x"])
    assert job_rules.decide_create(cmd, at(0)) == [job_events.JobCreated(
        job_id="J", commands=["a", "b"], project="p", parallel=True, fail_fast=True, labels=["x"],
        at=at(0).timestamp())]
    with pytest.raises(ValidationFailed, match="at least one command"):
        job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=[]), at(0))
    with pytest.raises(ValidationFailed, match="may not be blank"):
        job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["a", " "]), at(0))
    pending = _created()
    assert job_rules.decide_cancel(pending, at(1)) == [
        job_events.JobCancelled(reason="cancelled before it started", at=at(1).timestamp())]
    assert job_rules.decide_cancel(pending, at(1), "no") == [job_events.JobCancelled(reason="no", at=at(1).timestamp())]
    running = _running()
    assert running.attempt == 1
    assert job_rules.decide_cancel(running, at(12), "stop") == [
        job_events.JobCancelRequested(reason="stop", at=at(12).timestamp())]
    with pytest.raises(JobAlreadyCancelled, match="job J is already cancelled"):
        job_rules.decide_cancel(_apply(pending, job_rules.decide_cancel(pending, at(1))), at(2))
    assert job_rules.decide_lease_expired(running, at(100), at(70)) == [job_events.JobFailed(
        error="runner w1 on node n1 stopped heartbeating: no report for 90 s (lease of 60 s expired)",
        reason="heartbeat_timeout", at=at(100).timestamp())]
    # the deadline not yet passed: only the lease's own length counts
    [ev] = job_rules.decide_lease_expired(running, at(60), at(70))
    assert isinstance(ev, job_events.JobFailed) and "no report for 60 s" in (ev.error or "")
    cancelling = _apply(running, job_rules.decide_cancel(running, at(12)))
    assert job_rules.decide_lease_expired(cancelling, at(100), at(70)) == [job_events.JobCancelled(
        reason="runner w1 on node n1 stopped heartbeating: no report for 90 s (lease of 60 s expired)",
        at=at(100).timestamp())]
    done = _report(running, at(20), event="finish", status="completed")
    assert job_rules.decide_lease_expired(done, at(100), at(70)) == []


def test_refusals_say_why() -> None:
    with pytest.raises(InvalidTransition, match="job J has not been claimed"):
        _decide(_created(), 1, event="heartbeat")
    done = _report(_running(), at(20), event="finish", status="failed")
    with pytest.raises(InvalidTransition, match="job J is already failed") as e:
        _decide(done, 21, event="heartbeat")
    assert e.value.extra == {"job_id": "J", "state": "failed"}
    with pytest.raises(InvalidTransition, match="job J is running, not pending"):
        job_rules.decide_claim(_running(), job_rules.Claim(holder=HOLDER, lease_seconds=1), at(1))
    with pytest.raises(LeaseMismatch) as e2:
        job_rules.decide_report(_running(), msgspec.structs.replace(HOLDER, token_id="t2"),
                                job_rules.Report(event="heartbeat"), at(1))
    assert e2.value.extra == {"job_id": "J"} and "job J" in str(e2.value)


def test_evolve_folds_each_event_into_exactly_its_state() -> None:
    s = _created(["a", "b", "c"], parallel=True, fail_fast=True, labels=["x"])
    assert s == job_state.JobState(
        job_id="J", project="p", commands=tuple(job_state.CommandRun(command=c) for c in "abc"), parallel=True,
        fail_fast=True, labels=("x",), created_at=at(0).timestamp())
    s = _apply(s, job_rules.decide_claim(s, job_rules.Claim(holder=msgspec.structs.replace(HOLDER, lease_id="L"),
                                                            lease_seconds=60), at(10)))
    assert (s.state, s.node, s.worker, s.token_id, s.lease_id, s.lease_seconds, s.attempt, s.started_at) == (
        "running", "n1", "w1", "tok-1", "L", 60, 1, at(10).timestamp())
    s = _report(s, at(11), event="stage", stage="parallel")
    assert s.stage == "parallel"
    s = _report(s, at(11), event="command_started", command="a")
    s = _report(s, at(11), event="command_started", command="b")
    assert (s.current_command, [c.state for c in s.commands]) == ("b", ["running", "running", "pending"])
    s = _report(s, at(12), event="command_completed", command="b", exit_code=0, duration=1.0)
    assert s.current_command == "a" and s.commands[1] == job_state.CommandRun(
        command="b", state="succeeded", exit_code=0, duration=1.0)
    s = _report(s, at(13), event="command_completed", command="a", exit_code=2, duration=2.0)
    assert s.current_command is None and s.commands[0] == job_state.CommandRun(
        command="a", state="failed", exit_code=2, duration=2.0)
    assert (s.completed_commands, s.failed_commands) == (2, 1)
    s2 = _report(s, at(14), event="cache_hit", command="c")
    assert s2.commands[2] == job_state.CommandRun(command="c", state="cached", exit_code=0)
    assert (s2.completed_commands, s2.failed_commands) == (3, 1)
    s3 = _report(s, at(14), event="command_skipped", command="c", reason="fail_fast")
    assert s3.commands[2] == job_state.CommandRun(command="c", state="skipped", reason="fail_fast")
    s = _report(s, at(14), event="error", error="e1", command="a")
    s = _report(s, at(14), event="error", error="e2")
    assert (s.error, s.errors) == ("e2", ("a: e1", "e2"))
    before = s
    assert _report(s, at(15), event="heartbeat") == before
    s = _report(s, at(16), event="command_started", command="c")
    s = _report(s, at(17), event="finish", status="failed", exit_code=2, error="bad", result={"o": 1})
    assert (s.state, s.ended_at, s.exit_code, s.current_command, s.error) == (
        "failed", at(17).timestamp(), 2, None, "bad")
    assert s.errors == ("a: e1", "e2", "bad")
    assert s.commands[2].state == "interrupted"
    assert s.result == {"status": "failed", "exit_code": 2, "completed_commands": 2, "failed_commands": ["a"],
                        "output": {"o": 1}}


def test_evolve_ends_a_job_keeping_what_the_events_say() -> None:
    s = _running(["a"])
    done = _report(s, at(20), event="finish", status="completed")
    assert (done.state, done.exit_code, done.result, done.cancel_requested) == (
        "completed", 0, {"status": "completed", "exit_code": 0, "completed_commands": 0, "failed_commands": []},
        False)
    cancelled = _report(s, at(20), event="finish", status="cancelled", exit_code=-15)
    assert (cancelled.state, cancelled.error, cancelled.cancel_requested, cancelled.exit_code) == (
        "cancelled", "cancelled by the runner", True, -15)
    ended_at_zero = job_state.evolve(s, job_events.JobCompleted())
    assert ended_at_zero.ended_at is None  # a fact recorded before `at` existed
    asked = job_state.evolve(_created(), job_events.JobCancelRequested())
    assert (asked.state, asked.cancel_requested) == ("pending", True)
    many = s
    for i in range(25):
        many = job_state.evolve(many, job_events.JobErrorReported(error=f"e{i}"))
    assert many.errors == tuple(f"e{i}" for i in range(5, 25))
    failed = job_state.evolve(many, job_events.JobFailed(error="last"))
    assert failed.errors[-1] == "last" and len(failed.errors) == 20
    assert job_state.evolve(failed, job_events.JobFailed()).error == "last"
    for bad in (job_events.JobCommandStarted(command="z", index=5, total=1),
                job_events.JobCommandCompleted(command="z", index=-1, exit_code=0, duration=0.0),
                job_events.JobCacheHit(command="z", index=1), job_events.JobCommandSkipped(command="z", index=1)):
        assert job_state.evolve(s, bad) == s  # an index the job does not have changes nothing
    assert job_state.evolve(s, job_events.JobCreated(job_id="J", commands=["x"])) == s
    with pytest.raises(ValueError, match=r"must begin with job\.created, not job\.heartbeat"):
        job_state.evolve(None, job_events.JobHeartbeat())
    restarted = job_state.evolve(s, job_events.JobStarted(worker="w2", lease_id="M", lease_seconds=5, attempt=2,
                                                          at=at(50).timestamp()))
    assert restarted.started_at == s.started_at  # the first start stands


def test_status_is_exactly_the_view_of_the_state() -> None:
    s = _running(["a", "b"])
    s = _report(s, at(12), event="command_started", command="a")
    st = job_state.status(s, at(14))
    assert st == {
        "job_id": "J", "state": "running", "stage": "init", "progress": 0.0, "elapsed_sec": 4.0, "eta_sec": None,
        "current_command": "a", "total_commands": 2, "completed_commands": 0, "failed_commands": 0,
        "result": None, "cancel_requested": False, "project": "p", "parallel": False, "fail_fast": False,
        "labels": [], "command_timeout_seconds": None, "created_by": None,
        "commands": [{"command": "a", "state": "running", "exit_code": None, "duration": None,
                      "reason": None, "output": None, "output_truncated": False, "timed_out": False},
                     {"command": "b", "state": "pending", "exit_code": None, "duration": None,
                      "reason": None, "output": None, "output_truncated": False, "timed_out": False}],
        "node": "n1", "worker": "w1", "lease_id": "L", "attempt": 1, "error": None, "errors": [],
        "exit_code": None, "created_at": "2023-11-14T22:13:20.000000Z",
        "started_at": "2023-11-14T22:13:30.000000Z", "ended_at": None, "version": 0, "seq": 0,
    }
    assert job_state.elapsed(_created(), at(99)) == 0.0
    assert job_state.progress(job_state.JobState(job_id="E")) == 0.0
    assert job_state.iso(None) is None and job_state.iso(0.0) is None
    assert job_state.iso(1.5) == "1970-01-01T00:00:01.500000Z"
    assert job_state.rounded(1.234567) == 1.23 and job_state.rounded(1.235, 1) == 1.2
    assert job_state.rounded(-0.0) == 0.0 and str(job_state.rounded(-0.0)) == "0.0"


# ------------------------------------------------- output tail, command timeout, who started it


def test_a_completed_command_keeps_its_output_tail_in_the_event_and_the_view() -> None:
    s = _running(["a", "b"])
    evs = _decide(s, 12, event="command_completed", command="a", exit_code=2, duration=1.0,
                  output="...last lines\nerror: boom\n", output_truncated=True)
    assert evs == [job_events.JobCommandCompleted(command="a", exit_code=2, duration=1.0, index=0,
                                                  output="...last lines\nerror: boom\n", output_truncated=True)]
    again = job_events.decode("job.command_completed", msgspec.json.encode(job_events.payload(evs[0])))
    assert again == evs[0]
    st = job_state.status(_apply(s, evs), at(13))
    assert st["commands"][0] == {
        "command": "a", "state": "failed", "exit_code": 2, "duration": 1.0, "reason": None,
        "output": "...last lines\nerror: boom\n", "output_truncated": True, "timed_out": False,
    }
    assert st["commands"][1]["output"] is None


def test_a_timed_out_command_fails_like_a_non_zero_exit_and_is_named_in_the_result() -> None:
    s = _created(["sleep 99", "b"], command_timeout_seconds=2.5)
    assert s.command_timeout_seconds == 2.5
    claim = job_rules.Claim(holder=msgspec.structs.replace(HOLDER, lease_id="L"), lease_seconds=60)
    s = _apply(s, job_rules.decide_claim(s, claim, at(10)))
    evs = _decide(s, 13, event="command_completed", command="sleep 99", exit_code=124, duration=2.5,
                  timed_out=True, output="")
    assert evs[0] == job_events.JobCommandCompleted(command="sleep 99", exit_code=124, duration=2.5, index=0,
                                                    output="", timed_out=True)
    s = _apply(s, evs)
    assert s.commands[0].state == "failed" and s.commands[0].timed_out and s.failed_commands == 1
    s = _report(s, at(14), event="command_skipped", command="b", reason="fail_fast")
    s = _report(s, at(15), event="finish", status="failed", exit_code=124)
    assert s.result == {"status": "failed", "exit_code": 124, "completed_commands": 2,
                        "failed_commands": ["sleep 99"], "timed_out_commands": ["sleep 99"]}


def test_a_timed_out_command_cannot_have_exited_0_and_the_timeout_must_be_positive() -> None:
    s = _running(["a"])
    with pytest.raises(ValidationFailed) as e:
        _decide(s, 12, event="command_completed", command="a", exit_code=0, duration=1.0, timed_out=True)
    assert e.value.detail == "command_completed: a command that timed out cannot exit 0"
    for bad in (0.0, -1.0):
        with pytest.raises(ValidationFailed) as e:
            job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["a"], command_timeout_seconds=bad), T0)
        assert e.value.detail == "command_timeout_seconds: must be more than 0"
    half = job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["a"], command_timeout_seconds=0.5), T0)
    assert half[0].command_timeout_seconds == 0.5  # any positive limit, under a second too


def test_the_job_records_who_started_it() -> None:
    who = job_events.Actor(name="checker-1", role="worker", node="n2")
    s = _created(["a"], created_by=who)
    assert s.created_by == who
    assert job_state.status(s, T0)["created_by"] == {"name": "checker-1", "role": "worker", "node": "n2"}
    created = job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=["a"], created_by=who), T0)[0]
    assert job_events.decode("job.created", msgspec.json.encode(job_events.payload(created))) == created


# ------------------------------------------------------------ each refusal, exactly


def _refusal(exc: pytest.ExceptionInfo[DomainError]) -> tuple[type, str, dict[str, object]]:
    return type(exc.value), exc.value.detail, exc.value.extra


def test_a_job_refusal_says_what_is_wrong_and_names_the_job() -> None:
    for commands, detail in (([], "commands: at least one command is needed"),
                             (["a", "  "], "commands: a command may not be blank")):
        with pytest.raises(DomainError) as e:
            job_rules.decide_create(job_rules.CreateJob(job_id="J", commands=commands), T0)
        assert _refusal(e) == (ValidationFailed, detail, {})
    s = _created()
    with pytest.raises(DomainError) as e:
        job_rules.decide_claim(s, job_rules.Claim(holder=HOLDER, lease_seconds=60), T0)
    assert _refusal(e) == (InvalidTransition, "job J cannot be claimed without a lease id", {"job_id": "J"})
    with pytest.raises(DomainError) as e:
        job_rules.check_lease(s, HOLDER)
    assert _refusal(e) == (InvalidTransition, "job J has not been claimed", {"job_id": "J"})
    r = _running()
    with pytest.raises(DomainError) as e:
        job_rules.decide_claim(r, job_rules.Claim(holder=HOLDER, lease_seconds=60), T0)
    assert _refusal(e) == (InvalidTransition, "job J is running, not pending", {"job_id": "J"})
    gone = _apply(s, job_rules.decide_cancel(s, T0))
    with pytest.raises(DomainError) as e:
        job_rules.decide_cancel(gone, T0)
    assert _refusal(e) == (JobAlreadyCancelled, "job J is already cancelled", {"job_id": "J"})


def test_a_report_refusal_names_the_missing_field_or_the_command_and_its_state() -> None:
    s = _running()
    who = msgspec.structs.replace(HOLDER, lease_id="L")
    cases = [
        (job_rules.Report(event="command_completed", command="a", index=0, duration=1.0),
         "command_completed: exit_code is required"),
        (job_rules.Report(event="command_completed", command="a", index=0, exit_code=0),
         "command_completed: duration is required"),
        (job_rules.Report(event="error", command="a", index=0), "error: error (the message) is required"),
        (job_rules.Report(event="finish"), "finish: status is required (completed, failed or cancelled)"),
    ]
    for report, detail in cases:
        with pytest.raises(DomainError) as e:
            job_rules.decide_report(s, who, report, at(11))
        assert _refusal(e) == (ValidationFailed, detail, {})
    s = _apply(s, job_rules.decide_report(s, who, job_rules.Report(event="command_started", command="a", index=0),
                                          at(11)))
    with pytest.raises(DomainError) as e:
        job_rules.decide_report(s, who, job_rules.Report(event="command_started", command="a", index=0), at(12))
    assert _refusal(e) == (InvalidTransition, "command_started: command 0 ('a') is running",
                           {"job_id": "J", "index": 0})


def test_a_running_command_may_be_reported_cached_or_skipped_and_failures_add_up() -> None:
    s = _running()
    who = msgspec.structs.replace(HOLDER, lease_id="L")
    for i, c in enumerate("abc"):
        s = _apply(s, job_rules.decide_report(s, who, job_rules.Report(event="command_started", command=c, index=i),
                                              at(11)))
    assert job_rules.decide_report(s, who, job_rules.Report(event="cache_hit", command="a", index=0), at(12)) == [
        job_events.JobCacheHit(command="a", index=0)]
    assert job_rules.decide_report(s, who, job_rules.Report(event="command_skipped", command="b", index=1,
                                                            reason="r"), at(12)) == [
        job_events.JobCommandSkipped(command="b", index=1, reason="r")]
    for i, c in enumerate("ab"):
        s = _apply(s, job_rules.decide_report(s, who, job_rules.Report(
            event="command_completed", command=c, index=i, exit_code=1, duration=1.0), at(12)))
    assert (s.failed_commands, s.completed_commands, s.current_command) == (2, 2, "c")


def test_the_current_command_stays_the_one_last_started_while_it_runs() -> None:
    s = _running()
    for i, c in ((2, "c"), (1, "b"), (0, "a")):
        s = job_state.evolve(s, job_events.JobCommandStarted(command=c, index=i, total=3))
    assert s.current_command == "a"
    for ev in (job_events.JobCommandCompleted(command="c", index=2, exit_code=0, duration=1.0),
               job_events.JobCacheHit(command="c", index=2),
               job_events.JobCommandSkipped(command="c", index=2)):
        assert job_state.evolve(s, ev).current_command == "a"


def test_a_command_event_folds_for_the_first_command_and_is_ignored_out_of_range() -> None:
    s = _running()
    for ev in (job_events.JobCommandStarted(command="a", index=0, total=3),
               job_events.JobCommandCompleted(command="a", index=0, exit_code=0, duration=1.0),
               job_events.JobCacheHit(command="a", index=0),
               job_events.JobCommandSkipped(command="a", index=0)):
        assert job_state.evolve(s, ev).commands[0].state != "pending"
        assert job_state.evolve(s, msgspec.structs.replace(ev, index=3)) == s
        assert job_state.evolve(s, msgspec.structs.replace(ev, index=-1)) == s


def test_an_ending_keeps_its_time_and_output() -> None:
    s = _running()
    c = job_state.evolve(s, job_events.JobCancelled(at=T0.timestamp() + 20, result={"o": 1}))
    assert (c.ended_at, c.result["output"]) == (T0.timestamp() + 20, {"o": 1})
    d = job_state.evolve(s, job_events.JobCompleted(at=T0.timestamp() + 20, result={"o": 2}))
    assert d.result["output"] == {"o": 2}
    assert job_state.status(d, at(99))["ended_at"] == job_state.iso(T0.timestamp() + 20)
    assert job_state.elapsed(s, at(10.5)) == 0.5
