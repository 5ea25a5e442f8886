"""The CG operator's decisions for one InferenceEndpoint. Pure: the endpoint, what is observed and the time go in;
the objects to apply and delete, the replicas to replace, the status and the events come out.

Level-triggered: nothing here remembers a previous pass; the same world gives the same plan, so a restart (or a
second replica taking over) changes nothing.

- **Replicas**: with an autoscaler (``replicas.max > replicas.min``) the primary Deployment keeps the count the
  HPA set (clamped to min..max); without, it has ``replicas.min``.
- **Bursting**: the burst pool gets replicas only while the primary pool cannot serve what is asked of it: its
  GPR waits in the queue (``ScalingLimited``, with the queue's estimate), it has no ready replica at all, or the
  autoscaler is at its maximum with the metric still above target. Then as many burst replicas as the primary
  lacks (at least one), up to ``burst.maxReplicas``. The burst GPR exists while the burst pool has or wants pods.
- **Size of the primary GPR**: the replicas the pool asks for now (``replicas.min``, then the autoscaler's
  count), not ``replicas.max``: a GPR is admitted whole (all its nodes at once), so one sized for the maximum
  starts nothing while any one of those nodes is missing. A GPR still in the queue follows the count; an admitted
  one keeps the size it was admitted with (the GPR controller keeps an admitted GPR's recorded reservation, so
  a bigger ``nodeCount`` would not reserve more): replicas the autoscaler asks beyond it are reported
  (``ScalingLimited`` reason ``GPRAdmittedSmaller``) instead of being promised.
- **Autoscaling**: the ``Autoscaling`` condition carries the HPA controller's ``ScalingActive``; when it is False
  because a metric cannot be read (``FailedGet…Metric``: no custom or external metrics API answers), the reason is
  the HPA's and the message says the fix (the Prometheus Adapter, ``manifests/inference/prometheus-adapter.yaml``).
- **Health**: a replica on a node whose accelerators are unhealthy (condition ``GPUUnhealthy``/``NR1Unhealthy``
  True, or the ``accelstack.io/unhealthy`` taint) is deleted: it leaves the EndpointSlice (and the gateway's
  rotation) as it terminates, and its Deployment replaces it on a healthy node (the taint keeps it off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from inference.names import POOL_BURST, POOL_PRIMARY
from inference.operator import objects as o

UNHEALTHY_CONDITIONS = ("GPUUnhealthy", "NR1Unhealthy")
UNHEALTHY_TAINT = "accelstack.io/unhealthy"
ADMITTED_PHASES = ("Admitted", "Running")
ENDED_PHASES = ("Complete", "Cancelled")  # a GPR that will not come back: the operator makes a new one
CONDITION_TYPES = ("Ready", "Degraded", "Bursting", "ScalingLimited", "Autoscaling")
ADAPTER_FIX = ("no metrics API answers for it (custom.metrics.k8s.io / external.metrics.k8s.io): install the "
               "Prometheus Adapter (manifests/inference/prometheus-adapter.yaml) and check with "
               "`kubectl get --raw /apis/custom.metrics.k8s.io/v1beta1`")


@dataclass
class Observed:
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)  # pool -> Deployment
    gprs: dict[str, dict[str, Any]] = field(default_factory=dict)  # pool -> GPR
    hpa: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)  # the endpoint's pods
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    gpr_template: dict[str, Any] | None = None  # the GPRTemplate spec.gpr.template names, when found
    owned: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) of objects the endpoint owns now
    max_exit: str | None = None  # spec.policy.maxExitDuration of the workspace the endpoint's namespace is in


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    replace_pods: list[tuple[str, str]] = field(default_factory=list)  # (pod name, why)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def node_problem(node: dict[str, Any] | None) -> str:
    """Why a node's accelerators are unhealthy, or ''."""
    if not node:
        return ""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") in UNHEALTHY_CONDITIONS and cond.get("status") == "True":
            return f"{cond['type']}: {cond.get('message') or cond.get('reason') or 'True'}"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("key") == UNHEALTHY_TAINT:
            return f"taint {UNHEALTHY_TAINT}"
    return ""


