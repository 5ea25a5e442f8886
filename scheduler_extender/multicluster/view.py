"""One view over every member (issue 40.4): the REST API's inventory, queue and usage as the hub answers them,
from the hub's own objects only — the Clusters' status (what each agent last reported), the hub GPRs' mirrored
status and the hub Workspaces' ``status.clusters`` — so the hub never reaches a member to answer.

Pure functions over those objects (the hub's informer caches hand them in); :mod:`scheduler_extender.api.hub`
serves them with the REST API's authentication. Every row names its cluster; ``cluster=`` keeps one member's rows,
and a name no member has joined with is :class:`UnknownCluster` (a 404). The shapes follow the extender's views
(``cells``/``totals`` of ``inventory?summary=1``, ``items``/``counts`` of ``queue``) with ``cluster`` added and
``hub: true`` said, so the portal and the plugin tell a hub from a member by the answer alone.

The member's summary is per resource and model, not per node group (the agent sums its nodes before it writes), so
a cell's ``group`` is :data:`NOT_REPORTED` and ``groupLabel`` says why; a member's own REST API has its groups.
The hub's clock measures heartbeat age (``observedHeartbeatTime``: when the hub saw the member's heartbeat change),
never the member's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler_extender.multicluster.clusters import ready_of
from scheduler_extender.multicluster.placement import is_member_namespace
from scheduler_extender.objects.gpr_codec import parse_time

NOT_REPORTED = "(not reported)"
GROUP_NOTE = "node group: not in the members' summaries (ask the member's own REST API)"
UNPLACED = ""  # the cluster of a hub GPR no member has taken yet
ROW_FIELDS = ("nodes", "capacity", "allocatable", "allocated", "reserved", "unhealthy", "queued")
PHASE_ORDER = {"Queued": 0, "Evicting": 1, "Running": 2, "Admitted": 3}
UNFINISHED = ("Queued", "Admitted", "Running", "Evicting")
QUEUE_ORDER = ("Hub GPRs by phase, then the position their member's controller gave them (mirrored at the hub's "
               "last pass), then age. Positions count within one member's queue: two members each have a position "
               "1. A GPR with no cluster has not been placed yet (its reason says why).")


class UnknownCluster(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no member cluster {name!r} has joined the hub")


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or () if isinstance(c, Mapping) and c.get("type") == kind), {})


def check_cluster(clusters: Mapping[str, Any], cluster: str) -> str:
    """``cluster`` when it is empty (every member) or a joined member; :class:`UnknownCluster` otherwise."""
    if cluster and cluster not in clusters:
        raise UnknownCluster(cluster)
    return cluster


def cluster_row(obj: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A member as the hub judged it: Ready, Lost, the hub-clock age of its last heartbeat, its node count."""
    status = obj.get("status") or {}
    seen = parse_time(status.get("observedHeartbeatTime"))
    lost = _condition(status, "Lost")
    return {"cluster": _name(obj), "ready": bool(ready_of(status)), "lost": lost.get("status") == "True",
            "reason": str(_condition(status, "Ready").get("reason") or "NoHeartbeat"),
            "heartbeatAgeSeconds": round(max(0.0, now - seen), 1) if seen is not None else None,
            "nodes": int(status.get("nodes") or 0)}


def inventory(clusters: Mapping[str, Mapping[str, Any]], cluster: str, now: float) -> dict[str, Any]:
    """Cells of (cluster, resource, model) from each member's ``status.inventory``, its Ready/Lost beside every
    cell (a Lost member's cells are its last report, not today's), sorted cluster → resource → model."""
    check_cluster(clusters, cluster)
    names = [cluster] if cluster else sorted(clusters)
    members = [cluster_row(clusters[n], now) for n in names]
    cells = []
    for member in members:
        for item in (clusters[member["cluster"]].get("status") or {}).get("inventory") or ():
            if not isinstance(item, Mapping):
                continue
            counts = {f: int(item.get(f) or 0) for f in ROW_FIELDS}
            free = max(0, counts["allocatable"] - counts["allocated"] - counts["reserved"]) if member["ready"] else 0
            cells.append({"cluster": member["cluster"], "ready": member["ready"], "lost": member["lost"],
                          "resource": str(item.get("resource") or ""), "model": str(item.get("model") or "unknown"),
                          "group": NOT_REPORTED, **counts, "free": free})
    cells.sort(key=lambda c: (c["cluster"], c["resource"], c["model"]))
    totals = {f: sum(c[f] for c in cells) for f in (*ROW_FIELDS, "free")}
    return {"hub": True, "groupLabel": GROUP_NOTE, "clusters": members, "cells": cells, "totals": totals}


