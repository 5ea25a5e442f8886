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
- **The primary pool's GPRs** (:func:`growth`): ``<name>-primary`` for ``replicas.min`` nodes, and one GPR
  ``<name>-primary-<k>`` of one node for each replica the autoscaler asks beyond it. A GPR is admitted whole and
  an admitted GPR's reservation is never grown, so one GPR for the whole count would start nothing while one of
  its nodes is missing, and a bigger one would re-queue the replicas already running; a GPR per added replica is
  admitted as soon as one node has room, and adding or removing one never touches the others. Scaling down
  releases the GPRs left without a pod (the pods of the highest ``k`` go first: their ``pod-deletion-cost`` is
  lowest); a GPR with a pod on it, terminating included, is never deleted.
- **Pods to GPRs**: an autoscaled pool's pods are created naming ``<name>-primary-new``, a GPR that never exists,
  so they stay at the scheduling gate; each pass gives each such pod (and any pod still at the gate on a GPR that
  another could serve sooner) the GPR of a free replica slot, admitted ones first, by a JSON patch that holds only
  while the pod is still gated and still names what the pass saw. A pod past the gate is never moved.
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

from inference.names import LABEL_POOL, POOL_BURST, POOL_PRIMARY
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
    growth: dict[int, dict[str, Any]] = field(default_factory=dict)  # k -> GPR <name>-primary-<k> (owned)


@dataclass
class Plan:
    apply: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    replace_pods: list[tuple[str, str]] = field(default_factory=list)  # (pod name, why)
    assign: list[tuple[str, str, str, list[str], str]] = field(default_factory=list)  # see Growth.assign
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
    name = str((endpoint.get("metadata") or {}).get("name") or "")
    try:
        longest = f"{name}-primary-{max(int(replicas.get('max', 1)), 100)}"  # -new, or the last replica's GPR
        growing = o.autoscaled(spec)
    except (TypeError, ValueError):
        longest, growing = "", False
    if len(longest) > 63 and growing:
        problems.append(f"metadata.name: at most {63 - len(longest) + len(name)} characters for replicas.max "
                        f"{replicas.get('max')} (pods name their GPR '{name}-primary-<replica>' in a label of at "
                        "most 63)")
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


def _phase(g: dict[str, Any] | None) -> str:
    return str(((g or {}).get("status") or {}).get("phase") or "")


def _holds(g: dict[str, Any] | None) -> bool:
    """Whether the GPR holds its nodes now (admitted, running, or being evicted: its pods keep them until gone)."""
    return _phase(g) in (*ADMITTED_PHASES, "Evicting")


def _gated(pod: dict[str, Any]) -> bool:
    return any(isinstance(g, dict) and g.get("name") == o.SCHEDULING_GATE
               for g in (pod.get("spec") or {}).get("schedulingGates") or [])