def spec_problems(endpoint: dict[str, Any]) -> list[str]:
    """What the CRD's schema and CEL refuse, checked again (an object written before the CRD, or without it)."""
    spec = endpoint.get("spec")
    if not isinstance(spec, dict):
        return ["spec is missing"]
    problems = []
    if not spec.get("models") or not all(isinstance(m, str) and m for m in spec["models"]):
        problems.append("spec.models must list at least one model name")
    if not isinstance(spec.get("template"), dict) or not spec["template"].get("image"):
        problems.append("spec.template.image is required")
    accel = spec.get("accelerator")
    if not isinstance(accel, dict) or accel.get("resource") not in ("nvidia.com/gpu", "neureality.com/nr1"):
        problems.append("spec.accelerator.resource must be nvidia.com/gpu or neureality.com/nr1")
    replicas = spec.get("replicas") or {}
    try:
        if int(replicas.get("min", 1)) < 1 or int(replicas.get("min", 1)) > int(replicas.get("max", 1)):
            problems.append("spec.replicas: need 1 <= min <= max")
    except (TypeError, ValueError):
        problems.append("spec.replicas.min and .max must be integers")
    burst = spec.get("burst")
    if burst is not None and (not isinstance(burst, dict) or not burst.get("maxReplicas")
                              or not isinstance(burst.get("accelerator"), dict)):
        problems.append("spec.burst needs accelerator and maxReplicas")
    return problems


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def primary_replicas(endpoint: dict[str, Any], observed: Observed) -> int:
    replicas = endpoint["spec"].get("replicas") or {}
    low, high = _int(replicas.get("min", 1), 1), _int(replicas.get("max", 1), 1)
    if high <= low:
        return low
    current = observed.deployments.get(POOL_PRIMARY)
    count = _int(((current or {}).get("spec") or {}).get("replicas"), low)
    return max(low, min(high, count))


def _quantity(text: Any) -> float | None:
    """A Kubernetes quantity as a float ('8', '7500m', '1.5k'); None when it is not one."""
    if text is None:
        return None
    s = str(text)
    scale = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    try:
        if s and s[-1] in scale:
            return float(s[:-1]) * scale[s[-1]]
        return float(s)
    except ValueError:
        return None


def hpa_reading(hpa: dict[str, Any] | None) -> float | None:
    """The autoscaler's last average of the per-pod in-flight metric."""
    for metric in ((hpa or {}).get("status") or {}).get("currentMetrics") or []:
        if metric.get("type") == "Pods" and (metric.get("pods") or {}).get("metric", {}).get("name") == o.INFLIGHT_METRIC:
            return _quantity(metric["pods"].get("current", {}).get("averageValue"))
    return None


def gpr_nodes(observed: Observed, desired: int) -> int:
    """The primary GPR's ``nodeCount``: ``desired`` while it waits in the queue (or does not exist), the size it
    was admitted with once admitted (see the module's docstring)."""
    current = observed.gprs.get(POOL_PRIMARY) or {}
    if ((current.get("status") or {}).get("phase")) in (*ADMITTED_PHASES, "Evicting"):
        return _int((current.get("spec") or {}).get("nodeCount"), desired) or desired
    return desired


