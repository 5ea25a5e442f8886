"""Eviction planning: the cheapest set of lower-priority, preemptible holders whose removal lets a request fit.

Candidates are taken lowest priority first, then least work lost (device-milli x seconds held), then name;
they are released one by one on a scratch copy until the request fits; then every chosen victim whose
removal turns out unnecessary is put back (most expensive first), so no proper subset would do. If releasing
every candidate still leaves the request unplaceable, the plan is ``None``: nobody is evicted for nothing.

Whether a plan is carried out is the :class:`EvictionRule`'s call: the work the victims lose weighed against the
waiting the preemptor is spared, with a wait past which it evicts whatever the cost (the priority guarantee).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .inventory import Inventory
from .placement import Request, fits


@dataclass(frozen=True)
class Candidate:
    """A holder that might be evicted: allocation owner name, priority, whether preemptible, work lost."""

    name: str
    priority: int
    preemptible: bool
    work_lost: float
    milli: int = 0  # device milli it holds (counts towards ``need_milli``)


# defaults of the rule (SchedulerConfig.eviction_cost_ratio / eviction_max_wait_s). On the Philly cut at load 1,
# evicting whenever it made room cost 81 evictions and 629 GPU-hours of redone work for 5 s of mean wait
# (docs/simulator.md); a victim had run 7.8 GPU-hours on average, a preemptor typically waits minutes
EVICTION_COST_RATIO = 1.0
EVICTION_MAX_WAIT_S = 1800.0


@dataclass(frozen=True)
class EvictionRule:
    """When an eviction that makes room is worth what it destroys.

    Evict when the device-hours the victims have run (work they lose: they restart from the beginning) are at most
    ``cost_ratio`` x the device-hours of waiting the preemptor is spared (its devices x the wait it would still
    have without evicting, holders leaving at their predicted ends), or when that wait would make it wait
    ``max_wait_s`` or longer in all (already waited + still to wait): high-priority work never waits long for
    lower-priority work to make room, whatever the cost. ``cost_ratio`` None: evict whenever it makes room.
    """

    cost_ratio: float | None = EVICTION_COST_RATIO
    max_wait_s: float = EVICTION_MAX_WAIT_S

    def __post_init__(self) -> None:
        if self.cost_ratio is not None and not (math.isfinite(self.cost_ratio) and self.cost_ratio >= 0):
            raise ValueError(f"eviction_cost_ratio: must be a finite number >= 0 or None, got {self.cost_ratio!r}")
        if math.isnan(self.max_wait_s) or self.max_wait_s < 0:
            raise ValueError(f"eviction_max_wait_s: must be >= 0 (inf: never regardless of cost), "
                             f"got {self.max_wait_s!r}")

    @property
    def weighs(self) -> bool:
        """False when every eviction that makes room is carried out (no cost to weigh)."""
        return self.cost_ratio is not None

    def allows(self, lost: float, preemptor_milli: int, waited_s: float, wait_left_s: float) -> bool:
        """``lost``: device-milli x seconds the victims have run; ``preemptor_milli``: the devices the preemptor
        takes; ``waited_s``: how long it has waited; ``wait_left_s``: how long it would still wait without
        evicting (inf: nobody can say when it would fit)."""
        if self.cost_ratio is None or lost <= 0:
            return True
        if waited_s + wait_left_s >= self.max_wait_s:
            return True
        return lost <= self.cost_ratio * preemptor_milli * wait_left_s

    def describe(self) -> str:
        if self.cost_ratio is None:
            return "evict whenever it makes room"
        return (f"evict when the victims' lost GPU-hours are at most {self.cost_ratio:g} x the preemptor's GPU-hours "
                f"of waiting spared, or when it would otherwise wait {self.max_wait_s:g} s or more")


def plan_eviction(
    inv: Inventory, req: Request, priority: int, candidates: list[Candidate], need_milli: int = 0
) -> list[str] | None:
    """Names to evict (possibly empty if ``req`` already fits) or None if eviction cannot make it fit.

    Only candidates with ``preemptible`` set and a priority strictly below ``priority`` are considered.
    ``need_milli``: the victims must also hold at least this much between them (to free a workspace quota).
    """

    def ok(state: Inventory, chosen: list[Candidate]) -> bool:
        return fits(state, req) and sum(c.milli for c in chosen) >= need_milli

    if ok(inv, []):
        return []
    eligible = sorted(
        (c for c in candidates if c.preemptible and c.priority < priority and c.name in inv.allocations),
        key=lambda c: (c.priority, c.work_lost, c.name),
    )
    scratch = inv.copy()
    chosen: list[Candidate] = []
    for c in eligible:
        scratch.release(c.name)
        chosen.append(c)
        if ok(scratch, chosen):
            break
    else:
        return None
    # put back whatever is not needed, most expensive first
    for c in sorted(chosen[:-1], key=lambda c: (-c.priority, -c.work_lost, c.name)):
        # as it was: a victim on a node closed since (cordoned) holds devices no new placement may take
        scratch.allocate(c.name, inv.allocations[c.name], healthy_only=False)
        if ok(scratch, [x for x in chosen if x is not c]):
            chosen.remove(c)
        else:
            scratch.release(c.name)
    return [c.name for c in chosen]
