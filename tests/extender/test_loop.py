"""service.loop: a long sweep gives the loop back between slices; answers of costly sweeps are kept
longer, so sweeps take a bounded share of the loop."""

from __future__ import annotations

import asyncio

import pytest

from service.loop import DUTY, MAX_LAG, Sweep, kept_for, slices


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


async def _interleaved(sweep: Sweep, slices_: int, steps: int) -> list[str]:
    """What ran in which order: a sweep's slices ("S") and the steps of requests ("r") that arrive while it runs,
    each request taking ``steps`` rounds of the loop (read, handle, write)."""
    order: list[str] = []

    async def request() -> None:
        for _ in range(steps):
            order.append("r")
            await asyncio.sleep(0)

    async def work() -> None:
        async for _ in sweep.slices(list(range(slices_)), size=1):
            order.append("S")
            if len(order) == 1:  # a request arrives while the first slice runs
                asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(request()))

    await work()
    await asyncio.sleep(0.01)
    return order


async def test_a_background_sweep_lets_a_request_run_all_its_steps_before_its_next_slice() -> None:
    # with a bare yield (gap 0) each step of the request waits for a slice of the sweep
    assert "".join(await _interleaved(Sweep(budget=0, gap=0), 5, 3)) == "SSrSrSrS"
    # with a gap, the request runs through before the sweep takes the loop again
    assert "".join(await _interleaved(Sweep(budget=0, gap=0.002), 5, 3)) == "SrrrSSSS"


async def test_a_sweeps_budget_runs_across_its_steps_and_its_cost_is_the_time_it_held_the_loop() -> None:
    clock = [0.0]

    def tick() -> float:  # each look at the clock: 0.2 ms of work done since the last one
        clock[0] += 0.0002
        return clock[0]

    sweep = Sweep(budget=0.0005, gap=0, clock=tick)
    gave_back = 0
    for _ in range(10):  # ten short lists, one slice each: the budget is spent across them
        before = clock[0]
        await sweep.breathe()
        gave_back += clock[0] - before > 0.0003  # breathe looked twice: it gave the loop back
    assert 2 <= gave_back <= 5
    held = sweep.done()
    assert held == pytest.approx(clock[0] - 0.0002 - gave_back * 0.0002)  # not the looks taken while away