def _alive(pod: dict[str, Any]) -> bool:
    """Not terminating and not finished: a pod that counts for a replica slot."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def _gpr_of(pod: dict[str, Any]) -> str:
    return str(((pod.get("metadata") or {}).get("labels") or {}).get(o.GPR_LABEL) or "")


@dataclass
class Growth:
    """The primary pool's GPRs and what goes on them (see the module's docstring)."""
    base_nodes: int  # nodeCount of <name>-primary
    keep: list[int]  # growth GPR indices to keep or create, sorted
    slots: list[int]  # of those, the ones a replica is counted on (the others only wait for a terminating pod)
    assign: list[tuple[str, str, str, list[str], str]] = field(default_factory=list)
    # (pod, GPR it names now, GPR it gets, its scheduling gates as seen, pod-deletion-cost)
    admitted: int = 0  # replica slots in GPRs that hold nodes
    waiting: list[str] = field(default_factory=list)  # names of the slot GPRs not admitted (yet), base first
    queued: list[str] = field(default_factory=list)  # of those, the growth GPRs the controller has seen and left waiting


def growth(endpoint: dict[str, Any], observed: Observed, desired: int) -> Growth:
    """Which growth GPRs the primary pool keeps, which it makes, and which gated pod goes on which GPR."""
    spec = endpoint["spec"]
    low = _int((spec.get("replicas") or {}).get("min", 1), 1)
    base_name = o.child_name(endpoint, POOL_PRIMARY)
    base = observed.gprs.get(POOL_PRIMARY)
    # an admitted GPR keeps the reservation it was admitted with; one stored bigger (before growth GPRs) stays
    base_nodes = _int(((base or {}).get("spec") or {}).get("nodeCount"), low) if _holds(base) else low
    base_nodes = max(base_nodes, 1)
    need = max(0, desired - base_nodes) if o.autoscaled(spec) else 0
    pods = [p for p in observed.pods
            if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_POOL, POOL_PRIMARY) == POOL_PRIMARY]
    settled: dict[str, int] = {}  # live pods past the gate, by GPR: they stay where they are
    holding: set[str] = set()  # GPRs with any unfinished pod, terminating included
    gated: list[dict[str, Any]] = []
    for p in pods:
        if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        holding.add(_gpr_of(p))
        if not _alive(p):
            continue
        if _gated(p):
            gated.append(p)
        else:
            settled[_gpr_of(p)] = settled.get(_gpr_of(p), 0) + 1
    have = {k: g for k, g in observed.growth.items() if _phase(g) not in ENDED_PHASES}
    name = {k: o.growth_name(endpoint, k) for k in have}
    gated_on = {_gpr_of(p) for p in gated}
    ranked = sorted(have, key=lambda k: (not settled.get(name[k]), not _holds(have[k]), name[k] not in gated_on, k))
    slots = ranked[:max(need, sum(1 for k in have if settled.get(name[k])))]
    taken = set(observed.growth)
    k = base_nodes  # replica numbers: the base holds 1..base_nodes
    while len(slots) < need:
        k += 1
        if k not in taken:
            slots.append(k)
    slots.sort()
    keep = sorted(set(slots) | {k for k in have if name[k] in holding})
    out = Growth(base_nodes=base_nodes, keep=keep, slots=slots)

    # replica slots: what each slot GPR can take, less what is past its gate already
    names = {base_name: None, **{o.growth_name(endpoint, k): k for k in slots}}
    cap = {n: (base_nodes if k is None else 1) for n, k in names.items()}
    free = {n: cap[n] - settled.get(n, 0) for n in cap}
    admitted = {n for n, k in names.items() if _holds(base if k is None else have.get(k))}
    out.admitted = sum(cap[n] for n in admitted)
    out.waiting = [n for n in names if n not in admitted]
    out.queued = [n for n, k in names.items() if n not in admitted and k is not None and _phase(have.get(k))]

    def best(only_admitted: bool) -> str | None:
        order = sorted((n for n in names if free[n] > 0 and (n in admitted or not only_admitted)),
                       key=lambda n: (n not in admitted, names[n] is not None, names[n] or 0))
        return order[0] if order else None

    def move(p: dict[str, Any], to: str) -> None:
        free[to] -= 1
        index = names[to]
        gates = [str(g.get("name")) for g in (p.get("spec") or {}).get("schedulingGates") or [] if isinstance(g, dict)]
        out.assign.append((str(p["metadata"].get("name", "")), _gpr_of(p), to, gates, str(-(index or 0))))

    gated.sort(key=lambda p: (str(p["metadata"].get("creationTimestamp") or ""), str(p["metadata"].get("name"))))
    rest = []
    for p in gated:  # already on an admitted GPR with room: it starts there
        if _gpr_of(p) in admitted and free.get(_gpr_of(p), 0) > 0:
            free[_gpr_of(p)] -= 1
        else:
            rest.append(p)
    later = []
    for p in rest:  # to an admitted GPR with room: it starts now instead of waiting
        to = best(only_admitted=True)
        if to is not None:
            move(p, to)
        else:
            later.append(p)
    last = []
    for p in later:  # waits on the GPR it names, when that is a slot with room
        if free.get(_gpr_of(p), 0) > 0:
            free[_gpr_of(p)] -= 1
        else:
            last.append(p)
    for p in last:  # the rest to any slot with room (none: more pods than slots, it stays at the gate)
        to = best(only_admitted=False)
        if to is not None:
            move(p, to)
    return out


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


def burst_replicas(endpoint: dict[str, Any], observed: Observed, desired: int,
                   grown: Growth | None = None) -> tuple[int, str]:
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
    if grown is not None and grown.queued and phase is not None:
        return min(ceiling, len(grown.queued)), (f"{len(grown.queued)} of the primary pool's {desired} replicas "
                                                 f"wait for their GPR ({', '.join(grown.queued[:3])})")
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


def refused(endpoint: dict[str, Any], status: dict[str, Any], why: str, now: str,
            condition: str = "Ready") -> tuple[dict[str, Any], bool]:
    """``status`` with ``Ready=False``, reason ``Refused`` and ``why`` (what the API server refused and its answer:
    a webhook's or a quota's message); and whether that is news (an Event is due). ``condition="ScalingLimited"``
    for a refused replica GPR: ``ScalingLimited=True``, reason ``Refused`` (the endpoint still serves)."""
    generation = _int((endpoint.get("metadata") or {}).get("generation"), 0)
    old = {str(c.get("type")): c for c in (endpoint.get("status") or {}).get("conditions") or []
           if isinstance(c, dict)}
    said = _condition(old, condition, condition != "Ready", "Refused", why, now, generation)
    conditions = [said if c.get("type") == condition else c for c in status.get("conditions") or []]
    if condition not in {c.get("type") for c in conditions}:
        conditions.insert(0, said)
    before = old.get(condition) or {}
    return ({**status, "conditions": conditions},
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
    grown = growth(endpoint, observed, desired)
    burst_wanted, burst_why = burst_replicas(endpoint, observed, desired, grown)
    # the GPR before the Deployment, so its place in the queue is taken before the first pod is gated on it
    wanted: list[dict[str, Any]] = [
        o.gpr(endpoint, POOL_PRIMARY, template_spec, observed.max_exit, grown.base_nodes),
        o.deployment(endpoint, POOL_PRIMARY, desired, settings),
        o.service(endpoint, POOL_PRIMARY), o.pdb(endpoint), o.network_policy(endpoint, settings)]
    autoscaler = o.hpa(endpoint)
    if autoscaler is not None:
        wanted.append(autoscaler)
    # one GPR per replica beyond the base, last: one refused (a GPR count limit) leaves the rest of the endpoint
    # applied, and is reported as a limit on scaling, not as the endpoint being refused
    wanted += [o.gpr(endpoint, POOL_PRIMARY, template_spec, observed.max_exit, 1, index=k) for k in grown.keep]
    result.assign = grown.assign
    burst_dep = observed.deployments.get(POOL_BURST)
    if spec.get("burst"):
        # the Deployment's count leaves out pods being deleted (a ReplicaSet counts active pods only): the GPR
        # stays while any burst pod is still there, terminating included, so none runs outside a reservation
        burst_pods = _int(((burst_dep or {}).get("status") or {}).get("replicas"), 0) + sum(
            1 for p in observed.pods if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_POOL) == POOL_BURST
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))
        if burst_wanted > 0 or burst_pods > 0:
            wanted.append(o.gpr(endpoint, POOL_BURST, template_spec, observed.max_exit))
        wanted += [o.deployment(endpoint, POOL_BURST, burst_wanted, settings), o.service(endpoint, POOL_BURST)]
    # a GPR that ended (its workspace's exitDuration reached, or cancelled) is deleted and made again next pass:
    # a service outlives any one GPR, and the new one takes its place in the queue
    ended = {o.child_name(endpoint, pool): phase for pool, g in observed.gprs.items()
             if (phase := (g.get("status") or {}).get("phase")) in ENDED_PHASES}
    ended.update({o.growth_name(endpoint, k): phase for k, g in observed.growth.items()
                  if (phase := _phase(g)) in ENDED_PHASES})
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
    # the first growth GPR that waits, and why (its own reason and message, from the GPR controller's pass)
    growth_by_name = {o.growth_name(endpoint, k): g for k, g in observed.growth.items()}
    first_waiting = grown.queued[0] if grown.queued else None  # (one just created is not reported yet)
    waiting_status = (growth_by_name.get(first_waiting or "") or {}).get("status") or {}
    waiting_reason = str((primary_gpr if phase is not None and phase not in ADMITTED_PHASES else waiting_status)
                         .get("reason") or "")
    at_max_reason = ""
    for cond in ((observed.hpa or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ScalingLimited" and cond.get("status") == "True":
            at_max_reason = cond.get("message") or cond.get("reason") or "the autoscaler is at a limit"
    if phase is not None and phase not in ADMITTED_PHASES:
        position = primary_gpr.get("queuePosition")
        limited = (True, "GPRQueued", f"GPR {o.child_name(endpoint, POOL_PRIMARY)} is {phase}"
                   + (f" at position {position}" if position else "")
                   + (f", estimated start {estimated}" if estimated else "")
                   + (f" ({waiting_reason})" if waiting_reason else ""))
    elif first_waiting is not None:
        wait_phase = waiting_status.get("phase")
        said = str(waiting_status.get("message") or "")
        limited = (True, "GrowthQueued",
                   (f"{grown.admitted} of {desired} replicas admitted; {len(grown.waiting)} wait for their GPR: "
                    f"{first_waiting} is {wait_phase}" + (f" ({waiting_reason})" if waiting_reason else "")
                    + (f": {said}" if said else ""))[:1000])
        if not estimated:
            estimated = waiting_status.get("estimatedStart")
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
                                 "gprNodes": grown.base_nodes + len(grown.slots),
                                 "admittedReplicas": grown.admitted,
                                 "waitingReplicas": grown.base_nodes + len(grown.slots) - grown.admitted,
                                 **({"waitingReason": waiting_reason} if waiting_reason else {}),
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
