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

The pass is :func:`plan_pass`; its steps live beside it: :mod:`.pass_cache` (decoding and what a pass may keep from
the last), :mod:`.pod_tables` (pods by GPR, their tallies), :mod:`.host_use` (devices and CPU/memory used outside
reservations, pod facts), :mod:`.status_diff` (whether a status is worth a write), :mod:`.pod_actions` (narrowing,
ungating, evictions, orphans); its inputs and outputs are :mod:`.pass_types`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from kubeapi.collector import collector_paused
from scheduler_extender.controller.deboard import deboard_step, draining, requeued_from
from scheduler_extender.controller.host_use import (
    GatedNeeds,
    fit_pods,
    keep_to_bound_pods,
    node_lost,
    pod_facts,
    taken_from_reservations,
    used_outside_reservations,
    withhold_pods_host,
)
from scheduler_extender.controller.pass_cache import (
    Base,
    Decoded,
    Holders,
    PassCache,
    size_rank_of,
    waiting_block,
)
from scheduler_extender.controller.pass_types import ALLOCATED, PassConfig, Plan, Snapshot, StatusWrite
from scheduler_extender.controller.pod_actions import evictions_of, orphans_of, stale_narrowings
from scheduler_extender.controller.pod_tables import (
    NO_PODS,
    PodsByGPR,
    cannot_run,
    last_active,
    pods_moved_between,
    same_ledgers,
)
from scheduler_extender.controller.status_diff import (
    QUEUE_FIELDS,
    WAIT_DETAIL,
    differs,
    honest,
    spot_moved_from,
    spots_moved,
    wait_detail,
)
from scheduler_extender.core.gpr import GPR, Phase, clone
from scheduler_extender.core.inventory import Placement
from scheduler_extender.core.placement import fits, make_policy
from scheduler_extender.core.scheduler import Event, Scheduler
from scheduler_extender.core.waittime import Interval
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import NodeView, PodView


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
    w = waiting_block(cache, decoded, snap.gprs, sched, workspaces, owner, now)
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
            g.last_active_at = last_active(g, tally(key, g, pods_of.get(key, NO_PODS)), now)
            placement = base.adopted.get(key)
            if placement is None:
                ran = any(p.live and p.node for p in pods_of.get(key, ()))
                plan.events += [(uid, e) for e in node_lost(sched, g, now, ran)]
                continue
            (leaving if stamped or g.phase is Phase.EVICTING else keeping).append((g, placement))
            continue
        reason = g.reason if g.phase is Phase.QUEUED and not rejudged else ""
        # stored as Queued: nothing new (an empty history marks a GPR whose status needs no write)
        sched.restore_queued(g, now, g.not_before, size_rank_of(d, g, sched) if size_ranked else None,
                             news=status.get("phase") != Phase.QUEUED)
        g.reason = reason
    # adopted under arrival number 0, whatever came before them: the same in a warm and a cold pass
    if hb is not None:
        assert not keeping, "a holder of the cached base was left to the loop"
        fresh: dict[str, GPR] = {}
        for name, template in hb.templates:
            g = clone(template)
            g.last_active_at = last_active(g, tally(name, g, pods_of.get(name, NO_PODS)), now)
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
    used = outside_use(snap, cache, sched, base, previous, derived, pods, pods_seen, nodes_seen)
    overs: dict[str, int] = {}  # node -> devices its outside pods use beyond what its reservations leave free
    for name, count in used.items():
        over = count - sched.hold(f"pods@{name}", name, count)
        if over > 0:
            overs[name] = over
    if overs:  # all nodes at once: a GPR given back for one node frees devices on its other nodes too
        plan.events += [(uid_of.get(e.gpr, ""), e) for e in taken_from_reservations(sched, overs, pods_of, now)]
    gated_needs = GatedNeeds(pods.gated)
    sched.need_host(gated_needs)
    short = withhold_pods_host(sched, snap, pods, pods_of, cache, (pods, base, versions))
    for name, sick in cache.flagged(nodes_seen, inv):
        if sick:
            plan.events += [(uid_of.get(e.gpr, ""), e) for e in sched.set_health(name, None, False, now)]
        else:  # closed: no new reservation; the ones it has stay
            sched.close(name)
    plan.events += [(uid_of.get(e.gpr, ""), e) for e in deboard_step(sched, nodes_seen, pods_of, now)]
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
        gave_back, limits = fit_pods(sched, fit, gated, pods_of, now, last_fit[3] if reuse and last_fit else None,
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
    keep_to_bound_pods(sched, pods_of)
    fit.forget_except(gated)
    leaving_node = draining(sched)
    plan.events += [(uid_of.get(e.gpr, ""), e) for e in pod_facts(sched, pods_of, tally, now)]
    requeued_from(sched, leaving_node)
    cache.tallies.prune(sched.holders)
    ticked = sched.tick(now)
    plan.events += [(uid_of.get(e.gpr, ""), e) for e in ticked]
    extra = conditions(sched, snap, ticked, pods_of, gated_needs, now)
    # what the pass that set a queued GPR's reason found (which quota, how much of it is used): into its message
    found = {e.gpr: e.detail for _, e in plan.events if e.kind in WAIT_DETAIL}
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
    moved_at = (spots_moved([objects[key].spot_numbers for key in queue], [estimate_of(key) for key in queue], now)
                if refresh else np.zeros(0, dtype=bool))
    moved = moved_at.tolist()

    def spot_moved(key: str, d: Decoded, estimate: Any) -> bool:
        """On a refresh: whether a queued GPR's stored place and estimate moved enough to be written again."""
        place = position_of(key)
        return moved[place - 1] if place is not None else spot_moved_from(d.spot, None, estimate, now)

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
        estimate = honest(g, estimates.get(key) if estimates else None, now)
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
        body = gr.status_body(g, queue_position=positions.get(key), detail=wait_detail(g, found.get(key), current),
                              estimated_start=estimate.start if estimate is not None and finite else None,
                              estimated_range=(estimate.low, estimate.high) if estimate is not None and finite else None,
                              reservation=reservation, now=now,
                              observed_generation=d.generation,
                              conditions=extra.get(key), previous_conditions=current.get("conditions"))["status"]
        if differs(current, body, refresh, now):
            if not refresh:  # keep the stored position and estimate until the next refresh
                for k in QUEUE_FIELDS:
                    if g.phase is Phase.QUEUED and k in current:
                        body[k] = current[k]
                    else:
                        body.pop(k, None)
            plan.writes.append(StatusWrite(uid, key, body, holding, refresh and g.phase is Phase.QUEUED
                                           and not differs(current, body, False, now)))
    plan.evictions = evictions_of(sched, pods.placed, final, deleting, uid_of) + stale_narrowings(sched, loose, snap,
                                                                                            uid_of)
    plan.orphans = orphans_of(decoded, pods_of, now, cfg.orphan_grace)
    plan.queued = len(plan.queue)
    plan.holding = len(sched.holders)
    plan.wakeup = sched.next_wakeup()
    cache.prune(set(snap.gprs))
    plan.seconds = time.perf_counter() - started
    return plan


def outside_use(snap: Snapshot, cache: PassCache, sched: Scheduler, base: Base, previous: Base | None,
                derived: Base | None, pods: PodsByGPR, pods_seen: list[PodView], nodes_seen: list[NodeView]
                ) -> dict[str, int]:
    """Step of :func:`plan_pass`: the devices of each node that pods use outside any reservation (kept in
    ``cache.outside`` for the next pass)."""
    # devices held outside reservations: a function of the pods, the nodes' ledgers and the allocated GPRs alone,
    # so the last pass's answer stands while every pod is the one seen then, every node has the ledger seen then
    # (a status heartbeat, ~17 node updates a second at 5,000 nodes, changes nothing) and the base is the same
    last = cache.outside
    ledgers = last is not None and (last[2] == nodes_seen or same_ledgers(last[2], nodes_seen))
    # the nodes whose pods changed since the last pass (None: too many to count apart, or nothing to compare)
    pods_moved: frozenset[str] | None = None
    if ledgers and last is not None:
        if last[1] == pods_seen:
            pods_moved = frozenset()
        elif pods.origin is not None and pods.origin.seen is last[1]:
            pods_moved = pods.moved  # the tables were made from the last pass's: the same comparison, done once
        else:
            pods_moved = pods_moved_between(last[1], pods_seen)
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
        used.update(used_outside_reservations(sched, snap, (frozenset(touched), naming)))
    else:
        used = used_outside_reservations(sched, snap)
    cache.outside = (base, pods_seen, nodes_seen, used)
    return used


def conditions(sched: Scheduler, snap: Snapshot, ticked: list[Event], pods_of: dict[str, list[PodView]],
               gated_needs: GatedNeeds, now: float) -> dict[str, list[dict[str, Any]]]:
    """Step of :func:`plan_pass`: the conditions a GPR's status gains this pass — ``Idle``, and
    ``PodsCannotRun`` with why its pods cannot go where it is reserved or could be placed."""
    inv = sched.inv
    extra: dict[str, list[dict[str, Any]]] = {}
    for e in ticked:
        if e.kind == "idle":  # not enforced: said once, in a condition, while it stays idle
            extra.setdefault(e.gpr, []).append({"type": "Idle", "status": "True", "reason": "IdleTimeout",
                                                "message": "no pod has run for longer than spec.idleTimeout"})
    admitted = Phase.ADMITTED
    for key, g in sched.holders.items():  # reserved from the GPR's spec: say so when its pods cannot go there
        if g.phase is admitted and g.placement is not None and key in pods_of:  # Running ones: pods went
            why = cannot_run(pods_of[key], [snap.nodes.get(sched.inv.names[a.node]) for a in g.placement.assignments])
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

    return extra
