"""The extender's decisions for filter, prioritize and preempt: pure functions over the ``ClusterView``.

- filter: a pod of a GPR goes only to its GPR's reserved, healthy nodes with enough of the reservation left;
  nodes preemption cannot help go to ``FailedAndUnresolvableNodes`` (unknown, unhealthy, too small, not
  reserved, reservation used up), nodes that lack free devices held by others go to ``FailedNodes``.
- prioritize: 0-10 — the GPR's reserved nodes score 10; a pod without a GPR gets best-fit packing (the fewer
  devices a node has left after placing the pod, the higher), the placement rule of the policy core.
- preempt: a node stays a candidate only if every managed victim there has lower priority and is preemptible
  (its GPR's ``preemptible``); GPR priorities are compared when both sides have GPRs, pod priorities otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import orjson

from scheduler_extender.extender.wire import MetaPod, MetaVictims, Pod
from scheduler_extender.objects.cluster import (
    GPR_LABEL,
    HOLDING,
    ClusterView,
    GPRView,
    NodeView,
    PodView,
    pinned_node,
)
from scheduler_extender.objects.resources import pod_requests

MAX_SCORE = 10


@dataclass
class PodAsk:
    """What a pod in an extender request asks for, resolved against the view."""

    requests: dict[str, int]
    gpr_key: str = ""
    gpr: GPRView | None = None
    problem: str = ""  # set when no node can take the pod (unresolvable everywhere)
    priority: int = 0
    uid: str = ""  # the pod's UID when known: a node whose ledger records devices for it can take it
    pinned: str = ""  # the one node its node affinity allows by name (a pod the webhook pinned): its share is its own


def resolve(view: ClusterView, requests: dict[str, int], gpr_key: str, priority: int,
            require_gpr: bool = False, uid: str = "") -> PodAsk:
    """A pod's requests and GPR (``namespace/name`` or "") resolved against the view; the one place that says
    when a pod's GPR cannot take devices (missing, not admitted, or required and absent)."""
    ask = PodAsk(requests, gpr_key=gpr_key, priority=priority, uid=uid)
    if not requests:
        return ask
    if not gpr_key:
        if require_gpr:
            ask.problem = f"pod has no {GPR_LABEL} label and this extender requires a GPR"
        return ask
    ask.gpr = view.gprs.get(gpr_key)
    if ask.gpr is None:
        ask.problem = f"GPR {gpr_key} not found"
    elif ask.gpr.phase not in HOLDING:
        ask.problem = f"GPR {gpr_key} is {ask.gpr.phase}, not admitted"
    return ask


def ask_of(view: ClusterView, pod: Pod, require_gpr: bool = False) -> PodAsk:
    """The ask of a pod as an extender request carries it."""
    requests = pod_requests(pod.spec, view.resources)
    label = (pod.metadata.labels or {}).get(GPR_LABEL, "")
    ask = resolve(view, requests, f"{pod.metadata.namespace}/{label}" if label else "", pod.spec.priority or 0,
                  require_gpr, pod.metadata.uid or "")
    if label and len(pod.spec.affinity):  # msgspec.Raw holds valid JSON only
        ask.pinned = pinned_node(orjson.loads(memoryview(pod.spec.affinity)))
    return ask


@dataclass
class FilterOutcome:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


def filter_nodes(view: ClusterView, ask: PodAsk, names: list[str]) -> FilterOutcome:
    out = FilterOutcome()
    if not ask.requests:
        out.passed = list(names)
        return out
    if ask.problem:
        out.unresolvable = dict.fromkeys(names, ask.problem)
        return out
    if view.claims:
        view.lapse_claims()
    if ask.gpr is None and len(ask.requests) == 1:
        _filter_plain(view, ask, names, out)
        mine = view.recorded.get(ask.uid) if ask.uid else None
        if mine is not None and (mine in out.failed or mine in out.unresolvable):  # the memo speaks for others
            reason, resolvable = node_verdict(view, ask, mine)
            if not reason:
                out.failed.pop(mine, None)
                out.unresolvable.pop(mine, None)
                out.passed.append(mine)
        if ask.uid and view.claim_ttl > 0:
            _claim_withheld(view, ask, out)
        return out
    for name in names:
        reason, resolvable = node_verdict(view, ask, name)
        if not reason:
            out.passed.append(name)
        elif resolvable:
            out.failed[name] = reason
        else:
            out.unresolvable[name] = reason
    if ask.uid and view.claim_ttl > 0:
        if ask.gpr is not None:
            _claim_one(view, ask, out)
        else:
            _claim_withheld(view, ask, out)
    return out


