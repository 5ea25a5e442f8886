"""scheduler_extender.loop: a long sweep gives the loop back between slices; answers of costly sweeps are kept
longer, so sweeps take a bounded share of the loop."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_extender.loop import DUTY, MAX_LAG, kept_for, slices


async def _sweep(items: list[int], **kw: object) -> tuple[list[int], list[int]]:
    """(what the sweep saw, how far it had got each time another task ran)."""
    ran: list[int] = []
    seen: list[int] = []

    async def other() -> None:
        while True:
            ran.append(len(seen))
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    async for part in slices(items, **kw):  # type: ignore[arg-type]
        seen += part
    task.cancel()
    return seen, ran


async def test_budget_zero_gives_the_loop_back_before_every_slice_and_nothing_is_lost() -> None:
    seen, ran = await _sweep(list(range(10)), size=3, budget=0)
    assert seen == list(range(10))
    # the other task ran after each of the first three slices (4 slices: 3 + 3 + 3 + 1), never inside one
    assert {3, 6, 9} <= set(ran) and not set(ran) - {0, 3, 6, 9, 10}


async def test_the_loop_is_given_back_when_the_budget_is_spent_not_before() -> None:
    clock = [0.0]

    def tick() -> float:  # each look at the clock: 0.2 ms of work done since the last one
        clock[0] += 0.0002
        return clock[0]

    seen, ran = await _sweep(list(range(100)), size=10, budget=0.0005, clock=tick)
    assert seen == list(range(100))
    inside = sorted(set(ran) - {0, 100})
    assert inside and all(n % 10 == 0 for n in inside)  # only between slices
    assert len(inside) < 9  # not before every slice: only once the budget is spent
    fast, ran_fast = await _sweep(list(range(100)), size=10, budget=1.0)
    assert fast == list(range(100)) and not set(ran_fast) - {0, 100}  # a sweep within budget holds the loop


@pytest.mark.parametrize(("max_age", "cost", "expected"), [
    (0.5, 0.001, 0.5),  # cheap sweeps: the configured age
    (0.5, 0.1, 0.1 / DUTY),  # a 100 ms sweep: kept long enough that sweeps take DUTY of the loop
    (0.5, 60.0, MAX_LAG),  # never lagging more than MAX_LAG
    (20.0, 0.1, 20.0),  # a longer configured age stands
])
def test_kept_for(max_age: float, cost: float, expected: float) -> None:
    assert kept_for(max_age, cost) == pytest.approx(expected)
