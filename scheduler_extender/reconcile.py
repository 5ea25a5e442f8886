"""One controller pass as a pure function: the cluster's objects in, the writes and actions that make it right out.

Level-triggered, the way kube-controller-manager and Kueue work: nothing the pass decides depends on memory of
earlier passes. Every pass builds the policy core afresh from API objects —

- nodes: allocatable managed devices, GPU model labels, health (``GPUUnhealthy``/``NR1Unhealthy``, the
  ``accelstack.io/unhealthy`` taint);
- GPRs, by UID (a name reused after a delete is a new GPR): phase, failures, evictions, ``nextRetryTime`` (the
  backoff), timestamps and the reservation, all from ``status``; the spec of the current ``generation``;
- pods: devices held on each node by every bound pod that is not covered by its GPR's reservation (pods without a
  GPR, pods of finished or requeued GPRs, pods still terminating, pods bound by another scheduler, and ledger
  entries of pods not seen yet) are capacity no GPR may be given; pod phases say when a GPR runs, idles, ends,
  or when an ``Evicting`` GPR's pods are gone;

— then feeds in the facts, ticks the core, and returns what must change: status bodies (only where they differ
from what is stored), pods to ungate (narrowed to the reserved nodes) once the status says ``Admitted``, bound
pods to evict, Events, and auto-created GPRs left without pods. A restart or a new leader computes the same.

Parsed specs are cached by (UID, generation) in :class:`PassCache` — a cache of a pure function, rebuilt
identically after a restart.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
import time
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kubeapi.collector import collector_paused
from scheduler_extender import gpr_resource as gr
from scheduler_extender.cluster import GPU, MODEL_LABEL, NR1, TERMINAL_POD_PHASES, NodeView, PodView
from scheduler_extender.core.gpr import GPR, Phase, backoff_delay, clone
from scheduler_extender.core.inventory import AllocationError, Inventory, NodeAssignment, NodeSpec, Placement
from scheduler_extender.core.placement import fits, make_policy
from scheduler_extender.core.predictor import DurationPredictor
from scheduler_extender.core.scheduler import Event, HolderState, QueuedBlock, Scheduler, SchedulerConfig
from scheduler_extender.core.waittime import Calibrator, Interval
from scheduler_extender.podfit import (
    HOSTNAME_LABEL,
    NODE_NAME_FIELD,
    REQUIRED_AFFINITY,
    NodeFit,
    narrowed,
    selector_mismatch,
    why_not,
)
from scheduler_extender.predictor_store import job_key as history_key
from scheduler_extender.workspaces import WorkspaceIndex

MEMORY_LABEL = "nvidia.com/gpu.memory"
AUTO_LABEL = "accelstack.io/auto-gpr"
ALLOCATED = (Phase.ADMITTED, Phase.RUNNING, Phase.EVICTING)
# status fields a pass compares with what it would write (positions and estimates are refreshed apart)
QUEUE_FIELDS = ("queuePosition", "estimatedStart", "estimatedStartRange")  # refreshed apart from the rest
COMPARED = ("phase", "reason", "failures", "evictions", "reservation", "admittedAt", "startedAt", "finishedAt",
            "nextRetryTime", "observedGeneration")


@dataclass(frozen=True)
class Snapshot:
    """What the informers held when the pass began (shallow copies: the pass runs off the event loop)."""

    now: float
    nodes: Mapping[str, NodeView]
    pods: Mapping[str, PodView]  # by UID
    gprs: Mapping[str, dict[str, Any]]  # by UID
    refusals: Mapping[str, str] = field(default_factory=dict)  # GPR UID -> eviction refusals the API answered
    # node -> CPU (millicores) and memory (MiB) requested by the live pods bound there, accelstack's or not
    # (ClusterView.host_used); None: from ``pods`` alone (see host_used_of)
    host: Mapping[str, tuple[int, int]] | None = None


@dataclass
class PassConfig:
    policy: str = "bestfit"
    core: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(instant_eviction=False, learn=False))
    # what the controller learned of how long work runs (scheduler_extender.predictor_store); read, not changed
    predictor: DurationPredictor | None = None
    calibrator: Calibrator | None = None
    refresh_queue: bool = True  # write queue positions and estimates this pass
    estimates: bool = True  # compute wait estimates when refreshing
    # refresh also when the queue differs from this (a GPR arrived, left or moved), if allowed now
    last_queue: tuple[str, ...] | None = None
    refresh_on_change: bool = True
    orphan_grace: float = 120.0  # an auto-created GPR that no pod names is deleted after this long
    # namespace -> workspace (the core's quota unit; scheduler_extender.workspaces); None: namespace = workspace
    workspaces: WorkspaceIndex | None = None
    # UIDs of GPRs whose first projection the driver keeps already (predictor_store): not projected again
    noted: Container[str] = frozenset()


@dataclass
class StatusWrite:
    uid: str
    key: str
    status: dict[str, Any]
    holding: bool = False  # the status says Admitted/Running: its gated pods may be ungated once written
    # only the queue position or the wait estimate moved (a refresh): news for the user, not a decision, so the
    # controller may pace these writes; one left unwritten is planned again at the next refresh
    queue_only: bool = False


@dataclass
class Eviction:
    pod: PodView
    why: str
    gpr_uid: str


@dataclass
class Plan:
    writes: list[StatusWrite] = field(default_factory=list)
    ungate: dict[str, list[str]] = field(default_factory=dict)  # GPR UID -> reserved node names
    evictions: list[Eviction] = field(default_factory=list)
    events: list[tuple[str, Event]] = field(default_factory=list)  # (GPR UID, core event)
    orphans: list[tuple[str, str, str]] = field(default_factory=list)  # (namespace, name, uid)
    wakeup: float = math.inf
    queued: int = 0
    holding: int = 0
    queue: tuple[str, ...] = ()
    refreshed: bool = False
    seconds: float = 0.0
    estimate_seconds: float = 0.0
    # GPR UID -> (projected start, predicted hold time, priority) of queued GPRs when estimates were refreshed,
    # but those in PassConfig.noted
    projections: dict[str, tuple[float, float, int]] = field(default_factory=dict)


@dataclass(eq=False)  # compared by identity (PassCache.ordered)
class Decoded:
    """What a pass reads of one GPR object version, decoded once (the object is immutable per resourceVersion)."""

    version: str
    uid: str
    key: str
    order: tuple[str, str, str, str]
    deleting: bool
    phase: str
    status: dict[str, Any]
    generation: Any
    fields: dict[str, Any] | str
    proto: GPR | None
    reservation: dict[str, int]
    # (phase, reason, failures, evictions) as stored, when the stored status is complete (it observed this
    # generation, carries no Idle/EvictionBlocked condition): a GPR the pass left at exactly these renders it
    # unchanged; None when any pass must write it
    settled: tuple[Any, ...] | None
    spot: Spot  # its place in the queue as stored
    source: dict[str, Any]  # the object it was decoded from
    auto: bool  # made by the webhook for a pod (see _orphans)
    waiting: bool  # may be queued as its prototype (see decode)
    # (predictor, its epoch, workspace, ageing, Scheduler.size_rank) while queued: the rank kept between passes
    rank: tuple[Any, int, str, float, tuple[int, float, float]] | None = None
    # (UID, key, reservation as sorted (node, devices)): all the cached inventory depends on of an allocated GPR
    placed: tuple[str, str, tuple[tuple[str, int], ...]] = ("", "", ())
    spot_numbers: tuple[float, float, float, float, float] = (0.0, 0.0, math.nan, math.nan, math.nan)  # see _spots_moved


class PassCache:
    """Pure functions of immutable inputs, cached so a pass does not redo them: decoded objects by (UID,
    resourceVersion), specs by (UID, generation), node specs by node view, and the inventory with every
    allocated GPR adopted (:class:`Base`), by (node specs, each allocated GPR's UID, name and reservation: a
    status write that leaves its reservation as it was, Admitted to Running say, keeps it; an admission or a
    completion derives the next one from it). A restart rebuilds all of it identically."""

    def __init__(self) -> None:
        self.specs: dict[str, tuple[Any, dict[str, Any] | str]] = {}
        self.decoded: dict[str, Decoded] = {}
        self.nodes: dict[str, tuple[NodeView, NodeSpec | None]] = {}
        self.base: Base | None = None
        self.seen: list[Decoded] = []  # the last pass's decoded objects, as the snapshot listed them
        self.sorted: list[Decoded] = []  # the same in creation order
        self.sorted_at: dict[int, int] = {}  # id() of each of those -> its place there (they are alive: sorted holds them)
        # (UIDs, objects) as the last snapshot listed them, in step with ``seen``
        self.listed: tuple[list[str], list[dict[str, Any]]] = ([], [])
        # (base, pod views, node views, devices used outside reservations by node) of the last pass
        self.outside: tuple[Base, list[PodView], list[NodeView], dict[str, int]] | None = None
        self.changed: set[str] = set()  # UIDs decoded anew since the waiting block last looked
        self.same = False  # the last ordered() listed the very objects the one before it listed
        self.waiting: Waiting | None = None
        # (decoded list, waiting block, its version, holders block, the decoded objects in neither)
        self.rest: tuple[list[Decoded], Waiting | None, int, Holders | None, list[Decoded]] | None = None
        self.holders: Holders | None = None
        self.versions: tuple[Decoded, ...] = ()  # the last pass's allocated GPRs, as decoded (see Holders)
        self.tallies = PodTallies()  # what each allocated GPR's pods say (see pod_tally)
        self.fit = NodeFit()  # which nodes waiting pods can run on (by their constraints, the nodes' labels, taints)
        self.pods: PodsByGPR | None = None
        # (host requests by node, the inventory's node names, CPU and memory requested by node index) of the last
        # pass (see _withhold_host)
        self.host: tuple[Mapping[str, tuple[int, int]], list[str], np.ndarray, np.ndarray] | None = None
        self.shares: tuple[tuple[Any, ...], HostShares] | None = None  # (its key, the GPRs' shares): _withhold_host
        self._autos: tuple[list[Decoded], list[Decoded]] | None = None
        self._allocated: tuple[list[Decoded], list[Decoded], tuple[Any, ...]] | None = None
        self._flagged: tuple[list[NodeView], list[tuple[str, bool]]] | None = None
        # (pods, fit generation, base, queued GPR -> the nodes it may use) of the last pass (see _fit_pods)
        self.limits: tuple[PodsByGPR, int, Base, dict[str, frozenset[str]]] | None = None

    def decode(self, uid: str, obj: dict[str, Any], now: float) -> Decoded:
        hit = self.decoded.get(uid)
        if hit is not None and hit.source is obj:  # the very object decoded before (informers replace, never edit)
            return hit
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or "")
        if hit is not None and hit.version == version and version:
            hit.source = obj
            return hit
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        key = gr.gpr_key(namespace, name)
        status: dict[str, Any] = obj["status"] if isinstance(obj.get("status"), dict) else {}
        fields = self.spec(uid, obj)
        proto = None
        if not isinstance(fields, str):
            created = gr.parse_time(meta.get("creationTimestamp"))
            proto = GPR(name=key, workspace=namespace, submitted_at=created if created is not None else now, **fields)
            gr.restore_status(proto, status)
            hist = history_key(obj)  # what the duration predictor knows it by
            proto.template, proto.workload = hist.template, hist.owner
        extra = any(isinstance(c, dict) and c.get("type") in _EXTRA_CONDITIONS for c in status.get("conditions") or ())
        self.changed.add(uid)
        d = Decoded(version, uid, key, _created(obj), bool(meta.get("deletionTimestamp")), gr.phase_of(obj), status,
                    meta.get("generation"), fields, proto, gr.reservation_of(obj),
                    (status.get("phase"), status.get("reason"), status.get("failures", 0), status.get("evictions", 0))
                    if status and status.get("observedGeneration") == meta.get("generation") and not extra else None,
                    spot_of(status), obj,
                    (meta.get("labels") or {}).get(AUTO_LABEL) == "true",
                    False)
        d.placed = (uid, key, tuple(sorted(d.reservation.items())))
        d.spot_numbers = _spot_numbers(d.spot)
        # stored as Queued, valid, not being deleted, and its status is what the GPR renders while nothing happens
        # to it: the pass may queue the prototype itself and needs to look at it again only if it was handed out
        d.waiting = (proto is not None and status.get("phase") == Phase.QUEUED and not d.deleting and not proto.history
                     and d.settled == (proto.phase, proto.reason, proto.failures, proto.evictions))
        if hit is not None and hit.rank is not None and proto is not None and hit.proto is not None and (
                _ranked_fields(proto) == _ranked_fields(hit.proto)):
            d.rank = hit.rank  # a status write (queue position, estimate) leaves its place in the order as it was
        self.decoded[uid] = d
        return d

    def ordered(self, gprs: Mapping[str, dict[str, Any]], now: float) -> list[Decoded]:
        """The GPRs decoded, in creation order; the last order again when every object is the one seen then."""
        decode = self.decode
        uids, objs = list(gprs), list(gprs.values())
        last_uids, last_objs = self.listed
        if len(objs) == len(last_objs) and uids == last_uids:
            # the same UIDs in the same places (a snapshot copies the informer's dict, whose order an update
            # keeps): only the places whose object was replaced are decoded again, found without a Python loop
            # over the 15,000 that were not (a steady pass spent 9 ms here on identity checks)
            seen = self.seen
            changed = list(itertools.compress(itertools.count(), map(operator.is_not, objs, last_objs)))
            found: list[tuple[Decoded, Decoded]] = []  # (old, new) of each place whose decoded object changed
            if changed:
                seen = list(seen)
                for i in changed:
                    new = decode(uids[i], objs[i], now)
                    if new is not seen[i]:
                        found.append((seen[i], new))
                        seen[i] = new
            swaps: list[tuple[Decoded, Decoded]] | None = found
        else:
            seen, swaps = [decode(uid, obj, now) for uid, obj in gprs.items()], None
        self.listed = (uids, objs)
        # a list compares its items by identity first: equal lists cost no Decoded.__eq__
        self.same = seen == self.seen
        if not self.same:
            at = self.sorted_at
            if swaps and all(old.order == new.order and id(old) in at for old, new in swaps):
                # new versions of the same objects (a status write): each takes its predecessor's place in the
                # creation order, which a version never changes (no sort of 15,000 after each write)
                ordered = list(self.sorted)
                for old, new in swaps:
                    k = at.pop(id(old))
                    ordered[k] = new
                    at[id(new)] = k
                self.sorted = ordered
            else:
                self.sorted = sorted(seen, key=_ORDER)
                self.sorted_at = {id(d): k for k, d in enumerate(self.sorted)}
            self.seen = seen
        return self.sorted

    def allocated_of(self, decoded: list[Decoded]) -> tuple[list[Decoded], tuple[Any, ...]]:
        """The allocated GPRs among ``decoded`` (their devices taken: Admitted, Running, Evicting; valid, not
        being deleted) and what the base is keyed by of each (:attr:`Decoded.placed`), kept while the decoded
        list is the one seen last time."""
        if self._allocated is None or self._allocated[0] is not decoded:
            allocated = [d for d in decoded if d.phase in gr.ALLOCATED_PHASES and not d.deleting and d.proto is not None]
            self._allocated = (decoded, allocated, tuple(d.placed for d in allocated))
        return self._allocated[1], self._allocated[2]

    def flagged(self, nodes: list[NodeView], inv: Inventory) -> list[tuple[str, bool]]:
        """The inventory's nodes that are unhealthy for their resource (True) or closed to new work (False), in
        the snapshot's order: a function of the node views alone (the inventory's nodes and resources are made
        from them), kept while every view is the one seen last time."""
        if self._flagged is None or self._flagged[0] != nodes:
            index, specs = inv.index, inv.specs
            out = []
            for node in nodes:
                n = index.get(node.name)
                if n is None:
                    continue
                if node.health_reason(specs[n].resource):
                    out.append((node.name, True))
                elif node.closed:
                    out.append((node.name, False))
            self._flagged = (nodes, out)
        return self._flagged[1]

    def autos_of(self, decoded: list[Decoded]) -> list[Decoded]:
        """The auto-created GPRs among ``decoded`` (kept while the decoded list is the one seen last time)."""
        if self._autos is None or self._autos[0] is not decoded:
            self._autos = (decoded, [d for d in decoded if d.auto])
        return self._autos[1]

    def gpr(self, d: Decoded) -> GPR:
        """A fresh core GPR (spec and status restored) copied from the decoded prototype."""
        assert d.proto is not None
        return clone(d.proto)

    def node_specs(self, nodes: Mapping[str, NodeView]) -> list[NodeSpec]:
        out = []
        for name in sorted(nodes):
            view = nodes[name]
            hit = self.nodes.get(name)
            if hit is None or hit[0] is not view:
                hit = self.nodes[name] = (view, node_spec(view))
            if hit[1] is not None:
                out.append(hit[1])
        if len(self.nodes) > len(nodes):
            for gone in [n for n in self.nodes if n not in nodes]:
                del self.nodes[gone]
        return out

    def spec(self, uid: str, obj: dict[str, Any]) -> dict[str, Any] | str:
        meta = obj.get("metadata") or {}
        generation = meta.get("generation")
        hit = self.specs.get(uid)
        if hit is not None and hit[0] == generation:
            return hit[1]
        value: dict[str, Any] | str
        try:
            value = gr.check_spec(obj.get("spec") if obj.get("spec") is not None else {})
            name = meta.get("name")
            if not isinstance(name, str) or not 0 < len(name) <= gr.MAX_NAME:
                raise gr.SpecError(f"metadata.name: 1 to {gr.MAX_NAME} characters (pods name their GPR in the "
                                   f"label {gr.GPR_LABEL})")
            if value["milli_per_device"] < 1000:
                raise gr.SpecError(live_cluster_limitation())
        except gr.SpecError as exc:
            value = str(exc)
        self.specs[uid] = (generation, value)
        return value

    def prune(self, live: set[str]) -> None:
        for table in (self.specs, self.decoded):
            if len(table) > len(live):
                for uid in [u for u in table if u not in live]:
                    del table[uid]


class PodsByGPR:
    """The pods of a snapshot by GPR, as a pass reads them; a function of the pods alone (kept between passes
    while every pod is the one seen last time, and made from the last one when a few pods changed: see
    :meth:`after`). The tables' key order is not part of what they say."""

    def __init__(self, seen: list[PodView]) -> None:
        self.seen = seen
        self.of: dict[str, list[PodView]] = {}  # every pod of each GPR
        self.placed: dict[str, list[PodView]] = {}  # bound or past the gate: the only ones an eviction may take
        self.loose: list[PodView] = []  # ungated and unbound: waiting for kube-scheduler (few)
        # live pods of a GPR held at its gate: where they can run is where the GPR may go. Their node affinity is
        # all their own (accelstack narrows a pod only in the patch that lifts the gate, or, in the webhook,
        # instead of it)
        self.gated: dict[str, list[PodView]] = {}
        # GPR -> node -> CPU and memory its live pods bound there request (only GPRs whose pods request some)
        self.hosted: dict[str, dict[str, tuple[int, int]]] = {}
        # made by after(): the tables it was made from, and the GPRs whose tables were made again (the others
        # keep their very lists)
        self.origin: PodsByGPR | None = None
        self.affected: frozenset[str] = frozenset()
        self.moved: frozenset[str] = frozenset()  # the nodes the changed pods were or are on
        gate = gr.SCHEDULING_GATE
        for p in seen:
            if p.gpr and self._file(p, gate):
                self.loose.append(p)

    def _file(self, p: PodView, gate: str) -> bool:
        """Put pod ``p`` (of a GPR) in its GPR's tables; True when it is loose (ungated and unbound)."""
        self.of.setdefault(p.gpr, []).append(p)
        if p.node:
            self.placed.setdefault(p.gpr, []).append(p)
            if (p.host[0] or p.host[1]) and p.phase not in TERMINAL_POD_PHASES:
                on = self.hosted.setdefault(p.gpr, {})
                have = on.get(p.node, (0, 0))
                on[p.node] = (have[0] + p.host[0], have[1] + p.host[1])
        elif gate not in p.gates:
            self.placed.setdefault(p.gpr, []).append(p)
            return True
        elif not p.terminating and p.phase not in TERMINAL_POD_PHASES:
            self.gated.setdefault(p.gpr, []).append(p)
        return False

    @classmethod
    def after(cls, prev: PodsByGPR, seen: list[PodView]) -> PodsByGPR:
        """``PodsByGPR(seen)``, made from ``prev`` (the last pass's) when at most :data:`MOVED_LIMIT` pods changed
        (by identity: the informer replaces a pod's view when its object changes, in place in its order, and
        appends a new pod): the tables of the GPRs those pods belong or belonged to are made again, in
        ``seen``'s order; every other GPR keeps its lists, the very objects (a later step that keeps what it
        worked out for a GPR's list sees it unchanged)."""
        old = prev.seen
        diff = _list_changes(old, seen, MOVED_LIMIT)
        if diff is None:
            return cls(seen)
        pairs, deleted, added = diff
        swapped = {id(a): b for a, b in pairs}  # old view -> its new version, in the same place
        moved = _moved_nodes(pairs, deleted, added)
        affected = {a.gpr for a, _ in pairs if a.gpr}
        affected.update(b.gpr for _, b in pairs if b.gpr)
        affected.update(p.gpr for p in added if p.gpr)
        affected.update(p.gpr for p in deleted if p.gpr)
        out = cls([])
        out.seen, out.origin, out.affected, out.moved = seen, prev, frozenset(affected), moved
        prev.origin = None  # one step back only: no chain of every pass's tables
        out.of, out.placed, out.gated, out.hosted = dict(prev.of), dict(prev.placed), dict(prev.gated), dict(prev.hosted)
        if not affected:
            out.loose = prev.loose
            return out
        regrouped = any(a.gpr != b.gpr for a, b in pairs)
        if regrouped:  # a pod moved to another GPR: its place in that GPR's list is its place in ``seen``
            members = [p for p in seen if p.gpr in affected]
        else:
            gone = {id(p) for p in deleted}
            members = [swapped.get(id(p), p) for key in affected for p in prev.of.get(key, ()) if id(p) not in gone]
            members += [p for p in added if p.gpr]
        for key in affected:
            for table in (out.of, out.placed, out.gated, out.hosted):
                table.pop(key, None)
        gate = gr.SCHEDULING_GATE
        loose_now = {id(p) for p in members if out._file(p, gate)}
        was = [p for p in prev.loose if p.gpr in affected]
        if not regrouped and not added and not deleted and len(loose_now) == len(was) and all(
                id(swapped.get(id(p), p)) in loose_now for p in was):
            out.loose = [swapped.get(id(p), p) for p in prev.loose]  # the same pods loose, in their places
        else:
            keep = {id(p) for p in prev.loose if p.gpr not in affected} | loose_now
            out.loose = [p for p in seen if id(p) in keep] if keep else []
        return out


