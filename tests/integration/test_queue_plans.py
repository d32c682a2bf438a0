"""The statements a busy queue runs all the time keep to their indexes.

Each is explained with sequential scans disabled, so a plan that still reads a
whole table (or walks a whole index and filters it) is one PostgreSQL had no
index condition for, however small the test's tables are. asyncpg prepares
every statement, and after five runs PostgreSQL may keep a generic plan, so the
parameterised ones are explained under `plan_cache_mode = force_generic_plan`.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from taskledger.service.writer import tasks as cmds


async def _plan(pool: asyncpg.Pool, sql: str, *args: Any) -> list[dict[str, Any]]:
    """Every node of the plan, for `sql` with `args` under a generic plan."""
    async with pool.acquire() as c, c.transaction():
        await c.execute("SET LOCAL enable_seqscan = off")
        await c.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        stmt = await c.prepare(f"EXPLAIN (FORMAT JSON) {sql}")
        raw = await stmt.fetchval(*args)
    nodes: list[dict[str, Any]] = []

    def walk(n: dict[str, Any]) -> None:
        nodes.append(n)
        for child in n.get("Plans", []):
            walk(child)

    walk(json.loads(raw)[0]["Plan"])
    return nodes


def _index_cond_on(nodes: list[dict[str, Any]], table: str, column: str) -> bool:
    return any(n.get("Relation Name") == table and column in n.get("Index Cond", "") for n in nodes)


async def test_the_sweepers_poll_looks_up_its_indexes(pool: asyncpg.Pool) -> None:
    nodes = await _plan(pool, cmds.DUE_FOR_SWEEP)
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"], nodes
    assert _index_cond_on(nodes, "tasks", "escalate_at"), nodes
    assert _index_cond_on(nodes, "task_leases", "expires_at"), nodes


async def test_a_claim_and_a_collect_keep_to_their_project(pool: asyncpg.Pool) -> None:
    # one project: the claim (and the idle worker's look before it) walks its
    # project's part of tasks_claimable_by_project, not every project's backlog
    for select, limit in (("body::text AS body", 115), ("1", 1)):
        nodes = await _plan(pool, cmds._claim_sql(["p"], select=select, limit=limit),
                            ["implement"], ["p"], "w", "n")
        assert _index_cond_on(nodes, "tasks", "project"), nodes
    nodes = await _plan(pool, cmds._COLLECT_SQL, "p", 10)
    assert _index_cond_on(nodes, "tasks", "project"), nodes
