"""The REST API's read views for the portal and for scripts: the queue, a GPR's Events, the inventory
aggregated by model and node group (with drill-down to a group's nodes and to one node), health, and what the
caller may do.

- ``GET /api/v1/queue[?namespace=&workspace=&phase=&resource=&limit=&continue=]``  GPRs in queue order
- ``GET /api/v1/gprs/{namespace}/{name}/events``                                  the GPR's core/v1 Events
- ``GET /api/v1/inventory?summary=1``                          cells of (resource, model, node group)
- ``GET /api/v1/inventory/groups/{group}[?resource=&model=]``  the nodes of one node group
- ``GET /api/v1/inventory/nodes/{name}``                       one node: devices, health, holders, reservations
- ``GET /api/v1/health``                                       unhealthy nodes and devices, with since when
- ``GET /api/v1/whoami[?namespace=]``                          the caller and what its RBAC allows here

Everything is answered from the process's informer view (nodes, pods, GPRs): no request lists GPRs or nodes
from the API server (the queue order, the inventory summary and health are kept until the view changes, half a
second at most when it changes all the time), and
queue positions and estimated starts are the ones the controller wrote in the GPRs'
statuses (nothing is estimated per request). The workspace of a namespace comes from its
``accelstack.io/workspace`` label, read through :class:`NamespaceIndex` (one namespace list every few seconds at
most, only while someone asks).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from operator import itemgetter
from typing import Any, TypeVar

from aiohttp import web

from kubeapi.resources import EVENTS, GPR_TEMPLATE_BINDINGS, GPR_TEMPLATES, NODES, WORKSPACES
from scheduler_extender.api.http import Routes, api_error, error, json_response, query_int
from scheduler_extender.api.objects import member_workspaces, workspace_namespaces
from scheduler_extender.core.gpr import PRIORITY_MAX, PRIORITY_MIN, priority_class
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import ClusterView, GPRView, NodeView, model_of
from scheduler_extender.objects.kube import ApiError, Kube
from scheduler_extender.objects.workspaces import WORKSPACE_LABEL
from service.loop import kept_for, slices

log = logging.getLogger("accelstack.extender.rest")
T = TypeVar("T")

DEFAULT_GROUP_LABEL = "node.kubernetes.io/instance-type"
NO_GROUP = "(none)"
UNFINISHED = ("Queued", "Admitted", "Running", "Evicting")
PHASE_ORDER = {"Queued": 0, "Evicting": 1, "Running": 2, "Admitted": 3}
QUEUE_LIMIT, QUEUE_MAX_LIMIT = 100, 1000
GPR_ATTRS = {"group": gr.GROUP, "resource": gr.GPR_PLURAL}
NODE_ATTRS = {"group": "", "resource": NODES.plural}
EVENT_ATTRS = {"group": "", "resource": EVENTS.plural}
# What whoami reports: name -> (verb, group, resource, namespaced)
ABILITIES: dict[str, tuple[str, str, str, bool]] = {
    "inventory": ("list", "", NODES.plural, False),
    "queue": ("list", gr.GROUP, gr.GPR_PLURAL, True),
    "createGPR": ("create", gr.GROUP, gr.GPR_PLURAL, True),
    "deleteGPR": ("delete", gr.GROUP, gr.GPR_PLURAL, True),
    "events": ("list", "", EVENTS.plural, True),
    "workspaces": ("list", WORKSPACES.group, WORKSPACES.plural, False),
    "createWorkspace": ("create", WORKSPACES.group, WORKSPACES.plural, False),
    "templates": ("list", GPR_TEMPLATES.group, GPR_TEMPLATES.plural, True),
    "templateBindings": ("list", GPR_TEMPLATE_BINDINGS.group, GPR_TEMPLATE_BINDINGS.plural, True),
}


class NamespaceIndex:
    """Namespace -> workspace from the namespaces' ``accelstack.io/workspace`` label, refreshed at most every
    ``ttl`` seconds and only when asked. A failed refresh keeps the last answer (a namespace never read is its
    own workspace, as it is without workspaces)."""

    def __init__(self, kube: Kube, ttl: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.ttl, self.clock = kube, ttl, clock
        self.workspace: dict[str, str] = {}
        self.at = -math.inf
        self._lock = asyncio.Lock()

    async def refresh(self) -> dict[str, str]:
        if self.clock() - self.at < self.ttl:
            return self.workspace
        async with self._lock:
            if self.clock() - self.at >= self.ttl:
                try:
                    items = await self.kube.list_namespaces(WORKSPACE_LABEL)
                    self.workspace = {(o.get("metadata") or {}).get("name", ""):
                                      ((o.get("metadata") or {}).get("labels") or {}).get(WORKSPACE_LABEL, "")
                                      for o in items}
                except (ApiError, OSError, TimeoutError) as exc:
                    log.warning("namespace list failed; workspaces as last read",
                                extra={"error": str(exc)[:200]})
                self.at = self.clock()
        return self.workspace

    def of(self, namespace: str) -> str:
        return self.workspace.get(namespace) or namespace

    def namespaces(self, workspace: str) -> list[str]:
        found = sorted(ns for ns, ws in self.workspace.items() if ws == workspace)
        return found or [workspace]


# ---- the queue ---------------------------------------------------------------------------------------------
# How the controller orders the queue (core.scheduler, order "size", the only order the live controller runs):
# said beside every queue a person reads, so a position is never a mystery.
QUEUE_ORDER = ("Queued GPRs start by priority level, strictly: high (201-300), then medium (101-200), then low "
               "(1-100). Within a level, smaller predicted work first (devices x predicted run time, learned from "
               "finished GPRs of the same shape), and a GPR moves up the longer it waits; a GPR that fits in what "
               "is free without delaying those ahead of it may start earlier (backfill). Position is the "
               "controller's, written at its last pass.")


def level_of(priority: int) -> str:
    """The priority level a GPR's priority falls in (``high``, ``medium``, ``low``; '' outside 1-300)."""
    return priority_class(priority) if PRIORITY_MIN <= priority <= PRIORITY_MAX else ""