class Waiting:
    """The queued GPRs a pass queues as shared prototypes, kept between passes as one :class:`QueuedBlock` and
    patched by UID as their objects change (10,000 queued GPRs then cost a pass a few copies, not a restore
    each). Whether a GPR belongs is a function of its object, the time and the pass's configuration alone
    (:func:`_shareable`), so a patched block equals the one a fresh start builds."""

    def __init__(self, predictor: DurationPredictor, key: tuple[Any, ...]) -> None:
        # what the members' ranks and membership were judged under (see _waiting)
        self.predictor, self.key = predictor, key
        self.block = QueuedBlock()
        self.members: dict[str, Decoded] = {}  # UID -> the decoded object its entry was made from
        self.uid_of: dict[str, str] = {}  # core name -> UID
        self.objects: dict[str, Decoded] = {}  # core name -> decoded object
        self.later: list[tuple[float, str]] = []  # (retry time, UID): stored Queued, still in their backoff
        self.later_at: dict[str, float] = {}  # UID -> its live entry's retry time (one per UID: no growth)
        self.version = 0  # +1 at every change of membership
        self.now = -math.inf  # the latest time it was judged at (a clock set back rebuilds it)

    def add(self, d: Decoded, rank: tuple[int, float, float]) -> None:
        assert d.proto is not None
        self.block.add(d.proto, rank)
        self.members[d.uid], self.uid_of[d.key], self.objects[d.key] = d, d.uid, d
        self.version += 1

    def discard(self, d: Decoded) -> None:
        self.block.discard(d.key)
        del self.members[d.uid], self.uid_of[d.key], self.objects[d.key]
        self.version += 1


def _shareable(d: Decoded, now: float, workspaces: WorkspaceIndex | None) -> bool:
    """Stored as Queued, ready and in its namespace's own workspace: queued as its prototype (see Decoded.waiting)."""
    proto = d.proto
    return (d.waiting and proto is not None and proto.not_before <= now
            and (workspaces is None or workspaces.key(proto.workspace, proto.resource) == proto.workspace))