def _claim_one(view: ClusterView, ask: PodAsk, out: FilterOutcome) -> None:
    """A pod of a GPR is offered one node, and that node's share is claimed for it until its bind records it.

    kube-scheduler binds a pod while it already filters the next: without this, the GPR's next pods are offered
    the same reserved node (the scheduler sees all its devices free) and their binds fail once the GPR's share
    there is used up (a 20-node x 1-device GPR: 30 failed binds). With one node offered, the extender knows
    where each pod goes and offers the next pods the rest. The pick packs: the node with the least share left
    that still fits (a node whose ledger holds the pod already first: a retried bind)."""
    if not out.passed:
        view.unclaim(ask.uid)
        return
    if ask.pinned:  # it can go to that node only, and its share there is counted as its own until it is bound
        return
    assert ask.gpr is not None
    chosen, best = out.passed[0], None
    for name in out.passed:
        node = view.nodes[name]
        if ask.uid in node.ledger:
            chosen = name
            break
        reserved = ask.gpr.reservation.get(name, 0)
        left = min(reserved - node.used_by.get((ask.gpr_key, resource), 0)
                   - view.claimed_share(name, ask.gpr_key, resource, (ask.uid,)) for resource in ask.requests)
        if best is None or left < best:
            chosen, best = name, left
    for name in out.passed:
        if name != chosen:
            out.unresolvable[name] = f"GPR {ask.gpr_key}: this pod is sent to reserved node {chosen}"
    out.passed = [chosen]
    view.claim(ask.uid, chosen, ask.gpr_key, ask.requests)


def _claim_withheld(view: ClusterView, ask: PodAsk, out: FilterOutcome) -> None:
    """A pod without a GPR is offered at most one node where GPRs hold devices they have not used yet, and its
    devices there are claimed for it until it is seen bound (there or anywhere else).

    kube-scheduler counts a node's devices itself, binds a pod while it filters the next, and knows nothing of
    reservations: on a node where GPRs hold unused devices only the extender knows how many are left to others,
    and it learns of a bind only when the pod's event comes (24 such pods in flight at once took 20 and 23 of 12
    devices a test left them). So every such pod that may land on such a node holds a claim there, and is offered
    one of them, the one it fits best (the least left after it). Nodes where no GPR holds unused devices stay
    offered as they are: kube-scheduler's own count is exact there."""
    kept: list[str] = []
    fits: list[tuple[int, str]] = []  # (devices left after the pod, node) where GPRs hold unused devices
    mine = view.recorded.get(ask.uid)  # a node whose ledger holds the pod's devices already (a bind verb's retry)
    for name in out.passed:
        node = view.nodes.get(name)
        if (name not in view.reserved or name == mine or node is None
                or not any(view.withheld(node, r) for r in ask.requests)):
            kept.append(name)
            continue
        lefts, short = [], ""
        for resource, count in ask.requests.items():
            in_flight = view.claimed_share(name, "", resource, (ask.uid,)) if view.claimed else 0
            free = view.free_for(node, resource, "") - in_flight
            if free < count:
                short = f"{free + in_flight} {resource} free, {in_flight} of them to pods being bound, pod asks {count}"
                break
            lefts.append(free - count)
        if short:
            out.failed[name] = short
        else:
            fits.append((min(lefts), name))
    if not fits:
        view.unclaim(ask.uid)
        out.passed = kept
        return
    chosen = min(fits)[1]
    for _, name in fits:
        if name != chosen:
            out.unresolvable[name] = f"this pod is sent to node {chosen}, where GPRs hold devices too"
    out.passed = [*kept, chosen]
    view.claim(ask.uid, chosen, "", ask.requests)


def _filter_plain(view: ClusterView, ask: PodAsk, names: list[str], out: FilterOutcome) -> None:
    """filter_nodes for a pod without a GPR that asks for one resource (most pods, and the scheduler sends
    hundreds of names for each): a node's verdict depends only on the node and the reservations on it, so it is
    kept in the view's memo of the node until either changes (the same verdict :func:`node_verdict` gives)."""
    ((resource, count),) = ask.requests.items()
    key = ("verdict", resource, count)
    if ask.uid:  # the memo holds verdicts for any such pod (filter_nodes adds the pod's own node)
        ask = dataclasses.replace(ask, uid="")
    nodes, memos, passed, failed, unresolvable = view.nodes, view.memos(), out.passed, out.failed, out.unresolvable
    for name in names:
        node = nodes.get(name)
        if node is None:
            unresolvable[name] = "node unknown to the accelstack extender"
            continue
        hit = memos.get(name)  # ClusterView.node_facts inlined: the loop runs for every name of every filter
        verdict = hit[1].get(key) if hit is not None and hit[0] is node else None
        if verdict is None:
            verdict = node_verdict(view, ask, name)
            facts = _memo(view, node, resource, count)
            if facts is not None:
                facts[key] = verdict
        reason, resolvable = verdict
        if not reason:
            passed.append(name)
        elif resolvable:
            failed[name] = reason
        else:
            unresolvable[name] = reason


