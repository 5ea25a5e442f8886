"""Where a GPR one would submit now would stand and when it would start, from the view alone (``POST
/api/v1/waittime``): no pass is run, the controller's estimates in the GPRs' statuses are the basis.

Position: behind every queued GPR of higher or equal priority. Start: now when nothing of its resource waits
ahead of it and enough healthy nodes have the devices free; otherwise the latest estimated start the controller
wrote for a GPR of the same resource ahead of it (its range: the latest P10 and P90 of theirs), or — with
nothing ahead — the time enough holders reach their end bound (admission + exitDuration). ``estimable`` is
false when no bound exists.

:class:`WhatIf` answers from an index of the view (queued GPRs by priority with running maxima of their
estimates, free devices per node, holders by end bound), rebuilt in one sweep of O(nodes + GPRs) when the view
has changed and the index is older than ``max_age`` seconds — or older than twenty times what the last sweep
cost, so that sweeps take at most 5% of the loop on a cluster whose view changes all the time (:func:`.loop.kept_for`:
about 2 s at 5,000 nodes and 15,000 GPRs, never over 10 s). An answer then costs O(log GPRs), so a burst of
requests (a portal's live estimate as its user types) never costs a sweep each. The sweep runs on the event
loop that also answers the scheduler, so it runs in slices (:mod:`.loop`: a filter request waits about half a
millisecond for it), and a request that finds the index stale is answered from the previous one while the next
is built. The answer may lag the view by that age plus one sweep, as the estimates it relays lag the
controller's pass (which refreshes them every 30 s).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_extender import gpr_resource as gr
from scheduler_extender.cluster import ALLOCATED, HOLDING, ClusterView
from scheduler_extender.loop import kept_for, slices


@dataclass
class _Resource:
    """One resource's part of the index."""

    neg_priority: list[int] = field(default_factory=list)  # queued GPRs' -priority, ascending (priority first)
    start_max: list[float] = field(default_factory=list)  # running max of estimatedStart over that order
    start_missing: list[int] = field(default_factory=list)  # running count of GPRs without one
    low_max: list[float] = field(default_factory=list)  # running max of the range's P10 ...
    high_max: list[float] = field(default_factory=list)  # ... and P90
    range_missing: list[int] = field(default_factory=list)
    free: dict[str, tuple[int, int]] = field(default_factory=dict)  # healthy node -> (allocatable, free)
    free_at_least: list[int] = field(default_factory=list)  # [k]: healthy nodes with >= k devices free
    ends: list[tuple[float, str, int]] = field(default_factory=list)  # holders' (end bound, node, devices)
    memo: dict[tuple[int, int], tuple[float, str]] = field(default_factory=dict)  # of after_ends

    def ahead(self, priority: int) -> int:
        return bisect.bisect_right(self.neg_priority, -priority)

    def fits_now(self, per_node: int, count: int) -> bool:
        return per_node < len(self.free_at_least) and self.free_at_least[per_node] >= count

    def after_ends(self, per_node: int, count: int) -> tuple[float, str]:
        """When enough holders reach their end bound for ``count`` nodes with ``per_node`` devices free."""
        hit = self.memo.get((per_node, count))
        if hit is not None:
            return hit
        free = {name: f for name, (alloc, f) in self.free.items() if alloc >= per_node}
        enough = sum(1 for f in free.values() if f >= per_node)
        answer: tuple[float, str] = (math.inf, "more than the healthy cluster has")
        for end, name, n in self.ends:
            if name not in free:
                continue
            if not math.isfinite(end):
                answer = (math.inf, "an unbounded holder is in the way")
                break
            before = free[name]
            free[name] = before + n
            enough += before < per_node <= before + n
            if enough >= count:
                answer = (end, "when holders reach their exitDuration")
                break
        self.memo[per_node, count] = answer
        return answer


@dataclass
class _Index:
    version: int
    built: float
    neg_priority: list[int]  # every queued GPR's -priority, ascending
    resources: dict[str, _Resource]
    holding: int
    cost: float = 0.0  # seconds from the start of its sweep to its end


