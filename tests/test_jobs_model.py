"""The pure job model: no database, no HTTP."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import msgspec
import pytest

from events import lease
from events.errors import InvalidTransition, JobAlreadyCancelled, LeaseMismatch, ValidationFailed
from events.job import events as job_events
from events.job import rules as job_rules
from events.job import state as job_state

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
    for t in ("job.failed", "job.cancelled"):
        assert job_events.decode(t, b"{}").at == 0.0  # type: ignore[union-attr]
    with pytest.raises(msgspec.ValidationError):
        job_events.decode("job.unknown", b"{}")