def _queue_key(g: GPRView) -> tuple[Any, ...]:
    position = g.queue_position if g.queue_position is not None else math.inf
    return PHASE_ORDER.get(g.phase, 9), position, -g.priority, g.created, g.key


def queue_row(g: GPRView, workspace: str, now: float) -> dict[str, Any]:
    namespace, name = g.key.split("/", 1)
    created = gr.parse_time(g.created)
    start = g.estimated_start if g.phase == "Queued" else None
    return {"namespace": namespace, "name": name, "workspace": workspace, "phase": g.phase, "priority": g.priority,
            "level": level_of(g.priority), "resource": g.resource, "devicesPerNode": g.devices, "nodeCount": g.nodes,
            "position": g.queue_position if g.phase == "Queued" else None,
            "estimatedStart": gr.rfc3339(start) if start is not None else None,
            "waitSeconds": round(max(0.0, start - now), 1) if start is not None else None,
            "estimatedStartRange": {"earliest": gr.rfc3339(g.estimated_range[0]),
                                    "latest": gr.rfc3339(g.estimated_range[1])}
            if g.estimated_range is not None and start is not None else None,
            "created": g.created, "ageSeconds": round(now - created, 1) if created is not None else None,
            "reason": g.reason, "reservedNodes": sorted(g.reservation)}


async def in_queue_order(view: ClusterView) -> list[GPRView]:
    """Every GPR of the view in queue order: queued ones by the controller's position, then those holding
    devices; ties by priority (higher first), then age. The keys are made in slices (:mod:`.loop`); the key
    ends with the GPR's unique name, so the sort never compares two GPRs."""
    keyed: list[tuple[tuple[Any, ...], GPRView]] = []
    async for part in slices(list(view.gprs.values())):
        keyed += [(_queue_key(g), g) for g in part]
    keyed.sort(key=itemgetter(0))
    return [g for _, g in keyed]


