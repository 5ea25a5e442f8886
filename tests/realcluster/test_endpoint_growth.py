"""An inference endpoint starts with what fits and grows (issue 35.6b), on the real control plane: the operator under
its shipped ServiceAccount, the real Deployment/ReplicaSet/HPA controllers, the shipped webhooks, the GPR controller
and kube-scheduler with the shipped ``accelstack-scheduler`` profile.

Four fake nodes with one GPU each, one of them unhealthy (the ``accelstack.io/unhealthy`` taint); an endpoint of
1..4 replicas pinned to them. The base GPR (``replicas.min`` = 1) is admitted and its replica bound; then the
autoscaler asks for 4 (a scale as the HPA writes it): replicas 2 and 3 get a GPR each, admitted on the two other
healthy nodes and bound there, replica 4 waits with its GPR's reason, and the running replica is never touched
(same pod, same node, its GPR never re-queued). Scaling back to 2 releases the GPRs of the replicas removed.

Before: the endpoint's one GPR, admitted for 1 node, was never grown; the three new pods were released onto that
GPR's one node and none of them could bind (and a GPR for 4 would have started nothing at all).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import GPRS, wait_for
from tests.realcluster.stack import Product, Stack
from tests.realcluster.test_inference_operator import IES, condition, operator  # noqa: F401 (the fixture)

NAME = "grow"
PODS = "api/v1/namespaces/{ns}/pods"
POOL_LABEL = "accelstack.io/test-pool"


def endpoint(ns: str) -> dict[str, Any]:
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "InferenceEndpoint",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": {"models": ["grow-model"],
                     "template": {"image": "registry.k8s.io/pause:3.10", "nodeSelector": {POOL_LABEL: ns},
                                  "resources": {"requests": {"cpu": "100m"}}},
                     "accelerator": {"resource": "nvidia.com/gpu", "count": 1},
                     "replicas": {"min": 1, "max": 4}, "gpr": {"priority": 100}}}


def pods(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    got = cp.api("GET", PODS.format(ns=ns) + f"?labelSelector=accelstack.io/inference-endpoint={NAME}")
    return [p for p in got.get("items") or [] if not p["metadata"].get("deletionTimestamp")]


def bound(cp: ControlPlane, ns: str, count: int | None = None) -> dict[str, dict[str, Any]]:
    """Node -> the live pod bound there ({} unless there are ``count`` of them, when given)."""
    out = {p["spec"]["nodeName"]: p for p in pods(cp, ns) if p["spec"].get("nodeName")}
    return out if count is None or len(out) == count else {}


def gpr(cp: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    return cp.get(f"{GPRS.format(ns=ns)}/{name}")


def scale(cp: ControlPlane, ns: str, replicas: int) -> None:
    """As the HPA controller scales: the Deployment's scale subresource."""
    cp.patch(f"apis/apps/v1/namespaces/{ns}/deployments/{NAME}-primary/scale", {"spec": {"replicas": replicas}})


