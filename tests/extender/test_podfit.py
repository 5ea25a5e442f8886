"""kube-scheduler's own filters as the GPR controller reads them (scheduler_extender/podfit.py): taints and
tolerations (v1.Toleration.ToleratesTaint), nodeSelector and required node affinity; and what the controller does
with them: a condition on an Admitted GPR whose pods cannot go to its nodes, and an eviction of a pod narrowed to
nodes its GPR no longer holds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from scheduler_extender.cluster import GPU, node_view, pod_view
from scheduler_extender.gpr_resource import rfc3339
from scheduler_extender.podfit import selector_mismatch, tolerates, untolerated
from scheduler_extender.reconcile import PassCache, PassConfig, Plan, Snapshot, plan_pass
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
          tainted: bool = True) -> Plan:
    n1 = node("n1", gpus=4, taints=[TAINT] if tainted else None)
    nodes = {"n1": node_view(n1, (GPU,))}
    obj = gpr("g", phase=phase, devices=4, reservation=reservation, exitDuration="1h")
    obj["metadata"].update(uid="u-g", resourceVersion="1", creationTimestamp="2026-11-30T00:00:00Z")
    if phase:
        obj["status"]["admittedAt"] = rfc3339(time.time() - 30)
    views = {}
    for p in pods:
        view = pod_view(p, (GPU,))
        assert view is not None
        views[view.uid] = view
    return plan_pass(Snapshot(time.time(), nodes, views, {"u-g": obj}), PassConfig(), PassCache())


def _conditions(plan: Plan) -> dict[str, dict[str, Any]]:
    (write,) = [w for w in plan.writes if w.key == "default/g"]
    return {c["type"]: c for c in write.status.get("conditions") or []}


def test_an_admitted_gpr_whose_pods_cannot_go_to_its_nodes_says_so() -> None:
    gated = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    plan = _pass([gated], None, None)
    written = {w.key: w.status for w in plan.writes}
    assert written["default/g"]["phase"] == "Admitted"  # reserved from the GPR's spec, as before
    condition = _conditions(plan)["PodsCannotRun"]
    assert condition["status"] == "True" and condition["reason"] == "Unschedulable"
    assert "pod g-0" in condition["message"] and "untolerated taint dedicated=team-a:NoSchedule" in condition["message"]
    # the pod tolerates it: no condition
    tolerant = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    tolerant["spec"]["tolerations"] = [{"key": "dedicated", "operator": "Exists"}]
    assert "PodsCannotRun" not in _conditions(_pass([tolerant], None, None))
    # a nodeSelector the node does not match
    picky = pod("g-0", 4, gpr="g", uid="p0", gated=True)
    picky["spec"]["nodeSelector"] = {"zone": "b"}
    assert "nodeSelector zone=b" in _conditions(_pass([picky], None, None, tainted=False))["PodsCannotRun"]["message"]


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
