"""Where a GPR one would submit now would stand and when it would start, from the view alone (``POST
/api/v1/waittime``): no pass is run, the controller's estimates in the GPRs' statuses are the basis.

Position: behind every queued GPR of higher or equal priority. Start: now when nothing of its resource waits
ahead of it and enough healthy nodes have the devices free; otherwise the latest estimated start the controller
wrote for a GPR of the same resource ahead of it (its range: the latest P10 and P90 of theirs), or — with
nothing ahead — the time enough holders reach their end bound (admission + exitDuration). ``estimable`` is
false when no bound exists.

:class:`WhatIf` answers from an index of the view (queued GPRs by priority with running maxima of their
estimates, free devices per node, holders by end bound), swept again when the nodes or the GPRs have changed
(pods do not count here) and the index is older than ``max_age`` seconds — or older than twenty times what the
last sweep held the loop, so that sweeps take at most 5% of the loop on a cluster whose view changes all the
time (:func:`.loop.kept_for`, never over 10 s). A sweep takes what the last one found where its inputs are the
same: the GPRs' part (10,000 queued GPRs' order and estimates, the holders' end bounds) while no GPR changed, a
node's free devices while its object is the same one, so a bind costs a pass over the node list and the change
of one node. An answer then costs O(log GPRs), so a burst of requests (a portal's live estimate as its user
types) never costs a sweep each. The sweep runs on the event loop that also answers the scheduler, so it runs
in slices with gaps between them (:class:`.loop.Sweep`: a filter request waits about half a millisecond for it,
once), and a request that finds the index stale is answered from the previous one while the next is built.
The answer may lag the view by that age plus one sweep, as the estimates it relays lag the controller's pass
(which refreshes them every 30 s).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import ALLOCATED, HOLDING, ClusterView, NodeView
from service.loop import Sweep, kept_for


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


# a node's part of the index: the NodeView swept and (allocatable, free) of each resource in the index's order,
# None where no new work goes
_NodeFacts = tuple[NodeView, tuple[tuple[int, int] | None, ...]]


@dataclass
class _Queues:
    """What the index takes from the GPRs alone, kept while no GPR changes (pods and nodes change far more often)."""

    version: int  # the view's gprs_version when the sweep began
    resources: dict[str, _Resource]  # the queued GPRs' running maxima; ends: every holder's, sorted
    everyone: list[int]  # every queued GPR's -priority, ascending
    holding: int


@dataclass
class _Index:
    version: tuple[int, int]  # the view's (nodes_version, gprs_version) when the sweep began
    built: float
    neg_priority: list[int]  # every queued GPR's -priority, ascending
    resources: dict[str, _Resource]
    holding: int
    cost: float = 0.0  # seconds its sweep held the loop
    queues: _Queues | None = None
    # node -> its facts, valid while the GPRs are those of ``queues`` (what is free on a node depends on its object
    # and the reservations on it)
    per_node: dict[str, _NodeFacts] = field(default_factory=dict)


async def _sweep_gprs(view: ClusterView, sweep: Sweep) -> _Queues:
    version = view.gprs_version
    resources: dict[str, _Resource] = {}
    # resource -> -priority -> queued GPRs of that priority, in the view's order (the order a stable sort by
    # priority would give, without sorting 10,000 rows in one piece)
    queued: dict[str, dict[int, list[tuple[float | None, tuple[float, float] | None]]]] = {}
    levels: dict[int, int] = {}  # -priority -> queued GPRs of every resource
    ends: dict[str, list[tuple[float, str, int]]] = {}
    holding = 0
    async for part in sweep.slices(list(view.gprs.values())):  # a copy: the view changes while the sweep yields
        for g in part:
            if g.phase == "Queued":
                neg = -g.priority
                levels[neg] = levels.get(neg, 0) + 1
                queued.setdefault(g.resource, {}).setdefault(neg, []).append((g.estimated_start, g.estimated_range))
            elif g.phase in HOLDING:
                holding += 1
            if g.phase in ALLOCATED:
                held = ends.get(g.resource)
                if held is None:
                    held = ends[g.resource] = []
                for name, n in g.reservation.items():
                    held.append((g.end, name, n))
    for resource in {*view.resources, *queued}:
        r = resources[resource] = _Resource()
        start_top = low_top = high_top = -math.inf
        start_missing = range_missing = 0
        for neg, rows in sorted(queued.get(resource, {}).items()):
            async for chunk in sweep.slices(rows):
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
        await sweep.breathe()
        r.ends = sorted(ends.get(resource, ()))  # some thousands of holders: about a millisecond
    everyone = [neg for neg in sorted(levels) for _ in range(levels[neg])]  # every queued GPR's -priority, sorted
    return _Queues(version, resources, everyone, holding)


async def build_index(view: ClusterView, built: float, prior: _Index | None = None) -> _Index:
    """One sweep of the view (over copies of its node and GPR lists: the view changes while the sweep yields),
    in slices (:class:`.loop.Sweep`: a sort of 10,000 queued GPRs and three passes of running maxima over them,
    run in one piece, held the extender's loop for 5-10 ms, the tail of its filter latency). What ``prior``
    swept is taken again where its inputs are the same: the GPRs' part while no GPR changed, a node's free
    devices while its object is the same one (a bind changes one node; a pod event, none of this)."""
    sweep = Sweep()
    version = (view.nodes_version, view.gprs_version)
    queues = prior.queues if prior is not None and prior.queues is not None else None
    if queues is None or queues.version != view.gprs_version:
        queues = await _sweep_gprs(view, sweep)
        kept: dict[str, _NodeFacts] = {}
    else:
        kept = prior.per_node if prior is not None else {}
    per_node: dict[str, _NodeFacts] = {}
    resources = {name: _Resource(q.neg_priority, q.start_max, q.start_missing, q.low_max, q.high_max,
                                 q.range_missing) for name, q in queues.resources.items()}
    counts: dict[str, list[int]] = {name: [] for name in resources}
    # the resources in the order of queues.resources: a node's facts line up with them while that part is kept
    columns = [(name, r.free, counts[name]) for name, r in resources.items()]
    async for batch in sweep.slices(list(view.nodes.values())):
        for node in batch:
            hit = kept.get(node.name)
            if hit is None or hit[0] is not node:  # (allocatable, free) of each resource; None: no new work there
                hit = (node, tuple([
                    (alloc, view.free_for(node, resource, "")) if (alloc := node.allocatable.get(resource, 0)) > 0
                    and not node.ledger_error and not node.health_reason(resource) else None
                    for resource, _, _ in columns]))
            per_node[node.name] = hit
            for (_, free_of, tally), got in zip(columns, hit[1], strict=True):
                if got is not None:
                    free_of[node.name] = got
                    free = got[1]
                    if free >= len(tally):
                        tally += [0] * (free + 1 - len(tally))
                    tally[free] += 1
    for name, r in resources.items():
        total, tally = 0, counts[name]
        r.free_at_least = [0] * len(tally)
        for k in range(len(tally) - 1, -1, -1):
            total += tally[k]
            r.free_at_least[k] = total
        await sweep.breathe()
        r.ends = [e for e in queues.resources[name].ends if e[1] in r.free]  # on healthy nodes only, in order
    return _Index(version, built, queues.everyone, resources, queues.holding, sweep.done(), queues, per_node)


class WhatIf:
    def __init__(self, view: ClusterView, max_age: float = 0.5,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.view, self.max_age, self.monotonic = view, max_age, monotonic
        self._index: _Index | None = None
        self._building: asyncio.Task[_Index] | None = None
        self.builds = 0

    async def index(self) -> _Index:
        """The current index; a stale one starts the next sweep and is used meanwhile (the first is awaited)."""
        idx, version, now = self._index, (self.view.nodes_version, self.view.gprs_version), self.monotonic()
        if idx is not None and (idx.version == version or now - idx.built < kept_for(self.max_age, idx.cost)):
            return idx
        if self._building is None:
            self._building = asyncio.create_task(self._build(now))
        return idx if idx is not None else await asyncio.shield(self._building)

    async def _build(self, now: float) -> _Index:
        try:
            idx = await build_index(self.view, now, self._index)
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
