"""Wait-time estimation and reservation ("shadow") projection.

Both project the future from what is known now: holders release their devices at their end bound
(admission + exitDuration; never, if unbounded), and queued requests start in queue order as soon as they fit.
Early finishes make real starts earlier, higher-priority arrivals and evictions later, and the real placement
policy may pack differently from the projection's best fit: it is an estimate, and the simulator measures its error.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


# ------------------------------------------------------------------------------ predicted starts (fluid)
class Release(NamedTuple):
    """A holder as the fluid projection sees it: when it is predicted to release, how much, where."""

    end: float
    milli: int
    resource: str
    workspace: str


class Job(NamedTuple):
    """A queued request as the fluid projection sees it: device milli, predicted hold time (inf: holds for
    ever), the earliest time it may start, its rank in queue order (lower first), resource and workspace."""

    name: str
    milli: int
    duration: float
    ready: float
    order: int
    resource: str
    workspace: str


def serve_pool(
    capacity: int, releases: list[tuple[float, int]], jobs: list[tuple[float, int, int, float, str]], now: float
) -> dict[str, float]:
    """One pool of ``capacity`` milli: ``releases`` (end, milli) of what holds it now; ``jobs`` (ready, order,
    milli, duration, name). At every moment the first job in queue order among those ready starts as soon as
    the pool has room for it (nobody passes it); returns the start per job (inf: never)."""
    rel = list(releases)
    heapq.heapify(rel)
    used = sum(m for _, m in rel)
    pending = sorted(jobs)
    eligible: list[tuple[int, int, float, str]] = []
    out: dict[str, float] = {}
    t, i, n = now, 0, len(pending)
    while i < n or eligible:
        if not eligible:
            t = max(t, pending[i][0])
        while i < n and pending[i][0] <= t:
            _, order, milli, dur, name = pending[i]
            heapq.heappush(eligible, (order, milli, dur, name))
            i += 1
        while rel and rel[0][0] <= t:
            used -= heapq.heappop(rel)[1]
        order, milli, dur, name = eligible[0]
        if milli > capacity:
            heapq.heappop(eligible)
            out[name] = math.inf
            continue
        if used + milli <= capacity:
            heapq.heappop(eligible)
            out[name] = t
            used += milli
            heapq.heappush(rel, (t + dur, milli))
            continue
        # the head waits: for the next release or the next arrival that may come before it
        nxt = min(rel[0][0] if rel else math.inf, pending[i][0] if i < n else math.inf)
        if math.isinf(nxt):  # only unbounded holders left: nobody after this point ever starts
            for _, _, _, nm in eligible:
                out[nm] = math.inf
            for p in pending[i:]:
                out[p[4]] = math.inf
            break
        t = nxt
    return out


def project(
    capacity: dict[str, int],
    quotas: dict[str, int],
    holders: Sequence[Release],
    jobs: Sequence[Job],
    now: float,
    kept: KeptJobs | None = None,
) -> dict[str, float]:
    """Predicted start of each queued job with devices counted as one pool per resource (placement
    constraints and fragmentation are left to the calibration), holders releasing at their *predicted* ends
    and every job holding for its predicted duration.

    First each workspace with a quota is served on its own (its quota as the pool, its holders, its jobs in
    queue order): that gives the earliest start the quota allows. Then each resource's pool serves every job
    from that time on, in queue order among those ready. ``kept``: jobs kept to some of their resource's nodes
    (see :class:`KeptJobs`). Cost: O(n log n) for n holders and jobs."""
    ready: dict[str, float] = {}
    by_ws: dict[str, list[tuple[float, int, int, float, str]]] = {}
    kept = kept or KeptJobs()
    floor, pool_of = kept.floor, kept.pool_of
    for j in jobs:
        at = max(j.ready, now, floor[j.name]) if j.name in floor else max(j.ready, now)
        if j.workspace in quotas:
            by_ws.setdefault(j.workspace, []).append((at, j.order, j.milli, j.duration, j.name))
        else:
            ready[j.name] = at
    if by_ws:
        ws_rel: dict[str, list[tuple[float, int]]] = {}
        for h in holders:
            if h.workspace in by_ws:
                ws_rel.setdefault(h.workspace, []).append((h.end, h.milli))
        for ws, wjobs in by_ws.items():
            ready.update(serve_pool(quotas[ws], ws_rel.get(ws, []), wjobs, now))
    by_res: dict[str, list[tuple[float, int, int, float, str]]] = {}
    out: dict[str, float] = {}
    for j in jobs:
        r = ready[j.name]
        if math.isinf(r):
            out[j.name] = r
        else:
            by_res.setdefault(pool_of.get(j.name, j.resource) if pool_of else j.resource, []).append(
                (r, j.order, j.milli, j.duration, j.name))
    res_rel: dict[str, list[tuple[float, int]]] = {}
    for h in holders:
        res_rel.setdefault(h.resource, []).append((h.end, h.milli))
    for res, rjobs in by_res.items():
        if res in kept.pools:
            cap, freed = kept.pools[res]
            out.update(serve_pool(cap, freed, rjobs, now))
        else:
            out.update(serve_pool(capacity.get(res, 0), res_rel.get(res, []), rjobs, now))
    return out


@dataclass
class KeptJobs:
    """Jobs kept to some of their resource's nodes (by models, or by where their pods can run), as the fluid
    projection takes them. Where every job of a resource is kept to one of some node sets that do not overlap,
    each set is that resource's pool for its jobs (``pools``: id -> (capacity, (release, milli) of what holds it);
    ``pool_of``: job -> id). Otherwise a kept job's set is served on its own first, as a quota is, and its start
    there (``floor``) is the earliest the resource's pool may start it."""

    floor: dict[str, float] = field(default_factory=dict)
    pool_of: dict[str, str] = field(default_factory=dict)
    pools: dict[str, tuple[int, list[tuple[float, int]]]] = field(default_factory=dict)


