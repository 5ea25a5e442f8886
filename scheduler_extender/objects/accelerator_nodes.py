"""Accelerator nodes as pure functions: a Node in, whether it is an accelerator node and what says so out; the
``AcceleratorNode`` objects (cluster-scoped, ``accelstack.io/v1alpha1``, one per accelerator node, named as the
node) the cluster should hold, and their status.

A platform team rarely starts from an empty cluster: GPU nodes already serve pods through NVIDIA's device plugin
(GPU feature discovery labels them), node-feature-discovery labels PCI vendors, and accelstack's own device plugin
labels the nodes it runs on. :func:`detect` reads all of that from the Node object alone:

- the resource advertised (``status.capacity`` / ``allocatable`` of ``nvidia.com/gpu`` or ``neureality.com/nr1``),
  by whichever device plugin registered it;
- GPU feature discovery's labels ``nvidia.com/gpu.present``, ``.product``, ``.count``;
- node-feature-discovery's PCI labels ``feature.node.kubernetes.io/pci-10de.present`` (NVIDIA) and the same for
  the NR1 vendor IDs the controller is given (``--nr1-vendor-ids``, as the device plugin's ``nr1.vendorIDs``); NFD's
  default ``pci-<class>_<vendor>.present`` form counts too;
- the labels accelstack's device plugin writes (``nvidia.com/gpu.*``, ``nvidia.com/cuda.*``, ``accelstack.io/nr1.*``).
  GPU feature discovery writes the same GPU label names (on purpose: node selectors keep working), so what tells
  the two apart is who wrote them: the Node's ``metadata.managedFields`` entry of the field manager
  ``accelstack-device-plugin`` (the labeller's, ``device_plugin/labeller.py``). A label alone is never taken for
  accelstack's.

A node is *Detected* until it is onboarded (:func:`onboard_why`: asked for with ``spec.onboard``, chosen by the
controller's selector, already served by accelstack's plugin, or carrying its landing label). Onboarding puts the
landing label on (the shipped DaemonSets land only there) and waits, step by step (:func:`onboard_step`), for
accelstack's device plugin to serve the resource, node-problem-detector to report and the kubelet's pod-resources
view (as the plugin reports it) to match the pods bound there; then the node is *Managed*. An onboarding not done
within the timeout is *Failed* (and Managed the moment its last step is done). Deboarding and Deboarded follow a
deboard request (below).

:func:`plan` compares what should exist with the AcceleratorNodes there are (level-triggered: nothing depends on
memory of earlier passes) and says what to create, which statuses to write (only those that differ, ignoring
``lastTransitionTime``, which is kept while a condition's status stays) and what to delete: the object of a node
that is gone or no longer an accelerator node, or one owned by an earlier node of the same name.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import GPU, MODEL_LABEL, NR1
from scheduler_extender.objects.conditions import status_differs

GROUP, VERSION = "accelstack.io", "v1alpha1"
KIND, PLURAL = "AcceleratorNode", "acceleratornodes"
PHASES = ("Detected", "Onboarding", "Managed", "Deboarding", "Deboarded", "Failed")
# who serves the devices (printer column Managed-by)
BY_ACCELSTACK, BY_OTHER, BY_NONE = "accelstack", "other-plugin", "none"
# the labeller's field manager and label prefixes (device_plugin/labeller.py FIELD_MANAGER, OWNED_PREFIXES: the
# layout keeps device_plugin out of the control plane's imports; tests/extender/test_accelerator_nodes.py keeps
# the two in step)
PLUGIN_MANAGER = "accelstack-device-plugin"
PLUGIN_PREFIXES = {GPU: ("nvidia.com/gpu.", "nvidia.com/cuda."), NR1: ("accelstack.io/nr1.",)}
COUNT_LABEL = {GPU: "nvidia.com/gpu.count", NR1: "accelstack.io/nr1.count"}
GPU_PRESENT = "nvidia.com/gpu.present"
NVIDIA_VENDOR = "10de"
NFD_PCI = "feature.node.kubernetes.io/pci-"
# ---- deboarding (issue 39.4): spec.deboard {grace, requestedAt} asks for it; the controller taints the node
# DEBOARD_TAINT=<until>:NoSchedule, <until> the end of the grace in Unix seconds (a taint value is a label value: the
# GPR pass reads the deadline from the Node alone, which it already watches)
DEBOARD_TAINT = "accelstack.io/deboarding"
DEBOARD_REASON = "NodeDeboarding"  # the requeued GPRs' reason
# the node labels the shipped DaemonSets select by (manifests/: device plugins, NPD, exporter, CNI installer),
# removed when a node is Deboarded; GPU feature discovery and node-feature-discovery write some of them again
# while they run there (docs/nodes.md)
# ---- onboarding (issue 39.3): the shipped DaemonSets (device plugin, NPD, exporter, CNI installer) land only on
# nodes carrying their kind's landing label; putting it on is onboarding, taking it off (deboarding) sends them away.
# GPU feature discovery's and node-feature-discovery's labels are evidence only: they never bring accelstack's
# plugin onto a node another plugin serves
ONBOARD_LABEL = {GPU: "accelstack.io/gpu-node", NR1: "accelstack.io/nr1-node"}
LANDING_LABELS = tuple(ONBOARD_LABEL.values())
# the node condition accelstack's node-problem-detector keeps per kind (manifests/npd/configmap.yaml): present (any
# status) means NPD reports on the node
NPD_CONDITION = {GPU: "GPUUnhealthy", NR1: "NR1Unhealthy"}
# the kubelet's pod-resources view as accelstack's device plugin reports it on its Node (device_plugin/handover.py),
# one annotation per plugin (the GPU and NR1 DaemonSets on one node do not overwrite each other)
POD_RESOURCES_KEY = {GPU: "accelstack.io/pod-resources", NR1: "accelstack.io/pod-resources-nr1"}
ONBOARD_TIMEOUT_S = 900.0
MAX_GRACE_S = 7 * 86400
MAX_HOLDERS = 100  # rows kept in status.holders (holderCount counts them all): an object stays small


def vendor_id(value: str) -> str:
    """``0x1E2D`` / ``1e2d`` -> ``1e2d`` (the form NFD's labels use); ValueError naming the value otherwise."""
    text = value.strip().lower()
    text = text[2:] if text.startswith("0x") else text
    if len(text) != 4 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a PCI vendor ID like 0x1e2d: {value!r}")
    return text


@dataclass(frozen=True)
class Found:
    """One resource's devices on a node: advertised (capacity, allocatable), labelled (the count label), model."""

    resource: str
    capacity: int = 0
    allocatable: int = 0
    labelled: int = 0
    model: str = ""

    @property
    def seen(self) -> int:
        return self.capacity or self.labelled


@dataclass(frozen=True)
class PodResources:
    """The kubelet's pod-resources view of one resource as accelstack's device plugin reports it on its Node
    (annotation ``accelstack.io/pod-resources``, ``accelstack.io/pod-resources-nr1`` for NR1): the devices the plugin serves, the device IDs the kubelet lists as
    assigned to pods, and how many of those the plugin does not serve (IDs another plugin handed out); ``error``
    when the plugin could not read the view (or the annotation is not what it writes)."""

    resource: str = ""
    devices: int = 0
    in_use: int = 0
    unknown: int = 0
    error: str = ""


def pod_resources(value: Any) -> PodResources | None:
    """The annotation's value decoded (None: no annotation); a malformed one is an ``error``, never zeros."""
    if value is None:
        return None
    try:
        doc = json.loads(str(value))
    except ValueError:
        return PodResources(error="the pod-resources annotation is not JSON")
    if not isinstance(doc, Mapping):
        return PodResources(error="the pod-resources annotation is not a JSON object")
    if doc.get("error"):
        return PodResources(str(doc.get("resource") or ""), error=str(doc["error"])[:300])
    numbers = [doc.get(k) for k in ("devices", "inUse", "unknownIDs")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        return PodResources(str(doc.get("resource") or ""),
                            error="the pod-resources annotation lacks devices, inUse or unknownIDs")
    return PodResources(str(doc.get("resource") or ""), *numbers)  # type: ignore[arg-type]


def parse_selector(text: str) -> Callable[[Mapping[str, Any]], bool]:
    """A label selector as kubectl takes it, equality and existence forms (``a=b,c!=d,e,!f``), as a predicate
    over a node's labels; ValueError naming the part otherwise. An empty text selects nothing (not everything:
    onboarding by selector is opt-in)."""
    terms: list[tuple[str, str, str]] = []  # (op, key, value): op one of = != exists absent
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "!=" in part:
            key, _, value = part.partition("!=")
            op = "!="
        elif "=" in part:
            key, _, value = part.partition("==" if "==" in part else "=")
            op = "="
        else:
            op, key, value = ("absent", part[1:], "") if part.startswith("!") else ("exists", part, "")
        key, value = key.strip(), value.strip()
        if not key or any(c in key + value for c in " ()!=,"):
            raise ValueError(f"not a label selector like gpu-pool=a100 or key!=value: {part!r}")
        terms.append((op, key, value))

    def matches(labels: Mapping[str, Any]) -> bool:
        if not terms:
            return False
        for op, key, value in terms:
            have = labels.get(key)
            ok = {"=": have == value, "!=": have != value, "exists": key in labels, "absent": key not in labels}[op]
            if not ok:
                return False
        return True
    return matches


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found on an accelerator node. ``resource`` is the one the columns show (the advertised
    one, GPU first when both are); ``ours``: accelstack's device plugin wrote labels of that resource."""

    node: str
    uid: str
    resource: str
    found: tuple[Found, ...]
    evidence: tuple[str, ...]
    ours: bool
    managed_by: str
    model: str
    onboard_label: bool = False  # the landing label of ``resource`` is on (the DaemonSets land)
    npd: bool = False  # accelstack's NPD condition of ``resource`` is on the Node
    podres: PodResources | None = None  # the device plugin's report of the kubelet's view
    selected: bool = False  # the controller's --onboard-selector matches the node

    @property
    def devices(self) -> int:
        return next((f.seen for f in self.found if f.resource == self.resource), 0)

    @property
    def phase(self) -> str:
        return "Managed" if self.managed_by == BY_ACCELSTACK else "Detected"


def _count(value: Any) -> int:
    try:
        n = int(str(value))
    except ValueError:
        return 0
    return max(n, 0)


def _quantity(resources: Any, name: str) -> int:
    return _count(resources.get(name, 0)) if isinstance(resources, Mapping) else 0


def labels_by(node: Mapping[str, Any], manager: str = PLUGIN_MANAGER) -> set[str]:
    """The label keys ``manager`` owns according to the Node's ``metadata.managedFields``."""
    out: set[str] = set()
    for entry in (node.get("metadata") or {}).get("managedFields") or ():
        if not isinstance(entry, Mapping) or entry.get("manager") != manager:
            continue
        fields = ((entry.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:labels") or {}
        out.update(k[2:] for k in fields if isinstance(k, str) and k.startswith("f:"))
    return out


def _nfd_vendor(key: str, value: str) -> str:
    """The vendor of an NFD PCI label that says present (``pci-10de.present``, ``pci-0302_10de.present``)."""
    if not key.startswith(NFD_PCI) or not key.endswith(".present") or value != "true":
        return ""
    ident = key[len(NFD_PCI):-len(".present")]
    return ident.rpartition("_")[2].lower()


def detect(node: Mapping[str, Any], nr1_vendors: Iterable[str] = (),
           selector: Callable[[Mapping[str, Any]], bool] | None = None) -> Detection | None:
    """Whether ``node`` is an accelerator node and what was found (None: no evidence of GPUs or NR1 modules).
    ``nr1_vendors``: NR1 PCI vendor IDs as :func:`vendor_id` writes them; ``selector``: the onboarding policy's
    (:func:`parse_selector`)."""
    meta, status = node.get("metadata") or {}, node.get("status") or {}
    labels = meta.get("labels") or {}
    labels = labels if isinstance(labels, Mapping) else {}
    nr1_ids = set(nr1_vendors)
    evidence: list[str] = []
    hits: dict[str, bool] = {GPU: False, NR1: False}
    found: list[Found] = []
    written = labels_by(node)
    annotations = meta.get("annotations") or {}
    annotations = annotations if isinstance(annotations, Mapping) else {}
    reports = {r: pod_resources(annotations.get(key)) for r, key in POD_RESOURCES_KEY.items()}
    ours: dict[str, bool] = {}
    for resource in (GPU, NR1):
        capacity = _quantity(status.get("capacity"), resource)
        allocatable = _quantity(status.get("allocatable"), resource)
        if capacity or allocatable:
            evidence.append(f"{resource} advertised (capacity {capacity}, allocatable {allocatable})")
            hits[resource] = True
        # labels count as the plugin's only where managedFields say it set them: a label it wrote with the value
        # GPU feature discovery had already written is not recorded as its (the API server records changes), so
        # on a brownfield node its pod-resources report (only accelstack's plugin writes it) says so instead
        report = reports[resource]
        ours[resource] = any(k.startswith(PLUGIN_PREFIXES[resource]) and k in labels for k in written) or \
            (report is not None and report.resource in ("", resource))
        count = _count(labels.get(COUNT_LABEL[resource], 0))
        found.append(Found(resource, capacity, allocatable, count, str(labels.get(MODEL_LABEL[resource], ""))))
    if labels.get(GPU_PRESENT) == "true":
        evidence.append(f"label {GPU_PRESENT}=true")
        hits[GPU] = True
    for key in (MODEL_LABEL[GPU], COUNT_LABEL[GPU]):
        if labels.get(key) and (key != COUNT_LABEL[GPU] or _count(labels[key])):
            evidence.append(f"label {key}={labels[key]}")
            hits[GPU] = True
    for key in (COUNT_LABEL[NR1], MODEL_LABEL[NR1]):
        if labels.get(key) and (key != COUNT_LABEL[NR1] or _count(labels[key])):
            evidence.append(f"label {key}={labels[key]}")
            hits[NR1] = True
    for key, value in sorted(labels.items()):
        vendor = _nfd_vendor(str(key), str(value))
        if vendor == NVIDIA_VENDOR or (vendor and vendor in nr1_ids):
            evidence.append(f"label {key}=true")
            hits[GPU if vendor == NVIDIA_VENDOR else NR1] = True
    for resource in (GPU, NR1):
        if labels.get(ONBOARD_LABEL[resource]) == "true":
            evidence.append(f"label {ONBOARD_LABEL[resource]}=true (onboarded: the DaemonSets land)")
            hits[resource] = True
    for resource in (GPU, NR1):
        if ours[resource] and hits[resource]:
            evidence.append(f"{resource} labels written by {PLUGIN_MANAGER}" if any(
                k.startswith(PLUGIN_PREFIXES[resource]) and k in labels for k in written)
                else f"{resource} pod-resources view reported by accelstack's device plugin "
                     f"({POD_RESOURCES_KEY[resource]})")
    if not any(hits.values()):
        return None
    kept = tuple(f for f in found if hits[f.resource])
    advertised = [f.resource for f in kept if f.capacity or f.allocatable]
    resource = advertised[0] if advertised else kept[0].resource
    mine = ours[resource]
    managed_by = (BY_ACCELSTACK if mine else BY_OTHER) if advertised and resource in advertised else BY_NONE
    model = next(f.model for f in kept if f.resource == resource)
    conditions = {c.get("type") for c in status.get("conditions") or () if isinstance(c, Mapping)}
    return Detection(str(meta.get("name") or ""), str(meta.get("uid") or ""), resource, kept, tuple(evidence), mine,
                     managed_by, model, labels.get(ONBOARD_LABEL[resource]) == "true",
                     NPD_CONDITION[resource] in conditions, reports[resource], bool(selector and selector(labels)))


# ---- the objects -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Holder:
    """A pod bound to the node that requests devices there (live: not Succeeded or Failed)."""

    namespace: str
    name: str
    gpr: str  # the GPR's name ("" for a pod outside any GPR)
    resource: str
    count: int


def _managed_condition(d: Detection) -> tuple[str, str, str]:
    if d.managed_by == BY_ACCELSTACK:
        return "True", "AccelstackDevicePlugin", \
            f"accelstack's device plugin labelled the node and {d.resource} is advertised"
    if d.managed_by == BY_OTHER:
        return "False", "OtherDevicePlugin", \
            f"{d.resource} is advertised by a device plugin that is not accelstack's (no labels by {PLUGIN_MANAGER})"
    if d.ours:
        return "False", "NoDevicePlugin", \
            f"accelstack's device plugin labelled the node but no {d.resource} is advertised (not registered)"
    return "False", "NoDevicePlugin", f"no device plugin advertises {d.resource}"


def _detected_reason(d: Detection) -> str:
    first = d.evidence[0]
    if " advertised " in first:
        return "ResourceAdvertised"
    if first.startswith(f"label {NFD_PCI}"):
        return "PCILabels"
    return "FeatureLabels"


# ---- onboarding ------------------------------------------------------------------------------------------------
ONBOARD_STEPS = ("Labelling", "WaitingForDevicePlugin", "WaitingForNodeProblemDetector", "WaitingForPodResources",
                 "InventoryMatch")
HANDOVER_DOC = "docs/nodes.md#handing-over-from-another-device-plugin"


def onboard_why(d: Detection, obj: Mapping[str, Any] | None) -> str:
    """Why ``d``'s node is onboarded ("" for not), the first that holds: ``requested`` (``spec.onboard``:
    ``kubectl accelstack node onboard``), ``selector`` (the controller's ``--onboard-selector``), ``accelstack``
    (accelstack's device plugin serves it already), ``label`` (its landing label is on, put by hand). Never while
    a deboard request stands."""
    if obj is not None and deboard_request(obj) is not None:
        return ""
    if obj is not None and isinstance((obj.get("spec") or {}).get("onboard"), Mapping):
        return "requested"
    if d.selected:
        return "selector"
    if d.managed_by == BY_ACCELSTACK:
        return "accelstack"
    return "label" if d.onboard_label else ""


ADOPTED_LABEL = "accelstack.io/adopted-on"  # on a GPR made for a pod that ran before onboarding: the node


def adopts_pods(obj: Mapping[str, Any] | None) -> bool:
    """The onboard request asks for an automatic GPR for each pod already holding devices (``adoptPods``)."""
    onboard = ((obj or {}).get("spec") or {}).get("onboard")
    return isinstance(onboard, Mapping) and onboard.get("adoptPods") is True


def adopted_name(pod: str) -> str:
    """The GPR made for pod ``pod``: its name, cut to a label value's 63 characters with a hash when longer (the
    pod carries it in ``accelstack.io/gpr``)."""
    if len(pod) <= gr.MAX_NAME:
        return pod
    digest = hashlib.sha256(pod.encode()).hexdigest()[:8]
    return f"{pod[:gr.MAX_NAME - 9].rstrip('-.')}-{digest}"


def adopted_gpr(h: Holder, node: str) -> dict[str, Any]:
    """An automatic GPR for a pod that already runs on ``node``: one node of its devices. The GPR pass places it
    where the pod runs (its pod is bound there) and it is Running at once; the queue, quotas and the portal see it."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUProvisioningRequest",
            "metadata": {"name": adopted_name(h.name), "namespace": h.namespace,
                         "labels": {"accelstack.io/auto-gpr": "true", ADOPTED_LABEL: node},
                         "annotations": {"accelstack.io/adopted-pod": h.name}},
            "spec": {"resource": h.resource, "devicesPerNode": h.count, "nodeCount": 1}}


def to_adopt(d: Detection, holders: Iterable[Holder], obj: Mapping[str, Any] | None,
             status: Mapping[str, Any]) -> list[Holder]:
    """The pods outside any GPR that hold devices on an onboarded (Managed) node whose request asks to adopt them."""
    if status.get("phase") != "Managed" or not adopts_pods(obj):
        return []
    return sorted((h for h in holders if not h.gpr and h.resource == d.resource), key=lambda h: (h.namespace, h.name))


def onboard_step(d: Detection, allocated: int, onboarded: bool) -> tuple[int, str, str]:
    """The first onboarding step not done yet: (its number from 1, its reason, what it waits for); number 0 and
    reason ``Onboarded`` when all are. ``allocated``: devices of ``d.resource`` held by live pods bound there (the
    inventory's view); ``onboarded``: the node was Onboarded before, so only the label and the plugin are asked
    again (pods come and go faster than the plugin reports the kubelet's view: no flapping back to Onboarding)."""
    res, label = d.resource, ONBOARD_LABEL[d.resource]
    if not d.onboard_label:
        return 1, "Labelling", f"labelling the node {label}=true so the DaemonSets land"
    if d.managed_by == BY_OTHER:
        return 2, "WaitingForDevicePlugin", (
            f"{res} is still advertised by another device plugin, not accelstack's: stop that plugin on this node so "
            f"accelstack's registers ({HANDOVER_DOC})")
    if d.managed_by == BY_NONE:
        return 2, "WaitingForDevicePlugin", (
            f"waiting for accelstack's device plugin to register {res} with the kubelet and label the node")
    done = (f"onboarded: accelstack's device plugin serves {d.devices} {res}; node-problem-detector reported and "
            f"the kubelet's pod-resources view matched the pods bound here")
    if onboarded:
        return 0, "Onboarded", done
    if not d.npd:
        return 3, "WaitingForNodeProblemDetector", (
            f"waiting for node-problem-detector's {NPD_CONDITION[res]} condition on the node")
    pr = d.podres
    if pr is None or (pr.resource and pr.resource != res):
        return 4, "WaitingForPodResources", (
            f"waiting for accelstack's device plugin to report the kubelet's pod-resources view of {res} "
            f"(annotation {POD_RESOURCES_KEY[res]})")
    if pr.error:
        return 4, "PodResourcesUnreadable", f"the device plugin cannot read the kubelet's pod-resources view: {pr.error}"
    if pr.unknown:
        return 5, "DeviceIDsDiffer", (
            f"{pr.unknown} {res} in use were handed out by the previous plugin under IDs accelstack's plugin does "
            f"not serve: it withholds its free devices until those pods end ({HANDOVER_DOC})")
    if pr.in_use != allocated:
        return 5, "InventoryMismatch", (
            f"the kubelet lists {pr.in_use} {res} in use; the pods bound here request {allocated}")
    return 0, "Onboarded", done


def _onboard(d: Detection, why: str, allocated: int, previous: Mapping[str, Any], now: str,
             timeout_s: float) -> tuple[str, tuple[str, str, str], dict[str, Any] | None]:
    """(phase, the Onboarded condition, status.onboard) of a node as onboarding sees it."""
    if not why:
        hint = (f"; it is served by another device plugin: read {HANDOVER_DOC} first" if d.managed_by == BY_OTHER
                else "")
        return "Detected", ("False", "NotRequested",
                            f"not onboarded: kubectl accelstack node onboard {d.node}{hint}"), None
    was = {c.get("type"): c for c in previous.get("conditions") or () if isinstance(c, Mapping)}.get("Onboarded")
    step, reason, message = onboard_step(d, allocated, bool(was and was.get("status") == "True"))
    kept = previous.get("onboard") if isinstance(previous.get("onboard"), Mapping) else {}
    since = str((kept or {}).get("since") or now)
    if not step:
        done = str((kept or {}).get("completedAt") or now)
        return "Managed", ("True", reason, message), {"since": since, "by": why, "completedAt": done}
    late = (gr.parse_time(now) or 0.0) - (gr.parse_time(since) or 0.0) > timeout_s
    progress = {"since": since, "by": why, "step": f"{step}/{len(ONBOARD_STEPS)} {ONBOARD_STEPS[step - 1]}"}
    if late:
        return "Failed", ("False", reason, f"{message} (onboarding for longer than {timeout_s:.0f} s)"), progress
    return "Onboarding", ("False", reason, message), progress


def desired_status(d: Detection, holders: Iterable[Holder], generation: int, previous: Mapping[str, Any],
                   now: str, why: str = "", timeout_s: float = ONBOARD_TIMEOUT_S) -> dict[str, Any]:
    """The status an AcceleratorNode of ``d`` should carry; ``previous`` (its current status) keeps each
    condition's ``lastTransitionTime`` while the condition's status is the same; ``why``: :func:`onboard_why`."""
    rows = sorted(holders, key=lambda h: (h.namespace, h.name, h.resource))
    managed = _managed_condition(d)
    allocated = sum(h.count for h in rows if h.resource == d.resource)
    phase, onboarded, progress = _onboard(d, why, allocated, previous, now, timeout_s)
    conds = [("Detected", "True", _detected_reason(d), "; ".join(d.evidence)[:1000]), ("Managed", *managed),
             ("Onboarded", *onboarded)]
    before = {c.get("type"): c for c in previous.get("conditions") or () if isinstance(c, Mapping)}
    conditions = []
    for kind, state, reason, message in conds:
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == state else None
        conditions.append({"type": kind, "status": state, "reason": reason, "message": message,
                           "lastTransitionTime": since or now})
    return {
        "observedGeneration": generation,
        "phase": phase,
        "resource": d.resource,
        "managedBy": d.managed_by,
        "model": d.model,
        "reason": onboarded[1] if why else managed[1],
        "deviceCount": d.devices,
        "allocated": allocated,
        "holderCount": len(rows),
        "devices": [{"resource": f.resource, "capacity": f.capacity, "allocatable": f.allocatable,
                     "labelled": f.labelled, **({"model": f.model} if f.model else {})} for f in d.found],
        "evidence": list(d.evidence),
        "holders": [{"namespace": h.namespace, "name": h.name, **({"gpr": h.gpr} if h.gpr else {}),
                     "resource": h.resource, "count": h.count} for h in rows[:MAX_HOLDERS]],
        "conditions": conditions,
        **({"onboard": progress} if progress else {}),
    }


def desired_object(d: Detection) -> dict[str, Any]:
    """A new AcceleratorNode for ``d``: named as the node, owned by it (deleted with it by the garbage collector).
    Its status goes in a second write (the status subresource ignores it on create)."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": d.node, "labels": {"app.kubernetes.io/managed-by": "accelstack-controller"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": d.node, "uid": d.uid,
                                              "blockOwnerDeletion": False}]},
            "spec": {}}


def owner_uid(obj: Mapping[str, Any]) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("kind") == "Node":
            return str(ref.get("uid") or "")
    return ""


@dataclass
class Plan:
    create: list[dict[str, Any]] = field(default_factory=list)  # new objects (their status follows in statuses)
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> status to write
    delete: list[tuple[str, str]] = field(default_factory=list)  # (name, uid) of objects no node wants
    label: dict[str, str] = field(default_factory=dict)  # node -> the landing label to put on (onboarding)
    adopt: dict[str, list[Holder]] = field(default_factory=dict)  # node -> pods to give an automatic GPR

    @property
    def writes(self) -> int:
        return len(self.create) + len(self.statuses) + len(self.delete)


@dataclass(frozen=True)
class NodeBits:
    """What deboarding needs of any Node (accelerator node or not: a Deboarded node may show no evidence left):
    its UID, whether it carries the deboarding taint, and which of the DaemonSets' labels it has."""

    uid: str
    tainted: str | None  # the deboarding taint's value, None without it
    labels: tuple[str, ...]


def node_bits(node: Mapping[str, Any]) -> NodeBits:
    meta = node.get("metadata") or {}
    value = next((str(t.get("value") or "") for t in (node.get("spec") or {}).get("taints") or ()
                  if isinstance(t, Mapping) and t.get("key") == DEBOARD_TAINT), None)
    labels = meta.get("labels") or {}
    return NodeBits(str(meta.get("uid") or ""), value, tuple(k for k in LANDING_LABELS if k in labels))


USAGE_FIELDS = ("allocated", "holderCount", "holders")


def usage_only(previous: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether ``status`` changes nothing of ``previous`` but what pods hold there (``allocated``,
    ``holderCount``, ``holders``): a write the controller may pace (a phase, condition or deboard step never is)."""
    if not previous:
        return False

    def rest(st: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in st.items() if k not in USAGE_FIELDS}

    return not status_differs(rest(previous), rest(status))


def plan(nodes: Mapping[str, Detection], holders: Mapping[str, list[Holder]],
         existing: Mapping[str, Mapping[str, Any]], now: str,
         bits: Mapping[str, NodeBits] | None = None, timeout_s: float = ONBOARD_TIMEOUT_S) -> Plan:
    """What to create, write and delete so that the AcceleratorNodes match the accelerator nodes ``nodes``, and
    which nodes to label for onboarding. An object with a deboard request stays while its node does (``bits``:
    every Node), evidence or not: a Deboarded node's labels are gone by design."""
    out = Plan()
    bits = bits or {}
    clock = gr.parse_time(now) or 0.0
    for name, obj in sorted(existing.items()):
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        d = nodes.get(name)
        b = bits.get(name)
        if d is None and deboard_request(obj) is not None and b is not None and b.uid == owner_uid(obj):
            was: Mapping[str, Any] = obj.get("status") or {}
            base = {**was, "conditions": [c for c in was.get("conditions") or () if isinstance(c, Mapping)]}
            kept = deboard_status(base, deboard_request(obj), b.tainted is not None,  # type: ignore[arg-type]
                                  holders.get(name, ()), b.labels, was, clock)
            if status_differs(was, kept):
                out.statuses[name] = kept
            continue
        if d is None or (d.uid and owner_uid(obj) != d.uid):  # gone, no longer one, or a new node of that name
            out.delete.append((name, str(meta.get("uid") or "")))
    gone = {n for n, _ in out.delete}
    for name, d in sorted(nodes.items()):
        have = existing.get(name)
        if name in gone or (have is not None and (have.get("metadata") or {}).get("deletionTimestamp")):
            continue  # created again by a pass after the delete is seen
        if have is None:
            out.create.append(desired_object(d))
        previous: Mapping[str, Any] = (have or {}).get("status") or {}
        generation = int(((have or {}).get("metadata") or {}).get("generation") or 1)
        why = onboard_why(d, have)
        if why and not d.onboard_label:
            out.label[name] = ONBOARD_LABEL[d.resource]
        status = desired_status(d, holders.get(name, ()), generation, previous, now, why, timeout_s)
        want = deboard_request(have) if have is not None else None
        if want is not None:
            b = bits.get(name) or NodeBits(d.uid, None, ())
            status = deboard_status(status, want, b.tainted is not None, holders.get(name, ()), b.labels, previous,
                                    clock)
        pods = to_adopt(d, holders.get(name, ()), have, status)
        if pods:
            out.adopt[name] = pods
        if have is None or status_differs(previous, status):
            out.statuses[name] = status
    return out


# ---- deboarding ------------------------------------------------------------------------------------------------
_DURATION = {"s": 1, "m": 60, "h": 3600}


def parse_grace(text: str) -> float:
    """``90s``, ``10m``, ``1h30m`` (or plain seconds) -> seconds; ValueError naming the value otherwise (at most
    7 days: a deboard is an operation, not a schedule)."""
    raw = str(text).strip()
    if raw.isdigit():
        total = float(raw)
    else:
        total, num, rest = 0.0, "", raw
        for ch in rest:
            if ch.isdigit():
                num += ch
            elif ch in _DURATION and num:
                total, num = total + int(num) * _DURATION[ch], ""
            else:
                raise ValueError(f"not a duration like 10m or 1h30m: {text!r}")
        if num or not raw:
            raise ValueError(f"not a duration like 10m or 1h30m: {text!r}")
    if total > MAX_GRACE_S:
        raise ValueError(f"grace {text!r} is longer than 7 days")
    return total


@dataclass(frozen=True)
class Deboard:
    """A deboard request as ``spec.deboard`` carries it: the grace (seconds) and when it was asked for."""

    grace_s: float
    requested_at: float

    @property
    def until(self) -> int:
        return math.ceil(self.requested_at + self.grace_s)


def deboard_request(obj: Mapping[str, Any]) -> Deboard | None:
    """The AcceleratorNode's deboard request (None: none, or one the schema would have refused)."""
    spec = (obj.get("spec") or {}).get("deboard")
    if not isinstance(spec, Mapping):
        return None
    try:
        grace = parse_grace(str(spec.get("grace") or "0s"))
        at = gr.parse_time(str(spec.get("requestedAt") or ""))
    except ValueError:
        return None
    if at is None:
        return None
    return Deboard(grace, at)


def deboard_until(taints: Iterable[Mapping[str, Any]]) -> float | None:
    """The end of the grace a Node's deboarding taint carries (None: not deboarding; inf: a value that is not a
    time, so running work stays until the controller writes it right)."""
    for taint in taints:
        if isinstance(taint, Mapping) and taint.get("key") == DEBOARD_TAINT:
            value = str(taint.get("value") or "")
            return float(value) if value.isdigit() else math.inf
    return None


def node_patch(node: Mapping[str, Any], want: Deboard | None, deboarded: bool) -> dict[str, Any] | None:
    """The merge patch that makes ``node`` carry what its deboard request asks (None: nothing to change): the
    taint while a request stands (its value the grace's end), gone once it is withdrawn; the DaemonSets' labels
    removed once Deboarded. The patch carries the Node's resourceVersion (a compare-and-swap: the taint list is
    replaced whole, so a taint someone added meanwhile must not be lost)."""
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    taints = [t for t in spec.get("taints") or () if isinstance(t, Mapping)]
    others = [dict(t) for t in taints if t.get("key") != DEBOARD_TAINT]
    mine = [t for t in taints if t.get("key") == DEBOARD_TAINT]
    body: dict[str, Any] = {}
    if want is not None:
        taint = {"key": DEBOARD_TAINT, "value": str(want.until), "effect": "NoSchedule"}
        if mine != [taint]:
            body["spec"] = {"taints": [*others, taint]}
    elif mine:
        body["spec"] = {"taints": others or None}
    labels = meta.get("labels") or {}
    if want is not None and deboarded:
        gone = {k: None for k in LANDING_LABELS if k in labels}
        if gone:
            body["metadata"] = {"labels": gone}
    if not body:
        return None
    body.setdefault("metadata", {})["resourceVersion"] = str(meta.get("resourceVersion") or "")
    return body


def deboard_status(status: dict[str, Any], want: Deboard, tainted: bool, holders: Iterable[Holder],
                   labelled: Iterable[str], previous: Mapping[str, Any], now: float) -> dict[str, Any]:
    """``status`` (what detection says) turned into a deboarding node's: phase Deboarding while the taint is not
    on yet or pods hold devices there, Deboarded once none do and the DaemonSets' labels are gone; ``deboard``
    says the progress and a ``Deboarding`` condition why."""
    rows = list(holders)
    gprs = sorted({h.gpr for h in rows if h.gpr})
    left = sorted({f"{h.namespace}/{h.name}" for h in rows})
    labels = sorted(set(labelled) & set(LANDING_LABELS))
    past = now >= want.until
    if not tainted:
        phase, reason, message = "Deboarding", "Tainting", f"tainting the node {DEBOARD_TAINT}:NoSchedule"
    elif left:
        phase = "Deboarding"
        reason = "EvictionPending" if past else "GracePeriod"
        message = (f"{len(left)} pod(s) still hold devices (" + ", ".join(left[:5]) + ("..." if len(left) > 5 else "")
                   + (") past the grace: evicted through the Eviction API; a PodDisruptionBudget that forbids it "
                      "keeps them" if past else f") until the grace ends at {gr.rfc3339(want.until)}"))
    elif labels:
        phase, reason, message = "Deboarding", "RemovingLabels", "removing the DaemonSets' labels: " + ", ".join(labels)
    else:
        phase, reason, message = "Deboarded", "Deboarded", "no pod holds devices here; the DaemonSets' labels are " \
            "removed; the node stays tainted until the request is withdrawn"
    old = {c.get("type"): c for c in previous.get("conditions") or () if isinstance(c, Mapping)}.get("Deboarding")
    kept = (old or {}).get("lastTransitionTime") if (old or {}).get("status") == "True" else None
    conditions = [c for c in status["conditions"] if c["type"] != "Deboarding"]
    conditions.append({"type": "Deboarding", "status": "True", "reason": reason, "message": message[:1000],
                       "lastTransitionTime": kept or gr.rfc3339(now)})
    since = ((previous.get("deboard") or {}).get("since")) or gr.rfc3339(want.requested_at)
    return {**status, "phase": phase, "reason": reason, "conditions": conditions,
            "deboard": {"since": since, "until": gr.rfc3339(want.until), "podsLeft": len(left),
                        "gprsLeft": len(gprs), "pods": left[:MAX_HOLDERS]}}
