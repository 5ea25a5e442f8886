"""What pods use outside reservations and what that does to GPRs: devices on a node beyond what its reservations
leave (a reservation taken is given back), CPU and memory kube-scheduler will count on each node, pods'
phases into GPR facts (started, finished, idle), gated pods fitted to nodes, and nodes lost under a GPR."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from scheduler_extender.controller.pass_types import Snapshot
from scheduler_extender.controller.pod_tables import NO_PODS, PodsByGPR, PodTally
from scheduler_extender.core.gpr import GPR, Phase, backoff_delay
from scheduler_extender.core.inventory import Placement
from scheduler_extender.core.scheduler import Event, Scheduler
from scheduler_extender.objects.cluster import TERMINAL_POD_PHASES, PodView
from scheduler_extender.objects.podfit import (
    NodeFit,
)

if TYPE_CHECKING:  # the cache calls into this module; this module only reads the cache's fields
    from scheduler_extender.controller.pass_cache import PassCache


def taken_from_reservations(sched: Scheduler, overs: Mapping[str, int], pods_of: Mapping[str, Sequence[PodView]],
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


def node_lost(sched: Scheduler, g: GPR, now: float, ran: bool = True) -> list[Event]:
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


def used_outside_reservations(sched: Scheduler, snap: Snapshot,
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
        node = p.place  # a pod admitted directly takes its pinned node's devices before it is bound
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
    """Each allocated GPR's share of the CPU and memory of the nodes it holds (see :func:`withhold_pods_host`): a
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
        need_cpu, need_mem = host_need(pods.of.get(key) or NO_PODS, g)
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


def withhold_pods_host(sched: Scheduler, snap: Snapshot, pods: PodsByGPR, pods_of: dict[str, list[PodView]],
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


def pod_facts(sched: Scheduler, pods_of: dict[str, list[PodView]],
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


def keep_to_bound_pods(sched: Scheduler, pods_of: Mapping[str, Sequence[PodView]]) -> None:
    """A queued GPR whose live pods are already bound on at least as many nodes as it asks for (a running pod
    adopted by a GPR made after it, as onboarding does; or pods created with ``nodeName``) is placed where they
    run: placed anywhere else, its status would say Running on nodes its pods are not on, and their devices would be
    counted twice (reserved there, used here). A limit of this pass only (the scheduler is built anew each pass)."""
    for key, pods in pods_of.items():
        g = sched.gprs.get(key)
        if g is None or g.phase is not Phase.QUEUED:
            continue
        bound = frozenset(p.node for p in pods if p.node and p.live)
        if bound and len(bound) >= g.node_count:
            have = sched.limits.get(key)
            sched.limit(key, bound if have is None else (have & bound) or bound)


def fit_pods(sched: Scheduler, fit: NodeFit, gated: dict[str, list[PodView]],
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