async def build_index(view: ClusterView, version: int, built: float) -> _Index:
    """One sweep of the view (over copies of its node and GPR lists: the view changes while the sweep yields).
    Every step over GPRs or nodes runs in :func:`.loop.slices`: none holds the loop for more than a slice
    (a sort of 10,000 queued GPRs and three passes of running maxima over them, run in one piece, held the
    extender's loop for 5-10 ms, the tail of its filter latency)."""
    resources: dict[str, _Resource] = {}
    # resource -> -priority -> queued GPRs of that priority, in the view's order (the order a stable sort by
    # priority would give, without sorting 10,000 rows in one piece)
    queued: dict[str, dict[int, list[tuple[float | None, tuple[float, float] | None]]]] = {}
    levels: dict[int, int] = {}  # -priority -> queued GPRs of every resource
    holding = 0
    gprs, nodes = list(view.gprs.values()), list(view.nodes.values())
    async for part in slices(gprs):
        for g in part:
            if g.phase == "Queued":
                neg = -g.priority
                levels[neg] = levels.get(neg, 0) + 1
                queued.setdefault(g.resource, {}).setdefault(neg, []).append((g.estimated_start, g.estimated_range))
            elif g.phase in HOLDING:
                holding += 1
    for resource in {*view.resources, *queued}:
        r = resources[resource] = _Resource()
        start_top = low_top = high_top = -math.inf
        start_missing = range_missing = 0
        for neg, rows in sorted(queued.get(resource, {}).items()):
            async for chunk in slices(rows):
                for start, span in chunk:  # running maxima of the estimates over the queue's order
                    if start is None:
                        start_missing += 1
                    elif start > start_top:
                        start_top = start
                    if span is None:
                        range_missing += 1
                    else:
                        low_top, high_top = max(low_top, span[0]), max(high_top, span[1])
                    r.neg_priority.append(neg)
                    r.start_max.append(start_top)
                    r.start_missing.append(start_missing)
                    r.low_max.append(low_top)
                    r.high_max.append(high_top)
                    r.range_missing.append(range_missing)
        counts: list[int] = []
        async for batch in slices(nodes):
            for node in batch:
                alloc = node.allocatable.get(resource, 0)
                if alloc <= 0 or node.health_reason(resource) or node.ledger_error:
                    continue
                free = view.free_for(node, resource, "")
                r.free[node.name] = (alloc, free)
                if free >= len(counts):
                    counts += [0] * (free + 1 - len(counts))
                counts[free] += 1
        total = 0
        r.free_at_least = [0] * len(counts)
        for k in range(len(counts) - 1, -1, -1):
            total += counts[k]
            r.free_at_least[k] = total
    async for part in slices(gprs):
        for g in part:
            if g.phase in ALLOCATED and g.resource in resources:
                r = resources[g.resource]
                r.ends += [(g.end, name, n) for name, n in g.reservation.items() if name in r.free]
    for r in resources.values():
        await asyncio.sleep(0)
        r.ends.sort()  # some thousands of holders: about a millisecond
    everyone = [neg for neg in sorted(levels) for _ in range(levels[neg])]  # every queued GPR's -priority, sorted
    return _Index(version, built, everyone, resources, holding)


class WhatIf:
    def __init__(self, view: ClusterView, max_age: float = 0.5,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.view, self.max_age, self.monotonic = view, max_age, monotonic
        self._index: _Index | None = None
        self._building: asyncio.Task[_Index] | None = None
        self.builds = 0

    async def index(self) -> _Index:
        """The current index; a stale one starts the next sweep and is used meanwhile (the first is awaited)."""
        idx, version, now = self._index, self.view.version, self.monotonic()
        if idx is not None and (idx.version == version or now - idx.built < kept_for(self.max_age, idx.cost)):
            return idx
        if self._building is None:
            self._building = asyncio.create_task(self._build(version, now))
        return idx if idx is not None else await asyncio.shield(self._building)

    async def _build(self, version: int, now: float) -> _Index:
        try:
            idx = await build_index(self.view, version, now)
            idx.cost = self.monotonic() - now
            self._index = idx
            self.builds += 1
            return idx
        finally:
            self._building = None

    async def answer(self, fields: dict[str, Any], now: float) -> dict[str, Any]:
        idx = await self.index()
        resource, priority = fields["resource"], fields["priority"]
        per_node, count = fields["devices_per_node"], fields["node_count"]
        r = idx.resources.get(resource) or _Resource()
        same = r.ahead(priority)
        start, basis = math.inf, ""
        span: tuple[float, float] | None = None
        if not same and r.fits_now(per_node, count):
            start, basis = now, "fits now"
        elif same:
            if r.start_missing[same - 1] == 0:
                start, basis = max(now, r.start_max[same - 1]), "after the GPRs ahead of it"
                if r.range_missing[same - 1] == 0:  # it starts no earlier than the last of them
                    span = (max(now, r.low_max[same - 1]), max(now, r.high_max[same - 1]))
            else:
                basis = "a GPR ahead of it has no estimate yet"
        else:
            end, basis = r.after_ends(per_node, count)
            if math.isfinite(end):
                start = max(now, end)
        out_range = None
        if span is not None and math.isfinite(start):
            out_range = {"earliest": gr.rfc3339(min(span[0], start)), "latest": gr.rfc3339(max(span[1], start))}
        elif math.isfinite(start) and basis == "fits now":
            out_range = {"earliest": gr.rfc3339(start), "latest": gr.rfc3339(start)}
        return {"queuePosition": bisect.bisect_right(idx.neg_priority, -priority) + 1,
                "estimatedStart": gr.rfc3339(start) if math.isfinite(start) else None,
                "estimatedStartRange": out_range,
                "waitSeconds": round(start - now, 3) if math.isfinite(start) else None,
                "estimable": math.isfinite(start), "basis": basis, "admittedGPRs": idx.holding}
