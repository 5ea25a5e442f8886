"""The node preflight (``kubectl accelstack node check NODE``, docs/nr1-nodes.md): item by item, what a node needs
before it can serve accelerator pods, each ``ok``, ``missing`` or ``unknown`` with the evidence or the fix.

A pure function of what the API server holds: the Node (labels and who wrote them, capacity, conditions, taints),
accelstack's DaemonSet pods bound to it (found by their ``app.kubernetes.io/name`` labels, in whatever namespace
they were installed) and its AcceleratorNode (a deboard request). Nothing here reads the host: what the host has
is trusted only as far as a component on it reported it to the API server — the device plugin's count label
(modules it found in sysfs), the resource the kubelet advertises after the plugin registered, the CNI installer's
readiness probe (the plugin answers ``VERSION`` and the conflist is in place), node-problem-detector's condition
and its heartbeat, the exporter pod's state. ``unknown`` says the evidence cannot tell (a condition Unknown, a pod
whose node stopped reporting, a count label someone else wrote); it is never ``ok``.

The items of an NR1 node: ``node``, ``labels``, ``modules``, ``device plugin``, ``cni``, ``npd``, ``exporter``.
A GPU node has the same but ``devices`` for ``modules`` and no ``cni`` (the NR1 CNI is NR1's alone). A node with
both has both sets, named ``nr1 ...`` and ``gpu ...``. A node with no accelerator evidence at all is checked as
an NR1 node about to join (its labels missing first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_extender.objects.accelerator_nodes import DEBOARD_TAINT, PLUGIN_MANAGER, labels_by
from scheduler_extender.objects.gpr_codec import parse_time

OK, MISSING, UNKNOWN = "ok", "missing", "unknown"
DEFAULT_NAMESPACE = "accelstack-node"  # where the shipped node DaemonSets run (manifests/*/kustomization.yaml)
NPD_HEARTBEAT_S = 300.0  # the shipped NPD's --k8s-exporter-heartbeat-period
NPD_STALE_S = 3 * NPD_HEARTBEAT_S  # three heartbeats missed: NPD no longer reports (one late one is not news)
APP = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"


@dataclass(frozen=True)
class Kind:
    """One accelerator kind's DaemonSets, labels and condition, as the shipped manifests name them."""

    key: str  # nr1 | gpu
    resource: str
    devices: str  # "NR1 modules"
    seen_by: str  # where the device plugin looks
    item: str  # the devices item's name
    landing: tuple[tuple[str, str], ...]  # the landing label the DaemonSets select (GFD's, NFD's are only evidence)
    count_label: str
    plugin: str
    npd: str
    npd_condition: str
    exporter: str  # the exporter DaemonSet's component label
    cni: str = ""  # the CNI installer's app name, "" when the kind has none


NR1_KIND = Kind("nr1", "neureality.com/nr1", "NR1 modules", "in sysfs", "modules",
                (("accelstack.io/nr1-node", "true"),), "accelstack.io/nr1.count", "accelstack-device-plugin-nr1",
                "accelstack-npd-nr1", "NR1Unhealthy", "nr1", cni="accelstack-nr1-cni")
GPU_KIND = Kind("gpu", "nvidia.com/gpu", "GPUs", "through NVML", "devices",
                (("accelstack.io/gpu-node", "true"),), "nvidia.com/gpu.count",
                "accelstack-device-plugin-nvidia", "accelstack-npd-gpu", "GPUUnhealthy", "gpu")


@dataclass(frozen=True)
class Item:
    name: str
    status: str  # ok | missing | unknown
    detail: str  # the evidence, or what is wrong and the fix
    resource: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "resource": self.resource}


