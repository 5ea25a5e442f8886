"""GPRs across clusters as pure functions: where a hub GPR goes, what the copy on the hub (the *dispatch*) and the
copy in the member look like, how a status travels back, and what happens to a GPR whose member is Lost.

Three objects carry one request (docs/multicluster.md):

- the **origin**, the GPR a user made on the hub in a team namespace (``spec.clusterName`` pins it, or the hub
  picks); ``accelstack-hub`` writes its status and nothing else does.
- the **dispatch**, a copy the hub writes into the chosen member's hub namespace ``accelstack-member-NAME`` (the
  one namespace that member's agent may read), named :func:`dispatch_name` and labelled with the origin's
  namespace, name and UID. The name is a function of the origin alone, so two hub passes (or two hub replicas a
  moment apart) writing with *create* can never make two: the second gets 409.
- the **member GPR**, which the agent creates in its own cluster (same namespace and name as the origin, the
  origin in an annotation, ``clusterName`` removed); the member's own controller admits it, so the member stays
  the only authority over its nodes and nothing is double-booked.

Statuses go the other way: member GPR → dispatch (:func:`mirror`, by the agent) → origin (:func:`origin_status`,
by the hub). Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_extender.multicluster.clusters import (
    ANY_MODEL,
    MEMBER_NAMESPACE_PREFIX,
    member_namespace,
    ready_of,
)
from scheduler_extender.objects.cluster import GPU

ORIGIN_NAMESPACE = "accelstack.io/origin-namespace"  # labels on a dispatch (hub)
ORIGIN_NAME = "accelstack.io/origin-name"
ORIGIN_UID = "accelstack.io/origin-uid"
ORIGIN = "accelstack.io/origin"  # annotation on a member GPR: hub/NAMESPACE/NAME/UID
DISPATCH = "accelstack.io/dispatch"  # annotation on a member GPR: the dispatch's name on the hub
FROM_HUB = "accelstack.io/from-hub"  # label on a member GPR the agent made ("true"): its informer's selector
MAX_GPR_NAME = 63  # the GPR CRD's rule on metadata.name
# What the member's controller writes that the hub shows (the rest, counters and observedGeneration, stay there).
MIRRORED = ("phase", "reason", "message", "queuePosition", "estimatedStart", "estimatedStartRange", "reservation",
            "reservedNodes", "admittedAt", "startedAt", "finishedAt", "conditions")
HUB_CONDITIONS = ("Placed", "Lost", "Replaced")  # the hub's own conditions on an origin
AGENT_CONDITIONS = ("NamespaceMissing", "NameTaken")  # the agent's own conditions on a dispatch
NOT_STARTED = ("", "Queued", "Admitted")  # a member GPR in these phases may be placed again elsewhere
STARTED = ("Running", "Evicting")  # ... in these it may have pods running: reported Lost, never duplicated


# ---- names ------------------------------------------------------------------------------------------------
def dispatch_name(namespace: str, name: str) -> str:
    """``NAMESPACE.NAME``, or when that is longer than a GPR name may be, its first part and a hash of the
    whole: deterministic, so the same origin always has the same dispatch name, and distinct origins distinct
    names (``a.b-c`` and ``a-b.c`` differ, as the dot cannot be in a namespace)."""
    full = f"{namespace}.{name}"
    if len(full) <= MAX_GPR_NAME:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:10]
    head = full[:MAX_GPR_NAME - len(digest) - 1].rstrip("-.")
    return f"{head}-{digest}"


def is_member_namespace(namespace: str) -> bool:
    return namespace.startswith(MEMBER_NAMESPACE_PREFIX)


def origin_of(dispatch: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of a dispatch's origin, from its labels; None when it is not a dispatch."""
    labels = (dispatch.get("metadata") or {}).get("labels") or {}
    ns, name, uid = labels.get(ORIGIN_NAMESPACE), labels.get(ORIGIN_NAME), labels.get(ORIGIN_UID)
    if not (isinstance(ns, str) and ns and isinstance(name, str) and name and isinstance(uid, str) and uid):
        return None
    return ns, name, uid


def dispatch_object(origin: Mapping[str, Any], cluster: str) -> dict[str, Any]:
    """The dispatch of ``origin`` for member ``cluster``: the spec as the user wrote it (``clusterName`` kept, so
    the member's copy can say where it was pinned), the origin in labels."""
    meta = origin.get("metadata") or {}
    ns, name, uid = str(meta.get("namespace") or ""), str(meta.get("name") or ""), str(meta.get("uid") or "")
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": dispatch_name(ns, name), "namespace": member_namespace(cluster),
                         "labels": {ORIGIN_NAMESPACE: ns, ORIGIN_NAME: name, ORIGIN_UID: uid,
                                    "app.kubernetes.io/managed-by": "accelstack-hub"}},
            "spec": dict(origin.get("spec") or {})}


