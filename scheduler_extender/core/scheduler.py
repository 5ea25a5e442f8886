"""The scheduling engine: ties queue, inventory, placement, eviction and wait-time estimation together.

Drivers (the GPR controller, the simulator) call the event methods (``submit``, ``start``, ``activity``,
``finish``, ``cancel``, ``set_health``) and then :meth:`Scheduler.tick` with the current time; each returns
the :class:`Event` list of what changed. Nothing here reads a clock or does I/O.

A pass over the queue (in :meth:`tick`):

1. Requests are taken in queue order: priority level (high, medium, low) strictly, then predicted size with
   ageing (``order="size"``, see :meth:`Scheduler._order_key`), or priority then submission
   (``order="priority"``). While nothing is blocked, each one that fits is admitted. A workspace at its quota is skipped for the rest of the pass (its requests wait for its own
   usage to drop; they reserve no capacity).
2. The first request that does not fit may evict (``enableEviction``): the cheapest set of lower-priority,
   preemptible holders whose removal makes it fit (:mod:`.eviction`), or nobody; and only when the
   :class:`.eviction.EvictionRule` finds it worth the work lost (``eviction_cost_ratio``,
   ``eviction_max_wait_s``). A holder admitted in the same
   tick is never a victim: it has done no work yet, and evicting it would waste whatever was evicted to admit it
   (within a priority level the queue is in size order, so a later, higher-priority request of the same level
   could otherwise take back a reservation made moments before).
3. Otherwise it is *blocked* and gets a reservation: the earliest time it would fit if holders release at their
   end bound (admission + exitDuration), and the devices it would take then. Every later blocked request gets
   one too, with the earlier reservations held.
4. A later request may start now (backfill) only if it cannot delay any reservation: either it ends, by its own
   exitDuration, before the earliest reservation starts, or it fits without touching reserved devices or the
   host CPU and memory reserved on their nodes. A reservation that cannot be bounded (an unbounded holder is in
   the way) claims every node its request could ever use (its model, node group, node constraints), whole: a
   later request may start on the other nodes, which cannot delay it (one stuck request does not block its
   level on unrelated pools). When more than ``max_reservations`` requests are blocked, the pass stops.

A request that would not fit even on the empty healthy cluster is reported once (``unschedulable``) and skipped:
it waits (devices may recover) without blocking anyone.

Predictions (:mod:`.predictor`) order the queue and drive the wait estimates (:meth:`Scheduler.estimate_ranges`);
the guarantee below uses only bounds. So a later request never moves an earlier one's reservation later ("zero
priority inversions"), as long as exitDuration is enforced, which :meth:`tick` does. With ``audit`` set the engine
re-checks that claim after every backfill and counts violations in ``inversions``.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .eviction import EVICTION_COST_RATIO, EVICTION_MAX_WAIT_S, Candidate, EvictionRule, plan_eviction
from .gpr import GPR, Phase, backoff_delay, clone, priority_class
from .inventory import MILLI_PER_DEVICE, AllocationError, Inventory, NodeAssignment, NodeSpec, Placement
from .placement import PlacementPolicy, Request, fits
from .predictor import DurationPredictor, JobKey, shape_of
from .predictor import job_key as make_job_key
from .queue import GPRQueue, Key, queue_key
from .waittime import (
    Calibrator,
    Holder,
    Interval,
    Job,
    KeptJobs,
    Release,
    earliest_fit,
    holder_order,
    project,
    serve_pool,
)

ORDERS = ("priority", "size")
LEVEL = {"low": 1, "medium": 2, "high": 3}  # priority levels: strict between them
LEVEL_NAME = {1: "low (1-100)", 2: "medium (101-200)", 3: "high (201-300)"}


def _level(priority: int) -> int:
    return 3 if priority > 200 else 2 if priority > 100 else 1
SIZE_UNIT_GPU_S = 60.0  # predicted GPU-seconds below this count as "tiny" in the size order
# Size order: a GPR queues as if submitted this much later per doubling of its predicted GPU-time (4 days: within
# a level it is close to shortest-first, yet nothing arriving more than ~4 days x log2(its size / 60 GPU-s) after
# a GPR can pass it). Chosen on the Philly replay (docs/simulator.md: 2 days and 8 days measured beside it).
AGEING_S = 4 * 86400.0
_ENDED = (Phase.COMPLETE, Phase.CANCELLED, Phase.FAILED)  # a GPR of that name may be submitted again


@dataclass
class SchedulerConfig:
    use_priority: bool = True  # False: FIFO by submission time (``order`` is then ignored)
    # "size": priority level (low/medium/high) strictly, then predicted size with ageing (see _order_key);
    # "priority": numeric priority, then submission (FIFO within a priority: the baseline)
    order: str = "size"
    ageing_s: float = AGEING_S  # "size": queue position this much later per doubling of predicted GPU-time
    backfill: bool = True
    eviction: bool = True
    # the eviction rule (:class:`.eviction.EvictionRule`): evict only when the victims' lost device-hours are at most
    # this many times the device-hours of waiting the preemptor is spared (None: whenever it makes room) ...
    eviction_cost_ratio: float | None = EVICTION_COST_RATIO
    # ... or when the preemptor would otherwise wait this long or longer in all (the priority guarantee)
    eviction_max_wait_s: float = EVICTION_MAX_WAIT_S
    max_reservations: int = 8
    quotas: dict[str, int] | None = None  # workspace -> device milli it may hold at once
    # workspace -> device model -> device milli of that model it may hold at once (see Scheduler._capped)
    model_caps: dict[str, dict[str, int]] | None = None
    requeue_evicted: bool = True
    audit: bool = False
    # True: an evicted GPR's devices are free at once (the simulator: pods vanish). False: it is ``Evicting`` and
    # keeps them until the driver reports its pods gone (:meth:`Scheduler.evicted`) — the live controller.
    instant_eviction: bool = True
    # True: the engine teaches its predictor from the GPRs it sees complete (the simulator). False: the driver
    # does it (the live controller learns from finished GPR objects, once each, across restarts)
    learn: bool = True


@dataclass(frozen=True)
class Event:
    time: float
    # submitted admitted backfilled evicted requeued completed failed cancelled expired idle unschedulable modelquota
    # workspacequota insufficientcapacity behindhigherpriority behindblockedgprs backoff
    kind: str
    gpr: str
    detail: str = ""


@dataclass
class Reservation:
    """A blocked request's claim: it starts at ``start`` on ``placement``. An unbounded one (``start`` infinite,
    no placement: an unbounded holder is in the way) claims every node ``req`` could ever use instead."""

    gpr: str
    start: float
    placement: Placement | None
    req: Request | None = None


@dataclass
class _Pass:
    blocked: list[GPR] = field(default_factory=list)
    resv: list[Reservation] = field(default_factory=list)
    failed: set[Request] = field(default_factory=set)
    masked: Inventory | None = None
    unbounded_masked: Inventory | None = None  # only unbounded reservations' nodes taken out
    admitted: list[str] = field(default_factory=list)
    requeue: list[GPR] = field(default_factory=list)
    bounds: list[Holder] | None = None  # holders sorted by end bound, kept up to date within the pass
    reqs: dict[str, Request] = field(default_factory=dict)  # GPR -> its request narrowed by model caps


@dataclass
class HolderState:
    """The indexes of holders that adopting them leaves (see :meth:`Scheduler.holder_state`)."""

    holders: list[str]  # in the order they were adopted
    usage: dict[str, int]
    held_models: dict[str, dict[str, int]]
    model_usage: dict[tuple[str, str], int]
    ws_ends: dict[str, list[tuple[float, str, int]]]
    ws_unsorted: set[str]
    ws_entry: dict[str, tuple[float, str, int]]
    expiry: list[tuple[float, str, float]]


class QueuedBlock:
    """Queued prototypes kept together by a driver between rebuilds: what ``restore_queued(g, now, None, rank,
    news=False, shared=True)`` of each would queue, under arrival number 0 (ties in the size order then fall to
    the name). The driver keeps it up to date as its GPRs change (:meth:`add`, :meth:`discard`) and restores it
    into each fresh scheduler at the cost of a few dictionary and list copies (:meth:`Scheduler.restore_block`):
    the GPR controller queues 10,000 stored GPRs at every pass, and only a few of them change between passes."""

    def __init__(self, few: int = 64) -> None:
        self.few = few  # up to this many keys discarded from a workspace's list are taken out one by one
        self.gprs: dict[str, GPR] = {}
        self.pred: dict[str, float] = {}  # predicted hold times (the rank's third part)
        self.items: dict[str, tuple[str, Key, GPR]] = {}  # as GPRQueue keeps its entries
        self._by_ws: dict[str, list[Key]] = {}
        self._unsorted: set[str] = set()  # workspaces whose list was appended to out of order
        # workspace -> keys discarded but still listed, taken out when the lists are next read: a pass that
        # re-ranks thousands of changed GPRs (discard then add each) must not sort or shift a list per GPR
        self._gone: dict[str, set[Key]] = {}
        self.unjudged: set[str] = set()  # those stored without a reason (see Scheduler._unreached)

    def __len__(self) -> int:
        return len(self.gprs)

    def add(self, g: GPR, rank: tuple[int, float, float]) -> None:
        """Queue ``g`` (a prototype nobody changes) under its :meth:`Scheduler.size_rank`."""
        name = g.name
        if g.phase is not Phase.QUEUED or g.history:
            raise ValueError(f"{name}: only a GPR stored as Queued, ready and with no history may be shared")
        if name in self.gprs:
            raise ValueError(f"{name} is already in the block")
        level, at, pred = rank
        key: Key = (level, at, 0, name)
        ws = g.workspace
        self.gprs[name], self.pred[name], self.items[name] = g, pred, (ws, key, g)
        if not g.reason:
            self.unjudged.add(name)
        gone = self._gone.get(ws)
        if gone is not None and key in gone:  # re-added under the key it still has listed: that entry stands
            gone.discard(key)
            return
        lst = self._by_ws.setdefault(ws, [])
        if lst and key < lst[-1]:
            self._unsorted.add(ws)
        lst.append(key)

    def discard(self, name: str) -> None:
        item = self.items.pop(name, None)
        if item is None:
            return
        del self.gprs[name], self.pred[name]
        self.unjudged.discard(name)
        ws, key, _ = item
        self._gone.setdefault(ws, set()).add(key)

    def by_ws(self) -> dict[str, list[Key]]:
        """Each workspace's keys, sorted (one filter and one sort per changed workspace since the last read)."""
        for ws, gone in self._gone.items():
            if not gone:
                continue
            lst = self._by_ws[ws]
            if len(gone) <= self.few:  # a few taken out (an admission, a status write): found by bisection, sorted first
                if ws in self._unsorted:
                    lst.sort()
                    self._unsorted.discard(ws)
                for key in gone:
                    i = bisect.bisect_left(lst, key)
                    if i < len(lst) and lst[i] == key:
                        del lst[i]
            else:  # many: one pass over the list (hashing 10,000 keys costs a pass ~8 ms: not for one)
                lst[:] = [k for k in lst if k not in gone]
        self._gone.clear()
        for ws in self._unsorted:
            self._by_ws[ws].sort()
        self._unsorted.clear()
        return self._by_ws