def _waiting(cache: PassCache, decoded: list[Decoded], gprs: Mapping[str, Any], sched: Scheduler,
             workspaces: WorkspaceIndex | None, owner: dict[str, str] | None, now: float) -> Waiting | None:
    """The block of shared prototypes for this pass (None when the queue is not in size order): the last pass's,
    patched with the GPRs decoded anew since, those gone and those whose backoff has ended; built afresh when
    the ranks' inputs (the predictor and its epoch, the ageing) or the workspace map (``owner``, a copy of
    ``workspaces.owner``) changed."""
    changed, cache.changed = cache.changed, set()
    if not (sched.cfg.use_priority and sched.cfg.order == "size"):
        cache.waiting = None
        return None
    predictor = sched.predictor
    key = (predictor.epoch, sched.cfg.ageing_s, owner)
    w = cache.waiting
    candidates: Any
    if w is None or w.predictor is not predictor or w.key != key or now < w.now:
        w = cache.waiting = Waiting(predictor, key)
        candidates = decoded
    else:
        candidates = [d for d in (cache.decoded.get(uid) for uid in changed) if d is not None and d.uid in gprs]
        if not cache.same:
            for uid in w.members.keys() - gprs.keys():
                w.discard(w.members[uid])
        while w.later and w.later[0][0] <= now:
            at, uid = heapq.heappop(w.later)
            if w.later_at.get(uid) != at:
                continue  # superseded by a later entry of the same GPR
            del w.later_at[uid]
            d = cache.decoded.get(uid)
            if d is not None and uid in gprs:
                candidates.append(d)
    w.now = now
    members, objects = w.members, w.objects
    for d in candidates:
        old = members.get(d.uid)
        if old is d:
            continue
        if old is not None:
            w.discard(old)
        if _shareable(d, now, workspaces):
            if d.key not in objects:  # (names are unique in the API server; a second one is left to the pass)
                assert d.proto is not None
                w.add(d, _rank(d, d.proto, sched))
        elif d.waiting and d.proto is not None and d.proto.not_before > now and (
                w.later_at.get(d.uid) != d.proto.not_before):
            w.later_at[d.uid] = d.proto.not_before
            heapq.heappush(w.later, (d.proto.not_before, d.uid))
    return w


def live_cluster_limitation() -> str:
    return ("spec.milliPerDevice: fractions of a device are not supported on a cluster (the simulator models "
            "them); share GPUs with time-slicing replicas and ask for whole replicas instead")


def node_spec(node: NodeView) -> NodeSpec | None:
    """The core's node for a cluster node with managed devices (GPUs first when a node has both)."""
    for resource in (GPU, NR1):
        count = node.allocatable.get(resource, 0)
        if count > 0:
            try:
                memory = int(node.labels.get(MEMORY_LABEL, "0")) if resource == GPU else 0
            except ValueError:
                memory = 0
            cpu, mem = node.host if node.host is not None else (1 << 40, 1 << 40)
            return NodeSpec(node.name, count, node.labels.get(MODEL_LABEL[resource], ""), resource, memory, cpu, mem)
    return None


def node_specs(nodes: Mapping[str, NodeView]) -> list[NodeSpec]:
    return [spec for spec in (node_spec(nodes[name]) for name in sorted(nodes)) if spec is not None]


def _reserve(inv: Inventory, owner: str, reservation: tuple[tuple[str, int], ...]) -> Placement | None:
    """Allocate an Admitted/Running/Evicting GPR's recorded reservation ((node, devices) pairs, sorted) in the
    inventory (whole devices: the first free ones of each node; the kubelet picks the physical ones), for the
    scheduler to adopt; None when it no longer fits (a node left or shrank). Called before node health is
    applied to the fresh inventory: existing work stays."""
    assignments = []
    for node, count in reservation:
        n = inv.index.get(node)
        if n is None:
            return None
        free = inv.whole_free(n, count, healthy_only=False)
        if len(free) < count:
            return None
        assignments.append(NodeAssignment(n, free, 1000))
    if not assignments:
        return None
    placement = Placement(tuple(assignments))
    try:
        inv.allocate(owner, placement)
    except AllocationError:
        return None
    return placement


Entry = tuple[str, str, tuple[tuple[str, int], ...]]  # an allocated GPR's UID, key and sorted reservation
# a base is derived from the last one when at most this many entries changed, or this share of them: each costs
# about what it costs to build afresh, which then reserves every entry
DERIVE_LIMIT, DERIVE_SHARE = 64, 0.25


class Base:
    """The inventory with every allocated GPR's recorded reservation allocated in creation order (:func:`_reserve`),
    and the placement of each that fits, by key: a function of ``key`` = (node specs, each allocated GPR's
    :data:`Entry` in creation order) alone, which each pass copies before anything else touches it."""

    def __init__(self, key: tuple[tuple[NodeSpec, ...], tuple[Entry, ...]], inv: Inventory,
                 adopted: dict[str, Placement], touched: frozenset[str] | None = None,
                 on_node: dict[str, list[Entry]] | None = None, unique: bool | None = None) -> None:
        self.key, self.inv, self.adopted = key, inv, adopted
        self.touched = touched  # derived: the nodes whose allocations may differ from the base it came from
        self._on_node = on_node  # node -> the entries naming it, in creation order (made when first asked)
        # no owner name listed twice
        self.unique = len({e[1] for e in key[1]}) == len(key[1]) if unique is None else unique

    @classmethod
    def build(cls, key: tuple[tuple[NodeSpec, ...], tuple[Entry, ...]]) -> Base:
        inv = Inventory(key[0])
        adopted: dict[str, Placement] = {}
        for _, owner, reservation in key[1]:
            placement = _reserve(inv, owner, reservation)
            if placement is not None:
                adopted[owner] = placement
        return cls(key, inv, adopted)

    def on_node(self) -> dict[str, list[Entry]]:
        if self._on_node is None:
            self._on_node = {}
            for e in self.key[1]:
                for node, _ in e[2]:
                    self._on_node.setdefault(node, []).append(e)
        return self._on_node

    def derive(self, key: tuple[tuple[NodeSpec, ...], tuple[Entry, ...]]) -> Base | None:
        """``Base.build(key)``, worked out from this base when that gives the very same inventory: the same node
        specs, owner names listed once, at most :data:`DERIVE_LIMIT` entries (or :data:`DERIVE_SHARE` of them)
        gone, added or changed (admissions stored, GPRs finished), and on each node they name, those come after
        every unchanged entry naming it in both lists. Each unchanged entry then gets the devices it got here (devices are taken
        first-free, in creation order), so releasing the old entries and reserving the new ones in order ends
        where building afresh does. None otherwise (the caller builds afresh)."""
        if key[0] != self.key[0]:
            return None
        old_entries, entries = self.key[1], key[1]
        # an unchanged object's entry is the very tuple: compared by identity first, by value where it is not
        old_ids, new_ids = {id(e) for e in old_entries}, {id(e) for e in entries}
        fresh = {e[0]: e for e in entries if id(e) not in old_ids}
        stale = {e[0]: e for e in old_entries if id(e) not in new_ids}
        limit = max(DERIVE_LIMIT, int(DERIVE_SHARE * len(entries)))
        if len(fresh) + len(stale) > 2 * limit:
            return None
        gone = [e for e in stale.values() if fresh.get(e[0]) != e]
        added = [e for e in fresh.values() if stale.get(e[0]) != e]  # (in creation order)
        if not (gone or added) or len(gone) + len(added) > limit:
            return None
        unique = len({e[1] for e in entries}) == len(entries)
        if not (self.unique and unique):
            return None  # (names are unique in the API server) one owner's devices could be taken for another's
        touched = frozenset(node for e in (*gone, *added) for node, _ in e[2])
        on_node = dict(self.on_node())  # (by UID from here: an unchanged entry may be an equal, newer tuple)
        position = {e[0]: i for i, e in enumerate(entries)} if added else {}
        gone_uids = {e[0] for e in gone}
        arriving: dict[str, list[Entry]] = {}
        for e in added:
            for node, _ in e[2]:
                arriving.setdefault(node, []).append(e)
        for node in touched:
            listed = on_node.get(node, [])
            kept = [e for e in listed if e[0] not in gone_uids]
            if any(e[0] in gone_uids for e in listed[:len(kept)]):
                return None  # a gone entry before an unchanged one on this node
            arrived = arriving.get(node, [])
            if kept and arrived and position[arrived[0][0]] < position[kept[-1][0]]:
                return None  # an added entry before an unchanged one on this node
            if kept or arrived:
                on_node[node] = kept + arrived
            else:
                on_node.pop(node, None)
        inv, adopted = self.inv.copy(), dict(self.adopted)
        for e in gone:
            inv.release(e[1])
            adopted.pop(e[1], None)
        for _, owner, reservation in added:
            placement = _reserve(inv, owner, reservation)
            if placement is not None:
                adopted[owner] = placement
        return Base(key, inv, adopted, touched, on_node, unique)


class Holders:
    """The allocated GPRs of a cached base that hold their devices (Admitted, Running; their admission recorded),
    as the second pass on the same allocated objects adopted them (objects that change at every pass pay no
    copies), kept as the scheduler's indexes of them (:class:`HolderState`) and a copy of each (``templates``,
    in adoption order, never edited), to be restored into each pass's scheduler while the base, every
    allocated GPR's object (``versions``), the workspace map and the model caps stay the same: 4,800 holders
    then cost a pass a copy each, not an adoption each. :meth:`revise` keeps it through the changes a few
    holders make."""

    def __init__(self, base: Base, key: tuple[Any, ...], versions: tuple[Decoded, ...], state: HolderState,
                 templates: list[tuple[str, GPR]], uid_of: dict[str, str], objects: dict[str, Decoded],
                 members: set[str] | None = None) -> None:
        self.base, self.key, self.versions, self.state = base, key, versions, state
        self.templates = templates  # as adopted; their last activity is set per pass
        self.uid_of, self.objects = uid_of, objects
        self.members = members if members is not None else {d.uid for d in objects.values()}
        self.index: dict[str, int] | None = None

    @classmethod
    def adopted(cls, base: Base, key: tuple[Any, ...], versions: tuple[Decoded, ...], state: HolderState,
                gprs: list[GPR], uid_of: dict[str, str], objects: dict[str, Decoded]) -> Holders:
        return cls(base, key, versions, state, [(g.name, clone(g)) for g in gprs], uid_of, objects)

    def revise(self, base: Base, versions: tuple[Decoded, ...], cache: PassCache,
               workspaces: WorkspaceIndex | None, sched: Scheduler, now: float) -> Holders | None:
        """The block for new objects of the allocated GPRs (``versions``) on ``base`` (this block's, or one
        derived from it: see :meth:`Base.derive`, which keeps every unchanged entry's placement), equal to the
        one adopting them afresh builds:

        - a member whose object changed and still holds, with the same placement, and counts the same in the
          scheduler's indexes (workspace, devices, admission time, exitDuration), gets its new copy (a status
          write: its pods started, a condition);
        - a member that no longer holds (gone, finished, Evicting, its placement lost) leaves the indexes;
        - a GPR that starts to hold joins them, at its place in creation order (as adopting afresh places it;
          an admission stored is often of a GPR older than some holders: it waited in the queue).

        Returns this block (patched) when the members and the base stay, a new block when they change, None when
        a change is none of these (the block is built again)."""
        templates, members, adopted = self.templates, self.members, base.adopted
        old_ids, new_ids = {id(d) for d in self.versions}, {id(d) for d in versions}
        changed = [d for d in versions if id(d) not in old_ids]  # (in creation order)
        replaced = {d.uid for d in changed}
        leaving = {d.uid for d in self.versions if id(d) not in new_ids and d.uid in members and d.uid not in replaced}
        index = self._index()
        fresh: list[tuple[int, GPR, Decoded]] = []
        joining: list[tuple[GPR, Decoded, Placement]] = []
        for d in changed:
            if d.proto is None:
                return None
            g = cache.gpr(d)  # as the pass's loop sees it
            placement = adopted.get(d.key)
            holds = g.phase in (Phase.ADMITTED, Phase.RUNNING) and g.admitted_at is not None and placement is not None
            if workspaces is not None:
                g.workspace = workspaces.key(g.workspace, g.resource)
            if d.uid not in members:
                if holds:
                    assert placement is not None
                    joining.append((g, d, placement))
                continue
            if not holds:
                leaving.add(d.uid)
                continue
            i = index[d.key]
            template = templates[i][1]
            if placement is not template.placement or (
                    g.workspace, g.milli_total(), g.admitted_at, g.exit_duration_s) != (
                    template.workspace, template.milli_total(), template.admitted_at, template.exit_duration_s):
                return None
            g.seq, g.placement = template.seq, template.placement  # what adopting it sets
            fresh.append((i, g, d))
        if not leaving and not joining:
            block = self if base is self.base else Holders(base, self.key, versions, self.state, list(templates),
                                                           dict(self.uid_of), dict(self.objects), members)
            for i, g, d in fresh:
                block.templates[i] = (g.name, g)
                block.objects[d.key] = d
            block.versions = versions
            return block
        gone = {name for name, uid in self.uid_of.items() if uid in leaving} if leaving else set()
        state = sched.revised_holder_state(self.state, [templates[index[name]][1] for name in gone],
                                           [(g, p) for g, _, p in joining], now)
        kept = list(templates)
        objects = dict(self.objects)
        for i, g, d in fresh:
            kept[i] = (g.name, g)
            objects[d.key] = d
        uid_of = dict(self.uid_of)
        for name in gone:
            del uid_of[name], objects[name]
        for g, d, _ in joining:  # adopted by the scratch scheduler: seq, placement set as adopting them sets
            uid_of[g.name], objects[g.name] = d.uid, d
        staying = [t for t in kept if t[0] not in gone]
        joined = [(g.name, g) for g, _, _ in joining]
        if joined and staying and objects[joined[0][0]].order < objects[staying[-1][0]].order:
            # adopted afresh, holders come in creation order, and a GPR admitted now is often older than some
            # holders (it waited in the queue): the joiners take their places among them, as in the index of
            # holders (the other indexes do not depend on the order: sums, and lists and heaps of unique keys)
            staying = sorted(staying + joined, key=lambda t: objects[t[0]].order)
            joined = []
            state = dataclasses.replace(state, holders=[name for name, _ in staying])
        return Holders(base, self.key, versions, state, staying + joined, uid_of, objects,
                       (members - leaving) | {d.uid for _, d, _ in joining})

    def _index(self) -> dict[str, int]:
        """Each template's place in :attr:`templates` by name (the names and their order never change)."""
        if self.index is None:
            self.index = {name: i for i, (name, _) in enumerate(self.templates)}
        return self.index


