"""Eviction planning: the cheapest set of lower-priority, preemptible holders whose removal lets a request fit.

Candidates are taken lowest priority first, then least work lost (device-milli x seconds held), then name;
they are released one by one on a scratch copy until the request fits; then every chosen victim whose
removal turns out unnecessary is put back (most expensive first), so no proper subset would do. If releasing
every candidate still leaves the request unplaceable, the plan is ``None``: nobody is evicted for nothing.
"""

from __future__ import annotations

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
