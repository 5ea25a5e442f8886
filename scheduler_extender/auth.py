"""Who may use the REST API: the caller's bearer token is checked with the API server (TokenReview), then the
action with Kubernetes RBAC (SubjectAccessReview), the way kube-rbac-proxy and aggregated API servers do it.

So the REST API grants nothing the caller could not do with ``kubectl``: creating a GPR through it needs
``create`` on ``gpuprovisioningrequests`` in that namespace, the inventory needs ``list`` on nodes. Decisions are
cached for a few seconds per (token, action) to keep API traffic down.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from scheduler_extender.kube import Kube


class Authorizer:
    def __init__(self, kube: Kube, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self._cache: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, int, str]] = {}
        self._users: dict[str, tuple[float, int, str, dict[str, Any]]] = {}  # token hash -> (at, status, why, user)

    async def _review(self, token: str) -> dict[str, Any]:
        return await self.kube.token_review(token)

    async def _access(self, user: dict[str, Any], attributes: dict[str, str]) -> dict[str, Any]:
        spec = {"user": user.get("username", ""), "uid": user.get("uid", ""), "groups": user.get("groups") or [],
                "extra": user.get("extra") or {}, "resourceAttributes": attributes}
        return await self.kube.access_review(spec)

    async def _user(self, authorization: str | None) -> tuple[int, str, dict[str, Any]]:
        """(0, username, user info) for a valid bearer token, else (401 or 503, reason, {})."""
        if not authorization or not authorization.startswith("Bearer ") or not authorization[7:].strip():
            return 401, "a bearer token is required (Authorization: Bearer <token>)", {}
        token_hash = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
        now = self.clock()
        cached = self._users.get(token_hash)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1], cached[2], cached[3]
        try:
            review = await self._review(authorization[7:].strip())
        except Exception as exc:  # the API server is away: refuse, and do not cache the refusal
            return 503, f"cannot check the caller with the API server: {type(exc).__name__}", {}
        if not review.get("authenticated"):
            result: tuple[int, str, dict[str, Any]] = (
                401, "the token is not valid: " + str(review.get("error") or "not authenticated"), {})
        else:
            user = review.get("user") or {}
            result = (0, str(user.get("username", "")), user)
        if len(self._users) > 10_000:
            self._users.clear()
        self._users[token_hash] = (now, *result)
        return result

    async def authenticate(self, authorization: str | None) -> tuple[int, str]:
        """(0, username) for a valid bearer token, else (HTTP status, reason): 401 without a valid token, 503
        when the API server cannot answer. Callers that must read the request to learn the action (its
        namespace) authenticate first, then :meth:`check` once the action is known."""
        status, reason, _ = await self._user(authorization)
        return status, reason

    async def check(self, authorization: str | None, attributes: dict[str, str]) -> tuple[int, str]:
        """(0, username) when allowed, else (HTTP status, reason): 401 without a valid token, 403 when RBAC says
        no, 503 when the API server cannot answer."""
        status, reason, user = await self._user(authorization)
        if status:
            return status, reason
        assert authorization is not None
        key = (hashlib.sha256(authorization[7:].strip().encode()).hexdigest(), tuple(sorted(attributes.items())))
        now = self.clock()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1], cached[2]
        try:
            access = await self._access(user, attributes)
        except Exception as exc:  # the API server is away: refuse, and do not cache the refusal
            return 503, f"cannot check the caller with the API server: {type(exc).__name__}"
        if access.get("allowed"):
            result = (0, str(user.get("username", "")))
        else:
            what = f"{attributes.get('verb')} {attributes.get('resource')}"
            where = f" in namespace {attributes['namespace']}" if attributes.get("namespace") else ""
            result = (403, f"{user.get('username', '?')} may not {what}{where}"
                           + (f": {access['reason']}" if access.get("reason") else ""))
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key] = (now, *result)
        return result