def queue_row(obj: Mapping[str, Any], now: float) -> dict[str, Any]:
    """A hub GPR with its cluster and what the hub mirrored from it: phase, position, estimate, reason."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    phase = str(status.get("phase") or "Queued")
    start = parse_time(status.get("estimatedStart")) if phase == "Queued" else None
    created = parse_time(meta.get("creationTimestamp"))
    placed = _condition(status, "Placed")
    return {"cluster": str(status.get("cluster") or UNPLACED), "namespace": str(meta.get("namespace") or ""),
            "name": _name(obj), "phase": phase, "pinned": bool(spec.get("clusterName")),
            "placed": str(placed.get("reason") or ""), "priority": spec.get("priority"),
            "resource": str(spec.get("resource") or ""), "devicesPerNode": spec.get("devicesPerNode", 1),
            "nodeCount": spec.get("nodeCount", 1),
            "position": status.get("queuePosition") if phase == "Queued" else None,
            "estimatedStart": status.get("estimatedStart") if start is not None else None,
            "waitSeconds": round(max(0.0, start - now), 1) if start is not None else None,
            "created": meta.get("creationTimestamp"),
            "ageSeconds": round(now - created, 1) if created is not None else None,
            "reason": str(status.get("reason") or ""), "message": str(status.get("message") or "")}


def queue(gprs: Iterable[Mapping[str, Any]], clusters: Mapping[str, Any], *, cluster: str, namespace: str,
          phases: Iterable[str], now: float) -> dict[str, Any]:
    """The hub's GPRs (the users' own, not the dispatches in the members' namespaces), placed or not, in queue
    order; ``counts`` per phase over those of the cluster and namespace asked for."""
    check_cluster(clusters, cluster)
    wanted = set(phases)
    rows: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for obj in gprs:
        meta = obj.get("metadata") or {}
        ns = str(meta.get("namespace") or "")
        if is_member_namespace(ns) or (namespace and ns != namespace) or meta.get("deletionTimestamp"):
            continue
        row = queue_row(obj, now)
        if cluster and row["cluster"] != cluster:
            continue
        counts[row["phase"]] = counts.get(row["phase"], 0) + 1
        if row["phase"] in wanted:
            rows.append(row)
    rows.sort(key=lambda r: (PHASE_ORDER.get(r["phase"], 9), r["cluster"],
                             r["position"] if isinstance(r["position"], int) else 1 << 30,
                             str(r["created"] or ""), r["namespace"], r["name"]))
    return {"hub": True, "items": rows, "total": len(rows), "counts": counts, "continue": "", "order": QUEUE_ORDER}


def usage(workspaces: Iterable[Mapping[str, Any]], clusters: Mapping[str, Any], *, cluster: str,
          workspace: str = "") -> dict[str, Any]:
    """One row per (workspace, cluster, usage row) from the hub Workspaces' ``status.clusters`` (what each member's
    agent reported); a listed member with no usage yet is one row with its message."""
    check_cluster(clusters, cluster)
    rows = []
    for ws in sorted(workspaces, key=_name):
        if workspace and _name(ws) != workspace:
            continue
        for member in (ws.get("status") or {}).get("clusters") or ():
            if not isinstance(member, Mapping) or (cluster and member.get("name") != cluster):
                continue
            base = {"workspace": _name(ws), "cluster": str(member.get("name") or ""),
                    "ready": bool(member.get("ready")), "namespaces": list(member.get("namespaces") or []),
                    "message": str(member.get("message") or "")}
            for u in member.get("usage") or [{}]:
                rows.append({**base, "resource": u.get("resource", ""), "model": u.get("model") or "",
                             "inUse": u.get("inUse"), "reserved": u.get("reserved"), "queued": u.get("queued"),
                             "max": u.get("max")})
    return {"hub": True, "items": rows}


# ---- /metrics -------------------------------------------------------------------------------------------------
class ViewCollector(Collector):
    """Per-cluster figures a platform engineer watches, computed at scrape time from the hub's caches: the hub
    GPRs by cluster and phase (``cluster=""``: not placed yet) and each member's heartbeat age on the hub's clock.
    (Ready and the devices per kind are :class:`~.hub.HubMetrics`.)"""

    def __init__(self, clusters: Any, gprs: Any, clock: Any) -> None:
        self.clusters, self.gprs, self.clock = clusters, gprs, clock  # callables: name -> Cluster; GPRs; time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        now = self.clock()
        by_phase = GaugeMetricFamily("accelstack_hub_cluster_gprs", "Hub GPRs by the member they were placed on "
                                     "(cluster=\"\": not placed yet) and their mirrored phase",
                                     labels=["cluster", "phase"])
        counts: dict[tuple[str, str], int] = {}
        for obj in self.gprs():
            ns = str((obj.get("metadata") or {}).get("namespace") or "")
            if is_member_namespace(ns):
                continue
            status = obj.get("status") or {}
            key = (str(status.get("cluster") or UNPLACED), str(status.get("phase") or "Queued"))
            counts[key] = counts.get(key, 0) + 1
        for (cluster, phase), n in sorted(counts.items()):
            by_phase.add_metric([cluster, phase], n)
        yield by_phase
        age = GaugeMetricFamily("accelstack_hub_cluster_heartbeat_age_seconds", "Seconds since the hub saw the "
                                "member's heartbeat change (the hub's clock); absent before the first one",
                                labels=["cluster"])
        for name, obj in sorted(self.clusters().items()):
            row = cluster_row(obj, now)
            if row["heartbeatAgeSeconds"] is not None:
                age.add_metric([name], row["heartbeatAgeSeconds"])
        yield age
