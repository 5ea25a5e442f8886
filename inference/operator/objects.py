"""The objects an InferenceEndpoint stands for, as plain dicts. Pure: the endpoint and what is observed go in.

Per endpoint ``<name>`` in its namespace:

- per pool (``primary``; ``burst`` when the spec has one): a Deployment ``<name>-<pool>`` whose pods ask for the
  accelerator with a plain resource limit (so they pass the admission webhook, wait in the GPR queue and are bound
  by the extender like any other workload) and carry ``accelstack.io/gpr: <name>-<pool>``; a Service
  ``<name>-<pool>`` (its labels reach the EndpointSlices the gateway watches); a GPR ``<name>-<pool>``: the
  primary's for ``replicas.min`` nodes (so an endpoint starts with what fits), plus one GPR ``<name>-primary-<k>``
  of one node per replica the autoscaler adds (``k`` > ``replicas.min``, see :mod:`decide`); the burst pool's for
  its maximum, and only while it bursts. An autoscaled primary pool's pods are created naming no GPR that exists
  (``<name>-primary-new``): they stay at the gate until the operator gives each the GPR of a free replica slot;
- a PodDisruptionBudget ``<name>`` (one replica down at a time), a NetworkPolicy ``<name>`` (the gateway, the
  endpoint's namespace, the namespaces in ``spec.access`` and metrics scrapers reach the replicas' port; no one
  else), and, when ``replicas.max > replicas.min``, a HorizontalPodAutoscaler ``<name>`` on the gateway's per-pod
  in-flight metric (and the model's queue wait, when asked).

Every object carries an owner reference to the endpoint (controller: true), so deleting the endpoint deletes
them (Kubernetes' garbage collector); none lives outside the namespace, so no finalizer is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inference.names import (
    GROUP,
    KIND,
    LABEL_ENDPOINT,
    LABEL_POOL,
    POOL_BURST,
    POOL_PRIMARY,
    PORT_NAME,
    VERSION,
)

MANAGED_BY = "accelstack-inference-operator"
GPR_LABEL = "accelstack.io/gpr"
SCHEDULER_NAME = "accelstack-scheduler"
INFLIGHT_METRIC = "accelstack_gateway_replica_inflight"
QUEUE_METRIC = "accelstack_gateway_queue_wait_seconds"  # External metric served by the Prometheus Adapter rule
CONTAINER = "runtime"
SCHEDULING_GATE = "accelstack.io/gpr"  # the gate the webhook adds (same name as the label)
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"  # the ReplicaSet removes the lowest first
UNASSIGNED = "new"  # <name>-primary-new: what an autoscaled pool's new pods name until they get a replica's GPR


@dataclass(frozen=True)
class OperatorSettings:
    gateway_namespace: str = "accelstack-system"
    gateway_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "accelstack-gateway"),)
    gateway_url: str = "http://accelstack-gateway.accelstack-system.svc/v1"
    scraper_label: str = "accelstack.io/metrics-scraper"
    scheduler_name: str = SCHEDULER_NAME


def owner_ref(endpoint: dict[str, Any]) -> dict[str, Any]:
    meta = endpoint["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta.get("uid", ""),
            "controller": True, "blockOwnerDeletion": True}


def child_name(endpoint: dict[str, Any], pool: str | None = None) -> str:
    name: str = endpoint["metadata"]["name"]
    return f"{name}-{pool}" if pool else name


def labels(endpoint: dict[str, Any], pool: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": endpoint["metadata"]["name"], "app.kubernetes.io/component": "inference",
           "app.kubernetes.io/managed-by": MANAGED_BY, LABEL_ENDPOINT: endpoint["metadata"]["name"]}
    if pool:
        out[LABEL_POOL] = pool
    return out


def _meta(endpoint: dict[str, Any], name: str, pool: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": endpoint["metadata"]["namespace"], "labels": labels(endpoint, pool),
            "ownerReferences": [owner_ref(endpoint)]}


def growth_name(endpoint: dict[str, Any], index: int) -> str:
    """The GPR of the primary pool's replica number ``index`` (> ``replicas.min``): ``<name>-primary-<index>``."""
    return f"{child_name(endpoint, POOL_PRIMARY)}-{index}"


def growth_index(endpoint: dict[str, Any], name: str) -> int | None:
    """``index`` when ``name`` is :func:`growth_name` of it, else None."""
    prefix = f"{child_name(endpoint, POOL_PRIMARY)}-"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() and not tail.startswith("0") else None


