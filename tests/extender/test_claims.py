"""Pods in flight between filter and bind: filter offers each pod of a GPR one node and claims that node's share of
the GPR for it, so the GPR's next pods are offered the rest (kube-scheduler binds a pod while it filters the next,
and sees every device of a node free where the GPR's share is one); a pod without a GPR is offered at most one
node where GPRs hold unused devices, and claims its devices there, so pods in flight never take what a GPR holds."""

from __future__ import annotations

import datetime as dt

from scheduler_extender.extender.verbs import PodAsk, filter_nodes, node_verdict, resolve
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import GPU, ClusterView, pod_view
from tests.extender.harness import gpr, node

NODES = [f"n{i}" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def view_with_spread_gpr() -> tuple[ClusterView, Clock]:
    view, clock = ClusterView(), Clock()
    view.clock = clock
    view.sync_nodes([node(n, gpus=8) for n in NODES])
    view.sync_gprs([gpr("spread", reservation=dict.fromkeys(NODES, 1), nodes=4)])
    return view, clock


def ask(view: ClusterView, uid: str) -> PodAsk:
    return resolve(view, {GPU: 1}, "default/spread", 0, uid=uid)


def test_each_pod_is_offered_a_node_no_pod_in_flight_holds() -> None:
    view, _ = view_with_spread_gpr()
    offered = []
    for i in range(4):
        out = filter_nodes(view, ask(view, f"p{i}"), NODES)
        assert len(out.passed) == 1, out
        offered.append(out.passed[0])
        assert set(out.unresolvable) == set(NODES) - set(out.passed)
    assert sorted(offered) == NODES  # four pods in flight, four different nodes
    fifth = filter_nodes(view, ask(view, "p4"), NODES)
    assert fifth.passed == []
    assert all("taken by pods being bound (0 bound, 1 in flight, of 1)" in r for r in fifth.unresolvable.values())
    # a pod filtered again keeps no second claim: it is offered the same share, not a new one
    again = filter_nodes(view, ask(view, "p0"), NODES)
    assert again.passed == [offered[0]]
    # another pod's bind to a node claimed for p0 is refused; p0's own is not
    assert "in flight" in node_verdict(view, ask(view, "p4"), offered[0])[0]
    assert node_verdict(view, ask(view, "p0"), offered[0]) == ("", False)


def test_a_claim_ends_when_the_ledger_holds_the_pod_or_the_pod_goes_or_its_time_is_up() -> None:
    view, clock = view_with_spread_gpr()
    for i in range(3):
        filter_nodes(view, ask(view, f"p{i}"), NODES)
    n0 = view.claims["p0"].node
    # p0 bound: its entry is in the ledger (the binder unclaims as it writes it) and the pod event arrives
    obj = node(n0, gpus=8)
    obj["metadata"]["annotations"] = {ledger.LEDGER_ANNOTATION: ledger.render(
        {"p0": ledger.Entry("p0", "default/p0", {GPU: 1}, "default/spread", 1.0)})}
    obj["metadata"]["resourceVersion"] = "9"
    view.on_node("MODIFIED", obj)
    view.on_pod("MODIFIED", {"metadata": {"uid": "p0", "name": "p0", "namespace": "default",
                                          "labels": {"accelstack.io/gpr": "spread"}},
                             "spec": {"nodeName": n0, "containers": [{"name": "c", "resources": {
                                 "requests": {GPU: "1"}, "limits": {GPU: "1"}}}]},
                             "status": {"phase": "Pending"}})
    assert "p0" not in view.claims
    assert view.claimed_share(n0, "default/spread", GPU) == 0
    # p1 deleted before its bind
    view.on_pod("DELETED", {"metadata": {"uid": "p1", "name": "p1", "namespace": "default"}})
    assert "p1" not in view.claims
    # p2's bind never came: its claim lapses, and its node is offered again
    n2 = view.claims["p2"].node
    clock.now += view.claim_ttl + 1
    out = filter_nodes(view, ask(view, "p9"), [n2])
    assert out.passed == [n2] and "p2" not in view.claims
    assert len(view.claimed) == 1  # p9's own


def test_claims_off_offers_every_node_that_fits() -> None:
    view, _ = view_with_spread_gpr()
    view.claim_ttl = 0
    out = filter_nodes(view, ask(view, "p0"), NODES)
    assert sorted(out.passed) == NODES and not view.claims


def view_with_held_devices(memory: bool = True) -> tuple[ClusterView, Clock]:
    """Four 8-GPU nodes; GPR ``held`` reserves 4 on n0 and n1 and has no pod yet, n2 and n3 hold no reservation."""
    view, clock = ClusterView(ledger="memory" if memory else "node"), Clock()
    view.clock = clock
    view.sync_nodes([node(n, gpus=8) for n in NODES])
    view.sync_gprs([gpr("held", devices=4, reservation={"n0": 4, "n1": 4}, nodes=2)])
    return view, clock


def plain(view: ClusterView, uid: str, count: int = 1) -> PodAsk:
    return resolve(view, {GPU: count}, "", 0, uid=uid)


def bound(uid: str, node_name: str, count: int = 1) -> dict:  # type: ignore[type-arg]
    return {"metadata": {"uid": uid, "name": uid, "namespace": "kube-system"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {
                "requests": {GPU: str(count)}, "limits": {GPU: str(count)}}}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-05T00:53:34Z"}]}}


def test_pods_without_a_gpr_in_flight_share_out_the_devices_gprs_left_and_no_more() -> None:
    """kube-scheduler sees 8 free GPUs on n0 and n1 and binds without asking: each pod without a GPR is offered
    one of the nodes where a GPR holds unused devices (the one it fits best) with the nodes no GPR holds, and its
    devices there are claimed until its bind is seen: eight 1-GPU pods in flight get n0's and n1's 4 + 4 and the
    next is offered only n2 and n3."""
    view, _ = view_with_held_devices()
    offered: dict[str, int] = {}
    for i in range(8):
        out = filter_nodes(view, plain(view, f"p{i}"), NODES)
        held = [n for n in out.passed if n in ("n0", "n1")]
        assert len(held) == 1 and {"n2", "n3"} <= set(out.passed), out
        offered[held[0]] = offered.get(held[0], 0) + 1
    assert offered == {"n0": 4, "n1": 4}  # best fit: one node filled before the other
    ninth = filter_nodes(view, plain(view, "p8"), NODES)
    assert sorted(ninth.passed) == ["n2", "n3"]
    assert ninth.failed["n0"] == "4 nvidia.com/gpu free, 4 of them to pods being bound, pod asks 1"
    # the same pod filtered again keeps one claim, not a second
    again = filter_nodes(view, plain(view, "p0"), NODES)
    assert [n for n in again.passed if n in ("n0", "n1")] == [view.claims["p0"].node]
    # p0 seen bound to n3 instead (kube-scheduler chose a node no GPR holds): its claim goes, n0 or n1 has room
    view.on_pod("MODIFIED", bound("p0", "n3"))
    assert "p0" not in view.claims
    assert len([n for n in filter_nodes(view, plain(view, "p8"), NODES).passed if n in ("n0", "n1")]) == 1


def test_where_no_gpr_holds_unused_devices_a_pod_without_one_is_offered_every_node_and_claims_nothing() -> None:
    view, _ = view_with_held_devices()
    for uid, where in (("g0", "n0"), ("g1", "n1")):
        obj = bound(uid, where, 4)
        obj["metadata"].update(namespace="default", labels={"accelstack.io/gpr": "held"})
        view.on_pod("ADDED", obj)
    out = filter_nodes(view, plain(view, "p0"), NODES)
    assert sorted(out.passed) == NODES and not view.claims
    # a pod asking two resources takes the general path, and the same rule: one node where GPUs are held back
    view2, _ = view_with_held_devices()
    nr1 = "neureality.com/nr1"
    for name in NODES:
        obj = node(name, gpus=8)
        for key in ("capacity", "allocatable"):
            obj["status"][key][nr1] = "2"
        obj["metadata"]["resourceVersion"] = "5"
        view2.on_node("MODIFIED", obj)
    two = resolve(view2, {GPU: 1, nr1: 1}, "", 0, uid="q")
    out2 = filter_nodes(view2, two, NODES)
    assert len([n for n in out2.passed if n in ("n0", "n1")]) == 1 and {"n2", "n3"} <= set(out2.passed), out2
    assert view2.claims["q"].requests == {GPU: 1, nr1: 1}


def test_a_pod_bound_by_kube_scheduler_is_recorded_from_its_podscheduled_time() -> None:
    """No allocation annotation (kube-scheduler made the Binding): the bind time is the end of the second the API
    server stamped on PodScheduled, never earlier than the bind; the annotation, where accelstack bound, wins."""
    p = pod_view(bound("p0", "n0"), (GPU,))
    assert p is not None and p.bound_at == dt.datetime(2026, 12, 5, 0, 53, 35, tzinfo=dt.UTC).timestamp()
    annotated = bound("p1", "n0")
    annotated["metadata"]["annotations"] = {"accelstack.io/allocation": '{"boundAt": 1796432014.152}'}
    assert (q := pod_view(annotated, (GPU,))) is not None and q.bound_at == 1796432014.152
    unbound = bound("p2", "")
    unbound["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                        "lastTransitionTime": "2026-12-05T00:53:34Z"}]
    assert (r := pod_view(unbound, (GPU,))) is not None and r.bound_at == 0.0


def test_a_pod_whose_devices_a_bind_verb_recorded_keeps_its_node() -> None:
    """With a profile's bind verb, a Binding that may yet land leaves the pod's devices in the ledger: the retried
    pod is offered that node again, though by the count of the devices left no pod without a GPR fits there."""
    view, _ = view_with_held_devices()
    view.set_ledger("n0", {"p": ledger.Entry("p", "kube-system/p", {GPU: 4}, "", 1.0)})
    out = filter_nodes(view, plain(view, "p", 4), NODES)
    assert "n0" in out.passed and "n0" not in out.failed, out
    assert "n1" in out.passed or "n1" in out.unresolvable  # n1 fits 4 too, but only one held node is offered
    other = filter_nodes(view, plain(view, "q", 4), ["n0"])
    assert other.passed == [] and "n0" in other.failed
