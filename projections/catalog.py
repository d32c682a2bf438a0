"""The projections taskledger keeps, as data for the framework.

To add one: give it a name, a version (bump it when the fold changes, then
`taskledger rebuild --projection NAME`), the tables it owns with their key,
the streams it reads and a fold (see `projections.framework.Fold`), and list
it in `PROJECTIONS`. The framework imports nothing from here: callers hand it
the projections they mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from taskledger.projections import framework, jobs, tasks
from taskledger.projections.framework import Projection, Table

TASKS: Final = Projection(
    name="tasks", version=tasks.VERSION, tables=(Table("tasks", "id"),), streams="task:",
    new_fold=tasks.TaskFold,
    as_of=tasks.state_as_of,
)

BLOCKERS: Final = Projection(
    name="blockers", version=1, tables=(Table("blockers", "id"),), streams="task:",
    new_fold=tasks.BlockerFold, types=tasks.BLOCKER_EVENTS,
)

JOBS: Final = Projection(
    name="jobs", version=jobs.SCHEMA_VERSION, tables=(Table("jobs", "id"),), streams="job:",
    new_fold=jobs.JobFold,
    as_of=lambda conn, key, seq: jobs.replay(conn, key, to_seq=seq),
)

PROJECTIONS: Final[tuple[Projection, ...]] = (TASKS, BLOCKERS, JOBS)


def names() -> list[str]:
    return [p.name for p in PROJECTIONS]


def get(name: str) -> Projection:
    """The projection called `name`, or KeyError."""
    return select([name])[0]


def select(chosen: Sequence[str] | None) -> list[Projection]:
    """The named projections (all when `chosen` is empty), or KeyError naming the unknown ones."""
    return framework.select(PROJECTIONS, chosen)