def member_object(dispatch: Mapping[str, Any]) -> dict[str, Any] | None:
    """The GPR the agent creates in its member for ``dispatch``: the origin's namespace and name, the origin and
    the dispatch in annotations, ``clusterName`` removed (the member's controller admits it like any other GPR).
    None when the dispatch does not name its origin."""
    origin = origin_of(dispatch)
    if origin is None:
        return None
    ns, name, uid = origin
    spec = {k: v for k, v in (dispatch.get("spec") or {}).items() if k != "clusterName"}
    return {"apiVersion": "accelstack.io/v1alpha1", "kind": "GPUProvisioningRequest",
            "metadata": {"name": name, "namespace": ns, "labels": {FROM_HUB: "true"},
                         "annotations": {ORIGIN: f"hub/{ns}/{name}/{uid}",
                                         DISPATCH: str((dispatch.get("metadata") or {}).get("name") or "")}},
            "spec": spec}


def made_for(member_gpr: Mapping[str, Any], dispatch: Mapping[str, Any]) -> bool:
    """Whether ``member_gpr`` is the agent's copy of ``dispatch`` (the same origin UID), not a GPR of the same
    name that a member user made, or the copy of an earlier origin of that name."""
    origin = origin_of(dispatch)
    annotations = (member_gpr.get("metadata") or {}).get("annotations") or {}
    return origin is not None and annotations.get(ORIGIN) == f"hub/{origin[0]}/{origin[1]}/{origin[2]}"


# ---- statuses -------------------------------------------------------------------------------------------------
def _condition(kind: str, status: bool, reason: str, message: str, before: Iterable[Any],
               now_text: str) -> dict[str, Any]:
    value = "True" if status else "False"
    old = next((c for c in before if isinstance(c, Mapping) and c.get("type") == kind), {})
    since = old.get("lastTransitionTime") if old.get("status") == value else None
    return {"type": kind, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since or now_text}


def mirror(member_status: Mapping[str, Any], current: Mapping[str, Any], now_text: str,
           problem: tuple[str, str, str] | None = None) -> dict[str, Any]:
    """The dispatch's status from its member GPR's (the fields of :data:`MIRRORED`), as a merge patch: a field
    the member no longer has is null. ``problem`` (condition type, reason, message) is the agent's own trouble
    (``NamespaceMissing``, ``NameTaken``), shown as a True condition with the phase ``Queued``."""
    out: dict[str, Any] = {k: member_status.get(k) for k in MIRRORED}
    conditions = [c for c in member_status.get("conditions") or () if isinstance(c, Mapping)
                  and c.get("type") not in AGENT_CONDITIONS]
    before = current.get("conditions") or ()
    if problem is not None:
        kind, reason, message = problem
        out.update(phase="Queued", reason=reason, message=message)
        conditions.append(_condition(kind, True, reason, message, before, now_text))
    out["conditions"] = conditions or None
    return out