def _created(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("creationTimestamp") or ""), str(meta.get("namespace") or ""), str(meta.get("name") or ""),
            str(meta.get("uid") or ""))


_ORDER = operator.attrgetter("order")


def _rank(d: Decoded, g: GPR, sched: Scheduler) -> tuple[int, float, float]:
    """``sched.size_rank(g)`` for the GPR decoded as ``d``, kept in ``d`` while the predictor has learned nothing
    new and the workspace and ageing are the same (the size order's place of 10,000 queued GPRs each pass)."""
    predictor, kept = sched.predictor, d.rank
    if (kept is not None and kept[0] is predictor and kept[1] == predictor.epoch and kept[2] == g.workspace
            and kept[3] == sched.cfg.ageing_s):
        return kept[4]
    rank = sched.size_rank(g)
    d.rank = (predictor, predictor.epoch, g.workspace, sched.cfg.ageing_s, rank)
    return rank


def _ranked_fields(g: GPR) -> tuple[Any, ...]:
    """What Scheduler.size_rank reads of a GPR (besides the predictor and the configuration)."""
    return (g.workspace, g.template, g.workload, g.resource, g.devices_per_node, g.milli_per_device, g.node_count,
            g.exit_duration_s, g.priority, g.submitted_at)


class _Positions:
    """Queue positions (1-based) by GPR key, indexed on the first look: a pass that writes nothing and refreshes
    nothing never needs them."""

    def __init__(self, queued: tuple[str, ...]) -> None:
        self._queued = queued
        self._index: dict[str, int] | None = None

    def get(self, key: str) -> int | None:
        return self.index().get(key)

    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {name: i + 1 for i, name in enumerate(self._queued)}
        return self._index


def run_pass(snap: Snapshot, cfg: PassConfig, cache: PassCache) -> Plan:
    """:func:`plan_pass` as the controller runs it, with the cyclic garbage collector paused. A pass builds a
    scheduler of some 75,000 objects at 15,000 GPRs that all die when it returns (by reference counting: the
    core keeps no reference cycles). With the collector running, they outlive the young collections made
    during the pass and count as long-lived, which every few passes sets off a full collection over all the
    informers' objects: 300 ms at 5,000 nodes and 15,000 GPRs, doubling every other pass."""
    with collector_paused():
        return plan_pass(snap, cfg, cache)


