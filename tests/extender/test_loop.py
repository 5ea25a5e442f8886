"""scheduler_extender.loop.slices: a long sweep gives the loop back between slices."""

from __future__ import annotations

import asyncio

from scheduler_extender.loop import slices


async def test_other_tasks_run_between_slices_and_nothing_is_lost() -> None:
    ran: list[int] = []
    seen: list[int] = []

    async def other() -> None:
        while True:
            ran.append(len(seen))
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    async for part in slices(list(range(10)), 3):
        seen += part
    task.cancel()
    assert seen == list(range(10))
    # the other task ran after each of the first three slices (4 slices: 3 + 3 + 3 + 1), never inside one
    assert {3, 6, 9} <= set(ran) and not set(ran) - {0, 3, 6, 9, 10}
