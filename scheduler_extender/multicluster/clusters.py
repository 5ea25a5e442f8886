"""The ``Cluster`` object of the hub as pure functions: what a member's agent reports (the inventory summary of
its own Nodes, AcceleratorNodes and GPRs) and how the hub judges it (Ready / Lost).

Nothing here does I/O or reads a clock: the agent and the hub controller hand in the objects and the time.

Two clocks meet here and only one of them judges. The agent stamps ``lastHeartbeatTime`` with the member's clock;
the hub never compares that value with its own time, it only notices that the value *changed*, and records when
it noticed on its own clock (``observedHeartbeatTime``, with the value it saw in ``observedHeartbeat``). Lost is
"no change seen for ``lost_after`` on the hub's clock", so a member whose clock is a day ahead or behind is judged
exactly as one whose clock is right (Kueue's MultiKueue judges a worker the same way, by the manager's own
observation; so does the Lease-based leader election in :mod:`kubeapi.leader`).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubeapi.resources import Resource
from scheduler_extender.objects.cluster import GPU, NR1, gpr_view, model_of, node_view
from scheduler_extender.objects.gpr_codec import ALLOCATED_PHASES, GROUP, VERSION, parse_time

CLUSTERS = Resource(GROUP, VERSION, "clusters", "Cluster", namespaced=False)
MEMBER_NAMESPACE_PREFIX = "accelstack-member-"  # the member's namespace on the hub: accelstack-member-NAME
MAX_NAME = 63 - len(MEMBER_NAMESPACE_PREFIX)  # so that the namespace name is a DNS label (the CRD says 45)
LOST_AFTER_S = 15 * 60.0  # as Kueue's MultiKueue workerLostTimeout
WAITING_PHASES = ("Pending", "Queued")
ANY_MODEL = "*"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# ---- names and labels ---------------------------------------------------------------------------------------
def check_name(name: str) -> str:
    """A member's name: a DNS label short enough for ``accelstack-member-NAME``; ValueError saying why."""
    if not name or len(name) > MAX_NAME or not _NAME.match(name):
        raise ValueError(f"cluster name {name!r}: want a DNS label (a-z, 0-9, '-') of at most {MAX_NAME} characters")
    return name


def member_namespace(name: str) -> str:
    return MEMBER_NAMESPACE_PREFIX + name


def parse_label(text: str) -> tuple[str, str]:
    """``key=value`` as a Kubernetes label; ValueError naming the bad part."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"label {text!r}: want key=value")
    prefix, slash, name = key.rpartition("/")
    if (slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or \
            not name or len(name) > 63 or not _LABEL_NAME.match(name):
        raise ValueError(f"label {text!r}: {key!r} is not a label key (an optional DNS prefix and '/', then at most "
                         "63 of A-Z a-z 0-9 - _ .)")
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(f"label {text!r}: {value!r} is not a label value (at most 63 of A-Z a-z 0-9 - _ ., "
                         "starting and ending with a letter or digit)")
    return key, value


def cluster_object(name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": CLUSTERS.api_version, "kind": "Cluster",
            "metadata": {"name": check_name(name), "labels": {"app.kubernetes.io/managed-by": "accelstack"}},
            "spec": {"labels": dict(labels)}}


# ---- the member's summary -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeSummary:
    """What the summary needs of one Node, projected when the informer hands it over (a real Node is 15-20 KB;
    the agent keeps this instead, so that a summary over 5,000 nodes is a sum, not a parse)."""
    capacity: dict[str, int]
    allocatable: dict[str, int]
    models: dict[str, str]  # resource -> model
    unhealthy: frozenset[str]  # resources whose devices the node cannot give ("*": all)
    ledger_used: dict[str, int] = field(default_factory=dict)  # devices accelstack's bind recorded


def summarize_node(obj: Mapping[str, Any], resources: Iterable[str] = (GPU, NR1)) -> NodeSummary | None:
    """The projection of a Node; None for a node without any of ``resources`` (not counted)."""
    view = node_view(dict(obj), resources)
    if not view.capacity and not view.allocatable:
        return None
    unhealthy = set(view.unhealthy)
    if view.closed.startswith("not Ready") or "not-ready" in view.closed or "unreachable" in view.closed:
        unhealthy.add("*")
    held = view.capacity | view.allocatable
    return NodeSummary(capacity=dict(view.capacity), allocatable=dict(view.allocatable),
                       models={r: model_of(view, r) for r in held}, unhealthy=frozenset(unhealthy),
                       ledger_used=dict(view.used))


def accelerator_allocated(obj: Mapping[str, Any]) -> tuple[str, str, int] | None:
    """(node, resource, devices held by live pods) from an AcceleratorNode's status; None when it says nothing."""
    status = obj.get("status") or {}
    name = (obj.get("metadata") or {}).get("name")
    allocated, resource = status.get("allocated"), status.get("resource")
    if not isinstance(name, str) or not isinstance(resource, str) or not isinstance(allocated, int) \
            or isinstance(allocated, bool) or allocated < 0:
        return None
    return name, resource, allocated


