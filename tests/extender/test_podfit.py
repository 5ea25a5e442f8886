"""kube-scheduler's own filters as the GPR controller reads them (scheduler_extender/objects/podfit.py): taints and
tolerations (v1.Toleration.ToleratesTaint), nodeSelector and required node affinity; and what the controller does
with them: a condition on an Admitted GPR whose pods cannot go to its nodes, and an eviction of a pod narrowed to
nodes its GPR no longer holds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from scheduler_extender.controller.gpr_pass import plan_pass
from scheduler_extender.controller.pass_cache import PassCache
from scheduler_extender.controller.pass_types import PassConfig, Plan, Snapshot
from scheduler_extender.objects.cluster import GPU, node_view, pod_view
from scheduler_extender.objects.gpr_codec import rfc3339
from scheduler_extender.objects.podfit import selector_mismatch, tolerates, untolerated
from tests.extender.harness import gpr, node, pod

TAINT = {"key": "dedicated", "value": "team-a", "effect": "NoSchedule"}


@pytest.mark.parametrize(("toleration", "expected"), [
    ({"key": "dedicated", "operator": "Equal", "value": "team-a", "effect": "NoSchedule"}, True),
    ({"key": "dedicated", "value": "team-a"}, True),  # Equal by default; any effect
    ({"key": "dedicated", "operator": "Exists"}, True),
    ({"operator": "Exists"}, True),  # an empty key with Exists tolerates everything
    ({"key": "dedicated", "value": "team-b"}, False),
    ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}, False),
    ({"key": "other", "operator": "Exists"}, False),
])
def test_a_toleration_matches_a_taint_as_kubernetes_says(toleration: dict[str, Any], expected: bool) -> None:
    assert tolerates(toleration, TAINT) is expected


def test_only_blocking_taints_count() -> None:
    soft = {"key": "busy", "effect": "PreferNoSchedule"}
    assert untolerated([soft], []) == ""
    assert untolerated([soft, TAINT], []) == "dedicated=team-a:NoSchedule"
    assert untolerated([{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}], []) == \
        "node.kubernetes.io/unreachable:NoExecute"


def test_selectors_and_required_affinity() -> None:
    labels = {"zone": "a", "gpus": "8"}
    assert selector_mismatch({"zone": "a"}, None, "n1", labels) == ""
    assert selector_mismatch({"zone": "b"}, None, "n1", labels) == "nodeSelector zone=b"

    def terms(*t: dict[str, Any]) -> dict[str, Any]:
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(t)}}}

    assert selector_mismatch(None, terms({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["4"]}]}),
                             "n1", labels) == ""
    assert selector_mismatch(None, terms({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]},
                                         {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}),
                             "n1", labels) == ""  # terms are ORed
    assert selector_mismatch(None, terms({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}),
                             "n1", labels) == "required node affinity"
    assert selector_mismatch(None, terms({}), "n1", labels) == "required node affinity"  # an empty term: no node


def _pass(pods: list[dict[str, Any]], phase: str | None, reservation: dict[str, int] | None,
          tainted: bool = True, spare: bool = False, cache: PassCache | None = None) -> Plan:
    """One pass over a GPR of 4 GPUs on n1 (tainted unless told otherwise) and, with ``spare``, an untainted n2."""
    n1 = node("n1", gpus=4, taints=[TAINT] if tainted else None, labels={"zone": "a"})
    nodes = {"n1": node_view(n1, (GPU,))}
    if spare:
        nodes["n2"] = node_view(node("n2", gpus=4, labels={"zone": "b"}), (GPU,))
    obj = gpr("g", phase=phase, devices=4, reservation=reservation, exitDuration="1h")
    obj["metadata"].update(uid="u-g", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    if phase:
        obj["status"]["admittedAt"] = rfc3339(time.time() - 30)
    views = {}
    for p in pods:
        view = pod_view(p, (GPU,))
        assert view is not None
        views[view.uid] = view
    return plan_pass(Snapshot(time.time(), nodes, views, {"u-g": obj}), PassConfig(), cache or PassCache())


def _conditions(plan: Plan) -> dict[str, dict[str, Any]]:
    (write,) = [w for w in plan.writes if w.key == "default/g"]
    return {c["type"]: c for c in write.status.get("conditions") or []}


def _written(plan: Plan) -> dict[str, Any]:
    (write,) = [w for w in plan.writes if w.key == "default/g"]
    return write.status


def test_a_queued_gpr_is_placed_only_where_its_pods_can_run() -> None:
    # n1 comes first in every tie, but the gated pod does not tolerate its taint: the GPR goes to n2
    plan = _pass([pod("g-0", 4, gpr="g", uid="p0", gated=True)], None, None, spare=True)
    assert _written(plan)["phase"] == "Admitted"
    assert _written(plan)["reservation"] == [{"node": "n2", "devices": 4}]
    assert "PodsCannotRun" not in _conditions(plan)
    # tolerating it, the pod may go to either: n1, first in the tie
    tolerant = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    tolerant["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    assert _written(_pass([tolerant], None, None, spare=True))["reservation"] == [{"node": "n1", "devices": 4}]
    # a nodeSelector, and a required node affinity, choose among untainted nodes the same way
    picky = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    picky["spec"]["nodeSelector"] = {"zone": "b"}
    assert _written(_pass([picky], None, None, tainted=False, spare=True))["reservation"] == [
        {"node": "n2", "devices": 4}]
    affine = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    affine["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}]}}}
    assert _written(_pass([affine], None, None, tainted=False, spare=True))["reservation"] == [
        {"node": "n2", "devices": 4}]
    # pinned by the user to a host (the form accelstack's own narrowing takes too): a gated pod's affinity is
    # all its own, and counts
    pinned = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    pinned["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                     "values": ["n2"]}]}]}}}
    assert _written(_pass([pinned], None, None, tainted=False, spare=True))["reservation"] == [
        {"node": "n2", "devices": 4}]


def test_a_gpr_whose_pods_can_run_nowhere_waits_and_blocks_nobody() -> None:
    plan = _pass([pod("g-0", 4, gpr="g", uid="p0", gated=True)], None, None)
    status = _written(plan)
    assert status["phase"] == "Queued" and status["reason"] == "Unschedulable"
    assert any("on the nodes its pods can run on" in e.detail for _, e in plan.events)
    message = _conditions(plan)["PodsCannotRun"]["message"]
    assert message.startswith("its pods can run on 0 node(s) with nvidia.com/gpu, too few or too small"), message


def test_an_admitted_gpr_whose_pods_cannot_go_to_its_nodes_says_so() -> None:
    # admitted before its pods existed, onto the only node, which they cannot go to: there is nowhere better
    gated = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    plan = _pass([gated], "Admitted", {"n1": 4})
    assert _written(plan)["phase"] == "Admitted"
    condition = _conditions(plan)["PodsCannotRun"]
    assert condition["status"] == "True" and condition["reason"] == "Unschedulable"
    assert "pod g-0" in condition["message"] and "untolerated taint dedicated=team-a:NoSchedule" in condition["message"]
    # the pod tolerates it: nothing to say
    tolerant = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    tolerant["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    assert "PodsCannotRun" not in _conditions(_pass([tolerant], "Admitted", {"n1": 4}))
    # a nodeSelector the node does not match
    picky = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    picky["spec"]["nodeSelector"] = {"zone": "b"}
    assert "nodeSelector zone=b" in _conditions(_pass([picky], "Admitted", {"n1": 4}, tainted=False))[
        "PodsCannotRun"]["message"]


def test_an_admitted_gpr_whose_pods_cannot_go_to_its_nodes_moves_where_they_can() -> None:
    """Admitted onto n1 before its pods existed; they cannot tolerate n1's taint and n2 is free: the reservation
    moves to n2 in one pass, with no failure counted. Once a pod of it is bound, it stays (and says so)."""
    plan = _pass([pod("g-0", 4, gpr="g", uid="p0", gated=True)], "Admitted", {"n1": 4}, spare=True)
    status = _written(plan)
    assert status["phase"] == "Admitted" and status["reservation"] == [{"node": "n2", "devices": 4}]
    assert status.get("failures", 0) == 0
    assert any(e.kind == "requeued" and "cannot run on reserved node n1" in e.detail for _, e in plan.events)
    assert plan.ungate["u-g"] == ["n2"]
    bound = pod("g-1", 4, gpr="g", uid="p1", node_name="n1", phase="Running")
    plan = _pass([pod("g-0", 4, gpr="g", uid="p0", gated=True), bound], "Admitted", {"n1": 4}, spare=True)
    assert not any(e.kind == "requeued" for _, e in plan.events)


def test_a_pod_narrowed_to_nodes_its_gpr_no_longer_holds_is_evicted() -> None:
    old = pod("g-0", 4, gpr="g", uid="p-old")  # ungated, unbound, narrowed to n0 (a reservation of before)
    old["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n0"]}]}]}}}
    current = pod("g-1", 4, gpr="g", uid="p-now")
    current["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]}}}
    plan = _pass([old, current], "Admitted", {"n1": 4}, tainted=False)
    assert [e.pod.uid for e in plan.evictions] == ["p-old"]
    assert "no longer holds" in plan.evictions[0].why


def test_node_fit_is_kept_until_a_label_it_reads_or_a_taint_changes() -> None:
    """NodeFit answers from what it computed while no node's taints and no label some pod selects by changed;
    a heartbeat or another label (GPU feature discovery's timestamp) keeps it; answers equal a fresh one's."""
    from scheduler_extender.objects.podfit import NodeFit

    def views(**labels: dict[str, str]) -> dict[str, Any]:
        return {name: node_view(node(name, labels=lab, taints=[TAINT] if name == "n2" else None), (GPU,))
                for name, lab in labels.items()}

    picky = pod_view({**pod("p", 1, gpr="g", gated=True, uid="p"), "spec": {
        **pod("p", 1)["spec"], "nodeSelector": {"zone": "a"}}}, (GPU,))
    plain = pod_view(pod("q", 1, gpr="h", gated=True, uid="q"), (GPU,))
    assert picky is not None and plain is not None
    nodes = views(n0={"zone": "a", "stamp": "1"}, n1={"zone": "b", "stamp": "1"}, n2={"zone": "a", "stamp": "1"})
    fit = NodeFit()
    fit.sync(sorted(nodes), nodes)
    assert fit.allowed(picky) == frozenset({"n0"})  # n2 is tainted
    assert fit.allowed(plain) == frozenset({"n0", "n1"})
    kept = fit.allowed_by_key
    restamped = views(n0={"zone": "a", "stamp": "2"}, n1={"zone": "b", "stamp": "2"}, n2={"zone": "a", "stamp": "2"})
    fit.sync(sorted(restamped), restamped)
    assert fit.allowed_by_key is kept  # nothing read changed
    moved = views(n0={"zone": "b"}, n1={"zone": "a"}, n2={"zone": "a"})
    fit.sync(sorted(moved), moved)
    assert fit.allowed(picky) == frozenset({"n1"})
    fresh = NodeFit()
    fresh.sync(sorted(moved), moved)
    assert fresh.allowed(picky) == fit.allowed(picky) and fresh.allowed(plain) == fit.allowed(plain)
    # every pod can run everywhere: no limit at all; pods pinned apart: any of their nodes
    untainted = {n: node_view(node(n, labels={"zone": z}), (GPU,)) for n, z in (("n0", "a"), ("n1", "b"))}
    fit.sync(sorted(untainted), untainted)
    assert fit.of_group([plain], 1) is None
    other = pod_view({**pod("r", 1, gpr="g", gated=True, uid="r"), "spec": {
        **pod("r", 1)["spec"], "nodeSelector": {"zone": "b"}}}, (GPU,))
    assert other is not None
    assert fit.of_group([picky, plain], 1) == frozenset({"n0"})  # both can run there
    assert fit.of_group([picky, other], 2) == frozenset({"n0", "n1"})  # none in common: each to its own


def test_the_node_lifecycles_taints_do_not_decide_where_a_gpr_goes() -> None:
    """A node under disk pressure or cordoned carries the lifecycle's taints for a while: GPRs are not kept off it
    for good (a cordoned node is closed to new reservations and expected back), nor moved off it."""
    from scheduler_extender.objects.podfit import NodeFit

    pressure = {"key": "node.kubernetes.io/disk-pressure", "effect": "NoSchedule"}
    nodes = {"n0": node_view(node("n0", taints=[pressure]), (GPU,)), "n1": node_view(node("n1"), (GPU,))}
    plain = pod_view(pod("q", 1, gpr="h", gated=True, uid="q"), (GPU,))
    assert plain is not None
    fit = NodeFit()
    fit.sync(sorted(nodes), nodes)
    assert fit.allowed(plain) is None
    # an Admitted GPR on the node under pressure, its pod gated: it stays
    gated = pod_view(pod("g-0", 4, gpr="g", uid="p0", gated=True), (GPU,))
    assert gated is not None
    n1 = node("n1", gpus=4, taints=[pressure])
    plan = plan_pass(Snapshot(time.time(), {"n1": node_view(n1, (GPU,)),
                                            "n2": node_view(node("n2", gpus=4), (GPU,))},
                              {"p0": gated},
                              {"u-g": {**gpr("g", phase="Admitted", devices=4, reservation={"n1": 4},
                                             exitDuration="1h"),
                                       "metadata": {"name": "g", "namespace": "default", "uid": "u-g",
                                                    "resourceVersion": "1", "generation": 1,
                                                    "creationTimestamp": "2026-11-30T00:00:00Z"}}}),
                     PassConfig(), PassCache())
    assert not any(e.kind == "requeued" for _, e in plan.events)


def test_node_fit_stays_bounded_as_pods_come_and_go() -> None:
    """Pods (each with constraints of its own) come and go, pass after pass: what NodeFit keeps stays within a
    small multiple of what is live."""
    from scheduler_extender.objects.podfit import NodeFit

    nodes = {f"n{i}": node_view(node(f"n{i}", labels={"rack": str(i % 4)}), (GPU,)) for i in range(8)}
    fit = NodeFit()
    for round_ in range(300):
        live: dict[str, list[Any]] = {}
        for k in range(5):  # five GPRs, one pod each, a selector never seen before
            raw = pod(f"p{round_}-{k}", 1, gpr=f"g{k}", gated=True, uid=f"u{round_}-{k}")
            raw["spec"]["nodeSelector"] = {"rack": str(k % 4), "round": str(round_)}
            view = pod_view(raw, (GPU,))
            assert view is not None
            live[f"g{k}"] = [view]
        fit.sync(sorted(nodes), nodes)
        for key, pods in live.items():
            assert fit.of_gpr(key, pods, 1) == frozenset()  # no node has the label "round"
        fit.forget_except(live)
        assert len(fit.keys) <= 2 * 5 + 64 and len(fit.allowed_by_key) <= 4 * 74 and len(fit.by_group) == 5


def test_a_pass_on_the_same_objects_keeps_the_limits_and_plans_what_a_fresh_start_plans() -> None:
    """A pass on the very objects the last one saw keeps the queued GPRs' limits instead of working them out
    again; its plan is the one a fresh start makes. A node's new taint is worked out again."""
    nodes = {"n1": node_view(node("n1", gpus=4, taints=[TAINT]), (GPU,)), "n2": node_view(node("n2", gpus=4), (GPU,))}
    busy = gpr("busy", phase="Running", devices=4, reservation={"n2": 4}, exitDuration="1h")
    busy["metadata"].update(uid="u-busy", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    busy["status"]["admittedAt"] = rfc3339(time.time() - 30)
    waiting = gpr("g", phase="Queued", devices=4, exitDuration="1h")
    waiting["metadata"].update(uid="u-g", resourceVersion="2", creationTimestamp="2026-11-30T00:00:01Z")
    views = {v.uid: v for v in (pod_view(pod("g-0", 4, gpr="g", uid="p0", gated=True), (GPU,)),
                                pod_view(pod("busy-0", 4, gpr="busy", uid="pb", node_name="n2", phase="Running"),
                                         (GPU,))) if v is not None}
    gprs = {"u-busy": busy, "u-g": waiting}
    cache = PassCache()
    now = time.time()
    for _ in range(3):
        plan = plan_pass(Snapshot(now, nodes, views, gprs), PassConfig(), cache)
        fresh = plan_pass(Snapshot(now, nodes, views, gprs), PassConfig(), PassCache())
        assert [(w.uid, w.status.get("phase")) for w in plan.writes] == [
            (w.uid, w.status.get("phase")) for w in fresh.writes]
        assert not [w for w in plan.writes if w.status.get("phase") == "Admitted"]  # n1: its pod may not go
    assert cache.limits is not None
    kept = cache.limits[3]
    assert kept == {"default/g": frozenset({"n2"})}
    plan_pass(Snapshot(now, nodes, views, gprs), PassConfig(), cache)
    assert cache.limits[3] is kept  # the same objects: kept as it was
    tolerated = {**nodes, "n1": node_view(node("n1", gpus=4), (GPU,))}  # the taint is lifted
    plan = plan_pass(Snapshot(now, tolerated, views, gprs), PassConfig(), cache)
    assert [w.status["reservation"] for w in plan.writes if w.uid == "u-g"] == [[{"node": "n1", "devices": 4}]]


def test_an_auto_gpr_waits_for_its_pod_before_it_is_placed() -> None:
    """The webhook makes a GPR for a pod before the API server stores the pod (or never, when the creation fails
    after the webhook answered). Until a pod of it is seen, the GPR holds nothing and its status is not touched;
    then it is placed where the pod can run."""
    nodes = {"n1": node_view(node("n1", gpus=4, taints=[TAINT]), (GPU,)), "n2": node_view(node("n2", gpus=4), (GPU,))}
    auto = gpr("job-a", phase="Queued", devices=4, exitDuration="1h")
    auto["metadata"].update(uid="u-a", resourceVersion="1", creationTimestamp=rfc3339(time.time() - 5),
                            labels={"accelstack.io/auto-gpr": "true"})
    now = time.time()
    plan = plan_pass(Snapshot(now, nodes, {}, {"u-a": auto}), PassConfig(), PassCache())
    assert not [w for w in plan.writes if w.status.get("phase") == "Admitted"] and not plan.ungate
    assert not plan.orphans  # within its grace
    gated = pod_view(pod("job-a-0", 4, gpr="job-a", uid="p0", gated=True), (GPU,))
    assert gated is not None
    plan = plan_pass(Snapshot(now, nodes, {"p0": gated}, {"u-a": auto}), PassConfig(), PassCache())
    assert [w.status["reservation"] for w in plan.writes if w.uid == "u-a"] == [[{"node": "n2", "devices": 4}]]
    # never created: deleted once its grace is over, having held nothing
    late = plan_pass(Snapshot(now + 300, nodes, {}, {"u-a": auto}), PassConfig(), PassCache())
    assert late.orphans == [("default", "job-a", "u-a")]
    assert not [w for w in late.writes if w.status.get("phase") == "Admitted"]


def test_an_admitted_gprs_pods_are_checked_against_its_nodes_until_one_takes_each(monkeypatch: Any) -> None:
    """A pass checks the unbound pods of each Admitted GPR against its reserved nodes (PodsCannotRun). A pod
    narrowed to a 60-node reservation can go to the first: one check per pod, not one per pod and node (a
    GPR of 60 pods cost every pass 3,600 checks, ~45 ms at 100 x 100, while its pods waited to be bound). A pod
    that can go to none is named with the first three nodes' reasons."""
    from scheduler_extender.controller import pod_tables
    from scheduler_extender.objects.narrowing import narrow_affinity

    names = [f"n{i}" for i in range(60)]
    nodes = [node_view(node(n, gpus=8, labels={"kubernetes.io/hostname": n}), (GPU,)) for n in names]
    pods = []
    for k in range(60):
        p = pod(f"g-{k}", 8, gpr="g", uid=f"p{k}")
        p["spec"]["affinity"] = narrow_affinity(None, names, {n: n for n in names})[0]["value"]
        view = pod_view(p, (GPU,))
        assert view is not None
        pods.append(view)
    calls: list[str] = []
    real = pod_tables.why_not

    def counted(p: Any, n: Any, lifecycle: bool = True) -> str:
        calls.append(n.name)
        return real(p, n, lifecycle)

    monkeypatch.setattr(pod_tables, "why_not", counted)
    assert pod_tables.cannot_run(pods, nodes) == ""
    assert len(calls) == len(pods)
    picky = pod("g-x", 8, gpr="g", uid="px")
    picky["spec"]["nodeSelector"] = {"zone": "b"}
    picky_view = pod_view(picky, (GPU,))
    assert picky_view is not None
    message = pod_tables.cannot_run([*pods, picky_view], nodes)
    assert message.startswith("pod g-x cannot run on the reserved nodes (n0: nodeSelector zone=b"), message
    assert message.count("nodeSelector zone=b") == 3 and message.endswith("; ...)")
