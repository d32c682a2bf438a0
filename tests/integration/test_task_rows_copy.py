"""The rebuild writes new task rows with COPY in text format, formatted by hand: every
value must arrive as the upsert of the command path writes it, whatever it holds."""

from __future__ import annotations

import asyncpg
import msgspec

from taskledger.events.task.state import TaskState
from taskledger.projections import framework
from taskledger.projections import tasks as task_rows

ODD = 'tab\there, new\nline, cr\r, back\\slash, "quote", {brace}, comma, ünïcode ✓, \\N, \\.'


def _states() -> list[TaskState]:
    plain = TaskState(id="T1", project="p", title="t", created_at="2026-01-01T00:00:00.000000Z",
                      updated_at="2026-01-01T00:00:00.000000Z", version=1, seq=1)
    odd = TaskState(
        id="T2" + ODD, project="p" + ODD, title=ODD, spec=ODD, task_type="verify", state="pending",
        parent_task_id=ODD, subtask_round=3, is_parent=True, priority=-7, assignee=ODD,
        node_blacklist=[ODD, "n\\1", 'n"2', "n,3", ""], maker_node=ODD, maker_worker=ODD, labels=[ODD],
        escalate_after_seconds=90, ready_at="2026-01-01T00:00:00.000001Z", result={"x": ODD, "n": [1, None]},
        created_at="2026-01-01T00:00:00.000000Z", updated_at="2026-01-01T00:00:00.000000Z", version=4, seq=9,
    )
    escalating = msgspec.structs.replace(plain, id="T3", escalate_after_seconds=60,
                                         ready_at="2026-01-01T00:00:00.000000Z")
    return [plain, odd, escalating]


async def test_rows_copied_as_text_equal_the_rows_the_upsert_writes(pool: asyncpg.Pool) -> None:
    states = _states()
    created = {s.id: 100 + i for i, s in enumerate(states)}
    async with pool.acquire() as conn:
        copied = await framework.create_shadow(conn, "tasks", "__copied")
        upserted = await framework.create_shadow(conn, "tasks", "__upserted")
        fold = task_rows.TaskFold()
        fold._conn, fold._table = conn, copied.name
        await fold._write(states, [], dict(created))
        await task_rows.save(conn, states, created, table=upserted.name)
        rows = [await conn.fetch(f"SELECT to_jsonb(t)::text AS r FROM {t} t ORDER BY id")
                for t in (copied.name, upserted.name)]
        bodies = await conn.fetch(f"SELECT body::text AS b FROM {copied.name} ORDER BY id")
    assert rows[0] == rows[1]
    assert len(rows[0]) == 3
    assert [task_rows.decode_state(r["b"]) for r in bodies] == sorted(states, key=lambda s: s.id)
    assert '"escalate_at": null' not in rows[0][2]["r"]