def queue(index: NamespaceIndex, ordered: list[GPRView], *, namespaces: Iterable[str] | None,
          phases: Iterable[str], resource: str, offset: int, limit: int, now: float) -> dict[str, Any]:
    """One page of the GPRs that match, in queue order (``ordered``: :func:`in_queue_order` of the view).
    ``counts`` are per phase over every GPR of the namespaces and resource asked for."""
    wanted = set(namespaces) if namespaces is not None else None
    phase_set = set(phases)
    matching: list[GPRView] = []
    counts: dict[str, int] = {}
    for g in ordered:
        if wanted is not None and g.key.split("/", 1)[0] not in wanted:
            continue
        if resource and g.resource != resource:
            continue
        counts[g.phase] = counts.get(g.phase, 0) + 1
        if g.phase in phase_set:
            matching.append(g)
    page = matching[offset:offset + limit]
    rows = [queue_row(g, index.of(g.key.split("/", 1)[0]), now) for g in page]
    more = offset + limit < len(matching)
    return {"items": rows, "total": len(matching), "counts": counts,
            "continue": str(offset + limit) if more else "", "order": QUEUE_ORDER}


# ---- the inventory -----------------------------------------------------------------------------------------
def node_rows(view: ClusterView, node: NodeView, group_label: str) -> list[dict[str, Any]]:
    """One row per managed resource the node has (allocatable or capacity above 0). ``reserved`` counts a
    reservation's devices used or not, so ``allocated + reserved`` counts a GPR's running pods twice (the
    heat map showed "11/8"); ``held`` is each device once: allocated, or reserved and not yet used."""
    rows = []
    reservations = view.reservations_on(node.name)
    for resource in sorted(set(node.allocatable) | set(node.capacity)):
        allocatable = node.allocatable.get(resource, 0)
        capacity = max(node.capacity.get(resource, 0), allocatable)
        if capacity <= 0:
            continue
        reason = node.health_reason(resource) or node.ledger_error
        unused = sum(max(0, count - node.used_by.get((key, resource), 0)) for key, count in reservations.items()
                     if (g := view.gprs.get(key)) is not None and g.resource == resource)
        rows.append({"node": node.name, "group": node.labels.get(group_label) or NO_GROUP, "resource": resource,
                     "model": model_of(node, resource), "capacity": capacity, "allocatable": allocatable,
                     "allocated": node.used.get(resource, 0), "reserved": view.reserved_devices(node.name, resource),
                     "held": node.used.get(resource, 0) + unused, "free": 0 if reason else view.free_for(node, resource, ""), "healthy": not reason,
                     "reason": reason, "unhealthyDevices": capacity - allocatable if not reason else capacity})
    return rows


SUM_FIELDS = ("capacity", "allocatable", "allocated", "reserved", "held", "free", "unhealthyDevices")


async def summary(view: ClusterView, group_label: str) -> dict[str, Any]:
    """The inventory as cells of (resource, model, node group): a heat map stays one cell per pair however many
    nodes there are. Swept in slices (:mod:`.loop`)."""
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    async for part in slices(list(view.nodes.values())):
        for row in (row for node in part for row in node_rows(view, node, group_label)):
            key = (row["resource"], row["model"], row["group"])
            cell = cells.get(key)
            if cell is None:
                cell = cells[key] = {"resource": key[0], "model": key[1], "group": key[2], "nodes": 0,
                                     "unhealthyNodes": 0, **dict.fromkeys(SUM_FIELDS, 0)}
            cell["nodes"] += 1
            cell["unhealthyNodes"] += 0 if row["healthy"] else 1
            for f in SUM_FIELDS:
                cell[f] += row[f]
    out = sorted(cells.values(), key=lambda c: (c["resource"], c["model"], c["group"]))
    totals = {f: sum(c[f] for c in out) for f in ("nodes", "unhealthyNodes", *SUM_FIELDS)}
    return {"groupLabel": group_label, "cells": out, "totals": totals,
            "models": sorted({(c["resource"], c["model"]) for c in out}),
            "groups": sorted({c["group"] for c in out})}


