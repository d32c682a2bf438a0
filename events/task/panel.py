"""Verification: a maker's completion opens a panel of checkers; their verdicts decide.

The panel synthesis follows one written precedence (docs/DESIGN.md, "Panel
synthesis"), `panel_outcome`; no BLOCKED verdict is ever ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from taskledger.events.errors import InvalidTransition, ValidationFailed
from taskledger.events.lease import Holder
from taskledger.events.task.events import (
    DEFAULT_CHECKER,
    VERIFIER_ESTIMATED_MINUTES,
    VERIFIER_PRIORITY,
    Category,
    CheckerReport,
    Outcome,
    RequirementVerdict,
    TaskBlocked,
    TaskCompleted,
    TaskCreated,
    TaskEvent,
    TaskRejected,
    TaskRetryScheduled,
    TaskReverifyScheduled,
    TaskUnblocked,
    TaskVerdict,
    TaskVerified,
    TaskVerifying,
    UnblockAction,
    Unmet,
    VerdictRecord,
)
from taskledger.events.task.rules import Changes, check_lease
from taskledger.events.task.state import TaskState

PanelOutcome = Literal["blocked", "rejected", "reverify", "verified"]
HUMAN: Final[frozenset[Category]] = frozenset({"environment", "info_missing"})


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """A checker's report on the work it was given."""

    outcome: Outcome
    verdicts: list[RequirementVerdict] = []
    category: Category | None = None
    reason: str = ""
    result: Any = None


def verifier_ids(maker: TaskState, checkers: Sequence[str], attempt: int) -> list[str]:
    """Verifier ids per the contract (`V-{id}` for the first verification of attempt 1
    with the single default checker, else `V-{id}-a{attempt}-{checker}`), with a
    `-r{n}` suffix when a re-verification would reuse an id."""
    used = set(maker.all_verifier_task_ids)
    short = f"V-{maker.id}"
    out = []
    for c in checkers:
        base = short if attempt == 1 and list(checkers) == [DEFAULT_CHECKER] and short not in used \
            else f"V-{maker.id}-a{attempt}-{c}"
        vid, k = base, 1
        while vid in used:
            k += 1
            vid = f"{base}-r{k}"
        used.add(vid)
        out.append(vid)
    return out


def verifier_tasks(maker: TaskState, ids: Sequence[str], checkers: Sequence[str], notes: str | None = None) -> Changes:
    """One verify task per checker, never for the maker's node or worker (seed 000's
    priority and estimate unless the maker's `verification` says otherwise)."""
    ver = maker.verification
    priority = ver.priority if ver is not None and ver.priority is not None else VERIFIER_PRIORITY
    minutes = (ver.estimated_minutes if ver is not None and ver.estimated_minutes is not None
               else VERIFIER_ESTIMATED_MINUTES)
    blacklist = sorted({*maker.node_blacklist, *([maker.maker_node] if maker.maker_node else [])})
    return [(vid, [TaskCreated(
        id=vid, project=maker.project, title=f"Verify ({checker}): {maker.title}", spec=maker.spec,
        task_type="verify", parent_task_id=maker.id, priority=priority, estimated_minutes=minutes,
        requirements=list(maker.requirements), verification=None, max_attempts=maker.max_attempts,
        retry_predecessor=False, labels=list(maker.labels), node_blacklist=blacklist,
        escalate_after_seconds=maker.escalate_after_seconds, checker=checker, maker_attempt=maker.attempt,
        maker_node=maker.maker_node, maker_worker=maker.maker_worker, notes=notes,
    )]) for vid, checker in zip(ids, checkers, strict=True)]


def decide_complete(s: TaskState, who: Holder, result: Any) -> Changes:
    """An implement task's maker reports done: verification starts in the same transaction."""
    if s.task_type == "verify":
        raise ValidationFailed("a verify task is completed with an outcome and verdicts")
    check_lease(s, who, ("running",), "complete")
    events: list[TaskEvent] = [TaskCompleted(worker=who.worker, node=s.node, attempt=s.attempt, result=result)]
    if s.verification is None:
        return [(s.id, events)]
    checkers = list(s.verification.checkers)
    ids = verifier_ids(s, checkers, s.attempt)
    events.append(TaskVerifying(attempt=s.attempt, checkers=checkers, verifier_task_ids=ids,
                                maker_node=s.node, maker_worker=who.worker))
    done = msgspec.structs.replace(s, maker_node=s.node, maker_worker=who.worker)
    return [(s.id, events), *verifier_tasks(done, ids, checkers)]