def kinds_of(node: Mapping[str, Any]) -> list[Kind]:
    """The kinds a node shows evidence of (labels, advertised resource); NR1 when it shows none: the preflight is
    what a node about to join runs."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    capacity = (node.get("status") or {}).get("capacity") or {}
    found = [k for k in (NR1_KIND, GPU_KIND)
             if k.resource in capacity or k.count_label in labels or any(labels.get(key) == v for key, v in k.landing)]
    gpu_evidence = labels.get("nvidia.com/gpu.present") == "true" or any(  # GFD's, NFD's: evidence, not landing
        key.startswith("feature.node.kubernetes.io/pci-") and key.endswith("10de.present") and labels.get(key) == "true"
        for key in labels)
    if gpu_evidence and GPU_KIND not in found:
        found.append(GPU_KIND)
    return found or [NR1_KIND]


def _count(value: Any) -> int | None:
    try:
        n = int(str(value))
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == kind:
            return c
    return None


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 \
        else f"{seconds / 3600:.1f}h ago"


@dataclass(frozen=True)
class PodState:
    """One DaemonSet pod as the preflight reads it."""

    name: str
    namespace: str
    phase: str
    ready: bool
    restarts: int
    waiting: str  # a container's waiting or failed reason (CrashLoopBackOff, ImagePullBackOff, Error), else ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_state(pod: Mapping[str, Any]) -> PodState:
    meta, st = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = [s for s in [*(st.get("initContainerStatuses") or ()), *(st.get("containerStatuses") or ())]
                if isinstance(s, Mapping)]
    waiting = ""
    for s in statuses:
        state = s.get("state") or {}
        reason = (state.get("waiting") or {}).get("reason") or (
            (state.get("terminated") or {}).get("reason") if (state.get("terminated") or {}).get("exitCode") else "")
        if reason and reason not in ("PodInitializing", "ContainerCreating"):
            waiting = f"{s.get('name')}: {reason}"
            break
    ready = any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
                for c in st.get("conditions") or ())
    return PodState(str(meta.get("name") or ""), str(meta.get("namespace") or ""), str(st.get("phase") or "Pending"),
                    ready, sum(int(s.get("restartCount") or 0) for s in statuses), waiting)


def find_pod(pods: Iterable[Mapping[str, Any]], app: str, component: str = "") -> PodState | None:
    """The DaemonSet's pod on the node: a terminating one only when there is no other, a Ready one first."""
    found = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(APP) != app or (component and labels.get(COMPONENT) != component):
            continue
        found.append((bool((pod.get("metadata") or {}).get("deletionTimestamp")), pod))
    if not found:
        return None
    states = sorted(((gone, pod_state(p)) for gone, p in found), key=lambda x: (x[0], not x[1].ready, x[1].name))
    return states[0][1]


def _pod_item(name: str, kind: Kind, pod: PodState | None, app: str, what: str, ns: str,
              ok_detail: str) -> Item:
    """An item whose evidence is a DaemonSet pod Running and Ready."""
    if pod is None:
        return Item(name, MISSING, f"no {app} pod on the node: {what}; kubectl -n {ns} get ds {app} (its node "
                                   "affinity wants the labels above)", kind.resource)
    if pod.phase == "Unknown":
        return Item(name, UNKNOWN, f"pod {pod.ref} phase Unknown: the kubelet stopped reporting", kind.resource)
    if pod.phase == "Running" and pod.ready:
        return Item(name, OK, f"pod {pod.ref} Running and Ready{_restarts(pod)}: {ok_detail}", kind.resource)
    state = pod.waiting or ("Running, not Ready" if pod.phase == "Running" else pod.phase)
    return Item(name, MISSING, f"pod {pod.ref} {state}{_restarts(pod)}: {what}; kubectl -n {pod.namespace} "
                               f"describe pod {pod.name}", kind.resource)


def _restarts(pod: PodState) -> str:
    return f", {pod.restarts} restarts" if pod.restarts else ""


def _namespace(pods: Sequence[Mapping[str, Any]]) -> str:
    for pod in pods:
        ns = (pod.get("metadata") or {}).get("namespace")
        if ns and str(((pod.get("metadata") or {}).get("labels") or {}).get(APP, "")).startswith("accelstack-"):
            return str(ns)
    return DEFAULT_NAMESPACE


