"""The REST API's read views as the hub serves them (issue 40.4, docs/multicluster.md "One view"): inventory,
queue and usage over every member, each row naming its cluster, ``?cluster=NAME`` for one member (a name no member
joined with: 404), and the portal.

- ``GET /api/v1/inventory[?cluster=]``                     cells of (cluster, resource, model), each member's Ready/Lost
- ``GET /api/v1/queue[?cluster=&namespace=&phase=&limit=]`` the hub's GPRs, placed or not, with their cluster
- ``GET /api/v1/usage[?cluster=&workspace=]``              workspaces' usage per member
- ``GET /api/v1/whoami``                                   the caller and which of these its RBAC allows

The answers come from the hub process's own caches (a :class:`HubSource`, which ``accelstack-hub`` makes from
:mod:`scheduler_extender.multicluster.view`); this module knows nothing of members (the API layer does not import
the multicluster one: the source is handed in). Authentication is the extender's REST API's
(:class:`~.auth.Authorizer`: TokenReview, then a SubjectAccessReview on the hub's API server for the matching
Kubernetes action — ``list clusters.accelstack.io``, ``list gpuprovisioningrequests`` (in ``namespace=`` when
given), ``list workspaces.accelstack.io`` — before anything else is done; failed authentications limited per
address) and every authenticated caller is rate-limited (:class:`~.app.RateLimiter`, 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web

from kubeapi.resources import WORKSPACES
from scheduler_extender.api.app import RateLimiter, _refusal
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.http import error, json_response, query_int
from scheduler_extender.api.portal import portal_routes
from scheduler_extender.objects import gpr_codec as gr

CLUSTER_ATTRS = {"group": gr.GROUP, "resource": "clusters"}
GPR_ATTRS = {"group": gr.GROUP, "resource": gr.GPR_PLURAL}
WORKSPACE_ATTRS = {"group": WORKSPACES.group, "resource": WORKSPACES.plural}
UNFINISHED = ("Queued", "Admitted", "Running", "Evicting")
PHASES = tuple(p.value for p in gr.Phase)
# whoami's abilities, named as the portal's navigation names them
ABILITIES = {"inventory": CLUSTER_ATTRS, "queue": GPR_ATTRS, "usage": WORKSPACE_ATTRS}


def limited(answer: dict[str, Any], limit: int) -> dict[str, Any]:
    """The first ``limit`` rows; ``total`` and ``counts`` still count every row."""
    return {**answer, "items": answer["items"][:limit]}


class HubSource(Protocol):
    """The views over the hub's caches; a ``LookupError`` names a cluster no member joined with."""

    def inventory(self, cluster: str) -> dict[str, Any]: ...

    def queue(self, cluster: str, namespace: str, phases: tuple[str, ...]) -> dict[str, Any]: ...

    def usage(self, cluster: str, workspace: str) -> dict[str, Any]: ...


class HubAPI:
    def __init__(self, source: HubSource, authorizer: Authorizer | None,
                 limiter: RateLimiter | None = None, portal: bool = True) -> None:
        self.source, self.authorizer, self.portal = source, authorizer, portal
        self.limiter = limiter or RateLimiter()

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/api/v1/inventory", self.inventory), web.get("/api/v1/queue", self.queue),
                web.get("/api/v1/usage", self.usage), web.get("/api/v1/whoami", self.whoami),
                *(portal_routes() if self.portal else [])]

    async def _refused(self, request: web.Request, attrs: dict[str, str], namespace: str = "") -> web.Response | None:
        """401/403/429/503 before anything is read or computed for the caller; None when it may go on."""
        key = f"address:{request.remote}"
        if self.authorizer is not None:
            attributes = {"verb": "list", **attrs, **({"namespace": namespace} if namespace else {})}
            status, who = await self.authorizer.check(request.headers.get("Authorization"), attributes,
                                                      client=request.remote or "")
            if status:
                return _refusal(status, who)
            key = f"user:{who}"
        wait = self.limiter.check(key)
        return _refusal(429, f"too many requests; retry in {wait}s") if wait else None

    @staticmethod
    def _answer(compute: Any) -> web.Response:
        try:
            return json_response(compute())
        except LookupError as exc:  # a cluster no member joined with
            return error(404, str(exc.args[0]) if exc.args else "no such cluster")
        except ValueError as exc:
            return error(400, str(exc))

    async def inventory(self, request: web.Request) -> web.Response:
        refused = await self._refused(request, CLUSTER_ATTRS)
        return refused or self._answer(lambda: self.source.inventory(request.query.get("cluster", "")))

    async def queue(self, request: web.Request) -> web.Response:
        namespace = request.query.get("namespace", "")
        refused = await self._refused(request, GPR_ATTRS, namespace)
        if refused:
            return refused
        unsupported = next((k for k in ("workspace", "resource", "continue") if request.query.get(k)), "")
        if unsupported:  # said, not silently ignored: a hub's queue filters by cluster, namespace and phase
            return error(400, f"{unsupported}: not a filter of the hub's queue (cluster, namespace, phase, limit)")
        try:
            limit = query_int(request.query, "limit", 1000, 1, 10_000)
        except ValueError as exc:
            return error(400, str(exc))
        raw = request.query.get("phase", "")
        phases = PHASES if raw == "all" else tuple(p for p in raw.split(",") if p) or UNFINISHED
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            return error(400, f"phase: unknown {unknown[0][:40]!r} (one of {', '.join(PHASES)}, or all)")
        return self._answer(lambda: limited(self.source.queue(request.query.get("cluster", ""), namespace, phases),
                                            limit))

    async def usage(self, request: web.Request) -> web.Response:
        refused = await self._refused(request, WORKSPACE_ATTRS)
        return refused or self._answer(lambda: self.source.usage(request.query.get("cluster", ""),
                                                                 request.query.get("workspace", "")))

    async def whoami(self, request: web.Request) -> web.Response:
        """The caller and which hub views its RBAC allows; ``hub: true`` tells the portal to group by cluster."""
        user, allowed = "", {name: True for name in ABILITIES}
        if self.authorizer is not None:
            authorization = request.headers.get("Authorization")
            status, user = await self.authorizer.authenticate(authorization, client=request.remote or "")
            if status:
                return _refusal(status, user)
            checks = await asyncio.gather(*(self.authorizer.check(authorization, {"verb": "list", **attrs})
                                            for attrs in ABILITIES.values()))
            allowed = {name: status == 0 for name, (status, _) in zip(ABILITIES, checks, strict=True)}
        return json_response({"user": user, "namespace": "", "hub": True, "allowed": allowed})