def validate_verdict(maker: TaskState | None, v: Verdict) -> None:
    """A PASS judges every requirement, once; FAIL and BLOCKED may be partial but
    name only requirements of the task; the category goes with BLOCKED only."""
    if v.outcome == "BLOCKED" and v.category is None:
        raise ValidationFailed("a BLOCKED outcome needs a category")
    if v.outcome != "BLOCKED" and v.category is not None:
        raise ValidationFailed("category is only for BLOCKED outcomes")
    fails = [x.requirement_id for x in v.verdicts if x.verdict == "FAIL"]
    if v.outcome == "PASS" and fails:
        raise ValidationFailed("outcome PASS with FAIL verdicts: " + ", ".join(fails))
    if v.outcome == "FAIL" and not fails:
        raise ValidationFailed("outcome FAIL needs at least one FAIL verdict naming the unmet requirement")
    ids = [x.requirement_id for x in v.verdicts]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("one verdict per requirement")
    if maker is None or not maker.requirements:
        return
    known = [r.id for r in maker.requirements]
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValidationFailed(f"unknown requirement ids: {', '.join(unknown)}")
    missing = [i for i in known if i not in ids]
    if v.outcome == "PASS" and missing:
        raise ValidationFailed(f"a PASS judges every requirement; missing: {', '.join(missing)}")


def decide_verifier_complete(v: TaskState, maker: TaskState | None, who: Holder, verdict: Verdict) -> Changes:
    """A checker reports: its verdict lands on the maker's stream and, once every
    checker of the panel has reported, the panel decides."""
    if v.task_type != "verify":
        raise ValidationFailed("outcome and verdicts are for verify tasks")
    check_lease(v, who, ("running",), "complete")
    validate_verdict(maker, verdict)
    changes: Changes = [(v.id, [TaskCompleted(
        worker=who.worker, node=v.node, attempt=v.attempt, result=verdict.result, outcome=verdict.outcome,
        verdicts=list(verdict.verdicts), category=verdict.category, reason=verdict.reason,
    )])]
    if maker is None or maker.state != "verifying" or v.id not in maker.verifier_task_ids:
        return changes  # a stale verifier (its panel is over): kept on the verifier only
    return [*changes, *after_verdict(maker, TaskVerdict(
        checker=v.checker or DEFAULT_CHECKER, verifier_task_id=v.id, outcome=verdict.outcome,
        verdicts=list(verdict.verdicts), category=verdict.category, attempt=maker.attempt, node=v.node,
        worker=who.worker, reason=verdict.reason, token_id=who.token_id,
    ))]


def synthesized_blocked_verdict(v: TaskState, maker: TaskState) -> Changes:
    """A verifier that can no longer report (dead-lettered, cancelled) counts as
    BLOCKED/infrastructure for its maker, so the maker is never stuck verifying."""
    if maker.state != "verifying" or v.id not in maker.verifier_task_ids:
        return []
    if any(r.verifier_task_id == v.id for r in maker.verdicts):
        return []
    return after_verdict(maker, TaskVerdict(
        checker=v.checker or DEFAULT_CHECKER, verifier_task_id=v.id, outcome="BLOCKED",
        category="infrastructure", attempt=maker.attempt, node=v.node, worker=v.worker, synthesized=True,
        reason=f"verifier {v.id} is {v.state}",
    ))


def panel_outcome(records: Sequence[VerdictRecord]) -> PanelOutcome:
    """The precedence table, first row that matches wins:
    1. any BLOCKED environment/info_missing -> blocked;
    2. any FAIL, or BLOCKED code            -> rejected;
    3. any BLOCKED infrastructure           -> reverify (those checkers only);
    4. otherwise (every checker PASS)       -> verified."""
    if any(r.outcome == "BLOCKED" and r.category in HUMAN for r in records):
        return "blocked"
    if any(r.outcome == "FAIL" or (r.outcome == "BLOCKED" and r.category == "code") for r in records):
        return "rejected"
    if any(r.outcome == "BLOCKED" for r in records):
        return "reverify"
    return "verified"


def unmet(records: Sequence[VerdictRecord]) -> list[Unmet]:
    return [Unmet(requirement_id=x.requirement_id, reason=x.reason, checker=r.checker)
            for r in records for x in r.verdicts if x.verdict == "FAIL"]


def _reason(r: VerdictRecord) -> str:
    return r.reason or "; ".join(f"{x.requirement_id} {x.verdict}: {x.reason}" for x in r.verdicts if x.reason)


def reports(records: Sequence[VerdictRecord]) -> list[CheckerReport]:
    return [CheckerReport(checker=r.checker, outcome=r.outcome, category=r.category, reason=_reason(r))
            for r in records]


def blocked(maker: TaskState, reason: str, records: Sequence[VerdictRecord], category: Category | None,
            missing: list[Unmet] | None = None) -> TaskBlocked:
    """Open a blocker holding every checker's word and every unmet requirement."""
    return TaskBlocked(
        blocker_id=f"B-{maker.id}-{maker.blockers_opened + 1}", reason=reason,
        unmet_requirements=unmet(records) if missing is None else missing, category=category,
        attempt=maker.attempt, reports=reports(records),
    )


