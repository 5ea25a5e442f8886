"""The gateway's view of the cluster: informers on InferenceEndpoints, the operator's EndpointSlices and API-key
Secrets (``kubeapi``), folded into the route table by the same pure functions as the objects file.

Secrets are read only in the key namespaces (``--key-namespaces``; the shipped manifest: accelstack-system) and
only those labelled ``accelstack.io/api-key=true`` (the selector goes to the API server, so no other Secret ever
reaches the process): RBAC cannot limit a list or watch to a label, so it is the namespace list that lets the
gateway's account hold Secrets rights in those namespaces only, not cluster-wide (issue 36.7).

Events are coalesced: a burst of slice updates (a rollout) rebuilds the table once, ``debounce`` seconds after
the first. The gateway is ready once every informer has listed; while one cannot list, the routes in force stay
(an error is never taken for an empty list).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from inference.access import Caller, caller_from_user, digest
from inference.gateway.server import Gateway
from inference.gateway.sources import apply_objects
from inference.names import LABEL_API_KEY, LABEL_ENDPOINT
from inference.resources import ENDPOINT_SLICES, INFERENCE_ENDPOINTS
from kubeapi.client import KubeClient, from_config
from kubeapi.errors import ApiError
from kubeapi.informer import Informer
from kubeapi.resources import SECRETS, TOKEN_REVIEWS, Resource

log = logging.getLogger("accelstack.gateway")
FIELD_MANAGER = "accelstack-gateway"


class Store:
    """The objects of one kind an informer has delivered, by namespace/name."""

    def __init__(self, on_change: Any) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.on_change = on_change

    @staticmethod
    def _key(obj: dict[str, Any]) -> tuple[str, str]:
        meta = obj.get("metadata") or {}
        return meta.get("namespace") or "", meta.get("name") or ""

    def sync(self, items: list[dict[str, Any]], namespace: str | None = None) -> None:
        self.objects = {k: v for k, v in self.objects.items() if namespace is not None and k[0] != namespace}
        for obj in items:
            self.objects[self._key(obj)] = obj
        self.on_change()

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self.objects.pop(self._key(obj), None)
        else:
            self.objects[self._key(obj)] = obj
        self.on_change()


class TokenReviewer:
    """Service-account tokens checked with the API server (TokenReview), the answers cached by the token's hash:
    a valid one for ``ttl`` seconds, an invalid one for ``negative_ttl`` (so a client retrying a bad token does not
    become a TokenReview per request). An API server that cannot answer means no caller (401), never a guess."""

    def __init__(self, kube: KubeClient, ttl: float = 60.0, negative_ttl: float = 10.0, size: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.ttl, self.negative_ttl, self.size, self.clock = kube, ttl, negative_ttl, size, clock
        self.cache: dict[str, tuple[float, Caller | None]] = {}
        self.reviews = 0

    async def __call__(self, token: str) -> Caller | None:
        key = digest(token)
        now = self.clock()
        hit = self.cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.reviews += 1
        try:
            answer = await self.kube.create(TOKEN_REVIEWS, {"apiVersion": "authentication.k8s.io/v1",
                                                            "kind": "TokenReview", "spec": {"token": token}})
        except ApiError as exc:
            log.warning("TokenReview failed; caller refused", extra={"error": str(exc)[:200]})
            return None
        status = answer.get("status") or {}
        caller = caller_from_user(status.get("user")) if status.get("authenticated") else None
        if len(self.cache) >= self.size:
            self.cache = {k: v for k, v in self.cache.items() if v[0] > now}
            if len(self.cache) >= self.size:
                self.cache.clear()
        self.cache[key] = (now + (self.ttl if caller else self.negative_ttl), caller)
        return caller


class KubeSource:
    def __init__(self, gateway: Gateway, kube: KubeClient, namespaces: Sequence[str] = (),
                 debounce: float = 0.05, key_namespaces: Sequence[str] = ()) -> None:
        self.gateway, self.kube, self.debounce = gateway, kube, debounce
        self.endpoints, self.slices, self.secrets = (Store(self._changed) for _ in range(3))
        self.informers: list[Informer] = []
        watched: list[str | None] = list(namespaces) or [None]
        kinds: list[tuple[Resource, Store, str, list[str | None]]] = [
            (INFERENCE_ENDPOINTS, self.endpoints, "", watched),
            (ENDPOINT_SLICES, self.slices, LABEL_ENDPOINT, watched),
            (SECRETS, self.secrets, f"{LABEL_API_KEY}=true", list(key_namespaces) or watched)]
        for resource, store, selector, where in kinds:
            for namespace in where:
                self.informers.append(Informer(
                    kube, resource, store.event, self._syncer(store, namespace),
                    name=f"gateway-{resource.plural}" + (f"-{namespace}" if namespace else ""), namespace=namespace,
                    label_selector=selector))
        self._dirty = asyncio.Event()
        self._stop = asyncio.Event()
        gateway.reviewer = TokenReviewer(kube)

    @staticmethod
    def _syncer(store: Store, namespace: str | None) -> Callable[[list[dict[str, Any]]], None]:
        return lambda items: store.sync(items, namespace)

    @classmethod
    async def connect(cls, gateway: Gateway, kubeconfig: str, namespaces: Sequence[str],
                      key_namespaces: Sequence[str] = ()) -> KubeSource:
        return cls(gateway, await from_config(kubeconfig, field_manager=FIELD_MANAGER), namespaces,
                   key_namespaces=key_namespaces)

    def _changed(self) -> None:
        self._dirty.set()

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers)

    def rebuild(self) -> None:
        apply_objects(self.gateway, self.endpoints.objects.values(), self.slices.objects.values(),
                      self.secrets.objects.values())

    async def run(self) -> None:
        tasks = [asyncio.create_task(i.run(self._stop), name=i.name) for i in self.informers]
        try:
            await asyncio.gather(*(i.synced.wait() for i in self.informers))
            self.rebuild()
            log.info("discovery synced", extra={"models": len(self.gateway.routes)})
            while True:
                await self._dirty.wait()
                await asyncio.sleep(self.debounce)
                self._dirty.clear()
                self.rebuild()
        finally:
            self._stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        self._stop.set()
        await self.kube.close()
