"""Pods of a GPR in flight between filter and bind: filter offers each one node and claims that node's share of
the GPR for it, so the GPR's next pods are offered the rest (kube-scheduler binds a pod while it filters the next,
and sees every device of a node free where the GPR's share is one)."""

from __future__ import annotations

from scheduler_extender.extender.verbs import PodAsk, filter_nodes, node_verdict, resolve
from scheduler_extender.objects import ledger
from scheduler_extender.objects.cluster import GPU, ClusterView
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