def after_verdict(maker: TaskState, verdict: TaskVerdict) -> Changes:
    events: list[TaskEvent] = [verdict]
    records = [*maker.verdicts, VerdictRecord(
        checker=verdict.checker, verifier_task_id=verdict.verifier_task_id, outcome=verdict.outcome,
        verdicts=verdict.verdicts, category=verdict.category, node=verdict.node, worker=verdict.worker,
        reason=verdict.reason, token_id=verdict.token_id,
    )]
    if not set(maker.verifier_task_ids) <= {r.verifier_task_id for r in records}:
        return [(maker.id, events)]
    attempt = maker.attempt
    match panel_outcome(records):
        case "verified":
            events.append(TaskVerified(attempt=attempt, checkers=[r.checker for r in records]))
        case "blocked":
            cats = sorted({r.category for r in records if r.outcome == "BLOCKED" and r.category in HUMAN})
            events.append(blocked(maker, "checker reported BLOCKED/" + ", BLOCKED/".join(str(c) for c in cats),
                                  records, cats[0]))
        case "rejected":
            rework = [r for r in records if r.outcome == "FAIL" or (r.outcome == "BLOCKED" and r.category == "code")]
            missing = unmet(records) or [
                Unmet(requirement_id="-", reason=f"{r.checker} reported BLOCKED/code: {_reason(r)}".rstrip(": "),
                      checker=r.checker) for r in rework]
            events.append(TaskRejected(attempt=attempt, unmet_requirements=missing,
                                       reason=", ".join(f"{r.checker}: {r.outcome}" for r in rework)))
            if maker.retry_predecessor and attempt < maker.max_attempts:
                events.append(TaskRetryScheduled(attempt=attempt + 1, rework_notes=missing, reason="rejected"))
            else:
                why = "retries exhausted" if maker.retry_predecessor else "rejected and retry_predecessor is false"
                events.append(blocked(maker, why, records, None, missing))
        case "reverify" if maker.reverify_count == 0:
            again = [r.checker for r in records if r.outcome == "BLOCKED"]
            kept = [r.verifier_task_id for r in records if r.outcome == "PASS"]
            ids = verifier_ids(maker, again, attempt)
            events.append(TaskReverifyScheduled(attempt=attempt, verifier_task_ids=ids, kept_verifier_task_ids=kept,
                                                reason="BLOCKED/infrastructure: verifying again"))
            return [(maker.id, events), *verifier_tasks(maker, ids, again)]
        case "reverify":
            events.append(blocked(maker, "BLOCKED/infrastructure twice in a row", records, "infrastructure"))
    return [(maker.id, events)]


def decide_unblock(s: TaskState, action: UnblockAction, notes: str | None, parent: TaskState | None = None) -> Changes:
    """An operator resolves a blocker. `retry` hands the maker the unmet requirements
    of the latest verdicts and the notes (attempts start again); `reverify` asks
    again every checker without a PASS for this attempt, with the notes. A
    sub-task whose parent's goal is closed, or whose round was reviewed, stays
    as its round left it: the review judged it so, and a later round's review
    would not wait for it."""
    if s.state != "blocked" or s.blocker_id is None:
        raise InvalidTransition(f"task {s.id} is {s.state}, not blocked", state=s.state)
    if parent is not None and parent.state in ("done", "cancelled"):
        raise InvalidTransition(f"task {s.id} belongs to {parent.id}, which is {parent.state}", state=s.state)
    if parent is not None and (s.subtask_round or 1) < (parent.round or 1):
        raise InvalidTransition(f"task {s.id} belongs to round {s.subtask_round or 1} of {parent.id}; "
                                f"round {s.subtask_round or 1} was reviewed", state=s.state)
    if action == "retry":
        return [(s.id, [TaskUnblocked(blocker_id=s.blocker_id, action="retry", notes=notes, attempt=1,
                                      rework_notes=unmet(s.verdicts))])]
    if s.verification is None or (s.maker_node is None and s.maker_worker is None):
        raise InvalidTransition(f"task {s.id} has no completed work to verify again", state=s.state)
    passed = {r.checker: r.verifier_task_id for r in s.verdicts if r.outcome == "PASS"}
    again = [c for c in s.verification.checkers if c not in passed]
    kept = [passed[c] for c in s.verification.checkers if c in passed]
    if not again:  # nothing left unjudged: the operator asks the whole panel again
        again, kept = list(s.verification.checkers), []
    ids = verifier_ids(s, again, s.attempt)
    return [
        (s.id, [TaskUnblocked(blocker_id=s.blocker_id, action="reverify", notes=notes, attempt=s.attempt,
                              verifier_task_ids=ids, kept_verifier_task_ids=kept)]),
        *verifier_tasks(s, ids, again, notes),
    ]
