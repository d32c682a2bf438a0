"""Shutdown never waits forever on a background task that swallowed a cancellation."""

from __future__ import annotations

import asyncio

from taskledger.service.background import cancel_all


async def test_a_task_that_swallows_one_cancellation_is_cancelled_again_until_it_ends() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 1:
                    continue  # what a cancellation lost inside wait_for looks like
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all([task], every=0.05), 5)
    assert task.cancelled()
    assert swallowed == 2


async def test_finished_tasks_are_left_alone() -> None:
    done = asyncio.create_task(asyncio.sleep(0, result=7))
    await done
    await cancel_all([done])
    assert done.result() == 7
