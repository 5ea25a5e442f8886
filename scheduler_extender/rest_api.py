"""The REST API beside the extender (the design's API gateway): inventory, GPRs as custom resources, and a
wait-time estimate for a hypothetical GPR.

- ``GET  /api/v1/inventory``                     per node and per model: capacity, allocated, reserved, healthy
- ``GET  /api/v1/gprs[?namespace=ns]``           GPR objects
- ``POST /api/v1/gprs``                          ``{"namespace", "name", "spec"}`` -> created GPR object (201)
- ``GET|DELETE /api/v1/gprs/{namespace}/{name}``
- ``POST /api/v1/waittime``                      ``{"namespace", "spec"}`` -> estimated start, wait, queue position

Every call needs ``Authorization: Bearer <token>``: the token is checked with a TokenReview and the action with
a SubjectAccessReview (``auth.Authorizer``), so the API allows exactly what the caller's RBAC allows. Errors are
JSON ``{"error": ...}`` with the HTTP status of the cause (400 bad input, 401/403, 404, 409, 502 when the API
server fails).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from kubernetes_asyncio.client.exceptions import ApiException

from scheduler_extender import gpr_resource as gr
from scheduler_extender.auth import Authorizer
from scheduler_extender.cluster import HOLDING, ClusterView
from scheduler_extender.controller import GPRController, build_scheduler
from scheduler_extender.kube import Conflict, Kube, NotFound


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def inventory(view: ClusterView) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []
    models: dict[tuple[str, str], dict[str, Any]] = {}
    for node in sorted(view.nodes.values(), key=lambda n: n.name):
        for resource, capacity in sorted(node.allocatable.items()):
            if capacity <= 0:
                continue
            allocated = sum(e.requests.get(resource, 0) for e in node.ledger.values())
            reserved = sum(n for k, n in view.reservations_on(node.name).items()
                           if k in view.gprs and view.gprs[k].resource == resource)
            healthy = not node.health_reason(resource)
            model = node.labels.get("nvidia.com/gpu.product" if resource == "nvidia.com/gpu"
                                    else "accelstack.io/nr1.product", "unknown")
            nodes.append({"node": node.name, "resource": resource, "model": model, "capacity": capacity,
                          "allocated": allocated, "reserved": reserved, "healthy": healthy,
                          "reason": node.health_reason(resource)})
            agg = models.setdefault((resource, model), {"resource": resource, "model": model, "nodes": 0,
                                                         "capacity": 0, "allocated": 0, "reserved": 0,
                                                         "healthyCapacity": 0})
            agg["nodes"] += 1
            agg["capacity"] += capacity
            agg["allocated"] += allocated
            agg["reserved"] += reserved
            agg["healthyCapacity"] += capacity if healthy else 0
    return {"nodes": nodes, "models": list(models.values())}


GPR_ATTRS = {"group": gr.GROUP, "resource": gr.GPR_PLURAL}


class RestAPI:
    """The routes. With an ``authorizer`` every call needs a bearer token whose user RBAC allows the equivalent
    Kubernetes action; without one (tests of the routes alone) the API is open."""

    def __init__(self, kube: Kube, view: ClusterView, controller: GPRController | None = None,
                 clock: Callable[[], float] = time.time, authorizer: Authorizer | None = None) -> None:
        self.kube = kube
        self.view = view
        self.controller = controller
        self.clock = clock
        self.authorizer = authorizer

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/api/v1/inventory", self.get_inventory), web.get("/api/v1/gprs", self.list_gprs),
                web.post("/api/v1/gprs", self.create_gpr), web.get("/api/v1/gprs/{namespace}/{name}", self.get_gpr),
                web.delete("/api/v1/gprs/{namespace}/{name}", self.delete_gpr),
                web.post("/api/v1/waittime", self.waittime)]

    async def _denied(self, request: web.Request, verb: str, namespace: str = "",
                      attrs: dict[str, str] | None = None) -> web.Response | None:
        if self.authorizer is None:
            return None
        attributes = {"verb": verb, **(attrs or GPR_ATTRS), **({"namespace": namespace} if namespace else {})}
        status, reason = await self.authorizer.check(request.headers.get("Authorization"), attributes)
        return _error(status, reason) if status else None

    async def get_inventory(self, request: web.Request) -> web.Response:
        denied = await self._denied(request, "list", attrs={"group": "", "resource": "nodes"})
        return denied or _json(inventory(self.view))

    async def _call(self, coro: Any, created: bool = False) -> web.Response:
        try:
            return _json(await coro, 201 if created else 200)
        except NotFound as exc:
            return _error(404, str(exc) or "not found")
        except Conflict as exc:
            return _error(409, str(exc) or "conflict")
        except ApiException as exc:
            status = exc.status if exc.status in (400, 403, 422) else 502
            return _error(status, f"API server: {exc.status} {exc.reason}")

    async def list_gprs(self, request: web.Request) -> web.Response:
        namespace = request.query.get("namespace") or None
        denied = await self._denied(request, "list", namespace or "")
        if denied:
            return denied

        async def items() -> dict[str, Any]:
            return {"items": await self.kube.list_gprs(namespace)}

        return await self._call(items())

    async def get_gpr(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        return await self._denied(request, "get", namespace) or await self._call(self.kube.get_gpr(namespace, name))

    async def delete_gpr(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        denied = await self._denied(request, "delete", namespace)
        return denied or await self._call(self.kube.delete_gpr(namespace, name))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        return body

    async def create_gpr(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            namespace, name, spec = body.get("namespace"), body.get("name"), body.get("spec", {})
            if not isinstance(namespace, str) or not namespace or not isinstance(name, str) or not name:
                raise ValueError("namespace and name: required strings")
            obj = {"apiVersion": gr.API_VERSION, "kind": gr.GPR_KIND,
                   "metadata": {"name": name, "namespace": namespace}, "spec": spec}
            gr.from_object(obj, self.clock())  # validate before the API server sees it
        except (ValueError, gr.SpecError) as exc:
            return _error(400, str(exc))
        denied = await self._denied(request, "create", namespace)
        return denied or await self._call(self.kube.create_gpr(namespace, obj), created=True)

    async def waittime(self, request: web.Request) -> web.Response:
        now = self.clock()
        try:
            body = await self._body(request)
            namespace = body.get("namespace") or "default"
            obj = {"apiVersion": gr.API_VERSION, "kind": gr.GPR_KIND,
                   "metadata": {"name": "~hypothetical", "namespace": namespace}, "spec": body.get("spec", {})}
            g = gr.from_object(obj, now)
        except (ValueError, gr.SpecError) as exc:
            return _error(400, str(exc))
        denied = await self._denied(request, "list", namespace)  # the estimate reveals the namespace's queue
        if denied:
            return denied
        objects = self.controller.objects.values() if self.controller else []
        sched, _ = build_scheduler(self.view, list(objects), now,
                                   self.controller.policy if self.controller else "bestfit",
                                   self.controller.config if self.controller else None)
        g.submitted_at = now + 1e-6  # behind everything already queued at its priority
        sched.submit(g, now)
        order = [q.name for q in sched.queued()]
        position = order.index(g.name) + 1 if g.name in order else None
        start = sched.estimates(now).get(g.name, math.inf)
        fits_now = sched.policy.place(sched.inv, g.request()) is not None and position == 1
        if fits_now:
            start = now
        holding = sum(1 for v in self.view.gprs.values() if v.phase in HOLDING)
        return _json({"queuePosition": position, "estimatedStart": gr.rfc3339(start) if math.isfinite(start) else None,
                      "waitSeconds": round(start - now, 3) if math.isfinite(start) else None,
                      "estimable": math.isfinite(start), "admittedGPRs": holding})