# ------------------------------------------------------------------------------ calibration
CAL_STEP = 0.1  # natural-log bins of the ratio actual / projected wait
CAL_BINS = 161  # ln ratio -8 .. +8
CAL_SLACK_S = 60.0  # waits are compared as (wait + slack): a projected 0 s against an actual 30 s is no big miss
# the quantiles of the learned ratio that bound the P10-P90 range. Not 0.1/0.9: the histogram holds every
# projected GPR, most of which start within a minute of their projection, while the range is judged (and read)
# for those that waited longer, whose ratios spread wider; 0.05/0.95 put about 80% of those in the range
# (pooled calibration, round 3: coverage 85% at load 4, 84% at load 2 and 68% at load 1 on the October part of
# the Philly cut, docs/estimates.md; 0.1/0.9 gave 75%, 71% and 57%)
CAL_RANGE = (0.05, 0.95)


class Interval(NamedTuple):
    """An estimated start: point, and the P10-P90 range (absolute times)."""

    start: float
    low: float
    high: float


class Calibrator:
    """Turns a projected wait into a calibrated estimate with a P10-P90 range, learned online.

    Each time a GPR starts, the ratio ``(actual wait + slack) / (projected wait + slack)`` of its *first*
    projection is recorded in one bounded histogram of its logarithm, pooled over every GPR. An estimate scales
    the projection by the median ratio (point) and its ``range_q`` quantiles (the P10-P90 range, 5th and 95th
    percentile of the ratio by default: see :data:`CAL_RANGE`): about 80% of the GPRs that wait over a minute
    start in the range once history is representative, whatever the projection gets wrong systematically (later
    arrivals overtaking, placement, the pool model). Before ``min_samples`` starts: the projection itself with no
    range to speak of.

    Pooled, not per priority class x decade of the projected wait (as until round 3 of docs/estimates.md): on
    the October part of the Philly cut the per-bucket histograms were worse at every load (median relative
    error 0.61 / 0.39 / 0.46 against 0.41 / 0.36 / 0.45 pooled, coverage 57 / 73 / 83% against 68 / 84 / 85% at
    loads 1 / 2 / 4). As far as measured, a GPR that waits is made late mostly by higher levels of its own
    workspace arriving behind it, which neither its class nor the decade of its projection predicts (they
    correlate -0.05 and -0.2 with the log lateness at load 4), so the buckets only estimated the same spread
    from fewer starts each. ``cls`` stays in the interface (it is stored with each first projection), unused.
    """

    def __init__(self, min_samples: int = 30, max_count: float = 2000.0,
                 range_q: tuple[float, float] = CAL_RANGE) -> None:
        if not 0.0 < range_q[0] < 0.5 < range_q[1] < 1.0:
            raise ValueError(f"calibrator: range quantiles must be 0 < low < 0.5 < high < 1, got {range_q}")
        self.min_samples = min_samples
        self.max_count = max_count
        self.range_q = range_q
        self._hist: list[float] | None = None  # counts (CAL_BINS) + [total]; None before the first start
        # what ratios() answers (None: nothing known yet), until the next observation (10,000 estimates a refresh)
        self._answer: tuple[float, float, float] | None = None
        self._stale = True

    def observe(self, cls: str, projected_wait: float, actual_wait: float) -> None:
        if not (math.isfinite(projected_wait) and math.isfinite(actual_wait)):
            return
        lr = math.log((max(actual_wait, 0.0) + CAL_SLACK_S) / (max(projected_wait, 0.0) + CAL_SLACK_S))
        b = min(CAL_BINS - 1, max(0, round(lr / CAL_STEP) + CAL_BINS // 2))
        h = self._hist
        if h is None:
            h = self._hist = [0.0] * (CAL_BINS + 1)
        h[b] += 1.0
        h[-1] += 1.0
        if h[-1] > self.max_count:
            for k in range(CAL_BINS + 1):
                h[k] *= 0.5
        self._stale = True

    def ratios(self, cls: str, projected_wait: float) -> tuple[float, float, float] | None:
        """(low, median, high) of the log ratio, low and high at the ``range_q`` quantiles (the P10-P90 range,
        see :data:`CAL_RANGE`), or None when fewer than ``min_samples`` starts are known. The same for every
        class and wait (pooled: see the class docstring)."""
        if self._stale:
            self._answer, self._stale = self._ratios(), False
        return self._answer

    def _ratios(self) -> tuple[float, float, float] | None:
        h = self._hist
        if h is None or h[-1] < self.min_samples:
            return None
        total, acc, out = h[-1], 0.0, []
        targets = [self.range_q[0] * total, 0.5 * total, self.range_q[1] * total]
        for k in range(CAL_BINS):
            acc += h[k]
            while targets and acc >= targets[0] - 1e-9:
                out.append((k - CAL_BINS // 2) * CAL_STEP)
                targets.pop(0)
            if not targets:
                break
        return (out[0], out[1], out[2])

    def to_state(self) -> dict[str, Any]:
        """JSON-able: the non-empty bins, as the one bucket (key ``[]``) of the per-bucket form states had before
        the calibration was pooled (so either reads the other's)."""
        h = self._hist
        return {"step": CAL_STEP, "bins": CAL_BINS, "buckets": [] if h is None else [
            {"k": [], "c": [[i, round(c, 4)] for i, c in enumerate(h[:-1]) if c > 0]}]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace what is known with ``state`` (from :meth:`to_state`); ValueError naming what is wrong."""
        if not isinstance(state, dict) or state.get("step") != CAL_STEP or state.get("bins") != CAL_BINS:
            raise ValueError("calibrator state: written with different bins")
        hist: list[float] | None = None
        try:
            for item in state["buckets"]:
                h = [0.0] * (CAL_BINS + 1)
                for i, c in item["c"]:
                    if not 0 <= int(i) < CAL_BINS or not math.isfinite(float(c)) or float(c) < 0:
                        raise ValueError(f"bin {i}: count {c}")
                    h[int(i)] = float(c)
                h[-1] = sum(h[:-1])
                key = tuple(str(x) for x in item["k"])
                if key == ():  # a state written per class x decade also holds the pooled bucket: only it is used
                    hist = h
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"calibrator state: {exc}") from exc
        self._hist, self._answer, self._stale = hist, None, True

    def estimate(self, cls: str, now: float, projected_start: float) -> Interval:
        return self.estimate_all(now, ((cls, projected_start),))[0]

    def estimate_all(self, now: float, projected: Iterable[tuple[str, float]]) -> list[Interval]:
        """:meth:`estimate` of each (class, projected start), in order: a refresh calibrates 10,000 at once, with
        the scale factors worked out once."""
        inf, isfinite, slack = math.inf, math.isfinite, CAL_SLACK_S
        none = Interval(inf, inf, inf)
        q = self.ratios("", 0.0)
        out: list[Interval] = []
        append = out.append
        if q is None:
            for _, projected_start in projected:
                if not isfinite(projected_start):
                    append(none)
                    continue
                wait = max(0.0, projected_start - now)
                append(Interval(now + wait, now + wait / 2, now + 2 * wait))
            return out
        f0, f1, f2 = math.exp(q[1]), math.exp(q[0]), math.exp(q[2])
        for _, projected_start in projected:
            if not isfinite(projected_start):
                append(none)
                continue
            scaled = max(0.0, projected_start - now) + slack
            append(Interval(now + max(0.0, scaled * f0 - slack), now + max(0.0, scaled * f1 - slack),
                            now + max(0.0, scaled * f2 - slack)))
        return out