@dataclass(frozen=True)
class GPRSummary:
    phase: str
    resource: str
    models: tuple[str, ...]
    demand: int  # devicesPerNode x nodeCount
    reservation: dict[str, int]  # node -> devices


def summarize_gpr(obj: Mapping[str, Any]) -> GPRSummary:
    view = gpr_view(dict(obj))
    models = (obj.get("spec") or {}).get("models") or []
    return GPRSummary(view.phase, view.resource, tuple(m for m in models if isinstance(m, str)),
                      view.devices * view.nodes, dict(view.reservation))


def inventory(nodes: Mapping[str, NodeSummary], allocated: Mapping[str, tuple[str, int]],
              gprs: Iterable[GPRSummary]) -> dict[str, Any]:
    """The status fields the agent writes: ``inventory`` (per resource and model: nodes, capacity, allocatable,
    allocated, reserved, unhealthy, queued), ``devices`` (totals for the printer columns) and ``nodes``.

    ``allocated`` is node -> (resource, devices) from the AcceleratorNodes (the kubelet's view of every live pod,
    accelstack's or not); a node without one counts what accelstack's ledger recorded. A waiting GPR's demand
    goes to its model when it names exactly one, else to ``*``."""
    rows: dict[tuple[str, str], dict[str, int]] = {}

    def row(resource: str, model: str) -> dict[str, int]:
        return rows.setdefault((resource, model), {"nodes": 0, "capacity": 0, "allocatable": 0, "allocated": 0,
                                                   "reserved": 0, "unhealthy": 0, "queued": 0})

    for name, node in nodes.items():
        held = allocated.get(name)
        for resource in sorted(node.capacity.keys() | node.allocatable.keys()):
            r = row(resource, node.models.get(resource, "unknown"))
            capacity, allocatable = node.capacity.get(resource, 0), node.allocatable.get(resource, 0)
            capacity = max(capacity, allocatable)
            r["nodes"] += 1
            r["capacity"] += capacity
            r["allocatable"] += allocatable
            sick = resource in node.unhealthy or "*" in node.unhealthy
            r["unhealthy"] += (capacity - allocatable) + (allocatable if sick else 0)
            if held is not None and held[0] == resource:
                r["allocated"] += held[1]
            elif held is None:
                r["allocated"] += node.ledger_used.get(resource, 0)
    for gpr in gprs:
        if gpr.phase in ALLOCATED_PHASES:
            for node_name, devices in gpr.reservation.items():
                where = nodes.get(node_name)
                if where is not None:
                    row(gpr.resource, where.models.get(gpr.resource, "unknown"))["reserved"] += devices
        elif gpr.phase in WAITING_PHASES:
            model = gpr.models[0] if len(gpr.models) == 1 else ANY_MODEL
            row(gpr.resource, model)["queued"] += gpr.demand
    items: list[dict[str, Any]] = [{"resource": res, "model": model, **counts}
                                   for (res, model), counts in sorted(rows.items())]

    def total(resource: str, key: str) -> int:
        return sum(counts[key] for (res, _), counts in rows.items() if res == resource)

    return {"inventory": items, "nodes": len(nodes),
            "devices": {"gpuAllocatable": total(GPU, "allocatable"), "gpuAllocated": total(GPU, "allocated"),
                        "nr1Allocatable": total(NR1, "allocatable"), "nr1Allocated": total(NR1, "allocated")}}