@pytest.mark.timeout(400)  # four phases of the GPR controller's and the scheduler's work, each bounded below
def test_an_endpoint_starts_with_what_fits_and_grows_without_touching_its_running_replica(
        cp: ControlPlane, stack: Stack, operator: Product, ns: str, nodes: Nodes) -> None:  # noqa: F811
    stack.start_scheduler()
    healthy = [nodes.add(f"g{i}", gpus=1, labels={POOL_LABEL: ns}) for i in range(3)]
    sick = nodes.add("sick", gpus=1, labels={POOL_LABEL: ns},
                     taints=[{"key": "accelstack.io/unhealthy", "value": "GPUUnhealthy", "effect": "NoSchedule"}])
    cp.create(IES.format(ns=ns), endpoint(ns))

    # min replicas start: the base GPR asks for 1 node, is admitted, its replica bound on a healthy node
    first = wait_for("the first replica bound", lambda: bound(cp, ns, 1), timeout=120)
    (node0, pod0), = first.items()
    assert node0 in healthy and pod0["metadata"]["labels"]["accelstack.io/gpr"] == f"{NAME}-primary", pod0
    base = gpr(cp, ns, f"{NAME}-primary")
    assert base is not None and base["spec"]["nodeCount"] == 1 and base["status"]["phase"] in ("Admitted", "Running")
    admitted_at = base["status"]["admittedAt"]

    # the autoscaler asks for 4: replicas 2 and 3 start on the two other healthy nodes, 4 waits
    scale(cp, ns, 4)
    grown = wait_for("three replicas bound", lambda: bound(cp, ns, 3), timeout=120)
    assert set(grown) == set(healthy) and sick not in grown
    assert grown[node0]["metadata"]["uid"] == pod0["metadata"]["uid"]  # the running replica untouched
    assert {p["metadata"]["labels"]["accelstack.io/gpr"] for p in grown.values()} == {
        f"{NAME}-primary", f"{NAME}-primary-2", f"{NAME}-primary-3"}
    for k in (2, 3):
        g = gpr(cp, ns, f"{NAME}-primary-{k}")
        assert g is not None and g["spec"]["nodeCount"] == 1 and g["status"]["phase"] in ("Admitted", "Running")
    waiting = wait_for("replica 4's GPR to wait with a reason", lambda: (g := gpr(cp, ns, f"{NAME}-primary-4")) and (
        g.get("status") or {}).get("phase") == "Queued" and g["status"].get("reason") and g, timeout=120)
    fourth = [p for p in pods(cp, ns) if not p["spec"].get("nodeName")]
    assert len(fourth) == 1 and fourth[0]["metadata"]["labels"]["accelstack.io/gpr"] == f"{NAME}-primary-4"
    assert [g["name"] for g in fourth[0]["spec"].get("schedulingGates") or []] == ["accelstack.io/gpr"]
    base = gpr(cp, ns, f"{NAME}-primary")
    assert base is not None and base["status"]["admittedAt"] == admitted_at  # never re-queued
    assert base["spec"]["nodeCount"] == 1 and base["status"]["reservedNodes"] == [node0]

    # the endpoint says how many replicas are admitted, how many wait and why
    ep = wait_for("the endpoint's status to say 3 admitted, 1 waiting", lambda: (e := cp.get(
        f"{IES.format(ns=ns)}/{NAME}")) and (e.get("status") or {}).get("pools", {}).get("primary", {}).get(
        "admittedReplicas") == 3 and condition(e, "ScalingLimited").get("reason") == "GrowthQueued" and e, timeout=90)
    pool = ep["status"]["pools"]["primary"]
    assert (pool["desiredReplicas"], pool["waitingReplicas"], pool["waitingReason"]) == (
        4, 1, waiting["status"]["reason"]), pool
    limited = condition(ep, "ScalingLimited")["message"]
    assert limited.startswith(f"3 of 4 replicas admitted; 1 wait for their GPR: {NAME}-primary-4 is Queued "
                              f"({waiting['status']['reason']})"), limited

    # back to 2: the ReplicaSet removes the waiting replica and the last one (lowest pod-deletion-cost); once its
    # pod is gone (no kubelet here: deleted as a kubelet would confirm it) the GPRs of 3 and 4 are released
    scale(cp, ns, 2)
    leaving = wait_for("a bound replica terminating", lambda: [
        p for p in cp.api("GET", PODS.format(ns=ns)).get("items") or []
        if p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName")], timeout=90)
    assert [p["metadata"]["labels"]["accelstack.io/gpr"] for p in leaving] == [f"{NAME}-primary-3"]
    for p in leaving:
        cp.api("DELETE", f"{PODS.format(ns=ns)}/{p['metadata']['name']}", {"gracePeriodSeconds": 0})
    wait_for("the GPRs of replicas 3 and 4 released", lambda: gpr(cp, ns, f"{NAME}-primary-3") is None and
             gpr(cp, ns, f"{NAME}-primary-4") is None, timeout=90)
    left = bound(cp, ns)
    assert left[node0]["metadata"]["uid"] == pod0["metadata"]["uid"] and len(left) == 2
    assert gpr(cp, ns, f"{NAME}-primary-2") is not None
