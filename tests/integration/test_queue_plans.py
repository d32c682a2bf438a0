"""The statements a busy queue runs all the time keep to their indexes.

Each is explained with sequential scans disabled, so a plan that still reads a
whole table (or walks a whole index and filters it) is one PostgreSQL had no
index condition for, however small the test's tables are. asyncpg prepares
every statement, and after five runs PostgreSQL may keep a generic plan, so the
parameterised ones are explained under `plan_cache_mode = force_generic_plan`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from taskledger.service.writer import tasks as cmds


async def _plan(pool: asyncpg.Pool, sql: str, *args: str, without: str | None = None,
                plans: str = "force_generic_plan") -> list[dict[str, Any]]:
    """Every node of the generic plan of `sql`, its parameters given as typed SQL
    literals (`"'{a}'::text[]"`), `without` an index (dropped for the look and
    restored). PREPARE and EXECUTE: an EXPLAIN sent with parameters would plan
    with their values, a custom plan."""
    name = f"probe_{uuid.uuid4().hex[:8]}"
    types = "(" + ", ".join(a.rsplit("::", 1)[1] for a in args) + ")" if args else ""
    values = "(" + ", ".join(args) + ")" if args else ""
    async with pool.acquire() as c:
        await c.execute("BEGIN")
        try:
            if without is not None:
                await c.execute(f"DROP INDEX {without}")
            await c.execute("SET LOCAL enable_seqscan = off")
            await c.execute(f"SET LOCAL plan_cache_mode = {plans}")
            await c.execute(f"PREPARE {name}{types} AS {sql}")
            raw = await c.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE {name}{values}")
        finally:
            await c.execute("ROLLBACK")  # a dropped index comes back
            await c.execute(f"DEALLOCATE {name}")
    nodes: list[dict[str, Any]] = []

    def walk(n: dict[str, Any]) -> None:
        nodes.append(n)
        for child in n.get("Plans", []):
            walk(child)

    walk(json.loads(raw)[0]["Plan"])
    return nodes


def _project_index(nodes: list[dict[str, Any]]) -> bool:
    """The plan looks the project up in an index (`project = ...` as an index condition)."""
    return any("project =" in n.get("Index Cond", "") for n in nodes)


def _index_cond_on(nodes: list[dict[str, Any]], table: str, column: str) -> bool:
    return any(n.get("Relation Name") == table and column in n.get("Index Cond", "") for n in nodes)


_CLAIM_ARGS = ("'{implement}'::text[]", "'{p}'::text[]", "'w'::text", "'n'::text")


async def test_the_sweepers_poll_looks_up_its_indexes(pool: asyncpg.Pool) -> None:
    nodes = await _plan(pool, cmds.DUE_FOR_SWEEP)
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], nodes
    assert _index_cond_on(nodes, "tasks", "escalate_at"), nodes
    assert _index_cond_on(nodes, "task_leases", "expires_at"), nodes


async def test_a_claim_and_a_collect_keep_to_their_project(pool: asyncpg.Pool) -> None:
    # one project: the claim (and the idle worker's look before it) walks its
    # project's part of tasks_claimable_by_project, not every project's backlog
    for select, limit in (("body::text AS body", 115), ("1", 1)):
        nodes = await _plan(pool, cmds._claim_sql(["p"], select=select, limit=limit), *_CLAIM_ARGS)
        assert _project_index(nodes), nodes
    nodes = await _plan(pool, cmds._COLLECT_SQL, "'p'::text", "10::int")
    assert _project_index(nodes), nodes


async def test_only_a_claim_across_projects_may_walk_every_projects_backlog(pool: asyncpg.Pool) -> None:
    # Which of the two claim-ordered indexes a one-project claim walks was the
    # planner's choice by cost, and statistics tipped it to tasks_claimable.
    # Without its own project's index, it must still not be able to use it,
    # planned for any project or for its own.
    for select, limit in (("body::text AS body", 115), ("1", 1)):
        for plans in ("force_generic_plan", "force_custom_plan"):
            nodes = await _plan(pool, cmds._claim_sql(["p"], select=select, limit=limit), *_CLAIM_ARGS,
                                without="tasks_claimable_by_project", plans=plans)
            assert "tasks_claimable" not in [n.get("Index Name") for n in nodes], (plans, nodes)
    for projects, literal in ((None, "NULL::text[]"), (["p", "q"], "'{p,q}'::text[]")):
        nodes = await _plan(pool, cmds._claim_sql(projects), _CLAIM_ARGS[0], literal, *_CLAIM_ARGS[2:],
                            without="tasks_claimable_by_project")
        assert "tasks_claimable" in [n.get("Index Name") for n in nodes], nodes
