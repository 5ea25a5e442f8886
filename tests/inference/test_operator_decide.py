"""The CG operator's pure decisions: the objects an endpoint stands for, bursting, replacing replicas on unhealthy
nodes, deletions, status and events."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inference.names import LABEL_ENDPOINT, LABEL_POOL
from inference.operator.decide import Observed, Plan, node_problem, plan
from inference.operator.objects import GPR_LABEL, INFLIGHT_METRIC, QUEUE_METRIC, OperatorSettings
from tests.extender.test_crds import admit

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "inference-endpoint.yaml"
NOW = "2026-11-30T12:00:00Z"
SETTINGS = OperatorSettings()


def example() -> dict[str, Any]:
    obj = yaml.safe_load(EXAMPLE.read_text())
    stored, errors = admit("inferenceendpoints", obj)  # with the CRD's defaults, as the API server stores it
    assert errors == []
    stored["metadata"].update({"uid": "uid-1", "generation": 3})
    return stored


def by_kind(p: Plan) -> dict[tuple[str, str], dict[str, Any]]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in p.apply}


def deployment_status(replicas: int, ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": replicas}, "status": {"replicas": replicas, "readyReplicas": ready}}


def test_objects_of_the_example() -> None:
    p = plan(example(), Observed(), SETTINGS, NOW)
    objs = by_kind(p)
    assert set(objs) == {("Deployment", "llama-primary"), ("Service", "llama-primary"),
                         ("GPUProvisioningRequest", "llama-primary"), ("PodDisruptionBudget", "llama"),
                         ("NetworkPolicy", "llama"), ("HorizontalPodAutoscaler", "llama"),
                         ("Deployment", "llama-burst"), ("Service", "llama-burst")}  # no burst GPR while idle
    for obj in p.apply:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["kind"] == "InferenceEndpoint" and ref["uid"] == "uid-1" and ref["controller"] is True
        assert obj["metadata"]["namespace"] == "team-a"
        if not obj["apiVersion"].startswith("accelstack.io/"):
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    dep = objs[("Deployment", "llama-primary")]
    pod = dep["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "1"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert pod["spec"]["schedulerName"] == "accelstack-scheduler"
    # autoscaled (1..4): new pods name no GPR that exists, so they wait at the gate for the operator to give them one
    assert pod["metadata"]["labels"][GPR_LABEL] == "llama-primary-new"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert objs[("Deployment", "llama-burst")]["spec"]["replicas"] == 0
    svc = objs[("Service", "llama-primary")]
    assert svc["metadata"]["labels"][LABEL_ENDPOINT] == "llama" and svc["metadata"]["labels"][LABEL_POOL] == "primary"
    assert svc["spec"]["selector"] == {LABEL_ENDPOINT: "llama", LABEL_POOL: "primary"}
    g = objs[("GPUProvisioningRequest", "llama-primary")]["spec"]
    assert g == {"resource": "nvidia.com/gpu", "devicesPerNode": 1, "nodeCount": 1, "priority": 200,
                 "preemptible": False}
    h = objs[("HorizontalPodAutoscaler", "llama")]["spec"]
    assert (h["minReplicas"], h["maxReplicas"]) == (1, 4)
    assert h["metrics"][0]["pods"]["metric"]["name"] == INFLIGHT_METRIC
    assert h["metrics"][0]["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert h["metrics"][1]["external"]["metric"]["name"] == QUEUE_METRIC
    assert h["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert p.delete == [] and p.replace_pods == []


def test_network_policy_admits_gateway_own_namespace_and_listed_clients_only() -> None:
    np = by_kind(plan(example(), Observed(), SETTINGS, NOW))[("NetworkPolicy", "llama")]["spec"]
    assert np["policyTypes"] == ["Ingress"] and np["podSelector"] == {"matchLabels": {LABEL_ENDPOINT: "llama"}}
    (rule,) = np["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "http"}]
    peers = rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "accelstack-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "accelstack-gateway"}}} in peers
    assert {"podSelector": {}} in peers
    assert {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-b"]}]}} in peers
    assert {"namespaceSelector": {}} not in peers  # not everyone
    everyone = example()
    everyone["spec"]["access"]["namespaces"] = ["*"]
    np = by_kind(plan(everyone, Observed(), SETTINGS, NOW))[("NetworkPolicy", "llama")]["spec"]
    assert {"namespaceSelector": {}} in np["ingress"][0]["from"]


def test_replicas_follow_the_autoscaler_within_bounds() -> None:
    for current, expected in ((3, 3), (9, 4), (0, 1)):
        observed = Observed(deployments={"primary": deployment_status(current, current)})
        assert by_kind(plan(example(), observed, SETTINGS, NOW))[("Deployment", "llama-primary")]["spec"][
            "replicas"] == expected
    fixed = example()
    fixed["spec"]["replicas"] = {"min": 2, "max": 2}
    p = plan(fixed, Observed(deployments={"primary": deployment_status(5, 5)}, owned=[
        ("HorizontalPodAutoscaler", "llama")]), SETTINGS, NOW)
    assert by_kind(p)[("Deployment", "llama-primary")]["spec"]["replicas"] == 2
    assert p.delete == [("HorizontalPodAutoscaler", "llama")]  # no autoscaler when min == max


def test_queued_gpr_limits_scaling_and_bursts() -> None:
    observed = Observed(deployments={"primary": deployment_status(3, 1)},
                        gprs={"primary": {"status": {"phase": "Queued", "queuePosition": 2,
                                                     "estimatedStart": "2026-11-30T12:20:00Z"}}})
    p = plan(example(), observed, SETTINGS, NOW)
    objs = by_kind(p)
    assert objs[("Deployment", "llama-burst")]["spec"]["replicas"] == 2  # what the primary lacks
    burst_gpr = objs[("GPUProvisioningRequest", "llama-burst")]["spec"]
    assert burst_gpr["priority"] == 50 and burst_gpr["preemptible"] is True and burst_gpr["nodeCount"] == 2
    conds = {c["type"]: c for c in p.status["conditions"]}
    assert conds["ScalingLimited"]["status"] == "True" and conds["ScalingLimited"]["reason"] == "GPRQueued"
    assert "position 2" in conds["ScalingLimited"]["message"] and "2026-11-30T12:20:00Z" in conds["ScalingLimited"][
        "message"]
    assert conds["Bursting"]["status"] == "True" and "Queued" in conds["Bursting"]["message"]
    assert conds["Degraded"]["status"] == "True" and conds["Ready"]["status"] == "True"
    assert p.status["estimatedStart"] == "2026-11-30T12:20:00Z"
    assert p.status["pools"]["burst"]["desiredReplicas"] == 2
    reasons = [e[1] for e in p.events]
    assert "PrimarySaturated" in reasons and "GPRQueued" in reasons


def test_saturated_at_max_bursts_and_idle_does_not() -> None:
    hpa: Any = {"status": {"currentMetrics": [{"type": "Pods", "pods": {"metric": {"name": INFLIGHT_METRIC},
                                                                    "current": {"averageValue": "12"}}}],
                      "conditions": [{"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
                                      "message": "the desired replica count is more than the maximum"}]}}
    observed = Observed(deployments={"primary": deployment_status(4, 4)}, hpa=hpa,
                        gprs={"primary": {"status": {"phase": "Running"}}},
                        growth={k: gpr_status("Running", 1) for k in (2, 3, 4)})
    p = plan(example(), observed, SETTINGS, NOW)
    assert by_kind(p)[("Deployment", "llama-burst")]["spec"]["replicas"] == 2  # ceil(4*12/8) - 4 = 2
    conds = {c["type"]: c for c in p.status["conditions"]}
    assert conds["ScalingLimited"]["reason"] == "AtMaxReplicas"
    assert p.status["load"] == {"inflightPerReplica": "12"}
    hpa["status"]["currentMetrics"][0]["pods"]["current"]["averageValue"] = "7500m"
    p = plan(example(), observed, SETTINGS, NOW)
    assert by_kind(p)[("Deployment", "llama-burst")]["spec"]["replicas"] == 0


def test_burst_gpr_stays_while_burst_pods_drain() -> None:
    observed = Observed(deployments={"primary": deployment_status(2, 2), "burst": deployment_status(1, 1)},
                        gprs={"primary": {"status": {"phase": "Running"}}},
                        owned=[("GPUProvisioningRequest", "llama-burst")])
    p = plan(example(), observed, SETTINGS, NOW)
    assert ("GPUProvisioningRequest", "llama-burst") in by_kind(p) and p.delete == []
    # scaled to 0: the ReplicaSet no longer counts its pod, which is still terminating on the GPR's node
    observed.deployments["burst"] = deployment_status(0, 0)
    draining = pod("llama-burst-abc", "n9", terminating=True)
    draining["metadata"]["labels"] = {LABEL_ENDPOINT: "llama", LABEL_POOL: "burst"}
    observed.pods = [draining]
    p = plan(example(), observed, SETTINGS, NOW)
    assert ("GPUProvisioningRequest", "llama-burst") in by_kind(p) and p.delete == []
    observed.pods = []  # gone: now the GPR goes
    p = plan(example(), observed, SETTINGS, NOW)
    assert p.delete == [("GPUProvisioningRequest", "llama-burst")]


def test_burst_removed_from_spec_deletes_its_objects() -> None:
    ep = example()
    del ep["spec"]["burst"]
    owned = [("Deployment", "llama-burst"), ("Service", "llama-burst"), ("Deployment", "llama-primary")]
    p = plan(ep, Observed(owned=owned), SETTINGS, NOW)
    assert p.delete == [("Deployment", "llama-burst"), ("Service", "llama-burst")]
    assert "burst" not in p.status["pools"]


def node(name: str, condition: str | None = None, taint: bool = False) -> dict[str, Any]:
    conds = [{"type": "Ready", "status": "True"}]
    if condition:
        conds.append({"type": condition, "status": "True", "message": "XID 79 on GPU 2"})
    return {"metadata": {"name": name}, "status": {"conditions": conds},
            "spec": {"taints": [{"key": "accelstack.io/unhealthy", "effect": "NoSchedule"}] if taint else []}}


def pod(name: str, node_name: str, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "team-a"}
    if terminating:
        meta["deletionTimestamp"] = NOW
    return {"metadata": meta, "spec": {"nodeName": node_name}}


def test_replicas_on_unhealthy_nodes_are_replaced() -> None:
    nodes = {"good": node("good"), "xid": node("xid", "GPUUnhealthy"), "nr1": node("nr1", "NR1Unhealthy"),
             "tainted": node("tainted", taint=True)}
    pods = [pod("a", "good"), pod("b", "xid"), pod("c", "nr1"), pod("d", "tainted"), pod("e", "xid", terminating=True)]
    p = plan(example(), Observed(pods=pods, nodes=nodes), SETTINGS, NOW)
    assert [name for name, _ in p.replace_pods] == ["b", "c", "d"]
    assert "GPUUnhealthy: XID 79 on GPU 2" in p.replace_pods[0][1]
    assert sum(1 for e in p.events if e[1] == "ReplicaReplaced") == 3
    conds = {c["type"]: c for c in p.status["conditions"]}
    assert conds["Degraded"]["status"] == "True" and "unhealthy nodes" in conds["Degraded"]["message"]
    assert node_problem(node("x", "GPUUnhealthy")).startswith("GPUUnhealthy")
    assert node_problem(None) == "" and node_problem(node("ok")) == ""


@pytest.mark.parametrize(("mutate", "reason", "message"), [
    (lambda s: s.pop("template"), "InvalidSpec", "spec.template.image is required"),
    (lambda s: s.update(replicas={"min": 3, "max": 1}), "InvalidSpec", "1 <= min <= max"),
    (lambda s: s.update(accelerator={"resource": "amd.com/gpu"}), "InvalidSpec", "accelerator.resource"),
    (lambda s: s.update(gpr={"template": "serving"}), "GPRTemplateNotFound", "GPRTemplate team-a/serving"),
    ("long-name", "InvalidSpec", "metadata.name: at most 51 characters for replicas.max 4"),
])
def test_bad_specs_create_nothing_and_say_why(mutate: Any, reason: str, message: str) -> None:
    ep = example()
    if mutate == "long-name":  # an autoscaled endpoint's pods name <name>-primary-new: a label value, <= 63
        ep["metadata"]["name"] = "x" * 52
    else:
        mutate(ep["spec"])
    p = plan(ep, Observed(), SETTINGS, NOW)
    assert p.apply == [] and p.delete == []
    ready = next(c for c in p.status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == reason and message in ready["message"]
    assert p.events and p.events[0][:2] == ("Warning", reason)


def test_gpr_template_shapes_the_gpr() -> None:
    ep = example()
    ep["spec"]["gpr"] = {"template": "serving", "preemptible": False}
    template = {"spec": {"priority": 150, "preemptible": True, "models": ["H100"], "exitDuration": "8h"}}
    g = by_kind(plan(ep, Observed(gpr_template=template), SETTINGS, NOW))[("GPUProvisioningRequest", "llama-primary")]
    assert g["spec"] == {"priority": 150, "preemptible": True, "models": ["H100"], "resource": "nvidia.com/gpu",
                         "devicesPerNode": 1, "nodeCount": 1}


def test_level_triggered_second_pass_is_quiet_and_keeps_transition_times() -> None:
    ep = example()
    observed = Observed(deployments={"primary": deployment_status(3, 1)}, gprs={"primary": {"status": {"phase": "Queued"}}})
    first = plan(ep, observed, SETTINGS, NOW)
    assert first.events
    ep2 = copy.deepcopy(ep)
    ep2["status"] = first.status
    second = plan(ep2, observed, SETTINGS, "2026-11-30T12:05:00Z")
    assert second.events == [] and second.apply == first.apply
    assert [c["lastTransitionTime"] for c in second.status["conditions"]] == [NOW] * 5
    assert second.status["observedGeneration"] == 3


def gpr_status(phase: str, node_count: int) -> dict[str, Any]:
    return {"spec": {"nodeCount": node_count}, "status": {"phase": phase}}


def test_the_primary_gpr_asks_for_the_minimum_and_each_added_replica_gets_a_gpr_of_its_own() -> None:
    """Issue 35.6b: a GPR is admitted whole and an admitted one is never grown, so one GPR for the count (4 of 4
    nodes, one unhealthy) started nothing, and one admitted for 1 held the endpoint at 1 replica for good. Now
    <name>-primary asks for replicas.min and every replica the autoscaler adds has a one-node GPR of its own."""
    p = plan(example(), Observed(), SETTINGS, NOW)
    objs = by_kind(p)
    assert objs[("GPUProvisioningRequest", "llama-primary")]["spec"]["nodeCount"] == 1
    assert not [k for k in objs if k[1].startswith("llama-primary-")]
    assert p.status["pools"]["primary"]["gprNodes"] == 1
    # the autoscaler asks for 4 with the base admitted: replicas 2, 3 and 4 get a GPR each, shaped like the base
    observed = Observed(deployments={"primary": deployment_status(4, 1)}, gprs={"primary": gpr_status("Running", 1)})
    p = plan(example(), observed, SETTINGS, NOW)
    objs = by_kind(p)
    base = objs[("GPUProvisioningRequest", "llama-primary")]["spec"]
    assert base["nodeCount"] == 1  # never resized under its running replica
    for k in (2, 3, 4):
        grown = objs[("GPUProvisioningRequest", f"llama-primary-{k}")]
        assert grown["spec"] == {**base, "nodeCount": 1}
        assert grown["metadata"]["labels"]["accelstack.io/pool"] == "primary"
        assert grown["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert p.status["pools"]["primary"]["gprNodes"] == 4
    assert (p.status["pools"]["primary"]["admittedReplicas"], p.status["pools"]["primary"]["waitingReplicas"]) == (1, 3)
    # an admitted GPR stored bigger (made before growth GPRs) keeps its size; only the rest is added
    p = plan(example(), Observed(deployments={"primary": deployment_status(4, 2)},
                                 gprs={"primary": gpr_status("Running", 2)}), SETTINGS, NOW)
    assert [k[1] for k in by_kind(p) if k[1].startswith("llama-primary-")] == ["llama-primary-3", "llama-primary-4"]
    assert by_kind(p)[("GPUProvisioningRequest", "llama-primary")]["spec"]["nodeCount"] == 2
    # no autoscaler (min == max): one GPR for the count, pods name it directly, as before
    fixed = example()
    fixed["spec"]["replicas"] = {"min": 2, "max": 2}
    objs = by_kind(plan(fixed, Observed(), SETTINGS, NOW))
    assert objs[("GPUProvisioningRequest", "llama-primary")]["spec"]["nodeCount"] == 2
    assert objs[("Deployment", "llama-primary")]["spec"]["template"]["metadata"]["labels"][GPR_LABEL] == \
        "llama-primary"


def gated_pod(name: str, gpr: str, created: str = "2026-11-30T11:00:00Z") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a", "creationTimestamp": created,
                         "labels": {LABEL_ENDPOINT: "llama", LABEL_POOL: "primary", GPR_LABEL: gpr}},
            "spec": {"schedulingGates": [{"name": "accelstack.io/gpr"}]}}


def placed_pod(name: str, gpr: str, node_name: str = "n1", terminating: bool = False) -> dict[str, Any]:
    p = gated_pod(name, gpr)
    p["spec"] = {"nodeName": node_name}
    if terminating:
        p["metadata"]["deletionTimestamp"] = NOW
    return p


def queued(reason: str, message: str = "") -> dict[str, Any]:
    return {"spec": {"nodeCount": 1}, "status": {"phase": "Queued", "reason": reason, "message": message,
                                                 "estimatedStart": "2026-11-30T13:00:00Z"}}


def test_new_pods_go_to_admitted_replica_gprs_first_and_running_ones_never_move() -> None:
    """4 asked, 3 nodes healthy: the base and replicas 2 and 3 are admitted, 4 waits (Unschedulable). The pods at
    the gate go to the admitted GPRs with room (the one running stays where it is); the fourth waits on GPR 4, and
    the endpoint says 3 of 4 admitted and why the fourth waits."""
    observed = Observed(
        deployments={"primary": deployment_status(4, 1)}, gprs={"primary": gpr_status("Running", 1)},
        growth={2: gpr_status("Admitted", 1), 3: gpr_status("Admitted", 1),
                4: queued("Unschedulable", "too big for the healthy cluster")},
        pods=[placed_pod("run-1", "llama-primary"), gated_pod("new-b", "llama-primary-new", "2026-11-30T11:02:00Z"),
              gated_pod("new-a", "llama-primary-new", "2026-11-30T11:01:00Z"),
              gated_pod("new-c", "llama-primary-new", "2026-11-30T11:03:00Z")])
    p = plan(example(), observed, SETTINGS, NOW)
    gate = ["accelstack.io/gpr"]
    assert p.assign == [("new-a", "llama-primary-new", "llama-primary-2", gate, "-2"),
                        ("new-b", "llama-primary-new", "llama-primary-3", gate, "-3"),
                        ("new-c", "llama-primary-new", "llama-primary-4", gate, "-4")]
    pool = p.status["pools"]["primary"]
    assert (pool["admittedReplicas"], pool["waitingReplicas"], pool["waitingReason"]) == (3, 1, "Unschedulable")
    limited = next(c for c in p.status["conditions"] if c["type"] == "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "GrowthQueued")
    assert limited["message"].startswith("3 of 4 replicas admitted; 1 wait for their GPR: llama-primary-4 is Queued "
                                         "(Unschedulable): too big")
    assert p.status["estimatedStart"] == "2026-11-30T13:00:00Z"
    assert ("Warning", "GrowthQueued", limited["message"]) in p.events
    assert p.delete == []
    # the next pass, with the pods relabelled: nothing moves, nothing is made or deleted
    observed.pods = [placed_pod("run-1", "llama-primary"), gated_pod("new-a", "llama-primary-2"),
                     gated_pod("new-b", "llama-primary-3"), gated_pod("new-c", "llama-primary-4")]
    p = plan(example(), observed, SETTINGS, NOW)
    assert p.assign == [] and p.delete == []
    # GPR 3 admitted elsewhere but its pod went (replaced): a waiting pod on the queued GPR 4 moves to GPR 3
    observed.pods = [placed_pod("run-1", "llama-primary"), placed_pod("new-a", "llama-primary-2"),
                     gated_pod("new-c", "llama-primary-4")]
    observed.deployments["primary"] = deployment_status(3, 2)
    p = plan(example(), observed, SETTINGS, NOW)
    assert p.assign == [("new-c", "llama-primary-4", "llama-primary-3", gate, "-3")]
    assert p.delete == []  # GPR 4 keeps its gated pod until the move lands; the next pass releases it


def test_scaling_down_releases_the_gprs_left_without_a_pod_and_never_one_with_a_pod() -> None:
    owned = [("GPUProvisioningRequest", n) for n in ("llama-primary", "llama-primary-2", "llama-primary-3",
                                                      "llama-primary-4")]
    growth = {k: gpr_status("Running", 1) for k in (2, 3, 4)}
    # 4 -> 2: the ReplicaSet took the pods of 4 (gone) and 3 (still terminating: its GPR stays until it is gone)
    pods = [placed_pod("a", "llama-primary"), placed_pod("b", "llama-primary-2"),
            placed_pod("c", "llama-primary-3", terminating=True)]
    observed = Observed(deployments={"primary": deployment_status(2, 2)}, gprs={"primary": gpr_status("Running", 1)},
                        growth=growth, pods=pods, owned=owned)
    p = plan(example(), observed, SETTINGS, NOW)
    assert p.delete == [("GPUProvisioningRequest", "llama-primary-4")]
    assert ("GPUProvisioningRequest", "llama-primary-3") in by_kind(p)
    assert p.status["pools"]["primary"]["gprNodes"] == 2
    # its pod gone: released too
    observed.pods = pods[:2]
    p = plan(example(), observed, SETTINGS, NOW)
    assert sorted(p.delete) == [("GPUProvisioningRequest", "llama-primary-3"), ("GPUProvisioningRequest",
                                                                                 "llama-primary-4")]
    # the ReplicaSet removed another replica than the last one (a not-ready pod goes first): the GPR with a pod
    # stays, the empty one goes, whatever their numbers
    observed.pods = [placed_pod("a", "llama-primary"), placed_pod("d", "llama-primary-4")]
    p = plan(example(), observed, SETTINGS, NOW)
    assert sorted(p.delete) == [("GPUProvisioningRequest", "llama-primary-2"), ("GPUProvisioningRequest",
                                                                                 "llama-primary-3")]
    # more pods than the count for a moment (the ReplicaSet has not removed them yet): none of their GPRs goes
    observed.deployments["primary"] = deployment_status(1, 1)
    observed.pods = [placed_pod("a", "llama-primary"), placed_pod("b", "llama-primary-2"),
                     placed_pod("d", "llama-primary-4")]
    p = plan(example(), observed, SETTINGS, NOW)
    assert p.delete == [("GPUProvisioningRequest", "llama-primary-3")]


def test_a_new_replica_gpr_takes_the_lowest_free_number_and_an_ended_one_is_renewed() -> None:
    observed = Observed(deployments={"primary": deployment_status(4, 3)}, gprs={"primary": gpr_status("Running", 1)},
                        growth={3: gpr_status("Running", 1),
                                2: {"spec": {"nodeCount": 1}, "status": {"phase": "Complete"}}},
                        pods=[placed_pod("a", "llama-primary"), placed_pod("c", "llama-primary-3")],
                        owned=[("GPUProvisioningRequest", "llama-primary-2"),
                               ("GPUProvisioningRequest", "llama-primary-3")])
    p = plan(example(), observed, SETTINGS, NOW)
    made = sorted(k[1] for k in by_kind(p) if k[1].startswith("llama-primary-"))
    assert made == ["llama-primary-3", "llama-primary-4", "llama-primary-5"]  # 2 is deleted and made again later
    assert p.delete == [("GPUProvisioningRequest", "llama-primary-2")]
    assert ("Normal", "GPRRenewed", "GPR llama-primary-2 is Complete; deleted, a new one is made") in p.events


def test_a_queued_replica_gpr_bursts_what_the_primary_lacks() -> None:
    observed = Observed(deployments={"primary": deployment_status(3, 1)}, gprs={"primary": gpr_status("Running", 1)},
                        growth={2: queued("InsufficientCapacity"), 3: queued("InsufficientCapacity")})
    p = plan(example(), observed, SETTINGS, NOW)
    assert by_kind(p)[("Deployment", "llama-burst")]["spec"]["replicas"] == 2
    bursting = next(c for c in p.status["conditions"] if c["type"] == "Bursting")
    assert bursting["status"] == "True" and "llama-primary-2" in bursting["message"]


def hpa_active(status: str, reason: str, message: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
                                      {"type": "ScalingActive", "status": status, "reason": reason,
                                       "message": message}]}}


def test_autoscaling_that_cannot_read_its_metric_says_so_with_the_fix() -> None:
    """Issue 37.5: the HPA controller's ScalingActive=False (no custom-metrics API) reaches the endpoint's status
    as the Autoscaling condition with the HPA's reason and the fix, plus one Warning event."""
    said = ('the HPA was unable to compute the replica count: unable to get metric accelstack_gateway_replica_inflight: '
            'unable to fetch metrics from custom metrics API: the server could not find the metric '
            'accelstack_gateway_replica_inflight for pods (get pods.custom.metrics.k8s.io *)')
    ep = example()
    p = plan(ep, Observed(hpa=hpa_active("False", "FailedGetPodsMetric", said)), SETTINGS, NOW)
    auto = next(c for c in p.status["conditions"] if c["type"] == "Autoscaling")
    assert (auto["status"], auto["reason"]) == ("False", "FailedGetPodsMetric")
    assert "Prometheus Adapter" in auto["message"] and "manifests/inference/prometheus-adapter.yaml" in auto[
        "message"] and said in auto["message"]
    assert ("Warning", "FailedGetPodsMetric", auto["message"]) in p.events
    ep["status"] = p.status  # the next pass: nothing new to say
    again = plan(ep, Observed(hpa=hpa_active("False", "FailedGetPodsMetric", said)), SETTINGS, NOW)
    assert not [e for e in again.events if e[1] == "FailedGetPodsMetric"]

    def autoscaling(endpoint: dict[str, Any], observed: Observed) -> tuple[str, str]:
        c = next(c for c in plan(endpoint, observed, SETTINGS, NOW).status["conditions"] if c["type"] == "Autoscaling")
        return c["status"], c["reason"]

    assert autoscaling(example(), Observed(hpa=hpa_active("True", "ValidMetricFound", "ok"))) == ("True", "Active")
    assert autoscaling(example(), Observed()) == ("Unknown", "AutoscalerPending")
    fixed = example()
    fixed["spec"]["replicas"] = {"min": 2, "max": 2}
    assert autoscaling(fixed, Observed()) == ("False", "Disabled")
