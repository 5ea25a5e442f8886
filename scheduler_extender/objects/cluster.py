"""The extender's view of the cluster, fed by informers: nodes (allocatable managed devices, health, ledger),
pods that request managed resources, and GPRs (phase, priority, reservation).

Everything here is plain data and pure functions of it; the HTTP verbs read it, informers and the binder
write it. Node health comes from what node health sets: the conditions ``GPUUnhealthy``/``NR1Unhealthy``
(True) for their resource and the taint ``accelstack.io/unhealthy`` for every managed resource.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from kubeapi.collector import collector_paused
from scheduler_extender.objects import ledger
from scheduler_extender.objects.gpr_codec import ALLOCATION_ANNOTATION, TERMINAL_PHASES, parse_duration
from scheduler_extender.objects.podfit import NODE_NAME_FIELD, REQUIRED_AFFINITY, label_keys
from scheduler_extender.objects.resources import host_allocatable, host_requests, pod_requests, whole
from service.loop import let_go, slices

GPU, NR1 = "nvidia.com/gpu", "neureality.com/nr1"
GPR_LABEL = "accelstack.io/gpr"
# on a pod the webhook admitted directly, without a GPR (``accelstack-extender --auto-gpr-direct``): "true"
DIRECT_LABEL = "accelstack.io/direct"
UNHEALTHY_TAINT = "accelstack.io/unhealthy"
CONDITION_FOR = {"GPUUnhealthy": GPU, "NR1Unhealthy": NR1}
HOLDING = ("Admitted", "Running")
LEDGER_SOURCES = ("node", "memory")  # where a node's ledger is kept (ClusterView)
Held = dict[str, dict[str, ledger.Entry]]  # node -> pod UID -> ledger entry
ALLOCATED = (*HOLDING, "Evicting")  # phases whose reservation still takes devices
MODEL_LABEL = {GPU: "nvidia.com/gpu.product", NR1: "accelstack.io/nr1.product"}  # the device plugins' node labels
CAPACITY_LABELS = (MODEL_LABEL[GPU], "nvidia.com/gpu.memory", MODEL_LABEL[NR1], "kubernetes.io/hostname")
# The node lifecycle controller's taints on a node whose kubelet stopped answering (kube-scheduler places nothing
# there, whatever the effect, unless a pod tolerates them)
OUT_OF_SERVICE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
TERMINAL_POD_PHASES = ("Succeeded", "Failed")
# reasons of a Queued GPR that waits for something other than free devices: GPRs behind it are admitted past it
NOT_WAITING_FOR_DEVICES = ("WorkspaceQuota", "ModelQuota", "Unschedulable", "Backoff")
RELIST_SLICE = 8  # objects of a relist taken between two looks at the clock (a real Node: ~0.1 ms to decode and read)


@dataclass
class NodeView:
    name: str
    allocatable: dict[str, int]
    labels: dict[str, str]
    unhealthy: dict[str, str]  # resource (or "*") -> reason
    ledger: dict[str, ledger.Entry]
    resource_version: str = ""
    ledger_error: str = ""  # the ledger annotation cannot be read: no bind may write it, no GPR is placed here
    used: dict[str, int] = field(default_factory=dict)  # resource -> devices in the ledger
    used_by: dict[tuple[str, str], int] = field(default_factory=dict)  # (gpr, resource) -> devices
    capacity: dict[str, int] = field(default_factory=dict)  # status.capacity (devices the plugin found)
    unhealthy_since: dict[str, str] = field(default_factory=dict)  # resource (or "*") -> when it turned unhealthy
    # why the node takes no new reservation, though its devices are fine: cordoned, not Ready, or tainted by the
    # node lifecycle controller (kube-scheduler would place no pod there); "" when it takes work
    closed: str = ""
    taints: tuple[dict[str, Any], ...] = ()  # spec.taints that keep pods off (NoSchedule, NoExecute)
    # allocatable (CPU millicores, memory MiB): what kube-scheduler's NodeResourcesFit gives pods; None when the
    # node states neither
    host: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # aggregated once per node update, so filter and bind read them in O(1) per node
        for entry in self.ledger.values():
            for resource, count in entry.requests.items():
                self.used[resource] = self.used.get(resource, 0) + count
                if entry.gpr:
                    key = (entry.gpr, resource)
                    self.used_by[key] = self.used_by.get(key, 0) + count

    def health_reason(self, resource: str) -> str:
        if not self.unhealthy:
            return ""
        return self.unhealthy.get(resource) or self.unhealthy.get("*", "")

    def same_capacity(self, other: NodeView, labels: Iterable[str] = ()) -> bool:
        """Whether the GPR controller would see no difference: allocatable, health, ledger, taints (what pods must
        tolerate), the device model labels and the ``labels`` given (those pods select nodes by). Other labels
        do not count: GPU feature discovery rewrites ``nvidia.com/gfd.timestamp`` on every node every minute."""
        return (self.allocatable == other.allocatable and self.host == other.host and self.unhealthy == other.unhealthy
                and self.closed == other.closed
                and self.ledger == other.ledger and self.ledger_error == other.ledger_error
                and self.taints == other.taints
                and all(self.labels.get(k) == other.labels.get(k) for k in CAPACITY_LABELS)
                and all(self.labels.get(k) == other.labels.get(k) for k in labels))


@dataclass
class GPRView:
    key: str  # namespace/name
    phase: str
    priority: int
    preemptible: bool
    enable_eviction: bool
    resource: str
    reservation: dict[str, int]  # node -> devices
    uid: str = ""
    created: str = ""  # metadata.creationTimestamp (RFC 3339 sorts as text)
    devices: int = 1  # spec.devicesPerNode
    nodes: int = 1  # spec.nodeCount
    end: float = float("inf")  # admittedAt + exitDuration while it holds devices (inf when unbounded)
    estimated_start: float | None = None  # status.estimatedStart while Queued
    estimated_range: tuple[float, float] | None = None  # status.estimatedStartRange (P10, P90) while Queued
    queue_position: int | None = None  # status.queuePosition while Queued (the controller's order)
    reason: str = ""  # status.reason: why it is where it is (why it waits, while Queued)
    resource_version: str = ""  # metadata.resourceVersion


@dataclass
class PodView:
    uid: str
    namespace: str
    name: str
    node: str
    phase: str
    gpr: str  # namespace/name, "" if none
    requests: dict[str, int]
    priority: int
    labels: dict[str, str] = field(default_factory=dict)
    gates: tuple[str, ...] = ()  # spec.schedulingGates names
    terminating: bool = False  # metadata.deletionTimestamp is set
    ended_at: float = 0.0  # latest container finishedAt (epoch seconds) once a container ended, else 0
    # when it was bound (epoch seconds), 0 while it is not: the allocation annotation's time where accelstack's
    # bind verb bound it, else the end of the second of its PodScheduled condition (kube-scheduler's Binding)
    bound_at: float = 0.0
    affinity: dict[str, Any] | None = None  # spec.affinity as sent, for narrowing before the gate is lifted
    tolerations: tuple[dict[str, Any], ...] = ()  # spec.tolerations
    node_selector: dict[str, str] | None = None  # spec.nodeSelector
    host: tuple[int, int] = (0, 0)  # effective CPU (millicores) and memory (MiB) request (resources.host_requests)
    pinned: str = ""  # the one node its required node affinity allows by name (pinned_node), "" for none or several
    # admitted directly by the webhook, without a GPR (label accelstack.io/direct, no GPR label): its devices on
    # its pinned node are taken from its admission on, as a bound pod's are
    direct: bool = False

    @property
    def place(self) -> str:
        """The node whose devices the pod takes: where it is bound, or for a pod admitted directly and not bound
        yet, the node it is pinned to ("" for none)."""
        return self.node or (self.pinned if self.direct and not self.terminating else "")

    @property
    def live(self) -> bool:
        """Still holds (or may yet hold) its devices: not Succeeded or Failed."""
        return self.phase not in TERMINAL_POD_PHASES

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def node_view(obj: dict[str, Any], resources: Iterable[str]) -> NodeView:
    meta, status, spec = obj.get("metadata", {}), obj.get("status") or {}, obj.get("spec") or {}
    allocatable, capacity = _devices(status.get("allocatable"), resources), _devices(status.get("capacity"), resources)
    unhealthy: dict[str, str] = {}
    since: dict[str, str] = {}
    for cond in status.get("conditions") or []:
        sick = CONDITION_FOR.get(cond.get("type", ""))
        if sick and cond.get("status") == "True":
            unhealthy[sick] = f"{cond['type']}: {cond.get('message') or cond.get('reason') or 'True'}"
            since[sick] = str(cond.get("lastTransitionTime") or "")
    for taint in spec.get("taints") or []:
        if taint.get("key") == UNHEALTHY_TAINT:
            unhealthy["*"] = f"tainted {UNHEALTHY_TAINT}"
            since["*"] = str(taint.get("timeAdded") or "")
    annotations = meta.get("annotations") or {}
    error = ""
    try:
        entries = ledger.parse(annotations.get(ledger.LEDGER_ANNOTATION))
    except (ValueError, KeyError, TypeError) as exc:
        entries = {}
        error = f"unreadable {ledger.LEDGER_ANNOTATION} annotation ({str(exc)[:120]})"
    return NodeView(meta.get("name", ""), allocatable, dict(meta.get("labels") or {}), unhealthy, entries,
                    meta.get("resourceVersion", ""), error, capacity=capacity, unhealthy_since=since,
                    closed=closed_reason(spec, status), host=host_allocatable(status.get("allocatable")),
                    taints=tuple(t for t in spec.get("taints") or []
                                 if isinstance(t, dict) and t.get("effect") in ("NoSchedule", "NoExecute")))


def closed_reason(spec: dict[str, Any], status: dict[str, Any]) -> str:
    """Why kube-scheduler would place no new pod on the node though its devices are fine: cordoned
    (``spec.unschedulable``), its Ready condition not True (a node without one is taken as ready), or a taint of
    the node lifecycle controller; "" when it takes work. Only the reason, never a heartbeat time: a status
    heartbeat changes nothing here."""
    if spec.get("unschedulable"):
        return "cordoned (spec.unschedulable)"
    for cond in status.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready" and cond.get("status") != "True":
            return f"not Ready ({cond.get('reason') or cond.get('status') or 'Unknown'})"
    for taint in spec.get("taints") or []:
        if isinstance(taint, dict) and taint.get("key") in OUT_OF_SERVICE_TAINTS:
            return f"tainted {taint['key']}"
    return ""


def _devices(counts: Any, resources: Iterable[str]) -> dict[str, int]:
    """Whole devices per managed resource from a node's ``status.allocatable`` or ``status.capacity``."""
    out: dict[str, int] = {}
    for resource in resources:
        value = (counts or {}).get(resource) if isinstance(counts, dict) else None
        if value is not None:
            try:
                out[resource] = whole(value, resource)
            except ValueError:
                out[resource] = 0
    return out


