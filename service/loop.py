"""Sharing the event loop that answers the scheduler and the webhooks.

- :func:`slices`: work over many objects that a request waits for (a portal page, a relist) gives the loop back
  whenever it has run for :data:`BUDGET` seconds, so a filter or bind request waits about half a millisecond
  for a sweep, never for the whole of it;
- :class:`Sweep`: background work that nobody waits for (the wait-time index) does the same across all its
  steps, and after each slice leaves the loop alone for :data:`GAP` seconds, so that a request that arrived
  meanwhile runs through all its steps before the sweep takes the loop again;
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
GAP = 0.0005  # seconds a background sweep leaves the loop to others after each slice


async def slices(items: Sequence[T], size: int | None = None, budget: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> AsyncIterator[Sequence[T]]:
    """``items`` in slices of ``size`` (:data:`STEP`); before a slice, the loop is given back if the sweep has
    held it for ``budget`` (:data:`BUDGET`) seconds or more (0: before every slice after the first). Iterate over
    a copy when the loop may change the collection meanwhile."""
    async for part in Sweep(budget, 0.0, clock).slices(items, size):  # a bare yield: the request waits for it
        yield part


class Sweep:
    """One piece of background work on the loop that answers the scheduler, in slices.

    The budget runs across every step of the work (a sweep over many short lists gives the loop back as often as
    one over a long list), and when it gives the loop back it sleeps ``gap`` seconds rather than yielding for one
    round: with a bare yield each step of a request that arrived meanwhile (read, handle, write) waited for
    another slice of the sweep, and a filter took 2-3 ms instead of 0.9 ms while the wait-time index was rebuilt
    (5,000 nodes, 15,000 GPRs). The sweep takes at most about half of the loop while it runs, and longer in wall
    time, which nobody waits for. :attr:`held` counts the seconds it held the loop: its cost."""

    def __init__(self, budget: float | None = None, gap: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = BUDGET if budget is None else budget
        self.gap = GAP if gap is None else gap
        self.clock = clock
        self.held = 0.0
        self._since = clock()

    async def breathe(self) -> None:
        """Give the loop back if this sweep's slice is spent (call between two steps of the work)."""
        now = self.clock()
        if now - self._since >= self.budget:
            self.held += now - self._since
            await asyncio.sleep(self.gap)
            self._since = self.clock()

    async def slices(self, items: Sequence[T], size: int | None = None) -> AsyncIterator[Sequence[T]]:
        """``items`` in slices of ``size`` (:data:`STEP`), the loop given back between them when the budget is
        spent. Iterate over a copy when the loop may change the collection meanwhile."""
        size = size or STEP
        for start in range(0, len(items), size):
            if start:
                await self.breathe()
            yield items[start:start + size]

    def done(self) -> float:
        """The seconds this sweep held the loop, now that it has ended."""
        now = self.clock()
        self.held += now - self._since
        self._since = now
        return self.held


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