def node_item(node: Mapping[str, Any], accelerator_node: Mapping[str, Any] | None) -> Item:
    """Ready, schedulable, not deboarding."""
    name = (node.get("metadata") or {}).get("name", "NODE")
    spec = node.get("spec") or {}
    taint = next((t for t in spec.get("taints") or () if isinstance(t, Mapping) and t.get("key") == DEBOARD_TAINT),
                 None)
    request = ((accelerator_node or {}).get("spec") or {}).get("deboard")
    if taint is not None or request:
        phase = ((accelerator_node or {}).get("status") or {}).get("phase") or "Deboarding"
        return Item("node", MISSING, f"{phase}: a deboard request stands"
                                     + (f" (taint {DEBOARD_TAINT})" if taint is not None else "")
                                     + f"; take it back with kubectl accelstack node deboard {name} --abort")
    ready = _condition(node, "Ready")
    if ready is None or ready.get("status") == "Unknown":
        return Item("node", UNKNOWN, "the kubelet has not reported Ready"
                                     + (f" ({ready.get('reason')})" if ready and ready.get("reason") else "")
                                     + f": kubectl describe node {name}")
    if ready.get("status") != "True":
        return Item("node", MISSING, f"NotReady ({ready.get('reason') or 'no reason'}): {ready.get('message') or ''}"
                                     .rstrip(": ") + f"; kubectl describe node {name}")
    if spec.get("unschedulable"):
        return Item("node", MISSING, f"Ready but cordoned: kubectl uncordon {name}")
    return Item("node", OK, f"Ready ({ready.get('reason') or 'KubeletReady'}), schedulable, not deboarding")


