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
    assert pod["metadata"]["labels"][GPR_LABEL] == "llama-primary"
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
                        gprs={"primary": {"status": {"phase": "Running"}}})
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
    observed.deployments["burst"] = deployment_status(0, 0)
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
])
def test_bad_specs_create_nothing_and_say_why(mutate: Any, reason: str, message: str) -> None:
    ep = example()
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


def test_the_primary_gpr_asks_for_what_the_pool_runs_now_not_its_maximum() -> None:
    """Issue 35.6b: a GPR is admitted whole, so one for replicas.max (4) started nothing while one of 4 nodes was
    missing. It asks for replicas.min first, follows the autoscaler's count while queued, and an admitted one keeps
    its size (the GPR controller keeps its recorded reservation) with ScalingLimited saying what waits."""
    def primary_gpr(observed: Observed) -> tuple[int, Plan]:
        p = plan(example(), observed, SETTINGS, NOW)
        return by_kind(p)[("GPUProvisioningRequest", "llama-primary")]["spec"]["nodeCount"], p

    count, p = primary_gpr(Observed())
    assert count == 1 and p.status["pools"]["primary"]["gprNodes"] == 1
    queued = Observed(deployments={"primary": deployment_status(3, 0)}, gprs={"primary": gpr_status("Queued", 4)})
    assert primary_gpr(queued)[0] == 3  # still in the queue: resized to the autoscaler's count
    for phase in ("Admitted", "Running"):
        grown = Observed(deployments={"primary": deployment_status(3, 1)}, gprs={"primary": gpr_status(phase, 1)})
        count, p = primary_gpr(grown)
        assert count == 1 and p.status["pools"]["primary"] == {"desiredReplicas": 3, "readyReplicas": 1,
                                                               "gprNodes": 1, "gprPhase": phase}
        limited = next(c for c in p.status["conditions"] if c["type"] == "ScalingLimited")
        assert (limited["status"], limited["reason"]) == ("True", "GPRAdmittedSmaller")
        assert "asks for 3 replicas" in limited["message"] and "admitted for 1 node(s)" in limited["message"]
    # the autoscaler came back down: the admitted GPR is not shrunk under its running replicas either
    count, p = primary_gpr(Observed(deployments={"primary": deployment_status(1, 1)},
                                    gprs={"primary": gpr_status("Running", 2)}))
    assert count == 2
    assert next(c for c in p.status["conditions"] if c["type"] == "ScalingLimited")["status"] == "False"


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