def gpr_view(obj: dict[str, Any]) -> GPRView:
    meta, spec, status = obj.get("metadata", {}), obj.get("spec") or {}, obj.get("status") or {}
    reservation = {}
    for item in status.get("reservation") or []:
        try:
            reservation[str(item["node"])] = int(item.get("devices", 0))
        except (KeyError, TypeError, ValueError):
            continue
    def number(key: str, default: int) -> int:
        value = spec.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    end = float("inf")
    admitted, exit_duration = _epoch(status.get("admittedAt")), spec.get("exitDuration")
    if admitted is not None and isinstance(exit_duration, str):
        with contextlib.suppress(ValueError):
            end = admitted + parse_duration(exit_duration)
    return GPRView(
        key=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        phase=str(status.get("phase") or "Queued"),
        priority=number("priority", 100),
        preemptible=bool(spec.get("preemptible", True)),
        enable_eviction=bool(spec.get("enableEviction", False)),
        resource=str(spec.get("resource", GPU)),
        reservation=reservation,
        uid=str(meta.get("uid") or ""),
        created=str(meta.get("creationTimestamp") or ""),
        devices=number("devicesPerNode", 1),
        nodes=number("nodeCount", 1),
        end=end,
        estimated_start=_epoch(status.get("estimatedStart")),
        estimated_range=_range(status.get("estimatedStartRange")),
        queue_position=position if isinstance(position := status.get("queuePosition"), int)
        and not isinstance(position, bool) else None,
        reason=str(status.get("reason") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def _revision(version: str) -> int | None:
    """A resourceVersion as a number (etcd's revision, as kube-apiserver writes it), or None when it is not one:
    then nothing is compared."""
    return int(version) if version.isdigit() else None


def _range(value: Any) -> tuple[float, float] | None:
    if not isinstance(value, dict):
        return None
    low, high = _epoch(value.get("earliest")), _epoch(value.get("latest"))
    return (low, high) if low is not None and high is not None else None


def _epoch(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pinned_node(affinity: Any) -> str:
    """The one node a required node affinity allows, when each of its terms names that node, and only it, by
    ``metadata.name In [node]`` (as accelstack's webhook narrows a pod of a GPR to the node it picked); "" when
    it allows none by name or several."""
    if not isinstance(affinity, dict):
        return ""
    required = (affinity.get("nodeAffinity") or {}).get(REQUIRED_AFFINITY) if isinstance(
        affinity.get("nodeAffinity"), dict) else None
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms:
        return ""
    node = ""
    for term in terms:
        fields = term.get("matchFields") if isinstance(term, dict) else None
        names = [r.get("values") for r in fields or () if isinstance(r, dict) and r.get("key") == NODE_NAME_FIELD
                 and r.get("operator") == "In"]
        if len(names) != 1 or not isinstance(names[0], list) or len(names[0]) != 1 or not isinstance(names[0][0], str):
            return ""
        if node and names[0][0] != node:
            return ""
        node = names[0][0]
    return node


def pod_view(obj: dict[str, Any], resources: Iterable[str]) -> PodView | None:
    """A pod that requests a managed resource, or None."""
    meta, spec = obj.get("metadata", {}), obj.get("spec") or {}
    try:
        requests = pod_requests(spec, resources)
    except ValueError:
        return None
    if not requests:
        return None
    labels = dict(meta.get("labels") or {})
    namespace = meta.get("namespace", "")
    gpr = labels.get(GPR_LABEL, "")
    direct = not gpr and labels.get(DIRECT_LABEL) == "true"
    gates = tuple(str(g.get("name", "")) for g in spec.get("schedulingGates") or [] if isinstance(g, dict))
    status = obj.get("status") or {}
    affinity = spec.get("affinity")
    return PodView(meta.get("uid", ""), namespace, meta.get("name", ""), spec.get("nodeName") or "",
                   status.get("phase", "Pending"), f"{namespace}/{gpr}" if gpr else "",
                   requests, int(spec.get("priority") or 0), labels, gates,
                   terminating=bool(meta.get("deletionTimestamp")), ended_at=_ended_at(status),
                   bound_at=_bound_at(meta.get("annotations") or {}, status) if spec.get("nodeName") else 0.0,
                   affinity=affinity if isinstance(affinity, dict) else None,
                   tolerations=tuple(t for t in spec.get("tolerations") or () if isinstance(t, dict)),
                   node_selector=selector if isinstance(selector := spec.get("nodeSelector"), dict) else None,
                   host=host_requests(spec), pinned=pinned_node(affinity) if gpr or direct else "", direct=direct)


def entry_of(pod: PodView) -> ledger.Entry:
    """The ledger entry of a pod that holds devices (ledger "memory"): since its bind, else now."""
    return ledger.Entry(pod.uid, pod.key, dict(pod.requests), pod.gpr, pod.bound_at or time.time())


def _bound_at(annotations: dict[str, Any], status: dict[str, Any]) -> float:
    """When a bound pod was bound. The API server turns PodScheduled True when it takes a Binding and stamps the
    change to the second: a pod bound at 12:00:00.7 reads 12:00:00, so the end of that second is given, a time
    the bind was never after (a pod then never looks bound before a GPR's admission that came just ahead of it,
    in the same second, which would leave it out of that admission's tally)."""
    text = annotations.get(ALLOCATION_ANNOTATION)
    if isinstance(text, str):  # written by accelstack's own bind verb, where a profile names it
        try:
            value = orjson.loads(text).get("boundAt", 0)
        except (orjson.JSONDecodeError, AttributeError):
            value = 0
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    for condition in status.get("conditions") or ():
        if isinstance(condition, dict) and condition.get("type") == "PodScheduled":
            when = _epoch(condition.get("lastTransitionTime")) if condition.get("status") == "True" else None
            return when + 1.0 if when is not None else 0.0
    return 0.0


def _ended_at(status: dict[str, Any]) -> float:
    """When the pod's last container ended (epoch seconds), 0 when none has."""
    latest = 0.0
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or []:
            terminated = ((cs or {}).get("state") or {}).get("terminated") or {}
            when = terminated.get("finishedAt")
            if isinstance(when, str) and when:
                try:
                    latest = max(latest, dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp())
                except ValueError:
                    continue
    return latest


def model_of(node: NodeView, resource: str) -> str:
    """The model of ``node``'s devices of ``resource``, as its device plugin labels it ("unknown" without)."""
    return node.labels.get(MODEL_LABEL.get(resource, ""), "unknown")


@dataclass(frozen=True)
class Claim:
    """A pod of a GPR that filter sent to one reserved node and whose bind has not recorded it yet (in flight):
    the node's share of the GPR it takes is not offered to the GPR's next pods. kube-scheduler assumes a pod on
    its node between its scheduling cycle and its Binding; this is the extender's side of that."""

    node: str
    gpr: str
    requests: dict[str, int]
    until: float  # the view's clock: a claim whose bind never came (the pod failed a later step) lapses then


class ClusterView:
    """The informers' state of nodes, pods and GPRs, and the device ledger of each node.

    Where the ledger comes from (``ledger``): ``"node"``, each Node's ``accelstack.io/ledger`` annotation (the
    binders write it with conditional patches: any number of binders); ``"memory"``, the pods themselves: every
    live pod bound to a node that asks for devices is recorded there (its Binding carries the allocation), and the
    one active binder adds the pods it is binding (:meth:`set_ledger`) until their Binding shows in the pods. Node
    events then never touch the ledger; a relist of the pods rebuilds it, keeping the entries of pods still being
    bound."""

    def __init__(self, resources: Iterable[str] = (GPU, NR1), ledger: str = "node") -> None:
        if ledger not in LEDGER_SOURCES:
            raise ValueError(f"ledger must be one of {', '.join(LEDGER_SOURCES)}, not {ledger!r}")
        self.resources = tuple(resources)
        self.ledger_source = ledger
        # ledger "memory": node -> pod UID -> entry, what each node's NodeView.ledger holds (shared with the
        # fresh views a relist builds, which read it; only this view changes it)
        self.held: Held = {}
        self.held_at: dict[str, str] = {}  # ledger "memory": pod UID -> the node ``held`` records it on
        self._holding = True  # False in a relist's fresh view: the live view rebuilds ``held`` when it swaps in
        self.nodes: dict[str, NodeView] = {}
        self.gprs: dict[str, GPRView] = {}
        self.pods: dict[str, PodView] = {}  # by UID
        # every pod bound to a node and not finished, managed or not: UID -> (node, CPU millicores, memory MiB),
        # and their sums per node (what kube-scheduler's NodeResourcesFit counts as requested there)
        self.host_of: dict[str, tuple[str, int, int]] = {}
        self.host_used: dict[str, tuple[int, int]] = {}
        self.selector_keys: set[str] = set()  # node labels some pod's nodeSelector or node affinity read (grows only)
        self.reserved: dict[str, dict[str, int]] = {}  # node -> {gpr key: devices} for holding GPRs
        self.recorded: dict[str, str] = {}  # pod UID -> the node whose ledger records devices for it
        # pods of GPRs in flight between filter and the ledger (see Claim): pod UID -> claim, and their sums
        self.claims: dict[str, Claim] = {}
        self.claimed: dict[tuple[str, str, str], int] = {}  # (node, gpr key, resource) -> devices claimed
        self.claim_ttl = 30.0  # seconds; 0 turns claims off (filter then offers every reserved node that fits)
        # pods of GPRs pinned to one node (PodView.pinned), live, ungated and not bound yet: the node's share of
        # their GPR is theirs, as a claim's is, for as long as they wait (they can go nowhere else): pod UID ->
        # (node, gpr key, requests), and their sums by (node, gpr key, resource); pods admitted directly (no
        # GPR) under the key "": the node's free devices they were admitted to
        self._pinned_of: dict[str, tuple[str, str, dict[str, int]]] = {}
        self.pinned: dict[tuple[str, str, str], int] = {}
        # the pins this replica's webhook gave whose pods it has not seen yet: (node, gpr key, resource) -> [(when
        # it lapses, devices)], dropped one by one as the pods arrive (a pod refused after its pin never comes)
        self.pins_ahead: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
        # the CPU (millicores) and memory (MiB) the pods admitted directly to a node request while they wait to be
        # bound there (kube-scheduler counts them only once bound): seen (pod UID -> (node, cpu, mem), and their
        # sums by node) and pinned ahead by this replica's webhook (node -> [(when it lapses, cpu, mem)])
        self._direct_host_of: dict[str, tuple[str, int, int]] = {}
        self._direct_host: dict[str, tuple[int, int]] = {}
        self._direct_host_ahead: dict[str, list[tuple[float, int, int]]] = {}
        self.pin_ttl = 30.0
        self.clock: Callable[[], float] = time.monotonic
        self._next_lapse = math.inf
        self._live: dict[str, set[str]] = {}  # namespace -> keys of its unfinished GPRs (not Complete/Cancelled)
        # resource -> keys of its GPRs that wait for devices to be free (Queued, or no status yet; not those held by a
        # quota, too big for the cluster or backing off, which the controller admits others past)
        self.waiting: dict[str, set[str]] = {}
        # GPRs read afresh ahead of their watch (the filter's catch-up read): key -> that revision; the watch's
        # older events for them are skipped until it catches up, so the view never steps back
        self._ahead: dict[str, int] = {}
        self.version = 0  # counts changes (an index derived from the view knows when it is stale)
        self.nodes_version = 0  # counts changes of nodes alone ...
        self.node_names_version = 0  # ... and of which nodes there are (one added or deleted, a relist)
        self.gprs_version = 0  # ... and of GPRs alone (an index that reads no pods is not stale after a pod event)
        # node -> (the NodeView they were computed for, facts of that node and the reservations on it): kept
        # until the node or a reservation on it changes (filter asks per node per pod). Facts: resource -> devices
        # reserved here and not yet used (what free_for withholds); ("verdict", resource, count) -> filter's
        # verdict for a pod without a GPR (scheduler_extender.extender.verbs)
        self._withheld: dict[str, tuple[NodeView, dict[Any, Any]]] = {}

    # informer callbacks. A relist has two forms: sync_* replaces that part of the view at once; resync_* (what
    # the extender's informers use) builds the replacement aside in slices (:mod:`.loop`), giving the loop back
    # every half millisecond, and swaps it in at once: a relist of 5,000 nodes or 20,000 pods took 0.3-0.4 s of
    # the loop that answers filter and bind. Events of other kinds handled meanwhile apply to the live view.
    def sync_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        self._sync(items, ClusterView._add_node, ClusterView._take_nodes)

    async def resync_nodes(self, items: Sequence[dict[str, Any]]) -> None:
        await self._resync(items, ClusterView._add_node, ClusterView._take_nodes)

    def _sync(self, items: Sequence[dict[str, Any]], add: Callable[[ClusterView, dict[str, Any]], None],
              take: Callable[[ClusterView, ClusterView], dict[str, Any]]) -> None:
        fresh = self._fresh()
        for obj in items:
            add(fresh, obj)
        take(self, fresh)

    async def _resync(self, items: Sequence[dict[str, Any]], add: Callable[[ClusterView, dict[str, Any]], None],
                      take: Callable[[ClusterView, ClusterView], dict[str, Any]]) -> None:
        fresh = self._fresh()
        with collector_paused():
            async for part in slices(items, RELIST_SLICE):
                for obj in part:
                    add(fresh, obj)
            await let_go(take(self, fresh))

    def _add_node(self, obj: dict[str, Any]) -> None:
        self.on_node("ADDED", obj)

    def _add_gpr(self, obj: dict[str, Any]) -> None:
        self.on_gpr("ADDED", obj)

    def _add_pod(self, obj: dict[str, Any]) -> None:
        self.on_pod("ADDED", obj)

    def _fresh(self) -> ClusterView:
        fresh = ClusterView(self.resources, self.ledger_source)
        fresh.held, fresh._holding = self.held, False
        return fresh

    def _take_nodes(self, fresh: ClusterView) -> dict[str, NodeView]:
        """Swap in ``fresh``'s nodes; the replaced ones are returned (to be let go of)."""
        replaced = self.nodes
        self.version += 1
        self.nodes_version += 1
        self.nodes, self.recorded, self._withheld = fresh.nodes, fresh.recorded, {}
        self.node_names_version += 1
        return replaced

    def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        self.nodes_version += 1
        name = obj.get("metadata", {}).get("name", "")
        if kind == "DELETED":
            gone = self.nodes.pop(name, None)
            self._withheld.pop(name, None)
            if gone is not None:
                self.node_names_version += 1
                self._record(gone, None)
            return
        view = node_view(obj, self.resources)
        if self.ledger_source == "memory":  # the ledger is the pods', whatever the annotation says
            view = dataclasses.replace(view, ledger=dict(self.held.get(view.name) or {}), ledger_error="",
                                       used={}, used_by={})
        self.update_node(view)

    # ---- ledger "memory" -------------------------------------------------------------------------------------
    def set_ledger(self, node: str, entries: dict[str, ledger.Entry]) -> None:
        """The one active binder's change of a node's ledger (ledger "memory": what a binder patches onto the Node
        with ledger "node")."""
        for uid in self.held.get(node) or {}:
            if uid not in entries and self.held_at.get(uid) == node:
                del self.held_at[uid]
        if entries:
            self.held[node] = dict(entries)
        else:
            self.held.pop(node, None)
        for uid in entries:
            self.held_at[uid] = node
        self._show(node)

    def _show(self, node: str) -> None:
        """Put ``held``'s entries for ``node`` into its NodeView."""
        view = self.nodes.get(node)
        entries = self.held.get(node) or {}
        if view is not None and view.ledger != entries:
            self.update_node(dataclasses.replace(view, ledger=dict(entries), ledger_error="", used={}, used_by={}))

    def _hold(self, uid: str, pod: PodView | None) -> None:
        """Ledger "memory": record pod ``uid`` where it is bound and live, take it out where it ended, went or was
        deleted; a live pod not bound yet keeps an entry the binder made for it (its Binding is on the way)."""
        if pod is not None and pod.live and not pod.node:
            return
        was = self.held_at.get(uid, "")
        where = pod.node if pod is not None and pod.live else ""
        if was and was != where:
            del self.held_at[uid]
            entries = self.held.get(was)
            if entries is not None and entries.pop(uid, None) is not None:
                if not entries:
                    del self.held[was]
                self._show(was)  # a node the view does not know yet: its ledger is read from ``held`` when it comes
        if where and pod is not None and uid not in self.held.get(where, {}):
            self.held.setdefault(where, {})[uid] = entry_of(pod)
            self.held_at[uid] = where
            self._show(where)

    def _rehold(self, pods: dict[str, PodView]) -> None:
        """Ledger "memory", after a relist of the pods: every live bound pod recorded where it runs, and the
        binder's entries for pods still live and not bound yet kept."""
        held: Held = {}
        for node, entries in self.held.items():
            for uid, entry in entries.items():
                pod = pods.get(uid)
                if pod is not None and pod.live and not pod.node:
                    held.setdefault(node, {})[uid] = entry
        for pod in pods.values():
            if pod.node and pod.live:
                have = self.held.get(pod.node, {}).get(pod.uid)
                held.setdefault(pod.node, {})[pod.uid] = have if have is not None else entry_of(pod)
        touched = set(self.held) | set(held)
        self.held.clear()
        self.held.update(held)  # the same dict: fresh views of a relist in progress read it
        self.held_at = {uid: node for node, entries in held.items() for uid in entries}
        for node in touched:
            self._show(node)

    def update_node(self, view: NodeView) -> None:
        """Take a node's newer state (the binder's own patch responses arrive here too)."""
        self.version += 1
        self.nodes_version += 1
        current = self.nodes.get(view.name)
        if current is not None and current.resource_version and view.resource_version:
            try:
                if int(view.resource_version) < int(current.resource_version):
                    return  # an older event than what we already hold
            except ValueError:
                pass
        self.nodes[view.name] = view
        if current is None:
            self.node_names_version += 1
        if current is None or current.ledger != view.ledger:
            self._record(current, view)

    def _record(self, old: NodeView | None, new: NodeView | None) -> None:
        """Keep :attr:`recorded` in step with a node's ledger going from ``old``'s to ``new``'s."""
        if old is not None:
            for uid in old.ledger:
                if self.recorded.get(uid) == old.name:
                    del self.recorded[uid]
        if new is not None:
            for uid in new.ledger:
                self.recorded[uid] = new.name

    def claim(self, uid: str, node: str, gpr: str, requests: dict[str, int]) -> None:
        """Record that pod ``uid`` of ``gpr`` was sent to ``node`` (replacing its earlier claim)."""
        self.unclaim(uid)
        until = self.clock() + self.claim_ttl
        self.claims[uid] = Claim(node, gpr, dict(requests), until)
        self._next_lapse = min(self._next_lapse, until)
        for resource, count in requests.items():
            key = (node, gpr, resource)
            self.claimed[key] = self.claimed.get(key, 0) + count

    def unclaim(self, uid: str) -> None:
        """Pod ``uid`` is no longer in flight (its ledger entry is written, its bind failed, it is bound or gone)."""
        claim = self.claims.pop(uid, None)
        if claim is None:
            return
        for resource, count in claim.requests.items():
            key = (claim.node, claim.gpr, resource)
            left = self.claimed.get(key, 0) - count
            if left > 0:
                self.claimed[key] = left
            else:
                self.claimed.pop(key, None)

    def lapse_claims(self) -> None:
        """Drop the claims whose bind never came in time (O(1) until the earliest one is due)."""
        now = self.clock()
        if now < self._next_lapse:
            return
        for uid in [uid for uid, claim in self.claims.items() if claim.until <= now]:
            self.unclaim(uid)
        self._next_lapse = min((claim.until for claim in self.claims.values()), default=math.inf)

    def claimed_share(self, node: str, gpr: str, resource: str, mine: Collection[str] = ()) -> int:
        """Devices of ``gpr``'s share on ``node`` that pods in flight hold, not counting the pods ``mine``."""
        count = self.claimed.get((node, gpr, resource), 0)
        if count:
            for uid in mine:
                claim = self.claims.get(uid)
                if claim is not None and claim.node == node and claim.gpr == gpr:
                    count -= claim.requests.get(resource, 0)
        return count

    def _pin(self, uid: str, view: PodView | None) -> None:
        """Keep :attr:`pinned` in step with pod ``uid`` now being ``view`` (None: gone)."""
        old = self._pinned_of.pop(uid, None)
        if uid in self._direct_host_of:
            self._hold_host(uid, None)
        if old is not None:
            node, gpr, requests = old
            for resource, count in requests.items():
                key = (node, gpr, resource)
                left = self.pinned.get(key, 0) - count
                if left > 0:
                    self.pinned[key] = left
                else:
                    self.pinned.pop(key, None)
        if (view is None or not view.pinned or not (view.gpr or view.direct) or view.node or view.gates
                or view.terminating or not view.live):
            return
        self._pinned_of[uid] = (view.pinned, view.gpr, view.requests)
        for resource, count in view.requests.items():
            key = (view.pinned, view.gpr, resource)
            self.pinned[key] = self.pinned.get(key, 0) + count
        if view.direct:
            self._hold_host(uid, (view.pinned, *view.host))

    def _hold_host(self, uid: str, entry: tuple[str, int, int] | None) -> None:
        """Keep the CPU and memory of the pods admitted directly and waiting to be bound in step with pod ``uid``
        now requesting ``entry`` on its node (None: nothing)."""
        old = self._direct_host_of.pop(uid, None)
        if old is not None:
            cpu, mem = self._direct_host.pop(old[0], (0, 0))
            if (cpu - old[1], mem - old[2]) != (0, 0):
                self._direct_host[old[0]] = (cpu - old[1], mem - old[2])
        if entry is not None:
            self._direct_host_of[uid] = entry
            cpu, mem = self._direct_host.get(entry[0], (0, 0))
            self._direct_host[entry[0]] = (cpu + entry[1], mem + entry[2])

    def pinned_host(self, node: str) -> tuple[int, int]:
        """CPU (millicores) and memory (MiB) that pods admitted directly to ``node`` request while they wait to be
        bound there: seen, or pinned ahead by this replica's webhook and not seen yet."""
        cpu, mem = self._direct_host.get(node, (0, 0))
        ahead = self._direct_host_ahead.get(node)
        if ahead:
            now = self.clock()
            while ahead and ahead[0][0] <= now:
                ahead.pop(0)
            cpu += sum(e[1] for e in ahead)
            mem += sum(e[2] for e in ahead)
            if not ahead:
                del self._direct_host_ahead[node]
        return cpu, mem

    def _arrived(self, node: str, gpr: str, requests: dict[str, int]) -> None:
        """A pod pinned to ``node`` is seen pinned for the first time, in whatever state (waiting, or already bound
        when a relist is the first to show it): the webhook's pin ahead of it, if any, is its own and ends."""
        for resource in requests:
            ahead = self.pins_ahead.get((node, gpr, resource))
            if ahead:
                ahead.pop(0)
                if not ahead:
                    del self.pins_ahead[(node, gpr, resource)]
        host = self._direct_host_ahead.get(node) if not gpr else None
        if host:
            host.pop(0)
            if not host:
                del self._direct_host_ahead[node]

    def pin_ahead(self, node: str, gpr: str, requests: dict[str, int], host: tuple[int, int] | None = None) -> None:
        """The webhook pinned a pod of ``gpr`` to ``node``: its share there is the pod's from now on, until the pod
        is seen (then it counts in :attr:`pinned`) or :attr:`pin_ttl` passes (it was never created). A pod admitted
        directly (``gpr`` "") gives ``host``, its CPU and memory request, counted the same way."""
        until = self.clock() + self.pin_ttl
        for resource, count in requests.items():
            self.pins_ahead.setdefault((node, gpr, resource), []).append((until, count))
        if not gpr and host is not None:
            self._direct_host_ahead.setdefault(node, []).append((until, *host))

    def pinned_share(self, node: str, gpr: str, resource: str, own: int = 0) -> int:
        """Devices of ``gpr``'s share on ``node`` that pods pinned there hold while they wait to be bound (seen,
        or pinned by this replica's webhook and not seen yet), less ``own`` (the asking pod's, when it is one of
        them)."""
        count = self.pinned.get((node, gpr, resource), 0)
        ahead = self.pins_ahead.get((node, gpr, resource))
        if ahead:
            now = self.clock()
            while ahead and ahead[0][0] <= now:
                ahead.pop(0)
            count += sum(c for _, c in ahead)
            if not ahead:
                del self.pins_ahead[(node, gpr, resource)]
        return max(0, count - own)

    def sync_gprs(self, items: Sequence[dict[str, Any]]) -> None:
        self._sync(items, ClusterView._add_gpr, ClusterView._take_gprs)

    async def resync_gprs(self, items: Sequence[dict[str, Any]]) -> None:
        await self._resync(items, ClusterView._add_gpr, ClusterView._take_gprs)

    def _take_gprs(self, fresh: ClusterView) -> dict[str, GPRView]:
        replaced = self.gprs
        self.version += 1
        self.gprs_version += 1
        self.gprs, self.reserved, self._live, self._withheld = fresh.gprs, fresh.reserved, fresh._live, {}
        self.waiting = fresh.waiting
        self._ahead = {}  # a relist is the whole truth at its revision; the watch from there brings the rest
        return replaced

    def take_fresher_gpr(self, obj: dict[str, Any]) -> bool:
        """A GPR read afresh from the API server: taken (True) when it is newer than what the watch has brought,
        by resourceVersion; the watch's events older than it are then skipped until the watch catches up."""
        view = gpr_view(obj)
        fresh = _revision(view.resource_version)
        if fresh is None:
            return False
        held = self.gprs.get(view.key)
        if held is not None and (_revision(held.resource_version) or 0) >= fresh:
            return False
        self.on_gpr("MODIFIED", obj)
        self._ahead[view.key] = fresh
        return True

    def on_gpr(self, kind: str, obj: dict[str, Any]) -> None:
        view = gpr_view(obj)
        if self._ahead:
            ahead = self._ahead.get(view.key)
            if ahead is not None:
                revision = _revision(view.resource_version)
                if revision is not None and revision < ahead:
                    return  # the watch brings what the catch-up read already showed a newer version of
                del self._ahead[view.key]
        self.version += 1
        self.gprs_version += 1
        old = self.gprs.pop(view.key, None)
        namespace = view.key.split("/", 1)[0]
        if old is not None:
            for node in old.reservation:
                self.reserved.get(node, {}).pop(old.key, None)
                self._withheld.pop(node, None)
            live = self._live.get(namespace)
            if live is not None:
                live.discard(old.key)
                if not live:
                    del self._live[namespace]
            waits = self.waiting.get(old.resource)
            if waits is not None:
                waits.discard(old.key)
                if not waits:
                    del self.waiting[old.resource]
        if kind == "DELETED":
            return
        self.gprs[view.key] = view
        if view.phase not in TERMINAL_PHASES:
            self._live.setdefault(namespace, set()).add(view.key)
        if view.phase == "Queued" and view.reason not in NOT_WAITING_FOR_DEVICES:
            self.waiting.setdefault(view.resource, set()).add(view.key)
        if view.phase in ALLOCATED:
            for node, devices in view.reservation.items():
                self.reserved.setdefault(node, {})[view.key] = devices
                self._withheld.pop(node, None)

    def sync_pods(self, items: Sequence[dict[str, Any]]) -> None:
        self._sync(items, ClusterView._add_pod, ClusterView._take_pods)

    async def resync_pods(self, items: Sequence[dict[str, Any]]) -> None:
        await self._resync(items, ClusterView._add_pod, ClusterView._take_pods)

    def _take_pods(self, fresh: ClusterView) -> dict[str, PodView]:
        replaced = self.pods
        self.version += 1
        self.pods = fresh.pods
        self.host_of, self.host_used = fresh.host_of, fresh.host_used
        self.selector_keys |= fresh.selector_keys
        self._pinned_of, self.pinned = fresh._pinned_of, fresh.pinned
        self._direct_host_of, self._direct_host = fresh._direct_host_of, fresh._direct_host
        if self.pins_ahead:  # pins whose pods this relist may be the first to show (bound by now, or not)
            for uid, view in self.pods.items():
                if view.pinned and ((was := replaced.get(uid)) is None or not was.pinned):
                    self._arrived(view.pinned, view.gpr, view.requests)
        if self.ledger_source == "memory":
            self._rehold(self.pods)
        return replaced

    def on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        uid = obj.get("metadata", {}).get("uid", "")
        if kind == "DELETED":
            self.pods.pop(uid, None)
            self._host(uid, None)
            self.unclaim(uid)
            self._pin(uid, None)
            if self.ledger_source == "memory" and self._holding:
                self._hold(uid, None)
            return
        view = pod_view(obj, self.resources)
        if view is None:  # no managed resource: only what it requests of its node counts
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            node = spec.get("nodeName") if isinstance(spec, dict) else None
            live = isinstance(status, dict) and status.get("phase") not in TERMINAL_POD_PHASES
            self._host(uid, (node, *host_requests(spec)) if node and isinstance(node, str) and live else None)
            self.pods.pop(uid, None)
        else:
            self._host(uid, (view.node, *view.host) if view.node and view.live else None)
            # first seen pinned: new, or pinned since (a pod held at the gate and pinned by the binder's patch)
            if view.pinned and ((was := self.pods.get(uid)) is None or not was.pinned):
                self._arrived(view.pinned, view.gpr, view.requests)
            self.pods[uid] = view
            if view.node and uid in self.claims:  # bound (by this replica or another): the ledger holds it now
                self.unclaim(uid)
            if view.pinned or uid in self._pinned_of:
                self._pin(uid, view)
            if view.node_selector or view.affinity:
                self.selector_keys |= label_keys(view.node_selector, view.affinity)
        if self.ledger_source == "memory" and self._holding:
            self._hold(uid, view)

    def _host(self, uid: str, entry: tuple[str, int, int] | None) -> None:
        """Keep :attr:`host_used` in step with pod ``uid`` now requesting ``entry`` (None: nothing anywhere)."""
        old = self.host_of.get(uid)
        if old == entry:
            return
        used = self.host_used
        if old is not None:
            del self.host_of[uid]
            cpu, mem = used[old[0]]
            cpu, mem = cpu - old[1], mem - old[2]
            if cpu or mem:
                used[old[0]] = (cpu, mem)
            else:
                del used[old[0]]
        if entry is not None and (entry[1] or entry[2]):
            self.host_of[uid] = entry
            cpu, mem = used.get(entry[0], (0, 0))
            used[entry[0]] = (cpu + entry[1], mem + entry[2])

    # queries
    def unfinished_in(self, namespaces: Iterable[str], exclude: str = "") -> int:
        """GPRs in ``namespaces`` that are not Complete or Cancelled, ``exclude`` (namespace/name) left out: kept
        per namespace, so a webhook that counts them for every GPR created does not scan the whole view."""
        return sum(len(live) - (exclude in live) for ns in set(namespaces) if (live := self._live.get(ns)))

    def reservations_on(self, node: str) -> dict[str, int]:
        return self.reserved.get(node, {})

    def reserved_devices(self, node: str, resource: str) -> int:
        """Devices of ``resource`` that GPRs holding devices have reserved on ``node`` (used or not)."""
        return sum(n for k, n in self.reservations_on(node).items()
                   if k in self.gprs and self.gprs[k].resource == resource)

    def free_for(self, node: NodeView, resource: str, gpr: str) -> int:
        """Devices a pod of ``gpr`` ("" for none) may still take on ``node``."""
        free = node.allocatable.get(resource, 0) - node.used.get(resource, 0)
        reserved = self.reserved.get(node.name)
        if reserved:  # devices reserved for other GPRs and not yet used by them are withheld
            free -= self._unused_reserved(node, resource, reserved)
            if gpr and gpr in reserved:
                own = self.gprs.get(gpr)
                if own is not None and own.resource == resource:  # its own reservation is not withheld from it
                    free += max(0, reserved[gpr] - node.used_by.get((gpr, resource), 0))
                free = min(free, reserved[gpr] - node.used_by.get((gpr, resource), 0))
        return max(0, free)

    def withheld(self, node: NodeView, resource: str) -> int:
        """Devices of ``resource`` on ``node`` that GPRs reserved and have not used yet: what :meth:`free_for`
        withholds from the pods of other GPRs and of none."""
        reserved = self.reserved.get(node.name)
        return self._unused_reserved(node, resource, reserved) if reserved else 0

    def memos(self) -> dict[str, tuple[NodeView, dict[Any, Any]]]:
        """The memo table behind :meth:`node_facts` (node name -> (the NodeView its facts hold for, facts)), for
        loops over hundreds of names that look a fact up inline; an entry counts only while its NodeView is the
        node's current one, and only :meth:`node_facts` adds entries."""
        return self._withheld

    def node_facts(self, node: NodeView) -> dict[Any, Any]:
        """A memo of facts derived from ``node`` and the reservations on it alone: emptied when either changes."""
        hit = self._withheld.get(node.name)
        if hit is None or hit[0] is not node:
            hit = self._withheld[node.name] = (node, {})
        return hit[1]

    def _unused_reserved(self, node: NodeView, resource: str, reserved: dict[str, int]) -> int:
        facts = self.node_facts(node)
        total = facts.get(resource)
        if total is None:
            total = facts[resource] = sum(
                max(0, count - node.used_by.get((other, resource), 0)) for other, count in reserved.items()
                if (view := self.gprs.get(other)) is not None and view.resource == resource)
        return total