def node_detail(view: ClusterView, node: NodeView, group_label: str) -> dict[str, Any]:
    holders = []
    for entry in node.ledger.values():
        pod = view.pods.get(entry.uid)
        for resource, devices in sorted(entry.requests.items()):
            holders.append({"pod": entry.pod, "gpr": entry.gpr, "resource": resource, "devices": devices,
                            "phase": pod.phase if pod is not None else "",
                            "since": gr.rfc3339(entry.since) if entry.since else None})
    reservations = []
    for key, devices in sorted(view.reservations_on(node.name).items()):
        g = view.gprs.get(key)
        reservations.append({"gpr": key, "devices": devices, "resource": g.resource if g else "",
                             "phase": g.phase if g else "",
                             "inUse": node.used_by.get((key, g.resource), 0) if g else 0})
    health = [{"resource": r, "reason": reason, "since": node.unhealthy_since.get(r) or None}
              for r, reason in sorted(node.unhealthy.items())]
    return {"node": node.name, "group": node.labels.get(group_label) or NO_GROUP, "labels": node.labels,
            "resources": node_rows(view, node, group_label), "health": health, "ledgerError": node.ledger_error,
            "holders": sorted(holders, key=lambda h: h["pod"]), "reservations": reservations}


async def health(view: ClusterView, group_label: str) -> dict[str, Any]:
    """Nodes with an unhealthy condition or taint, or fewer allocatable devices than the node has (devices the
    plugin reports unhealthy), earliest first. Swept in slices (:mod:`.loop`)."""
    items = []
    devices = 0
    sick_nodes = []
    async for part in slices(list(view.nodes.values())):
        sick_nodes += [n for n in part if n.unhealthy or n.ledger_error or any(
            n.capacity.get(r, 0) > n.allocatable.get(r, 0) for r in n.capacity)]
    for node in sick_nodes:
        lost = {r: node.capacity.get(r, 0) - node.allocatable.get(r, 0) for r in node.capacity
                if node.capacity.get(r, 0) > node.allocatable.get(r, 0)}
        problems = [{"resource": r, "reason": reason, "since": node.unhealthy_since.get(r) or None}
                    for r, reason in sorted(node.unhealthy.items())]
        problems += [{"resource": r, "reason": f"{n} of {node.capacity[r]} devices unhealthy (allocatable below "
                                               "capacity)", "since": None} for r, n in sorted(lost.items())]
        if node.ledger_error:
            problems.append({"resource": "*", "reason": node.ledger_error, "since": None})
        sick = sum(node.capacity.get(r, node.allocatable.get(r, 0)) for r in view.resources
                   if node.health_reason(r)) + sum(n for r, n in lost.items() if not node.health_reason(r))
        devices += sick
        known = [p["since"] for p in problems if p["since"]]
        items.append({"node": node.name, "group": node.labels.get(group_label) or NO_GROUP,
                      "models": sorted({model_of(node, r) for r in node.allocatable or node.capacity}),
                      "unhealthyDevices": sick, "since": min(known) if known else None, "problems": problems})
    items.sort(key=lambda i: (i["since"] or "9999", i["node"]))
    return {"nodes": items, "unhealthyNodes": len(items), "unhealthyDevices": devices, "totalNodes": len(view.nodes)}


