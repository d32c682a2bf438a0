"""Rules the state machine's oracle (tests/unit/test_task_machine.py) found wrong, over HTTP
against a real PostgreSQL."""

from __future__ import annotations

from tests.conftest import AppHarness
from tests.flows import claim, complete_impl, complete_verify, create_task, project, types_of, view

ANSWERS = {"goal_clear": True, "coverage": "g1 failed, g2 covers it", "next_round": "g2"}


async def test_a_sub_task_of_a_reviewed_round_cannot_be_unblocked_so_the_goal_never_closes_over_it(
    harness: AppHarness,
) -> None:
    proj = project()
    producer = await harness.client("producer")
    maker = await harness.client("worker", node="node-a")
    checker = await harness.client("worker", node="node-b")
    reviewer = await harness.client("reviewer")
    goal = f"{proj}-g"
    await create_task(producer, proj, id=goal, verification=None)
    g1 = await create_task(producer, proj, id=f"{proj}-g1", parent_task_id=goal, retry_predecessor=False)
    t = await claim(maker, proj, ["implement"])
    assert t is not None
    await complete_impl(maker, t)
    v = await claim(checker, proj, ["verify"])
    assert v is not None
    await complete_verify(checker, v, "FAIL")
    assert (await view(producer, g1["id"]))["state"] == "blocked"
    await reviewer.ok(await reviewer.post(f"/tasks/{goal}/round-review", {
        **ANSWERS, "decision": "NEW_ROUND",
        "new_subtasks": [{"id": f"{proj}-g2", "title": "smaller", "verification": None}]}))
    before = await types_of(producer, g1["id"])
    for action in ("retry", "reverify"):
        r = await producer.post(f"/tasks/{g1['id']}/unblock", {"action": action})
        assert r.status_code == 409 and r.json()["code"] == "invalid_transition", r.text
        assert "round 1 was reviewed" in r.json()["detail"]
    assert await types_of(producer, g1["id"]) == before
    t = await claim(maker, proj, ["implement"])
    assert t is not None and t["id"] == f"{proj}-g2"
    await complete_impl(maker, t)
    p = await reviewer.ok(await reviewer.post(f"/tasks/{goal}/round-review", {**ANSWERS,
                                                                               "decision": "GOAL_ACHIEVED"}))
    assert p["state"] == "done"
    assert (await view(producer, g1["id"]))["state"] == "blocked"
