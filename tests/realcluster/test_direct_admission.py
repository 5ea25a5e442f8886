"""Bare pods admitted at once without a GPR (``accelstack-extender --auto-gpr=true --auto-gpr-direct=true``) on the
real kube-apiserver and kube-scheduler, under the shipped webhooks, profile and RBAC: while no GPR waits, each pod
of a namespace whose default template is one node, whole devices and not preemptible is pinned to a node with free
devices and bound there by kube-scheduler, with no GPR object and no gate; the controller counts those devices
(a GPR that needs them queues, saying who holds them); and once a GPR waits, the next bare pod gets a GPR of its
own and its gate, as without the flag."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.realcluster.conftest import Nodes
from tests.realcluster.controlplane import ControlPlane
from tests.realcluster.objects import (
    GPRS,
    account_token,
    bound_gpus,
    gpr,
    gpr_status,
    pod,
    pod_obj,
    wait_bound,
    wait_for,
)
from tests.realcluster.shipped import webhooks_to
from tests.realcluster.stack import Stack
from tests.realcluster.test_members import rest

DIRECT = ("--auto-gpr=true", "--auto-gpr-direct=true")


@pytest.fixture(scope="module")
def direct(stack: Stack) -> Iterator[Stack]:
    """The stack's extender restarted with the flags for this module's tests, and as it was afterwards."""
    before = list(stack.extender_args)
    stack.extender_args = [*before, *DIRECT]
    stack.restart_extender()
    try:
        yield stack
    finally:
        stack.extender_args = before
        stack.restart_extender()


def queued_elsewhere(cp: ControlPlane) -> list[str]:
    """GPRs that wait anywhere in the cluster (any of them turns direct admission off)."""
    items = cp.api("GET", "apis/accelstack.io/v1alpha1/gpuprovisioningrequests").get("items") or []
    return [f"{g['metadata']['namespace']}/{g['metadata']['name']}" for g in items
            if (g.get("status") or {}).get("phase", "Queued") == "Queued"]


def setup(cp: ControlPlane, stack: Stack, ns: str, nodes: Nodes) -> tuple[str, list[str]]:
    """Two 8-GPU nodes of a model only they have, the namespace's default template one GPU of that model on one
    node, not preemptible; the scheduler running; no GPR queued. (model, node names)"""
    model = f"direct-{ns}"[:63].rstrip("-")
    names = [nodes.add(f"n{i}", labels={"nvidia.com/gpu.product": model}) for i in range(2)]
    cp.patch(f"api/v1/namespaces/{ns}", {"metadata": {"annotations": {"accelstack.io/default-template": "one"}}})
    cp.create(f"apis/accelstack.io/v1alpha1/namespaces/{ns}/gprtemplates", {
        "apiVersion": "accelstack.io/v1alpha1", "kind": "GPRTemplate", "metadata": {"name": "one"},
        "spec": {"resource": "nvidia.com/gpu", "devicesPerNode": 1, "nodeCount": 1, "models": [model],
                 "preemptible": False, "exitDuration": "1h"}})
    stack.start_scheduler()
    # a GPR waiting anywhere turns admission at once off: the last test's are deleted with its namespace
    wait_for("no GPR queued in the cluster", lambda: not queued_elsewhere(cp) or None, timeout=30)
    # and a node the binder's view does not hold yet (or without its devices) is no node to admit a pod to
    token = account_token(cp, ns, "viewer", [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}])
    try:
        def seen() -> bool | None:
            status, body = rest(stack, cp, "/api/v1/inventory", token)
            devices = {r["node"]: r["capacity"] for r in body.get("nodes") or ()} if status == 200 else {}
            return all(devices.get(n) == 8 for n in names) or None

        wait_for("the binder's view holding the nodes and their devices", seen, timeout=30)
    finally:
        for kind in ("clusterrolebindings", "clusterroles"):
            cp.delete(f"apis/rbac.authorization.k8s.io/v1/{kind}/{ns}-viewer")
    return model, names


def assert_admitted_at_once(cp: ControlPlane, ns: str, name: str, names: list[str]) -> str:
    """The pod bound to one of ``names``, labelled as admitted at once, its node term naming that node; the node."""
    on = wait_bound(cp, ns, name)
    obj = pod_obj(cp, ns, name)
    labels = obj["metadata"].get("labels") or {}
    assert labels.get("accelstack.io/direct") == "true" and "accelstack.io/gpr" not in labels, labels
    terms = obj["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [on]}]}], terms
    assert on in names and obj["spec"]["activeDeadlineSeconds"] == 3600
    return on


def test_pods_the_replica_that_does_not_bind_answers_are_handed_to_the_binder(cp: ControlPlane, direct: Stack,
                                                                              ns: str, nodes: Nodes) -> None:
    """The Deployment runs two replicas behind the webhook's Service: the one that does not answer the verbs holds
    the pod at the gate, labelled pending, with no GPR; the binder pins it and lifts the gate in one patch."""
    stack = direct
    _, names = setup(cp, stack, ns, nodes)
    second, _ = stack.second_extender()
    ca = cp.pki.ca_crt.read_bytes()
    try:
        cp.apply(webhooks_to(stack.objects, second.health, ca))  # every webhook call to the other replica
        made = [cp.create(f"api/v1/namespaces/{ns}/pods", pod(f"handed-{i}")) for i in range(3)]
        for obj in made:  # as the other replica answered
            assert obj["metadata"]["labels"] == {"accelstack.io/direct": "pending"}, obj["metadata"]
            assert obj["spec"]["schedulingGates"] == [{"name": "accelstack.io/gpr"}], obj["spec"]
        on = {assert_admitted_at_once(cp, ns, f"handed-{i}", names) for i in range(3)}
        assert len(on) == 1, on  # the binder packs them, as its own
        assert (cp.get(GPRS.format(ns=ns)) or {}).get("items") == []
    finally:
        cp.apply(webhooks_to(stack.objects, stack.url, ca))
        second.stop()


def test_bare_pods_run_at_once_without_a_gpr_until_a_gpr_waits(cp: ControlPlane, direct: Stack, ns: str,
                                                               nodes: Nodes) -> None:
    model, names = setup(cp, direct, ns, nodes)
    bare = [f"bare-{i}" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda name: cp.create(f"api/v1/namespaces/{ns}/pods", pod(name)), bare))
    for name in bare:
        assert_admitted_at_once(cp, ns, name, names)
    assert (cp.get(GPRS.format(ns=ns)) or {}).get("items") == []  # no GPR object for any of them
    assert sorted(bound_gpus(cp, n) for n in names) == [0, 6]  # packed on one node
    # a GPR for both nodes whole waits for the devices the bare pods hold, and says who holds them
    cp.create(GPRS.format(ns=ns), gpr("big", devices=8, nodes=2, models=[model]))
    status = wait_for("big queued for capacity", lambda: (s := gpr_status(cp, ns, "big")).get(
        "reason") == "InsufficientCapacity" and s)
    assert status["phase"] == "Queued", status
    # now something waits: the next bare pod gets a GPR of its own, gated like any
    cp.create(f"api/v1/namespaces/{ns}/pods", pod("after"))
    obj = pod_obj(cp, ns, "after")
    assert (obj["metadata"].get("labels") or {}).get("accelstack.io/gpr") == "after", obj["metadata"]
    made = cp.get(f"{GPRS.format(ns=ns)}/after") or {}
    assert (made.get("metadata", {}).get("labels") or {}).get("accelstack.io/auto-gpr") == "true", made
    for name in names:
        assert bound_gpus(cp, name) <= 8, name