def kind_items(kind: Kind, node: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], now: float,
               prefix: str = "") -> list[Item]:
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    name, labels = meta.get("name", "NODE"), meta.get("labels") or {}
    ns = _namespace(pods)
    items: list[Item] = []

    # labels: the DaemonSets land only where these are
    landed = [f"{k}={v}" for k, v in kind.landing if labels.get(k) == v]
    want = "=".join(kind.landing[0])
    if landed:
        items.append(Item(prefix + "labels", OK, f"{', '.join(landed)} (the {kind.key.upper()} DaemonSets land here)",
                          kind.resource))
    else:
        items.append(Item(prefix + "labels", MISSING, f"{want} not set: the {kind.key.upper()} DaemonSets do not land "
                                                      f"here; kubectl label node {name} {want}", kind.resource))

    # devices seen: the device plugin's count label (its field manager says it wrote it)
    count = _count(labels.get(kind.count_label))
    plugin_pod = find_pod(pods, kind.plugin)
    item = prefix + kind.item
    if kind.count_label not in labels:
        items.append(Item(item, MISSING, f"no {kind.count_label} label: {kind.plugin} has not labelled the node "
                                         f"(it counts the {kind.devices} {kind.seen_by} when it starts)",
                          kind.resource))
    elif count is None:
        items.append(Item(item, UNKNOWN, f"{kind.count_label}={labels[kind.count_label]!r} is not a count",
                          kind.resource))
    elif kind.count_label not in labels_by(node, PLUGIN_MANAGER):
        items.append(Item(item, UNKNOWN, f"label {kind.count_label}={count} not written by {PLUGIN_MANAGER} (by hand "
                                         f"or another labeller): it does not say what {kind.plugin} sees",
                          kind.resource))
    elif count == 0:
        fix = "the vendor ID in nr1.vendorIDs (docs/install.md) and lspci -nn on the node" if kind.key == "nr1" \
            else "the driver (nvidia-smi on the node)"
        items.append(Item(item, MISSING, f"0 {kind.devices} {kind.seen_by} (label {kind.count_label}=0, written by "
                                         f"{PLUGIN_MANAGER}): check {fix}", kind.resource))
    else:
        items.append(Item(item, OK, f"{count} {kind.devices} {kind.seen_by} (label {kind.count_label}={count}, "
                                    f"written by {PLUGIN_MANAGER})", kind.resource))

    # device plugin registered: the kubelet advertises the resource, as many as the plugin counted
    capacity = _count((status.get("capacity") or {}).get(kind.resource)) or 0
    allocatable = _count((status.get("allocatable") or {}).get(kind.resource)) or 0
    logs = f"kubectl -n {plugin_pod.namespace if plugin_pod else ns} logs ds/{kind.plugin}"
    item = prefix + "device plugin"
    if capacity == 0:
        where = "" if plugin_pod else f" (no {kind.plugin} pod on the node)"
        items.append(Item(item, MISSING, f"{kind.resource} not advertised (capacity 0): the plugin is not registered"
                                         f"{where}; {logs}", kind.resource))
    elif count is None:
        items.append(Item(item, UNKNOWN, f"{kind.resource} advertised (capacity {capacity}) but no count label to "
                                         f"compare it with", kind.resource))
    elif capacity != count:
        items.append(Item(item, MISSING, f"{kind.resource} capacity {capacity} but {count} {kind.devices} counted "
                                         f"({kind.count_label}): the plugin advertises another number; {logs}",
                          kind.resource))
    else:
        unhealthy = f", {capacity - allocatable} unhealthy" if allocatable < capacity else ""
        items.append(Item(item, OK, f"{kind.resource} advertised: capacity {capacity} == {kind.count_label} "
                                    f"(allocatable {allocatable}{unhealthy})", kind.resource))

    # CNI: the installer pod Ready, whose readiness probe checks the binary answers and the conflist is there
    if kind.cni:
        items.append(_pod_item(prefix + "cni", kind, find_pod(pods, kind.cni), kind.cni,
                               "the NR1 CNI plugin and its config are not known to be installed", ns,
                               "its probe found /opt/cni/bin/accelstack-nr1-cni answering VERSION and "
                               "zz-accelstack-nr1.conflist in place"))

    # NPD: its condition on the Node, with a recent heartbeat
    item = prefix + "npd"
    cond = _condition(node, kind.npd_condition)
    npd_pod = find_pod(pods, kind.npd)
    npd_logs = f"kubectl -n {npd_pod.namespace if npd_pod else ns} logs ds/{kind.npd}"
    if cond is None:
        where = "" if npd_pod else f" (no {kind.npd} pod on the node)"
        items.append(Item(item, MISSING, f"no {kind.npd_condition} condition: node-problem-detector does not report "
                                         f"here{where}; {npd_logs}", kind.resource))
    else:
        beat = parse_time(cond.get("lastHeartbeatTime"))
        age = None if beat is None else now - beat
        said = f"{kind.npd_condition}={cond.get('status')} ({cond.get('reason') or 'no reason'})"
        heard = "no heartbeat" if age is None else f"heartbeat {_ago(age)}"
        if age is None or age > NPD_STALE_S:
            items.append(Item(item, MISSING, f"{said}, {heard}: NPD stopped reporting (it heartbeats every "
                                             f"{NPD_HEARTBEAT_S / 60:.0f}m); {npd_logs}", kind.resource))
        elif cond.get("status") == "False":
            items.append(Item(item, OK, f"{said}, {heard}", kind.resource))
        elif cond.get("status") == "True":
            items.append(Item(item, MISSING, f"{said}: {cond.get('message') or 'a problem'}; docs/npd.md",
                              kind.resource))
        else:
            items.append(Item(item, UNKNOWN, f"{said}, {heard}: the check could not look; {npd_logs}",
                              kind.resource))

    # exporter: its pod Running and Ready (it has no readiness probe: Ready means started and not restarting)
    exporter_app = "accelstack-device-exporter"
    items.append(_pod_item(prefix + "exporter", kind, find_pod(pods, exporter_app, kind.exporter),
                           f"{exporter_app}-{kind.exporter}", "no per-device metrics from this node", ns,
                           "it serves :9402/metrics; that Prometheus scrapes it is Prometheus' to say (this "
                           "node's accelstack-device-exporter target up)"))
    return items


def check(node: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
          accelerator_node: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """The preflight's answer: ``{"node", "ok", "kinds", "items": [{name, status, detail, resource}]}``.

    ``pods``: the pods bound to the node (others are ignored: only accelstack's DaemonSets' are read).
    ``accelerator_node``: its AcceleratorNode, None when there is none."""
    kinds = kinds_of(node)
    items = [node_item(node, accelerator_node)]
    for kind in kinds:
        items += kind_items(kind, node, pods, now, prefix=f"{kind.key} " if len(kinds) > 1 else "")
    return {"node": (node.get("metadata") or {}).get("name", ""), "ok": all(i.status == OK for i in items),
            "kinds": [k.resource for k in kinds], "items": [i.as_dict() for i in items]}