def plan_pass(snap: Snapshot, cfg: PassConfig, cache: PassCache) -> Plan:
    started = time.perf_counter()
    now = snap.now
    plan = Plan()
    specs = cache.node_specs(snap.nodes)
    decoded = cache.ordered(snap.gprs, now)
    allocated, placed = cache.allocated_of(decoded)
    base_key = (tuple(specs), placed)
    versions = tuple(allocated)  # the objects themselves (one Decoded per version, compared by identity)
    # the inventory with every allocated GPR's reservation: the last pass's, derived from it (a few entries
    # changed: an admission stored, a GPR finished), or built afresh
    previous, derived = cache.base, None
    if previous is not None and previous.key == base_key:
        base = previous
        base.key = base_key  # equal; its entries are this pass's very tuples (the next derive compares by identity)
    else:
        derived = previous.derive(base_key) if previous is not None else None
        base = cache.base = derived or Base.build(base_key)
    sched = Scheduler(base.inv.copy(), make_policy(cfg.policy), cfg.core, cfg.predictor, cfg.calibrator)
    inv = sched.inv

    # the pods by GPR: a function of the pods alone, kept while every pod is the one seen last time
    pods_seen = list(snap.pods.values())
    kept_pods = cache.pods
    if kept_pods is not None and kept_pods.seen == pods_seen:
        pods = kept_pods
    else:
        pods = cache.pods = PodsByGPR(pods_seen) if kept_pods is None else PodsByGPR.after(kept_pods, pods_seen)
    pods_of, loose, gated = pods.of, pods.loose, pods.gated

    size_ranked = sched.cfg.use_priority and sched.cfg.order == "size"
    uid_of: dict[str, str] = {}  # core name (namespace/name) -> UID of the live object
    objects: dict[str, Decoded] = {}
    final: dict[str, str] = {}  # key -> phase, for GPRs that hold nothing any more (their bound pods must go)
    deleting: set[str] = set()
    workspaces = cfg.workspaces
    # stored as Queued and ready: the scheduler queues the prototypes themselves and copies one only if the pass
    # looks at it (most of 10,000 queued GPRs it never reaches); the rest are restored one by one
    rest = decoded
    owner = None if workspaces is None else dict(workspaces.owner)  # what both kept blocks were built under
    w = _waiting(cache, decoded, snap.gprs, sched, workspaces, owner, now)
    if w is not None:
        sched.restore_block(w.block, now)
        uid_of.update(w.uid_of)
        objects.update(w.objects)
    # the holders of the cached base (or of the one it was derived from, revised: see Holders.revise), adopted as
    # the pass that cached them adopted them
    caps = sched.cfg.model_caps or {}
    holders_key = (owner, {k: dict(v) for k, v in caps.items()})
    hb = cache.holders
    if hb is not None and (hb.key != holders_key or not (hb.base is base or (derived and hb.base is previous))):
        hb = None
    elif hb is not None and (hb.versions != versions or hb.base is not base):
        hb = hb.revise(base, versions, cache, workspaces, sched, now)
    cache.holders = hb  # (one that no longer serves is dropped)
    if hb is not None:
        uid_of.update(hb.uid_of)
        objects.update(hb.objects)
    if w is not None or hb is not None:
        kept = cache.rest
        if (kept is not None and kept[0] is decoded and kept[1] is w and kept[2] == (w.version if w else 0)
                and kept[3] is hb):
            rest = kept[4]
        else:
            skip = (w.members.keys() if w is not None else set()) | (hb.members if hb is not None else set())
            rest = [d for d in decoded if d.uid not in skip]
            cache.rest = (decoded, w, w.version if w else 0, hb, rest)
    tally = cache.tallies.of
    keeping: list[tuple[GPR, Placement]] = []  # adopted after the loop: holders first, then the rest
    leaving: list[tuple[GPR, Placement]] = []
    for d in rest:
        uid, key, status, phase = d.uid, d.key, d.status, d.phase
        if d.deleting:
            deleting.add(key)
            continue
        if isinstance(d.fields, str):
            if not (phase == Phase.FAILED.value and status.get("reason") == "InvalidSpec"
                    and status.get("message") == d.fields and status.get("observedGeneration") == d.generation):
                plan.writes.append(StatusWrite(uid, key, {"phase": Phase.FAILED.value, "reason": "InvalidSpec",
                                                          "message": d.fields, "observedGeneration": d.generation,
                                                          "failures": status.get("failures", 0) or 0,
                                                          "evictions": status.get("evictions", 0) or 0}))
            final[key] = Phase.FAILED.value
            continue
        # Phase is a StrEnum: its members equal their strings (no .value here: an enum property costs a Python
        # call, and these loops run 15,000 times a pass)
        rejudged = phase == Phase.FAILED and status.get("reason") == "InvalidSpec"
        if phase in gr.FINAL_PHASES and not rejudged:
            final[key] = phase
            continue
        g = cache.gpr(d)
        if workspaces is not None:
            g.workspace = workspaces.key(g.workspace, g.resource)
        uid_of[key] = uid
        objects[key] = d
        if g.phase in ALLOCATED:
            stamped = g.admitted_at is None
            if stamped:
                g.admitted_at = now
            g.last_active_at = _last_active(g, tally(key, g, pods_of.get(key, _NO_PODS)), now)
            placement = base.adopted.get(key)
            if placement is None:
                ran = any(p.live and p.node for p in pods_of.get(key, ()))
                plan.events += [(uid, e) for e in _node_lost(sched, g, now, ran)]
                continue
            (leaving if stamped or g.phase is Phase.EVICTING else keeping).append((g, placement))
            continue
        reason = g.reason if g.phase is Phase.QUEUED and not rejudged else ""
        # stored as Queued: nothing new (an empty history marks a GPR whose status needs no write)
        sched.restore_queued(g, now, g.not_before, _rank(d, g, sched) if size_ranked else None,
                             news=status.get("phase") != Phase.QUEUED)
        g.reason = reason
    # adopted under arrival number 0, whatever came before them: the same in a warm and a cold pass
    if hb is not None:
        assert not keeping, "a holder of the cached base was left to the loop"
        fresh: dict[str, GPR] = {}
        for name, template in hb.templates:
            g = clone(template)
            g.last_active_at = _last_active(g, tally(name, g, pods_of.get(name, _NO_PODS)), now)
            fresh[name] = g
        sched.restore_holders(hb.state, fresh, now)
    else:
        for g, placement in keeping:
            sched.adopt(g, placement, now, allocated=True, seq=0)
    if hb is None and versions == cache.versions:
        # kept from the second pass on the same objects: a holder that changes at every pass pays no copies
        cache.holders = Holders.adopted(base, holders_key, versions, sched.holder_state(), [g for g, _ in keeping],
                                {g.name: uid_of[g.name] for g, _ in keeping},
                                {g.name: objects[g.name] for g, _ in keeping})
    cache.versions = versions
    for g, placement in leaving:
        sched.adopt(g, placement, now, allocated=True, seq=0)

    nodes_seen = list(snap.nodes.values())
    # devices held outside reservations: a function of the pods, the nodes' ledgers and the allocated GPRs alone,
    # so the last pass's answer stands while every pod is the one seen then, every node has the ledger seen then
    # (a status heartbeat, ~17 node updates a second at 5,000 nodes, changes nothing) and the base is the same
    last = cache.outside
    ledgers = last is not None and (last[2] == nodes_seen or _same_ledgers(last[2], nodes_seen))
    # the nodes whose pods changed since the last pass (None: too many to count apart, or nothing to compare)
    pods_moved: frozenset[str] | None = None
    if ledgers and last is not None:
        if last[1] == pods_seen:
            pods_moved = frozenset()
        elif pods.origin is not None and pods.origin.seen is last[1]:
            pods_moved = pods.moved  # the tables were made from the last pass's: the same comparison, done once
        else:
            pods_moved = _pods_moved(last[1], pods_seen)
    if pods_moved is not None and not pods_moved and last is not None and last[0] is base:
        used = last[3]
    elif pods_moved is not None and last is not None and (last[0] is base or (derived is not None
                                                                         and last[0] is previous)):
        # each node's count depends on its own pods, ledger and reservations alone: only the nodes a changed pod
        # was or is on, and those a derived base's changed entries name, can count differently
        touched = pods_moved | (derived.touched or frozenset() if last[0] is not base and derived is not None
                           else frozenset())
        used = {name: count for name, count in last[3].items() if name not in touched}
        on_node = base.on_node()
        naming = {e[1] for n in touched for e in on_node.get(n, ())}  # the GPRs whose reservations name them
        used.update(_used_outside_reservations(sched, snap, (frozenset(touched), naming)))
    else:
        used = _used_outside_reservations(sched, snap)
    cache.outside = (base, pods_seen, nodes_seen, used)
    overs: dict[str, int] = {}  # node -> devices its outside pods use beyond what its reservations leave free
    for name, count in used.items():
        over = count - sched.hold(f"pods@{name}", name, count)
        if over > 0:
            overs[name] = over
    if overs:  # all nodes at once: a GPR given back for one node frees devices on its other nodes too
        plan.events += [(uid_of.get(e.gpr, ""), e) for e in _taken_from_reservations(sched, overs, pods_of, now)]
    gated_needs = GatedNeeds(pods.gated)
    sched.need_host(gated_needs)
    short = _withhold_host(sched, snap, pods, pods_of, cache, (pods, base, versions))
    for name, sick in cache.flagged(nodes_seen, inv):
        if sick:
            plan.events += [(uid_of.get(e.gpr, ""), e) for e in sched.set_health(name, None, False, now)]
        else:  # closed: no new reservation; the ones it has stay
            sched.close(name)
    # a GPR the webhook made for a pod that no informer has shown yet waits for it: where its pod may run is not
    # known, and a pod whose creation failed after the webhook answered never comes (it is deleted after
    # orphan_grace, having held nothing meanwhile)
    for d in cache.autos_of(decoded):
        if d.key not in pods_of and not d.deleting:
            held = sched.gprs.get(d.key)
            if held is not None and held.phase is Phase.QUEUED:
                sched.defer(d.key)
    fit = cache.fit
    if gated:
        fit.sync(inv.names, snap.nodes)
        # the last pass's limits stand while the GPR objects, the pods, what the fit reads of the nodes and the
        # inventory are the very ones it had
        last_fit = cache.limits
        reuse = (last_fit is not None and cache.same and last_fit[1] == fit.generation and last_fit[2] is base
                 and (last_fit[0] is pods or last_fit[0] is pods.origin))
        # made from the last pass's tables: only the GPRs whose pods changed are judged again, and those this pass
        # has queued again so far (a reservation given back to pods outside any GPR, a node lost or sick: the
        # last pass judged them holding, so its limits have nothing for them)
        redo: AbstractSet[str] = (pods.affected if reuse and last_fit is not None and last_fit[0] is not pods
                                  else frozenset())
        if reuse and plan.events:
            redo = redo | {e.gpr for _, e in plan.events if e.gpr in gated}
        gave_back, limits = _fit_pods(sched, fit, gated, pods_of, now, last_fit[3] if reuse and last_fit else None,
                                      redo)
        cache.limits = (pods, fit.generation, base, limits)
        plan.events += [(uid_of.get(e.gpr, ""), e) for e in gave_back]
        for key, node in short:  # reserved where its pods' CPU or memory no longer fits: placed again
            held = sched.holders.get(key)
            if held is not None and held.phase is Phase.ADMITTED:
                plan.events += [(uid_of.get(key, ""), e) for e in sched.give_back(
                    key, now, f"Requeued: its pods' CPU or memory requests do not fit on reserved node {node}")]
    else:
        cache.limits = None  # nothing judged this pass: nothing a later pass may build on
    fit.forget_except(gated)
    plan.events += [(uid_of.get(e.gpr, ""), e) for e in _pod_facts(sched, pods_of, tally, now)]
    cache.tallies.prune(sched.holders)
    ticked = sched.tick(now)
    plan.events += [(uid_of.get(e.gpr, ""), e) for e in ticked]
    extra: dict[str, list[dict[str, Any]]] = {}
    for e in ticked:
        if e.kind == "idle":  # not enforced: said once, in a condition, while it stays idle
            extra.setdefault(e.gpr, []).append({"type": "Idle", "status": "True", "reason": "IdleTimeout",
                                                "message": "no pod has run for longer than spec.idleTimeout"})
    admitted = Phase.ADMITTED
    for key, g in sched.holders.items():  # reserved from the GPR's spec: say so when its pods cannot go there
        if g.phase is admitted and g.placement is not None and key in pods_of:  # Running ones: pods went
            why = _cannot_run(pods_of[key], [snap.nodes.get(sched.inv.names[a.node]) for a in g.placement.assignments])
            if why:
                extra.setdefault(key, []).append({"type": "PodsCannotRun", "status": "True", "reason": "Unschedulable",
                                                  "message": why})
    for key, nodes in sched.limits.items():  # queued, kept to where its pods can run, and too big for those nodes
        waiting = sched.gprs.get(key)
        if waiting is not None and waiting.phase is Phase.QUEUED and waiting.reason == "Unschedulable":
            listed = ", ".join(sorted(nodes)[:5]) + (", ..." if len(nodes) > 5 else "")
            extra.setdefault(key, []).append({
                "type": "PodsCannotRun", "status": "True", "reason": "Unschedulable",
                "message": f"its pods can run on {len(nodes)} node(s) with {waiting.resource}"
                           + (f" ({listed})" if nodes else "")
                           + ", too few or too small for it even with nothing else running (their tolerations, "
                             "nodeSelector and node affinity against the nodes' taints and labels)"})
    largest: dict[str, tuple[int, int]] = {}  # resource -> the most CPU and memory one of its nodes offers
    for key, (cpu, mem) in gated_needs.asked.items():  # queued, and asking more CPU or memory than any node has
        waiting = sched.gprs.get(key)
        if waiting is None or waiting.phase is not Phase.QUEUED or key in extra:
            continue
        if waiting.reason != "Unschedulable":
            # the core tried to place it (a few a pass: the heads of the queue) and could not: say so when its
            # devices would be there now and what other pods request of those nodes' CPU or memory is what stops it
            asked = sched.request_of(waiting)
            if key not in sched.deferred and waiting.not_before <= now and not fits(inv, asked) and fits(
                    inv, dataclasses.replace(asked, cpu_milli=waiting.cpu_milli_per_node,
                                             memory_mib=waiting.memory_mib_per_node)):
                extra.setdefault(key, []).append({
                    "type": "PodsCannotRun", "status": "True", "reason": "InsufficientHostResources",
                    "message": f"its pods ask for {cpu}m CPU and {mem}Mi memory on each node; the nodes with free "
                               f"{waiting.resource} for it have less CPU or memory free now (what the pods bound "
                               "there, and those of GPRs holding them, request)"})
            continue
        if waiting.resource not in largest:
            specs = [sp for sp in inv.specs if sp.resource == waiting.resource]
            largest[waiting.resource] = (max((sp.cpu_milli for sp in specs), default=0),
                                         max((sp.memory_mib for sp in specs), default=0))
        most_cpu, most_mem = largest[waiting.resource]
        if cpu > most_cpu or mem > most_mem:
            extra.setdefault(key, []).append({
                "type": "PodsCannotRun", "status": "True", "reason": "Unschedulable",
                "message": f"its pods ask for {cpu}m CPU and {mem}Mi memory on each node, more than any node with "
                           f"{waiting.resource} has allocatable (at most {most_cpu}m CPU, {most_mem}Mi memory)"})

    # what the pass that set a queued GPR's reason found (which quota, how much of it is used): into its message
    found = {e.gpr: e.detail for _, e in plan.events if e.kind in _WAIT_DETAIL}
    estimates: dict[str, Interval] = {}
    plan.queue = tuple(sched.queued_names())
    refresh = cfg.refresh_queue or (cfg.refresh_on_change and plan.queue != cfg.last_queue)
    plan.refreshed = refresh
    if refresh and cfg.estimates and plan.queue:
        queued = sched.peek_queued()  # read only: prototypes stay unhanded (the loop below skips them cheaply)
        t0 = time.perf_counter()
        estimates = sched.estimate_ranges(now)
        plan.estimate_seconds = time.perf_counter() - t0
        noted = cfg.noted
        unnoted = [g for g in queued if (u := uid_of.get(g.name)) is not None and u not in noted]
        plan.projections = {uid_of[name]: at for name, at in sched.projections(unnoted).items()}
    positions = _Positions(plan.queue)
    # a refresh asks every queued GPR where it stands: plain dictionary lookups, bound once
    position_of, estimate_of = (positions.index().get if refresh else positions.get), estimates.get
    # a refresh asks every queued prototype whether its stored spot moved enough: all at once, by queue position
    queue = plan.queue
    moved_at = (_spots_moved([objects[key].spot_numbers for key in queue], [estimate_of(key) for key in queue], now)
                if refresh else np.zeros(0, dtype=bool))
    moved = moved_at.tolist()

    def spot_moved(key: str, d: Decoded, estimate: Any) -> bool:
        """On a refresh: whether a queued GPR's stored place and estimate moved enough to be written again."""
        place = position_of(key)
        return moved[place - 1] if place is not None else _spot_moved(d.spot, None, estimate, now)

    names, refusals, holding_phases = inv.names, snap.refusals, (Phase.ADMITTED, Phase.RUNNING)
    # queued as their prototypes and never handed out (most of 10,000): nothing happened to them; outside a
    # refresh their status stands, on a refresh too unless their place or estimate moved enough or they have a
    # condition or an eviction refusal to write (the first test below), found with one set lookup each
    untouched: AbstractSet[str] = sched.queue.shared()
    if refresh:
        still = set(map(queue.__getitem__, np.flatnonzero(~moved_at).tolist()))
        refused = {key for key, u in uid_of.items() if u in refusals} if refusals else ()
        untouched = (still & untouched) - extra.keys() - set(refused)
    for key, g in sched.gprs.items():
        if key in untouched:
            continue
        d = objects[key]
        if g is d.proto and (not refresh or (
                not (refusals and d.uid in refusals) and key not in extra
                and not spot_moved(key, d, estimate_of(key)))):
            # queued as its prototype and never handed out: nothing happened to it, its status stands (stored
            # settled: see Decoded.waiting), or on a refresh, at most its place in the queue moved, too little
            continue
        uid = d.uid
        refusal = refusals.get(uid) if refusals else None
        estimate = _honest(g, estimates.get(key) if estimates else None)
        # nothing happened to it in this pass: at most its place in the queue moved (checked on a refresh only,
        # from those fields alone: rendering 10,000 whole statuses to find a few that moved cost 0.8 s a refresh)
        settled = d.settled
        if (settled is not None and not g.history and not refusal and key not in extra
                and settled == (g.phase, g.reason, g.failures, g.evictions)) and (
                not refresh or g.phase is not Phase.QUEUED or not spot_moved(key, d, estimate)):
            if g.phase in holding_phases:
                plan.ungate[uid] = [names[a.node] for a in g.placement.assignments] if g.placement else []
            continue
        finite = estimate is not None and math.isfinite(estimate.start)
        if refusal and g.phase is Phase.EVICTING:
            reason = "PodDisruptionBudget" if " 429 " in f" {refusal} " else "EvictionRefused"
            extra.setdefault(key, []).append({"type": "EvictionBlocked", "status": "True", "reason": reason,
                                              "message": refusal[:1000]})
        current = d.status
        parts = g.placement.assignments if g.placement is not None and g.phase in ALLOCATED else ()
        reserved = [inv.names[a.node] for a in parts]
        reservation: list[dict[str, Any]] = [{"node": inv.names[a.node], "devices": len(a.devices)} for a in parts]
        holding = g.phase in (Phase.ADMITTED, Phase.RUNNING)
        if holding:
            plan.ungate[uid] = reserved
        body = gr.status_body(g, queue_position=positions.get(key), detail=_wait_detail(g, found.get(key), current),
                              estimated_start=estimate.start if estimate is not None and finite else None,
                              estimated_range=(estimate.low, estimate.high) if estimate is not None and finite else None,
                              reservation=reservation, now=now,
                              observed_generation=d.generation,
                              conditions=extra.get(key), previous_conditions=current.get("conditions"))["status"]
        if _differs(current, body, refresh, now):
            if not refresh:  # keep the stored position and estimate until the next refresh
                for k in QUEUE_FIELDS:
                    if g.phase is Phase.QUEUED and k in current:
                        body[k] = current[k]
                    else:
                        body.pop(k, None)
            plan.writes.append(StatusWrite(uid, key, body, holding, refresh and g.phase is Phase.QUEUED
                                           and not _differs(current, body, False, now)))
    plan.evictions = _evictions(sched, pods.placed, final, deleting, uid_of) + _stale_narrowings(sched, loose, snap,
                                                                                            uid_of)
    plan.orphans = _orphans(decoded, pods_of, now, cfg.orphan_grace)
    plan.queued = len(plan.queue)
    plan.holding = len(sched.holders)
    plan.wakeup = sched.next_wakeup()
    cache.prune(set(snap.gprs))
    plan.seconds = time.perf_counter() - started
    return plan


def _last_active(g: GPR, tally: PodTally, now: float) -> float:
    """When the GPR last had a running pod: now if one runs, else the latest end of one of its pods after
    admission, else its start (or admission). An Admitted GPR whose pods never start is idle since admission."""
    if tally.any_running:
        return now
    since = g.started_at or g.admitted_at or now
    return tally.last_end if tally.last_end > since else since


class PodTally(NamedTuple):
    """What a pass reads of an allocated GPR's pods: a function of the pods and the GPR's admission time alone."""

    counted: int  # pods of this admission (not bound, nor ended, before it)
    running: int  # of those, Running
    ended: int  # of those, Succeeded or Failed
    failed: int  # of those, Failed
    any_running: bool  # any pod Running (of this admission or not)
    last_end: float  # the latest end of any pod (0 if none ended)


_NO_PODS: tuple[PodView, ...] = ()


def pod_tally(pods: Sequence[PodView], since: float) -> PodTally:
    counted = running = ended = failed = 0
    any_running, last_end = False, 0.0
    for p in pods:
        phase = p.phase
        if phase == "Running":
            any_running = True
        if p.ended_at > last_end:
            last_end = p.ended_at
        terminal = phase in TERMINAL_POD_PHASES
        # pods of an earlier admission of this GPR (bound or ended before this one) say nothing about this one
        if (p.bound_at and p.bound_at < since) or (terminal and p.ended_at and p.ended_at < since):
            continue
        counted += 1
        if phase == "Running":
            running += 1
        elif terminal:
            ended += 1
            failed += phase == "Failed"
    return PodTally(counted, running, ended, failed, any_running, last_end)