def node_verdict(view: ClusterView, ask: PodAsk, name: str, node: NodeView | None = None,
                 recorded: Collection[str] = ()) -> tuple[str, bool]:
    """('' , _) when the node can take the pod now; else (reason, whether preemption could help). ``node`` judges
    against that state of the node instead of the view's (the binder's ledger with the batch's earlier pods, whose
    UIDs ``recorded`` names: their claims are in that ledger already)."""
    node = node if node is not None else view.nodes.get(name)
    if node is None:
        return "node unknown to the accelstack extender", False
    if node.ledger_error:
        return node.ledger_error, False
    # a bind whose Binding may yet land left the pod's devices recorded here: they are its own
    mine = ask.uid in node.ledger if ask.uid else False
    for resource, count in ask.requests.items():
        sick = node.health_reason(resource)
        if sick:
            return f"unhealthy: {sick}", False
        capacity = node.allocatable.get(resource, 0)
        if capacity < count:
            return f"node has {capacity} {resource}, pod asks {count}", False
        if ask.gpr is not None:
            reserved = ask.gpr.reservation.get(name)
            if reserved is None:
                return f"not reserved for GPR {ask.gpr_key}", False
            if mine:
                continue
            own_used = node.used_by.get((ask.gpr_key, resource), 0)
            if reserved - own_used < count:
                return f"GPR {ask.gpr_key} reservation here is used up ({own_used} of {reserved} bound)", False
            in_flight = view.claimed_share(name, ask.gpr_key, resource, (ask.uid, *recorded)) if view.claimed else 0
            if view.pinned or view.pins_ahead:  # pods pinned here wait for their share: it is not offered to others
                in_flight += view.pinned_share(name, ask.gpr_key, resource, count if ask.pinned == name else 0)
            if reserved - own_used - in_flight < count:
                return (f"GPR {ask.gpr_key} reservation here is taken by pods being bound ({own_used} bound, "
                        f"{in_flight} in flight, of {reserved})"), False
        if mine:
            continue
        free = view.free_for(node, resource, ask.gpr_key)
        if free < count:
            return f"{free} {resource} free, pod asks {count}", True
    return "", False


def prioritize(view: ClusterView, ask: PodAsk, names: list[str]) -> list[tuple[str, int]]:
    scores = []
    # a pod without a GPR asking for one resource: a node's score is kept in its memo, as filter's verdict is
    plain = ask.gpr is None and len(ask.requests) == 1
    resource, count = next(iter(ask.requests.items())) if plain else ("", 0)
    key = ("score", resource, count)
    nodes, memos = view.nodes, view.memos()
    for name in names:
        node = nodes.get(name)
        if node is None or not ask.requests:
            scores.append((name, 0))
            continue
        if ask.gpr is not None:
            scores.append((name, MAX_SCORE if name in ask.gpr.reservation else 0))
            continue
        score = None
        if plain:  # ClusterView.node_facts inlined, as in filter
            hit = memos.get(name)
            score = hit[1].get(key) if hit is not None and hit[0] is node else None
        if score is None:
            score = _packing_score(view, ask, node)
            facts = _memo(view, node, resource, count) if plain else None
            if facts is not None:
                facts[key] = score
        scores.append((name, score))
    return scores


def _memo(view: ClusterView, node: NodeView, resource: str, count: int) -> dict[Any, Any] | None:
    """Where filter's verdict and prioritize's score for a pod without a GPR asking ``count`` of ``resource``
    are kept on ``node`` (:meth:`ClusterView.node_facts`); None for a count the node can never hold, judged
    afresh each time, so pods with ever new huge counts cannot grow every node's memo."""
    return view.node_facts(node) if count <= node.allocatable.get(resource, 0) else None


def _packing_score(view: ClusterView, ask: PodAsk, node: NodeView) -> int:
    """Best-fit packing for a pod without a GPR: the fewer devices the node has left after placing it, the
    higher (0 when it does not fit)."""
    score = MAX_SCORE
    for resource, count in ask.requests.items():
        capacity = node.allocatable.get(resource, 0)
        left = view.free_for(node, resource, "") - count
        if capacity <= 0 or left < 0:
            return 0
        score = min(score, round(MAX_SCORE * (1 - left / capacity)))
    return max(0, min(MAX_SCORE, score))


def _outranks(view: ClusterView, ask: PodAsk, victim: PodView) -> bool:
    victim_gpr = view.gprs.get(victim.gpr) if victim.gpr else None
    if victim_gpr is not None and not victim_gpr.preemptible:
        return False
    if ask.gpr is not None and victim_gpr is not None:
        return victim_gpr.priority < ask.gpr.priority
    return victim.priority < ask.priority


def preempt(view: ClusterView, ask: PodAsk, victims: dict[str, list[str]],
            pdb_violations: dict[str, int]) -> dict[str, MetaVictims]:
    """Keep the nodes whose every victim (by UID) may be preempted by this pod."""
    out: dict[str, MetaVictims] = {}
    for node, uids in victims.items():
        if ask.problem or (ask.gpr is not None and node not in ask.gpr.reservation):
            continue
        node_view = view.nodes.get(node)
        if node_view is None or any(node_view.health_reason(r) for r in ask.requests):
            continue
        # Victims the view does not track request no managed resource: the scheduler already picked them by
        # lower pod priority, and they hold no GPR work, so they stay.
        pods = [p for p in (view.pods.get(uid) for uid in uids) if p is not None]
        if all(p.node in (node, "") and _outranks(view, ask, p) for p in pods):
            out[node] = MetaVictims(Pods=[MetaPod(UID=uid) for uid in uids],
                                    NumPDBViolations=pdb_violations.get(node, 0))
    return out
