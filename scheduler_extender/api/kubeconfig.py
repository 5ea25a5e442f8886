"""A workspace kubeconfig for one member cluster, from the hub's REST API (issue 40.2; docs/multicluster.md,
"Workspace kubeconfigs"):

- ``POST /api/v1/workspaces/{workspace}/kubeconfig?cluster=NAME[&expiry=1h]``

The caller's bearer token is reviewed (TokenReview) before anything is read; the rule is then the hub Workspace's
own ``spec.access`` (not RBAC: a user listed there holds no hub rights), which the issuer handed in checks. The
answer is JSON: ``kubeconfig`` (text), ``workspace``, ``cluster``, ``namespace``, ``role``, ``serviceAccount``,
``expirySeconds``, with ``Cache-Control: no-store``; refusals are one line (400 a bad argument, 401, 403 not in
the access rules, 404 a member the workspace is not on or that has not joined, or that has no such workspace, 409
not Ready there, 429, 504 the member's agent did not answer in time). The issuer (which knows the members) is
handed in by ``accelstack-hub``: the API layer does not import the multicluster one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web

from kubeapi import ApiError
from scheduler_extender.api.app import RateLimiter, _refusal
from scheduler_extender.api.auth import Authorizer
from scheduler_extender.api.http import error, json_response


class Issuer(Protocol):
    async def issue(self, workspace: str, cluster: str, user: str, groups: Sequence[str], expiry: int
                    ) -> dict[str, Any]: ...


class KubeconfigAPI:
    def __init__(self, issuer: Issuer, authorizer: Authorizer | None, parse_expiry: Any,
                 refusal: type[Exception], limiter: RateLimiter | None = None) -> None:
        """``parse_expiry``: text -> seconds (ValueError with one line); ``refusal``: the issuer's exception
        type, with ``status`` and ``message``."""
        self.issuer, self.authorizer, self.parse_expiry, self.refusal = issuer, authorizer, parse_expiry, refusal
        self.limiter = limiter or RateLimiter()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/api/v1/workspaces/{workspace}/kubeconfig", self.kubeconfig)]

    async def kubeconfig(self, request: web.Request) -> web.Response:
        user: dict[str, Any] = {"username": "", "groups": []}
        key = f"address:{request.remote}"
        if self.authorizer is not None:
            status, reason, user = await self.authorizer.identify(request.headers.get("Authorization"),
                                                                  client=request.remote or "")
            if status:
                return _refusal(status, reason)
            key = f"user:{reason}"
        wait = self.limiter.check(key)
        if wait:
            return _refusal(429, f"too many requests; retry in {wait}s")
        cluster = request.query.get("cluster", "")
        if not cluster:
            return error(400, "cluster: required (the member cluster the kubeconfig is for)")
        try:
            expiry = self.parse_expiry(request.query.get("expiry", ""))
        except ValueError as exc:
            return error(400, str(exc))
        try:
            answer = await self.issuer.issue(request.match_info["workspace"], cluster, str(user.get("username", "")),
                                             [str(g) for g in user.get("groups") or ()], expiry)
        except self.refusal as exc:
            return error(int(getattr(exc, "status", 500)), str(getattr(exc, "message", exc)))
        except ApiError as exc:  # the hub's own API server refused or did not answer a step
            return error(502, f"the hub's API server: {str(exc).splitlines()[0][:200]}")
        response = json_response(answer)
        response.headers["Cache-Control"] = "no-store"
        return response