def autoscaled(spec: dict[str, Any]) -> bool:
    replicas = spec.get("replicas") or {}
    return int(replicas.get("max", 1)) > int(replicas.get("min", 1))


def pod_gpr(endpoint: dict[str, Any], pool: str) -> str:
    """The GPR the pool's pod template names: the pool's own, but for an autoscaled primary pool a name no GPR has
    (``<name>-primary-new``): the webhook keeps such a pod at the gate (a GPR of that name does not exist), so the
    controller cannot lift the gate before the operator has given the pod the GPR of a free replica slot. (Named
    after an admitted GPR that is full, a new pod would be released onto that GPR's nodes and never bind.)"""
    if pool == POOL_PRIMARY and autoscaled(endpoint["spec"]):
        return f"{child_name(endpoint, pool)}-{UNASSIGNED}"
    return child_name(endpoint, pool)


def pool_accelerator(spec: dict[str, Any], pool: str) -> dict[str, Any]:
    accel = (spec.get("burst") or {}).get("accelerator") if pool == POOL_BURST else spec.get("accelerator")
    accel = accel or {}
    return {"resource": accel.get("resource", "nvidia.com/gpu"), "count": int(accel.get("count", 1))}


def pool_max(spec: dict[str, Any], pool: str) -> int:
    if pool == POOL_BURST:
        return int((spec.get("burst") or {}).get("maxReplicas", 0))
    return int((spec.get("replicas") or {}).get("max", 1))


def deployment(endpoint: dict[str, Any], pool: str, replicas: int, settings: OperatorSettings) -> dict[str, Any]:
    spec = endpoint["spec"]
    tpl = spec["template"]
    accel = pool_accelerator(spec, pool)
    resources: dict[str, Any] = {k: dict(v) for k, v in (tpl.get("resources") or {}).items() if v}
    resources.setdefault("limits", {})[accel["resource"]] = str(accel["count"])
    port = int(tpl.get("port", 8000))
    container: dict[str, Any] = {"name": CONTAINER, "image": tpl["image"],
                                 "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
                                 "resources": resources}
    for key in ("command", "args", "env", "readinessProbe", "livenessProbe", "startupProbe"):
        if tpl.get(key):
            container[key] = tpl[key]
    pod_labels = {**labels(endpoint, pool), GPR_LABEL: pod_gpr(endpoint, pool)}
    pod_spec: dict[str, Any] = {"schedulerName": settings.scheduler_name, "containers": [container],
                                "enableServiceLinks": False,
                                "automountServiceAccountToken": bool(tpl.get("serviceAccountName"))}
    for key in ("serviceAccountName", "runtimeClassName", "nodeSelector", "tolerations"):
        if tpl.get(key):
            pod_spec[key] = tpl[key]
    burst = spec.get("burst") or {}
    if pool == POOL_BURST and burst.get("priorityClassName"):
        pod_spec["priorityClassName"] = burst["priorityClassName"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(endpoint, child_name(endpoint, pool), pool),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {LABEL_ENDPOINT: endpoint["metadata"]["name"], LABEL_POOL: pool}},
            # the pool's GPRs hold devices for its count only: a rollout must not add a pod above the count
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def service(endpoint: dict[str, Any], pool: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(endpoint, child_name(endpoint, pool), pool),
            "spec": {"type": "ClusterIP",
                     "selector": {LABEL_ENDPOINT: endpoint["metadata"]["name"], LABEL_POOL: pool},
                     "ports": [{"name": PORT_NAME, "port": int(endpoint["spec"]["template"].get("port", 8000)),
                                "targetPort": PORT_NAME, "protocol": "TCP"}]}}


