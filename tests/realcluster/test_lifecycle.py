"""The whole life cycle on the real control plane: the real API server calls the shipped webhooks, the GPR
controller admits under its shipped RBAC, the real kube-scheduler with the shipped ``accelstack-scheduler``
profile calls the extender's filter and bind, and the pods end up bound to the GPR's reserved node."""

from __future__ import annotations

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import GPRS, admitted, gpr, pod, pod_obj, wait_bound, wait_for
from tests.realcluster.stack import Stack


def test_gated_pod_is_admitted_narrowed_and_bound_by_the_real_scheduler(cp: ControlPlane, stack: Stack, ns: str,
                                                                       nodes: Nodes) -> None:
    stack.start_scheduler()
    a, b = nodes.add("a", gpus=8), nodes.add("b", gpus=8)
    # a pod created before its GPR: the webhook gates it, nothing can schedule it before the GPR is admitted
    first = cp.create(f"api/v1/namespaces/{ns}/pods", pod("train-0", gpus=1, gpr_name="train"))
    assert [g["name"] for g in first["spec"].get("schedulingGates") or []] == ["accelstack.io/gpr"], first["spec"]
    cp.create(GPRS.format(ns=ns), gpr("train", devices=2, nodes=1))
    status = wait_for("the GPR admitted", lambda: admitted(cp, ns, "train"))
    reserved = {r["node"] for r in status.get("reservation") or []}
    assert len(reserved) == 1 and reserved <= {a, b}, status
    # a pod created after admission: no gate, narrowed straight to the reservation with matchFields (which keeps
    # kube-scheduler's NodeAffinity PreFilter shortcut)
    second = cp.create(f"api/v1/namespaces/{ns}/pods", pod("train-1", gpus=1, gpr_name="train"))
    assert not second["spec"].get("schedulingGates")
    terms = second["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                            "values": sorted(reserved)}]}]
    for i in range(2):
        name = f"train-{i}"
        node = wait_bound(cp, ns, name)
        assert node in reserved
        assert not pod_obj(cp, ns, f"train-{i}")["spec"].get("schedulingGates")


def test_a_25_node_reservation_is_narrowed_by_name_and_the_real_api_server_takes_it(cp: ControlPlane, stack: Stack,
                                                                                   ns: str, nodes: Nodes) -> None:
    """A GPR of 25 nodes x 1 GPU: the gated pod's narrowing at ungate (a scheduling-gated pod may only gain node
    affinity, KEP-3838) is one matchFields term a node, a later pod's at creation one term, the node the binder's
    webhook pinned it to; both accepted by the real API server, and the real scheduler binds the pods inside the
    reservation."""
    stack.start_scheduler()
    names = {nodes.add(f"w{i:02d}", gpus=1) for i in range(25)}
    cp.create(f"api/v1/namespaces/{ns}/pods", pod("wide-0", gpus=1, gpr_name="wide"))
    cp.create(GPRS.format(ns=ns), gpr("wide", devices=1, nodes=25))
    status = wait_for("the GPR admitted", lambda: admitted(cp, ns, "wide"))
    assert {r["node"] for r in status["reservation"]} == names
    cp.create(f"api/v1/namespaces/{ns}/pods", pod("wide-1", gpus=1, gpr_name="wide"))
    for name in ("wide-0", "wide-1"):
        node = wait_bound(cp, ns, name)
        assert node in names
        terms = pod_obj(cp, ns, name)["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        want = sorted(names) if name == "wide-0" else [node]  # wide-1: pinned at creation to one reserved node
        assert sorted(t["matchFields"][0]["values"][0] for t in terms) == want
        assert all(t == {"matchFields": [{"key": "metadata.name", "operator": "In",
                                          "values": t["matchFields"][0]["values"]}]} for t in terms)