class PodTallies:
    """:func:`pod_tally` of each allocated GPR, kept while its pods are the very views (or equal ones) and its
    admission time the one seen last time: 4,800 running GPRs cost a pass a lookup each, not a count of their
    pods twice."""

    def __init__(self) -> None:
        self.kept: dict[str, tuple[Sequence[PodView], float, PodTally]] = {}

    def of(self, key: str, g: GPR, pods: Sequence[PodView]) -> PodTally:
        since = g.admitted_at or 0.0
        hit = self.kept.get(key)
        if hit is not None and hit[1] == since and hit[0] == pods:
            return hit[2]
        tally = pod_tally(pods, since)
        self.kept[key] = (pods, since, tally)
        return tally

    def prune(self, live: Collection[str]) -> None:
        """Forget the GPRs not in ``live`` once they are as many as those in it (amortised: not every pass)."""
        if len(self.kept) > 2 * len(live) + 64:
            self.kept = {key: hit for key, hit in self.kept.items() if key in live}


def _taken_from_reservations(sched: Scheduler, overs: Mapping[str, int], pods_of: Mapping[str, Sequence[PodView]],
                             now: float) -> list[Event]:
    """Pods outside any GPR (bound by ``nodeName`` or another scheduler) use ``overs[node]`` more devices of each
    node than its reservations leave free: those reservations no longer fit. Admitted GPRs reserved there none of
    whose pods is bound anywhere give their reservations back and queue again as they are (no failure, no backoff;
    the next pass places them elsewhere or they wait), the latest admitted first, while a node they reserve is
    still short; the devices given back, on every node that was short, go to the outside pods. A GPR with a bound
    pod keeps its reservation (its work started). Judged over all short nodes at once, in one order of GPRs: a GPR
    reserved on two short nodes covers both, and a warm pass (nodes counted in another order) gives back and holds
    what a cold one does."""
    index = sched.inv.index
    left = {index[name]: over for name, over in overs.items()}
    candidates = sorted(((g.admitted_at or 0.0, key, g) for key, g in sched.holders.items()
                         if g.phase is Phase.ADMITTED and g.placement is not None
                         and any(a.node in left for a in g.placement.assignments)
                         and not any(p.node for p in pods_of.get(key, ()))), key=lambda t: (-t[0], t[1]))
    events: list[Event] = []
    names = sched.inv.names
    for _, key, g in candidates:
        parts = g.placement.assignments  # type: ignore[union-attr]
        short = [a for a in parts if left.get(a.node, 0) > 0]
        if not short:
            continue
        taken = ", ".join(f"{len(a.devices)} reserved device(s) of node {names[a.node]}" for a in short)
        events += sched.give_back(key, now, f"Requeued: pods outside any GPR took {taken} before any pod of it "
                                            "started (ReservationTaken)")
        for a in short:
            left[a.node] -= len(a.devices)
    if events:
        for name, over in overs.items():  # what the outside pods use of the devices just given back
            sched.hold(f"pods+@{name}", name, over)
    return events


_HELD_BY_POLICY = ("WorkspaceQuota", "ModelQuota")


def _honest(g: GPR, estimate: Interval | None) -> Interval | None:
    """A queued GPR's estimate as written: none while its workspace quota or a model cap holds it (the fluid
    projection cannot tell when its workspace's holders leave enough room: "now" would be a promise the
    controller will not keep), and never before the end of its backoff (the earliest time it may start)."""
    if estimate is None or g.phase is not Phase.QUEUED:
        return estimate
    if g.reason in _HELD_BY_POLICY:
        return None
    nb = g.not_before
    if math.isfinite(estimate.start) and estimate.start < nb:
        return Interval(nb, max(estimate.low, nb), max(estimate.high, nb))
    return estimate


_WAIT_DETAIL = {"workspacequota": "WorkspaceQuota", "modelquota": "ModelQuota", "unschedulable": "Unschedulable",
                "insufficientcapacity": "InsufficientCapacity", "behindhigherpriority": "BehindHigherPriority",
                "backoff": "Backoff"}


def _wait_detail(g: GPR, found: str | None, current: Mapping[str, Any]) -> str:
    """The detail of a queued GPR's reason for its message: what this pass found when it set the reason (the
    quota's use, the caps), else what the stored message says for the same reason (the core says it once, when
    the reason starts), else nothing."""
    if g.phase is not Phase.QUEUED or g.reason not in _WAIT_DETAIL.values():
        return ""
    if found:
        # a backoff says until when: its retry time, fixed when the failure requeued it
        return f"until {gr.rfc3339(math.ceil(g.not_before))} {found}" if g.reason == "Backoff" else found
    said, mark = current.get("message"), f"; {g.reason}: "
    if current.get("reason") == g.reason and isinstance(said, str) and mark in said:
        return said.split(mark, 1)[1]
    return ""


def _node_lost(sched: Scheduler, g: GPR, now: float, ran: bool = True) -> list[Event]:
    """An allocated GPR whose recorded reservation no longer fits: a reserved node left or shrank, or another
    stored reservation claims the same devices (a status write that landed after its writer gave up on it, while
    the next pass gave the nodes to another GPR). With a pod of it bound, that is a failure (requeued with backoff
    while retries are left, as the core does for a failed device); with none, nothing of it ran and nothing
    failed: it is requeued as it is."""
    g.history = []
    if g.phase is Phase.EVICTING:  # it was leaving anyway: back to the queue
        g.failures += 1
        g.phase, g.reason = Phase.QUEUED, "Requeued after eviction"
        sched.submit(g, now)
        g.reason = "Requeued after eviction"
        return [Event(now, "requeued", g.name, "node lost while evicting")]
    if not ran:
        g.phase = Phase.QUEUED
        sched.submit(g, now)
        g.reason = "Requeued: its reservation no longer fits (NodeLost) and no pod of it had started"
        return [Event(now, "requeued", g.name, "reservation lost before any pod started")]
    g.failures += 1
    if g.requeue_on_failure and g.failures <= g.retry_limit:
        delay = backoff_delay(g.failures, g.backoff_base_s, g.backoff_cap_s)
        sched.submit(g, now, now + delay)
        g.reason = "Backoff"
        return [Event(now, "failed", g.name, "NodeLost"), Event(now, "requeued", g.name, f"backoff {delay:g}s"),
                Event(now, "backoff", g.name, f"after failure {g.failures} (NodeLost)")]
    g.phase, g.reason, g.finished_at = Phase.FAILED, "NodeLost", now
    g.admitted_at = g.admitted_at or now
    sched.gprs[g.name] = g
    return [Event(now, "failed", g.name, "NodeLost")]


MOVED_LIMIT = 256  # pods changed since the last pass up to which only their nodes are counted again


def _list_changes(old: list[PodView], new: list[PodView], limit: int
                  ) -> tuple[list[tuple[PodView, PodView]], list[PodView], list[PodView]] | None:
    """How ``new`` came from ``old`` when pods were replaced in place (same UID), deleted, and appended at the
    end, as the informer changes its table: (replaced (old, new) pairs, deleted, appended); None for anything
    else or more than ``limit`` changes. The unchanged stretches are skipped in C (identity)."""
    pairs: list[tuple[PodView, PodView]] = []
    deleted: list[PodView] = []
    i = j = 0
    size = len(old)
    while i < size and j < len(new):
        # the next place where the lists differ, from (i, j) on, found in C (list iterators set to a position in
        # O(1): no stretch is walked twice)
        new_it, old_it = iter(new), iter(old)
        new_it.__setstate__(j)  # type: ignore[attr-defined]
        old_it.__setstate__(i)  # type: ignore[attr-defined]
        k = next(itertools.compress(itertools.count(), map(operator.is_not, new_it, old_it)), None)
        if k is None:
            step = min(size - i, len(new) - j)
            i, j = i + step, j + step
            break
        i, j = i + k, j + k
        if i >= size or j >= len(new):
            break
        a, b = old[i], new[j]
        if a.uid == b.uid:
            pairs.append((a, b))
            i, j = i + 1, j + 1
        else:  # a deleted: b is what follows it
            deleted.append(a)
            i += 1
        if len(pairs) + len(deleted) > limit:
            return None
    deleted += old[i:]
    added = new[j:]
    if len(pairs) + len(deleted) + len(added) > limit:
        return None
    # what was appended must be new: a pod deleted with its UID reused (or a table rebuilt) starts afresh
    if added and deleted and {p.uid for p in added} & {p.uid for p in deleted}:
        return None
    return pairs, deleted, added


def _pods_moved(old: list[PodView], new: list[PodView]) -> frozenset[str] | None:
    """The nodes the pods that changed between two snapshots' pod lists were or are on ("" left out); None when
    more than :data:`MOVED_LIMIT` changed, or the lists are not one made from the other by the informer's
    changes (see :func:`_list_changes`)."""
    diff = _list_changes(old, new, MOVED_LIMIT)
    if diff is None:
        return None
    return _moved_nodes(*diff)


def _moved_nodes(pairs: list[tuple[PodView, PodView]], deleted: list[PodView], added: list[PodView]) -> frozenset[str]:
    """The nodes the changed pods of :func:`_list_changes` were or are on ("" left out)."""
    return frozenset([n for a, b in pairs for n in (a.node, b.node) if n] + [p.node for p in deleted if p.node]
                     + [p.node for p in added if p.node])


def _same_ledgers(old: list[NodeView], new: list[NodeView]) -> bool:
    """Whether two lists of nodes agree, node by node, in all that :func:`_used_outside_reservations` reads of
    them: the name, the ledger and whether it could be read."""
    return len(old) == len(new) and all(
        a is b or (a.name == b.name and a.ledger_error == b.ledger_error and a.ledger == b.ledger)
        for a, b in zip(old, new, strict=True))


def _used_outside_reservations(sched: Scheduler, snap: Snapshot,
                               only: tuple[frozenset[str], set[str]] | None = None) -> dict[str, int]:
    """Devices in use on each node that no allocated GPR's reservation covers: capacity nobody gets (node ->
    devices). With ``only`` = (nodes, the GPRs whose reservations name them), on those nodes alone: each node's
    count depends on its own pods, ledger and reservations alone. Runs over every pod and node: names are bound
    locally and PodView.live is inlined."""
    inv = sched.inv
    index, specs, names = inv.index, inv.specs, inv.names
    covered: dict[tuple[str, str], int] = {}  # (gpr key, node) -> devices its reservation holds there
    holders, evicting = sched.holders, sched.evicting
    holding = ([*holders.items(), *evicting.items()] if only is None else
               [(name, g) for name in only[1] if (g := holders.get(name) or evicting.get(name)) is not None])
    for name, g in holding:
        for a in g.placement.assignments if g.placement else ():
            covered[name, names[a.node]] = len(a.devices)
    used: dict[str, int] = {}
    seen: set[str] = set()
    pods = snap.pods
    nodes: Container[str] = index if only is None else only[0]
    for p in pods.values():
        node = p.node
        if node not in nodes or p.phase in TERMINAL_POD_PHASES or node not in index:
            continue
        seen.add(p.uid)
        count = p.requests.get(specs[index[node]].resource, 0)
        if p.gpr:
            left = covered.get((p.gpr, node), 0)
            if left:
                take = min(left, count)
                covered[p.gpr, node] = left - take
                count -= take
        if count > 0:
            used[node] = used.get(node, 0) + count
    views = snap.nodes
    for name, node_view in (views.items() if only is None else ((n, views[n]) for n in only[0] if n in views)):
        n = index.get(name)
        if n is None:
            continue
        if node_view.ledger_error:
            used[name] = int(inv.ndev[n])  # unknown use: give this node to nobody
            continue
        resource = specs[n].resource
        for uid, entry in node_view.ledger.items():  # bound a moment ago, not in this replica's informer yet
            if uid not in seen and uid not in pods:
                left = covered.get((entry.gpr, name), 0)
                count = entry.requests.get(resource, 0)
                if left and entry.gpr:
                    take = min(left, count)
                    covered[entry.gpr, name] = left - take
                    count -= take
                used[name] = used.get(name, 0) + max(0, count)
    return used


def host_used_of(pods: Mapping[str, PodView]) -> dict[str, tuple[int, int]]:
    """What :attr:`.cluster.ClusterView.host_used` holds, from ``pods`` alone (those that ask for managed
    resources): for a snapshot made without it."""
    used: dict[str, tuple[int, int]] = {}
    for p in pods.values():
        if p.node and p.live and (p.host[0] or p.host[1]):
            cpu, mem = used.get(p.node, (0, 0))
            used[p.node] = (cpu + p.host[0], mem + p.host[1])
    return used


