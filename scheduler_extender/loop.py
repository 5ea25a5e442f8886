"""Sharing the event loop that answers the scheduler and the webhooks.

- :func:`slices`: work over many objects (a sweep of the view for the wait-time index or a portal page) gives
  the loop back whenever it has run for :data:`BUDGET` seconds, so a filter or bind request waits about half a
  millisecond for a sweep, never for the whole of it;
- :func:`kept_for`: how long an answer swept from the view is served while the view keeps changing, so that
  sweeps take at most :data:`DUTY` of the loop however often the view changes and however large the cluster;
- :func:`let_go`: what a swap replaced is freed a slice at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
STEP = 100  # objects handled between two looks at the clock
BUDGET = 0.0005  # seconds a sweep may hold the loop before it gives it back
DUTY = 0.05  # share of the loop's time that sweeps of a changing view may take
MAX_LAG = 10.0  # seconds an answer may lag a changing view at most, whatever a sweep costs


async def slices(items: Sequence[T], size: int | None = None, budget: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> AsyncIterator[Sequence[T]]:
    """``items`` in slices of ``size`` (:data:`STEP`); before a slice, the loop is given back if the sweep has
    held it for ``budget`` (:data:`BUDGET`) seconds or more (0: before every slice after the first). Iterate over
    a copy when the loop may change the collection meanwhile."""
    size = size or STEP
    budget = BUDGET if budget is None else budget
    held = clock()
    for start in range(0, len(items), size):
        if start and clock() - held >= budget:
            await asyncio.sleep(0)
            held = clock()
        yield items[start:start + size]


def kept_for(max_age: float, cost: float, duty: float = DUTY, cap: float = MAX_LAG) -> float:
    """Seconds to keep serving an answer whose sweep took ``cost`` seconds while the view changes: ``max_age``,
    or longer when sweeping every ``max_age`` would take more than ``duty`` of the loop (never over ``cap``)."""
    return max(max_age, min(cap, cost / duty))


async def let_go(*replaced: dict[Any, Any]) -> None:
    """Drop what a swap replaced a slice at a time: the last reference to thousands of objects freed at once
    holds the loop (5 ms for 2,000 real nodes' views). Pass the dicts without keeping a reference to them
    (``await let_go(self._take(...))``): the values are let go of here, a slice at a time, once the dicts are
    gone; a dict someone else still holds keeps its objects, and nothing is lost."""
    values = [v for d in replaced for v in d.values()]
    del replaced
    held = time.perf_counter()
    while values:
        del values[-STEP:]
        if time.perf_counter() - held >= BUDGET:
            await asyncio.sleep(0)
            held = time.perf_counter()
