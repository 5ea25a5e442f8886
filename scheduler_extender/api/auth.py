"""Who may use the REST API: the caller's bearer token is checked with the API server (TokenReview), then the
action with Kubernetes RBAC (SubjectAccessReview), the way kube-rbac-proxy and aggregated API servers do it.

So the REST API grants nothing the caller could not do with ``kubectl``: creating a GPR through it needs
``create`` on ``gpuprovisioningrequests`` in that namespace, the inventory needs ``list`` on nodes. Decisions are
cached for a few seconds per (token, action) to keep API traffic down.

A token costs the API server a TokenReview at most once per ``ttl``: reviews are cached, the valid ones and the
refused ones alike (as the API server's own cached token authenticator does), keyed by the token's SHA-256, in a
bounded LRU (``max_entries``; the oldest go first). Unknown tokens are what an attacker can make without end, so
failed authentications are also limited per client address (a token bucket: ``fail_burst`` at once, then
``fail_rate`` a second): past it a caller gets 429 without a TokenReview being sent. A token already known to be
valid is never held back by that limit (many users behind one proxy keep working).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from scheduler_extender.objects.kube import Kube

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A mapping that keeps at most ``size`` entries, dropping the least recently set or read."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class Authorizer:
    def __init__(self, kube: Kube, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 4096, fail_rate: float = 1.0, fail_burst: int = 10) -> None:
        self.kube = kube
        self.ttl = ttl
        self.clock = clock
        self.fail_rate, self.fail_burst = fail_rate, fail_burst
        self._cache: LRU[tuple[str, tuple[tuple[str, str], ...]], tuple[float, int, str]] = LRU(max_entries)
        self._users: LRU[str, tuple[float, int, str, dict[str, Any]]] = LRU(max_entries)  # token hash -> review
        self._failures: LRU[str, tuple[float, float]] = LRU(max_entries)  # client -> (tokens left, at)
        self.reviews = 0  # TokenReviews sent

    def _failure_wait(self, client: str, spend: bool = False) -> int:
        """0 when ``client`` may fail another authentication now (spending one when ``spend``), else the seconds
        until it may (for Retry-After)."""
        now = self.clock()
        tokens, at = self._failures.get(client) or (float(self.fail_burst), now)
        tokens = min(float(self.fail_burst), tokens + (now - at) * self.fail_rate)
        if tokens < 1.0:
            self._failures[client] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self.fail_rate))
        self._failures[client] = (tokens - 1.0 if spend else tokens, now)
        return 0

    async def _review(self, token: str) -> dict[str, Any]:
        return await self.kube.token_review(token)

    async def _access(self, user: dict[str, Any], attributes: dict[str, str]) -> dict[str, Any]:
        spec = {"user": user.get("username", ""), "uid": user.get("uid", ""), "groups": user.get("groups") or [],
                "extra": user.get("extra") or {}, "resourceAttributes": attributes}
        return await self.kube.access_review(spec)

    async def _user(self, authorization: str | None, client: str = "") -> tuple[int, str, dict[str, Any]]:
        """(0, username, user info) for a valid bearer token, else (401, 429 or 503, reason, {})."""
        if not authorization or not authorization.startswith("Bearer ") or not authorization[7:].strip():
            return 401, "a bearer token is required (Authorization: Bearer <token>)", {}
        token_hash = hashlib.sha256(authorization[7:].strip().encode()).hexdigest()
        now = self.clock()
        cached = self._users.get(token_hash)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1], cached[2], cached[3]
        wait = self._failure_wait(client)
        if wait:
            return 429, f"too many failed authentications from this address; retry in {wait}s", {}
        try:
            self.reviews += 1
            review = await self._review(authorization[7:].strip())
        except Exception as exc:  # the API server is away: refuse, and do not cache the refusal
            return 503, f"cannot check the caller with the API server: {type(exc).__name__}", {}
        if not review.get("authenticated"):
            self._failure_wait(client, spend=True)
            result: tuple[int, str, dict[str, Any]] = (
                401, "the token is not valid: " + str(review.get("error") or "not authenticated")[:200], {})
        else:
            user = review.get("user") or {}
            result = (0, str(user.get("username", "")), user)
        self._users[token_hash] = (now, *result)
        return result

    async def authenticate(self, authorization: str | None, client: str = "") -> tuple[int, str]:
        """(0, username) for a valid bearer token, else (HTTP status, reason): 401 without a valid token, 503
        when the API server cannot answer. Callers that must read the request to learn the action (its
        namespace) authenticate first, then :meth:`check` once the action is known. ``client``: the caller's
        address, which failed authentications are limited by (429 past the limit); "" for callers that cannot say
        (they share one limit)."""
        status, reason, _ = await self._user(authorization, client)
        return status, reason

    async def identify(self, authorization: str | None, client: str = "") -> tuple[int, str, dict[str, Any]]:
        """As :meth:`authenticate`, with the TokenReview's user (username, uid, groups, extra) for callers whose
        rule is not RBAC (a hub Workspace's ``spec.access`` names users and groups): ``{}`` when refused."""
        return await self._user(authorization, client)

    async def check(self, authorization: str | None, attributes: dict[str, str],
                    client: str = "") -> tuple[int, str]:
        """(0, username) when allowed, else (HTTP status, reason): 401 without a valid token, 403 when RBAC says
        no, 429 after too many failed authentications from ``client``, 503 when the API server cannot answer."""
        status, reason, user = await self._user(authorization, client)
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
        self._cache[key] = (now, *result)
        return result