def mirror_differs(current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether writing ``patch`` would change ``current`` (a null is the field's absence)."""
    return any(current.get(k) != v for k, v in patch.items())


@dataclass(frozen=True)
class Placed:
    cluster: str
    reason: str  # Pinned | EarliestStart | Replaced
    message: str


def origin_status(dispatch_status: Mapping[str, Any] | None, current: Mapping[str, Any], placed: Placed,
                  now_text: str, lost: str = "", replaced: str = "") -> dict[str, Any]:
    """The origin's status (a merge patch): the dispatch's mirrored fields, ``cluster``, the condition ``Placed``
    and, when its member is Lost while it had started, ``Lost`` (reason ``ClusterLost``, ``lost`` the message;
    the phase stays the last one the member reported: the hub cannot know more). ``replaced`` says the GPR was
    taken off a Lost member before it started (condition ``Replaced``)."""
    mirrored = dict(dispatch_status or {})
    out: dict[str, Any] = {k: mirrored.get(k) for k in MIRRORED}
    if dispatch_status is None:  # dispatched, not yet picked up by the member's agent
        out.update(phase="Queued", reason="Dispatched", message=f"sent to {placed.cluster}; waiting for its agent")
    before = current.get("conditions") or ()
    conditions = [c for c in mirrored.get("conditions") or () if isinstance(c, Mapping)
                  and c.get("type") not in HUB_CONDITIONS]
    conditions.append(_condition("Placed", True, placed.reason, placed.message, before, now_text))
    if replaced:
        conditions.append(_condition("Replaced", True, "ClusterLost", replaced, before, now_text))
    if lost:
        conditions.append(_condition("Lost", True, "ClusterLost", lost, before, now_text))
        out.update(reason="ClusterLost", message=lost)
    out["conditions"] = conditions
    out["cluster"] = placed.cluster
    return out


def waiting_status(reason: str, message: str, current: Mapping[str, Any], now_text: str) -> dict[str, Any]:
    """An origin no member takes (yet): Queued with ``reason`` (``Unschedulable``: too big for every member;
    ``NoClusterReady``; ``ClusterNotFound``: pinned to a name the hub does not know), ``Placed=False``."""
    out: dict[str, Any] = {k: None for k in MIRRORED}
    out.update(phase="Queued", reason=reason, message=message,
               conditions=[_condition("Placed", False, reason, message, current.get("conditions") or (), now_text)])
    return out


# ---- picking --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Demand:
    resource: str
    models: tuple[str, ...]
    devices_per_node: int
    node_count: int

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.node_count

    def text(self) -> str:
        models = f" ({', '.join(self.models)})" if self.models else ""
        return f"{self.node_count} x {self.devices_per_node} {self.resource}{models}"


def demand_of(spec: Mapping[str, Any]) -> Demand:
    """What a GPR spec asks for, with the CRD's defaults (the API server has applied them already)."""
    def count(key: str) -> int:
        value = spec.get(key, 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    models = tuple(m for m in spec.get("models") or () if isinstance(m, str))
    return Demand(str(spec.get("resource") or GPU), models, count("devicesPerNode"), count("nodeCount"))


@dataclass(frozen=True)
class Fit:
    """One member seen for one demand, from its ``Cluster.status.inventory``."""
    cluster: str
    usable: int  # healthy capacity of the models it accepts, on nodes with enough devices each
    free: int  # usable devices neither allocated nor reserved now
    queued: int  # devices waiting GPRs ask for of those models (and of "any model")

    def text(self, resource: str) -> str:
        if self.queued:
            return f"{self.cluster}: {self.free} free {resource} now, {self.queued} queued"
        return f"{self.cluster}: {self.free} free {resource} now"


def fit(cluster: str, status: Mapping[str, Any], want: Demand) -> Fit:
    """``want`` against one member's inventory rows (per resource and model). A row's devices count when the
    GPR accepts its model and its nodes are big enough on average (the summary has no per-node sizes: the
    member's own controller has the last word and its verdict comes back as the GPR's reason)."""
    usable = free = queued = 0
    for row in status.get("inventory") or ():
        if not isinstance(row, Mapping) or row.get("resource") != want.resource:
            continue
        model = str(row.get("model") or "")

        def n(key: str, r: Mapping[str, Any] = row) -> int:
            value = r.get(key) or 0
            return value if isinstance(value, int) else 0

        if model == ANY_MODEL:  # waiting GPRs that take several models: they may compete for these devices
            queued += n("queued")
            continue
        if want.models and model not in want.models:
            continue
        queued += n("queued")
        nodes, capacity = n("nodes"), n("capacity")
        if nodes <= 0 or capacity // nodes < want.devices_per_node:
            continue
        healthy = max(0, capacity - n("unhealthy"))
        usable += healthy
        free += max(0, min(healthy, n("allocatable")) - n("allocated") - n("reserved"))
    return Fit(cluster, usable, free, queued)


@dataclass(frozen=True)
class Choice:
    """The member picked (``cluster``) with the message saying why, or none (``cluster`` empty) with the
    reason: ``Unschedulable`` (no Ready member could ever hold it) or ``NoClusterReady``."""
    cluster: str
    reason: str
    message: str


def _fits(want: Demand, clusters: Mapping[str, Mapping[str, Any]],
          exclude: Iterable[str]) -> tuple[list[Fit], list[str]]:
    """Each Ready member not excluded against ``want``, and why the others were left out."""
    left_out = set(exclude)
    fits: list[Fit] = []
    skipped: list[str] = []
    for name in sorted(clusters):
        status = (clusters[name] or {}).get("status") or {}
        if name in left_out:
            skipped.append(f"{name}: left (Lost)")
        elif ready_of(status) is not True:
            skipped.append(f"{name}: not Ready")
        else:
            fits.append(fit(name, status, want))
    return fits, skipped


MAX_ALTERNATIVES = 4  # the other members a choice's message names (the rest counted): 20 members, 10,000 GPRs


def _choose(want: Demand, fits: list[Fit], skipped: list[str], sent: Mapping[tuple[str, str], int] | None = None
            ) -> Choice:
    """The choice over ``fits``; ``sent``: devices a pass already sent to a member, by (member, resource), taken
    off its free devices and added to its queued ones (worked out here, no Fit copied: 10,000 GPRs x 20 members)."""
    need = want.devices
    if sent:
        def seen(f: Fit) -> Fit:
            n = sent.get((f.cluster, want.resource), 0)
            return Fit(f.cluster, f.usable, max(0, f.free - n), f.queued + n) if n else f
    else:
        def seen(f: Fit) -> Fit:
            return f
    ranked: list[tuple[int, float, str, Fit]] = []
    for f in fits:
        if f.usable < need:
            continue
        n = sent.get((f.cluster, want.resource), 0) if sent else 0
        ranked.append((0 if f.free - n >= need else 1, (f.queued + n) / max(1, f.usable), f.cluster, f))
    if not ranked:
        if not fits:
            why = "; ".join(skipped) or "no member cluster joined"
            return Choice("", "NoClusterReady", f"needs {want.text()}; no Ready member: {why}")
        sizes = "; ".join(f"{f.cluster}: {f.usable} usable" for f in fits)
        also = f"; {'; '.join(skipped)}" if skipped else ""
        return Choice("", "Unschedulable", f"needs {want.text()}, more than any Ready member has: {sizes}{also}")
    ranked.sort()  # member names are unique: the Fit in the fourth place is never compared
    best = seen(ranked[0][3])
    small = [f for f in fits if f.usable < need]
    others = len(ranked) - 1 + len(small)
    rest = [seen(r[3]).text(want.resource) for r in ranked[1:MAX_ALTERNATIVES + 1]]  # only those it names
    rest += [f"{f.cluster}: {f.usable} usable, too few" for f in small[:MAX_ALTERNATIVES - len(rest)]]
    if others > len(rest):
        rest.append(f"{others - len(rest)} more")
    now = "free now" if ranked[0][0] == 0 else "least queued per device"
    message = f"{best.text(want.resource)} ({now})" + ("; " + "; ".join(rest) if rest else "")
    return Choice(best.cluster, "EarliestStart", message)


def pick(want: Demand, clusters: Mapping[str, Mapping[str, Any]], exclude: Iterable[str] = ()) -> Choice:
    """The member where ``want`` can start soonest, over the Ready members' inventories (``clusters``: name ->
    Cluster object). Free now (the free devices of the models it accepts cover it) beats not free; then the
    least queued demand per usable device (less waiting ahead of it: among the free ones too, since a queue
    there means GPRs that may take those devices first); then the name. A member whose usable capacity is
    below the GPR's devices is never picked; ``exclude`` (a Lost member being left) neither."""
    return _choose(want, *_fits(want, clusters, exclude))


class Placer:
    """:func:`pick` for one hub pass: each member is read against a demand once (the inventories do not change
    within a pass), and what the pass has already sent to a member counts there (its devices off the free ones
    and onto the queued ones, by resource), so one pass spreads a burst of GPRs instead of sending every GPR of a
    demand to the one member that looked best before any of them went (3,617 of 10,000 to one member of 20)."""

    def __init__(self, clusters: Mapping[str, Mapping[str, Any]]) -> None:
        self.clusters = clusters
        self._seen: dict[tuple[Demand, frozenset[str]], tuple[list[Fit], list[str]]] = {}
        self.sent: dict[tuple[str, str], int] = {}  # (member, resource) -> devices sent this pass

    def pick(self, want: Demand, exclude: Iterable[str] = ()) -> Choice:
        key = (want, frozenset(exclude))
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _fits(want, self.clusters, key[1])
        choice = _choose(want, *seen, self.sent)
        if choice.cluster:
            where = (choice.cluster, want.resource)
            self.sent[where] = self.sent.get(where, 0) + want.devices
        return choice


# ---- a Lost member ----------------------------------------------------------------------------------------------
def lost_of(cluster: Mapping[str, Any] | None) -> bool:
    """Whether the hub judged the member Lost (its condition ``Lost`` is True)."""
    for c in ((cluster or {}).get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Lost":
            return c.get("status") == "True"
    return False


def on_lost(last_phase: str, pinned: bool) -> str:
    """What to do with a GPR whose member is Lost, by the phase the member last reported: ``replace`` (never
    started: take it off that member and place it elsewhere), ``lost`` (had started, or is pinned there: report
    it Lost, never duplicate it), or ``keep`` (finished: nothing can change)."""
    if last_phase in NOT_STARTED and not pinned:
        return "replace"
    if last_phase in NOT_STARTED or last_phase in STARTED:
        return "lost"
    return "keep"
