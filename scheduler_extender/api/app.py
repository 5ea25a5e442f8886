"""The REST API beside the extender (the design's API gateway): inventory, GPRs as custom resources, and a
wait-time estimate for a hypothetical GPR; workspaces, templates and bindings (:mod:`rest_objects`); the
portal's views (:mod:`rest_views`: queue, Events, inventory summary and drill-down, health, whoami); the portal
itself at ``/ui/`` (:mod:`portal`).

- ``GET  /api/v1/inventory``                     per node and per model: capacity, allocated, reserved, healthy
                                                 (``?summary=1``: aggregated by model and node group instead)
- ``GET  /api/v1/gprs[?namespace=ns]``           GPR objects
- ``POST /api/v1/gprs``                          ``{"namespace", "name", "spec"}`` -> created GPR object (201)
- ``GET|DELETE /api/v1/gprs/{namespace}/{name}``
- ``POST /api/v1/waittime``                      ``{"namespace", "spec"}`` -> estimated start, wait, queue position

Every call needs ``Authorization: Bearer <token>``: the token is checked with a TokenReview and the action with
a SubjectAccessReview (``auth.Authorizer``: reviews cached, failed authentications limited per address, 429
past the limit), so the API allows exactly what the caller's RBAC allows. The caller
is authenticated before its request body is read (a request without a valid token is a 401 whatever its body),
and authorised as soon as the body names the namespace. Errors are JSON ``{"error": ...}`` with the HTTP status
of the cause (400 bad input, JSON nested too deeply included; 401/403; 404; 408 when the body does not arrive
within the body-read timeout, and the connection is closed; 409; 413 over the size limit; 502 when the API
server fails).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import orjson
from aiohttp import web

from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.http import LIST_PAGE, api_call, api_items, error, json_response
from scheduler_extender.api.nodes import node_routes
from scheduler_extender.api.objects import object_routes
from scheduler_extender.api.portal import portal_routes
from scheduler_extender.api.views import DEFAULT_GROUP_LABEL, ViewRoutes
from scheduler_extender.api.whatif import WhatIf
from scheduler_extender.objects import gpr_codec as gr
from scheduler_extender.objects.cluster import ClusterView, NodeView, model_of
from scheduler_extender.objects.gpr_codec import cluster_refusal
from scheduler_extender.objects.kube import Kube
from service.http_body import DEFAULT_BODY_TIMEOUT, BodyError, closing, loads, read_body
from service.loop import slices

_json, _error = json_response, error


async def inventory(view: ClusterView) -> dict[str, Any]:
    """Every node's managed devices (capacity, allocated, reserved, health) and their sums per model: swept in
    slices (:mod:`.loop`), so that 5,000 nodes never hold the loop that answers the scheduler."""
    nodes: list[dict[str, Any]] = []
    models: dict[tuple[str, str], dict[str, Any]] = {}
    async for part in slices(sorted(view.nodes.values(), key=attrgetter("name"))):
        for row in (row for node in part for row in _device_rows(view, node)):
            nodes.append(row)
            agg = models.setdefault((row["resource"], row["model"]), {
                "resource": row["resource"], "model": row["model"], "nodes": 0, "capacity": 0, "allocated": 0,
                "reserved": 0, "healthyCapacity": 0})
            agg["nodes"] += 1
            for name in ("capacity", "allocated", "reserved"):
                agg[name] += row[name]
            agg["healthyCapacity"] += row["capacity"] if row["healthy"] else 0
    return {"nodes": nodes, "models": list(models.values())}


def _device_rows(view: ClusterView, node: NodeView) -> list[dict[str, Any]]:
    rows = []
    for resource, capacity in sorted(node.allocatable.items()):
        if capacity <= 0:
            continue
        reason = node.health_reason(resource)
        rows.append({"node": node.name, "resource": resource, "model": model_of(node, resource),
                     "capacity": capacity, "allocated": sum(e.requests.get(resource, 0) for e in node.ledger.values()),
                     "reserved": view.reserved_devices(node.name, resource), "healthy": not reason, "reason": reason})
    return rows


GPR_ATTRS = {"group": gr.GROUP, "resource": gr.GPR_PLURAL}


class RestAPI:
    """The routes. With an ``authorizer`` every call needs a bearer token whose user RBAC allows the equivalent
    Kubernetes action; without one (tests of the routes alone) the API is open."""

    def __init__(self, kube: Kube, view: ClusterView, clock: Callable[[], float] = time.time,
                 authorizer: Authorizer | None = None, limiter: RateLimiter | None = None,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, node_group_label: str = DEFAULT_GROUP_LABEL,
                 portal: bool = True) -> None:
        self.kube = kube
        self.view = view
        self.clock = clock
        self.authorizer = authorizer
        self.limiter = limiter or RateLimiter()
        self.body_timeout = body_timeout
        self.what_if = WhatIf(view)
        self.views = ViewRoutes(self, node_group_label)
        self.portal = portal

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/api/v1/inventory", self.get_inventory), web.get("/api/v1/gprs", self.list_gprs),
                web.post("/api/v1/gprs", self.create_gpr), web.get("/api/v1/gprs/{namespace}/{name}", self.get_gpr),
                web.delete("/api/v1/gprs/{namespace}/{name}", self.delete_gpr),
                web.post("/api/v1/waittime", self.waittime), *object_routes(self), *node_routes(self),
                *self.views.routes(),
                *(portal_routes() if self.portal else [])]

    async def _denied(self, request: web.Request, verb: str, namespace: str = "",
                      attrs: dict[str, str] | None = None) -> web.Response | None:
        if self.authorizer is None:
            return None
        attributes = {"verb": verb, **(attrs or GPR_ATTRS), **({"namespace": namespace} if namespace else {})}
        status, reason = await self.authorizer.check(request.headers.get("Authorization"), attributes,
                                                     client=request.remote or "")
        return _refusal(status, reason) if status else None

    async def _unauthenticated(self, request: web.Request) -> web.Response | None:
        if self.authorizer is None:
            return None
        status, reason = await self.authorizer.authenticate(request.headers.get("Authorization"),
                                                            client=request.remote or "")
        return _refusal(status, reason) if status else None

    async def get_inventory(self, request: web.Request) -> web.Response:
        if request.query.get("summary", "false").lower() not in ("false", "0", "no"):
            return await self.views.get_summary(request)
        denied = await self._denied(request, "list", attrs={"group": "", "resource": "nodes"})
        return denied or _json(await self.views.memo("inventory", lambda: inventory(self.view)))

    async def _call(self, coro: Any, created: bool = False) -> web.Response:
        return await api_call(coro, created)

    async def list_gprs(self, request: web.Request) -> web.StreamResponse:
        namespace = request.query.get("namespace") or None
        return await self._denied(request, "list", namespace or "") or \
            await api_items(request, self.kube.list_gprs(namespace, page_size=LIST_PAGE))

    async def get_gpr(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        return await self._denied(request, "get", namespace) or await self._call(self.kube.get_gpr(namespace, name))

    async def delete_gpr(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        denied = await self._denied(request, "delete", namespace)
        return denied or await self._call(self.kube.delete_gpr(namespace, name))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object the request carries; :class:`BodyError` (400, 408, 413) otherwise."""
        body = loads(await read_body(request, self.body_timeout))
        if not isinstance(body, dict):
            raise BodyError(400, "body must be a JSON object")
        return body

    async def create_gpr(self, request: web.Request) -> web.Response:
        unauthenticated = await self._unauthenticated(request)
        if unauthenticated:
            return unauthenticated
        try:
            body = await self._body(request)
            namespace, name, spec = body.get("namespace"), body.get("name"), body.get("spec", {})
            if not isinstance(namespace, str) or not namespace or not isinstance(name, str) or not name:
                raise ValueError("namespace and name: required strings")
            obj = {"apiVersion": gr.API_VERSION, "kind": gr.GPR_KIND,
                   "metadata": {"name": name, "namespace": namespace}, "spec": spec}
            unsupported = cluster_refusal(gr.from_object(obj, self.clock()))  # before the API server sees it
            if unsupported:
                raise ValueError(unsupported)
        except BodyError as exc:
            return await closing(request, _error(exc.status, exc.message))
        except (ValueError, gr.SpecError) as exc:
            return _error(400, str(exc))
        denied = await self._denied(request, "create", namespace)
        return denied or await self._call(self.kube.create_gpr(namespace, obj), created=True)

    async def waittime(self, request: web.Request) -> web.Response:
        """Estimated start of a GPR one would submit now, from what the controller keeps in the GPRs' statuses: no
        pass is run here (:mod:`.whatif`: O(log GPRs) an answer, from an index swept at most twice a second).
        Rate-limited per caller: the authenticated user (however its header is spelt), or the address when the
        API runs without authentication."""
        key = f"address:{request.remote}"
        if self.authorizer is not None:
            status, who = await self.authorizer.authenticate(request.headers.get("Authorization"),
                                                             client=request.remote or "")
            if status:
                return _refusal(status, who)
            key = f"user:{who}"
        limited = self.limiter.check(key)
        if limited:
            return web.Response(status=429, body=orjson.dumps({"error": "too many wait-time requests"}),
                                content_type="application/json", headers={"Retry-After": str(limited)})
        try:
            body = await self._body(request)
            namespace = body.get("namespace") or "default"
            if not isinstance(namespace, str):
                raise gr.SpecError("namespace: must be a string")
        except BodyError as exc:
            return await closing(request, _error(exc.status, exc.message))
        except (ValueError, gr.SpecError) as exc:
            return _error(400, str(exc))
        denied = await self._denied(request, "list", namespace)  # the estimate reveals the namespace's queue
        if denied:
            return denied
        try:
            fields = gr.check_spec(body.get("spec", {}))
        except gr.SpecError as exc:
            return _error(400, str(exc))
        return _json(await self.what_if.answer(fields, self.clock()))


def _refusal(status: int, reason: str) -> web.Response:
    """An authentication or authorisation refusal; a 429 says when to come back."""
    response = _error(status, reason)
    if status == 429:
        digits = "".join(c for c in reason.rpartition("retry in ")[2] if c.isdigit())
        response.headers["Retry-After"] = digits or "1"
    return response


class RateLimiter:
    """A token bucket per caller key (the authenticated user, or the peer address without authentication)."""

    def __init__(self, rate: float = 10.0, burst: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.buckets: dict[str, tuple[float, float]] = {}

    def check(self, key: str) -> int:
        """0 when allowed, else the seconds to wait (for Retry-After)."""
        now = self.clock()
        tokens, at = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self.rate))
        if len(self.buckets) > 10_000:
            self.buckets.clear()
        self.buckets[key] = (tokens - 1.0, now)
        return 0