# ---- routes ------------------------------------------------------------------------------------------------
class ViewRoutes:
    def __init__(self, api: Routes, group_label: str = DEFAULT_GROUP_LABEL, whoami_ttl: float = 10.0,
                 max_age: float = 0.5) -> None:
        self.api, self.group_label = api, group_label
        self.index = NamespaceIndex(api.kube)
        self.whoami_ttl = whoami_ttl
        self._whoami: dict[str, tuple[float, dict[str, Any]]] = {}
        self.max_age = max_age
        self._memo: dict[str, tuple[int, float, float, Any]] = {}  # name -> (version, at, cost, answer)

    async def memo(self, name: str, compute: Callable[[], Awaitable[T]]) -> T:
        """``compute()`` of the view: kept while the informers leave the view unchanged (its version), and
        for ``max_age`` seconds at most after it was computed however busy the informers are — longer when the
        computation is costly (:func:`.loop.kept_for`: such sweeps take at most 5% of the loop). A dashboard is
        half a second behind; at most one computation per ``max_age`` on a cluster whose GPRs change all the
        time."""
        version, now = self.api.view.version, time.monotonic()
        kept = self._memo.get(name)
        if kept is not None and (kept[0] == version or now - kept[1] < kept_for(self.max_age, kept[2])):
            return kept[3]  # type: ignore[no-any-return]
        value = await compute()
        self._memo[name] = (version, now, time.monotonic() - now, value)
        return value

    def forget(self) -> None:
        """Drop every kept answer: the next request computes (a benchmark measures that cost)."""
        self._memo.clear()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/api/v1/queue", self.get_queue),
                web.get("/api/v1/gprs/{namespace}/{name}/events", self.get_events),
                web.get("/api/v1/inventory/groups/{group}", self.get_group),
                web.get("/api/v1/inventory/nodes/{name}", self.get_node),
                web.get("/api/v1/health", self.get_health), web.get("/api/v1/whoami", self.whoami)]

    async def nodes_denied(self, request: web.Request) -> web.Response | None:
        return await self.api._denied(request, "list", attrs=NODE_ATTRS)

    async def get_queue(self, request: web.Request) -> web.Response:
        q = request.query
        namespace, workspace = q.get("namespace", ""), q.get("workspace", "")
        try:
            limit = query_int(q, "limit", QUEUE_LIMIT, 1, QUEUE_MAX_LIMIT)
            offset = query_int(q, "continue", 0, 0, 10**9)
            phases = [p for p in q.get("phase", "").split(",") if p] or list(UNFINISHED)
            if phases == ["all"]:
                phases = [p.value for p in gr.Phase]
            unknown = [p for p in phases if p not in gr.Phase._value2member_map_]
            if unknown:
                raise ValueError(f"phase: unknown {unknown[0][:40]!r} (one or more of "
                                 f"{', '.join(p.value for p in gr.Phase)}, comma-separated, or all)")
        except ValueError as exc:
            return error(400, str(exc))
        namespaces: list[str] | None = None
        if namespace:
            namespaces = [namespace]
        if workspace:
            await self.index.refresh()
            in_ws = self.index.namespaces(workspace)
            namespaces = [ns for ns in in_ws if ns in namespaces] if namespaces is not None else in_ws
        for ns in namespaces if namespaces is not None else [""]:  # every namespace it reads, or cluster-wide
            denied = await self.api._denied(request, "list", ns, GPR_ATTRS)
            if denied:
                return denied
        await self.index.refresh()
        view = self.api.view
        ordered = await self.memo("queue", lambda: in_queue_order(view))
        return json_response(queue(self.index, ordered, namespaces=namespaces, phases=phases,
                                   resource=q.get("resource", ""), offset=offset, limit=limit, now=self.api.clock()))

    async def get_events(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        denied = await self.api._denied(request, "list", namespace, EVENT_ATTRS)
        if denied:
            return denied
        try:
            items = await self.api.kube.list_events(namespace, gr.GPR_KIND, name)
        except ApiError as exc:
            return api_error(exc)
        events = [{"type": e.get("type", ""), "reason": e.get("reason", ""), "message": e.get("message", ""),
                   "count": e.get("count") or 1,
                   "firstTimestamp": e.get("firstTimestamp") or e.get("eventTime"),
                   "lastTimestamp": e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp"),
                   "source": (e.get("source") or {}).get("component") or e.get("reportingComponent", "")}
                  for e in items]
        events.sort(key=lambda e: str(e["lastTimestamp"] or ""))
        return json_response({"items": events})

    async def get_summary(self, request: web.Request) -> web.Response:
        return await self.nodes_denied(request) or json_response(
            await self.memo("summary", lambda: summary(self.api.view, self.group_label)))

    async def get_group(self, request: web.Request) -> web.Response:
        denied = await self.nodes_denied(request)
        if denied:
            return denied
        group, resource, model = request.match_info["group"], request.query.get("resource", ""), \
            request.query.get("model", "")
        rows = [row for node in self.api.view.nodes.values()
                if (node.labels.get(self.group_label) or NO_GROUP) == group
                for row in node_rows(self.api.view, node, self.group_label)
                if (not resource or row["resource"] == resource) and (not model or row["model"] == model)]
        if not rows:
            return error(404, f"no node with managed devices in node group {group[:80]!r}"
                              + (f" ({resource} {model})".rstrip() if resource or model else ""))
        rows.sort(key=lambda r: (r["node"], r["resource"]))
        return json_response({"group": group, "groupLabel": self.group_label, "nodes": rows})

    async def get_node(self, request: web.Request) -> web.Response:
        denied = await self.nodes_denied(request)
        if denied:
            return denied
        node = self.api.view.nodes.get(request.match_info["name"])
        if node is None:
            return error(404, f"node {request.match_info['name'][:80]!r} not found (or it has no managed devices "
                              "this extender sees)")
        return json_response(node_detail(self.api.view, node, self.group_label))

    async def get_health(self, request: web.Request) -> web.Response:
        return await self.nodes_denied(request) or json_response(
            await self.memo("health", lambda: health(self.api.view, self.group_label)))

    async def whoami(self, request: web.Request) -> web.Response:
        """The caller's name and, per portal action, whether its RBAC allows it (cluster-wide, or in
        ``?namespace=`` for namespaced actions): a few SubjectAccessReviews, cached per token briefly."""
        namespace = request.query.get("namespace", "")
        authorization = request.headers.get("Authorization", "")
        key = hashlib.sha256(f"{authorization}\0{namespace}".encode()).hexdigest()
        now = time.monotonic()
        cached = self._whoami.get(key)
        if cached is not None and now - cached[0] < self.whoami_ttl:
            return json_response(cached[1])
        user = ""
        if self.api.authorizer is not None:
            status, user = await self.api.authorizer.authenticate(authorization or None)
            if status:
                return error(status, user)

        async def allowed(verb: str, group: str, resource: str, namespaced: bool) -> bool:
            if self.api.authorizer is None:
                return True
            attrs = {"verb": verb, "group": group, "resource": resource,
                     **({"namespace": namespace} if namespaced and namespace else {})}
            status, _ = await self.api.authorizer.check(authorization, attrs)
            return status == 0

        answers = await asyncio.gather(*(allowed(*a) for a in ABILITIES.values()))
        abilities = dict(zip(ABILITIES, answers, strict=True))
        body: dict[str, Any] = {"user": user, "namespace": namespace, "allowed": abilities}
        if self.api.authorizer is not None and not abilities["workspaces"]:
            # A member reads its own Workspaces through the REST API (rest_objects.member_of): say which, and
            # in which of their namespaces it may create GPRs, so the portal's menu and Create page tell the
            # truth for a caller whose namespaced roles RBAC checks cluster-wide would deny.
            mine = await member_workspaces(self.api, request)
            spaces = [{"name": (w.get("metadata") or {}).get("name", ""), "namespaces": workspace_namespaces(w)}
                      for w in mine]
            create_in = [ns for w in spaces for ns in w["namespaces"]
                         if await self.api._denied(request, "create", ns, GPR_ATTRS) is None]
            body["workspaces"] = spaces
            body["createGPRIn"] = list(dict.fromkeys(create_in))
            abilities["workspaces"] = bool(spaces)
            if not namespace:  # cluster-wide questions: true where a member workspace allows it
                abilities["queue"] = abilities["queue"] or bool(spaces)
                abilities["createGPR"] = abilities["createGPR"] or bool(create_in)
        if len(self._whoami) > 10_000:
            self._whoami.clear()
        self._whoami[key] = (now, body)
        return json_response(body)