class HostNeeds(Protocol):
    """A driver's answer to what a GPR's pods need of a node's CPU and memory (see :meth:`Scheduler.need_host`)."""

    def need(self, g: GPR) -> tuple[int, int] | None:
        """(CPU millicores, memory MiB) per node, or None for nothing beyond the spec."""
        ...


class Scheduler:
    def __init__(
        self,
        inventory: Inventory,
        policy: PlacementPolicy,
        config: SchedulerConfig | None = None,
        predictor: DurationPredictor | None = None,
        calibrator: Calibrator | None = None,
    ) -> None:
        self.inv = inventory
        self.policy = policy
        self.cfg = config or SchedulerConfig()
        if self.cfg.order not in ORDERS:
            raise ValueError(f"order: {self.cfg.order!r} is not one of {', '.join(ORDERS)}")
        self._size_ranked = self.cfg.use_priority and self.cfg.order == "size"  # keys from size_rank
        self._restored_at = 0.0  # when shared queue entries were restored (restore_queued)
        if not self.cfg.ageing_s > 0:
            raise ValueError("ageing_s: must be positive")
        self.eviction_rule = EvictionRule(self.cfg.eviction_cost_ratio, self.cfg.eviction_max_wait_s)
        self.evictions_declined = 0  # plans the eviction rule found not worth their cost
        # the eviction rule's projections (_wait_left): how many were worked out, and the last ones kept while
        # nothing they depend on changed (_held_epoch: holders come or go; the inventory's stamps; see _wait_left)
        self.wait_projections = 0
        self._held_epoch = 0
        self._wait_cache: dict[tuple[object, ...], tuple[float, float, float]] = {}
        self._wait_cache_at: tuple[int, int, int] = (-1, -1, -1)
        self.predictor = predictor if predictor is not None else DurationPredictor()  # an empty one is falsy
        self.calibrator = calibrator if calibrator is not None else Calibrator()
        self.gprs: dict[str, GPR] = {}
        # the queue keys and makes working copies through a weak reference: no reference cycle, so a scheduler
        # built for one pass is freed as soon as the pass drops it, without waiting for the cyclic garbage
        # collector (a bound method here made one: each pass's scheduler and its 4,800 holder copies were left
        # for the young collection after the pass, ~20 ms at 5,000 nodes)
        me = weakref.proxy(self)
        self.queue = GPRQueue(self.cfg.use_priority, key=lambda g: me._order_key(g))
        self.queue.fresh = lambda proto, key: me._fresh(proto, key)
        self._pred: dict[str, float] = {}  # queued GPR -> predicted hold time (s), fixed when it joined the queue
        self._releases: dict[str, Release] = {}  # holder -> when it is predicted to release (see _predicted_end)
        # the same for estimates alone: a holder's prediction depends on when it is made (how long it has held),
        # so an estimate that refreshed the decisions' copy would move the eviction rule's later choices
        self._est_releases: dict[str, Release] = {}
        self._first_est: dict[str, tuple[float, float, str]] = {}  # queued GPR -> (when, projected wait, class)
        # queued since the last pass and perhaps without a reason yet: a pass that does not get to them says why
        # (see _unreached); a few names a pass, not the whole queue
        self._unjudged: set[str] = set()
        self.projection: dict[str, float] = {}  # the last estimate's projected starts, before calibration
        # workspace -> its holders as (end bound, name, milli), sorted when read (_ends_of); kept up to date by
        # _hold/_unhold. Appended out of order, a list is sorted once when next read: a driver adopting 4,800
        # holders of one workspace would otherwise shift the list 4,800 times
        self._ws_ends: dict[str, list[tuple[float, str, int]]] = {}
        self._ws_unsorted: set[str] = set()
        self._ws_entry: dict[str, tuple[float, str, int]] = {}
        self.holders: dict[str, GPR] = {}
        self.evicting: dict[str, GPR] = {}  # chosen for eviction, devices still held until their pods are gone
        self._tick_admitted: set[str] = set()  # admitted during the current tick: never evicted in it
        self.external: dict[str, Placement] = {}  # devices held by work outside any GPR (see :meth:`hold`)
        self.usage: dict[str, int] = {}
        self.model_usage: dict[tuple[str, str], int] = {}  # (workspace, device model) -> milli held
        self._held_models: dict[str, dict[str, int]] = {}  # holder -> device model -> milli it holds
        self.reservations: list[Reservation] = []
        self.inversions = 0
        self.passes = 0
        self._seq = 0
        self._requeued = False
        self._backoff: list[tuple[float, int, str]] = []
        self._expiry: list[tuple[float, str, float]] = []  # (end bound, name, admitted_at)
        self._idle: list[tuple[float, str, float]] = []  # (deadline, name, last_active_at)
        self._empty = inventory.empty_copy()  # same nodes and health, nothing allocated: "could it ever fit?"
        self._ever: dict[Request, bool] = {}
        self.limits: dict[str, frozenset[str]] = {}  # GPR name -> the only nodes it may be placed on (see limit)
        self.deferred: set[str] = set()  # queued GPRs passed over by placement for now (see defer)
        self.host_needs: HostNeeds | None = None  # host CPU/memory a GPR's pods need per node (see need_host)

    # ------------------------------------------------------------------ events in
    def submit(self, g: GPR, now: float, not_before: float | None = None, validated: bool = False) -> list[Event]:
        """Queue ``g``; with ``not_before`` later than ``now`` it waits out that backoff first (a driver restoring
        a requeued GPR whose retry time is recorded). ``validated``: the driver already checked the spec."""
        if not validated:
            g.validate()
        old = self.gprs.get(g.name)
        if old is not None and old.phase not in _ENDED:
            raise ValueError(f"{g.name} already exists ({old.phase.value})")
        self._seq += 1
        g.seq = self._seq
        g.phase, g.not_before = Phase.QUEUED, max(now, not_before if not_before is not None else now)
        g.history.append((now, Phase.QUEUED, "Submitted"))
        self.gprs[g.name] = g
        if g.not_before > now:
            heapq.heappush(self._backoff, (g.not_before, g.seq, g.name))
        else:
            self.queue.push(g)
            self._unjudged.add(g.name)
        return [Event(now, "submitted", g.name)]

    def restore_queued(self, g: GPR, now: float, not_before: float | None = None,
                       rank: tuple[int, float, float] | None = None, news: bool = True, shared: bool = False) -> None:
        """:meth:`submit` for a driver rebuilding its queue from stored GPRs whose specs it checked, where
        nobody listens for the event: the same state at a fraction of the cost (the GPR controller restores
        every queued GPR at every pass, 10,000 at the scale it is measured at). ``rank``: the GPR's
        :meth:`size_rank` as the driver kept it from an earlier pass (same spec, workspace and predictor epoch).
        ``news``: False for a GPR already stored as Queued (no Submitted step in its history). ``shared``: ``g``
        is the driver's prototype, which this scheduler never changes: it is copied the first time the queue
        hands it out, and until then ``gprs`` holds the prototype, read-only (only for a GPR stored as Queued
        and ready: not ``news``, no ``not_before`` ahead)."""
        name = g.name
        gprs = self.gprs
        old = gprs.get(name)
        if old is not None and old.phase not in _ENDED:
            raise ValueError(f"{name} already exists ({old.phase.value})")
        ready = not_before is None or not_before <= now
        if shared and (news or not ready or g.phase is not Phase.QUEUED or g.history):
            raise ValueError(f"{name}: only a GPR stored as Queued, ready and with no history may be shared")
        if shared and not self._size_ranked:
            g, shared = clone(g), False
        self._seq = seq = self._seq + 1
        gprs[name] = g
        if shared:
            self._restored_at = now
            level, at, self._pred[name] = rank if rank is not None else self.size_rank(g)
            self.queue.push(g, (level, at, seq, name), shared=True)
            self._unjudged.add(name)
            return
        g.seq = seq
        g.phase = Phase.QUEUED
        if news:
            g.history.append((now, Phase.QUEUED, "Submitted"))
        if not ready:
            assert not_before is not None
            g.not_before = not_before
            heapq.heappush(self._backoff, (not_before, seq, name))
            return
        g.not_before = now
        if rank is not None and self._size_ranked:
            self._pred[name] = rank[2]
            self.queue.push(g, (rank[0], rank[1], seq, name))
        else:
            self.queue.push(g)
        self._unjudged.add(name)

    def restore_block(self, block: QueuedBlock, now: float) -> None:
        """Queue every prototype of ``block`` (each as :meth:`restore_queued` with ``shared=True`` would, under
        arrival number 0) into a scheduler that knows none of their names."""
        if not self._size_ranked:
            raise ValueError("shared queue entries need the size order")
        if not block.gprs:
            return
        if not self.gprs.keys().isdisjoint(block.gprs):
            raise ValueError("a GPR of the block is known already")
        self.queue.merge_shared(block.items, block.by_ws())
        self._unjudged.update(block.unjudged)
        self.gprs.update(block.gprs)
        self._pred.update(block.pred)
        self._restored_at = now

    def holder_state(self) -> HolderState:
        """What :meth:`adopt` of the holders (Admitted and Running GPRs) left, for :meth:`restore_holders`; taken
        from a scheduler that has done nothing else to holders yet (no tick, release or eviction)."""
        if self.evicting or self._releases:
            raise ValueError("a holder state is taken right after adopting holders, before anything else")
        return HolderState(list(self.holders), dict(self.usage), dict(self._held_models), dict(self.model_usage),
                           {ws: list(lst) for ws, lst in self._ws_ends.items()}, set(self._ws_unsorted),
                           dict(self._ws_entry), list(self._expiry))

    def revised_holder_state(self, state: HolderState, leaving: Iterable[GPR],
                             joining: Iterable[tuple[GPR, Placement]], now: float) -> HolderState:
        """What :meth:`holder_state` returns after adopting the holders of ``state`` but ``leaving`` (each as it
        was adopted), then each of ``joining`` in turn (``adopt(g, placement, now, allocated=True, seq=0)``: ``g``
        is adopted). Worked out in a scratch scheduler on this one's inventory (which records the joiners'
        placements); this one is left as it was. A driver keeps its holders' state this way when a few GPRs
        start or stop holding; it equals adopting the remaining holders and then the joiners afresh."""
        scratch = Scheduler(self.inv, self.policy, self.cfg, self.predictor, self.calibrator)
        scratch.holders = dict.fromkeys(state.holders)  # type: ignore[assignment]  # holder_state reads names only
        scratch.usage, scratch._held_models = dict(state.usage), dict(state.held_models)
        scratch.model_usage = dict(state.model_usage)
        scratch._ws_ends = {ws: list(lst) for ws, lst in state.ws_ends.items()}
        scratch._ws_unsorted, scratch._ws_entry = set(state.ws_unsorted), dict(state.ws_entry)
        gone: set[str] = set()
        for g in leaving:
            if g.name not in scratch.holders:
                raise ValueError(f"{g.name} is not a holder of the state")
            del scratch.holders[g.name]
            scratch._unuse(g)
            scratch._unhold(g)
            gone.add(g.name)
        if gone:  # what adopting the rest afresh leaves: no entry for a workspace (or model) nobody holds
            scratch._ws_ends = {ws: lst for ws, lst in scratch._ws_ends.items() if lst}
            scratch._ws_unsorted &= scratch._ws_ends.keys()
            scratch.usage = {ws: milli for ws, milli in scratch.usage.items() if ws in scratch._ws_ends}
            scratch.model_usage = {k: milli for k, milli in scratch.model_usage.items() if milli}
        scratch._expiry = [e for e in state.expiry if e[1] not in gone]
        if gone:
            heapq.heapify(scratch._expiry)
        for g, placement in joining:
            scratch.adopt(g, placement, now, allocated=True, seq=0)
        return scratch.holder_state()

    def restore_holders(self, state: HolderState, gprs: dict[str, GPR], now: float) -> None:
        """Adopt again the holders ``state`` was taken after (:meth:`holder_state`), as fresh copies ``gprs`` (by
        name; placements, arrival numbers and admission times as then, their last activity as now): the state
        adopting each of them in turn leaves, at the cost of a few copies, into a scheduler that holds nothing
        yet and whose inventory records their placements (a driver's cached inventory)."""
        if self.holders or self.evicting or self.usage or self._ws_entry:
            raise ValueError("holders are restored into a scheduler that holds nothing yet")
        if len(gprs) != len(state.holders) or not gprs.keys() >= set(state.holders):
            raise ValueError("restore_holders needs a copy of each holder of the state, by name")
        if not self.gprs.keys().isdisjoint(gprs):
            raise ValueError("a holder of the state is known already")
        self.gprs.update(gprs)
        self.holders = {name: gprs[name] for name in state.holders}
        self._held_epoch += 1
        self.usage, self._held_models = dict(state.usage), dict(state.held_models)
        self.model_usage = dict(state.model_usage)
        self._ws_ends = {ws: list(lst) for ws, lst in state.ws_ends.items()}
        self._ws_unsorted, self._ws_entry = set(state.ws_unsorted), dict(state.ws_entry)
        self._expiry = list(state.expiry)
        running = Phase.RUNNING
        for g in self.holders.values():  # what adopt does that depends on the time
            if g.phase is running and g.last_active_at is None:
                g.last_active_at = now
            if g.idle_timeout_s is not None:
                self._arm_idle(g)

    def _fresh(self, proto: GPR, key: Key) -> GPR:
        """The working copy of a shared queue entry (see :meth:`restore_queued`), as restoring a copy made it."""
        g = clone(proto)
        g.seq, g.not_before = key[2], self._restored_at
        self.gprs[g.name] = g
        return g

    def adopt(self, g: GPR, placement: Placement, now: float, allocated: bool = False, seq: int | None = None) -> bool:
        """Take over a GPR that already holds ``placement`` (Admitted or Running, e.g. after a controller
        restart). False, changing nothing, when the placement no longer fits the inventory; the caller then
        queues the GPR again with :meth:`submit`. ``allocated``: the inventory already records it. ``seq``: its
        arrival number (default: the next one)."""
        if not g.holding and g.phase is not Phase.EVICTING:
            raise ValueError(f"{g.name}: only Admitted, Running or Evicting GPRs can be adopted ({g.phase.value})")
        if allocated:  # the inventory was built with this very allocation recorded (a driver's cache)
            held = self.inv.allocations.get(g.name)
            if held is not placement and held != placement:
                raise ValueError(f"{g.name}: the inventory does not hold that placement")
        else:
            try:
                self.inv.allocate(g.name, placement)
            except AllocationError:
                return False
        if seq is None:
            self._seq = seq = self._seq + 1
        g.seq = seq
        g.placement = placement
        if g.admitted_at is None:
            g.admitted_at = now
        self.gprs[g.name] = g
        self._use(g)
        if g.phase is Phase.EVICTING:
            self.evicting[g.name] = g
            self._hold(g, leaving_at=now)
            return True
        self.holders[g.name] = g
        self._hold(g)
        if g.exit_duration_s is not None:
            heapq.heappush(self._expiry, (g.end_bound(), g.name, g.admitted_at))
        if g.phase is Phase.RUNNING and g.last_active_at is None:
            g.last_active_at = now
        self._arm_idle(g)  # an Admitted GPR whose pods never start is idle since its admission
        return True

    def limit(self, name: str, nodes: frozenset[str] | None) -> None:
        """GPR ``name`` may be placed on ``nodes`` only (None: anywhere): the nodes its pods can run on, as the
        driver judges them from the pods' tolerations, node selector and node affinity (facts outside the core).
        It holds for every placement, eviction plan and reservation of it from then on."""
        if nodes is None:
            self.limits.pop(name, None)
        else:
            self.limits[name] = nodes

    def defer(self, name: str) -> None:
        """Pass queued GPR ``name`` over in the next placements, without a word and blocking nobody (a GPR made
        for a pod that does not exist yet: where it may go is not known, and the pod may never come). It keeps its
        place in the queue and its estimate."""
        self.deferred.add(name)

    def need_host(self, needs: HostNeeds | None) -> None:
        """What each GPR needs of host CPU (millicores) and memory (MiB) on each node it is placed on, on top of
        what its spec says: what its pods request, as the driver reads them (facts outside the core). Asked only
        of the GPRs a placement is tried for."""
        self.host_needs = needs

    def request_of(self, g: GPR) -> Request:
        """What placing ``g`` asks: its spec's request, kept to its limit (see :meth:`limit`), with the host CPU and
        memory its pods need (see :meth:`need_host`)."""
        req = g.request()
        nodes = self.limits.get(g.name) if self.limits else None
        host = self.host_needs.need(g) if self.host_needs is not None else None
        if host is not None:
            return dataclasses.replace(req, nodes=nodes if nodes is not None else req.nodes,
                                       cpu_milli=max(req.cpu_milli, host[0]), memory_mib=max(req.memory_mib, host[1]))
        return req if nodes is None else dataclasses.replace(req, nodes=nodes)

    def hold(self, owner: str, node: str, count: int) -> int:
        """Take up to ``count`` free whole devices of ``node`` for work the queue does not manage (pods without a
        GPR, pods still terminating, pods of finished GPRs): capacity no GPR may be given. Returns how many were
        free to take (the rest is already over-committed)."""
        n = self.inv.index.get(node)
        if n is None or count <= 0 or owner in self.inv.allocations:
            return 0
        free = self.inv.whole_free(n, count, healthy_only=False)
        if not free:
            return 0
        placement = Placement((NodeAssignment(n, tuple(free), 1000),))
        healthy = self.inv.healthy[n].copy()
        self.inv.healthy[n] = self.inv.present[n]  # held devices may be unhealthy ones
        try:
            self.inv.allocate(owner, placement)
        finally:
            self.inv.healthy[n] = healthy
        self.external[owner] = placement
        return len(free)

    def evicted(self, name: str, now: float) -> list[Event]:
        """An ``Evicting`` GPR's pods are gone: its devices return, and it is requeued (or ends ``Evicted``)."""
        g = self.gprs[name]
        if g.phase is not Phase.EVICTING:
            raise ValueError(f"{name} is not evicting ({g.phase.value})")
        self._release(g)
        return self._after_eviction(g, now)

    def _after_eviction(self, g: GPR, now: float, st: _Pass | None = None) -> list[Event]:
        if not self.cfg.requeue_evicted:
            g.transition(Phase.EVICTED, now, g.reason)
            return []
        g.transition(Phase.QUEUED, now, "Requeued after eviction")
        g.not_before = now
        if st is not None:
            st.requeue.append(g)
        elif g.name not in self.queue:
            self.queue.push(g)
        return [Event(now, "requeued", g.name, "after eviction")]

    def start(self, name: str, now: float) -> list[Event]:
        """Its pods are running: Admitted -> Running."""
        g = self.gprs[name]
        g.transition(Phase.RUNNING, now)
        self._arm_idle(g)
        return [Event(now, "running", name)]

    def activity(self, name: str, now: float) -> None:
        """The GPR's devices did work at ``now`` (resets its idle clock)."""
        g = self.gprs[name]
        if g.phase is Phase.RUNNING:
            g.last_active_at = now
            g.idle_reported = False
            self._arm_idle(g)

    def finish(self, name: str, now: float, ok: bool = True, reason: str = "") -> list[Event]:
        """Its work ended: Complete, or Failed (then requeued with backoff while retries are left)."""
        g = self.gprs[name]
        if not g.holding:
            raise ValueError(f"{name} holds nothing ({g.phase.value})")
        self._release(g)
        if ok:
            g.transition(Phase.COMPLETE, now, reason or "Succeeded")
            self._learn(g, now)
            return [Event(now, "completed", name, g.reason)]
        g.failures += 1
        g.transition(Phase.FAILED, now, reason or "Failed")
        events = [Event(now, "failed", name, g.reason)]
        if g.requeue_on_failure:
            if g.failures <= g.retry_limit:
                delay = backoff_delay(g.failures, g.backoff_base_s, g.backoff_cap_s)
                g.transition(Phase.QUEUED, now, "Backoff")
                g.not_before = now + delay
                heapq.heappush(self._backoff, (g.not_before, g.seq, name))
                events.append(Event(now, "requeued", name, f"backoff {delay:g}s"))
                events.append(Event(now, "backoff", name, f"after failure {g.failures} ({reason or 'Failed'})"))
            else:
                g.reason = "RetryLimitExceeded"
        return events

    def give_back(self, name: str, now: float, why: str) -> list[Event]:
        """An Admitted GPR none of whose pods has run gives its reservation back (its pods cannot run there) and
        is queued again as it is: no failure, no backoff."""
        g = self.gprs[name]
        if g.phase is not Phase.ADMITTED:
            raise ValueError(f"{name} is not admitted ({g.phase.value})")
        self._release(g)
        g.transition(Phase.QUEUED, now, why)
        g.not_before = now
        self.queue.push(g)
        return [Event(now, "requeued", name, why)]

    def drain(self, name: str, now: float, why: str) -> list[Event]:
        """A Running GPR must leave its node (the node is being deboarded): ``Evicting`` with reason ``why``, its
        devices held until its pods are gone (the controller evicts them through the Eviction API), then requeued
        by :meth:`evicted` as after any eviction. Not a failure and not counted as a preemption's eviction."""
        g = self.gprs[name]
        if g.phase is not Phase.RUNNING:
            raise ValueError(f"{name} is not running ({g.phase.value})")
        self.holders.pop(name, None)
        self.evicting[name] = g
        self._hold(g, leaving_at=now)
        g.transition(Phase.EVICTING, now, why)
        return [Event(now, "evicted", name, why)]

    def cancel(self, name: str, now: float) -> list[Event]:
        g = self.gprs[name]
        if g.holding or g.phase is Phase.EVICTING:
            self._release(g)
        self.queue.remove(name)  # backoff entries are skipped lazily
        g.transition(Phase.CANCELLED, now, "Cancelled")
        return [Event(now, "cancelled", name)]

    def set_health(self, node: str, device: int | None, healthy: bool, now: float) -> list[Event]:
        """Mark a device (or a whole node) healthy or not. Holders of a failed device fail (and requeue)."""
        self.inv.set_health(node, device, healthy)
        self._empty.set_health(node, device, healthy)
        self._ever.clear()
        events: list[Event] = []
        if healthy:
            return events
        n = self.inv.index[node]
        for g in list(self.holders.values()):
            hit = any(
                a.node == n and (device is None or device in a.devices)
                for a in (g.placement.assignments if g.placement else ())
            )
            if hit:
                events += self.finish(g.name, now, ok=False, reason="DeviceUnhealthy")
        return events

    def close(self, node: str) -> None:
        """The node takes no new placement (cordoned, not Ready): what holds it now stays, nothing fails, and
        nothing new is placed there while it is closed. Unlike :meth:`set_health`, a closed node still counts
        for what could ever fit (it is expected back)."""
        self.inv.set_health(node, None, False)

    def set_nodes(self, nodes: list[NodeSpec], now: float) -> list[Event]:
        """The node set changed (nodes joined, left, or changed devices): rebuild the inventory, keeping
        allocations that still fit; GPRs that lost theirs fail with reason ``NodeLost`` (and requeue)."""
        self.inv, lost = self.inv.rebuild(nodes)
        self._empty = self.inv.empty_copy()
        self._ever.clear()
        events: list[Event] = []
        for name in lost:
            self.external.pop(name, None)
            g = self.gprs.get(name)
            if g is None:
                continue
            self.holders.pop(name, None)
            self._unhold(g)
            self._unuse(g)
            if self.evicting.pop(name, None) is not None:
                continue
            g.failures += 1
            g.transition(Phase.FAILED, now, "NodeLost")
            events.append(Event(now, "failed", name, "NodeLost"))
            if g.requeue_on_failure and g.failures <= g.retry_limit:
                delay = backoff_delay(g.failures, g.backoff_base_s, g.backoff_cap_s)
                g.transition(Phase.QUEUED, now, "Backoff")
                g.not_before = now + delay
                heapq.heappush(self._backoff, (g.not_before, g.seq, name))
                events.append(Event(now, "requeued", name, f"backoff {delay:g}s"))
                events.append(Event(now, "backoff", name, f"after failure {g.failures} (NodeLost)"))
        return events

    # ---------------------------------------------------------------- time passes
    def next_wakeup(self) -> float:
        """The earliest future time at which :meth:`tick` has time-based work (inf if none)."""
        out = math.inf
        heaps: tuple[list[Any], ...] = (self._expiry, self._idle, self._backoff)
        for heap in heaps:
            while heap and not self._live(heap, heap[0]):
                heapq.heappop(heap)
            if heap:
                out = min(out, heap[0][0])
        return out

    def tick(self, now: float) -> list[Event]:
        """Apply exitDuration expiry, idle timeouts and finished backoffs at ``now``, then run a pass."""
        events: list[Event] = []
        self._tick_admitted = set()
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)
            if self._live(self._expiry, entry):
                g = self.gprs[entry[1]]
                self._release(g)
                g.transition(Phase.COMPLETE, now, "ExitDurationReached")
                self._learn(g, now)
                events.append(Event(now, "expired", g.name, "ExitDurationReached"))
        while self._idle and self._idle[0][0] <= now:
            entry = heapq.heappop(self._idle)
            if self._live(self._idle, entry):
                g = self.gprs[entry[1]]
                if g.enforce_idle_timeout:
                    self._release(g)
                    g.transition(Phase.COMPLETE, now, "IdleTimeout")
                    self._learn(g, now)
                    events.append(Event(now, "completed", g.name, "IdleTimeout"))
                elif not g.idle_reported:
                    g.idle_reported = True
                    events.append(Event(now, "idle", g.name, "IdleTimeout not enforced"))
        while self._backoff and self._backoff[0][0] <= now:
            bo = heapq.heappop(self._backoff)
            g = self.gprs[bo[2]]
            if g.phase is Phase.QUEUED and g.not_before == bo[0] and g.name not in self.queue:
                self.queue.push(g)
                self._unjudged.add(g.name)
        events += self._pass(now)
        for _ in range(3):  # evicted work went back to the queue: it may fit elsewhere right away
            if not self._requeued:
                break
            events += self._pass(now)
        return events

    # ---------------------------------------------------------------- queries
    def queued(self) -> list[GPR]:
        """Queued GPRs in order, including those waiting out a backoff."""
        return self._queued(self.queue.ordered())

    def peek_queued(self) -> list[GPR]:
        """:meth:`queued` without handing any GPR out of the queue: a shared entry is its prototype, read-only
        (a refresh reads 10,000 queued GPRs and changes none)."""
        return self._queued(self.queue.peek())

    def _queued(self, order: list[GPR]) -> list[GPR]:
        if not self._backoff:
            return order
        seen = {g.name for g in order}
        extra = [self.gprs[n] for _, _, n in self._backoff if self.gprs[n].phase is Phase.QUEUED]
        extra = [g for g in extra if g.name not in seen]
        if not extra:
            return order
        return sorted(order + list({g.name: g for g in extra}.values()), key=self._key)

    def queued_names(self) -> list[str]:
        """The names of :meth:`queued`, in its order, without handing the GPRs out of the queue."""
        if not self._backoff:
            return self.queue.names()
        return [g.name for g in self.peek_queued()]

    def estimates(self, now: float, upto: str | None = None) -> dict[str, float]:
        """Estimated start time per queued GPR (all of them, or only ``upto``); inf: cannot be estimated. The
        point of :meth:`estimate_ranges`."""
        return {name: iv.start for name, iv in self.estimate_ranges(now, upto).items()}

    def estimate_ranges(self, now: float, upto: str | None = None) -> dict[str, Interval]:
        """Estimated start per queued GPR with its P10-P90 range, in queue order (all of them, or only ``upto``,
        projected with the GPRs ahead of it).

        A fluid projection (:func:`.waittime.project`): holders release at their *predicted* end (the
        predictor's expected remaining time given how long they have held, never past their end bound),
        queued GPRs start in queue order as soon as their resource's pool and their workspace's quota have
        room and hold for their predicted duration. The :class:`.waittime.Calibrator` then scales the
        projected wait by what past first projections got wrong (median ratio, pooled over every start) and
        gives the range (5th-95th percentile of the ratio). Cost: O(n log n) in holders and queued GPRs, no
        placement calls."""
        order: list[GPR] = []
        if upto is None:  # read, none handed out: a prototype's working copy would wait from _restored_at
            order = self.peek_queued()
        else:
            for g in self.queue.walk():
                order.append(g)
                if g.name == upto:
                    break
            else:
                backing = [self.gprs[n] for _, _, n in self._backoff if self.gprs[n].phase is Phase.QUEUED]
                backing = [g for g in {g.name: g for g in backing}.values() if g.name not in self.queue]
                if backing:
                    order = sorted(order + backing, key=self._key)
                listed = [g.name for g in order]
                order = order[: listed.index(upto) + 1] if upto in listed else []
        shared, restored_at, hold = self.queue.is_shared, self._restored_at, self.predicted_hold
        jobs = [
            Job(g.name, g.milli_total(), hold(g), restored_at if shared(g.name) else g.not_before, i, g.resource,
                g.workspace)
            for i, g in enumerate(order)
        ]
        releases, cached = [], self._est_releases
        for h in self.holders.values():
            r = cached.get(h.name)
            if r is None or r.end <= now:
                r = cached[h.name] = self._predicted_end(h, now)
            releases.append(r)
        releases += [Release(now, g.milli_total(), g.resource, g.workspace) for g in self.evicting.values()]
        for p in self.external.values():  # work outside any GPR: no end known
            res = self.inv.resources[int(self.inv.resource[p.assignments[0].node])] if p.assignments else ""
            releases.append(Release(math.inf, p.milli_total(), res, ""))
        capacity = {r: self.inv.capacity_milli(r, healthy_only=True) for r in {j.resource for j in jobs}}
        raw = self.projection = project(capacity, self.cfg.quotas or {}, releases, jobs, now,
                                        self._kept_jobs(order, jobs, now))
        first = self._first_est
        names: list[str] = []  # those asked about, in order
        asked: list[tuple[str, float]] = []
        for g in order:
            name = g.name
            start = raw[name]
            cls = priority_class(g.priority)  # once per GPR, not through the property twice
            if name not in first and start < math.inf:
                first[name] = (now, start - now, cls)
            if upto is None or name == upto:
                names.append(name)
                asked.append((cls, start))
        out = dict(zip(names, self.calibrator.estimate_all(now, asked), strict=True))
        if upto is None:  # forget GPRs that left the queue otherwise (cancelled)
            for memo in (self._first_est, self._pred):
                if len(memo) > len(out):
                    for name in [n for n in memo if n not in out]:
                        del memo[name]
        return out

    def _kept_jobs(self, order: list[GPR], jobs: list[Job], now: float) -> KeptJobs | None:
        """Queued GPRs kept to some of their resource's nodes (``models``, or a limit: where their pods can run),
        for the fluid projection (see :class:`.waittime.KeptJobs`): each such node set is a pool of its healthy
        devices, released as the holders on it are predicted to leave. So a GPR that may use only busy H100 nodes
        is not promised the idle A100 ones. None when no GPR is kept."""
        limits, inv = self.limits, self.inv
        groups: dict[tuple[str, tuple[str, ...], frozenset[str] | None], list[int]] = {}  # -> positions in order
        for i, g in enumerate(order):
            nodes = limits.get(g.name) if limits else None
            if g.models or nodes is not None:
                groups.setdefault((g.resource, g.models, nodes), []).append(i)
        if not groups:
            return None
        per_resource = Counter(g.resource for g in order)
        # by node set: GPRs kept to the same nodes (by models, or by their pods) share one pool, in queue order
        by_set: dict[tuple[str, bytes], tuple[np.ndarray, list[int]]] = {}
        for (resource, models, nodes), members in groups.items():
            if resource not in inv.resource_index:
                continue
            mask = inv.resource == inv.resource_index[resource]
            whole = mask.copy()
            if models:
                mask &= inv.models_mask(models)
            if nodes is not None:
                mask &= inv.names_mask(nodes)
            if not np.array_equal(mask, whole):  # kept to all of its resource's nodes: nothing to say
                by_set.setdefault((resource, mask.tobytes()), (mask, []))[1].extend(members)
        if not by_set:
            return None
        masks: dict[str, list[tuple[np.ndarray, list[int]]]] = {}
        for (resource, _), (mask, members) in by_set.items():
            members.sort()  # queue order
            masks.setdefault(resource, []).append((mask, members))
        # every holder's devices, node by node: (node, milli, predicted release)
        at: list[tuple[int, int, float]] = []
        releases = self._est_releases  # (estimate_ranges has just brought every holder's up to date)
        for h in self.holders.values():
            if h.placement is not None:
                end = releases[h.name].end
                at += [(a.node, len(a.devices) * a.milli, end) for a in h.placement.assignments]
        for g in self.evicting.values():
            at += [(a.node, len(a.devices) * a.milli, now) for a in self._assignments(g)]
        for p in self.external.values():
            at += [(a.node, len(a.devices) * a.milli, math.inf) for a in p.assignments]
        held_node = np.fromiter((n for n, _, _ in at), dtype=np.int64, count=len(at))
        healthy = inv.healthy.sum(axis=1) * MILLI_PER_DEVICE
        kept = KeptJobs()
        for resource, sets in masks.items():
            # every job of the resource kept to one of sets that do not overlap: each set is its jobs' pool
            apart = (sum(len(m) for _, m in sets) == per_resource[resource]
                     and int(np.sum([mask for mask, _ in sets], axis=0).max()) <= 1)
            for k, (mask, members) in enumerate(sets):
                on = mask[held_node].tolist() if at else []
                freed = [(end, milli) for (_, milli, end), inside in zip(at, on, strict=True) if inside]
                capacity = int(healthy[mask].sum())
                if apart:
                    pool = f"{resource}#{k}"
                    kept.pools[pool] = (capacity, freed)
                    kept.pool_of.update((order[i].name, pool) for i in members)
                else:
                    served = [(max(jobs[i].ready, now), jobs[i].order, jobs[i].milli, jobs[i].duration,
                               jobs[i].name) for i in members]
                    kept.floor.update(serve_pool(capacity, freed, served, now))
        return kept

    @staticmethod
    def _assignments(g: GPR) -> tuple[NodeAssignment, ...]:
        return g.placement.assignments if g.placement is not None else ()

    def check(self) -> None:
        """Invariants: inventory consistent; holders are exactly the allocations; quotas respected."""
        self.inv.check()
        owners = set(self.holders) | set(self.evicting) | set(self.external)
        assert owners == set(self.inv.allocations), "holders and allocations differ"
        for ws, used in self.usage.items():
            q = (self.cfg.quotas or {}).get(ws)
            assert q is None or used <= q, f"workspace {ws} over quota"
        model_caps = self.cfg.model_caps or {}
        for (ws, model), used in self.model_usage.items():
            cap = model_caps.get(ws, {}).get(model)
            assert cap is None or used <= cap, f"workspace {ws} over its {model} cap"
        assert set(self._held_models) == set(self.holders) | set(self.evicting), "the model usage is stale"
        assert set(self._ws_entry) == set(self.holders) | set(self.evicting), "the workspace index is stale"
        for ws in self._ws_ends:
            ends = self._ends_of(ws)
            assert ends == sorted(e for n, e in self._ws_entry.items() if self.gprs[n].workspace == ws), (
                f"the end-bound index of {ws} is stale or out of order")

    # ---------------------------------------------------------------- internals
    def _key(self, g: GPR) -> Key:
        k = self.queue.key(g.name)
        return k if k is not None else self._order_key(g)

    def _order_key(self, g: GPR) -> Key:
        """Queue order. FIFO (``use_priority`` off): submission. ``order="priority"``: priority, then
        submission. ``order="size"``: priority *level* (high, medium, low) strictly; within a level the GPR
        queues as if submitted ``ageing_s * log2(1 + predicted GPU-seconds / 60)`` seconds later, so smaller
        predicted work goes first, but nothing submitted more than that after it can pass it (ageing: no
        starvation). The key is fixed when the GPR joins the queue."""
        cfg = self.cfg
        if not cfg.use_priority:
            return queue_key(g, False)
        if cfg.order == "priority":
            return queue_key(g, True)
        level, at, self._pred[g.name] = self.size_rank(g)
        return (level, at, g.seq, g.name)

    def size_rank(self, g: GPR) -> tuple[int, float, float]:
        """The size order's (-level, ageing-shifted submission time, predicted hold time) of ``g``: a function of
        its spec, workspace, submission time, this configuration and the predictor's state (its ``epoch``)
        alone, so a driver that restores the same GPR pass after pass may keep it."""
        job = make_job_key(g.workspace, g.template, g.workload,
                           shape_of(g.resource, g.devices_per_node, g.milli_per_device, g.node_count))
        pred = self.predictor.predict(job, g.exit_duration_s).mean
        size = pred * (g.devices_per_node * g.milli_per_device * g.node_count) / 1000.0  # g.milli_total()
        shift = self.cfg.ageing_s * math.log2(1.0 + size / SIZE_UNIT_GPU_S)
        p = g.priority  # LEVEL[g.priority_class], without two Python calls per queued GPR
        return (-3 if p > 200 else -2 if p > 100 else -1, g.submitted_at + shift, pred)

    @staticmethod
    def job_key(g: GPR) -> JobKey:
        return make_job_key(g.workspace, g.template, g.workload,
                           shape_of(g.resource, g.devices_per_node, g.milli_per_device, g.node_count))

    def predicted_hold(self, g: GPR) -> float:
        """Predicted hold time of a queued GPR (fixed while it stays queued)."""
        p = self._pred.get(g.name)
        if p is None:
            p = self._pred[g.name] = self.predictor.predict(self.job_key(g), g.exit_duration_s).mean
        return p

    def projections(self, queued: list[GPR]) -> dict[str, tuple[float, float, int]]:
        """Name -> (projected start at the last estimate (inf: none), predicted hold time, priority) of each of
        ``queued``."""
        projection, hold, inf = self.projection, self.predicted_hold, math.inf
        return {g.name: (projection.get(g.name, inf), hold(g), g.priority) for g in queued}

    def _predicted_end(self, g: GPR, now: float) -> Release:
        """When a holder is predicted to release: now + the predicted remaining hold time given how long it
        has held (the caller re-asks once that time has passed); never past its end bound."""
        adm = g.admitted_at if g.admitted_at is not None else now
        rem = self.predictor.remaining(self.job_key(g), now - adm, g.exit_duration_s).mean
        return Release(min(now + rem, g.end_bound()), g.milli_total(), g.resource, g.workspace)

    def _learn(self, g: GPR, now: float) -> None:
        """A GPR completed (succeeded, or stopped at its exitDuration or idle timeout): one hold-time sample."""
        if g.admitted_at is not None and self.cfg.learn:
            self.predictor.observe(self.job_key(g), max(0.0, now - g.admitted_at), g.exit_duration_s)

    def _live(self, heap: list[Any], entry: Any) -> bool:
        if heap is self._backoff:
            g = self.gprs.get(entry[2])
            return g is not None and g.phase is Phase.QUEUED and g.not_before == entry[0]
        g = self.gprs.get(entry[1])
        if g is None or not g.holding:
            return False
        if heap is self._expiry:
            return g.admitted_at == entry[2]
        return g.last_active_at == entry[2] and not g.idle_reported

    def _arm_idle(self, g: GPR) -> None:
        if g.idle_timeout_s is not None and g.last_active_at is not None:
            heapq.heappush(self._idle, (g.last_active_at + g.idle_timeout_s, g.name, g.last_active_at))
            if len(self._idle) > 2 * len(self.holders) + 64:  # activity re-arms often: drop dead entries
                self._idle = [e for e in self._idle if self._live(self._idle, e)]
                heapq.heapify(self._idle)

    def _hold(self, g: GPR, leaving_at: float | None = None) -> None:
        """``g`` holds devices: index when it releases them at the latest under its workspace (for quota
        shadows): its end bound, or ``leaving_at`` for a GPR being evicted."""
        self._unhold(g)
        self._held_epoch += 1
        entry = (g.end_bound() if leaving_at is None else leaving_at, g.name, g.milli_total())
        lst = self._ws_ends.setdefault(g.workspace, [])
        if lst and entry < lst[-1]:
            self._ws_unsorted.add(g.workspace)
        lst.append(entry)
        self._ws_entry[g.name] = entry

    def _ends_of(self, workspace: str) -> list[tuple[float, str, int]]:
        lst = self._ws_ends.get(workspace, [])
        if workspace in self._ws_unsorted:
            lst.sort()
            self._ws_unsorted.discard(workspace)
        return lst

    def _unhold(self, g: GPR) -> None:
        """``g`` no longer holds anything: drop it from the indexes and predictions of holders."""
        self._held_epoch += 1
        self._releases.pop(g.name, None)
        self._est_releases.pop(g.name, None)
        entry = self._ws_entry.pop(g.name, None)
        if entry is not None:
            lst = self._ends_of(g.workspace)
            del lst[bisect.bisect_left(lst, entry)]

    def _use(self, g: GPR) -> None:
        """``g`` now holds its placement: count it against its workspace, in total and, where the workspace has
        model caps (fixed for the scheduler's life), per device model."""
        self.usage[g.workspace] = self.usage.get(g.workspace, 0) + g.milli_total()
        held: dict[str, int] = {}
        capped = bool((self.cfg.model_caps or {}).get(g.workspace))
        for a in g.placement.assignments if g.placement is not None and capped else ():
            model = self.inv.models[int(self.inv.model[a.node])]
            held[model] = held.get(model, 0) + len(a.devices) * a.milli
        self._held_models[g.name] = held
        for model, milli in held.items():
            self.model_usage[g.workspace, model] = self.model_usage.get((g.workspace, model), 0) + milli

    def _unuse(self, g: GPR) -> None:
        """``g`` gave its devices back (counted as :meth:`_use` counted them, whatever the node set now)."""
        self.usage[g.workspace] = self.usage.get(g.workspace, 0) - g.milli_total()
        for model, milli in self._held_models.pop(g.name, {}).items():
            self.model_usage[g.workspace, model] -= milli

    def _capped(self, g: GPR, req: Request, caps: dict[str, int]) -> Request | None:
        """``req`` narrowed to the device models its workspace may still take all of ``g`` on: a model with a
        cap is allowed only while the workspace's milli held on it plus the whole of ``g`` stays within the cap
        (``g`` counted whole, wherever its devices land: conservative, and simple to prove). None: no model is
        left, or what is left could never hold ``g`` while the unnarrowed request could (it waits for its
        workspace to release devices of a capped model, blocking nobody)."""
        inv = self.inv
        if req.resource not in inv.resource_index:
            return req
        models = req.models or frozenset(
            inv.models[int(i)] for i in np.unique(inv.model[inv.resource == inv.resource_index[req.resource]]))
        need = g.milli_total()
        over = {m for m in models if m in caps and self.model_usage.get((g.workspace, m), 0) + need > caps[m]}
        if not over:
            return req
        if over == models:
            return None
        capped = dataclasses.replace(req, models=frozenset(models - over))
        if not self._ever_fits(capped) and self._ever_fits(req):
            return None
        return capped

    def _ever_fits(self, req: Request) -> bool:
        """Whether ``req`` fits on the empty healthy cluster (cached until health or the node set changes)."""
        if req not in self._ever:
            self._ever[req] = fits(self._empty, req)
        return self._ever[req]

    def _model_blocked(self, g: GPR, caps: dict[str, int], now: float) -> list[Event]:
        """``g`` waits for its workspace to hold less of a capped model: said once (reason ``ModelQuota``)."""
        if g.reason == "ModelQuota":
            return []
        g.reason = "ModelQuota"
        held = ", ".join(f"{m}: {self.model_usage.get((g.workspace, m), 0) / 1000:g} of {c / 1000:g} devices held"
                         for m, c in sorted(caps.items()) if not g.models or m in g.models)
        return [Event(now, "modelquota", g.name,
                      f"workspace {g.workspace} at its model caps ({held}); it needs {g.milli_total() / 1000:g}")]

    def _quota_blocked(self, g: GPR, quota: int, now: float, behind: bool = False) -> list[Event]:
        """``g`` waits for its workspace's usage to drop under its quota: said once (reason ``WorkspaceQuota``),
        with the quota, what the workspace holds and what ``g`` needs, in devices. ``behind``: ``g`` fits the quota
        itself but waits behind GPRs of its workspace that the quota holds (starting it first would delay them)."""
        if g.reason == "WorkspaceQuota":
            return []
        g.reason = "WorkspaceQuota"
        used = self.usage.get(g.workspace, 0)
        why = ("GPRs of the workspace ahead of it wait for that quota, and starting it first would delay them"
               if behind else f"it needs {g.milli_total() / 1000:g}")
        return [Event(now, "workspacequota", g.name,
                      f"workspace {g.workspace} quota: {used / 1000:g} of {quota / 1000:g} devices in use; {why}")]

    # reasons a queued GPR's wait gets from the pass (set when it is left waiting; a Requeued reason stays)
    WAIT_REASONS = ("", "InsufficientCapacity", "BehindHigherPriority", "BehindBlockedGPRs", "Backoff")

    def _unreached(self, st: _Pass, qshadow: dict[str, float], now: float) -> list[Event]:
        """Give a reason to the GPRs queued since the last pass that this pass left without one: those it did not
        get to (it stops after ``max_reservations`` blocked GPRs, and walks no further into a workspace after as
        many held by its quota) and those it passed over to keep their workspace's quota for a GPR ahead of them.
        ``WorkspaceQuota`` when that quota holds them (over it, or behind a GPR of the workspace waiting for it),
        else ``BehindBlockedGPRs``. A GPR that had a reason keeps it until a pass gets to it; only the few queued
        or restored since the last pass are looked at, never the whole queue."""
        events: list[Event] = []
        quotas, gprs, queue, deferred = self.cfg.quotas or {}, self.gprs, self.queue, self.deferred
        unsaid = [n for n in self._unjudged if n in queue and n not in deferred and not gprs[n].reason]
        self._unjudged.clear()
        for name in sorted(unsaid, key=lambda n: queue.key(n) or ()):  # in queue order: deterministic
            g = queue.get(name)  # the working copy of a shared entry
            assert g is not None
            q = quotas.get(g.workspace)
            over = q is not None and self.usage.get(g.workspace, 0) + g.milli_total() > q
            if q is not None and (over or g.workspace in qshadow):
                events += self._quota_blocked(g, q, now, behind=not over)
            else:
                g.reason = "BehindBlockedGPRs"
                said = (f"behind {len(st.blocked)} GPRs that wait for devices; a pass stops there, and looks at this "
                        "one once fewer wait ahead of it" if self.cfg.backfill else
                        "behind a GPR that waits for devices, which nothing passes (no backfill)")
                events.append(Event(now, "behindblockedgprs", name, said))
        return events

    def _waits(self, g: GPR, req: Request, now: float, st: _Pass) -> list[Event]:
        """``g`` was left waiting by this pass: reason ``BehindHigherPriority`` when a blocked GPR of a higher
        priority level is ahead and ``g`` itself would fit now (the head's reservation keeps it off), else
        ``InsufficientCapacity``. Said once, when the reason starts (the detail is computed only then: cheap at
        10,000 queued GPRs); a ``Requeued ...`` reason set by a failure or a requeue is left as it is."""
        if g.reason not in self.WAIT_REASONS:
            return []
        head = st.blocked[0] if st.blocked else None
        behind = (head is not None and head is not g and _level(head.priority) > _level(g.priority)
                  and req not in st.failed and self.policy.place(self.inv, req) is not None)
        reason = "BehindHigherPriority" if behind else "InsufficientCapacity"
        if g.reason == reason:
            return []
        g.reason = reason
        if behind:
            assert head is not None
            return [Event(now, "behindhigherpriority", g.name,
                          f"behind {head.name} at priority level {LEVEL_NAME[_level(head.priority)]}, which waits "
                          "for devices; nodes it would use are kept for it")]
        return [Event(now, "insufficientcapacity", g.name, self._capacity_detail(req))]

    def _capacity_detail(self, req: Request) -> str:
        """What ``req`` needs and where the devices are: how many of the nodes it could ever use have enough
        free, and who holds the rest (the first few holders by node name: deterministic)."""
        inv = self.inv
        models = f" ({', '.join(sorted(req.models))})" if req.models else ""
        need = (f"needs {req.node_count} node(s) x {req.count} {req.resource}{models}"
                + (f" of {req.milli / 1000:g}" if req.milli != MILLI_PER_DEVICE else ""))
        reach = self._reach(inv, req) & (inv.ndev >= req.count)
        nodes = np.flatnonzero(reach)
        if not len(nodes):
            return need + "; no node it may use has that many devices"
        free = (inv.avail()[nodes] >= req.milli).sum(axis=1)
        have = int((free >= req.count).sum())
        owners: dict[int, list[str]] = {}
        for owner, p in inv.allocations.items():
            for a in p.assignments:
                if reach[a.node]:
                    owners.setdefault(a.node, []).append(owner)
        held = [f"{o} ({inv.names[n]})" for n in sorted(owners, key=lambda n: inv.names[n])
                for o in sorted(owners[n])]
        out = f"{need}; {have} of {len(nodes)} fitting nodes have {req.count} free"
        if held:
            out += "; held by " + ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return out

    def _release(self, g: GPR) -> None:
        self.inv.release(g.name)
        self.holders.pop(g.name, None)
        self.evicting.pop(g.name, None)
        self._unuse(g)
        self._unhold(g)

    def _admit(self, g: GPR, p: Placement, now: float, kind: str, st: _Pass) -> Event:
        self.inv.allocate(g.name, p)
        g.placement = p
        g.transition(Phase.ADMITTED, now, kind.capitalize())
        self.holders[g.name] = g
        self._use(g)
        self._hold(g)
        self._pred.pop(g.name, None)
        first = self._first_est.pop(g.name, None)
        if first is not None:  # how far off was its first projection? (calibrates the estimates)
            self.calibrator.observe(first[2], first[1], now - first[0])
        if g.exit_duration_s is not None:
            heapq.heappush(self._expiry, (g.end_bound(), g.name, now))
        st.admitted.append(g.name)
        self._tick_admitted.add(g.name)
        if st.bounds is not None:
            bisect.insort(st.bounds, Holder(g.name, g.end_bound()), key=holder_order)
        st.masked = st.unbounded_masked = None
        return Event(now, kind, g.name)

    def _evict(self, g: GPR, now: float, st: _Pass, by: str) -> list[Event]:
        st.bounds = None
        g.evictions += 1
        events = [Event(now, "evicted", g.name, by)]
        if not self.cfg.instant_eviction:
            self.holders.pop(g.name, None)
            self.evicting[g.name] = g
            self._hold(g, leaving_at=now)
            g.transition(Phase.EVICTING, now, f"EvictedFor:{by}")
            return events
        self._release(g)
        g.transition(Phase.EVICTED, now, f"EvictedFor:{by}")
        return events + self._after_eviction(g, now, st)

    def _fits_once_evicted(self, req: Request) -> bool:
        """Whether ``req`` fits when the GPRs being evicted now have left (then nobody more is evicted for it)."""
        if not self.evicting:
            return False
        after = self.inv.copy()
        for name in self.evicting:
            after.release(name)
        return self.policy.place(after, req) is not None

    def _plan(self, g: GPR, req: Request, now: float, quota: int | None) -> list[str] | None:
        """Eviction plan for ``g`` (as ``req``, narrowed by model caps: the evictions make room only on models
        it may take): for capacity (any workspace), or with ``quota`` set, within ``g``'s own workspace so that
        it also fits under that quota."""
        # only those plan_eviction may choose (preemptible, lower priority): the others' work is not worked out;
        # for a quota, only the workspace's own holders, read from its index (_ws_ends: holders and evicting)
        # rather than by going through every holder of the cluster (the plan orders its candidates itself)
        prio, holders, admitted = g.priority, self.holders, self._tick_admitted
        pool: Iterable[GPR] = (holders.values() if quota is None else
                               [holders[n] for _, n, _ in self._ws_ends.get(g.workspace, ()) if n in holders])
        cands = []
        for h in pool:
            if h.preemptible and h.priority < prio and h.name not in admitted:
                milli = h.milli_total()  # what _work_done gives, its milli_total worked out once
                work = (now - h.admitted_at) * milli if h.admitted_at is not None else 0.0
                cands.append(Candidate(h.name, h.priority, True, work, milli))
        need = 0 if quota is None else self.usage.get(g.workspace, 0) + g.milli_total() - quota
        return plan_eviction(self.inv, req, g.priority, cands, need_milli=need)

    def _worth(self, g: GPR, req: Request, victims: list[str], now: float, quota: int | None) -> bool:
        """Whether the eviction rule lets ``g`` evict ``victims``: the work they lose against the wait ``g`` is
        spared. That wait (:meth:`_wait_left`) is worked out only when the cost is not settled without it."""
        rule = self.eviction_rule
        if not rule.weighs:
            return True
        gprs = self.gprs
        lost = sum(self._work_done(gprs[v], now) for v in victims)
        waited = now - self._queued_since(g)
        if rule.allows(lost, g.milli_total(), waited, 0.0):  # nothing lost, or waited long enough already
            return True
        if rule.allows(lost, g.milli_total(), waited, self._wait_left(g, req, now, quota)):
            return True
        self.evictions_declined += 1
        return False

    @staticmethod
    def _work_done(h: GPR, now: float) -> float:
        """Device-milli x seconds ``h`` has held its devices: what evicting it throws away (it restarts)."""
        return (now - h.admitted_at) * h.milli_total() if h.admitted_at is not None else 0.0

    @staticmethod
    def _queued_since(g: GPR) -> float:
        """When ``g`` last joined the queue (submission, a requeue); its submission for a GPR restored without
        history."""
        for t, phase, _ in reversed(g.history):
            if phase is Phase.QUEUED:
                return t
        return g.submitted_at

    def _wait_left(self, g: GPR, req: Request, now: float, quota: int | None) -> float:
        """How long ``g`` would still wait without evicting, holders leaving at their *predicted* ends (the
        expected wait, not the bound): for room in the cluster, and with ``quota`` for room in its workspace
        too. inf when nothing predicted to end makes room.

        The projection is kept (per request and, with ``quota``, workspace need) and given again while nothing it
        depends on changed: the same holders and GPRs being evicted (:attr:`_held_epoch`), the same inventory
        (its stamps: allocations, health), and ``now`` before every holder's predicted end (none is predicted
        anew). The evicting GPRs leave at ``now`` and a request that fits starts ``now``, so the start kept
        is read as ``max(start, now)``: what the projection would give at the later ``now``. A head request the
        rule declines is weighed again at every pass until something changes; most passes (arrivals) change
        none of this."""
        inv = self.inv
        at = (self._held_epoch, inv.uid, int(inv.stamp.sum()))
        if at != self._wait_cache_at:
            self._wait_cache.clear()
            self._wait_cache_at = at
        need = 0 if quota is None else self.usage.get(g.workspace, 0) + g.milli_total() - quota
        key: tuple[object, ...] = (req,) if quota is None else (req, g.workspace, need)
        kept = self._wait_cache.get(key)
        if kept is not None and kept[0] <= now < kept[1]:
            return max(kept[2], now) - now
        self.wait_projections += 1
        releases = self._releases
        soonest = math.inf
        holders: list[Holder] = []
        for h in self.holders.values():
            r = releases.get(h.name)
            if r is None or r.end <= now:
                r = releases[h.name] = self._predicted_end(h, now)
            soonest = min(soonest, r.end)
            holders.append(Holder(h.name, r.end, h.workspace, h.milli_total()))
        holders += [Holder(e.name, now, e.workspace, e.milli_total()) for e in self.evicting.values()]
        start, _ = earliest_fit(inv, req, holders, now)
        if quota is not None:
            acc = 0
            for w in sorted((w for w in holders if w.workspace == g.workspace), key=holder_order):
                if acc >= need:
                    break
                acc += w.milli
                start = max(start, w.end)
            if acc < need:
                start = math.inf
        self._wait_cache[key] = (now, soonest, start)
        return start - now

    def _quota_shadow(self, g: GPR, quota: int, now: float, st: _Pass) -> float:
        """Earliest time ``g``'s workspace has room for it under its quota, holders leaving at their bound."""
        need = self.usage.get(g.workspace, 0) + g.milli_total() - quota
        if need <= 0:
            return now
        acc = 0
        for end, _, milli in self._ends_of(g.workspace):
            acc += milli
            if acc >= need:
                return max(now, end)
        return math.inf

    def _holder_bounds(self, now: float) -> list[Holder]:
        return ([Holder(g.name, g.end_bound()) for g in self.holders.values()]
                + [Holder(g.name, now) for g in self.evicting.values()])

    @staticmethod
    def _reach(inv: Inventory, req: Request) -> np.ndarray:
        """Nodes ``req`` could ever be placed on (resource, model, node constraints, device memory), whatever is
        free on them now."""
        if req.resource not in inv.resource_index:
            return np.zeros(len(inv), dtype=bool)
        ok = inv.resource == inv.resource_index[req.resource]
        if req.models:
            ok &= inv.models_mask(req.models)
        if req.nodes is not None:
            ok &= inv.names_mask(req.nodes)
        if req.count > 0 and req.device_memory_mib:
            ok &= inv.dev_mem >= req.device_memory_mib
        return ok

    def _base_without(self, resv: list[Reservation], unbounded_only: bool = False) -> Inventory:
        """A copy of the inventory with reserved devices and reserved host resources taken out. An unbounded
        reservation takes out every node its request could ever use, whole (its devices and host CPU and memory):
        when its holder leaves is unknown, so any of them may be the one it starts on, at any time. Nodes it can
        never use stay: work there cannot delay it. ``unbounded_only``: take out only those."""
        base = self.inv.copy()
        for r in resv:
            if r.placement is None:
                if r.req is None or math.isfinite(r.start):
                    continue
                for n in np.flatnonzero(self._reach(base, r.req)):
                    base.healthy[n] = False
                    base.cpu_free[n] = min(int(base.cpu_free[n]), -1)
                    base.mem_free[n] = min(int(base.mem_free[n]), -1)
                    base.touch(int(n))
                continue
            if unbounded_only:
                continue
            for a in r.placement.assignments:
                base.cpu_free[a.node] -= a.cpu_milli
                base.mem_free[a.node] -= a.memory_mib
                base.touch(a.node)
                for d in a.devices:
                    base.healthy[a.node, d] = False
        return base

    def _reserve(self, g: GPR, prior: list[Reservation], now: float, st: _Pass | None = None) -> Reservation:
        base = self._base_without(prior)
        if st is None:
            req = self.request_of(g)
            start, state = earliest_fit(base, req, self._holder_bounds(now), now)
        else:
            req = st.reqs.get(g.name) or self.request_of(g)
            if st.bounds is None:
                st.bounds = sorted(self._holder_bounds(now), key=holder_order)
            start, state = earliest_fit(base, req, st.bounds, now, presorted=True)
        placement = self.policy.place(state, req) if math.isfinite(start) else None
        return Reservation(g.name, max(start, g.not_before), placement, req)

    def _ensure_reservations(self, st: _Pass, now: float) -> bool:
        while len(st.resv) < len(st.blocked):
            r = self._reserve(st.blocked[len(st.resv)], st.resv, now, st)
            st.resv.append(r)
            st.masked = st.unbounded_masked = None
        return all(math.isfinite(r.start) for r in st.resv)

    def _audit(self, st: _Pass, now: float) -> None:
        check = _Pass(bounds=sorted(self._holder_bounds(now), key=holder_order), reqs=st.reqs)  # afresh, not from st
        for i, r in enumerate(st.resv):
            again = self._reserve(self.gprs[r.gpr], st.resv[:i], now, check)
            if again.start > r.start + 1e-9:
                self.inversions += 1

    def _pass(self, now: float) -> list[Event]:
        self.passes += 1
        cfg, quotas, model_caps = self.cfg, self.cfg.quotas or {}, self.cfg.model_caps or {}
        st = _Pass()
        events: list[Event] = []
        walk = self.queue.walk()
        qshadow: dict[str, float] = {}  # workspace -> earliest quota-start of its quota-blocked requests
        qcount: dict[str, int] = {}
        deferred = self.deferred
        for g in walk:
            if deferred and g.name in deferred:
                continue
            req = self.request_of(g)
            caps = model_caps.get(g.workspace)
            if caps:
                capped = self._capped(g, req, caps)
                if capped is None:
                    events += self._model_blocked(g, caps, now)
                    continue
                if g.reason == "ModelQuota":
                    g.reason = ""
                if capped != req:
                    req = st.reqs[g.name] = capped
            q = quotas.get(g.workspace)
            if q is not None:
                over = self.usage.get(g.workspace, 0) + g.milli_total() > q
                if not over and g.reason == "WorkspaceQuota":
                    g.reason = ""
                if g.workspace in qshadow:
                    # behind a quota-blocked request of the same workspace: only if it ends before that one
                    # could start, so the workspace's quota is back in time
                    if over or g.exit_duration_s is None or now + g.exit_duration_s > qshadow[g.workspace]:
                        if over:
                            qshadow[g.workspace] = min(qshadow[g.workspace], self._quota_shadow(g, q, now, st))
                            events += self._quota_blocked(g, q, now)
                        qcount[g.workspace] += 1
                        if qcount[g.workspace] > cfg.max_reservations:
                            walk.drop(g.workspace)
                        continue
                elif over:
                    if cfg.eviction and g.enable_eviction and not st.blocked and not any(
                            e.workspace == g.workspace for e in self.evicting.values()):
                        victims = self._plan(g, req, now, q)
                        if victims and not self._worth(g, req, victims, now, q):
                            victims = None
                        if victims:
                            for v in victims:
                                events += self._evict(self.gprs[v], now, st, g.name)
                            st.failed.clear()
                            # under the quota only once the victims' devices no longer count: at once when an
                            # eviction is instant, else when their pods are gone (evicted()): the cluster may
                            # have room elsewhere meanwhile, which must not admit it over its quota
                            room = self.usage.get(g.workspace, 0) + g.milli_total() <= q
                            p = self.policy.place(self.inv, req) if room else None
                            if p is not None:
                                events.append(self._admit(g, p, now, "admitted", st))
                                continue
                    events += self._quota_blocked(g, q, now)
                    if not cfg.backfill:
                        walk.drop(g.workspace)
                        continue
                    qshadow[g.workspace] = self._quota_shadow(g, q, now, st)
                    qcount[g.workspace] = 1
                    continue
            if g.reason == "Unschedulable" and self._ever_fits(req):
                g.reason = ""  # fits again (a spec change, a node back): no longer said, across restarts too
            if not self._ever_fits(req):
                if g.reason != "Unschedulable":
                    g.reason = "Unschedulable"
                    where = " on the nodes its pods can run on" if req.nodes is not None else ""
                    events.append(Event(now, "unschedulable", g.name,
                                        f"does not fit even on the empty healthy cluster{where}"))
                continue  # waits (it may fit when devices recover) but blocks nobody
            if not st.blocked:
                p = None if req in st.failed else self.policy.place(self.inv, req)
                if p is None:
                    st.failed.add(req)
                    if cfg.eviction and g.enable_eviction and not self._fits_once_evicted(req):
                        victims = self._plan(g, req, now, None)
                        if victims and not self._worth(g, req, victims, now, None):
                            victims = None
                        if victims:
                            for v in victims:
                                events += self._evict(self.gprs[v], now, st, g.name)
                            st.failed.clear()
                            p = self.policy.place(self.inv, req)
                if p is not None:
                    events.append(self._admit(g, p, now, "admitted", st))
                    continue
                events += self._waits(g, req, now, st)
                if not cfg.backfill:
                    break
                st.blocked.append(g)
                continue
            # behind a blocked request: backfill only without delaying any reservation
            if len(st.blocked) > cfg.max_reservations:
                break
            if req in st.failed:
                events += self._waits(g, req, now, st)
                st.blocked.append(g)
                continue
            bounded = self._ensure_reservations(st, now)
            first = min((r.start for r in st.resv if math.isfinite(r.start)), default=math.inf)
            if g.exit_duration_s is not None and now + g.exit_duration_s <= first:
                # ends before any bounded reservation starts; an unbounded one keeps its nodes whole
                if bounded:
                    p = self.policy.place(self.inv, req)
                    if p is None:
                        st.failed.add(req)
                else:
                    if st.unbounded_masked is None:
                        st.unbounded_masked = self._base_without(st.resv, unbounded_only=True)
                    p = self.policy.place(st.unbounded_masked, req)
            else:
                if st.masked is None:
                    st.masked = self._base_without(st.resv)
                p = self.policy.place(st.masked, req)
            if p is not None:
                events.append(self._admit(g, p, now, "backfilled", st))
                if cfg.audit:
                    self._audit(st, now)
                continue
            events += self._waits(g, req, now, st)
            st.blocked.append(g)
        events += self._unreached(st, qshadow, now)
        for name in st.admitted:
            self.queue.remove(name)
        for g in st.requeue:
            if g.name not in self.queue:
                self.queue.push(g)
        self.reservations = st.resv
        self._requeued = bool(st.requeue)
        return events
