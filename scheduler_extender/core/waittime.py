"""Wait-time estimation and reservation ("shadow") projection.

Both project the future from what is known now: holders release their devices at their end bound
(admission + exitDuration; never, if unbounded), and queued requests start in queue order as soon as they fit.
Early finishes make real starts earlier, higher-priority arrivals and evictions later, and the real placement
policy may pack differently from the projection's best fit: it is an estimate, and the simulator measures its error.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .inventory import Inventory, Placement
from .placement import PlacementPolicy, Request, fits


class Holder(NamedTuple):
    """An allocation owner in ``inv.allocations`` and when it releases at the latest (inf if unbounded);
    its workspace and device milli matter only for quota-aware estimates."""

    name: str
    end: float
    workspace: str = ""
    milli: int = 0


def holder_order(h: Holder) -> tuple[float, str]:
    return (h.end, h.name)


@dataclass(frozen=True)
class Waiting:
    name: str
    request: Request
    duration: float | None  # exitDuration; None = holds forever once started
    not_before: float = 0.0
    workspace: str = ""


def earliest_fit(
    inv: Inventory, req: Request, holders: Sequence[Holder], now: float, presorted: bool = False
) -> tuple[float, Inventory]:
    """The earliest time ``req`` fits if ``holders`` release at their end bounds (in that order), and the
    projected inventory at that time. ``inf`` (and the fully released state) when it never fits.

    Releases are applied in growing batches, then narrowed by bisection, so the cost is a logarithmic number of
    fit checks rather than one per holder. ``presorted``: ``holders`` already sorted by :func:`holder_order`.
    """
    if fits(inv, req):
        return now, inv
    if presorted:
        order = [h for h in holders if h.name in inv.allocations]
    else:
        order = sorted((h for h in holders if h.name in inv.allocations), key=holder_order)
    state = inv.copy()
    done, step = 0, 1
    while done < len(order):
        prev = state.copy()
        hi = min(len(order), done + step)
        for h in order[done:hi]:
            state.release(h.name)
        if fits(state, req):
            lo, top = done, hi  # the answer is in (lo, top]
            while top - lo > 1:
                mid = (lo + top) // 2
                trial = prev.copy()
                for h in order[done:mid]:
                    trial.release(h.name)
                if fits(trial, req):
                    top = mid
                else:
                    lo = mid
            final = prev.copy()
            for h in order[done:top]:
                final.release(h.name)
            return max(now, order[top - 1].end), final
        done, step = hi, step * 2
    return math.inf, state


def estimate_starts(
    inv: Inventory,
    holders: Sequence[Holder],
    waiting: Sequence[Waiting],
    now: float,
    policy: PlacementPolicy,
    quotas: dict[str, int] | None = None,
) -> dict[str, float]:
    """Estimated start time for each waiting request, in the given (queue) order.

    Requests start in order; one that cannot fit even when everything bounded has been released gets ``inf``
    and does not hold up the ones behind it. With ``quotas`` (device milli per workspace) each request also
    waits, within its own workspace and in order, until the workspace's holders and earlier requests leave
    it room; the estimate is the later of the capacity and the quota projection.
    """
    quotas = quotas or {}
    qusage: dict[str, int] = {}
    qevents: dict[str, list[tuple[float, int]]] = {}
    qclock: dict[str, float] = {}
    for h in holders:
        if h.workspace in quotas:
            qusage[h.workspace] = qusage.get(h.workspace, 0) + h.milli
            heapq.heappush(qevents.setdefault(h.workspace, []), (h.end, h.milli))

    def quota_start(w: Waiting, earliest: float) -> float:
        q = quotas.get(w.workspace)
        if q is None:
            return earliest
        heap = qevents.setdefault(w.workspace, [])
        t = max(earliest, qclock.get(w.workspace, now))
        milli = w.request.milli_total()
        while heap and (heap[0][0] <= t or qusage.get(w.workspace, 0) + milli > q):
            end, m = heapq.heappop(heap)
            qusage[w.workspace] -= m
            t = max(t, end)
        if qusage.get(w.workspace, 0) + milli > q:
            return math.inf
        qclock[w.workspace] = t
        return t

    def quota_hold(w: Waiting, start: float) -> None:
        if w.workspace in quotas and math.isfinite(start):
            qusage[w.workspace] = qusage.get(w.workspace, 0) + w.request.milli_total()
            end = start + w.duration if w.duration is not None else math.inf
            heapq.heappush(qevents.setdefault(w.workspace, []), (end, w.request.milli_total()))

    state = inv.copy()
    events: list[tuple[float, str]] = [(h.end, h.name) for h in holders if h.name in state.allocations]
    heapq.heapify(events)
    # everything that will ever be released, released: a request that does not fit here never will
    final = inv.copy()
    for end, name in events:
        if math.isfinite(end):
            final.release(name)
    clock = now
    out: dict[str, float] = {}
    never: dict[Request, bool] = {}  # request -> does not fit even in `final` (reset when `final` changes)
    for i, w in enumerate(waiting):
        if w.request not in never:
            never[w.request] = not fits(final, w.request)
        if never[w.request]:
            out[w.name] = math.inf
            continue
        clock = max(clock, w.not_before)
        while events and events[0][0] <= clock:
            state.release(heapq.heappop(events)[1])
        p: Placement | None = policy.place(state, w.request)
        while p is None and events and math.isfinite(events[0][0]):
            end, name = heapq.heappop(events)
            clock = max(clock, end)
            state.release(name)
            while events and events[0][0] <= clock:  # everything ending at the same time
                state.release(heapq.heappop(events)[1])
            p = policy.place(state, w.request)
        if p is None:  # only possible when unbounded holders sit differently than in `final`
            out[w.name] = math.inf
            continue
        owner = f"\0wait{i}"
        state.allocate(owner, p)
        if w.duration is None:
            p_final = policy.place(final, w.request)
            if p_final is not None:
                final.allocate(owner, p_final)
                never.clear()
        else:
            heapq.heappush(events, (clock + w.duration, owner))
        start = quota_start(w, clock)
        quota_hold(w, start)
        out[w.name] = start
    return out