# ---- the hub's judgement ------------------------------------------------------------------------------------
def micro_time(epoch: float) -> str:
    """RFC 3339 with microseconds: two heartbeats within one second still differ."""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Judgement:
    ready: bool
    reason: str
    message: str
    observed_heartbeat: str  # the agent's value the hub has seen
    observed_at: float | None  # the hub's clock when it saw that value change; None: never saw a heartbeat
    next_check: float | None  # the hub's time at which the verdict would change without a new heartbeat


def judge(status: Mapping[str, Any], now: float, lost_after: float = LOST_AFTER_S) -> Judgement:
    """Ready or Lost for one Cluster at the hub's time ``now``, from its status alone (level-triggered: the hub
    keeps nothing in memory, so a restart reaches the same verdict and writes nothing while nothing changed).

    The agent's ``lastHeartbeatTime`` is compared with the ``observedHeartbeat`` the hub recorded, as text: a
    different value is a heartbeat seen now; the same value was seen at ``observedHeartbeatTime`` (hub clock)."""
    beat = str(status.get("lastHeartbeatTime") or "")
    seen = str(status.get("observedHeartbeat") or "")
    seen_at = parse_time(status.get("observedHeartbeatTime"))
    if not beat:
        return Judgement(False, "NoHeartbeat", "the member's agent has not reported yet", "", None, None)
    if beat != seen or seen_at is None:
        seen_at = now  # a heartbeat the hub sees for the first time: it came now, by the hub's clock
    silent = now - seen_at
    if silent >= lost_after:
        return Judgement(False, "HeartbeatMissed",
                         f"no heartbeat seen for {silent:.0f}s (lost after {lost_after:g}s, the hub's clock)",
                         beat, seen_at, None)
    return Judgement(True, "HeartbeatSeen", "the member's agent reports", beat, seen_at, seen_at + lost_after)


def hub_status(current: Mapping[str, Any], verdict: Judgement, now: float) -> dict[str, Any]:
    """The hub's part of the status (conditions Ready and Lost, observedHeartbeat, observedHeartbeatTime), with
    each condition's lastTransitionTime kept while its status stays."""
    old = {c.get("type"): c for c in current.get("conditions") or () if isinstance(c, Mapping)}

    def condition(kind: str, true: bool, reason: str, message: str) -> dict[str, Any]:
        value = "True" if true else "False"
        before = old.get(kind) or {}
        since = before.get("lastTransitionTime") if before.get("status") == value else None
        return {"type": kind, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": since or micro_time(now).split(".")[0] + "Z"}

    lost = verdict.reason == "HeartbeatMissed"
    conditions = [condition("Ready", verdict.ready, verdict.reason, verdict.message),
                  condition("Lost", lost, verdict.reason if lost else "HeartbeatSeen" if verdict.ready else verdict.reason,
                            verdict.message if lost else "")]
    out: dict[str, Any] = {"conditions": conditions}
    if verdict.observed_at is not None:
        out["observedHeartbeat"] = verdict.observed_heartbeat
        out["observedHeartbeatTime"] = (current.get("observedHeartbeatTime")
                                        if verdict.observed_heartbeat == current.get("observedHeartbeat")
                                        and current.get("observedHeartbeatTime")
                                        else micro_time(verdict.observed_at))
    return out


def hub_part_differs(current: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` (the hub's part) would change ``current``: conditions without their times."""
    def strip(status: Mapping[str, Any]) -> Any:
        return ({c.get("type"): {k: v for k, v in c.items() if k != "lastTransitionTime"}
                 for c in status.get("conditions") or () if isinstance(c, Mapping)},
                status.get("observedHeartbeat"), status.get("observedHeartbeatTime"))

    return bool(strip(current) != strip({**current, **new}))


def ready_of(status: Mapping[str, Any]) -> bool | None:
    """The Ready condition as stored: True, False, or None when there is none."""
    for c in status.get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return None