def host_need(pods: Sequence[PodView], g: GPR) -> tuple[int, int]:
    """The host CPU (millicores) and memory (MiB) GPR ``g``'s pods need on each of its nodes: the largest requests
    of as many pods as one node takes when they are spread evenly over its ``nodeCount`` nodes, and no more than
    its ``devicesPerNode`` hold at once (8 one-GPU pods of an 8-GPU node when a Job has 16). Pods that ended or
    are being deleted need nothing."""
    live = [p for p in pods if p.live and not p.terminating]
    if not live:
        return 0, 0
    each = -(-len(live) // max(1, g.node_count))
    if each == 1:  # a pod a node (one pod, or a pod per node of a gang): the largest
        return max(p.host[0] for p in live), max(p.host[1] for p in live)
    smallest = min(p.requests.get(g.resource, 0) for p in live)
    if smallest > 0:
        each = min(each, max(1, g.devices_per_node // smallest))
    cpu = sorted((p.host[0] for p in live), reverse=True)[:each]
    mem = sorted((p.host[1] for p in live), reverse=True)[:each]
    return sum(cpu), sum(mem)


class GatedNeeds:
    """What each GPR's pods at the gate need of a node's CPU and memory (:func:`host_need`), worked out when the core
    asks: it asks for the GPRs it tries to place (the head of a queue of 10,000, not all of them)."""

    def __init__(self, gated: Mapping[str, list[PodView]]) -> None:
        self.gated = gated
        self.asked: dict[str, tuple[int, int]] = {}  # GPR -> a need beyond nothing, for each one asked about

    def need(self, g: GPR) -> tuple[int, int] | None:
        hit = self.asked.get(g.name)
        if hit is not None:
            return hit
        pods = self.gated.get(g.name)
        if not pods:
            return None
        need = host_need(pods, g)
        if not need[0] and not need[1]:
            return None
        self.asked[g.name] = need
        return need


class HostShares(NamedTuple):
    """Each allocated GPR's share of the CPU and memory of the nodes it holds (see :func:`_withhold_host`): a
    function of the pods, the allocated GPRs' objects and the base inventory alone, kept while they are the same."""

    owned: dict[str, tuple[Placement, tuple[tuple[int, int, int], ...]]]  # as Inventory.host_owned keeps it
    nodes: np.ndarray  # every share's node, CPU and memory, flat
    cpu: np.ndarray
    mem: np.ndarray
    bound_cpu: np.ndarray  # by node: what those GPRs' pods bound there request (counted in the node's sums)
    bound_mem: np.ndarray
    pending: list[tuple[str, int]]  # (GPR, node) where its pods not yet bound will ask for more


def _host_shares(sched: Scheduler, pods: PodsByGPR, size: int) -> HostShares:
    names = sched.inv.names
    holders, evicting, allocations = sched.holders, sched.evicting, sched.inv.allocations
    waiting = {k for k in pods.gated if k in holders or k in evicting}
    waiting.update(p.gpr for p in pods.loose if p.gpr in holders or p.gpr in evicting)
    hosted = pods.hosted
    owned: dict[str, tuple[Placement, tuple[tuple[int, int, int], ...]]] = {}
    flat: list[tuple[int, int, int]] = []
    pending: list[tuple[str, int]] = []
    bound: dict[int, tuple[int, int]] = {}  # node -> what the allocated GPRs' pods bound there request
    for key in hosted.keys() | waiting if waiting else hosted:  # (any order: Inventory.own_host sorts)
        placement = allocations.get(key)
        if placement is None:
            continue
        on = hosted.get(key)  # node -> what its bound pods request there
        if key not in waiting:  # all its pods bound: its share is what they request on its nodes
            assert on is not None
            shares = []
            for a in placement.assignments:
                there = on.get(names[a.node])
                if there is not None:
                    shares.append((a.node, there[0], there[1]))
                    have = bound.get(a.node)
                    bound[a.node] = there if have is None else (have[0] + there[0], have[1] + there[1])
            if shares:
                owned[key] = (placement, tuple(shares))
                flat += shares
            continue
        g = holders.get(key) or evicting.get(key)
        if g is None or g.placement is not placement:
            continue
        need_cpu, need_mem = host_need(pods.of.get(key) or _NO_PODS, g)
        shares = []
        for a in placement.assignments:
            there = on.get(names[a.node], (0, 0)) if on else (0, 0)
            left_cpu, left_mem = max(0, need_cpu - there[0]), max(0, need_mem - there[1])
            if left_cpu or left_mem:
                pending.append((key, a.node))
            if there[0] or there[1] or left_cpu or left_mem:
                shares.append((a.node, there[0] + left_cpu, there[1] + left_mem))
                have = bound.get(a.node, (0, 0))
                bound[a.node] = (have[0] + there[0], have[1] + there[1])
        if shares:
            owned[key] = (placement, tuple(shares))
            flat += shares
    bound_cpu, bound_mem = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
    if bound:
        at = np.fromiter(bound.keys(), dtype=np.int64, count=len(bound))
        bound_cpu[at] = np.fromiter((c for c, _ in bound.values()), dtype=np.int64, count=len(bound))
        bound_mem[at] = np.fromiter((m for _, m in bound.values()), dtype=np.int64, count=len(bound))
    return HostShares(owned, np.fromiter((n for n, _, _ in flat), dtype=np.int64, count=len(flat)),
                      np.fromiter((c for _, c, _ in flat), dtype=np.int64, count=len(flat)),
                      np.fromiter((m for _, _, m in flat), dtype=np.int64, count=len(flat)),
                      bound_cpu, bound_mem, pending)


def _withhold_host(sched: Scheduler, snap: Snapshot, pods: PodsByGPR, pods_of: dict[str, list[PodView]],
                   cache: PassCache, key: tuple[Any, ...]) -> list[tuple[str, str]]:
    """Take out of the inventory's host CPU and memory what kube-scheduler will count on each node: the requests of
    every live pod bound there (accelstack's or not), and, on each node an allocated GPR holds, what its pods not
    yet bound will ask of it (:func:`host_need`, less what its pods bound there already take). What an allocated
    GPR's pods take on its nodes, bound or to come, goes with its allocation (:meth:`.Inventory.own_host`): an
    eviction plan that frees the GPR frees that CPU too.

    Returns (GPR, node) for Admitted GPRs none of whose pods is bound, reserved on a node their pods' requests do
    not fit (taken by other pods since, or the GPR was admitted before its pods existed): they go elsewhere.
    What the bound pods request, by node index, is kept while the requests by node and the nodes are the same;
    the GPRs' shares while ``key`` (the pods, the base inventory, the allocated GPRs' objects) is."""
    inv = sched.inv
    index, names = inv.index, inv.names
    host = snap.host if snap.host is not None else host_used_of(snap.pods)
    kept = cache.host
    if kept is not None and kept[1] is names and kept[0] == host:
        cpu, mem = kept[2], kept[3]
    else:
        cpu, mem = np.zeros(len(names), dtype=np.int64), np.zeros(len(names), dtype=np.int64)
        for node, (c, m) in host.items():
            n = index.get(node)
            if n is not None:
                cpu[n], mem[n] = c, m
        cache.host = (host, names, cpu, mem)
    last = cache.shares
    # the pods and the base by identity, the allocated GPRs' objects one by one (a new tuple each pass)
    if last is not None and last[0][0] is key[0] and last[0][1] is key[1] and last[0][2] == key[2]:
        shares = last[1]
    else:
        shares = _host_shares(sched, pods, len(names))
        cache.shares = (key, shares)
    # what no allocation takes: the bound pods outside allocated GPRs (or on nodes their GPR does not hold)
    free_cpu, free_mem = np.maximum(cpu - shares.bound_cpu, 0), np.maximum(mem - shares.bound_mem, 0)
    short: list[tuple[str, str]] = []
    if shares.pending:
        own_cpu, own_mem = np.zeros(len(names), dtype=np.int64), np.zeros(len(names), dtype=np.int64)
        np.add.at(own_cpu, shares.nodes, shares.cpu)
        np.add.at(own_mem, shares.nodes, shares.mem)
        gated = pods.gated
        for gpr, n in shares.pending:  # its own share counted: room = capacity - everything else
            g = sched.holders.get(gpr)
            if g is None or g.phase is not Phase.ADMITTED or gpr not in gated:
                continue
            if (free_cpu[n] + own_cpu[n] > inv.cpu_cap[n] or free_mem[n] + own_mem[n] > inv.mem_cap[n]) \
                    and not any(p.node and p.live for p in pods_of.get(gpr, ())):
                short.append((gpr, names[n]))
    short.sort()
    taken = np.flatnonzero(free_cpu | free_mem)
    inv.withhold_host(taken, free_cpu[taken], free_mem[taken])
    if shares.owned:
        inv.take_host(shares.owned, shares.nodes, shares.cpu, shares.mem)
    return short


def _pod_facts(sched: Scheduler, pods_of: dict[str, list[PodView]],
               tally: Callable[[str, GPR, Sequence[PodView]], PodTally], now: float) -> list[Event]:
    events: list[Event] = []
    admitted, running_phase = Phase.ADMITTED, Phase.RUNNING
    for key, g in list(sched.holders.items()):
        group = pods_of.get(key)
        if not group:
            continue
        counted, running, ended, failed = tally(key, g, group)[:4]
        if not counted:
            continue
        if ended == counted:  # every pod ended
            events += sched.finish(key, now, ok=not failed, reason="PodFailed" if failed else "Succeeded")
            continue
        if g.phase is admitted and running == counted:
            events += sched.start(key, now)
        elif g.phase is running_phase and running:
            sched.activity(key, now)
    for key in list(sched.evicting):
        if not any(p.live and p.node for p in pods_of.get(key, ())):
            events += sched.evicted(key, now)
    return events


def _fit_pods(sched: Scheduler, fit: NodeFit, gated: dict[str, list[PodView]],
              pods_of: dict[str, list[PodView]], now: float, kept: dict[str, frozenset[str]] | None,
              redo: AbstractSet[str] = frozenset()) -> tuple[list[Event], dict[str, frozenset[str]]]:
    """Keep each queued GPR to the nodes its gated pods can run on (their tolerations, node selector and node
    affinity: see :class:`NodeFit`). An Admitted GPR reserved on a node they cannot run on, while enough other
    nodes would take them and no pod of it has been bound, gives the reservation back and is placed again in this
    pass (its pods were created after its admission, and the webhook held them at the gate because none of the
    reserved nodes would take them, say, or a node's labels or taints changed before they were let go).

    ``kept``: the queued GPRs' limits of the last pass, when nothing they depend on changed since (the GPR
    objects, the pods, the nodes' taints and labels, the inventory) but the pods of the GPRs in ``redo``, which
    are judged again. Returns the events and this pass's limits."""
    events: list[Event] = []
    names = sched.inv.names
    if kept is not None:
        fit.keep_groups()
        limits = kept
        if redo:
            limits = {key: nodes for key, nodes in kept.items() if key not in redo}
            for key in redo:
                pods, g = gated.get(key), sched.gprs.get(key)
                if pods and g is not None and g.phase is Phase.QUEUED:
                    nodes = fit.of_gpr(key, pods, g.node_count)
                    if nodes is not None:
                        limits[key] = nodes
        sched.limits.update(limits)
    else:
        limits = {}
        for key, pods in gated.items():
            g = sched.gprs.get(key)
            if g is not None and g.phase is Phase.QUEUED:
                nodes = fit.of_gpr(key, pods, g.node_count)
                if nodes is not None:
                    limits[key] = nodes
        sched.limits.update(limits)
    holders = sched.holders
    for key in sorted(k for k in gated if k in holders):  # by name: the tables' order says nothing
        g, pods = holders[key], gated[key]
        if g.phase is Phase.ADMITTED and g.placement is not None:
            allowed = fit.of_gpr(key, pods, g.node_count)
            if allowed is None or len(allowed) < g.node_count:
                continue
            off = [names[a.node] for a in g.placement.assignments if names[a.node] not in allowed]
            if not off or any(p.node and p.live for p in pods_of.get(key, ())):
                continue
            events += sched.give_back(key, now, f"Requeued: its pods cannot run on reserved node {off[0]}")
            sched.limit(key, allowed)
    return events, limits


def _cannot_run(pods: Sequence[PodView], nodes: Sequence[NodeView | None]) -> str:
    """Why the first unbound, live pod that kube-scheduler's own filters (taints, nodeSelector, node affinity)
    keep off every one of ``nodes`` cannot go there; "" when each can go to one of them."""
    known = [n for n in nodes if n is not None]
    for p in pods:
        if p.node or not p.live or p.terminating or not known:
            continue
        if any(not why_not(p, n) for n in known):  # stops at the first node it can go to (one, once narrowed)
            continue
        listed = "; ".join(f"{n.name}: {why_not(p, n)}" for n in known[:3])
        return f"pod {p.name} cannot run on the reserved nodes ({listed}{'; ...' if len(known) > 3 else ''})"
    return ""


def _evictions(sched: Scheduler, placed: dict[str, list[PodView]], final: dict[str, str],
               deleting: set[str], uid_of: dict[str, str]) -> list[Eviction]:
    """Bound, live pods that hold devices outside their GPR's reservation: pods of Evicting, finished, requeued
    or deleted GPRs. Pods without a GPR and pods never bound are left alone (they hold nothing of ours).
    ``placed``: the GPRs' pods that are bound or past the gate (a gated pod never goes)."""
    out: list[Eviction] = []
    gate, holding = gr.SCHEDULING_GATE, (Phase.ADMITTED, Phase.RUNNING)
    for key, pods in placed.items():
        g = sched.gprs.get(key)
        if g is not None and g.phase in holding:
            continue
        # bound pods hold devices; an ungated, unbound pod narrowed to an old reservation could never be placed
        # again (a node affinity cannot be widened): it goes too, and its owner makes a new one, gated. (Most
        # pods here are a queued GPR's, at the gate: looked at first, before a reason is written for them.)
        going = [p for p in pods if (p.node or gate not in p.gates) and p.live and not p.terminating
                 and (p.node or narrowed(p))]
        if not going:
            continue
        if g is not None:
            why = f"GPR {key} is {g.phase.value}" + (f" ({g.reason})" if g.reason else "")
        elif key in final:
            why = f"GPR {key} is {final[key]}"
        elif key in deleting:
            why = f"GPR {key} was deleted"
        else:
            continue  # no such GPR (yet): its pods wait at the gate; never delete a user's pods on a guess
        out.extend(Eviction(p, why, uid_of.get(key, "")) for p in going)
    return out


def _stale_narrowings(sched: Scheduler, loose: list[PodView], snap: Snapshot,
                      uid_of: dict[str, str]) -> list[Eviction]:
    """Ungated, unbound pods (``loose``) of a holding GPR narrowed to nodes it no longer holds (requeued and
    placed elsewhere in one pass, before they were evicted as pods of a queued GPR): a node affinity cannot be
    widened, so they go, and their owner makes new ones, gated."""
    out: list[Eviction] = []
    names = sched.inv.names
    for p in loose:
        g = sched.holders.get(p.gpr)
        if g is None or g.placement is None or not p.live or p.terminating or not narrowed(p):
            continue
        nodes = [n for a in g.placement.assignments if (n := snap.nodes.get(names[a.node])) is not None]
        if nodes and all(selector_mismatch(None, p.affinity, n.name, n.labels) for n in nodes):
            out.append(Eviction(p, f"narrowed to nodes GPR {p.gpr} no longer holds", uid_of.get(p.gpr, "")))
    return out


def _orphans(decoded: list[Decoded], pods_of: dict[str, list[PodView]], now: float,
             grace: float) -> list[tuple[str, str, str]]:
    """GPRs the webhook created for a pod that was then never created (the API server gave up on the request
    after the webhook answered), or whose pods are all gone: nothing will ever use them."""
    out = []
    for d in decoded:
        if not d.auto or d.deleting:
            continue
        meta = d.source.get("metadata") or {}
        created = gr.parse_time(meta.get("creationTimestamp"))
        if created is None or now - created < grace or pods_of.get(d.key):
            continue
        out.append((str(meta.get("namespace") or ""), str(meta.get("name") or ""), d.uid))
    return out


_EXTRA_CONDITIONS = ("Idle", "EvictionBlocked")


def _differs(current: Mapping[str, Any], new: Mapping[str, Any], queue_too: bool, now: float = 0.0) -> bool:
    if any(current.get(k) != new.get(k) for k in COMPARED):
        return True
    if queue_too and _queue_moved(spot_of(current), spot_of(new), now):
        return True

    def kinds(status: Mapping[str, Any]) -> set[tuple[str, str]]:
        return {(str(c.get("type")), str(c.get("status"))) for c in status.get("conditions") or []
                if isinstance(c, dict)}

    return kinds(current) != kinds(new)


Spot = tuple[Any, float | None, float | None, float | None]  # queuePosition, estimatedStart, its range


def spot_of(status: Mapping[str, Any]) -> Spot:
    """A status's place in the queue, its times as epoch seconds."""
    raw = status.get("estimatedStartRange")
    span: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    return (status.get("queuePosition"), gr.parse_time(status.get("estimatedStart")),
            gr.parse_time(span.get("earliest")), gr.parse_time(span.get("latest")))


def _queue_moved(old: Spot, new: Spot, now: float) -> bool:
    """Whether a queued GPR's position or estimate moved enough to be worth a write: a position by at least a
    tenth (any change in the first ten), an estimated start by at least a tenth of the wait (and a minute).
    A time that was due (at or before ``now``) and is still due has not moved: "any moment now" rewritten as the
    new now every minute told the user nothing, and cost a write a minute for every GPR whose predicted start
    had come (200 a minute at 10,000 queued). Rewriting every position behind each admission would cost the API
    server a write per queued GPR per refresh; this keeps the numbers a user reads honest at a fraction of it."""
    if _position_moved(old[0], new[0]):
        return True
    for old_at, new_at in zip(old[1:], new[1:], strict=True):
        if (old_at is None) != (new_at is None):
            return True
        if old_at is not None and new_at is not None and _time_moved(old_at, new_at, now):
            return True
    return False


def _position_moved(old_pos: Any, new_pos: int | None) -> bool:
    """The position rule of :func:`_queue_moved` (a stored position that is not a number never moves)."""
    if (old_pos is None) != (new_pos is None):
        return True
    return isinstance(old_pos, int) and isinstance(new_pos, int) and abs(new_pos - old_pos) >= max(1, old_pos // 10)


def _time_moved(old_at: float, new_at: float, now: float) -> bool:
    """The rule of :func:`_queue_moved` for one time, both known."""
    return not (old_at <= now and new_at <= now) and abs(new_at - old_at) >= max(60.0, max(new_at - now, 0) / 10)


def _spot_moved(old: Spot, position: int | None, estimate: Interval | None, now: float) -> bool:
    """``_queue_moved(old, new, now)`` where ``new`` is :func:`spot_of` the fields ``gpr_resource.queue_fields``
    would write for ``position`` and ``estimate``, without writing them or building ``new``, and stopping at the
    first field that moved."""
    if _position_moved(old[0], position):
        return True
    at, low_at, high_at = old[1], old[2], old[3]
    if estimate is None or not math.isfinite(start := estimate.start):
        return at is not None or low_at is not None or high_at is not None
    if at is None or _time_moved(at, math.floor(start), now):
        return True
    low, high = estimate.low, estimate.high
    if not (math.isfinite(low) and math.isfinite(high)):
        return low_at is not None or high_at is not None
    return (low_at is None or high_at is None or _time_moved(low_at, math.floor(min(low, start)), now)
            or _time_moved(high_at, math.floor(max(high, start)), now))


POSITION_CLIP = 2 ** 52  # stored positions beyond it move as it does (either way: by more than a tenth), exactly


def _spot_numbers(spot: Spot) -> tuple[float, float, float, float, float]:
    """A stored spot as numbers for :func:`_spots_moved`: the position's kind (0 none, 1 an integer, 2 anything
    else), the position (clipped), and each time (NaN: none)."""
    pos = spot[0]
    kind, value = (0.0, 0.0) if pos is None else (
        (1.0, float(max(-POSITION_CLIP, min(POSITION_CLIP, pos)))) if isinstance(pos, int) else (2.0, 0.0))
    return (kind, value, *(math.nan if t is None else float(t) for t in spot[1:]))  # type: ignore[return-value]


def _spots_moved(spots: list[tuple[float, float, float, float, float]], estimates: list[Interval | None],
                 now: float) -> np.ndarray:
    """``[_spot_moved(old, i + 1, estimate, now) for i, ...]`` over a whole queue (``spots``: each queued GPR's
    :func:`_spot_numbers`, in queue order), in a few array operations instead of 10,000 calls."""
    n = len(spots)
    if not n:
        return np.zeros(0, dtype=bool)
    old = np.array(spots, dtype=np.float64).reshape(n, 5)
    nan = math.nan
    est = np.array([(e.start, e.low, e.high) if e is not None else (nan, nan, nan) for e in estimates],
                   dtype=np.float64).reshape(n, 3)
    kind, pos = old[:, 0], old[:, 1]
    new_pos = np.arange(1, n + 1, dtype=np.float64)
    moved = (kind == 0) | ((kind == 1) & (np.abs(new_pos - pos) >= np.maximum(1.0, np.floor_divide(pos, 10.0))))
    at, low_at, high_at = old[:, 2], old[:, 3], old[:, 4]
    no_at, no_low, no_high = np.isnan(at), np.isnan(low_at), np.isnan(high_at)
    start, low, high = est[:, 0], est[:, 1], est[:, 2]
    finite = np.isfinite(start)
    ranged = finite & np.isfinite(low) & np.isfinite(high)
    with np.errstate(invalid="ignore"):
        def shifted(old_at: np.ndarray, new_at: np.ndarray) -> np.ndarray:  # _time_moved, element-wise
            return ~((old_at <= now) & (new_at <= now)) & (
                np.abs(new_at - old_at) >= np.maximum(60.0, np.maximum(new_at - now, 0.0) / 10))

        floor_start = np.floor(start)
        moved |= ~finite & ~(no_at & no_low & no_high)
        moved |= finite & (no_at | shifted(at, floor_start))
        moved |= finite & ~ranged & ~(no_low & no_high)
        moved |= ranged & (no_low | no_high | shifted(low_at, np.floor(np.minimum(low, start)))
                           | shifted(high_at, np.floor(np.maximum(high, start))))
    return moved


def _by_name(node: str) -> dict[str, Any]:
    # a node field selector takes exactly one value (the API server refuses `In` with two or more)
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}




def narrow_affinity(affinity: dict[str, Any] | None, nodes: list[str], hostnames: Mapping[str, str] | None = None,
                    base: str = "/spec/affinity") -> list[dict[str, Any]]:
    """JSON-patch ops that narrow a pod's required node affinity to ``nodes``, in the forms the API server
    accepts on a new pod or, for a gated one, as a narrowing (KEP-3838: a required node affinity that has terms
    keeps them, each keeping its requirements, new ones appended):

    - no required term yet: one term per node, ``matchFields metadata.name In [node]`` (a field selector takes one
      value; terms are ORed), however many nodes: kube-scheduler's NodeAffinity PreFilter then hands the
      scheduler those nodes only (a union over the terms), where a label expression would make it filter every
      node of the cluster for every pod (~25 ms a pod at 5,000 nodes, measured in the real scheduler; the terms
      cost about 80 bytes a node in the pod object).
    - terms already (the user's): appended to each, ``metadata.name In [node]`` for one node, else
      ``kubernetes.io/hostname In [...]``; when a node's label is not known, nothing (the filter keeps the pod on
      its reservation all the same).

    Nothing when it is narrowed already."""
    names = sorted(set(nodes))
    labels = sorted({(hostnames or {}).get(n, "") for n in names})
    by_label = {"key": HOSTNAME_LABEL, "operator": "In", "values": labels}
    fresh: dict[str, Any] = {"nodeSelectorTerms": [{"matchFields": [_by_name(n)]} for n in names]}
    if affinity is None:
        return [{"op": "add", "path": base, "value": {"nodeAffinity": {REQUIRED_AFFINITY: fresh}}}]
    node_affinity = affinity.get("nodeAffinity")
    if node_affinity is None:
        return [{"op": "add", "path": f"{base}/nodeAffinity", "value": {REQUIRED_AFFINITY: fresh}}]
    terms = (node_affinity.get(REQUIRED_AFFINITY) or {}).get("nodeSelectorTerms") or []
    if not terms:
        return [{"op": "add", "path": f"{base}/nodeAffinity/{REQUIRED_AFFINITY}", "value": fresh}]
    if all(_within(term, "matchFields", NODE_NAME_FIELD, set(names)) for term in terms):
        return []  # narrowed already (a webhook called again, a gate lifted by the last leader's patch)
    if len(names) == 1:
        key, need = "matchFields", _by_name(names[0])
    else:
        if "" in labels:
            return []
        if all(_within(term, "matchExpressions", HOSTNAME_LABEL, set(labels)) for term in terms):
            return []
        key, need = "matchExpressions", by_label
    narrowed = []
    for term in terms:
        requirements = list(term.get(key) or [])
        if need not in requirements:
            requirements.append(need)
        narrowed.append({**term, key: requirements})
    if narrowed == terms:
        return []
    return [{"op": "replace", "path": f"{base}/nodeAffinity/{REQUIRED_AFFINITY}/nodeSelectorTerms",
             "value": narrowed}]


def _within(term: dict[str, Any], kind: str, key: str, allowed: set[str]) -> bool:
    """Whether a term already keeps a pod within ``allowed`` by ``key`` (an ``In`` requirement naming only
    those)."""
    return any(r.get("key") == key and r.get("operator") == "In" and r.get("values")
               and set(r["values"]) <= allowed for r in term.get(kind) or [])


def ungate_patch(pod: PodView, nodes: list[str], gate: str, hostnames: Mapping[str, str] | None = None
                 ) -> list[dict[str, Any]] | None:
    """A JSON patch that narrows the pod's required node affinity to ``nodes`` and lifts ``gate``, in one
    request (Kubernetes lets a gated pod's node affinity be narrowed, never widened). Tests guard against a
    concurrent change. None when the pod does not carry the gate."""
    if gate not in pod.gates or not nodes:
        return None
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/spec/schedulingGates",
                                  "value": [{"name": g} for g in pod.gates]}]
    if pod.affinity is not None:
        ops.append({"op": "test", "path": "/spec/affinity", "value": pod.affinity})
    ops += narrow_affinity(pod.affinity, nodes, hostnames)
    ops.append({"op": "replace", "path": "/spec/schedulingGates",
                "value": [{"name": g} for g in pod.gates if g != gate]})
    return ops