def autoscaling(endpoint: dict[str, Any], hpa: dict[str, Any] | None) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Autoscaling`` condition, from the HPA controller's ``ScalingActive``."""
    replicas = (endpoint.get("spec") or {}).get("replicas") or {}
    if _int(replicas.get("max", 1), 1) <= _int(replicas.get("min", 1), 1):
        return "False", "Disabled", "replicas.min equals replicas.max: no autoscaler"
    active = next((c for c in ((hpa or {}).get("status") or {}).get("conditions") or []
                   if c.get("type") == "ScalingActive"), None)
    if active is None:
        return "Unknown", "AutoscalerPending", "the HPA controller has not reported on the autoscaler yet"
    reason = str(active.get("reason") or "ScalingInactive")
    said = str(active.get("message") or "")
    if active.get("status") == "True":
        return "True", "Active", said
    if reason.startswith("FailedGet") and reason.endswith("Metric"):
        return "False", reason, f"the autoscaler cannot read its metric, {ADAPTER_FIX}. The HPA says: {said}"[:1000]
    return "False", reason, f"the HPA controller reports ScalingActive=False: {said}"[:1000]


def _ready(deployment: dict[str, Any] | None) -> int:
    return _int(((deployment or {}).get("status") or {}).get("readyReplicas"), 0)


def burst_replicas(endpoint: dict[str, Any], observed: Observed, desired: int) -> tuple[int, str]:
    """(burst replicas wanted, why) from the primary pool's state."""
    spec = endpoint["spec"]
    burst = spec.get("burst")
    if not burst:
        return 0, ""
    ceiling = _int(burst.get("maxReplicas"), 0)
    ready = _ready(observed.deployments.get(POOL_PRIMARY))
    phase = ((observed.gprs.get(POOL_PRIMARY) or {}).get("status") or {}).get("phase")
    if phase is not None and phase not in ADMITTED_PHASES:
        return min(ceiling, max(1, desired - ready)), f"the primary pool's GPR is {phase}"
    if ready == 0 and desired > 0 and phase is not None:
        return min(ceiling, desired), "the primary pool has no ready replica"
    high = _int((spec.get("replicas") or {}).get("max", 1), 1)
    target = _int((spec.get("autoscaling") or {}).get("targetInflightPerReplica", 8), 8)
    current = hpa_reading(observed.hpa)
    if desired >= high and current is not None and current > target and ready > 0:
        lacking = math.ceil(ready * current / target) - ready
        return min(ceiling, max(1, lacking)), (f"the primary pool is at its maximum of {high} with "
                                               f"{current:g} requests in flight per replica (target {target})")
    return 0, ""


def _condition(old: dict[str, dict[str, Any]], type_: str, status: bool | str, reason: str, message: str, now: str,
               generation: int) -> dict[str, Any]:
    value = status if isinstance(status, str) else ("True" if status else "False")
    previous = old.get(type_)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value and \
        previous.get("lastTransitionTime") else now
    return {"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": since,
            "observedGeneration": generation}


def refused(endpoint: dict[str, Any], status: dict[str, Any], why: str, now: str) -> tuple[dict[str, Any], bool]:
    """``status`` with ``Ready=False``, reason ``Refused`` and ``why`` (what the API server refused and its answer:
    a webhook's or a quota's message); and whether that is news (an Event is due)."""
    generation = _int((endpoint.get("metadata") or {}).get("generation"), 0)
    old = {str(c.get("type")): c for c in (endpoint.get("status") or {}).get("conditions") or []
           if isinstance(c, dict)}
    ready = _condition(old, "Ready", False, "Refused", why, now, generation)
    conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
    before = old.get("Ready") or {}
    return ({**status, "conditions": [ready, *conditions]},
            (before.get("reason"), before.get("message")) != ("Refused", why))


