"""The projections taskledger keeps, registered with the framework.

To add one: give it a name, a version (bump it when the fold changes, then
`taskledger rebuild --projection NAME`), the tables it owns with their key,
the streams it reads and a fold (see `projections.framework.Fold`).
"""

from __future__ import annotations

from taskledger.projections import jobs, tasks
from taskledger.projections.framework import Projection, Table, register

TASKS = register(Projection(
    name="tasks", version=tasks.VERSION, tables=(Table("tasks", "id"),), streams="task:",
    new_fold=lambda: tasks.TaskFold(write="tasks"),
    as_of=tasks.state_as_of,
))

BLOCKERS = register(Projection(
    name="blockers", version=1, tables=(Table("blockers", "id"),), streams="task:",
    new_fold=lambda: tasks.TaskFold(write="blockers"),
))

JOBS = register(Projection(
    name="jobs", version=jobs.SCHEMA_VERSION, tables=(Table("jobs", "id"),), streams="job:",
    new_fold=jobs.JobFold,
    as_of=lambda conn, key, seq: jobs.replay(conn, key, to_seq=seq),
))
