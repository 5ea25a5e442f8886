"""What a pass may keep from the last one, as caches of pure functions (rebuilt identically after a restart): GPR
objects decoded once per (UID, generation), the queue's order and size ranks, the inventory of allocated GPRs
(:class:`Base`) and the holders adopted into it (:class:`Holders`), and the block of waiting GPRs."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_extender.controller.host_use import HostShares
from scheduler_extender.controller.pod_tables import PodsByGPR, PodTallies
from scheduler_extender.controller.predictor_store import job_key as history_key
from scheduler_extender.controller.status_diff import EXTRA_CONDITIONS, Spot, spot_numbers_of, spot_of
from scheduler_extender.core.gpr import GPR, Phase, clone
from scheduler_extender.core.inventory import AllocationError, Inventory, NodeAssignment, NodeSpec, Placement
from scheduler_extender.core.predictor import DurationPredictor
from scheduler_extender.core.scheduler import HolderState, QueuedBlock, Scheduler
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import GPU, MODEL_LABEL, NR1, NodeView, PodView
from scheduler_extender.objects.podfit import (
    NodeFit,
)
from scheduler_extender.objects.workspaces import WorkspaceIndex

MEMORY_LABEL = "nvidia.com/gpu.memory"


AUTO_LABEL = "accelstack.io/auto-gpr"


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
    auto: bool  # made by the webhook for a pod (see orphans_of)
    waiting: bool  # may be queued as its prototype (see decode)
    # (predictor, its epoch, workspace, ageing, Scheduler.size_rank) while queued: the rank kept between passes
    rank: tuple[Any, int, str, float, tuple[int, float, float]] | None = None
    # (UID, key, reservation as sorted (node, devices)): all the cached inventory depends on of an allocated GPR
    placed: tuple[str, str, tuple[tuple[str, int], ...]] = ("", "", ())
    spot_numbers: tuple[float, float, float, float, float] = (0.0, 0.0, math.nan, math.nan, math.nan)  # see spots_moved


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
        # pass (see withhold_pods_host)
        self.host: tuple[Mapping[str, tuple[int, int]], list[str], np.ndarray, np.ndarray] | None = None
        self.shares: tuple[tuple[Any, ...], HostShares] | None = None  # (its key, the GPRs' shares): withhold_pods_host
        self._autos: tuple[list[Decoded], list[Decoded]] | None = None
        self._allocated: tuple[list[Decoded], list[Decoded], tuple[Any, ...]] | None = None
        self._flagged: tuple[list[NodeView], list[tuple[str, bool]]] | None = None
        # (pods, fit generation, base, queued GPR -> the nodes it may use) of the last pass (see fit_pods)
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
        extra = any(isinstance(c, dict) and c.get("type") in EXTRA_CONDITIONS for c in status.get("conditions") or ())
        self.changed.add(uid)
        d = Decoded(version, uid, key, _created(obj), bool(meta.get("deletionTimestamp")), gr.phase_of(obj), status,
                    meta.get("generation"), fields, proto, gr.reservation_of(obj),
                    (status.get("phase"), status.get("reason"), status.get("failures", 0), status.get("evictions", 0))
                    if status and status.get("observedGeneration") == meta.get("generation") and not extra else None,
                    spot_of(status), obj,
                    (meta.get("labels") or {}).get(AUTO_LABEL) == "true",
                    False)
        d.placed = (uid, key, tuple(sorted(d.reservation.items())))
        d.spot_numbers = spot_numbers_of(d.spot)
        # stored as Queued, valid, not being deleted, and its status is what the GPR renders while nothing happens
        # to it: the pass may queue the prototype itself and needs to look at it again only if it was handed out
        d.waiting = (proto is not None and status.get("phase") == Phase.QUEUED and not d.deleting and not proto.history
                     and d.settled == (proto.phase, proto.reason, proto.failures, proto.evictions))
        if hit is not None and hit.rank is not None and proto is not None and hit.proto is not None and (
                ranked_fields(proto) == ranked_fields(hit.proto)):
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
                raise gr.SpecError(gr.live_cluster_limitation())
        except gr.SpecError as exc:
            value = str(exc)
        self.specs[uid] = (generation, value)
        return value

    def prune(self, live: set[str]) -> None:
        for table in (self.specs, self.decoded):
            if len(table) > len(live):
                for uid in [u for u in table if u not in live]:
                    del table[uid]


class Waiting:
    """The queued GPRs a pass queues as shared prototypes, kept between passes as one :class:`QueuedBlock` and
    patched by UID as their objects change (10,000 queued GPRs then cost a pass a few copies, not a restore
    each). Whether a GPR belongs is a function of its object, the time and the pass's configuration alone
    (:func:`_shareable`), so a patched block equals the one a fresh start builds."""

    def __init__(self, predictor: DurationPredictor, key: tuple[Any, ...]) -> None:
        # what the members' ranks and membership were judged under (see waiting_block)
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


def waiting_block(cache: PassCache, decoded: list[Decoded], gprs: Mapping[str, Any], sched: Scheduler,
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
                w.add(d, size_rank_of(d, d.proto, sched))
        elif d.waiting and d.proto is not None and d.proto.not_before > now and (
                w.later_at.get(d.uid) != d.proto.not_before):
            w.later_at[d.uid] = d.proto.not_before
            heapq.heappush(w.later, (d.proto.not_before, d.uid))
    return w


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


def size_rank_of(d: Decoded, g: GPR, sched: Scheduler) -> tuple[int, float, float]:
    """``sched.size_rank(g)`` for the GPR decoded as ``d``, kept in ``d`` while the predictor has learned nothing
    new and the workspace and ageing are the same (the size order's place of 10,000 queued GPRs each pass)."""
    predictor, kept = sched.predictor, d.rank
    if (kept is not None and kept[0] is predictor and kept[1] == predictor.epoch and kept[2] == g.workspace
            and kept[3] == sched.cfg.ageing_s):
        return kept[4]
    rank = sched.size_rank(g)
    d.rank = (predictor, predictor.epoch, g.workspace, sched.cfg.ageing_s, rank)
    return rank


def ranked_fields(g: GPR) -> tuple[Any, ...]:
    """What Scheduler.size_rank reads of a GPR (besides the predictor and the configuration)."""
    return (g.workspace, g.template, g.workload, g.resource, g.devices_per_node, g.milli_per_device, g.node_count,
            g.exit_duration_s, g.priority, g.submitted_at)