def plan(endpoint: dict[str, Any], observed: Observed, settings: o.OperatorSettings, now: str) -> Plan:
    result = Plan()
    meta = endpoint["metadata"]
    generation = _int(meta.get("generation"), 0)
    old: dict[str, dict[str, Any]] = {str(c.get("type")): c for c in (endpoint.get("status") or {}).get("conditions")
                                      or [] if isinstance(c, dict)}
    problems = spec_problems(endpoint)
    spec = endpoint.get("spec") or {}
    template_name = (spec.get("gpr") or {}).get("template") if isinstance(spec, dict) else None
    if not problems and template_name and observed.gpr_template is None:
        problems.append(f"GPRTemplate {meta['namespace']}/{template_name} (spec.gpr.template) does not exist")
    if problems:
        message = "; ".join(problems)
        reason = "GPRTemplateNotFound" if "GPRTemplate" in message else "InvalidSpec"
        result.status = {"observedGeneration": generation, "conditions": [
            _condition(old, "Ready", False, reason, message, now, generation),
            *[_condition(old, t, False, reason, "", now, generation) for t in CONDITION_TYPES[1:]]]}
        if (old.get("Ready") or {}).get("reason") != reason or (old.get("Ready") or {}).get("message") != message:
            result.events.append(("Warning", reason, message))
        return result

    template_spec = (observed.gpr_template or {}).get("spec") if template_name else None
    desired = primary_replicas(endpoint, observed)
    burst_wanted, burst_why = burst_replicas(endpoint, observed, desired)
    # the GPR before the Deployment, so its place in the queue is taken before the first pod is gated on it
    wanted: list[dict[str, Any]] = [
        o.gpr(endpoint, POOL_PRIMARY, template_spec, observed.max_exit, gpr_nodes(observed, desired)),
        o.deployment(endpoint, POOL_PRIMARY, desired, settings),
        o.service(endpoint, POOL_PRIMARY), o.pdb(endpoint), o.network_policy(endpoint, settings)]
    autoscaler = o.hpa(endpoint)
    if autoscaler is not None:
        wanted.append(autoscaler)
    burst_dep = observed.deployments.get(POOL_BURST)
    if spec.get("burst"):
        burst_pods = _int(((burst_dep or {}).get("status") or {}).get("replicas"), 0)
        if burst_wanted > 0 or burst_pods > 0:
            wanted.append(o.gpr(endpoint, POOL_BURST, template_spec, observed.max_exit))
        wanted += [o.deployment(endpoint, POOL_BURST, burst_wanted, settings), o.service(endpoint, POOL_BURST)]
    # a GPR that ended (its workspace's exitDuration reached, or cancelled) is deleted and made again next pass:
    # a service outlives any one GPR, and the new one takes its place in the queue
    ended = {o.child_name(endpoint, pool): phase for pool, g in observed.gprs.items()
             if (phase := (g.get("status") or {}).get("phase")) in ENDED_PHASES}
    result.apply = [obj for obj in wanted if not (obj["kind"] == "GPUProvisioningRequest"
                                                  and obj["metadata"]["name"] in ended)]
    keep = {(obj["kind"], obj["metadata"]["name"]) for obj in result.apply}
    result.delete = sorted(k for k in observed.owned if k not in keep)
    for name, phase in sorted(ended.items()):
        result.events.append(("Normal", "GPRRenewed", f"GPR {name} is {phase}; deleted, a new one is made"))

    # replicas on unhealthy nodes
    for pod in observed.pods:
        pmeta = pod.get("metadata") or {}
        if pmeta.get("deletionTimestamp"):
            continue
        node_name = (pod.get("spec") or {}).get("nodeName")
        why = node_problem(observed.nodes.get(node_name)) if node_name else ""
        if why:
            result.replace_pods.append((pmeta.get("name", ""), f"node {node_name}: {why}"))
            result.events.append(("Warning", "ReplicaReplaced",
                                  f"replica {pmeta.get('name')} on node {node_name} taken out of rotation and "
                                  f"replaced ({why})"))

    # status
    primary_dep = observed.deployments.get(POOL_PRIMARY)
    ready = _ready(primary_dep)
    burst_ready = _ready(burst_dep)
    primary_gpr = (observed.gprs.get(POOL_PRIMARY) or {}).get("status") or {}
    burst_gpr = (observed.gprs.get(POOL_BURST) or {}).get("status") or {}
    phase = primary_gpr.get("phase")
    estimated = primary_gpr.get("estimatedStart") if phase not in ADMITTED_PHASES else None
    at_max_reason = ""
    for cond in ((observed.hpa or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ScalingLimited" and cond.get("status") == "True":
            at_max_reason = cond.get("message") or cond.get("reason") or "the autoscaler is at a limit"
    if phase is not None and phase not in ADMITTED_PHASES:
        position = primary_gpr.get("queuePosition")
        limited = (True, "GPRQueued", f"GPR {o.child_name(endpoint, POOL_PRIMARY)} is {phase}"
                   + (f" at position {position}" if position else "")
                   + (f", estimated start {estimated}" if estimated else ""))
    elif desired > (held := gpr_nodes(observed, desired)):
        limited = (True, "GPRAdmittedSmaller",
                   f"the autoscaler asks for {desired} replicas; GPR {o.child_name(endpoint, POOL_PRIMARY)} was "
                   f"admitted for {held} node(s), so {desired - held} replica(s) wait for a node of it")
    elif at_max_reason:
        limited = (True, "AtMaxReplicas", at_max_reason)
    else:
        limited = (False, "WithinLimits", "")
    unhealthy = len(result.replace_pods)
    degraded_bits = []
    if ready < desired:
        degraded_bits.append(f"{ready} of {desired} primary replicas ready")
    if unhealthy:
        degraded_bits.append(f"{unhealthy} replica(s) on unhealthy nodes being replaced")
    serving = ready + burst_ready
    conditions = [
        _condition(old, "Ready", serving > 0, "Serving" if serving > 0 else "NoReadyReplica",
                   f"{ready} primary and {burst_ready} burst replicas ready" if serving else
                   "no replica is ready yet", now, generation),
        _condition(old, "Degraded", bool(degraded_bits), "ReplicasUnavailable" if degraded_bits else "AllReady",
                   "; ".join(degraded_bits), now, generation),
        _condition(old, "Bursting", burst_wanted > 0 or burst_ready > 0,
                   "PrimarySaturated" if burst_wanted > 0 else ("Draining" if burst_ready else "NotBursting"),
                   burst_why, now, generation),
        _condition(old, "ScalingLimited", limited[0], limited[1], limited[2], now, generation),
        _condition(old, "Autoscaling", *autoscaling(endpoint, observed.hpa), now, generation),
    ]
    for cond in conditions:
        before = old.get(cond["type"])
        if before is None or before.get("status") != cond["status"]:
            if cond["type"] in ("Bursting", "ScalingLimited") and cond["status"] == "True":
                result.events.append(("Normal" if cond["type"] == "Bursting" else "Warning", cond["reason"],
                                      cond["message"]))
            elif cond["type"] == "Autoscaling" and cond["status"] == "False" and cond["reason"] != "Disabled":
                result.events.append(("Warning", cond["reason"], cond["message"]))
            elif cond["type"] == "Bursting" and before is not None:
                result.events.append(("Normal", "BurstEnded", "the primary pool serves the load again"))
    status: dict[str, Any] = {
        "observedGeneration": generation, "url": settings.gateway_url,
        "pools": {POOL_PRIMARY: {"desiredReplicas": desired, "readyReplicas": ready,
                                 "gprNodes": gpr_nodes(observed, desired),
                                 **({"gprPhase": phase} if phase else {})}},
        "conditions": conditions}
    if spec.get("burst"):
        status["pools"][POOL_BURST] = {"desiredReplicas": burst_wanted, "readyReplicas": burst_ready,
                                       **({"gprPhase": burst_gpr["phase"]} if burst_gpr.get("phase") else {})}
    reading = hpa_reading(observed.hpa)
    if reading is not None:
        status["load"] = {"inflightPerReplica": f"{reading:g}"}
    if estimated:
        status["estimatedStart"] = estimated
    result.status = status
    return result