def gpr(endpoint: dict[str, Any], pool: str, template_spec: dict[str, Any] | None = None,
        exit_duration: str | None = None, node_count: int | None = None, index: int | None = None) -> dict[str, Any]:
    """The pool's GPR: ``nodeCount`` = ``node_count`` (the replicas the GPR holds, see :mod:`decide`; the pool's
    maximum when None), ``devicesPerNode`` = the accelerator count. ``index``: the GPR of that one replica of the
    primary pool (:func:`growth_name`), shaped like the pool's own.

    ``exit_duration``: the longest run the endpoint's workspace allows (its ``spec.policy.maxExitDuration``), which
    the GPR webhook requires there; None elsewhere (a service runs until the endpoint is deleted). A GPR that
    reaches it completes and the operator makes a new one (see :mod:`decide`)."""
    spec = endpoint["spec"]
    choice = spec.get("gpr") or {}
    accel = pool_accelerator(spec, pool)
    body: dict[str, Any] = dict(template_spec or {})
    body.update({"resource": accel["resource"], "devicesPerNode": accel["count"],
                 "nodeCount": node_count or pool_max(spec, pool)})
    body.pop("milliPerDevice", None)
    if pool == POOL_BURST:
        burst = spec.get("burst") or {}
        body["priority"] = int(burst.get("gprPriority") or choice.get("priority") or body.get("priority") or 100)
        body["preemptible"] = True
    else:
        if choice.get("priority") is not None:
            body["priority"] = int(choice["priority"])
        body.setdefault("priority", 100)
        if template_spec is None or "preemptible" not in template_spec:
            body["preemptible"] = bool(choice.get("preemptible", False))
    for key in ("exitDuration", "idleTimeout", "enforceIdleTimeout"):
        body.pop(key, None)  # a service runs until the endpoint is deleted
    if exit_duration:
        body["exitDuration"] = exit_duration
    name = growth_name(endpoint, index) if index is not None else child_name(endpoint, pool)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUProvisioningRequest",
            "metadata": _meta(endpoint, name, pool), "spec": body}


def pdb(endpoint: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(endpoint, child_name(endpoint)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {LABEL_ENDPOINT: endpoint["metadata"]["name"]}}}}


def network_policy(endpoint: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    namespaces = sorted((endpoint["spec"].get("access") or {}).get("namespaces") or [])
    port = [{"protocol": "TCP", "port": PORT_NAME}]
    peers: list[dict[str, Any]] = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.gateway_namespace}},
         "podSelector": {"matchLabels": dict(settings.gateway_labels)}},
        {"podSelector": {}},  # the endpoint's own namespace
        {"namespaceSelector": {"matchLabels": {settings.scraper_label: "true"}}},
    ]
    if "*" in namespaces:
        peers.append({"namespaceSelector": {}})
    elif namespaces:
        peers.append({"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}]}})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(endpoint, child_name(endpoint)),
            "spec": {"podSelector": {"matchLabels": {LABEL_ENDPOINT: endpoint["metadata"]["name"]}},
                     "policyTypes": ["Ingress"], "ingress": [{"from": peers, "ports": port}]}}


def hpa(endpoint: dict[str, Any]) -> dict[str, Any] | None:
    spec = endpoint["spec"]
    replicas = spec.get("replicas") or {}
    low, high = int(replicas.get("min", 1)), int(replicas.get("max", 1))
    if high <= low:
        return None
    scaling = spec.get("autoscaling") or {}
    metrics: list[dict[str, Any]] = [{"type": "Pods", "pods": {
        "metric": {"name": INFLIGHT_METRIC},
        "target": {"type": "AverageValue", "averageValue": str(int(scaling.get("targetInflightPerReplica", 8)))}}}]
    if scaling.get("targetQueueSeconds"):
        metrics.append({"type": "External", "external": {
            "metric": {"name": QUEUE_METRIC, "selector": {"matchExpressions": [
                {"key": "model", "operator": "In", "values": sorted(spec["models"])}]}},
            "target": {"type": "Value", "value": _quantity(float(scaling["targetQueueSeconds"]))}}})
    up = int(scaling.get("scaleUpStabilizationSeconds", 0))
    down = int(scaling.get("scaleDownStabilizationSeconds", 300))
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(endpoint, child_name(endpoint)),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": child_name(endpoint, POOL_PRIMARY)},
                     "minReplicas": low, "maxReplicas": high, "metrics": metrics,
                     "behavior": {
                         "scaleUp": {"stabilizationWindowSeconds": up, "selectPolicy": "Max",
                                     "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15},
                                                  {"type": "Percent", "value": 100, "periodSeconds": 15}]},
                         "scaleDown": {"stabilizationWindowSeconds": down, "selectPolicy": "Min",
                                       "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}}}


def _quantity(seconds: float) -> str:
    """A Kubernetes quantity for seconds: whole numbers as they are, else milli-units (0.5 -> 500m)."""
    if float(seconds).is_integer():
        return str(int(seconds))
    return f"{math.ceil(seconds * 1000)}m"
