"""GPR decisions a team can trust, on the real API server and kube-scheduler (issue 35)."""

from __future__ import annotations

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import GPRS, admitted, bound_node, gpr, pod, wait_for
from tests.realcluster.stack import Stack


def test_many_small_pods_of_one_gpr_bind_without_a_failed_bind(cp: ControlPlane, stack: Stack, ns: str,
                                                               nodes: Nodes) -> None:
    """A 20-node x 1-GPU GPR on 8-GPU nodes, then its 20 pods at once: kube-scheduler filters each next pod while
    the last one binds and sees 8 free GPUs on every reserved node; the extender offers each pod a node whose
    share no pod in flight holds, so every bind succeeds the first time, one pod per reserved node. Each pod is
    created pinned to its node (the binder's webhook narrows it to one reserved node: one node term, not 20)."""
    stack.start_scheduler()
    for i in range(20):
        nodes.add(f"s{i:02d}", gpus=8)
    cp.create(GPRS.format(ns=ns), gpr("spread", devices=1, nodes=20))
    status = wait_for("the GPR admitted", lambda: admitted(cp, ns, "spread"))
    reserved = {r["node"] for r in status["reservation"]}
    assert len(reserved) == 20
    for i in range(20):
        cp.create(f"api/v1/namespaces/{ns}/pods", pod(f"w-{i:02d}", gpr_name="spread"))
    placed = wait_for("all 20 pods bound", lambda: (lambda b: b if all(b) else None)(
        [bound_node(cp, ns, f"w-{i:02d}") for i in range(20)]), timeout=90)
    assert sorted(placed) == sorted(reserved), "one pod on each reserved node"
    for i in range(20):  # pinned at creation to the node it was bound to
        obj = cp.get(f"api/v1/namespaces/{ns}/pods/w-{i:02d}") or {}
        terms = obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert len(terms) == 1 and terms[0]["matchFields"][0]["values"] == [obj["spec"]["nodeName"]], terms
    events = cp.api("GET", f"api/v1/namespaces/{ns}/events").get("items") or []
    # a failed bind is the extender's refusal, which kube-scheduler reports as FailedScheduling quoting it; other
    # FailedScheduling (a scheduler whose node cache still catches up after the previous test's API-server
    # restart: "didn't satisfy plugin(s) [NodeAffinity]") are no bind
    failed = [e.get("message", "") for e in events if e.get("reason") == "FailedScheduling"
              and ("cannot bind" in e.get("message", "") or "binding" in e.get("message", "").lower())]
    assert failed == [], failed
